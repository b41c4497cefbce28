"""The preference objectives' frozen reference under every strategy (issue 57, item 2), on 2 real CPU ranks over gloo.

A DPO full finetune of a tiny Llama, in scenarios chosen so that each way a strategy holds the reference (whole,
FSDP2 shards, ZeRO-3 partitions, their initial-value copies) runs once, in as few fits as cover it:

- ``folder`` (every strategy: gym_ddp, gym_fsdp, zero1, zero2, zero3, zero3_offload): the reference is another
  pretrained folder (``ref_model``), loaded by the one loader: every rank reads only what it holds. 2 ranks x 2 pairs
  give each step's loss and TRL metrics of 1 process x 4 pairs (fp32, 1e-5); the reference is held as the policy
  (sharded: half of it on each rank; replicated: whole), never registered in the module; for one strategy per
  checkpoint format it is absent from the checkpoint, and ``gym export`` of the run writes the policy's tensors.
- ``initial`` (gym_ddp, gym_fsdp, zero2, zero3): the policy is randomly initialised, so the reference takes its
  initial values (``copy_of``, or the values gym_ddp's module remembered before Lightning restored a checkpoint): the
  first step's rewards are 0. Under gym_ddp and gym_fsdp the run killed by SIGKILL on rank 1 after its second step and
  resumed gives the uninterrupted run's losses and weights: the resume builds the reference again from the policy's
  initial values, not from the restored policy.
- LoRA (gym_ddp, gym_fsdp, zero2, zero3) and QLoRA (gym_fsdp, zero3): the reference is the base with the adapters
  off; no reference model is built.
- ``bf16-mixed`` (gym_fsdp, zero2, zero3): the reference's parameters in the policy's compute dtype.

One launch of two ranks runs everything (``reference_strategy_worker.py``): the killed runs in forked children of
the ranks (no launch each), then the other fits one after the other; the single-process runs run in this process.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.dist import free_port, run_ranks
from objective_harness import save_folder
from reference_strategy_worker import run, write_pairs

from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters

pytestmark = pytest.mark.slow
FSDP_HOLDS_4BIT = fsdp2_holds_integer_parameters()

STRATEGIES = ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3", "zero3_offload"]
SHARDED = {"gym_fsdp", "zero3", "zero3_offload"}
# One strategy per way of holding the reference and its initial values: whole (gym_ddp remembers the policy's
# initial values, zero2 copies them), FSDP2 shards, ZeRO-3 partitions. zero1 and offload hold it as zero2 and zero3.
INITIAL = ["gym_ddp", "gym_fsdp", "zero2", "zero3"]
CRASHED = ["gym_ddp", "gym_fsdp"]  # restored before on_fit_start (remembered values) and after it (copy_of)
EXPORTED = INITIAL  # one per checkpoint format: a file, torch distributed checkpoint, DeepSpeed stages 2 and 3
LORA = INITIAL
QLORA = ["gym_fsdp", "zero3"]  # 4-bit base codes sharded or partitioned (torch >= 2.13's FSDP2 shards integers)
BF16 = ["gym_fsdp", "zero2", "zero3"]
REFERENCE_DTYPE = ["gym_ddp", "gym_fsdp"]  # reference_dtype: bfloat16 beside an fp32 policy (32-true)
STEPS, KILL_STEP = 4, 2
LOSS_ATOL, METRIC_ATOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-6
WORKER = Path(__file__).with_name("reference_strategy_worker.py")


def specs(root: Path) -> dict[str, Any]:
    """The launch's spec: the killed runs, then every other 2-rank run; and the single-process runs."""
    common = {"devices": 2, "batch_size": 2, "data": str(root / "pairs.jsonl"), "cache": str(root / "cache")}
    common |= {"out": str(root / "out"), "model": str(root / "policy")}
    folder = {**common, "ref_model": str(root / "reference"), "steps": 3}
    initial = {**common, "pretrained": False, "steps": STEPS}
    lora = {**common, "lora": True, "steps": 3, "lr": 3e-2}
    qlora = {**lora, "module_args": {"quantization": {"compute_dtype": "float32"}, "torch_dtype": "float32"}}
    crashes = [
        {
            **initial,
            "name": f"{s}-crash",
            "strategy": s,
            "kill_step": KILL_STEP,
            "ckpt": f"{s}-ckpt",
            "port": free_port(),
        }
        for s in CRASHED
    ]
    runs = [{**folder, "name": f"{s}-folder", "strategy": s} for s in STRATEGIES]
    runs += [{**initial, "name": f"{s}-initial", "strategy": s} for s in INITIAL]
    runs += [{**initial, "name": f"{s}-resume", "strategy": s, "resume": True, "ckpt": f"{s}-ckpt"} for s in CRASHED]
    runs += [{**lora, "name": f"{s}-lora", "strategy": s} for s in LORA]
    runs += [{**lora, "name": "gym_fsdp-lora-bf16", "strategy": "gym_fsdp", "precision": "bf16-mixed", "steps": 1}]
    runs += [{**qlora, "name": f"{s}-qlora", "strategy": s} for s in QLORA if s != "gym_fsdp" or FSDP_HOLDS_4BIT]
    runs += [{**common, "name": f"{s}-bf16", "strategy": s, "precision": "bf16-mixed", "steps": 1} for s in BF16]
    asked = {**common, "reference_dtype": "bfloat16", "steps": 1}
    runs += [{**asked, "name": f"{s}-reference_dtype", "strategy": s} for s in REFERENCE_DTYPE]
    single = {"devices": 1, "batch_size": 4, "strategy": "single"}
    singles = [{**spec, **single, "name": name} for name, spec in (("folder", folder), ("initial", initial),
               ("lora", lora), ("qlora", qlora))]  # fmt: skip
    return {"out": common["out"], "crashes": crashes, "runs": runs, "singles": singles}


def launch(spec_path: Path, timeout: float = 900) -> None:
    """Both ranks started as torchrun starts them (Lightning starts no process; ``helpers.dist.run_ranks``)."""
    run_ranks([str(WORKER), str(spec_path)], timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run's results (``NAME.json``, ``NAME.pt``) and checkpoints, in one folder."""
    from gym_lightning import CausalLMDataModule

    root = tmp_path_factory.mktemp("reference_strategies")
    save_folder(root / "policy", seed=0)
    save_folder(root / "reference", seed=1)
    write_pairs(root / "pairs.jsonl")
    (root / "out").mkdir()
    spec = specs(root)
    # Tokenized once, here: the ranks and the forked children only read the cache.
    data = CausalLMDataModule(train_files=str(root / "pairs.jsonl"), tokenizer=str(root / "policy"),
                              format="preference", max_seq_length=32, cache_dir=str(root / "cache"))  # fmt: skip
    data.prepare_data()
    (root / "spec.json").write_text(json.dumps(spec))
    launch(root / "spec.json")
    for single in spec["singles"]:
        run(single, [0])
    return root / "out"


def load(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / f"{name}.json").read_text())


def assert_same_steps(two: dict[str, Any], one: dict[str, Any]) -> None:
    """Each step's loss and TRL metrics of 2 ranks equal those of 1 process (fp32)."""
    assert len(two["losses"]) == len(one["losses"]) > 0
    torch.testing.assert_close(two["losses"], one["losses"], rtol=0, atol=LOSS_ATOL)
    for step, (mine, theirs) in enumerate(zip(two["metrics"], one["metrics"], strict=True)):
        # logps/* are sums of ~50 in fp32 (one ulp: 3.8e-6): 1e-5 absolute, or 1e-6 of the value where larger.
        assert mine == pytest.approx(theirs, rel=1e-6, abs=METRIC_ATOL), f"step {step + 1}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_give_what_one_process_gives(results: Path, strategy: str) -> None:
    for scenario in ("folder", "initial") if strategy in INITIAL else ("folder",):
        assert_same_steps(load(results, f"{strategy}-{scenario}"), load(results, scenario))
    first = load(results, f"{strategy}-folder")["metrics"][0]
    assert abs(first["rewards/chosen"]) > 1e-3, "the reference is the other folder, not the policy"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_reference_is_held_as_the_policy(results: Path, strategy: str) -> None:
    """Sharded strategies hold half of the reference on each rank, as they hold the policy (ZeRO-3 its partitions,
    the gathered parameters released after each forward); the others hold it whole; one reference is built per fit
    and it is never a submodule of the LightningModule."""
    scenarios = ["folder"] + ["initial"] * (strategy in INITIAL) + ["resume"] * (strategy in CRASHED)
    for scenario in scenarios:
        result = load(results, f"{strategy}-{scenario}")
        assert result["builds"] == 1, scenario
        for rank in result["holdings"]:
            reference, policy = rank["reference"], rank["policy"]
            assert rank["provider"] == "FrozenCopy" and not rank["registered"]
            assert reference["full_numel"] == policy["full_numel"] > 0
            assert reference["numel"] == policy["numel"], "held as the policy is held"
            if strategy in SHARDED:
                # Half of every matrix; ZeRO-3 keeps the few small vectors (the norms: 0.3 % here) whole on every
                # rank once used, the policy's too (its persistence threshold).
                assert reference["numel"] < 0.51 * reference["full_numel"], "never whole on a rank that shards"
            else:
                assert reference["numel"] == reference["full_numel"]


def test_a_random_initialised_reference_takes_the_policy_s_initial_values(results: Path) -> None:
    for strategy in INITIAL:
        first = load(results, f"{strategy}-initial")["metrics"][0]
        assert first["rewards/chosen"] == pytest.approx(0, abs=1e-6), strategy
        assert first["rewards/rejected"] == pytest.approx(0, abs=1e-6), strategy


@pytest.mark.parametrize("strategy", CRASHED)
def test_sigkill_then_resume_matches_the_uninterrupted_run(results: Path, strategy: str) -> None:
    statuses = [json.loads((results / f"crashes-{rank}.json").read_text())[f"{strategy}-crash"] for rank in (0, 1)]
    assert os.WIFSIGNALED(statuses[1]) and os.WTERMSIG(statuses[1]) == signal.SIGKILL, statuses
    assert statuses[0] != 0, "rank 0 loses its peer"
    resumed, full = load(results, f"{strategy}-resume"), load(results, f"{strategy}-initial")
    assert resumed["global_step"] == full["global_step"] == STEPS
    assert len(resumed["losses"]) == STEPS - KILL_STEP
    torch.testing.assert_close(resumed["losses"], full["losses"][KILL_STEP:], rtol=1e-5, atol=1e-7)
    final, expected = (torch.load(results / f"{strategy}-{s}.pt", weights_only=True) for s in ("resume", "initial"))
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=WEIGHT_ATOL, msg=key)


def checkpoint_weight_names(path: Path) -> set[str]:
    """The names of the model tensors a checkpoint holds, in each strategy's format, without the module's prefix."""
    if path.is_file():  # gym_ddp: one file
        return {k.removeprefix("model.") for k in torch.load(path, weights_only=True)["state_dict"]}
    if (path / ".metadata").is_file():  # gym_fsdp: torch distributed checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k.removeprefix("state_dict.model.") for k in keys if k.startswith("state_dict.")}
    names: set[str] = set()  # DeepSpeed: every rank's module states (stage 3: the partitioned parameters' names)
    for file in (path / "checkpoint").glob("*model_states.pt"):
        state = torch.load(file, weights_only=True)
        names |= set(state["module"]) | {n for shapes in state.get("param_shapes") or [] for n in shapes}
    return {name.removeprefix("model.") for name in names}


@pytest.mark.parametrize("strategy", EXPORTED)
def test_checkpoints_hold_no_reference_and_export_writes_the_policy(
    results: Path, strategy: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from gym_lightning.commands.export import main as export_main

    final = torch.load(results / f"{strategy}-folder.pt", weights_only=True)
    checkpoint = results / f"{strategy}-folder" / "last.ckpt"
    assert checkpoint_weight_names(checkpoint.resolve()) == set(final), "only the policy's tensors"
    export_main(["--checkpoint", str(checkpoint), "--output_dir", str(tmp_path / "hf")])
    exported = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported and set(exported) <= set(final)
    for key, value in exported.items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=0, msg=key)
    trained = load_file(results.parent / "policy" / "model.safetensors")
    assert any(not torch.equal(trained[k], v) for k, v in exported.items() if k in trained), "the policy trained"


@pytest.mark.parametrize(("strategy", "kind"), [(s, "lora") for s in LORA] + [(s, "qlora") for s in QLORA])
def test_lora_s_reference_is_the_base_with_the_adapters_off(results: Path, strategy: str, kind: str) -> None:
    """LoRA and QLoRA (NF4 base codes, fp32 compute): the reference is the base with the adapters off, no copy."""
    if kind == "qlora" and strategy == "gym_fsdp" and not FSDP_HOLDS_4BIT:
        pytest.skip("torch < 2.13's FSDP2 cannot shard 4-bit codes: gym_fsdp refuses QLoRA (tests/quant)")
    result = load(results, f"{strategy}-{kind}")
    assert result["builds"] == 0, "no second copy of the model"
    assert {rank["provider"] for rank in result["holdings"]} == {"AdaptersOff"}
    assert all(rank["reference"]["numel"] == 0 for rank in result["holdings"])
    assert_same_steps(result, load(results, kind))
    assert load(results, kind)["metrics"][-1]["rewards/margins"] != 0, "the adapters moved the policy"


def test_a_lora_run_under_bf16_mixed_trains_under_gym_fsdp(results: Path) -> None:
    """A LoRA run's first forward is its reference's, adapters off: gym_fsdp initialises FSDP2 before it (otherwise
    FSDP2 found nothing trainable then and the first backward failed: "attempting to assign a gradient with dtype
    BFloat16 to a tensor with grad_dtype Float")."""
    result = load(results, "gym_fsdp-lora-bf16")
    assert {rank["provider"] for rank in result["holdings"]} == {"AdaptersOff"}
    assert result["metrics"][0]["rewards/chosen"] == result["metrics"][0]["rewards/rejected"] == 0


@pytest.mark.parametrize("strategy", BF16)
def test_under_bf16_mixed_the_reference_holds_the_policy_s_compute_weights(results: Path, strategy: str) -> None:
    """gym_fsdp and DeepSpeed compute in bf16 weights under ``bf16-mixed`` (FSDP gathers them in bf16, DeepSpeed's
    engine keeps them so): the reference stores its parameters in bf16 (half the bytes of fp32), its buffers (the
    rotary ``inv_freq``) in fp32, and a reference of the policy's own folder gives the policy's log-probabilities: the
    first step's rewards are 0."""
    result = load(results, f"{strategy}-bf16")
    for rank in result["holdings"]:
        assert rank["reference"]["dtypes"] == ["torch.bfloat16"], rank
        assert rank["reference"]["buffer_dtypes"] == ["torch.float32"], rank
    first = result["metrics"][0]
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0, first


@pytest.mark.parametrize("strategy", REFERENCE_DTYPE)
def test_reference_dtype_stores_the_reference_in_it_beside_an_fp32_policy(results: Path, strategy: str) -> None:
    """``reference_dtype: bfloat16`` under ``32-true``: the reference's parameters in bf16 (whole under gym_ddp, half
    on each rank under gym_fsdp, which also gathers them in bf16), the policy's in fp32; the reference of the policy's
    own folder then differs from the policy by bf16's rounding only."""
    result = load(results, f"{strategy}-reference_dtype")
    for rank in result["holdings"]:
        assert rank["reference"]["dtypes"] == ["torch.bfloat16"], rank
        assert rank["policy"]["dtypes"] == ["torch.float32"], rank
    first = result["metrics"][0]
    assert 0 < abs(first["rewards/chosen"]) < 0.05, first
