"""Random-weight Hugging Face model folders, as a user has a downloaded checkpoint: the benchmark sizes (``SIZES``:
250M to 1B parameters, a 0.4B mixture of experts, a narrow model for long sequences, an untied one for FSDP's
vocabulary units) saved as sharded bf16 safetensors once under a work folder, and tiny folders of every model family
(``make_family_folder``: hidden 64, 2 layers, several files) that the tests and the host-sync census train. Each has
the shipped tokenizer beside it.

    python -m benchmarks.common.models 250m /tmp/gym-scale    # builds /tmp/gym-scale/models/llama-250m (once)

A benchmark-size folder is built in a process of its own (``ensure_folder``): the model it holds while saving would
otherwise stay in the measuring process's peak.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.common.launch import child_env, python_module
from benchmarks.common.paths import REPO_ROOT

# Llama shapes (tied embeddings, 32,000 vocabulary). 1B: TinyLlama's width with 20 layers (GQA 32/4 heads): 0.95B.
# moe-400m: a Qwen3-MoE (Qwen3-30B-A3B's structure: every layer sparse, 8 of 128 experts) scaled down to 16 experts,
# top-2, 8 layers: 0.40B parameters, saved as transformers saves it (one tensor per expert), loaded into fused expert
# tensors.
SIZES: dict[str, dict[str, Any]] = {
    "250m": {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000, "tie_word_embeddings": True},
    "1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 20,
           "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": True},
    "moe-400m": {"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
                 "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 768, "vocab_size": 32000,
                 "tie_word_embeddings": False},
    # long_sequence_peak.py: narrow enough that a 4,096-token fp32 step runs in about a minute on 2 CPU ranks, wide
    # enough (8 query / 4 key-value heads) to split over 2 ranks.
    "long-44m": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
                 "tie_word_embeddings": True, "max_position_embeddings": 32768},
    # gym_fsdp's vocabulary units (strategies.fsdp.vocabulary_units): an untied 32,000 x 1,024 embedding and LM head,
    # 125 MiB each in fp32, beside 14 layers of 49 MiB; 245M parameters. Run with --precision 32-true.
    "246m-untied": {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 14,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
                    "tie_word_embeddings": False},
}  # fmt: skip
SHARD_SIZE = "500MB"
SHARD_SIZES = {"246m-untied": "200MB"}  # the checkpoint file the load reads at once (default SHARD_SIZE)


def write_random_folder(folder: Path, fields: dict[str, Any], max_shard_size: str = SHARD_SIZE) -> Any:
    """A seeded random-init model of ``fields`` (``model_type`` and its config's fields) saved to ``folder`` as
    sharded bf16 safetensors with the shipped tokenizer, atomically (written beside, then renamed); returns the
    model (in bf16, as saved)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gym_lightning.tokenizer import load_tokenizer

    torch.manual_seed(0)
    # from_config builds on the meta device and materialises the parameters already in bf16 (no fp32 copy).
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=max_shard_size)
    load_tokenizer(None).save_pretrained(partial)
    partial.rename(folder)
    print(f"wrote {folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    return model


def folder_of(workdir: Path, size: str) -> Path:
    """Where the model folder of ``size`` is kept (``llama-250m``, ``qwen3_moe-moe-400m``)."""
    return workdir / "models" / f"{SIZES[size]['model_type']}-{size}"


def ensure_folder(workdir: Path, size: str, *trees: Path) -> Path:
    """The folder of ``size`` under ``workdir``, built first (in a child process, with ``trees``' gym_lightning
    first on its path: the default is this repository's) when it is not there."""
    folder = folder_of(workdir, size)
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        command = python_module("benchmarks.common.models", size, workdir)
        subprocess.run(command, check=True, cwd=REPO_ROOT, env=child_env(*trees, threads=None))
    return folder


# ------------------------------------------------------------------------------------------------ tiny families
TOKENIZER = REPO_ROOT / "gym_lightning" / "assets" / "tokenizer"
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
# What each family needs beyond COMMON to be itself at this size (expert counts, MLA ranks, ...).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "gemma3_text": {"sliding_window": 32, "tie_word_embeddings": True},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # DeepseekV3Config sets head_dim = qk_rope_head_dim; the rotary embedding is that wide
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
}
# Families without q_proj / v_proj: fused attention (Phi-3), multi-head latent attention (DeepSeek-V3).
LORA_TARGETS = {"phi3": ["qkv_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"]}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def family_config(family: str, **overrides: Any) -> Any:
    """The tiny config of ``family`` (vocabulary: the shipped tokenizer's)."""
    from transformers import AutoConfig, AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER))
    return AutoConfig.for_model(family, vocab_size=vocab, **{**COMMON, **FAMILIES[family], **overrides})


def make_family_folder(family: str, folder: Path, seed: int = 0, max_shard_size: str = "200KB") -> Path:
    """A tiny random bf16 ``family`` model saved (several safetensors files) with the shipped tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the random-weight folder of one benchmark size.")
    parser.add_argument("size", choices=list(SIZES))
    parser.add_argument("workdir", type=Path, help="the folder is written to WORKDIR/models/<type>-<size>")
    args = parser.parse_args()
    folder = folder_of(args.workdir, args.size)
    folder.parent.mkdir(parents=True, exist_ok=True)
    write_random_folder(folder, SIZES[args.size], SHARD_SIZES.get(args.size, SHARD_SIZE))


if __name__ == "__main__":
    main()
