"""Exact mid-epoch resume after a rank is SIGKILLed, on 2 real CPU ranks, for DDP, FSDP and ZeRO-3.

This file is also the worker: ``python tests/checkpointing/test_resume.py SPEC.json`` runs one phase list (or the
phase lists of several runs) in one pair of processes. Each case's killed run is a launch of its own, started as a
user starts it (Lightning's launcher re-runs the same command line for rank 1); the resumes and the uninterrupted runs
of all cases share one, started as torchrun starts ranks (``helpers.dist.run_ranks``).

Scenario (2 ranks x 6 micro-batches of 2 per epoch, accumulate 2, 2 epochs = 6 optimizer steps, linear schedule
with warm-up, AdamW with weight decay): ``crash`` checkpoints every step and SIGKILLs rank 1 in the middle of the
5th step (epoch 1, micro-batch 3), one micro-batch after the step-4 checkpoint (epoch 1, micro-batch 1: mid-epoch).
``resume`` runs ``fit(ckpt_path="last")`` in new processes; ``full`` is the same training without interruption.

Tolerance: resumed and uninterrupted runs execute the same fp32 operations in the same order on the same data, so
they agree bit for bit on DDP and FSDP, and to ~1e-7 on ZeRO-3 (re-partitioning on load). We allow 1e-6 absolute on
weights of magnitude ~0.02-1 and 1e-5 relative on losses. Resuming at the wrong data position (restarting the epoch,
or skipping a micro-batch), losing the optimizer moments or the scheduler step all move weights by >= 1e-4.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.full_state import full_model_state_dict

from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters

LOSS_RTOL, LOSS_ATOL, WEIGHT_ATOL = 1e-5, 1e-7, 1e-6
KILL_AT_STEP, KILL_AT_BATCH = 4, 3
# One strategy per checkpoint format: a single .ckpt file (gym_ddp), torch DCP shards (gym_fsdp), DeepSpeed's
# per-rank files (zero3). ZeRO-1 and ZeRO-2 write through the same ZeROStrategy.save_checkpoint as ZeRO-3 (only which
# tensors are partitioned differs); their exact resume is tests/strategies/test_multirank.py::
# test_causal_lm_resume_continues_like_uninterrupted_run (from an epoch's end, without a kill).
STRATEGIES = ["gym_ddp", "gym_fsdp", "zero3"]


# ------------------------------------------------------------------------------------------------------ worker
def build_strategy(name: str) -> Any:
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

    # A dead peer must not keep the survivor waiting for the default 30 minutes.
    timeout = timedelta(seconds=60)
    if name == "gym_ddp":
        return GymDDPStrategy(timeout=timeout)
    if name == "gym_fsdp":
        return GymFSDPStrategy(timeout=timeout)
    return ZeROStrategy(stage=int(name.removeprefix("zero")), timeout=timeout)  # zero1 / zero2 / zero3


class KillRank(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """SIGKILL one rank at a given step and micro-batch: no Python cleanup, no exception handler runs."""

    def __init__(self, rank: int, step: int, batch: int) -> None:
        self.rank, self.step, self.batch = rank, step, batch

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def seeded_module_and_data(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The run every kill/resume test trains (seeded): CausalLMModule on ``spec``'s model folder and its data."""
    import lightning.pytorch as pl

    from gym_lightning import CausalLMDataModule, CausalLMModule, LoRAArgs
    from gym_lightning.quant import QuantizationArgs

    pl.seed_everything(7, workers=True)
    # LoRA: adapters on q/v with a larger step (B starts at zero and must move for the comparison to mean anything).
    lora = LoRAArgs(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if spec.get("lora") else None
    # QLoRA: the 4-bit base in blocks of 32 (the model is 32 wide), dequantised in fp32 like the rest of this run.
    quantization = QuantizationArgs(block_size=32, compute_dtype="float32") if spec.get("qlora") else None
    module = CausalLMModule(
        model=spec["model_dir"], lr=3e-2 if lora else 3e-3, weight_decay=0.01, scheduler="linear", warmup_steps=2,
        min_lr_ratio=0.1, lora=lora, quantization=quantization,
    )  # fmt: skip
    data = CausalLMDataModule(
        train_files=spec["train_file"], tokenizer=spec["model_dir"], batch_size=2, max_seq_length=32
    )
    return module, data


def run_phase(spec: dict[str, Any], phase: str, devices: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from helpers.strategy_worker import RecordLosses

    from gym_lightning.checkpointing import StepCheckpoint

    out = Path(spec["out"])
    module, data = seeded_module_and_data(spec)
    recorder = RecordLosses()
    ckpt_dir = out / ("ckpt" if phase in ("crash", "resume") else f"{phase}-ckpt")
    callbacks = [recorder, StepCheckpoint(dirpath=ckpt_dir, every_n_steps=1, keep_last=2)]
    if phase == "crash":
        callbacks.append(KillRank(devices - 1, KILL_AT_STEP, spec.get("kill_at_batch", KILL_AT_BATCH)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=build_strategy(spec["strategy"]),
        precision="32-true", max_epochs=2, accumulate_grad_batches=2, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last" if phase == "resume" else None)
    save_final_weights(trainer, module, out / f"{phase}.pt")
    return {"losses": recorder.losses, "global_step": trainer.global_step}


def save_final_weights(trainer: Any, module: Any, path: Path) -> None:
    """The module's full weights, gathered by the strategy where it shards them, saved by global rank 0 (collective)."""
    state = full_model_state_dict(trainer.strategy, module.model)
    if trainer.is_global_zero:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, path)
    trainer.strategy.barrier()


def worker_main(spec_path: str) -> None:
    """Run the spec's phases, or each of its ``runs`` (specs of their own: another strategy, another folder) one
    after the other in the same processes (one process-group start for all of them)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    for run in spec.get("runs", [spec]):
        results = {phase: run_phase(run, phase, run.get(f"{phase}_devices", 2)) for phase in run["phases"]}
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            (Path(run["out"]) / f"results-{'-'.join(run['phases'])}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------------ tests
def launch(spec: dict[str, Any], phases: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    from helpers.dist import rank_env

    spec_path = Path(spec["out"]) / f"spec-{'-'.join(phases)}.json"
    spec_path.write_text(json.dumps({**spec, "phases": phases}))
    return subprocess.run(
        [sys.executable, __file__, str(spec_path)], env=rank_env(), capture_output=True, text=True, timeout=timeout
    )


def assert_same_weights(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = WEIGHT_ATOL
) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=f"weights differ at {key}")


# The kill/resume cases: every strategy's full finetune, LoRA under the two strategies that shard adapters, and
# QLoRA (a 4-bit base) under the two that shard it (gym_ddp's .ckpt holds it whole: tests/quant/test_qlora_runs.py).
# The strategies whose checkpoints hold per-rank slices; gym_fsdp only where torch's FSDP2 shards integer parameters
# (torch >= 2.13; on older torch it refuses a 4-bit base in one line: tests/quant/test_qlora_runs.py).
QLORA_STRATEGIES = ["gym_fsdp", "zero3"] if fsdp2_holds_integer_parameters() else ["zero3"]
CASES: list[tuple[str, bool | str]] = [(name, False) for name in STRATEGIES] + [("gym_fsdp", True), ("zero3", True)]
CASES += [(name, "qlora") for name in QLORA_STRATEGIES]


@pytest.fixture(scope="module")
def killed_and_resumed(
    pretrained: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, bool | str], dict[str, Any]]:
    """Each case trained with rank 1 SIGKILLed mid-epoch (one launch each: the kill ends the processes), then every
    case resumed and trained uninterrupted in one more launch (one process-group start for all of them)."""
    model_dir, train_file = pretrained
    runs = {}
    for strategy, lora in CASES:
        out = tmp_path_factory.mktemp(f"{strategy}-{lora if isinstance(lora, str) else 'lora' if lora else 'full'}")
        spec = {"strategy": strategy, "lora": bool(lora), "qlora": lora == "qlora", "out": str(out)}
        spec |= {"model_dir": str(model_dir), "train_file": str(train_file)}
        crash = launch(spec, ["crash"])
        ckpt = out / "ckpt"  # as the killed run left it (the resume writes its own checkpoints there)
        last = os.readlink(ckpt / "last.ckpt") if (ckpt / "last.ckpt").is_symlink() else None
        kept = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
        runs[strategy, lora] = {"spec": spec, "crash": crash, "last": last, "kept": kept}
    together = tmp_path_factory.mktemp("resume-full")
    results = results_of_runs([{**run["spec"], "phases": ["resume", "full"]} for run in runs.values()], together)
    for run, result in zip(runs.values(), results, strict=True):
        run["results"] = result
    return runs


def results_of_runs(runs: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """Each run's results, all runs in one launch (2 ranks as torchrun starts them: ``helpers.dist.run_ranks``)."""
    from helpers.dist import run_ranks

    spec_path = out / "spec-runs.json"
    spec_path.write_text(json.dumps({"out": str(out), "runs": runs, "phases": ["runs"]}))
    run_ranks([__file__, str(spec_path)], timeout=900)
    return [json.loads((Path(run["out"]) / "results-resume-full.json").read_text()) for run in runs]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(
    strategy: str, killed_and_resumed: dict[tuple[str, bool], dict[str, Any]], pretrained: tuple[Path, Path]
) -> None:
    run = killed_and_resumed[strategy, False]
    out = Path(run["spec"]["out"])
    assert run["crash"].returncode != 0, "the killed run should fail"
    assert run["last"] == "step-00000004.ckpt", run["kept"]
    steps = ["step-00000003.ckpt", "step-00000004.ckpt"]
    manifests = [f"{name}.manifest.json" for name in steps] if strategy == "gym_ddp" else []  # beside single files
    assert run["kept"] == sorted(["last.ckpt", *steps, *manifests]), "keep_last=2, no staging leftovers"

    resumed, full = run["results"]["resume"], run["results"]["full"]
    assert (resumed["global_step"], full["global_step"]) == (6, 6)
    # The resumed run trains micro-batches 2..5 of epoch 1: 4 of the 12 micro-batches, same losses as the full run's.
    assert len(resumed["losses"]) == 4
    torch.testing.assert_close(resumed["losses"], full["losses"][-4:], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    final = torch.load(out / "resume.pt", weights_only=True)
    assert_same_weights(final, torch.load(out / "full.pt", weights_only=True))
    assert_export_round_trip(out / "ckpt", final, pretrained[0], out / "hf")


def assert_adapters_resumed(run: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The killed adapter run resumed from its step-4 checkpoint like the uninterrupted one; its final weights."""
    out = Path(run["spec"]["out"])
    assert run["crash"].returncode != 0, "the killed run should fail"
    assert run["last"] == "step-00000004.ckpt", run["kept"]
    resumed, full = run["results"]["resume"], run["results"]["full"]
    assert (resumed["global_step"], full["global_step"], len(resumed["losses"])) == (6, 6, 4)
    torch.testing.assert_close(resumed["losses"], full["losses"][-4:], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    final = torch.load(out / "resume.pt", weights_only=True)
    assert_same_weights(final, torch.load(out / "full.pt", weights_only=True))
    adapters = {k: v for k, v in final.items() if ".lora_B." in k}
    assert adapters and all(v.abs().max() > 0 for v in adapters.values()), "the adapters trained"
    return final


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gym_fsdp", "zero3"])
def test_a_lora_run_killed_and_resumed_matches_uninterrupted(
    strategy: str, killed_and_resumed: dict[tuple[str, bool], dict[str, Any]], pretrained: tuple[Path, Path]
) -> None:
    """Every rank's slice of the adapters (sharded by FSDP, partitioned by ZeRO-3) and of their optimizer state is
    in the checkpoint and comes back: peers have lost them (accelerate PR 4206)."""
    from safetensors.torch import load_file

    final = assert_adapters_resumed(killed_and_resumed[strategy, True])
    pretrained_weights = load_file(pretrained[0] / "model.safetensors")
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(final[base], pretrained_weights["model.layers.0.self_attn.q_proj.weight"]), "base frozen"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", QLORA_STRATEGIES)
def test_a_qlora_run_killed_and_resumed_matches_uninterrupted(
    strategy: str, killed_and_resumed: dict[tuple[str, bool | str], dict[str, Any]], pretrained: tuple[Path, Path]
) -> None:
    """A 4-bit base (QLoRA) resumes exactly too: the adapters and their optimizer state of every rank come back, and
    the NF4 codes and scales, frozen, are the quantisation of the pretrained weights bit for bit after 6 steps, a
    kill and a resume (each rank quantised only its rows when it loaded them)."""
    from safetensors.torch import load_file

    from gym_lightning.quant import nf4

    final = assert_adapters_resumed(killed_and_resumed[strategy, "qlora"])
    source = load_file(pretrained[0] / "model.safetensors")
    # q_proj is adapted (peft's wrapper inserts base_layer), down_proj and o_proj are not.
    for index, name in ((0, "self_attn.q_proj.base_layer"), (1, "mlp.down_proj"), (1, "self_attn.o_proj")):
        checkpoint_name = name.removesuffix(".base_layer")
        expected = nf4.quantize(source[f"model.layers.{index}.{checkpoint_name}.weight"], block_size=32)
        prefix = f"base_model.model.model.layers.{index}.{name}."
        assert final[prefix + "weight"].dtype == torch.uint8, "the base is held in 4 bits"
        for key, part in (("weight", "codes"), ("weight_scales", "scales"), ("weight_scale_stats", "scale_stats")):
            assert torch.equal(final[prefix + key], expected[part]), f"{prefix}{key} changed or was quantised otherwise"


PROBE = torch.tensor([[5, 9, 12, 40, 7, 3, 22, 8, 100, 41]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def assert_export_round_trip(checkpoint: Path, weights: dict[str, torch.Tensor], model_dir: Path, out: Path) -> None:
    """``gym export`` of the strategy's own checkpoint format, loaded by transformers, gives the trained logits."""
    from transformers import AutoModelForCausalLM

    from gym_lightning.commands.export import main as export_main

    export_main(["--checkpoint", str(checkpoint), "--output_dir", str(out), "--max_shard_size", "60KB"])
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file(), "60KB shards of a ~250KB model"
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(model_dir)
    trained.load_state_dict(weights)
    exported = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(exported), logits(trained), rtol=0, atol=1e-6)


if __name__ == "__main__":
    worker_main(sys.argv[1])
