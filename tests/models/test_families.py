"""Every model family users bring, through the user's own path, on 2 CPU ranks: a tiny random bf16 folder of each
(``helpers.families``: dense, and the mixtures of experts Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3), trained by
``gym fit`` from the shipped YAML of gym_ddp, gym_fsdp and zero3, full and LoRA, 2 steps in bf16-mixed.

For each run: the sharded load gives the folder's logits before the first step (each rank read only its slices,
through transformers' conversion of per-expert checkpoint tensors into fused expert tensors); the end-of-fit export
has the folder's keys and layout (per-expert tensors again) and, reloaded in plain transformers, gives the trained
model's logits; for the MoE families ``gym export`` of the run's checkpoint writes the same folder.

One launch per strategy runs its trainings in the same ranks (``helpers.fit_worker``): every family full and
LoRA where adapters meet something new (``matrix``); ``GYM_FULL_FAMILY_MATRIX=1`` runs all 66.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.cli_runs import fit_in_one_launch, tensors_of
from helpers.families import FAMILIES, MOE_FAMILIES, family_run_config, make_family_folder, reloaded_logits

from gym_lightning.cli import main

pytestmark = pytest.mark.slow
STRATEGIES = ("gym_ddp", "gym_fsdp", "zero3")
# The strategies whose loading is gym_lightning's (each rank reads its slices) run every family; gym_ddp loads with
# from_pretrained on every rank, so there the dense reference and the MoE families (the export's layout) suffice.
SHARDED = ("gym_fsdp", "zero3")
# LoRA on families whose adapters meet something new: a fused qkv (Phi-3), tied embeddings (Gemma-3), the MoE
# families (DeepSeek-V3's latent attention); Qwen2/Qwen3/Mistral/OLMo-2 adapt the q_proj/v_proj Llama does.
# GYM_FULL_FAMILY_MATRIX=1 runs every family with LoRA under every strategy (the figures of docs/benchmarks.md).
LORA_FAMILIES = ("llama", "phi3", "gemma3_text", *MOE_FAMILIES)
FULL_MATRIX = os.environ.get("GYM_FULL_FAMILY_MATRIX") == "1"
FROM_CHECKPOINT = (("qwen3_moe", 0), ("deepseek_v3", 0))  # also exported by `gym export` of the run's checkpoint
# The run's logits against the reloaded folder's, weights held in the same dtype: bf16 logits of about 1 differ in
# the last bits where a reduction runs in another order (measured: at most 0.0078 = 2 bf16 steps of [0.5, 1)); the
# bf16 merge of LoRA into the base adds one more rounding. fp32 runs (gym_ddp's fp32 master weights) agree to 1e-6.
TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 2**-6}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_folder(family, root / family) for family in FAMILIES}


def matrix(strategy: str) -> list[tuple[str, int]]:
    """The (family, LoRA) runs of ``strategy`` in this test run."""
    families = FAMILIES if strategy in SHARDED or FULL_MATRIX else ("llama", *MOE_FAMILIES)
    return [(f, lora) for f in families for lora in (0, 1) if not lora or FULL_MATRIX or f in LORA_FAMILIES]


def _problems(family: str, run: Path, folder: Path) -> list[str]:
    probe = torch.load(run / "logits.pt", weights_only=True)
    tolerance, problems = TOLERANCE[probe["dtype"]], []
    for moment, source in (("start", folder), ("end", run / "hf")):
        gap = float((reloaded_logits(source, probe["dtype"]) - probe[moment]).abs().max())
        if gap > tolerance:
            problems.append(f"{family} {run.name}: {moment} logits differ from {source.name} by {gap:.4g}")
    written, exported = tensors_of(folder), tensors_of(run / "hf")
    if written.keys() != exported.keys() or any(exported[k].shape != v.shape for k, v in written.items()):
        problems.append(f"{family} {run.name}: the export's keys or shapes are not the checkpoint layout")
    return problems


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_family_trains_loads_and_exports(strategy: str, folders: dict[str, Path], tmp_path: Path) -> None:
    runs = {(f, lora): tmp_path / f"{f}-{'lora' if lora else 'full'}" for f, lora in matrix(strategy)}
    fit_in_one_launch([
        family_run_config(f, strategy, bool(lora), folders[f], out, checkpoints=(f, lora) in FROM_CHECKPOINT)
        for (f, lora), out in runs.items()
    ])  # fmt: skip
    problems = [line for (family, _), run in runs.items() for line in _problems(family, run, folders[family])]
    for family, lora in FROM_CHECKPOINT:
        run = runs[family, lora]
        args = ["--checkpoint", str(run / "checkpoints"), "--output_dir", str(run / "gym-export"), "--dtype", "float32"]
        main(["export", *args])
        ours, live = tensors_of(run / "gym-export"), tensors_of(run / "hf")
        # The checkpoint holds the fp32 master weights; under ZeRO-3 the live model (so the end-of-fit export) holds
        # DeepSpeed's bf16 module weights, which are those masters rounded to bf16.
        held = torch.bfloat16 if strategy == "zero3" else torch.float32
        if ours.keys() != live.keys() or any(not torch.equal(ours[k].to(held), live[k].to(held)) for k in live):
            problems.append(f"{family} {strategy}: gym export of the checkpoint differs from the end-of-fit export")
    assert not problems, "\n".join(problems)
