"""gym_lightning._compat: every private Lightning/DeepSpeed/torch member the package relies on is declared there, still
exists in the installed versions, and is reached from nowhere else."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchmetrics import MeanMetric, Metric

import gym_lightning
from gym_lightning import _compat
from gym_lightning._compat import (
    DEEPSPEED_MEMBERS,
    DEEPSPEED_MEMORY_ATTRIBUTES,
    PEFT_MEMBERS,
    PRIVATE_IMPORTS,
    PRIVATE_MEMBERS,
    PRIVATE_OVERRIDES,
    TRANSFORMERS_MEMBERS,
    DeepSpeedMember,
    _FitLoop,
)

PACKAGE = Path(gym_lightning.__file__).resolve().parent
UPSTREAM_ROOTS = ("lightning", "lightning_fabric", "pytorch_lightning", "deepspeed", "torch")


# ------------------------------------------------------------------------------ (a) members exist upstream
def _cheap_instance(cls: type) -> Any | None:
    """An instance of ``cls`` (for attributes its ``__init__`` sets), or None where none is cheap to build."""
    factories: dict[type, Callable[[], Any]] = {
        DDPStrategy: DDPStrategy,
        DeepSpeedStrategy: DeepSpeedStrategy,
        ModelParallelStrategy: ModelParallelStrategy,
        ModelCheckpoint: ModelCheckpoint,
        LightningOptimizer: lambda: LightningOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)),
        nn.Module: nn.Module,
        RemovableHandle: lambda: RemovableHandle(OrderedDict()),
        Metric: MeanMetric,
        _FitLoop: lambda: _FitLoop(Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)),
        Trainer: lambda: Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False),
    }
    factory = factories.get(cls)
    return factory() if factory is not None else None


def _lightning_members() -> list[tuple[type, str]]:
    return [
        (cls, name) for table in (PRIVATE_OVERRIDES, PRIVATE_MEMBERS) for cls, names in table.items() for name in names
    ]


@pytest.mark.parametrize(("cls", "name"), _lightning_members(), ids=lambda v: getattr(v, "__name__", v))
def test_declared_private_member_exists_upstream(cls: type, name: str) -> None:
    assert hasattr(cls, name) or hasattr(_cheap_instance(cls), name), f"{cls.__qualname__}.{name} is gone"


@pytest.mark.parametrize(("cls", "name"), [(c, n) for c, names in PRIVATE_OVERRIDES.items() for n in names])
def test_overridden_private_member_is_a_method_upstream(cls: type, name: str) -> None:
    # An override of something that is no longer called would silently stop taking effect.
    assert callable(inspect.getattr_static(cls, name)), f"{cls.__qualname__}.{name} is not a method any more"


@pytest.mark.parametrize(("module", "name"), PRIVATE_IMPORTS)
def test_declared_private_import_exists(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def _resolve(dotted: str) -> Any:
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, attribute = dotted.rpartition(".")
        return getattr(importlib.import_module(module), attribute)


def _deepspeed_defines(owner: Any, name: str) -> bool:
    """``owner`` (a class or module) has ``name``, declares it as a dataclass field, or assigns ``<x>.name = ...``."""
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in {field.name for field in dataclasses.fields(owner)}:
        return True
    return re.search(rf"\.{name}\s*(:[^=\n]+)?=(?!=)", inspect.getsource(owner)) is not None


@pytest.mark.parametrize("member", DEEPSPEED_MEMBERS + DEEPSPEED_MEMORY_ATTRIBUTES, ids=lambda m: f"{m.owner}.{m.name}")
def test_declared_deepspeed_member_exists(member: DeepSpeedMember) -> None:
    pytest.importorskip("deepspeed")
    assert _deepspeed_defines(_resolve(member.owner), member.name), f"{member.owner} no longer has {member.name}"


@pytest.mark.parametrize(("module", "name"), PEFT_MEMBERS, ids=lambda v: v)
def test_declared_peft_member_exists(module: str, name: str) -> None:
    pytest.importorskip("peft")
    assert callable(getattr(importlib.import_module(module), name, None)), f"{module} no longer has {name}"


@pytest.mark.parametrize(("owner", "name"), TRANSFORMERS_MEMBERS, ids=lambda v: v)
def test_declared_transformers_member_exists(owner: str, name: str) -> None:
    # Instance attributes set by a module's functions: the module still reads and assigns them.
    assert _deepspeed_defines(importlib.import_module(owner), name), f"{owner} no longer sets {name}"


def test_the_memory_table_is_what_memory_reads() -> None:
    # deepspeed_attribute() refuses undeclared names, so the table cannot fall behind memory.py.
    with pytest.raises(KeyError, match="not declared"):
        _compat.deepspeed_attribute(object(), "some_new_attribute")
    assert _compat.deepspeed_attribute(SimpleNamespace(ipg_buckets={}), "ipg_buckets") == {}


# ------------------------------------------------------------- (b) subclasses override only declared members
def _package_modules() -> Iterator[Any]:
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="gym_lightning."):
        if not info.name.endswith("__main__"):  # running it would start the command line
            yield importlib.import_module(info.name)


def _lightning_subclasses() -> list[type]:
    classes = {
        cls
        for module in _package_modules()
        for cls in vars(module).values()
        if inspect.isclass(cls) and cls.__module__ == module.__name__
    }
    return sorted((c for c in classes if _upstream_bases(c)), key=lambda c: c.__qualname__)


def _upstream_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if base.__module__.split(".")[0] in ("lightning", "pytorch_lightning")]


@functools.cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _private_names_used(cls: type) -> set[str]:
    """``_x`` names ``cls`` defines, or reaches as ``self._x`` / ``cls._x`` / ``super()._x`` in its own source."""
    # ``_abc_impl``: ABCMeta's own bookkeeping on every abstract subclass, not a member we define.
    names = {name for name in vars(cls) if name.startswith("_") and not name.startswith("__") and name != "_abc_impl"}
    for node in ast.walk(ast.parse(inspect.getsource(cls))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            is_super = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super"
            if is_super or (isinstance(value, ast.Name) and value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def _exists_upstream(bases: list[type], name: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(name)}\b")
    return any(hasattr(base, name) or pattern.search(_source(base)) for base in bases)


@pytest.mark.parametrize("cls", _lightning_subclasses(), ids=lambda c: c.__qualname__)
def test_subclasses_touch_only_declared_private_members(cls: type) -> None:
    bases = _upstream_bases(cls)
    declared = {name for base in cls.__mro__ for name in PRIVATE_OVERRIDES.get(base, ())}
    undeclared = sorted(n for n in _private_names_used(cls) if _exists_upstream(bases, n) and n not in declared)
    assert not undeclared, (
        f"{cls.__qualname__} overrides or touches private upstream members {undeclared}: declare overrides in "
        "gym_lightning._compat.PRIVATE_OVERRIDES, reach anything else through a _compat function"
    )


def test_the_guard_sees_the_package_strategies_and_callbacks() -> None:
    names = {cls.__qualname__ for cls in _lightning_subclasses()}
    assert {"ZeROStrategy", "GymDDPStrategy", "GymFSDPStrategy", "StepCheckpoint", "MemoryCallback"} <= names


# ---------------------------------------------------------------------- (c) nothing else reaches them directly
def _forbidden_names() -> set[str]:
    names = {name for names in PRIVATE_MEMBERS.values() for name in names}
    names |= {member.name for member in DEEPSPEED_MEMBERS + DEEPSPEED_MEMORY_ATTRIBUTES}
    names |= {name for names in PRIVATE_OVERRIDES.values() for name in names}
    # A one-word name ("buffer", an IPG bucket's) is everyday torch vocabulary (GradBucket.buffer()): not scanned.
    return {name for name in names if "_" in name}


def _violations(tree: ast.AST, forbidden: set[str], overrides: set[str]) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] in UPSTREAM_ROOTS and any(p.startswith("_") for p in parts):
                    yield node.lineno, f"import from private module {module}"
                private = [a.name for a in node.names if a.name.startswith("_")]
                if parts[0] in UPSTREAM_ROOTS and isinstance(node, ast.ImportFrom) and private:
                    yield node.lineno, f"import of private {private} from {module}"
        elif isinstance(node, ast.Attribute) and node.attr in forbidden:
            via_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super"
            if not (via_super and node.attr in overrides):
                yield node.lineno, f".{node.attr}"
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            for arg in node.args[1:2]:
                if isinstance(arg, ast.Constant) and arg.value in forbidden:
                    yield node.lineno, f"{node.func.id}(..., {arg.value!r})"  # type: ignore[attr-defined]


def test_only_compat_reaches_private_upstream_members() -> None:
    forbidden = _forbidden_names()
    overrides = {name for names in PRIVATE_OVERRIDES.values() for name in names}
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "_compat"
        for line, what in _violations(ast.parse(path.read_text()), forbidden, overrides)
    ]
    assert not found, "go through gym_lightning._compat instead:\n" + "\n".join(found)


def test_the_scan_catches_direct_access() -> None:
    source = (
        "from torch.distributed._tensor import DTensor\n"
        "from lightning.fabric.strategies.registry import _StrategyRegistry\n"
        "engine._config\n"
        "getattr(opt, 'ipg_buckets', None)\n"
        "super()._init_optimizers()\n"
        "self._init_optimizers()\n"
    )
    found = list(_violations(ast.parse(source), _forbidden_names(), {"_init_optimizers"}))
    assert [line for line, _ in found] == [1, 2, 3, 4, 6], found


# ------------------------------------------------------------------------------ ZeRO-3 trace fix: only if needed
def test_installed_deepspeed_still_compares_modules_with_ne() -> None:
    pytest.importorskip("deepspeed")
    assert _compat.zero3_trace_compares_with_ne()


def test_probe_reads_the_comparison_from_the_source() -> None:
    ne = "def trace_prologue(self, sub_module):\n    if sub_module != self.order[0]:\n        pass\n"
    identity = "def trace_prologue(self, sub_module):\n    if sub_module is not self.order[0]:\n        pass\n"
    assert _compat.compares_argument_with_ne(ne)
    assert not _compat.compares_argument_with_ne(identity)
    assert _compat.compares_argument_with_ne("not python (")  # unreadable: assume the fix is needed


class _Offload:
    """Stands in for DeepSpeed's DeepSpeedZeRoOffload: the lists of hook handles it registered."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.forward_hooks = [m.register_forward_pre_hook(lambda *a: None) for m in modules]
        self.backward_hooks = [m.register_forward_hook(lambda *a: None) for m in modules]


def _metric_engine() -> tuple[Any, _Offload]:
    from torchmetrics import MeanMetric

    root = nn.Module()
    root.linear, root.metric = nn.Linear(2, 2), MeanMetric()
    offload = _Offload([root.linear, root.metric])
    return SimpleNamespace(module=root, optimizer=SimpleNamespace(parameter_offload=offload)), offload


@pytest.mark.parametrize("needed", [True, False])
def test_zero3_trace_fix_applies_only_where_deepspeed_needs_it(monkeypatch: pytest.MonkeyPatch, needed: bool) -> None:
    from gym_lightning.strategies.zero import trace as zero3_trace

    logged: list[str] = []
    monkeypatch.setattr(zero3_trace, "zero3_trace_compares_with_ne", lambda: needed)
    monkeypatch.setattr(zero3_trace, "rank_zero_info", logged.append)
    zero3_trace._log_trace_fix_not_needed.cache_clear()
    engine, offload = _metric_engine()
    for _ in range(2):  # two engines (training, then inference) in one process: logged once
        zero3_trace.keep_zero3_trace_valid(engine)
    assert (len(offload.forward_hooks), len(offload.backward_hooks)) == ((1, 1) if needed else (2, 2))
    assert len(logged) == (0 if needed else 1)
    zero3_trace._log_trace_fix_not_needed.cache_clear()


# ------------------------------------------------------------------------------- memory callback: moved attributes
def _zero_optimizer(**attributes: Any) -> Any:
    """An object that looks like a DeepSpeed ZeRO optimizer (by its class's module) with only ``attributes``."""
    cls = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    optimizer = cls()
    for name, value in attributes.items():
        setattr(optimizer, name, value)
    return optimizer


def _trainer(optimizer: Any) -> Any:
    strategy = SimpleNamespace(model=nn.Linear(2, 2), root_device=torch.device("cpu"))
    return SimpleNamespace(optimizers=[optimizer], strategy=strategy, lightning_module=None)


def test_memory_callback_warns_once_when_deepspeed_moved_its_attributes() -> None:
    from gym_lightning.callbacks import MemoryCallback

    callback, trainer = MemoryCallback(), _trainer(_zero_optimizer())
    with pytest.warns(UserWarning, match=r"none of the DeepSpeed attributes.*single_partition_of_fp32_groups"):
        callback._measure(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback._measure(trainer)  # once only


def test_memory_callback_is_quiet_when_it_finds_them() -> None:
    from gym_lightning.callbacks import MemoryCallback

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryCallback()._measure(_trainer(_zero_optimizer(ipg_buckets={})))
        MemoryCallback()._measure(_trainer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)))


# ------------------------------------------------------------------------------ (d) self.log's device walk
def test_result_metric_move_is_skipped_only_when_nothing_would_move() -> None:
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
    from torchmetrics import MeanMetric

    from gym_lightning.patches import apply_patches

    assert "lightning_log_device_walk" in apply_patches()  # Lightning 2.6 needs it (tests/test_patches.py)
    wrapper = _ResultMetric.to
    assert getattr(wrapper, "_gym_same_device_skip", False)
    _compat.skip_same_device_result_moves()
    assert _ResultMetric.to is wrapper  # applied once, however often it is asked for

    metric = _compat.logged_result_metric(torch.tensor(2.0))
    meta = metric.meta
    assert metric.to(torch.device("cpu")) is metric and metric.meta is meta  # all on the CPU: no walk
    assert metric.to(device="cpu").meta is not meta  # a keyword: Lightning's own walk (it copies meta)
    moved = metric.to("meta")  # another device: Lightning's own walk moves everything
    assert moved.value.device.type == "meta" and moved._defaults["value"].device.type == "meta"

    moved._defaults["value"] = torch.zeros(())  # one nested tensor elsewhere: Lightning's walk moves it too
    assert moved.to("meta")._defaults["value"].device.type == "meta"
    assert not _compat._all_tensors_on({"a": [torch.zeros(1)], "m": MeanMetric()}, torch.device("cpu"))
