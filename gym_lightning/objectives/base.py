"""What a training stage optimises, over the LM engine: the ``Objective`` base class and the registry of names.

A stage is data plus an objective (TRL: one trainer per objective; LLaMA-Factory: ``stage: sft|pt|dpo|...``). The
module (``CausalLMModule``) builds the model, the optimizer and the engine (``engine.LMEngine``) and hands each
training and validation batch to its objective, which runs the engine on the model(s) it needs and returns the loss.
A new objective is a subclass in a new file plus ``@register_objective``: nothing in the engine or the module
changes. ``model.objective`` in a ``gym fit`` YAML names one (``sft``, ``pt``, ...) or gives it with settings
(``class_path``/``init_args``, or ``{name: ..., <settings>}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import torch

from gym_lightning.errors import GymUserError

if TYPE_CHECKING:
    import lightning.pytorch as pl

OBJECTIVES: dict[str, type[Objective]] = {}
ObjectiveClass = TypeVar("ObjectiveClass", bound="type[Objective]")


class ValidationLoss(NamedTuple):
    """A validation batch's loss (a mean) and its weight in the epoch's mean (target tokens, pairs, ...)."""

    value: torch.Tensor
    weight: torch.Tensor


class Objective:
    """A training objective: the loss of a training batch, and of a validation batch, from the module's engine.

    Subclasses set ``name`` (registered with ``register_objective``), take their settings as typed constructor
    arguments (the YAML mirrors them) and override ``training_step`` and ``validation_loss``; ``configure_model``
    builds what they hold beside the module's model (a frozen reference, say), ``problems`` checks the settings.
    ``perplexity``: ``exp(val/loss)`` means something (a token-mean language-model loss). ``batch_kind``: the batches
    it reads (``"lm"``: the shared contract of ``data.collate``; ``"pairs"``: chosen rows then rejected rows;
    ``"unpaired"``: completions with a desirable/undesirable label and their mismatched KL rows), which the data
    settings must produce.
    """

    name: ClassVar[str] = ""
    perplexity: ClassVar[bool] = False
    batch_kind: ClassVar[str] = "lm"

    def problems(self) -> list[str]:
        """Every wrong setting, one sentence each (empty when all are right)."""
        return []

    def configure_model(self, module: pl.LightningModule) -> None:
        """Called once the module's model is built (inside the strategy's construction context)."""

    def on_fit_start(self, module: pl.LightningModule) -> None:
        """Called once the strategy has set up the module (its model sharded or wrapped), before the first batch."""

    def training_step(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        """The loss to back-propagate for this micro-batch (logging through ``module.log``)."""
        raise NotImplementedError

    def validation_loss(self, module: pl.LightningModule, batch: dict[str, Any]) -> ValidationLoss:
        """This validation batch's loss and weight (extra metrics logged through ``module.log``)."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """The constructor's arguments as plain data (``{name: ..., <argument>: value}``)."""
        return {"name": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.settings() == self.settings()

    def __hash__(self) -> int:
        return hash(type(self))


def register_objective(cls: ObjectiveClass) -> ObjectiveClass:
    """Make ``cls`` selectable by its ``name`` and loadable from checkpoints with ``weights_only=True``."""
    if not cls.name or OBJECTIVES.get(cls.name, cls) is not cls:
        raise ValueError(f"objective {cls.__name__} needs a name of its own, got {cls.name!r}")
    OBJECTIVES[cls.name] = cls
    torch.serialization.add_safe_globals([cls])
    return cls


def objective_from_value(value: Objective | str | Mapping[str, Any] | None) -> Objective:
    """An objective from what a config or checkpoint holds: an ``Objective``, a registered name, a mapping
    ``{name: ..., <settings>}`` or jsonargparse's ``{class_path: ..., init_args: {...}}``; ``None`` is ``sft``."""
    if isinstance(value, Objective):
        return value
    if value is None:
        value = "sft"
    if isinstance(value, str):
        return _registered(value)()
    if isinstance(value, Mapping):
        settings = dict(value)
        if "class_path" in settings:
            return _class_of(settings["class_path"])(**dict(settings.get("init_args") or {}))
        name = settings.pop("name", None)
        if not isinstance(name, str):
            raise GymUserError(f"model.objective {dict(value)!r} names no objective: add name: one of {_names()}.")
        return _registered(name)(**settings)
    raise GymUserError(f"model.objective must be one of {_names()} or a mapping with settings, got {value!r}.")


def _names() -> str:
    return ", ".join(sorted(OBJECTIVES))


def _registered(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise GymUserError(f"model.objective {name!r} is not an objective; choose one of {_names()}.")
    return OBJECTIVES[name]


def _class_of(path: str) -> type[Objective]:
    """The registered objective class whose import path or class name is ``path``. Nothing is imported: a
    checkpoint's hyper-parameters name classes, and loading one must not run code it names."""
    for cls in OBJECTIVES.values():
        if path in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__, cls.name):
            return cls
    raise GymUserError(f"model.objective class_path {path!r} is not a registered objective; choose one of {_names()}.")


__all__ = ["OBJECTIVES", "Objective", "ValidationLoss", "objective_from_value", "register_objective"]
