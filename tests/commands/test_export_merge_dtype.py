"""A merged LoRA export is computed in the export dtype: ``--lora merged --dtype float32`` of a run on a bf16 folder
gives the logits of the PEFT adapter applied to that folder (fp32, within 1e-5), under every strategy.

Under mixed precision a LoRA run keeps its frozen base weights in the folder's bf16 and trains fp32 adapters; the
merge ``W + scale * B @ A`` used to be rounded back to bf16 (the base weight's dtype) before the float32 export
wrote it, so the merged folder disagreed with the adapter on the same base by bf16's rounding of the sum (1.7e-4 in
logits on gym_fsdp). One process shows the merge itself; one 2-rank launch shows each strategy's checkpoint format
(a DDP file, an FSDP distributed checkpoint, ZeRO-3's partitions and frozen fragments) through ``gym export``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli_runs import fit_in_one_launch
from helpers.families import PROBE_IDS, family_run_config, make_family_folder
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from gym_lightning.cli import main
from gym_lightning.hf_folder import live_source, write_export

SAME = 1e-5  # fp32 logits of the same weights, added in another order (merged, or base + adapter)


def _logits(folder: Path, adapter: Path | None = None) -> torch.Tensor:
    """``folder`` loaded in fp32 by plain transformers, with the PEFT ``adapter`` on it if given."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(input_ids=PROBE_IDS, use_cache=False).logits.float()


def test_merged_float32_export_of_a_bf16_base_equals_the_adapter_on_that_base(tmp_path: Path) -> None:
    folder = make_family_folder("llama", tmp_path / "llama")
    base = AutoModelForCausalLM.from_pretrained(folder)  # bf16, as a mixed-precision LoRA run holds its base
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_" in name:  # trained fp32 adapters (a fresh lora_B is zero: nothing to merge)
            param.data = torch.randn_like(param, dtype=torch.float32) * 0.05
    source = live_source(None, model, None)
    assert source.tensors["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == torch.bfloat16
    write_export(source, tmp_path / "merged", lora="merged", dtype="float32")
    write_export(source, tmp_path / "adapter", lora="adapter")
    on_source = _logits(folder, tmp_path / "adapter")
    assert (on_source - _logits(folder)).abs().max() > 1e-3, "the adapters change nothing the merge could round"
    torch.testing.assert_close(_logits(tmp_path / "merged"), on_source, rtol=0, atol=SAME)


@pytest.mark.slow
def test_gym_export_merged_float32_equals_the_adapter_on_the_source_folder_for_every_strategy(tmp_path: Path) -> None:
    """gym_ddp, gym_fsdp and zero3 LoRA runs on a bf16 folder (``bf16-mixed``, 2 CPU ranks, one launch): ``gym
    export --lora merged --dtype float32`` of each checkpoint and ``--lora adapter`` of the same checkpoint on the
    source folder give the same logits."""
    folder = make_family_folder("llama", tmp_path / "llama")
    runs = {strategy: tmp_path / strategy for strategy in ("gym_ddp", "gym_fsdp", "zero3")}
    fit_in_one_launch(
        [family_run_config("llama", s, True, folder, out, **{"model.lr": 3e-2}) for s, out in runs.items()]
    )
    for strategy, out in runs.items():
        exported = {}
        for kind in ("merged", "adapter"):
            exported[kind] = out / f"gym-{kind}"
            args = ["--checkpoint", str(out / "checkpoints"), "--output_dir", str(exported[kind]), "--lora", kind]
            main(["export", *args, "--dtype", "float32"])
        on_source = _logits(folder, exported["adapter"])
        assert (on_source - _logits(folder)).abs().max() > 1e-3, f"{strategy}: the adapters did not train"
        merged = _logits(exported["merged"])
        torch.testing.assert_close(merged, on_source, rtol=0, atol=SAME, msg=lambda m, s=strategy: f"{s}: {m}")
