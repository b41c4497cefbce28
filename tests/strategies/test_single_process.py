"""Single-process checks of the strategies: registry names, construction-time validation, pure helpers, and what
ZeRO resolves from a plain module on one CPU rank."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.dist import REPO_ROOT, free_port, rank_env
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from gym_lightning.errors import GymUserError
from gym_lightning.strategies import (
    STRATEGY_NAMES,
    GymDDPStrategy,
    GymFSDPStrategy,
    ZeRO1Strategy,
    ZeRO3Strategy,
    ZeROStrategy,
)
from gym_lightning.strategies._common import threads_per_rank
from gym_lightning.strategies.base import GymStrategy
from gym_lightning.strategies.fsdp import (
    OFFLOAD_BACKEND,
    find_layer_classes,
    mixed_precision_policy,
    process_group_backend,
    shard_storage_device,
)
from gym_lightning.strategies.zero.config import zero_config

REPO = REPO_ROOT


@pytest.mark.parametrize(
    ("name", "cls", "attrs"),
    [
        ("gym_ddp", GymDDPStrategy, {}),
        ("gym_fsdp", GymFSDPStrategy, {"sharding": "full"}),
        ("zero1", ZeROStrategy, {"stage": 1}),
        ("zero2", ZeROStrategy, {"stage": 2}),
        ("zero3", ZeROStrategy, {"stage": 3}),
        ("zero2_offload", ZeROStrategy, {"stage": 2}),
        ("zero3_offload", ZeROStrategy, {"stage": 3, "remote_device": "cpu"}),
        ("zero_infinity", ZeROStrategy, {"stage": 3, "remote_device": "nvme"}),
    ],
)
def test_registered_names_build_the_right_strategy(name: str, cls: type, attrs: dict) -> None:
    assert name in STRATEGY_NAMES
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is cls
    for key, value in attrs.items():
        assert getattr(strategy, key) == value


def test_offload_presets_write_the_offload_sections() -> None:
    zero = StrategyRegistry.get("zero3_offload").config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert StrategyRegistry.get("zero2_offload").config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in StrategyRegistry.get("zero2_offload").config["zero_optimization"]


def test_zero_config_lets_lightning_own_accumulation_and_keeps_the_torch_optimizer() -> None:
    config = ZeROStrategy(stage=2).config
    assert config["managed_gradient_accumulation"] is False
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert "gradient_accumulation_steps" not in config  # filled from the Trainer at setup
    assert zero_config(1, "none", "none", None, False, 10)["zero_optimization"]["overlap_comm"] is False


def test_zero_reports_every_problem_in_one_error() -> None:
    with pytest.raises(ValueError) as info:
        ZeROStrategy(stage=4, offload_optimizer="disk", offload_parameters="nvme", cpu_optimizer="fast")
    message = str(info.value)
    assert "stage=4 is not a ZeRO stage" in message
    assert "offload_optimizer='disk'" in message
    assert "offload_parameters='nvme' needs stage=3" in message
    assert "NVMe offload needs nvme_path" in message
    assert "cpu_optimizer='fast'" in message
    assert "5 problem(s)" in message


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"stage": 2, "offload_parameters": "cpu"}, "needs stage=3"),
        ({"stage": 3, "nvme_path": "/nvme"}, "nvme_path='/nvme' is unused"),
        ({"stage": 2, "cpu_optimizer": "deepspeed"}, "needs offload_optimizer='cpu' or 'nvme'"),
        ({"stage": 3, "config": {"zero_optimization": {"stage": 2}}}, "disagrees with the config"),
        ({"config": {"zero_optimization": {"stage": 2}}, "offload_optimizer": "cpu"}, "ignored when config is given"),
    ],
)
def test_zero_invalid_combinations(kwargs: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        ZeROStrategy(**kwargs)


def test_zero_config_dict_sets_the_stage_and_is_copied() -> None:
    user = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    strategy = ZeROStrategy(config=user)
    assert strategy.stage == 3 and strategy.remote_device == "cpu"
    assert "managed_gradient_accumulation" not in user, "the caller's dict must not be modified"


def test_zero_convenience_classes() -> None:
    assert ZeRO1Strategy().stage == 1
    assert ZeRO3Strategy(offload_optimizer="cpu", offload_parameters="cpu").remote_device == "cpu"
    # They fix the stage and share ZeROStrategy's signature, not a copy of it.
    assert inspect.signature(ZeRO3Strategy) == inspect.signature(ZeROStrategy)
    assert all("__init__" not in vars(cls) for cls in (ZeRO1Strategy, ZeRO3Strategy))
    with pytest.raises(ValueError, match=r"stage=3 disagrees with ZeRO1Strategy \(stage 1\)"):
        ZeRO1Strategy(stage=3)
    with pytest.raises(ValueError, match="offload_parameters='cpu' needs stage=3"):
        ZeRO1Strategy(offload_parameters="cpu")
    config = {"zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match=r"stage=1 disagrees with the config's zero_optimization\.stage=3"):
        ZeRO1Strategy(config=config)


def test_ddp_invalid_combinations() -> None:
    with pytest.raises(ValueError) as info:
        GymDDPStrategy(gradient_compression="int8", powersgd_rank=0)
    message = str(info.value)
    assert "gradient_compression='int8'" in message
    assert "powersgd_rank=0 only applies to PowerSGD" in message
    assert "powersgd_rank must be an integer >= 1" in message
    with pytest.raises(ValueError, match="powersgd_start_iter must be an integer >= 2"):
        GymDDPStrategy(gradient_compression="powersgd", powersgd_start_iter=1)


def test_fsdp_invalid_combinations() -> None:
    with pytest.raises(ValueError) as info:
        GymFSDPStrategy(sharding="zero3", layer_classes="LlamaDecoderLayer", gradient_compression="powersgd")
    message = str(info.value)
    assert "sharding='zero3'" in message
    assert "layer_classes must be a list" in message
    assert "PowerSGD is a DDP" in message or "DDP communication hook" in message


def test_fsdp_finds_decoder_layers_from_no_split_modules() -> None:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = torch.nn.ModuleDict({"model": LlamaForCausalLM(config)})
    assert find_layer_classes(model) == {"LlamaDecoderLayer"}
    assert find_layer_classes(model, ["LlamaMLP"]) == {"LlamaMLP"}
    assert find_layer_classes(torch.nn.Linear(2, 2)) == set()


def test_fsdp_mixed_precision_policy_follows_trainer_precision() -> None:
    bf16 = mixed_precision_policy("bf16-mixed", "none")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = mixed_precision_policy("32-true", "none")
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)
    compressed = mixed_precision_policy("32-true", "bf16")
    assert (compressed.param_dtype, compressed.reduce_dtype) == (None, torch.bfloat16)


def test_fsdp_cpu_offload_gives_host_shards_a_cpu_backend() -> None:
    assert process_group_backend(None, "cuda", cpu_offload=True) == OFFLOAD_BACKEND == "cpu:gloo,cuda:nccl"
    assert process_group_backend(None, "cuda", cpu_offload=False) == "nccl"
    assert process_group_backend(None, "cpu", cpu_offload=True) == "gloo"  # a no-op on CPU ranks
    assert process_group_backend("cpu:gloo,cuda:nccl", "cuda", cpu_offload=True) == OFFLOAD_BACKEND
    with pytest.raises(GymUserError, match="no backend for CPU tensors"):
        process_group_backend("nccl", "cuda", cpu_offload=True)
    # The strategy asks the same rule for the device it runs on (set here by hand: this machine has no GPU).
    strategy = GymFSDPStrategy(cpu_offload=True)
    strategy.parallel_devices = [torch.device("cuda", 0)]
    assert strategy._get_process_group_backend() == OFFLOAD_BACKEND


def test_fsdp_cpu_offload_builds_shards_in_host_memory() -> None:
    cuda = torch.device("cuda", 0)
    assert shard_storage_device(cuda, cpu_offload=True) == torch.device("cpu")
    assert shard_storage_device(cuda, cpu_offload=False) == cuda
    assert shard_storage_device(torch.device("cpu"), cpu_offload=True) == torch.device("cpu")


@pytest.mark.parametrize(("ranks", "cpus", "threads"), [(2, 2, 1), (1, 2, 2), (2, 16, 8), (4, 2, 1)])
def test_threads_per_rank_never_oversubscribes(ranks: int, cpus: int, threads: int) -> None:
    assert threads_per_rank(ranks, cpus) == threads


_EXIT_PROBE = """
import atexit, sys
import torch
import torch.distributed as dist
# registered first, so it runs last (atexit is last-in first-out): it sees what the handler under test left
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
from gym_lightning.strategies._common import destroy_process_group_at_exit
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
dist.all_reduce(torch.ones(3), async_op=True).wait()
destroy_process_group_at_exit()
destroy_process_group_at_exit()  # the strategy sets up again on a second fit: still one handler
if sys.argv[2] == "raise":
    raise RuntimeError("training failed")
"""


def test_the_process_group_is_destroyed_before_the_interpreter_shuts_down() -> None:
    # Left to the interpreter's finalisation, gloo's threads could abort a finished run (exit -6). A program ended by
    # an unhandled exception keeps the group: destroying it could wait for a peer stuck in a collective.
    endings = {"clean": (0, "initialized at exit: False"), "raise": (1, "initialized at exit: True")}
    probes = {  # both at once: each spends ~10 s importing Lightning
        ending: subprocess.Popen(
            [sys.executable, "-c", _EXIT_PROBE, str(free_port()), ending],
            env=rank_env(),  # one thread each, the repository importable: as every other child run of the tests
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ending in endings
    }
    for ending, (returncode, seen) in endings.items():
        stdout, stderr = probes[ending].communicate(timeout=120)
        assert probes[ending].returncode == returncode, f"{ending}: {stderr[-2000:]}"
        assert stdout.count("initialized at exit:") == 1 and seen in stdout, f"{ending}: {stdout}{stderr[-2000:]}"


class _CleanupRegistered(Exception):
    """Raised by the stand-in for the exit cleanup, so that ``setup_environment`` stops before it starts a group."""


@pytest.mark.parametrize("strategy_class", [GymDDPStrategy, GymFSDPStrategy, ZeROStrategy])
def test_every_strategy_registers_the_exit_cleanup_before_the_group_starts(
    strategy_class: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = sys.modules[GymStrategy.__module__]  # the shared lifecycle (strategies.base)
    # The thread and allocator settings would outlive this test in this process; they are not what is checked here.
    monkeypatch.setattr(module, "configure_cpu_threads", lambda *args: None)
    monkeypatch.setattr(module, "return_freed_host_memory", lambda *args: None)

    def register() -> None:
        raise _CleanupRegistered

    monkeypatch.setattr(module, "destroy_process_group_at_exit", register)
    strategy = strategy_class()
    strategy.parallel_devices = [torch.device("cpu")]  # what the Trainer's connector sets
    with pytest.raises(_CleanupRegistered):  # raised before super().setup_environment() could start a group
        strategy.setup_environment()


def test_bucket_sizes_are_capped_at_the_model_size() -> None:
    from gym_lightning.strategies.zero.sizing import cap_bucket_sizes

    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 500}}
    capped = cap_bucket_sizes(config, model_numel=1000)
    assert capped["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 500}
    assert config["zero_optimization"]["reduce_bucket_size"] == 200_000_000, "the input must not be modified"
    # DeepSpeed asserts that bucket sizes are multiples of 2: an odd parameter count is rounded up.
    assert cap_bucket_sizes(config, model_numel=109_997)["zero_optimization"]["reduce_bucket_size"] == 109_998


def test_fsdp_descends_into_module_lists() -> None:
    """``fully_shard`` refuses containers without a forward; their children become the shard units instead."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from gym_lightning.strategies.fsdp import _shard_unit

    blocks = nn.ModuleList([nn.Linear(4, 4), nn.ModuleDict({"a": nn.Linear(4, 4)}), nn.ReLU()])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _shard_unit(blocks, {"mesh": init_device_mesh("cpu", (1,))})
    finally:
        dist.destroy_process_group()
    assert isinstance(blocks[0], FSDPModule) and isinstance(blocks[1]["a"], FSDPModule)
    assert not isinstance(blocks, FSDPModule) and not isinstance(blocks[2], FSDPModule)


@pytest.mark.parametrize("initialized", [False, True])
def test_fsdp_is_initialised_before_a_first_forward_with_the_adapters_off(initialized: bool) -> None:
    """A LoRA preference run's first forward is its reference's, adapters off (peft's ``disable_adapter`` sets their
    ``requires_grad`` to False): FSDP2's lazy initialisation then finds nothing trainable and the first backward under
    bf16 mixed precision fails. ``GymFSDPStrategy.setup`` initialises FSDP2 after materialising
    (tests/objectives/test_reference_strategies.py runs gym_fsdp + LoRA + DPO under bf16-mixed through it)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gym_lightning._compat import initialize_fsdp_now

    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    base, adapter = model[0]
    base.requires_grad_(False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
        if initialized:
            initialize_fsdp_now(model)
        adapter.requires_grad_(False)
        with torch.no_grad():
            model(torch.randn(2, 8))
        adapter.requires_grad_(True)
        if not initialized:
            with pytest.raises(RuntimeError, match="grad_dtype"):
                model(torch.randn(2, 8)).float().sum().backward()
            return
        model(torch.randn(2, 8)).float().sum().backward()
    finally:
        dist.destroy_process_group()
    assert adapter.weight.grad is not None and adapter.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------- ZeRO-3 trace fix
class _Offload:
    """Stands in for DeepSpeed's DeepSpeedZeRoOffload: the lists of hook handles it registered."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.forward_hooks = [m.register_forward_pre_hook(lambda *a: None) for m in modules]
        self.forward_hooks += [m.register_forward_hook(lambda *a: None) for m in modules]
        self.backward_hooks = [m.register_forward_pre_hook(lambda *a: None) for m in modules]


class _Engine:
    def __init__(self, module: torch.nn.Module, offload: _Offload) -> None:
        self.module, self.optimizer = module, type("Stage3", (), {"parameter_offload": offload})()


def test_a_torchmetrics_metric_is_never_equal_to_itself_for_deepspeed() -> None:
    # Why zero3_trace exists: DeepSpeed's trace check is `sub_module != expected`, and for a metric that is a
    # (truthy) CompositionalMetric even when both are the same object. If torchmetrics changes this, the fix can go.
    from torchmetrics import MeanMetric

    metric = MeanMetric()
    assert bool(metric != metric)
    linear = torch.nn.Linear(2, 2)
    assert not bool(linear != linear)  # plain modules compare by identity


def test_zero3_hooks_are_detached_from_parameter_free_metrics_only() -> None:
    from torchmetrics import MeanMetric

    from gym_lightning.strategies.zero.trace import keep_zero3_trace_valid, trace_breaking_modules

    root = torch.nn.Module()
    root.linear, root.metric, root.act = torch.nn.Linear(2, 2), MeanMetric(), torch.nn.Tanh()
    assert trace_breaking_modules(root) == [root.metric]
    user_hook = root.metric.register_forward_hook(lambda *a: None)  # a user's own hook must survive
    offload = _Offload([root.linear, root.metric, root.act])
    assert keep_zero3_trace_valid(_Engine(root, offload)) == 3
    assert len(offload.forward_hooks) == 4 and len(offload.backward_hooks) == 2
    assert list(root.metric._forward_hooks) == [user_hook.id] and not root.metric._forward_pre_hooks
    assert len(root.linear._forward_pre_hooks) == 2 and len(root.act._forward_hooks) == 1


def test_zero3_trace_fix_warns_when_deepspeed_internals_moved() -> None:
    from torchmetrics import MeanMetric

    from gym_lightning.strategies.zero.trace import keep_zero3_trace_valid

    root = torch.nn.Module()
    root.metric = MeanMetric()
    engine = type("Engine", (), {"module": root, "optimizer": object()})()
    with pytest.warns(UserWarning, match="could not find DeepSpeed's ZeRO-3 hooks"):
        assert keep_zero3_trace_valid(engine) == 0


# ------------------------------------------------------------------------------- ZeRO: facts from any module
# One process, one CPU rank: enough to see what the strategy resolves, and that it leaves the Trainer alone.
class PlainRegression(pl.LightningModule):
    """A plain LightningModule (no gym_lightning interface) fed by a plain DataLoader."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def one_rank_zero() -> Iterator[Callable[..., pl.Trainer]]:
    """Fit ``PlainRegression`` for 2 optimizer steps under ``ZeROStrategy(config=...)`` in this process."""

    def fit(config: dict[str, Any], accumulate: int = 1) -> pl.Trainer:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ZeROStrategy(config=config),
            accumulate_grad_batches=accumulate,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
        try:
            trainer.fit(PlainRegression(), loader)
        finally:
            assert trainer.accumulate_grad_batches == accumulate, "a strategy never changes the Trainer"
        return trainer

    yield fit
    # The strategy started a one-rank process group here; later tests must not find it.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


HF_AUTO = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2},
}


@pytest.mark.slow
def test_plain_module_gets_the_trainer_and_dataloader_facts(one_rank_zero: Callable[..., pl.Trainer]) -> None:
    trainer = one_rank_zero(HF_AUTO, accumulate=2)
    config = trainer.strategy.config
    assert config["train_micro_batch_size_per_gpu"] == 4  # the DataLoader's batch size
    assert config["gradient_accumulation_steps"] == 2 and config["train_batch_size"] == 8
    assert config["gradient_clipping"] == 0.0 and config["bf16"]["enabled"] is False
    assert trainer.global_step == 2


@pytest.mark.slow
def test_plain_module_auto_optimizer_values_are_an_error(one_rank_zero: Callable[..., pl.Trainer]) -> None:
    optimizer = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}}
    with pytest.raises(GymUserError) as info:
        one_rank_zero({**HF_AUTO, "optimizer": optimizer})
    message = str(info.value)
    assert "(1 problem(s))" in message
    assert 'optimizer.params.lr: "auto" needs a value that is not known here' in message
    assert "ProvidesOptimizerFacts" in message


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_zero_json_accumulation_that_differs_from_the_trainer_is_an_error(
    one_rank_zero: Callable[..., pl.Trainer], accumulate: int
) -> None:
    # Before, the strategy adopted the JSON's 4 into a Trainer left at 1, after the data module had read it.
    with pytest.raises(GymUserError) as info:
        one_rank_zero({**HF_AUTO, "gradient_accumulation_steps": 4}, accumulate=accumulate)
    message = str(info.value)
    both = (
        f"gradient_accumulation_steps=4 in the DeepSpeed config but trainer.accumulate_grad_batches gives {accumulate}"
    )
    assert both in message
    assert f'write "auto" (or {accumulate}) in the JSON, or change trainer.accumulate_grad_batches to 4' in message


def test_strategies_do_not_reach_into_the_module_or_the_data() -> None:
    """Strategies learn about the module and data through gym_lightning.protocols only (the import layers are
    tests/test_imports.py's); they never read a module's hyper-parameters by name."""
    forbidden = ("gym_lightning.module", "gym_lightning.data")
    for path in sorted((REPO / "gym_lightning" / "strategies").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [name for name in names if name.startswith(forbidden)], f"{path.name} imports {names}"
            if isinstance(node, ast.Attribute):
                assert node.attr != "hparams", f"{path.name}:{node.lineno} reads hparams"
