"""The planner's strategies: one row per way to train, each of a cost-model family (``planner.families``).

A row says how gym_lightning's strategy class with its arguments shards and offloads: ``family`` (``replicated``:
DDP and FSDP without sharding; ``fsdp``: FSDP2 ``full`` / ``grad_op`` / ``hybrid``; ``zero``: DeepSpeed ZeRO 1-3),
its ZeRO ``stage`` or FSDP ``sharding``, and what it offloads. Every registered name
(``gym_lightning.vocabulary.STRATEGY_PRESETS``) is a row of :data:`STRATEGIES`, with the shape the name stands for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gym_lightning.vocabulary import STRATEGY_CLASSES, STRATEGY_PRESET_BY_NAME, StrategyClass

Family = Literal["replicated", "fsdp", "zero"]
Offload = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class Strategy:
    """One way to train: its family, how it shards and offloads, and how to select it in gym_lightning.

    Args:
        key: The planner's key. label: Its label in the tables. trainer_strategy: How the table names it.
        family: The cost model that prices it (``planner.families.FAMILIES``).
        stage: ZeRO's stage (``zero`` rows).
        sharding: FSDP2's ``full``, ``grad_op`` (gathered from forward to backward), ``hybrid`` (sharded within a
            node, replicated across) or ``none`` (a ``replicated`` row).
        offload_optimizer: Where the optimizer state lives. offload_parameters: Where the parameter shards live.
        ddp: gym_ddp: its gradients are DDP's reducer buckets (FSDP ``none`` keeps a bucket copy beside them).
        name: The registered name that selects it, if any. strategy_class: Else its class family, with init_args.
    """

    key: str
    label: str
    trainer_strategy: str
    family: Family
    stage: int = 0
    sharding: str = "full"
    offload_optimizer: Offload = "none"
    offload_parameters: Offload = "none"
    ddp: bool = False
    name: str | None = None
    strategy_class: StrategyClass | None = None
    init_args: tuple[tuple[str, Any], ...] = ()

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_parameters != "none"

    @property
    def hybrid(self) -> bool:
        return self.sharding == "hybrid"

    @property
    def keep_gathered(self) -> bool:
        return self.sharding == "grad_op"

    def layout(self) -> tuple[object, ...]:
        """What the cost models read of a row: everything but its names."""
        return (self.family, self.stage, self.sharding, self.offload_optimizer, self.offload_parameters, self.ddp)

    def trainer_config(self) -> str | dict[str, Any] | None:
        """``trainer.strategy`` that selects it: the registered name, else ``{"class_path", "init_args"}``; ``None``
        for a row that no gym_lightning strategy stands for."""
        if self.name is not None:
            return self.name
        if self.strategy_class is None:
            return None
        return {"class_path": STRATEGY_CLASSES[self.strategy_class], "init_args": dict(self.init_args)}


def planner_strategy(
    key: str, label: str, strategy_class: StrategyClass, init_args: Mapping[str, Any], name: str | None = None
) -> Strategy:
    """How gym_lightning's ``strategy_class`` with ``init_args`` shards and offloads, as the planner models it.

    Args:
        key: The planner's key of the row.
        label: Its label in the table.
        strategy_class: ``"ddp"``, ``"fsdp"`` or ``"zero"`` (``vocabulary.STRATEGY_CLASSES``).
        init_args: The strategy's arguments: FSDP's ``sharding`` and ``cpu_offload``; ZeRO's ``stage`` and
            ``offload_*``.
        name: The registered name that selects it, if any; else it is shown as the class with its arguments.
    """
    arguments = ", ".join(f"{k}={v!r}" for k, v in init_args.items())
    shown = name or f"{STRATEGY_CLASSES[strategy_class].rsplit('.', 1)[-1]}({arguments})"
    selects: dict[str, Any] = {"name": name, "strategy_class": strategy_class, "init_args": tuple(init_args.items())}
    if strategy_class == "ddp":
        return Strategy(key, label, shown, "replicated", sharding="none", ddp=True, **selects)
    if strategy_class == "fsdp":
        sharding = str(init_args.get("sharding", "full"))
        offload = "cpu" if init_args.get("cpu_offload") else "none"
        family: Family = "replicated" if sharding == "none" else "fsdp"
        return Strategy(key, label, shown, family, 0, sharding, offload, offload, **selects)
    offloads = (init_args.get("offload_optimizer", "none"), init_args.get("offload_parameters", "none"))
    return Strategy(key, label, shown, "zero", int(init_args["stage"]), "full", *offloads, **selects)


def _planned(key: str, label: str, preset: str | tuple[StrategyClass, dict[str, Any]]) -> Strategy:
    """A row of the planner's list: a registered preset (by name) or a strategy class with its arguments."""
    if isinstance(preset, str):
        found = STRATEGY_PRESET_BY_NAME[preset]
        return planner_strategy(key, label, found.strategy_class, found.init_args, name=found.name)
    return planner_strategy(key, label, *preset)


# Ordered by expected speed, fastest first (docs/planner.md, "Recommendation", says why).
STRATEGIES: tuple[Strategy, ...] = (
    _planned("ddp", "DDP", "gym_ddp"),
    _planned("zero1", "ZeRO-1", "zero1"),
    _planned("zero2", "ZeRO-2", "zero2"),
    _planned("fsdp_grad_op", "FSDP grad_op", ("fsdp", {"sharding": "grad_op"})),
    _planned("fsdp_full", "FSDP full", "gym_fsdp"),
    _planned("zero3", "ZeRO-3", "zero3"),
    _planned("zero2_offload", "ZeRO-2 + CPU optimizer", "zero2_offload"),
    _planned("zero3_offload_optimizer", "ZeRO-3 + CPU optimizer", ("zero", {"stage": 3, "offload_optimizer": "cpu"})),
    _planned("fsdp_offload", "FSDP full + CPU offload", ("fsdp", {"cpu_offload": True})),
    _planned("zero3_offload", "ZeRO-3 + CPU optimizer + params", "zero3_offload"),
    _planned("zero_infinity", "ZeRO-Infinity (NVMe)", "zero_infinity"),
)
STRATEGY_KEYS: tuple[str, ...] = tuple(s.key for s in STRATEGIES)
STRATEGY_BY_KEY: dict[str, Strategy] = {s.key: s for s in STRATEGIES}

__all__ = ["STRATEGIES", "STRATEGY_BY_KEY", "STRATEGY_KEYS", "Family", "Strategy", "planner_strategy"]
