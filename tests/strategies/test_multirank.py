"""Strategies on 2 real CPU ranks over gloo, compared with a single process that sees the same global batch.

Each worker run (tests/helpers/strategy_worker.py) starts the process group once and runs several ``Trainer.fit``
phases in the same two processes, so one ~20-60 s launch serves many assertions.

Tolerance. Everything runs in fp32 with the module's torch AdamW. A rank-split batch sums gradients in a different
order than the single process (two half-batch sums added by the all-reduce instead of one full-batch sum), so
gradients differ by a few ulps (fp32 epsilon 1.2e-7). Adam divides by sqrt(v), which can magnify those ulps for
near-zero gradient entries, and the difference compounds over steps; over the <= 8 optimizer steps here that stays
below 1e-5 relative on losses and 5e-5 absolute on weights of magnitude ~0.1-1 (observed: 0 for DDP/FSDP/ZeRO-1/2,
~1e-7 for ZeRO-3, which gathers and re-partitions parameters). A bug in normalisation (double division by the
accumulation count, a missing world-size factor, unsynchronised gradients) changes losses by >= 1e-2, far above.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.dist import run_worker, run_worker_two_nodes
from helpers.strategy_worker import run_phase, save_tiny_pretrained

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
WEIGHT_ATOL = 5e-5

pytestmark = pytest.mark.slow


def _nvme_offload_buildable() -> bool:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


NVME = _nvme_offload_buildable()
MLP_STRATEGIES = ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
MLP_STRATEGIES += ["zero_infinity"] if NVME else []
FSDP_NO_SHARD = {"class": "GymFSDPStrategy", "kwargs": {"sharding": "none"}}
FSDP_HYBRID = {"class": "GymFSDPStrategy", "kwargs": {"sharding": "hybrid"}}
CPU_ADAM = {"class": "ZeROStrategy", "kwargs": {"stage": 2, "offload_optimizer": "cpu", "cpu_optimizer": "deepspeed"}}
COMPRESSIONS = ["fp16", "bf16", "powersgd"]
ACCUMULATION_STRATEGIES = ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3"]
SGD_ACCUMULATION = {"max_epochs": 2, "optimizer": "sgd", "accumulate": 2, "dataset_size": 24}
# The control run switches gym_lightning's ZeRO-3 trace fix off, to show the test below can fail.
ZERO3_METRIC_CONTROL = {"name": "zero3_metric_without_fix", "zero3_trace_fix": False}
SHARDED = {"gym_fsdp", "zero3", "zero3_offload", "zero_infinity", "fsdp_grad_op", "fsdp_ac"}
SHARDED |= {"fsdp_chunked_loss", "zero3_chunked_loss"}


def _compression_phase(compression: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"gradient_compression": compression}
    if compression == "powersgd":
        kwargs["powersgd_start_iter"] = 2
    return {"name": f"ddp_{compression}", "max_epochs": 1, "strategy": {"class": "GymDDPStrategy", "kwargs": kwargs}}


def _reference(spec: dict[str, Any], phase: dict[str, Any], out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run in this process on one device with the global batch (2 x the per-rank batch)."""
    single = {**spec, "devices": 1, "batch_size": 2 * spec["batch_size"], "strategy": "auto"}
    phase = {key: value for key, value in phase.items() if key != "strategy"}
    result = run_phase(single, phase, out)
    return result["losses"], torch.load(out / f"{phase['name']}.pt", weights_only=True)


def _assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=f"weights differ at {key}")


# ------------------------------------------------------------------------------------------------ plain module


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mlp")
    phases = [{"name": name, "max_epochs": 1, "strategy": name} for name in MLP_STRATEGIES]
    for name in ACCUMULATION_STRATEGIES:
        (out / name).mkdir()
    phases += [_compression_phase(c) for c in COMPRESSIONS]
    phases.append({"name": "zero2_cpu_adam", "max_epochs": 1, "strategy": CPU_ADAM})
    phases.append({"name": "fsdp_none", "max_epochs": 1, "strategy": FSDP_NO_SHARD})
    phases += [
        {"name": "zero3_metric", "max_epochs": 1, "strategy": "zero3", "metric_in_step": True},
        {**ZERO3_METRIC_CONTROL, "max_epochs": 1, "strategy": "zero3", "metric_in_step": True},
    ]
    phases += [{**SGD_ACCUMULATION, "name": f"{name}/sgd", "strategy": name} for name in ACCUMULATION_STRATEGIES]
    spec = {"model": "mlp", "dataset_size": 32, "batch_size": 4, "phases": phases}
    results = run_worker(spec, out, timeout=600)
    losses, weights = _reference({**spec, "out": str(out)}, {"name": "reference", "max_epochs": 1}, out)
    sgd_losses, sgd_weights = _reference({**spec, "out": str(out)}, {**SGD_ACCUMULATION, "name": "sgd_ref"}, out)
    return {
        "out": out,
        "results": results,
        "ref_losses": losses,
        "ref_weights": weights,
        "sgd_ref_losses": sgd_losses,
        "sgd_ref_weights": sgd_weights,
    }


@pytest.mark.parametrize("name", ACCUMULATION_STRATEGIES)
def test_accumulation_scales_gradients_exactly_once(mlp_runs: dict[str, Any], name: str) -> None:
    # AdamW is invariant to a constant gradient scale, so it would hide a double division by the accumulation
    # count (DeepSpeed's scale_wrt_gas); plain SGD does not. 3 micro-batches per epoch with accumulate 2 also end
    # each epoch on a partial window, where DeepSpeed's own micro-step counter would drift from Lightning's.
    result = mlp_runs["results"][f"{name}/sgd"]
    assert result["global_step"] == 4
    torch.testing.assert_close(result["losses"], mlp_runs["sgd_ref_losses"], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    weights = torch.load(mlp_runs["out"] / f"{name}/sgd.pt", weights_only=True)
    _assert_same_weights(weights, mlp_runs["sgd_ref_weights"], WEIGHT_ATOL)


@pytest.mark.parametrize("name", [*MLP_STRATEGIES, "fsdp_none"])
def test_plain_lightning_module_trains_like_single_process(mlp_runs: dict[str, Any], name: str) -> None:
    result = mlp_runs["results"][name]
    assert result["global_step"] == 4
    torch.testing.assert_close(result["losses"], mlp_runs["ref_losses"], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    weights = torch.load(mlp_runs["out"] / f"{name}.pt", weights_only=True)
    _assert_same_weights(weights, mlp_runs["ref_weights"], WEIGHT_ATOL)
    stored = result["local_numel"] / result["full_numel"]
    assert stored == (0.5 if name in SHARDED else 1.0), f"{name} stores {stored:.2f} of the parameters per rank"


def test_zero3_trace_survives_a_torchmetrics_metric_called_in_training_step(mlp_runs: dict[str, Any]) -> None:
    # DeepSpeed checks its recorded module order with `module != expected`; a torchmetrics metric's `!=` is always
    # truthy, so without the fix every step throws the trace (and with it ZeRO-3's prefetching) away.
    fixed = mlp_runs["results"]["zero3_metric"]
    assert fixed["global_step"] == 4 and len(fixed["zero3_trace"]) == 4
    assert fixed["zero3_trace"][1:] == ["complete"] * 3, fixed["zero3_trace"]
    torch.testing.assert_close(fixed["losses"], mlp_runs["ref_losses"], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    control = mlp_runs["results"][ZERO3_METRIC_CONTROL["name"]]
    assert "invalid" in control["zero3_trace"] and "complete" not in control["zero3_trace"][1:], control


TWO_NODE_STRATEGIES: dict[str, Any] = {
    "gym_ddp": "gym_ddp",
    "gym_fsdp": "gym_fsdp",
    "zero3": "zero3",
    "fsdp_hybrid": FSDP_HYBRID,
}


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every strategy of :data:`TWO_NODE_STRATEGIES` in one 2-node launch (a phase each, one process-group start)."""
    phases = [{"name": name, "max_epochs": 1, "strategy": strategy} for name, strategy in TWO_NODE_STRATEGIES.items()]
    spec = {"model": "mlp", "dataset_size": 32, "batch_size": 4, "phases": phases}
    return run_worker_two_nodes(spec, tmp_path_factory.mktemp("two_nodes"), timeout=600)


@pytest.mark.parametrize("name", list(TWO_NODE_STRATEGIES))
def test_two_nodes_one_process_each_on_loopback(
    mlp_runs: dict[str, Any], two_node_runs: dict[str, Any], name: str
) -> None:
    # num_nodes=2 through Lightning's cluster environment (NODE_RANK, MASTER_ADDR, MASTER_PORT), as on 2 machines.
    result = two_node_runs[name]
    torch.testing.assert_close(result["losses"], mlp_runs["ref_losses"], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    # Hybrid shards within a node (1 process here) and replicates across nodes: each rank stores everything.
    sharded_over_nodes = name in ("gym_fsdp", "zero3")
    assert result["local_numel"] * (2 if sharded_over_nodes else 1) == result["full_numel"]


def test_deepspeed_cpu_adam_matches_torch_adamw_closely(mlp_runs: dict[str, Any]) -> None:
    # DeepSpeedCPUAdam implements the same AdamW update in fused C++ (different operation order, so rounding
    # differs by a few ulps per step); after 4 steps that is ~1e-6 on the loss, not bit-identical.
    result = mlp_runs["results"]["zero2_cpu_adam"]
    torch.testing.assert_close(result["losses"], mlp_runs["ref_losses"], rtol=0, atol=1e-4)
    weights = torch.load(mlp_runs["out"] / "zero2_cpu_adam.pt", weights_only=True)
    _assert_same_weights(weights, mlp_runs["ref_weights"], 1e-4)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_ddp_gradient_compression_runs_on_gloo_and_changes_little(mlp_runs: dict[str, Any], compression: str) -> None:
    result = mlp_runs["results"][f"ddp_{compression}"]
    reference = mlp_runs["ref_losses"]
    # The first step's loss precedes any compressed update; later ones move by the compression error only.
    assert result["losses"][0] == pytest.approx(reference[0], rel=1e-6)
    torch.testing.assert_close(result["losses"], reference, rtol=0, atol=3e-2)
    # ...and the hook really ran: compressed gradients do not give bit-identical fp32 results.
    assert result["losses"] != reference


# ------------------------------------------------------------------------------------------------ CausalLMModule

CAUSAL_STRATEGIES = ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3"]
CAUSAL_VARIANTS = {
    "fsdp_grad_op": {"class": "GymFSDPStrategy", "kwargs": {"sharding": "grad_op"}},
    "fsdp_ac": {"class": "GymFSDPStrategy", "kwargs": {"activation_checkpointing": True}},
}

# The chunked loss against the same unchunked single-process reference: FSDP2 keeps the root's (LM head's) weight
# unsharded for the calls after the model's forward, ZeRO-3 gathers it on each call (the ranks' batches differ in
# length, so 5-position chunks make their chunk counts differ unless the module agrees on the largest).
CHUNKED_LOSS_VARIANTS = {
    "fsdp_chunked_loss": {"strategy": "gym_fsdp", "loss_chunk_tokens": 5},
    "zero3_chunked_loss": {"strategy": "zero3", "loss_chunk_tokens": 5},
}


@pytest.fixture(scope="module")
def causal_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("causal")
    phases: list[dict[str, Any]] = []
    for name in CAUSAL_STRATEGIES:
        # 3 micro-batches per epoch and accumulate 2: windows of 2 and 1 (a partial window at each epoch end).
        phases += [
            {"name": f"{name}/full", "max_epochs": 2, "strategy": name},
            {
                "name": f"{name}/part",
                "max_epochs": 1,
                "strategy": name,
                "save_dir": f"{name}-ckpt",
                "export": ["merged"],
            },
            {"name": f"{name}/resume", "max_epochs": 2, "strategy": name, "resume_from": f"{name}-ckpt"},
        ]
    phases += [{"name": f"{name}/full", "max_epochs": 2, "strategy": s} for name, s in CAUSAL_VARIANTS.items()]
    phases += [{"name": f"{name}/full", "max_epochs": 2, **phase} for name, phase in CHUNKED_LOSS_VARIANTS.items()]
    # ZeRO-3 building a preset from its config (no weights) inside zero.Init: HF's initialisation must still run.
    phases.append({"name": "zero3_preset/part", "max_epochs": 1, "strategy": "zero3", "preset": True})
    phases += _export_phases()
    for name in [*CAUSAL_STRATEGIES, *CAUSAL_VARIANTS, *CHUNKED_LOSS_VARIANTS, "zero3_preset", *OFFLOAD_STRATEGIES]:
        (out / name).mkdir()
    # Every run starts from the same saved weights: ZeRO-3 initialises partitions with a different random stream,
    # and from_pretrained under zero.Init is the path real finetuning takes.
    model_dir = str(save_tiny_pretrained(out / "pretrained"))
    spec = {
        "model": "causal",
        "model_dir": model_dir,
        "dataset_size": 24,
        "batch_size": 4,
        "accumulate": 2,
        "phases": phases,
    }
    results = run_worker(spec, out, timeout=900)
    (out / "reference").mkdir()
    losses, weights = _reference({**spec, "out": str(out)}, {"name": "reference/full", "max_epochs": 2}, out)
    return {"out": out, "results": results, "ref_losses": losses, "ref_weights": weights, "model_dir": model_dir}


OFFLOAD_STRATEGIES = ["zero2_offload", "zero3_offload"] + (["zero_infinity"] if NVME else [])
EXPORT_STRATEGIES = CAUSAL_STRATEGIES + OFFLOAD_STRATEGIES
# (strategy, phase, LoRA export): full finetunes export "merged" (there is nothing to merge), LoRA runs both ways.
EXPORT_CASES = [(name, "part", "merged") for name in EXPORT_STRATEGIES]
EXPORT_CASES += [(name, "lora", mode) for name in EXPORT_STRATEGIES for mode in ("merged", "adapter")]
# bf16-mixed LoRA under ZeRO-3: the engine's module holds 16-bit factors, the optimizer fp32 masters; the live merge
# must read the masters, as the checkpoint's export does (strategies.zero.masters).
BF16_EXPORT_STRATEGIES = ["zero3"]
EXPORT_CASES += [(name, "lora-bf16", "merged") for name in BF16_EXPORT_STRATEGIES]


def _export_phases() -> list[dict[str, Any]]:
    """One LoRA run per strategy (checkpoint + live export both ways) and the offload variants' full finetunes (the
    others' "part" phases export already)."""
    phases = [
        {"name": f"{name}/lora", "max_epochs": 1, "strategy": name, "lora": True, "save_dir": f"{name}-lora-ckpt",
         "export": ["merged", "adapter"]}
        for name in EXPORT_STRATEGIES
    ]  # fmt: skip
    phases += [
        {"name": f"{name}/part", "max_epochs": 1, "strategy": name, "save_dir": f"{name}-ckpt", "export": ["merged"]}
        for name in OFFLOAD_STRATEGIES
    ]
    phases += [
        {"name": f"{name}/lora-bf16", "max_epochs": 1, "strategy": name, "lora": True, "precision": "bf16-mixed",
         "save_dir": f"{name}-lora-bf16-ckpt", "export": ["merged"]}
        for name in BF16_EXPORT_STRATEGIES
    ]  # fmt: skip
    return phases


@pytest.mark.parametrize("name", CAUSAL_STRATEGIES + list(CAUSAL_VARIANTS) + list(CHUNKED_LOSS_VARIANTS))
def test_causal_lm_loss_trajectory_matches_single_process(causal_runs: dict[str, Any], name: str) -> None:
    result = causal_runs["results"][f"{name}/full"]
    assert result["global_step"] == 4, "2 epochs x (one full + one partial accumulation window)"
    torch.testing.assert_close(result["losses"], causal_runs["ref_losses"], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    # The export path: full weights gathered from the shards equal the single-process model's.
    weights = torch.load(causal_runs["out"] / f"{name}/full.pt", weights_only=True)
    _assert_same_weights(weights, causal_runs["ref_weights"], WEIGHT_ATOL)
    if name in SHARDED:
        assert result["local_numel"] * 2 == result["full_numel"], "parameters are not split across the 2 ranks"


@pytest.mark.parametrize("name", CAUSAL_STRATEGIES)
def test_causal_lm_resume_continues_like_uninterrupted_run(causal_runs: dict[str, Any], name: str) -> None:
    results = causal_runs["results"]
    full, part, resumed = results[f"{name}/full"], results[f"{name}/part"], results[f"{name}/resume"]
    assert (part["global_step"], resumed["global_step"]) == (2, 4)
    torch.testing.assert_close(part["losses"] + resumed["losses"], full["losses"], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    out = causal_runs["out"]
    _assert_same_weights(
        torch.load(out / f"{name}/resume.pt", weights_only=True),
        torch.load(out / f"{name}/full.pt", weights_only=True),
        WEIGHT_ATOL,
    )
    checkpoint = out / f"{name}-ckpt" / "last.ckpt"
    assert checkpoint.is_dir() == (name != "gym_ddp"), "sharding strategies write a sharded checkpoint folder"


def test_zero3_from_config_keeps_hugging_face_initialisation(causal_runs: dict[str, Any]) -> None:
    # Under zero.Init without the transformers DeepSpeed integration, HF skips _init_weights and embeddings keep
    # torch's N(0, 1) init; with it they follow initializer_range=0.02 (2 steps at lr 3e-3 barely move them).
    weights = torch.load(causal_runs["out"] / "zero3_preset/part.pt", weights_only=True)
    std = weights["model.embed_tokens.weight"].float().std().item()
    assert 0.01 < std < 0.04, f"embedding std {std:.3f}: HF's initialisation did not run under zero.Init"


# ------------------------------------------------------------------------------------------------ export
def _folder_contents(folder: Path) -> dict[str, Any]:
    """Every file of an exported folder: safetensors as tensors, JSON as data (transformers' version dropped)."""
    from safetensors.torch import load_file

    contents: dict[str, Any] = {}
    for file in sorted(folder.iterdir()):
        if file.suffix == ".safetensors":
            contents[file.name] = load_file(file)
        elif file.suffix == ".json":
            data = json.loads(file.read_text())
            contents[file.name] = {k: v for k, v in data.items() if k != "transformers_version"}
        else:
            contents[file.name] = file.read_bytes()
    return contents


def _reload(folder: Path, mode: str, model_dir: str) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if mode == "adapter":
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder)
    return AutoModelForCausalLM.from_pretrained(folder)


# LoRA's adapter_config.json: the live run's peft config carries runtime fields (inference_mode, ...); these are the
# ones that decide the model.
ADAPTER_FIELDS = ("r", "lora_alpha", "lora_dropout", "base_model_name_or_path", "task_type", "peft_type")


@pytest.mark.parametrize(("name", "run", "mode"), EXPORT_CASES)
def test_live_export_equals_checkpoint_export_and_reproduces_the_module(
    causal_runs: dict[str, Any], name: str, run: str, mode: str, tmp_path: Path
) -> None:
    from helpers.strategy_worker import PROBE

    from gym_lightning.checkpointing.reading import export_checkpoint

    out = causal_runs["out"]
    live = out / f"{name}/{run}.export-{mode}"
    checkpoint = out / (f"{name}-ckpt" if run == "part" else f"{name}-{run}-ckpt") / "last.ckpt"
    offline = export_checkpoint(checkpoint, tmp_path / "hf", lora=mode)
    live_files, offline_files = _folder_contents(live), _folder_contents(offline)
    assert live_files.keys() == offline_files.keys()
    for file, content in live_files.items():
        if file == "adapter_config.json":
            assert {k: content[k] for k in ADAPTER_FIELDS} == {k: offline_files[file][k] for k in ADAPTER_FIELDS}
            assert set(content["target_modules"]) == set(offline_files[file]["target_modules"]) == {"q_proj", "v_proj"}
        elif file.endswith(".safetensors"):
            assert content.keys() == offline_files[file].keys(), file
            for key, tensor in content.items():
                assert torch.equal(tensor, offline_files[file][key]), f"{file}: {key} differs"
        else:
            assert content == offline_files[file], file
    reloaded = _reload(live, mode, causal_runs["model_dir"]).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=torch.tensor(PROBE)).logits
    expected = torch.load(out / f"{name}/{run}.logits.pt", weights_only=True)
    if run != "lora-bf16":  # under bf16-mixed the module computes with 16-bit weights; the export merges the masters
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    if run.startswith("lora"):  # LoRA's B starts at zero: the adapters must have trained for the export to prove it
        _assert_adapters_trained(live_files, mode, Path(causal_runs["model_dir"]), bf16=run == "lora-bf16")


def _assert_adapters_trained(files: dict[str, Any], mode: str, model_dir: Path, bf16: bool = False) -> None:
    """The targeted weight moved, an untargeted one is the source's (under ZeRO's ``bf16-mixed`` the engine holds
    frozen weights in bf16 and keeps no fp32 master of them: the source rounded to bf16)."""
    from safetensors.torch import load_file

    if mode == "adapter":
        assert any(t.abs().max() > 0 for k, t in files["adapter_model.safetensors"].items() if "lora_B" in k)
        return
    pretrained = load_file(model_dir / "model.safetensors")
    merged = files["model.safetensors"]
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], pretrained["model.layers.0.self_attn.q_proj.weight"]
    )
    untargeted = pretrained["model.layers.0.mlp.up_proj.weight"]
    untargeted = untargeted.to(torch.bfloat16).to(untargeted.dtype) if bf16 else untargeted
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], untargeted)
