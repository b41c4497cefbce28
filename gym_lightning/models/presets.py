"""Built-in tiny model presets: real ``transformers`` architectures at a size that trains in seconds on a CPU.

They use the tokenizer shipped with the package, so tests, the quickstart and CI need nothing from a model hub.
Shapes are chosen so that a preset learns the bundled ``addition`` task on a 2-core CPU in about a minute
(a few hundred thousand parameters; ``tests/test_hf_folder.py`` pins the exact counts).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from gym_lightning.errors import GymUserError
from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer

_SHARED_SHAPE = {
    # Wide and shallow learns the addition task fastest per CPU second (docs/benchmarks-history.md, "The presets'
    # shape").
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def _tiny_llama(vocab_size: int, special_ids: dict[str, int | None]) -> PretrainedConfig:
    return LlamaConfig(vocab_size=vocab_size, rms_norm_eps=1e-5, **_SHARED_SHAPE, **special_ids)


def _tiny_qwen3(vocab_size: int, special_ids: dict[str, int | None]) -> PretrainedConfig:
    return Qwen3Config(vocab_size=vocab_size, head_dim=32, rms_norm_eps=1e-6, **_SHARED_SHAPE, **special_ids)


PRESETS: dict[str, Callable[[int, dict[str, int | None]], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-qwen3": _tiny_qwen3,
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str) -> PretrainedConfig:
    """The ``transformers`` config of preset ``name``, sized to the shipped tokenizer."""
    if name not in PRESETS:
        raise GymUserError(f"Unknown preset {name!r}; the built-in presets are: {', '.join(sorted(PRESETS))}.")
    tokenizer = load_tokenizer(str(SHIPPED_TOKENIZER_DIR))
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return PRESETS[name](len(tokenizer), special_ids)


def resolve_tokenizer_source(model: str, tokenizer: str | None) -> str | None:
    """The tokenizer of a run: an explicit one, else the model's own (presets use the shipped one, ``None``)."""
    if tokenizer is not None:
        return tokenizer
    return None if is_preset(model) else model
