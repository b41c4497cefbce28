"""Sharded loading (gym_fsdp builds on the meta device and each rank loads only its shards) and fp32 master weights
under ``bf16-mixed`` for every strategy, on 2 CPU ranks, from a checkpoint saved in bf16."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.dist import HELPERS, run_ranks
from helpers.strategy_worker import TINY_OVERRIDES
from safetensors.torch import load_file, save_file

from gym_lightning import CausalLMDataModule, CausalLMModule
from gym_lightning.errors import GymUserError
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.models.plan import META, BuildPlan, WeightsSource, reference_state_dict
from gym_lightning.strategies.materialize import has_meta_tensors, materialize


def source_of(plan: BuildPlan, model: torch.nn.Module) -> WeightsSource | None:
    """What ``plan`` recorded for ``model`` (``None``: nothing, an ordinary build)."""
    return next((source for built, source in plan.built if built is model), None)


BF16_MIXED_STRATEGIES = ["gym_ddp", "gym_fsdp", "zero1", "zero2", "zero3", "zero2_offload"]
# The module itself holds the fp32 master weights (DeepSpeed's engine keeps bf16 module weights and fp32 partitions).
MODULE_HOLDS_MASTER = {"gym_ddp", "gym_fsdp"}
# Each builds a random initialisation its own way (gym_ddp, zero1/2: eagerly on every rank; gym_fsdp: meta, then
# scattered from rank 0; zero3: under zero.Init, then replaced): all must start from the same weights.
RANDOM_INIT_PEERS = ["zero1", "zero2", "zero3"]


def save_bf16_pretrained(folder: Path) -> Path:
    """A tiny Llama with HF's initialisation saved in bf16 (config ``dtype: bfloat16``), as most hub models are."""
    from gym_lightning.tokenizer import load_tokenizer

    torch.manual_seed(0)
    model = build_causal_lm("tiny-llama", config_overrides=TINY_OVERRIDES).to(torch.bfloat16)
    model.save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_pretrained(tmp_path_factory.mktemp("bf16") / "model")


@pytest.fixture(scope="module")
def runs(bf16_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("loading")
    phases: list[dict[str, Any]] = [
        {"name": f"{name}/bf16", "strategy": name, "precision": "bf16-mixed"} for name in BF16_MIXED_STRATEGIES
    ]
    phases += [
        {"name": "gym_fsdp/lora", "strategy": "gym_fsdp", "lora": True},
        {"name": "gym_ddp/lora", "strategy": "gym_ddp", "lora": True},
        {"name": "gym_fsdp/random", "strategy": "gym_fsdp", "pretrained": False, "steps": 1},
        {"name": "gym_ddp/random", "strategy": "gym_ddp", "pretrained": False, "steps": 1},
        *({"name": f"{name}/random", "strategy": name, "pretrained": False, "steps": 1} for name in RANDOM_INIT_PEERS),
    ]
    for name in {phase["name"].split("/")[0] for phase in phases}:
        (out / name).mkdir()
    spec = {"model_dir": str(bf16_folder), "dataset_size": 16, "batch_size": 4, "phases": phases, "out": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    run_ranks([str(HELPERS / "loading_worker.py"), str(out / "spec.json")], timeout=900)
    return {"out": out, "results": json.loads((out / "results.json").read_text())}


def _initial(runs: dict[str, Any], name: str) -> dict[str, torch.Tensor]:
    return torch.load(runs["out"] / f"{name}.pt", weights_only=True)


# ------------------------------------------------------------------------------------------- 2 ranks (slow)


@pytest.mark.slow
def test_fsdp_starts_from_the_checkpoint_upcast_to_fp32(runs: dict[str, Any], bf16_folder: Path) -> None:
    stored = load_file(bf16_folder / "model.safetensors")
    initial = _initial(runs, "gym_fsdp/bf16")
    assert set(stored) <= set(initial) and set(initial) - set(stored) == {"lm_head.weight"}, "tied head is not stored"
    for key, value in stored.items():
        assert initial[key].dtype == torch.float32, key
        torch.testing.assert_close(initial[key], value.float(), rtol=0, atol=0)
    assert runs["results"]["gym_fsdp/bf16"]["tied"], "the LM head is no longer the embedding matrix"


@pytest.mark.slow
@pytest.mark.parametrize("name", BF16_MIXED_STRATEGIES)
def test_bf16_mixed_trains_fp32_master_weights_from_a_bf16_checkpoint(runs: dict[str, Any], name: str) -> None:
    result = runs["results"][f"{name}/bf16"]
    assert result["optimizer"] == {"updated": ["torch.float32"], "state": ["torch.float32"]}
    if name in MODULE_HOLDS_MASTER:
        assert result["trainable"] == ["torch.float32"]
    losses = result["losses"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gym_fsdp", *RANDOM_INIT_PEERS])
def test_random_init_depends_on_the_seed_not_on_the_strategy(runs: dict[str, Any], name: str) -> None:
    # gym_ddp builds the model eagerly on every rank: what one process draws with the same seed.
    sharded, ddp = _initial(runs, f"{name}/random"), _initial(runs, "gym_ddp/random")
    assert sharded.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(sharded[key], ddp[key], rtol=0, atol=0, msg=key)
    assert runs["results"][f"{name}/random"]["tied"] is not False


@pytest.mark.slow
def test_lora_on_a_sharded_load(runs: dict[str, Any], bf16_folder: Path) -> None:
    initial = _initial(runs, "gym_fsdp/lora")
    stored = load_file(bf16_folder / "model.safetensors")
    base = "base_model.model."
    for key, value in stored.items():
        name = base + key.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")
        torch.testing.assert_close(initial[name].float(), value.float(), rtol=0, atol=0)
    lora_a = [v for k, v in initial.items() if "lora_A" in k]
    lora_b = [v for k, v in initial.items() if "lora_B" in k]
    assert lora_a and all(v.abs().sum() > 0 for v in lora_a), "adapters A keep peft's random initialisation"
    assert lora_b and all(v.abs().sum() == 0 for v in lora_b), "adapters B start at zero (no change to the model)"
    result = runs["results"]["gym_fsdp/lora"]
    assert result["trainable"] == ["torch.float32"] and len(result["losses"]) == 2
    # gym_ddp builds eagerly (peft draws the adapters as it creates them), gym_fsdp on the meta device (no draw):
    # both end with the adapters drawn from the same generator state.
    eager = _initial(runs, "gym_ddp/lora")
    assert eager.keys() == initial.keys()
    for key, value in eager.items():
        if "lora_" in key:
            torch.testing.assert_close(initial[key], value, rtol=0, atol=0, msg=key)


# ------------------------------------------------------------------------------------------- one process (fast)


def test_a_meta_plan_allocates_nothing_and_records_the_source(bf16_folder: Path) -> None:
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(bf16_folder), plan=plan)
    assert has_meta_tensors(model) and all(p.is_meta for p in model.parameters())
    record = source_of(plan, model)
    assert record is not None and record.folder == str(bf16_folder)
    assert model.dtype == torch.bfloat16, "dtype 'auto' (transformers' default): the checkpoint's own dtype"
    assert not has_meta_tensors(build_causal_lm(str(bf16_folder))), "the default plan: an eager load"
    assert not vars(model).keys() - vars(build_causal_lm(str(bf16_folder))).keys(), "nothing attached to the model"


def test_materialize_without_sharding_equals_from_pretrained(bf16_folder: Path) -> None:
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(bf16_folder), plan=plan)
    materialize(model, torch.device("cpu"), plan.take())
    eager = build_causal_lm(str(bf16_folder))
    assert not has_meta_tensors(model) and not plan.built
    for (name, value), (_, expected) in zip(
        [*model.state_dict().items(), *model.named_buffers()],
        [*eager.state_dict().items(), *eager.named_buffers()],
        strict=True,
    ):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_metric_states_keep_their_values_through_the_meta_build(monkeypatch: pytest.MonkeyPatch) -> None:
    module = CausalLMModule("tiny-llama", config_overrides=TINY_OVERRIDES)
    plan = BuildPlan(device=META)
    # The module asks its Trainer's strategy for the plan (models.plan.plan_of): a gym_fsdp stand-in here.
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(build_plan=lambda: plan), precision_plugin="32-true")
    module.configure_model()
    module._trainer = None
    # to_empty's storage holds whatever memory held before: NaN here, so that junk cannot pass for zeros.
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    materialize(module, torch.device("cpu"), plan.take())
    monkeypatch.undo()
    assert not has_meta_tensors(module)
    for metric in (module.val_loss, module.val_exact_match):
        assert metric.mean_value.item() == 0.0 and metric.weight.item() == 0.0
        metric.update(torch.tensor(5.0))
        metric.reset()  # back to the defaults, which must not be junk either
        assert metric.mean_value.item() == 0.0 and metric.weight.item() == 0.0
    module.val_loss.update(torch.tensor(2.0), weight=torch.tensor(3.0))
    module.val_loss.update(torch.tensor(4.0), weight=torch.tensor(1.0))
    assert module.val_loss.compute().item() == 2.5


def test_a_random_init_is_drawn_on_the_cpu_whatever_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning builds gym_ddp/zero1/zero2 models under torch.device(cuda:0); this machine has none, so the model
    # class is replaced by a recorder: which default device the weights are drawn on, where the model goes after.
    from gym_lightning.models import loading

    seen: dict[str, Any] = {}

    class Recorder(torch.nn.Module):
        def to(self, device: Any) -> Recorder:  # type: ignore[override]
            seen["moved_to"] = torch.device(device)
            return self

    def from_config(config: Any, **options: Any) -> Recorder:
        seen["drawn_on"] = torch.get_default_device()
        return Recorder()

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_config", from_config)
    with torch.device("cuda:0"):
        model = build_causal_lm("tiny-llama", config_overrides=TINY_OVERRIDES)
    assert isinstance(model, Recorder)
    assert seen == {"drawn_on": torch.device("cpu"), "moved_to": torch.device("cuda", 0)}


def test_the_recorded_random_init_is_what_one_process_draws() -> None:
    torch.manual_seed(3)
    plan = BuildPlan(record_random_init=True)
    model = build_causal_lm("tiny-llama", config_overrides=TINY_OVERRIDES, plan=plan)
    after_build = torch.get_rng_state()
    source = source_of(plan, model)
    assert source is not None and source.folder is None
    expected_next = torch.rand(1, generator=torch.Generator().manual_seed(11))
    torch.manual_seed(11)  # the reference does not depend on the generator's state when it is drawn ...
    reference = reference_state_dict(source)
    assert torch.equal(torch.rand(1), expected_next), "... and leaves the caller's generator where it was"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(reference[key], value, rtol=0, atol=0, msg=key)
    assert not torch.equal(after_build, source.rng_state)


class _FirstStepDtypes(pl.Callback):
    """The trainable parameters' and AdamW states' dtypes right after the first optimizer step."""

    def __init__(self) -> None:
        self.dtypes: dict[str, set[str]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.dtypes:
            optimizer = trainer.optimizers[0]
            trainable = [p for p in pl_module.parameters() if p.requires_grad]
            states = [v for p in trainable for v in optimizer.state[p].values() if v.dim() > 0]
            self.dtypes = {"trainable": {str(p.dtype) for p in trainable}, "state": {str(v.dtype) for v in states}}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_one_process_bf16_mixed_trains_fp32_weights_from_a_bf16_checkpoint(
    bf16_folder: Path, variable_length_jsonl: Path, precision: str
) -> None:
    # Lightning's own single-device strategy (no gym strategy to upcast): the module keeps fp32 masters itself,
    # and bf16-true stays the explicit choice of bf16 weights.
    module = CausalLMModule(str(bf16_folder), attn_implementation="eager")
    data = CausalLMDataModule(train_files=str(variable_length_jsonl), batch_size=4, seed=3)
    capture = _FirstStepDtypes()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, precision=precision, callbacks=[capture], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    expected = "torch.float32" if precision == "bf16-mixed" else "torch.bfloat16"
    assert capture.dtypes == {"trainable": {expected}, "state": {expected}}


def test_a_checkpoint_without_a_weight_is_refused_by_name(bf16_folder: Path, tmp_path: Path) -> None:
    stored = load_file(bf16_folder / "model.safetensors")
    stored.pop("model.norm.weight")
    for item in bf16_folder.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    plan = BuildPlan(device=META)
    model = build_causal_lm(str(tmp_path), plan=plan)
    with pytest.raises(GymUserError, match=r"no tensor for model\.norm\.weight"):
        materialize(model, torch.device("cpu"), plan.take())


def test_a_meta_model_whose_plan_recorded_nothing_is_a_clear_error(bf16_folder: Path) -> None:
    model = build_causal_lm(str(bf16_folder), plan=BuildPlan(device=META))
    with pytest.raises(GymUserError, match="build plan recorded no weights source"):
        materialize(model, torch.device("cpu"), [])


def _cache_as_hub_repo(folder: Path, cache: Path, repo: str, *, bin_only: bool = False) -> Path:
    """``folder`` as the Hugging Face cache holds a downloaded repository (``models--org--name``, refs/main)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for item in folder.iterdir():
        if not (bin_only and item.suffix == ".safetensors"):
            (snapshot / item.name).write_bytes(item.read_bytes())
    if bin_only:
        torch.save(load_file(folder / "model.safetensors"), snapshot / "pytorch_model.bin")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants

    # conftest.py sets HF_HUB_OFFLINE=1: the cached snapshot is all there is, as on a node without network.
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_a_hub_name_builds_on_meta_and_loads_from_its_cached_safetensors(bf16_folder: Path, hub_cache: Path) -> None:
    snapshot = _cache_as_hub_repo(bf16_folder, hub_cache, "org/tiny-bf16")
    plan = BuildPlan(device=META)
    model = build_causal_lm("org/tiny-bf16", plan=plan)
    record = source_of(plan, model)
    assert all(p.is_meta for p in model.parameters()), "a hub name is sharded before it is loaded, as a folder is"
    assert record is not None and Path(str(record.folder)) == snapshot
    materialize(model, torch.device("cpu"), plan.take())
    for key, value in load_file(bf16_folder / "model.safetensors").items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_a_bin_only_hub_model_loads_whole_with_a_warning(bf16_folder: Path, hub_cache: Path) -> None:
    _cache_as_hub_repo(bf16_folder, hub_cache, "org/tiny-bin", bin_only=True)
    plan = BuildPlan(device=META)
    with pytest.warns(UserWarning, match="no safetensors weights.*every rank loads the whole"):
        model = build_causal_lm("org/tiny-bin", plan=plan)
    assert not plan.built and not has_meta_tensors(model)
    expected = load_file(bf16_folder / "model.safetensors")["model.norm.weight"]
    torch.testing.assert_close(model.model.norm.weight, expected, rtol=0, atol=0)


def test_a_hub_name_missing_from_the_offline_cache_is_a_clear_error(hub_cache: Path) -> None:
    with pytest.raises(GymUserError, match="not an existing local folder"):
        build_causal_lm("org/not-cached", plan=BuildPlan(device=META))
