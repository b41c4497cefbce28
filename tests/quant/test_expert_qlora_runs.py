"""QLoRA on the experts of a mixture of experts through the user's path: ``gym fit`` of the shipped YAMLs with
``model.quantization`` and ``lora.target_parameters: [all-experts]`` on a tiny Qwen3-MoE folder (8 experts, top-2,
both fused 3-D expert weights of each block in NF4), one process and 2 CPU ranks under gym_ddp, gym_fsdp and ZeRO-3;
a ZeRO-3 run SIGKILLed mid-step and resumed; and configs/moe_qlora.yaml itself, trained and exported.

As in test_qlora_runs.py the runs hold everything in fp32 (``32-true``, ``torch_dtype`` and ``compute_dtype``
float32) so that the strategies can be compared tightly: the same global batch of 8 samples (1 rank x accumulate 4,
or 2 ranks x accumulate 2), 4 AdamW steps, a checkpoint every 2. Every rank quantises the experts it holds to the
codes one process makes (``quant.nf4`` keeps all state per row), so the loaded models agree bit for bit; the steps
then sum the same gradients in another order (measured: 2.4e-7 on logits, 2.7e-6 on adapters, Adam's first steps
scaling rounding noise in near-zero gradients up; 1e-5 is far below what a lost gradient, e.g. one expert's adapter
reduced on one rank, moves). The tiny model is 64 wide with 32-wide expert down projections: ``block_size: 32``
holds both expert weights in NF4 (the default 64 would leave ``down_proj`` 16-bit).

Resume: the ZeRO-3 run (the strategy that partitions the integer expert codes across ranks and gathers them per MoE
block) is killed by SIGKILL on rank 1 in the middle of step 4, one step after the step-2 checkpoint, then resumed with
``ckpt_path: last``: the same operations in the same order as the uninterrupted run (measured: bit for bit), 1e-6.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers.cli_runs import fit_in_one_launch, shipped_recipe
from helpers.families import PROBE_IDS, family_run_config, make_family_folder
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gym_lightning.checkpointing.reading import read_checkpoint
from gym_lightning.quant import nf4
from gym_lightning.strategies.fsdp import fsdp2_holds_integer_parameters

pytestmark = pytest.mark.slow
# torch < 2.13's FSDP2 cannot shard integer parameters: gym_fsdp refuses a 4-bit base there (test_qlora_runs.py), and
# configs/moe_qlora.yaml (gym_fsdp) runs under zero3, the alternative its header names.
FSDP_HOLDS_4BIT = fsdp2_holds_integer_parameters()
STRATEGIES = ("gym_ddp", "gym_fsdp", "zero3") if FSDP_HOLDS_4BIT else ("gym_ddp", "zero3")
BLOCK = 32  # divides both expert widths of the tiny folder (h = 64, moe_intermediate_size = 32)
FP32 = {
    "trainer.precision": "32-true",
    "model.torch_dtype": "float32",
    "model.lora.target_parameters": ["all-experts"],  # beside helpers.cli_runs' q_proj / v_proj adapters
    "model.quantization": {"compute_dtype": "float32", "block_size": BLOCK},
    # No router load-balancing loss (helpers.families asks for it): it is a product of two means over each
    # micro-batch, and one process's micro-batches (samples 0-1, 2-3, ...) are not the 2 ranks' (0 and 2, 1 and 3,
    # ...), so with it the layouts train different losses (measured: adapters 5.6e-4 apart after 4 steps, 2.7e-6
    # without it).
    "model.config_overrides": {"output_router_logits": False},
    "model.lr": 3e-3,
    "trainer.max_steps": 4,
    "data.batch_size": 2,
}
ONE_PROCESS = {"trainer.devices": 1, "trainer.strategy": "auto", "trainer.accumulate_grad_batches": 4}
TWO_RANKS = {"trainer.accumulate_grad_batches": 2}
SAME_RUN, RESUMED = 1e-5, 1e-6
# Rank 1 dies at the start of micro-batch 7 (the second of step 4, global_step 3): after the step-2 checkpoint.
KILL = {"rank": 1, "step": 3, "batch": 7}
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _with_callbacks(config: Path, name: str, extra: list[dict[str, Any]], **top: Any) -> Path:
    """``config`` written again beside it as ``name`` with ``extra`` trainer callbacks and ``top`` level keys."""
    loaded = yaml.safe_load(config.read_text())
    loaded["trainer"]["callbacks"] = [*loaded["trainer"]["callbacks"], *extra]
    path = config.with_name(name)
    path.write_text(yaml.safe_dump({**loaded, **top}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three launches: the 1-process reference; the ZeRO-3 run killed mid-step (the kill ends its processes); every
    2-rank run, the resume and the shipped recipe together."""
    root = tmp_path_factory.mktemp("expert-qlora")
    folder = make_family_folder("qwen3_moe", root / "qwen3_moe")
    outs = {name: root / name for name in ("one", *STRATEGIES, "killed", "recipe")}

    def config(strategy: str, name: str, **changes: Any) -> Path:
        return family_run_config("qwen3_moe", strategy, True, folder, outs[name], step_losses=True, **FP32, **changes)

    fit_in_one_launch([config("gym_ddp", "one", **ONE_PROCESS)], nproc=1)
    killed = config("zero3", "killed", **TWO_RANKS)
    crash = _with_callbacks(killed, "crash.yaml", [{"class_path": "helpers.faults.KillRank", "init_args": KILL}])
    with pytest.raises(AssertionError) as died:
        fit_in_one_launch([crash])
    checkpoints = outs["killed"] / "checkpoints"
    left = {"log": str(died.value)[-3000:], "last": os.readlink(checkpoints / "last.ckpt")}
    resume = _with_callbacks(killed, "resume.yaml", [], ckpt_path="last")
    # configs/moe_qlora.yaml as a user points it at the folder: 2 steps in bf16-mixed on CPU, short rows, blocks of 32.
    shipped = yaml.safe_load((Path(__file__).parents[2] / "configs" / "moe_qlora.yaml").read_text())
    recipe = shipped_recipe(
        "moe_qlora",
        outs["recipe"],
        trainer={"accumulate_grad_batches": 1, **({} if FSDP_HOLDS_4BIT else {"strategy": "zero3"})},
        model={
            "model": str(folder),
            "tokenizer": str(folder),
            "quantization": {**shipped["model"]["quantization"], "block_size": BLOCK},
        },
        data={"batch_size": 2, "max_seq_length": 32},
    )
    fit_in_one_launch([*(config(s, s, **TWO_RANKS) for s in STRATEGIES), resume, recipe])
    return {"folder": folder, "killed_left": left, **outs}


def _probe(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "logits.pt", weights_only=True)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "hf-adapter" / "adapter_model.safetensors")


def _is_expert_adapter(key: str) -> bool:
    return ".mlp.experts." in key and (".lora_A." in key or ".lora_B." in key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_train_nf4_experts_as_one_process(strategy: str, runs: dict[str, Any]) -> None:
    one, two, runs_of = _probe(runs["one"]), _probe(runs[strategy]), ("one", strategy)
    assert torch.equal(two["start"], one["start"]), "every strategy loads the same 4-bit experts"
    torch.testing.assert_close(two["end"], one["end"], rtol=0, atol=SAME_RUN)
    assert (one["end"] - one["start"]).abs().max() > 1e-3, "the adapters trained"
    # Each micro-batch's share of its step's loss: the 4 steps' losses are the sums of 4 (one process) or 2 shares.
    steps = {name: torch.load(runs[name] / "losses.pt", weights_only=True).view(4, -1).sum(1) for name in runs_of}
    torch.testing.assert_close(steps[strategy], steps["one"], rtol=0, atol=SAME_RUN)
    adapters = {name: _adapter(runs[name]) for name in ("one", strategy)}
    assert adapters["one"].keys() == adapters[strategy].keys()
    experts_b = [k for k in adapters["one"] if _is_expert_adapter(k) and ".lora_B." in k]
    assert len(experts_b) == 4, "gate_up_proj and down_proj adapted in both MoE blocks"
    assert all(adapters["one"][k].abs().max() > 1e-4 for k in experts_b), "the expert adapters trained"
    for key, value in adapters["one"].items():
        torch.testing.assert_close(adapters[strategy][key], value, rtol=0, atol=SAME_RUN, msg=key)


def test_the_loaded_model_is_the_source_with_nf4_experts(runs: dict[str, Any]) -> None:
    """The start logits are those of the source with every linear layer but lm_head and both fused expert weights
    of every block rounded to NF4 (the router stays as it is)."""
    reference = AutoModelForCausalLM.from_pretrained(runs["folder"], dtype=torch.float32)
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.weight.data = nf4.dequantize(nf4.quantize(module.weight.data, BLOCK, True), torch.float32)
        for weight in EXPERT_WEIGHTS if name.endswith("mlp.experts") else ():
            fused = getattr(module, weight)
            fused.data = nf4.dequantize(nf4.quantize(fused.data, BLOCK, True), torch.float32)
    with torch.no_grad():
        expected = reference.eval()(input_ids=PROBE_IDS, use_cache=False).logits
    torch.testing.assert_close(_probe(runs["one"])["start"], expected, rtol=0, atol=1e-5)


def _assert_codes_are_the_source_quantised(checkpoint: Path, source: dict[str, torch.Tensor]) -> None:
    """Every fused expert weight in ``checkpoint`` (any strategy's format) is the NF4 quantisation of the source's,
    codes, scales and their statistics bit for bit."""
    stored = read_checkpoint(checkpoint).tensors
    for layer in (0, 1):
        prefix = f"model.base_model.model.model.layers.{layer}.mlp.experts.base_layer.base_layer."
        for weight in EXPERT_WEIGHTS:
            quantized = nf4.quantize(source[f"model.layers.{layer}.mlp.experts.{weight}"], BLOCK, True)
            for suffix, part in (("", "codes"), ("_scales", "scales"), ("_scale_stats", "scale_stats")):
                value = stored[prefix + weight + suffix].load()
                assert torch.equal(value, quantized[part]), f"{checkpoint}: layer {layer} {weight}{suffix}"


@pytest.fixture(scope="module")
def source(runs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The source folder's fused expert weights as transformers loads them (bf16, as saved)."""
    return AutoModelForCausalLM.from_pretrained(runs["folder"], dtype=torch.bfloat16).state_dict()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_checkpoint_holds_the_nf4_expert_codes_of_the_source(
    strategy: str, runs: dict[str, Any], source: dict[str, torch.Tensor]
) -> None:
    _assert_codes_are_the_source_quantised(runs[strategy] / "checkpoints" / "last.ckpt", source)


def test_a_zero3_run_killed_mid_step_resumes_as_the_uninterrupted_one(
    runs: dict[str, Any], source: dict[str, torch.Tensor]
) -> None:
    """The killed run's last checkpoint is step 2; resumed from it, steps 3 and 4 give the uninterrupted run's
    losses and adapters, and the frozen NF4 expert codes are the source's quantisation in the checkpoint the killed
    run wrote and in the one the resume wrote."""
    assert runs["killed_left"]["last"] == "step-00000002.ckpt", runs["killed_left"]["log"]
    resumed, full = runs["killed"], runs["zero3"]
    losses = {run: torch.load(run / "losses.pt", weights_only=True) for run in (resumed, full)}
    assert losses[resumed].shape == (4,), "the resume trains the 4 micro-batches of steps 3 and 4"
    torch.testing.assert_close(losses[resumed], losses[full][-4:], rtol=1e-5, atol=RESUMED)
    adapters = {run: _adapter(run) for run in (resumed, full)}
    assert adapters[resumed].keys() == adapters[full].keys() and any(map(_is_expert_adapter, adapters[full]))
    for key, value in adapters[full].items():
        torch.testing.assert_close(adapters[resumed][key], value, rtol=0, atol=RESUMED, msg=key)
    for step in ("step-00000002.ckpt", "step-00000004.ckpt"):  # written before the kill; written by the resume
        _assert_codes_are_the_source_quantised(resumed / "checkpoints" / step, source)


def test_the_shipped_moe_qlora_recipe_trains_and_exports_expert_adapters(runs: dict[str, Any]) -> None:
    """configs/moe_qlora.yaml (bf16-mixed, dropout 0.05, all-linear and all-experts) trains and its export section
    (``lora: adapter``) writes PEFT files holding both expert weights' adapters of every MoE block, which peft loads
    on the original 16-bit base."""
    from peft import PeftModel

    exported = runs["recipe"] / "hf"
    adapters = load_file(exported / "adapter_model.safetensors")
    experts = sorted(k for k in adapters if _is_expert_adapter(k))
    assert len(experts) == 8, f"(A, B) x (gate_up_proj, down_proj) x 2 blocks: {experts}"
    assert not any(".mlp.gate." in k for k in adapters), "the router stays frozen"
    on_source = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["folder"]), exported)
    loaded = [n for n, _ in on_source.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(loaded) == 4, loaded
