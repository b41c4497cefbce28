"""LoRA on the experts of a mixture of experts on 2 real CPU ranks (gloo, fp32): gym_ddp, gym_fsdp and zero3 train
like one process, a SIGKILLed run resumes exactly, each MoE block (adapters included) is one ZeRO-3 leaf and each
decoder layer (adapters included) one FSDP unit.

This file is also the worker: ``python tests/strategies/test_expert_lora_ranks.py SPEC.json`` runs the spec's runs
one after the other in one set of processes (see ``launch``).

Models (``helpers.families``, loaded in fp32): Qwen3-MoE with the experts alone adapted (``all-experts``: 8 routed
experts, top-2, both fused 3-D weights of each block), and DeepSeek-V3 with the experts and its attention adapted
(routed experts, the shared expert's three linear layers wrapped by parameter, q_b_proj / kv_b_proj; a dense first
layer and multi-head latent attention). Scenario (the data of checkpointing/test_world_size.py): 24 prompt/completion
pairs, the same global batch of 8 samples on both layouts (2 ranks x 2 samples x accumulate 2, or 1 rank x 2 samples
x accumulate 4), 3 optimizer steps per epoch, 2 epochs, AdamW with weight decay and a linear schedule with warm-up.

Tolerance: every optimizer step sees the same samples on both layouts, so losses and gradients are the same sums
taken in another order; the issue asks for 1e-5. Measured (lr 3e-3): at most 5.4e-7 on losses and 4.5e-7 on weights
after 6 AdamW steps, every strategy. At lr 3e-2 Adam's division by sqrt(v) magnified those ulps to 1.2e-5 (3.1e-5
under ZeRO-3) on the first block's lora_A, whose gradients start near 0 (lora_B starts at 0). A wrong reduction (an
expert's adapter gradient reduced on one rank only, a missing world-size factor) moves both by >= 1e-3. Resume runs
the same operations in the same order: measured bit-exact, asserted to 1e-6. One 2-rank launch per killed run, one
for the rest: ~60 s on 2 CPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

# The kill/resume scenario's data; the optimizer-step loss recorder of the world-size tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpointing"))

PARITY_ATOL, RESUME_ATOL = 1e-5, 1e-6
KILL_AT_STEP, KILL_AT_BATCH = 4, 3
ACCUMULATION = {1: 4, 2: 2}  # ranks -> accumulation for the same global batch of 8 samples
STRATEGIES = ("gym_ddp", "gym_fsdp", "zero3")
# variant -> (family, LoRA settings beyond r=4, alpha=8)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "experts": ("qwen3_moe", {"target_parameters": ["all-experts"]}),
    "attention": ("deepseek_v3", {"target_parameters": ["all-experts"], "target_modules": ["q_b_proj", "kv_b_proj"]}),
}
# DeepSeek-V3's latent attention has as many key/value heads as query heads (the real config: 128 and 128); the
# family matrix's tiny config says 2 for 4, which transformers' SDPA path refuses on a padded batch ("size of tensor
# a (4) must match ... (8)"; these runs pad, the matrix's do not).
OVERRIDES = {"deepseek_v3": {"num_key_value_heads": 4}}
KILLED = (("zero3", "attention"), ("gym_fsdp", "experts"))


# ------------------------------------------------------------------------------------------------------ worker
def build_strategy(name: str) -> Any:
    from gym_lightning.strategies import GymDDPStrategy, GymFSDPStrategy, ZeROStrategy

    timeout = timedelta(seconds=60)  # a killed peer must not keep the survivor waiting 30 minutes
    if name == "gym_ddp":
        return GymDDPStrategy(timeout=timeout)
    if name == "gym_fsdp":
        return GymFSDPStrategy(timeout=timeout)
    return ZeROStrategy(stage=3, timeout=timeout)


class Structure(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """What the strategy made of the adapted model, seen at the first forward of each MoE block's experts module:
    the ZeRO-3 leaf modules and whether all of the block's parameters (adapters included) were gathered together;
    the FSDP units and whether each decoder layer's unit manages all of the layer's parameters."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {"gathered": [], "leaves": [], "blocks": [], "units": []}
        self._hooks: list[Any] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from gym_lightning.models.moe import moe_blocks

        model = pl_module.model
        names = {id(m): n for n, m in model.named_modules()}
        blocks = moe_blocks(model)
        self.seen["blocks"] = [names[id(b)] for b in blocks]
        self.seen["leaves"] = [n for n, m in model.named_modules() if getattr(m, "_z3_leaf", False)]
        self.seen["adapters_in_blocks"] = [sum("lora_" in n for n, _ in b.named_parameters()) for b in blocks]
        self.seen["units"] = _fsdp_units(model, names)
        if hasattr(next(model.parameters()), "ds_status"):
            for block in blocks:
                self._hooks.append(block.experts.register_forward_pre_hook(self._gathered(names[id(block)], block)))

    def _gathered(self, name: str, block: torch.nn.Module) -> Any:
        def hook(*_: Any) -> None:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            if len(self.seen["gathered"]) < len(self._hooks):  # the first step is enough
                statuses = {p.ds_status for p in block.parameters()}
                self.seen["gathered"].append([name, statuses == {ZeroParamStatus.AVAILABLE}])

        return hook

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for hook in self._hooks:
            hook.remove()


def _fsdp_units(model: torch.nn.Module, names: dict[int, str]) -> list[list[Any]]:
    """Each FSDP unit: its module's name, its class, how many of its managed parameters are adapters, and whether
    it manages every parameter below it that no unit further down manages."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        managed = {id(p.sharded_param) for p in (group.fsdp_params if group else [])}
        inner_units = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
        inner = {id(p) for m in inner_units for p in m.parameters()}
        own = {id(p): n for n, p in module.named_parameters() if id(p) not in inner}
        adapters = sum("lora_" in n for i, n in own.items() if i in managed)
        units.append([names[id(module)], type(module).__name__, adapters, set(own) == managed])
    return units


def seeded_module_and_data(run: dict[str, Any]) -> tuple[Any, Any]:
    """The run every phase trains (seeded): CausalLMModule on the family folder, fp32, expert LoRA; the data."""
    import lightning.pytorch as pl

    from gym_lightning import CausalLMDataModule, CausalLMModule, LoRAArgs

    pl.seed_everything(7, workers=True)
    lora = LoRAArgs(r=4, alpha=8, **VARIANTS[run["variant"]][1])
    module = CausalLMModule(
        model=run["model_dir"], tokenizer=run["model_dir"], torch_dtype="float32", lr=3e-3, weight_decay=0.01,
        scheduler="linear", warmup_steps=2, min_lr_ratio=0.1, lora=lora,
    )  # fmt: skip
    data = CausalLMDataModule(
        train_files=run["train_file"], tokenizer=run["model_dir"], batch_size=2, max_seq_length=32
    )
    return module, data


def run_phase(run: dict[str, Any], phase: str) -> dict[str, Any]:
    """One ``Trainer.fit``: ``one`` (1 process), ``two`` (2 ranks), ``crash`` (2 ranks, rank 1 killed), ``resume``."""
    import lightning.pytorch as pl
    from test_resume import KillRank, save_final_weights
    from test_world_size import StepLosses

    from gym_lightning.checkpointing import StepCheckpoint

    out = Path(run["out"])
    devices = 1 if phase == "one" else 2
    module, data = seeded_module_and_data(run)
    recorder, structure = StepLosses(), Structure()
    callbacks = [recorder, structure]
    if phase in ("crash", "resume"):
        callbacks.append(StepCheckpoint(dirpath=out / "ckpt", every_n_steps=1, keep_last=2))
    if phase == "crash":
        callbacks.append(KillRank(1, KILL_AT_STEP, KILL_AT_BATCH))  # SIGKILL: no Python cleanup, no handler runs
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=build_strategy(run["strategy"]) if devices > 1 else "auto",
        precision="32-true", max_epochs=2, accumulate_grad_batches=ACCUMULATION[devices], callbacks=callbacks,
        logger=False, enable_checkpointing=phase in ("crash", "resume"), default_root_dir=out,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last" if phase == "resume" else None)
    save_final_weights(trainer, module, out / f"{phase}.pt")
    return {"losses": recorder.losses, "global_step": trainer.global_step, **structure.seen}


def worker_main(spec_path: str) -> None:
    """Run each of the spec's ``runs`` (a strategy, a variant, its folder, its phases) in these processes."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    for run in spec["runs"]:
        results = {phase: run_phase(run, phase) for phase in run["phases"]}
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            (Path(run["out"]) / f"results-{spec['launch']}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------------ tests
def family_folder(family: str, folder: Path) -> Path:
    """``helpers.families.make_family_folder`` with this file's ``OVERRIDES``: a tiny random bf16 folder."""
    from helpers.families import TOKENIZER, family_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = family_config(family, **OVERRIDES.get(family, {}))
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def launch(out: Path, name: str, runs: list[dict[str, Any]], check: bool = True) -> list[dict[str, Any]] | None:
    """One set of processes (2 ranks when a phase asks for 2) for ``runs``; their results (``check``: it must end
    well; else the killed launch's results are not read). A killed run starts its ranks as users do (Lightning's
    launcher re-runs this file for rank 1), the others as torchrun would (``helpers.dist.run_ranks``)."""
    from helpers.dist import rank_env, run_ranks

    path = out / f"spec-{name}.json"
    path.write_text(json.dumps({"launch": name, "runs": runs}))
    if check:
        run_ranks([__file__, str(path)], timeout=900, nproc=1 if name == "one" else 2)
        return [json.loads((Path(run["out"]) / f"results-{name}.json").read_text()) for run in runs]
    proc = subprocess.run(
        [sys.executable, __file__, str(path)], env=rank_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode != 0, f"{name}: the killed run should fail"
    return None


@pytest.fixture(scope="module")
def expert_runs(pretrained: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four launches: the 1-process references; each killed run (the kill ends its processes); then every 2-rank
    run and the resumes in one more."""
    root = tmp_path_factory.mktemp("expert_lora")
    train_file = str(pretrained[1])
    folders = {v: str(family_folder(family, root / family)) for v, (family, _) in VARIANTS.items()}

    def run(strategy: str, variant: str, phases: list[str]) -> dict[str, Any]:
        out = root / f"{strategy}-{variant}"
        out.mkdir(exist_ok=True)
        return {"strategy": strategy, "variant": variant, "model_dir": folders[variant], "train_file": train_file,
                "out": str(out), "phases": phases}  # fmt: skip

    one = launch(root, "one", [run("single", v, ["one"]) for v in VARIANTS])
    killed_at = {}
    for strategy, variant in KILLED:
        launch(root, f"crash-{strategy}", [run(strategy, variant, ["crash"])], check=False)
        killed_at[strategy, variant] = os.readlink(root / f"{strategy}-{variant}" / "ckpt" / "last.ckpt")
    runs = [run(s, v, ["two", "resume"] if (s, v) in KILLED else ["two"]) for s in STRATEGIES for v in VARIANTS]
    two = launch(root, "two", runs)
    results = {("single", v): r for v, r in zip(VARIANTS, one, strict=True)}
    results |= {(r["strategy"], r["variant"]): res for r, res in zip(runs, two, strict=True)}
    for pair, link in killed_at.items():
        results[pair]["killed_at"] = link
    return {"root": root, "results": results, "folders": folders}


def _weights(runs: dict[str, Any], strategy: str, variant: str, phase: str) -> dict[str, torch.Tensor]:
    return torch.load(runs["root"] / f"{strategy}-{variant}" / f"{phase}.pt", weights_only=True)


def _assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=f"weights differ at {key}")


def test_checkpoint_keys_drop_every_wrapper_of_an_experts_module_with_two_targets() -> None:
    from gym_lightning.lora import checkpoint_key

    # One experts module adapted in 2 weights nests 2 peft wrappers; the sharded loaders (gym_fsdp, zero3) looked
    # for "...experts.base_layer.gate_up_proj" in the folder and refused the run.
    nested = "base_model.model.model.layers.1.mlp.experts.base_layer.base_layer.gate_up_proj"
    assert checkpoint_key(nested) == "base_model.model.model.layers.1.mlp.experts.gate_up_proj"
    assert checkpoint_key("model.q_proj.base_layer.weight") == "model.q_proj.weight"


def test_a_moe_leaf_block_with_adapters_gets_inputs_that_require_grad() -> None:
    from deepspeed.utils import get_z3_leaf_modules
    from peft import get_peft_model

    from gym_lightning.lora import LoRAArgs, peft_lora_config
    from gym_lightning.models.experts import expert_targets, install_routed_experts
    from gym_lightning.strategies.zero.leaf import mark_moe_leaf_modules

    model = family_model("qwen3_moe")
    targets = expert_targets(model)
    model = get_peft_model(model, peft_lora_config(LoRAArgs(r=2, target_parameters=["all-experts"]), targets))
    install_routed_experts(model)
    mark_moe_leaf_modules(model)
    blocks = get_z3_leaf_modules(model)
    assert len(blocks) == 2 and all(any("lora_A" in n for n, _ in b.named_parameters()) for b in blocks)
    seen: list[bool] = []
    for block in blocks:
        block.experts.register_forward_pre_hook(lambda module, args: seen.append(args[0].requires_grad))
    ids = torch.tensor([[5, 9, 12, 40]])
    model(input_ids=ids, use_cache=False)  # frozen embeddings and attention: nothing upstream requires grad
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert seen == [True, True, False, False], "DeepSpeed's leaf backward hook would fire before the block's backward"
    hooks = [len(b._forward_pre_hooks) for b in blocks]
    mark_moe_leaf_modules(model)  # fit, then validate: still one hook per block
    assert [len(b._forward_pre_hooks) for b in blocks] == hooks == [1, 1]


def family_model(family: str) -> torch.nn.Module:
    """A tiny random fp32 ``family`` model (``helpers.families``), built in this process."""
    from helpers.families import family_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_with_expert_lora_train_like_one_process(
    strategy: str, variant: str, expert_runs: dict[str, Any]
) -> None:
    single, two = expert_runs["results"]["single", variant]["one"], expert_runs["results"][strategy, variant]["two"]
    assert single["global_step"] == two["global_step"] == 6 and len(two["losses"]) == 6
    torch.testing.assert_close(two["losses"], single["losses"], rtol=0, atol=PARITY_ATOL)
    expected = _weights(expert_runs, "single", variant, "one")
    _assert_close_weights(_weights(expert_runs, strategy, variant, "two"), expected, PARITY_ATOL)
    # The expert adapters trained (lora_B starts at 0), every expert's; the base experts stayed frozen.
    experts_b = {k: v for k, v in expected.items() if ".experts." in k and ".lora_B." in k}
    assert experts_b and all(v.abs().max() > 1e-3 for v in experts_b.values()), "the expert adapters trained"
    source = AutoModelState(expert_runs["folders"][variant])
    base = [k for k in expected if k.endswith("experts.base_layer.base_layer.gate_up_proj")]
    assert base and all(torch.equal(expected[k], source.gate_up_proj(k)) for k in base), "the experts stayed frozen"
    if variant == "attention":
        assert any("shared_experts.gate_proj.lora_B" in k for k in expected)
        assert any("q_b_proj.lora_B" in k for k in expected)


class AutoModelState:
    """The source folder's fused expert weights as transformers loads them (fp32), by the run's state-dict key."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoModelForCausalLM

        self.state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()

    def gate_up_proj(self, key: str) -> torch.Tensor:
        return self.state[key.removeprefix("base_model.model.").replace(".base_layer", "")]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "variant"), KILLED)
def test_expert_lora_killed_and_resumed_matches_uninterrupted(
    strategy: str, variant: str, expert_runs: dict[str, Any]
) -> None:
    run = expert_runs["results"][strategy, variant]
    assert run["killed_at"] == "step-00000004.ckpt", "the killed run's last checkpoint"
    resumed, full = run["resume"], run["two"]
    # The resume continues the step-4 checkpoint: steps 5 and 6 (epoch 1, from its second optimizer step).
    assert resumed["global_step"] == 6 and len(resumed["losses"]) == 2
    torch.testing.assert_close(resumed["losses"], full["losses"][4:], rtol=0, atol=RESUME_ATOL)
    final = _weights(expert_runs, strategy, variant, "resume")
    _assert_close_weights(final, _weights(expert_runs, strategy, variant, "two"), RESUME_ATOL)
    assert any(".experts.lora_A." in k for k in final) and any(".experts.base_layer.lora_B." in k for k in final)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_zero3_gathers_each_moe_block_with_its_expert_adapters_as_one_leaf(
    variant: str, expert_runs: dict[str, Any]
) -> None:
    seen = expert_runs["results"]["zero3", variant]["two"]
    layers = [0, 1] if variant == "experts" else [1]  # DeepSeek-V3's first layer is dense here
    blocks = [f"base_model.model.model.layers.{i}.mlp" for i in layers]
    assert seen["blocks"] == blocks and seen["leaves"] == blocks, seen
    # 2 targets x (A, B) on the routed experts; DeepSeek's shared expert: 3 linear layers x (A, B)
    assert seen["adapters_in_blocks"] == [4 if variant == "experts" else 10] * len(blocks)
    assert seen["gathered"] == [[name, True] for name in blocks], "a block's parameters were not all gathered at once"


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp_shards_each_decoder_layer_with_its_expert_adapters_as_one_unit(
    variant: str, expert_runs: dict[str, Any]
) -> None:
    units = expert_runs["results"]["gym_fsdp", variant]["two"]["units"]
    layers = {u[0]: u for u in units if ".layers." in u[0]}
    assert sorted(layers) == [f"base_model.model.model.layers.{i}" for i in (0, 1)], units
    assert all(u[3] for u in units), f"a unit does not manage all of its own parameters: {units}"
    # Every adapter is managed by its decoder layer's unit: none by an inner unit or the root.
    # DeepSeek-V3's layer 0 is dense: attention only (q_b_proj, kv_b_proj, 2 factors each); layer 1: those, the
    # routed experts' 2 targets and the shared expert's 3 linear layers.
    per_layer = {0: 4, 1: 4} if variant == "experts" else {0: 4, 1: 14}
    assert {int(n.rsplit(".", 1)[1]): u[2] for n, u in layers.items()} == per_layer
    assert sum(u[2] for u in units) == sum(per_layer.values()), units
    layer_class = "FSDPQwen3MoeDecoderLayer" if variant == "experts" else "FSDPDeepseekV3DecoderLayer"
    assert {u[1] for u in layers.values()} == {layer_class}


if __name__ == "__main__":
    worker_main(sys.argv[1])
