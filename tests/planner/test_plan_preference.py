"""The preference stages in the planner (issue 57, item 6), each term against a hand computation: the stage table,
how a run holds its reference, what each strategy family charges for it, the sequences per example, the forwards
without gradient in the step (with their gathers and ZeRO-3's fetches), ``precompute_ref_log_probs``' one-off pass,
and the ways in (``gym plan --stage``, ``--rows``, ``--config``'s ``model.objective``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_lightning.commands.plan import main as plan_main
from gym_lightning.commands.plan import plan_arguments
from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner import plan
from gym_lightning.planner.comm import Group, Network
from gym_lightning.planner.compute import Kernels, forward_seconds, micro_batch_compute
from gym_lightning.planner.estimate import STRATEGY_BY_KEY, estimate, param_counts
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.hardware import Hardware, HostFigures
from gym_lightning.planner.run_config import run_settings
from gym_lightning.planner.spec import STAGES, RunSpec
from gym_lightning.planner.timing import reference_pass_seconds, speed, step_time

GB = 1e9
NET = Network(intra_bandwidth=400 * GB, inter_bandwidth=100 * GB, intra_latency=0.0, inter_latency=0.0)
KERNELS = Kernels(peak_flops=1e15, memory_bandwidth=4e12, efficiency=0.5)
HW = Hardware("test", KERNELS, NET, HostFigures(50 * GB, 200 * GB, 10 * GB, zero3_fetch=1e-4))
# h 64, I 128, 2 layers, 4 heads of 16, 2 kv heads, vocabulary 1000, untied: 202,048 parameters, of which 320 are
# norms (ZeRO-3 keeps them whole): 2 x (4,096 + 2 x 2,048 + 4,096 + 3 x 8,192 + 2 x 64) + 64 + 2 x 64,000.
TINY = ModelShape("tiny", 64, 128, 2, 4, 2, 16, 1000, False)
PSI = 202_048
DPO = RunSpec(gpus_per_node=8, micro_batch_size=2, seq_length=100, stage="dpo")


def model(key: str, spec: RunSpec) -> Any:
    return cost_model(STRATEGY_BY_KEY[key], TINY, spec)


def test_the_stage_table_and_how_a_run_holds_its_reference() -> None:
    assert TINY.num_params() == PSI and param_counts(TINY, DPO).persistent == 320
    kinds = {name: (k.sequences, k.detached, k.reference) for name, k in STAGES.items()}
    assert kinds == {"sft": (1, 0, False), "pt": (1, 0, False), "dpo": (2, 0, True), "kto": (1, 1, True),
                     "orpo": (2, 0, False), "simpo": (2, 0, False)}  # fmt: skip
    holds = {
        "full": (DPO, "copy", 1),
        "lora": (replace(DPO, lora_r=8), "adapters_off", 1),
        "lora + ref_model": (replace(DPO, lora_r=8, ref_model="base"), "copy", 1),
        "precomputed": (replace(DPO, precompute_ref_log_probs=True), "precomputed", 0),
        "kto": (replace(DPO, stage="kto"), "copy", 2),  # the reference's forward and the KL rows' own
        "orpo": (replace(DPO, stage="orpo"), "none", 0),
        "sft": (replace(DPO, stage="sft"), "none", 0),
    }
    for name, (spec, hold, passes) in holds.items():
        assert (spec.reference_hold, spec.no_grad_passes) == (hold, passes), name


def test_each_family_charges_the_copy_as_it_holds_the_policy() -> None:
    bf16 = 2 * PSI
    expected = {
        "ddp": bf16,  # whole on every rank, as the policy
        "zero1": bf16,
        "zero2": bf16,
        "fsdp_grad_op": bf16 / 8,
        "fsdp_full": bf16 / 8,  # sharded as the policy
        "zero3": 2 * (PSI - 320) / 8 + 2 * 320,  # partitioned; the persistent norms whole
        "zero3_offload_optimizer": 2 * (PSI - 320) / 8 + 2 * 320,
    }
    for key, held in expected.items():
        assert estimate(TINY, STRATEGY_BY_KEY[key], DPO).reference == pytest.approx(held), key
    # Parameter offload: the copy's shard lives where the policy's shards do.
    fsdp_offload = estimate(TINY, STRATEGY_BY_KEY["fsdp_offload"], DPO)
    offloaded = estimate(TINY, STRATEGY_BY_KEY["fsdp_offload"], replace(DPO, stage="sft"))
    assert fsdp_offload.reference == 0.0
    assert fsdp_offload.host_per_node - offloaded.host_per_node == pytest.approx(8 * bf16 / 8)
    infinity = estimate(TINY, STRATEGY_BY_KEY["zero_infinity"], DPO)
    assert infinity.nvme_per_node - estimate(
        TINY, STRATEGY_BY_KEY["zero_infinity"], replace(DPO, stage="sft")
    ).nvme_per_node == pytest.approx(bf16)
    # The dtype: bf16-mixed holds frozen weights in 16 bits; fp32 when asked, or in 32-true training.
    assert model("ddp", replace(DPO, reference_dtype="fp32")).reference_bytes() == 4 * PSI
    assert model("ddp", replace(DPO, precision="32-true")).reference_bytes() == 4 * PSI
    assert model("ddp", replace(DPO, precision="32-true", reference_dtype="bf16")).reference_bytes() == bf16
    # No copy: the adapters off, precomputed, reference-free. A LoRA run with its own ref_model holds the base whole.
    for spec in (replace(DPO, lora_r=8), replace(DPO, precompute_ref_log_probs=True), replace(DPO, stage="simpo")):
        assert all(estimate(TINY, s, spec).reference == 0 for s in STRATEGY_BY_KEY.values())
    assert model("fsdp_full", replace(DPO, lora_r=8, ref_model="base")).reference_bytes() == bf16 / 8


def test_sequences_per_example_and_the_phases() -> None:
    fsdp, sft = STRATEGY_BY_KEY["fsdp_full"], replace(DPO, stage="sft")
    one, pair, kto = (
        estimate(TINY, fsdp, sft),
        estimate(TINY, fsdp, DPO),
        estimate(TINY, fsdp, replace(DPO, stage="kto")),
    )
    assert pair.activations == pytest.approx(2 * one.activations)  # chosen and rejected rows trained together
    assert kto.activations == one.activations  # the KL rows run without gradient: nothing saved for backward
    assert (pair.params, pair.grads, pair.optimizer_state, pair.buffers) == (
        one.params,
        one.grads,
        one.optimizer_state,
        one.buffers,
    )
    copy = 2 * PSI / 8
    assert pair.gpu_total == pytest.approx(one.gpu_total + one.activations + one.logits + copy)
    peaks = {name: model("fsdp_full", spec) for name, spec in (("sft", sft), ("dpo", DPO))}
    for phase in ("step_peak", "save_peak", "export_peak"):  # held through save and export too, never saved
        extra = getattr(peaks["dpo"], phase)().device - getattr(peaks["sft"], phase)().device
        assert extra == pytest.approx(
            copy + (pair.activations + pair.logits - one.activations - one.logits) * (phase == "step_peak")
        ), phase
    assert peaks["dpo"].load_peak() == peaks["sft"].load_peak()  # built after the load, at the fit's start


def test_the_reference_forward_is_one_more_forward_over_every_row() -> None:
    c = micro_batch_compute(TINY, DPO, KERNELS)
    # A full finetune's reference is the policy's architecture: its forward over the 2B rows is the policy's.
    assert c.reference == pytest.approx(c.forward) and c.detached == 0.0
    tokens = 2 * 2 * 100  # micro-batch 2, two rows each, 100 tokens
    assert c.reference == pytest.approx(forward_seconds(TINY, DPO, tokens, KERNELS) / 0.5)
    # LoRA: the base with its adapters off skips the adapters' GEMMs.
    lora = micro_batch_compute(TINY, replace(DPO, lora_r=8), KERNELS)
    assert lora.reference == pytest.approx(c.reference) and lora.reference < lora.forward
    # KTO: the policy trains on each completion (B rows), runs its KL rows without gradient (B rows), and the
    # reference runs over both (2B rows): the DPO forward's size.
    kto = micro_batch_compute(TINY, replace(DPO, stage="kto"), KERNELS)
    sft = micro_batch_compute(TINY, replace(DPO, stage="sft"), KERNELS)
    assert (kto.forward, kto.backward) == (sft.forward, sft.backward)
    assert kto.detached == pytest.approx(sft.forward) and kto.reference == pytest.approx(c.forward)
    assert micro_batch_compute(TINY, replace(DPO, precompute_ref_log_probs=True), KERNELS).no_grad == 0.0
    assert micro_batch_compute(TINY, replace(DPO, stage="orpo"), KERNELS).no_grad == 0.0


def test_the_step_pays_the_forwards_without_gradient_and_their_gathers() -> None:
    one_gpu = replace(DPO, gpus_per_node=1, accumulate_grad_batches=3)
    c = micro_batch_compute(TINY, one_gpu, KERNELS)
    step = step_time(TINY, STRATEGY_BY_KEY["ddp"], one_gpu, HW)
    assert step.compute == pytest.approx(3 * (c.forward + c.backward + c.reference))
    assert step.no_grad_forward == pytest.approx(3 * c.reference) and step.exposed_communication == 0.0
    # gym_fsdp: the copy is gathered unit by unit in its forward, in bf16 (4 units: embedding, 2 layers, norm + head)
    fsdp = model("fsdp_full", DPO)
    gather = Group(8, 1, NET).all_gather(2 * PSI, len(fsdp.units()))
    assert fsdp.reference_gather(HW)[0] == pytest.approx(gather)
    assert fsdp.no_grad_traffic(HW).forward == pytest.approx(gather)
    # The adapters off gather the policy's own units again; KTO's KL rows add one more policy forward.
    lora = model("fsdp_full", replace(DPO, lora_r=8))
    assert lora.no_grad_traffic(HW).forward == pytest.approx(lora.traffic(HW).forward)
    kto = model("fsdp_full", replace(DPO, stage="kto"))
    assert kto.no_grad_traffic(HW).forward == pytest.approx(gather + kto.traffic(HW).forward)
    assert model("fsdp_full", replace(DPO, precompute_ref_log_probs=True)).no_grad_traffic(HW).forward == 0.0
    assert model("ddp", DPO).no_grad_traffic(HW).forward == 0.0  # whole on every rank: nothing to gather
    # ZeRO-3: the copy without its persistent norms, one fetch per module per pass (2 layers + embedding + head).
    zero3 = model("zero3", DPO)
    assert zero3.reference_gather(HW)[0] == pytest.approx(Group(8, 1, NET).all_gather(2 * (PSI - 320), 4))
    assert zero3.hook_seconds(HW) == pytest.approx((2 + 1) * 4 * 1e-4)  # forward, backward, the reference
    assert model("zero3", replace(DPO, stage="kto")).hook_seconds(HW) == pytest.approx((2 + 2) * 4 * 1e-4)
    assert model("zero3", replace(DPO, stage="simpo")).hook_seconds(HW) == pytest.approx(2 * 4 * 1e-4)
    # In the step: the reference's gathers beside its forward, and its compute.
    with_ref = step_time(TINY, STRATEGY_BY_KEY["fsdp_full"], DPO, HW)
    precomputed = step_time(TINY, STRATEGY_BY_KEY["fsdp_full"], replace(DPO, precompute_ref_log_probs=True), HW)
    assert with_ref.communication - precomputed.communication == pytest.approx(gather)
    assert with_ref.compute - precomputed.compute == pytest.approx(micro_batch_compute(TINY, DPO, KERNELS).reference)


def test_precompute_is_a_one_off_pass_before_training() -> None:
    spec = replace(DPO, gpus_per_node=1, accumulate_grad_batches=3, precompute_ref_log_probs=True)
    forward = micro_batch_compute(TINY, replace(spec, precompute_ref_log_probs=False), KERNELS).reference
    assert reference_pass_seconds(TINY, STRATEGY_BY_KEY["ddp"], spec, HW) == pytest.approx(3 * forward)
    assert reference_pass_seconds(TINY, STRATEGY_BY_KEY["ddp"], replace(spec, precompute_ref_log_probs=False), HW) == 0
    # Under ZeRO-3 the pass fetches every module once and gathers the policy (full finetune: the policy is the
    # pass's reference before its first step).
    sharded = replace(spec, gpus_per_node=8)
    zero3 = model("zero3", sharded)
    moved = zero3.traffic(HW)
    one = max(forward, moved.forward - moved.forward_exposed) + moved.forward_exposed + 4 * 1e-4
    assert reference_pass_seconds(TINY, STRATEGY_BY_KEY["zero3"], sharded, HW) == pytest.approx(3 * one)
    # Hours: training, plus the pass once over the data (not once per epoch).
    result = speed(TINY, STRATEGY_BY_KEY["ddp"], spec, HW)
    assert result.reference_pass == pytest.approx(3 * forward) and result.step.no_grad_forward == 0.0
    tokens = 10 * result.tokens_per_step  # 5 steps of data, 2 epochs
    training = tokens / result.tokens_per_second_per_gpu
    assert result.hours(tokens, 1, epochs=2) * 3600 == pytest.approx(training + 5 * 3 * forward)


def test_gym_plan_stage_dpo_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    plan_main(["--model", "llama-3-8b", "--stage", "dpo", "--gpus_per_node", "8", "--micro_batch_size", "2"])
    out = capsys.readouterr().out
    assert "Preference: 2 sequence(s) per example trained; reference: a frozen 16-bit copy" in out
    header = next(line for line in out.splitlines() if line.startswith("strategy") and "ref" in line.split())
    assert header.split().index("ref") == header.split().index("GPU") - 1
    plan_main(["--model", "llama-3-8b", "--stage", "dpo", "--precompute_ref_log_probs", "--rows", "1000", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["precompute_ref_log_probs"] and report["strategies"][0]["bytes"]["reference"] == 0
    assert all(s["speed"]["reference_pass_seconds_per_step"] > 0 for s in report["strategies"] if s["speed"])


def test_rows_count_both_sequences_of_a_pair() -> None:
    common = ["--model", "llama-3-8b", "--rows", "1000", "--epochs", "2", "--seq_length", "512"]
    assert plan_arguments(common)["tokens"] == 1000 * 2 * 512
    assert plan_arguments([*common, "--stage", "dpo"])["tokens"] == 1000 * 2 * 512 * 2
    assert plan_arguments([*common, "--stage", "kto"])["tokens"] == 1000 * 2 * 512  # the KL rows are not data
    assert plan_arguments([*common, "--stage", "dpo"])["epochs"] == 2


def _write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    ("objective", "expected"),
    [
        ("dpo", {"stage": "dpo"}),
        ({"name": "kto", "beta": 0.2, "precompute_ref_log_probs": True}, {"stage": "kto", "precompute_ref_log_probs": True}),  # noqa: E501
        ({"class_path": "gym_lightning.objectives.DPO", "init_args": {"ref_model": "/ref", "loss_type": "ipo"}},
         {"stage": "dpo", "ref_model": "/ref"}),
        ({"class_path": "gym_lightning.objectives.simpo.SimPO", "init_args": {"simpo_gamma": 0.5}}, {"stage": "simpo"}),
    ],
)  # fmt: skip
def test_config_reads_the_objective_s_stage_and_reference(objective: Any, expected: dict[str, Any]) -> None:
    settings = run_settings({"model": {"objective": objective}}).settings
    assert {k: settings[k] for k in expected} == expected
    assert "precompute_ref_log_probs" in settings or "precompute_ref_log_probs" not in expected


def test_config_of_a_lora_dpo_run_plans_no_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "trainer": {"devices": 2, "accelerator": "cpu", "precision": "bf16-mixed", "strategy": "zero3"},
        "model": {"model": "llama-3-8b", "lora": {"r": 16}, "objective": {"name": "dpo", "beta": 0.1}},
        "data": {"batch_size": 2, "max_seq_length": 1024, "format": "preference"},
    }
    plan_main(["--config", _write(tmp_path, config), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["stage"] == "dpo" and report["tokens_per_rank"] == 2 * 2 * 1024
    assert all(s["bytes"]["reference"] == 0 for s in report["strategies"])
    config["model"]["objective"] = {"name": "dpo", "ref_model": "/a/folder"}
    plan_main(["--config", _write(tmp_path, config), "--json"])
    report = json.loads(capsys.readouterr().out)
    zero3 = next(s for s in report["strategies"] if s["key"] == "zero3")
    assert zero3["bytes"]["reference"] > 0


def test_reference_settings_on_a_stage_without_one_are_named() -> None:
    with pytest.raises(GymUserError) as found:
        plan("llama-3-8b", stage="orpo", precompute_ref_log_probs=True, reference_dtype="fp32")
    message = str(found.value)
    assert "precompute_ref_log_probs applies to the stages with a reference model (dpo, kto); stage orpo" in message
    assert "reference_dtype applies" in message
    with pytest.raises(GymUserError, match="reference_dtype must be one of auto, bf16, fp32, got 'fp16'"):
        plan("llama-3-8b", stage="dpo", reference_dtype="fp16")
