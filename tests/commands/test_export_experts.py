"""Export of LoRA on the experts of a mixture of experts (``lora.target_parameters: [all-experts]``), merged and as a
PEFT adapter, from the end-of-fit ``HFExport`` and from ``gym export`` of the run's checkpoint, for every bundled MoE
family: Qwen3-MoE, Mixtral, gpt-oss (experts stored ``[in, out]``, with biases) and DeepSeek-V3 (shared experts,
adapted by parameter).

The merged folder is a plain transformers model in the per-expert checkpoint layout the family's folder has, and
reloads to the trained model's logits (gym's routed forward, fp32, 1e-5); the adapter folder holds the tensors
``PeftModel.save_pretrained`` of the same live model writes, under the same names, and
``PeftModel.from_pretrained(original base, adapter)`` (peft's own ``ParamWrapper`` forward) gives those logits too.
One process shows each family (and NF4 experts, QLoRA, dequantised then merged); one 2-rank launch shows the
checkpoint formats of ZeRO-3 (parameters re-assembled from partitions) and gym_fsdp (a distributed checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.cli_runs import fit_in_one_launch, tensors_of
from helpers.families import LORA_TARGETS, MOE_FAMILIES, PROBE_IDS, family_run_config, make_family_folder
from peft import PeftModel
from safetensors.torch import load_file
from test_export import assert_same_export
from transformers import AutoModelForCausalLM

from gym_lightning import CausalLMDataModule, CausalLMModule, HFExport
from gym_lightning.cli import main
from gym_lightning.errors import GymUserError
from gym_lightning.hf_folder import ExportSource, hf_tensors, live_source
from gym_lightning.lora import EXPERTS_SHORTHAND

SAME = 1e-5  # fp32 logits of the same weights, summed in another order (routed per expert vs transformers' own)


def _lora(family: str) -> dict[str, object]:
    """Attention and every expert (routed and shared) adapted; dropout, which the adapter config must drop."""
    attention = LORA_TARGETS.get(family, ["q_proj"])
    return {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": attention, "target_parameters": [EXPERTS_SHORTHAND]}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE_IDS, use_cache=False).logits.float()


def _reloaded(folder: Path, adapter: Path | None = None) -> torch.Tensor:
    """``folder`` in plain transformers (fp32), with the PEFT ``adapter`` on it if given."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return _logits(PeftModel.from_pretrained(model, adapter) if adapter is not None else model)


def _gym_export(checkpoint: Path, out: Path, lora: str) -> Path:
    main(["export", "--checkpoint", str(checkpoint), "--output_dir", str(out), "--lora", lora, "--dtype", "float32"])
    return out


def _fit(folder: Path, root: Path, family: str, **settings: object) -> CausalLMModule:
    """3 fp32 steps with expert LoRA in one process, the merged and the adapter export at the end, a checkpoint;
    ``settings``: more of ``CausalLMModule``'s (``lora`` replaces :func:`_lora`'s)."""
    settings = {"lora": _lora(family), **settings}
    module = CausalLMModule(str(folder), tokenizer=str(folder), torch_dtype="float32", lr=3e-2, **settings)
    exports = [
        HFExport(output_dir=str(root / "hf"), dtype="float32"),
        HFExport(output_dir=str(root / "hf-adapter"), lora="adapter"),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=exports,
    )  # fmt: skip
    trainer.fit(module, CausalLMDataModule(dataset="addition", batch_size=4, max_seq_length=32))
    trainer.save_checkpoint(root / "last.ckpt")
    return module


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_adapters_export_merged_and_as_peft_files_live_and_from_a_checkpoint(
    family: str, tmp_path: Path
) -> None:
    folder = make_family_folder(family, tmp_path / family)
    module = _fit(folder, tmp_path, family)
    trained = _logits(module.model)
    expert_b = [p for n, p in module.model.named_parameters() if "experts.lora_B" in n]
    assert expert_b and all(p.abs().max() > 0 for p in expert_b), "the expert adapters did not train"
    assert (trained - _reloaded(folder)).abs().max() > 1e-3, "the adapters changed nothing the export could lose"

    merged, adapter = tmp_path / "hf", tmp_path / "hf-adapter"
    # merged: a plain transformers folder in the family's per-expert checkpoint layout, with the trained logits
    written, exported = tensors_of(folder), tensors_of(merged)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in written.items()}
    torch.testing.assert_close(_reloaded(merged), trained, rtol=0, atol=SAME)
    # adapter: what peft itself saves of the same model, loading on the original base with the trained logits
    module.model.save_pretrained(tmp_path / "peft")
    peft_own, ours = load_file(tmp_path / "peft" / "adapter_model.safetensors"), tensors_of(adapter)
    assert ours.keys() == peft_own.keys() and any(".experts.base_layer.lora_A." in k for k in ours)
    assert all(torch.equal(ours[k], v) for k, v in peft_own.items())
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.0 and "experts.gate_up_proj" in config["target_parameters"]
    torch.testing.assert_close(_reloaded(folder, adapter), trained, rtol=0, atol=SAME)
    # gym export of the checkpoint writes the same two folders
    for kind, live in (("merged", merged), ("adapter", adapter)):
        assert_same_export(_gym_export(tmp_path / "last.ckpt", tmp_path / f"gym-{kind}", kind), live)


def test_an_expert_adapter_without_its_wrapper_is_refused_not_dropped(tmp_path: Path) -> None:
    folder = make_family_folder("qwen3_moe", tmp_path / "qwen3_moe")
    module = CausalLMModule(str(folder), tokenizer=str(folder), torch_dtype="float32", lora=_lora("qwen3_moe"))
    module.configure_model()
    source = live_source(None, module.model, None)
    assert {a.parameter for a in source.parameter_adapters.values()} >= {"gate_up_proj", "down_proj"}
    hf_tensors(source, "merged")  # knows which weight each pair adapts
    blind = ExportSource(source.tensors, source.base, source.lora_config, source.lora_scaling, None)
    with pytest.raises(GymUserError, match=r"Cannot merge the LoRA adapters of .*mlp\.experts.*parameter_adapters"):
        hf_tensors(blind, "merged")


def test_nf4_experts_are_dequantised_then_merged(tmp_path: Path) -> None:
    """QLoRA: the fused expert weights held in NF4 are written dequantised (fp32) with their adapters merged."""
    folder = make_family_folder("qwen3_moe", tmp_path / "qwen3_moe")
    module = _fit(folder, tmp_path, "qwen3_moe", quantization={"compute_dtype": "float32"})
    codes = [n for n, p in module.model.named_parameters() if n.endswith("experts.base_layer.base_layer.gate_up_proj")]
    assert codes and all(module.model.get_parameter(n).dtype == torch.uint8 for n in codes), "experts not in NF4"
    trained = _logits(module.model)
    torch.testing.assert_close(_reloaded(tmp_path / "hf"), trained, rtol=0, atol=SAME)
    assert_same_export(_gym_export(tmp_path / "last.ckpt", tmp_path / "gym-merged", "merged"), tmp_path / "hf")


@pytest.mark.slow
def test_sharded_checkpoints_of_expert_lora_export_as_the_live_run(tmp_path: Path) -> None:
    """2 ranks, DeepSeek-V3 (routed and shared experts) through ``gym fit``, under ZeRO-3 (adapters re-assembled
    from fp32 partitions, frozen experts from fragments) and gym_fsdp (a distributed checkpoint), in one launch:
    ``gym export`` of each checkpoint equals its end-of-fit exports, which reload to the trained logits."""
    folder = make_family_folder("deepseek_v3", tmp_path / "deepseek_v3")
    runs = {strategy: tmp_path / strategy for strategy in ("zero3", "gym_fsdp")}
    fp32 = {"trainer.precision": "32-true", "model.torch_dtype": "float32", "model.lr": 3e-2}
    lora = {f"model.lora.{key}": value for key, value in _lora("deepseek_v3").items()}
    fit_in_one_launch([family_run_config("deepseek_v3", s, True, folder, o, **fp32, **lora) for s, o in runs.items()])
    for strategy, out in runs.items():
        probe = torch.load(out / "logits.pt", weights_only=True)
        assert (probe["end"] - probe["start"]).abs().max() > 1e-3, f"{strategy}: the adapters did not train"
        experts_b = [v for k, v in tensors_of(out / "hf-adapter").items() if "experts.lora_B" in k]
        assert experts_b and all(v.abs().max() > 0 for v in experts_b), f"{strategy}: expert adapters untrained"
        torch.testing.assert_close(_reloaded(out / "hf"), probe["end"], rtol=0, atol=SAME)
        torch.testing.assert_close(_reloaded(folder, out / "hf-adapter"), probe["end"], rtol=0, atol=SAME)
        for kind, live in (("merged", out / "hf"), ("adapter", out / "hf-adapter")):
            assert_same_export(_gym_export(out / "checkpoints", out / f"gym-{kind}", kind), live)


def test_all_linear_on_deepseek_reloads_as_a_peft_adapter_where_it_trained(tmp_path: Path) -> None:
    # DeepSeek-V3's dense first MLP and shared experts are gate_proj/up_proj/down_proj: peft's loader would move
    # such module targets onto the routed experts, so gym names them by weight (lora.lora_config_for); all-experts'
    # shared-expert targets are the same layers, adapted once.
    folder = make_family_folder("deepseek_v3", tmp_path / "deepseek_v3")
    lora = {"r": 4, "alpha": 8, "target_modules": ["all-linear"], "target_parameters": [EXPERTS_SHORTHAND]}
    module = _fit(folder, tmp_path, "deepseek_v3", lora=lora)
    trained = _logits(module.model)
    adapted = {n.partition(".lora_A")[0] for n, _ in module.model.named_parameters() if ".lora_A." in n}
    assert any(n.endswith("layers.0.mlp.gate_proj") for n in adapted), "the dense MLP is adapted"
    assert any(n.endswith("shared_experts.down_proj") for n in adapted) and any("q_b_proj" in n for n in adapted)
    config = json.loads((tmp_path / "hf-adapter" / "adapter_config.json").read_text())
    assert "gate_proj.weight" in config["target_parameters"] and "gate_proj" not in config["target_modules"]
    torch.testing.assert_close(_reloaded(folder, tmp_path / "hf-adapter"), trained, rtol=0, atol=SAME)
    torch.testing.assert_close(_reloaded(tmp_path / "hf"), trained, rtol=0, atol=SAME)
