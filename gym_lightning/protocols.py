"""What modules, data modules, strategies and callbacks ask of each other: every such interface, in one module.

gym_lightning's pieces work with any LightningModule, data module or strategy. Where one needs something only
another knows, it asks through one of these small typed protocols instead of reading the other's settings by name
(a strategy never reads a module's hyper-parameters, a module never imports a strategy). Every protocol is optional:
whoever asks has a stated answer for "not provided" (each protocol's docstring says which).

- Module and data module -> strategy (DeepSpeed's ``"auto"`` values, ``strategies.zero.hf_auto``):
  ``ProvidesOptimizerFacts``, ``ProvidesModelFacts``, ``ProvidesMicroBatchSize``.
- Strategy -> module (``models.plan``, ``loss``): ``ProvidesBuildPlan``, ``AgreesCallCounts``.
- Strategy -> callbacks: ``ProvidesFullTensors`` (the exporter, ``hf_folder``), ``ProvidesLocalGradients``
  (``NonFiniteGuard``).
- Strategy -> objectives (``objectives.preference``): ``HoldsFrozenModels``.
- Objective -> data module (``objectives.reference_pass``): ``StoresReferenceLogps``.
- Batch keys beyond the shared contract (``data.collate``) that a data loader, a strategy and the module exchange:
  ``STEP_TOKENS_KEY``, ``SHIFT_LABELS_KEY``.

This module imports nothing from gym_lightning at run time, so that every layer may depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from gym_lightning.lazy import LazyTensor
    from gym_lightning.loss import AgreedCounts
    from gym_lightning.models.facts import ModelFacts
    from gym_lightning.models.plan import BuildPlan


@dataclass(frozen=True)
class OptimizerFacts:
    """The module's optimizer settings, as DeepSpeed's ``"auto"`` needs them; ``None`` means "not known".

    Args:
        lr: Peak learning rate.
        betas: Adam betas.
        eps: Adam epsilon.
        weight_decay: Weight decay.
        warmup_steps: Warm-up length in optimizer steps (> 0 wins over ``warmup_ratio``, as in the HF Trainer).
        warmup_ratio: Warm-up length as a fraction of the run's total optimizer steps.
    """

    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    warmup_ratio: float | None = None


@runtime_checkable
class ProvidesOptimizerFacts(Protocol):
    """A LightningModule that states its optimizer settings (see ``OptimizerFacts``); all unknown without it."""

    def optimizer_facts(self) -> OptimizerFacts: ...


@runtime_checkable
class ProvidesModelFacts(Protocol):
    """A LightningModule that states its model's facts (``models.facts.ModelFacts``: the model's width and layer
    size) before building the model: ZeRO-3 sizes its buffers before ``configure_model``. Unknown without it."""

    def model_facts(self) -> ModelFacts: ...


@runtime_checkable
class ProvidesMicroBatchSize(Protocol):
    """A data module (or a module that builds its own DataLoader) that states its per-device training micro-batch
    size; the training DataLoader's batch size without it."""

    @property
    def micro_batch_size(self) -> int: ...


@runtime_checkable
class ProvidesBuildPlan(Protocol):
    """A strategy that says how the models built in ``configure_model`` are to be built (``models.plan``); the
    default plan without it."""

    def build_plan(self) -> BuildPlan: ...


@runtime_checkable
class AgreesCallCounts(Protocol):
    """A strategy that agrees, over the ranks that must make the same calls, on how many times each rank calls a
    module: ``local`` holds this rank's counts, the answer every rank's same counts (started, not waited for).

    The counted modules are those whose calls may be collectives (ZeRO-3 gathers the LM head's and each MLP's weights
    on every call): the module's loss chunks and MLP tiles. Without it, the largest count over the default process
    group (``loss.agreed_counts_of``).
    """

    def start_agreed_counts(self, local: list[int]) -> AgreedCounts: ...


@runtime_checkable
class ProvidesFullTensors(Protocol):
    """A strategy that shards parameters and can gather them one full tensor at a time (the exporter,
    ``hf_folder``); every rank holds the whole model without it."""

    def full_tensors(self, model: nn.Module) -> dict[str, LazyTensor]: ...


@runtime_checkable
class ProvidesLocalGradients(Protocol):
    """A strategy that hands out this rank's gradients (local shards, for ``NonFiniteGuard``), or ``None`` where an
    engine owns them; the parameters' ``.grad`` without it."""

    def local_gradients(self, module: nn.Module) -> list[torch.Tensor] | None: ...


@runtime_checkable
class HoldsFrozenModels(Protocol):
    """A strategy that holds frozen models (a preference objective's reference) the way it holds the policy.

    ``hold_frozen(build, copy_of, dtype)`` is called once the strategy has set the module up (``on_fit_start``), on
    every rank. ``build(plan)`` builds the model with the module's one loader (``models.loading.build_causal_lm``) under
    ``plan``: the strategy passes its build plan and opens its construction context around the call, then shards or
    partitions the model as it does the policy (FSDP2 shards, ZeRO-3 partitions; a reduced dtype such as bf16 is
    allowed) and fills the weights the plan recorded, so that no rank that shards ever holds it whole. ``copy_of``,
    when given, is the policy with its initial values (Lightning restores a checkpoint into it only after
    ``on_fit_start`` where ``restore_checkpoint_after_setup``: FSDP, DeepSpeed), which the frozen model must take
    instead of the source's (copied into whatever holds each tensor): a random initialisation, which no folder holds.
    Where Lightning restores before ``on_fit_start`` (DDP), the caller remembered those values when the policy was
    built and ``build`` loads them itself (a default plan); ``copy_of`` is then ``None``. The answer is the module to
    call (gradients off, eval mode; the same calls on every rank, as the policy's forward): never a registered
    submodule of the LightningModule, so never in a checkpoint or the optimizer. ``dtype`` (the objective's
    ``reference_dtype``) is its parameters' dtype, else the policy's compute dtype as the strategy holds it; a
    strategy that cannot honour it refuses it in one line. gym_ddp, gym_fsdp and ZeRO provide
    it (``strategies.frozen``). Without this protocol the objective keeps a whole copy on the module's device
    (``objectives.preference.FrozenCopy``), which only strategies that replicate the policy can afford.
    """

    def hold_frozen(
        self,
        build: Callable[[BuildPlan], nn.Module],
        copy_of: nn.Module | None = None,
        dtype: torch.dtype | None = None,
    ) -> nn.Module: ...


@runtime_checkable
class StoresReferenceLogps(Protocol):
    """A data module that computes a reference model's log-probabilities of its preference data once (TRL's
    ``precompute_ref_log_probs``; ``logps``: a collated batch -> ``[rows]`` summed log-probabilities), stores them
    beside its prepared data under
    ``reference_id`` (a resume reuses them; another id computes new ones) and hands them out in every batch as
    ``reference_logps``. Collective: every rank calls it, after the strategy set the module up."""

    def precompute_reference_logps(
        self, logps: Callable[[dict], torch.Tensor], reference_id: str, batch_size: int | None = None
    ) -> None: ...


def optimizer_facts_of(module: object) -> OptimizerFacts:
    """``module.optimizer_facts()`` when the module provides them, else all unknown."""
    return module.optimizer_facts() if isinstance(module, ProvidesOptimizerFacts) else OptimizerFacts()


def micro_batch_size_of(*providers: object) -> int | None:
    """The first ``micro_batch_size`` stated by one of ``providers`` (``None`` entries are skipped), else ``None``."""
    for provider in providers:
        if provider is None or not isinstance(provider, ProvidesMicroBatchSize):
            continue
        size = provider.micro_batch_size
        # A runtime-checkable protocol only checks that the attribute exists; None (or a bool) states nothing.
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


# The target tokens of the whole optimizer step on this rank (``data.loader``), which the module sums over ranks to
# normalise the loss.
STEP_TOKENS_KEY = "step_target_tokens"
# Each position's next-token target, already shifted: a sequence-parallel strategy gives a rank its slice of the
# sequence this way (``strategies.sequence``), and the module's loss takes it as it is.
SHIFT_LABELS_KEY = "shift_labels"


__all__ = [
    "SHIFT_LABELS_KEY",
    "STEP_TOKENS_KEY",
    "AgreesCallCounts",
    "HoldsFrozenModels",
    "OptimizerFacts",
    "ProvidesBuildPlan",
    "ProvidesFullTensors",
    "ProvidesLocalGradients",
    "ProvidesMicroBatchSize",
    "ProvidesModelFacts",
    "ProvidesOptimizerFacts",
    "StoresReferenceLogps",
    "micro_batch_size_of",
    "optimizer_facts_of",
]
