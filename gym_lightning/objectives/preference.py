"""What the preference objectives (``dpo``, ``kto``, ``orpo``, ``simpo``) share: reference log-probabilities, the
batch layout, the loss normalisation and TRL's metrics.

Batches: ``batch_kind="pairs"``: rows ``0..B-1`` prompt+chosen, ``B..2B-1`` prompt+rejected of the same examples
(TRL's ``DataCollatorForPreference`` layout, one forward); ``"unpaired"`` (KTO): rows ``0..B-1`` prompt+completion,
``B..2B-1`` the mismatched KL rows, and ``kto_labels``. Either may carry ``reference_logps`` ``[2B]`` and
``step_pairs`` (this rank's pairs, or KTO examples, in the optimizer step).

Reference log-probabilities (``ReferenceLogps``, DPO and KTO): ``Precomputed`` reads ``batch["reference_logps"]``;
``AdaptersOff`` runs the policy with its LoRA adapters off (peft's ``disable_adapter``, which gym's routed expert
adapters honour); ``FrozenCopy`` holds a frozen model built by the module's one loader, held by the strategy
(``protocols.HoldsFrozenModels``: sharded as the policy) or whole on the module's device where the strategy
replicates the policy. The reference is never a registered submodule: never in a checkpoint or the optimizer.

Normalisation: TRL's mean over the micro-batch's pairs, which Lightning averages over accumulation and DDP over
ranks: with equal micro-batches, the mean over the step's pairs whatever the ranks. With ``step_pairs`` the pairs
are summed and divided by the step's count over ranks (exact for unequal micro-batches too). A token-mean term
(TRL's ``sft``, CPO's and ORPO's NLL) divides by the micro-batch's target tokens summed over ranks (an all-reduce
started before the forward): 2 ranks of B pairs give what 1 process gives on the 2B.

Metrics: TRL's names, from device sums (no host sync), logged every micro-batch as means over the optimizer step's
micro-batches so far; at the Trainer's logging steps the sums are all-reduced first, so the loggers read the means
over the step's pairs of every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol

import torch
from torch import nn
from typing_extensions import override

from gym_lightning.engine import base_model_of
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX, start_rank_sum
from gym_lightning.models.fused import apply_fused_ops
from gym_lightning.models.loading import build_causal_lm
from gym_lightning.models.plan import BuildPlan
from gym_lightning.models.presets import is_preset
from gym_lightning.objectives.base import Objective
from gym_lightning.objectives.reference_pass import precompute_reference_pass
from gym_lightning.protocols import HoldsFrozenModels

if TYPE_CHECKING:
    import lightning.pytorch as pl

REFERENCE_LOGPS_KEY = "reference_logps"
STEP_PAIRS_KEY = "step_pairs"
KTO_LABELS_KEY = "kto_labels"
MODEL_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
SftAverage = Literal["token", "sequence"]
ReferenceDType = Literal["float32", "bfloat16", "float16"]
REFERENCE_DTYPES: tuple[str, ...] = ReferenceDType.__args__


class ReferenceSettings(NamedTuple):
    """What an objective with a reference states about it (``PreferenceObjective.reference_settings``)."""

    precompute: bool  # precompute_ref_log_probs
    ref_model: str | None  # the reference's source; None: the policy's
    dtype: ReferenceDType | None = None  # reference_dtype: a frozen copy's parameters; None: as the strategy holds


# ----------------------------------------------------------------------------------------------- reference providers
class ReferenceLogps(Protocol):
    """Where an objective's reference log-probabilities come from: ``setup`` once the strategy has set the module up
    (every rank), then ``logps``: per row of ``batch``, the reference's summed target log-probabilities, ``[rows]``
    fp32 without gradient, in ``LMEngine.sequence_logps``'s order."""

    def setup(self, module: pl.LightningModule) -> None: ...

    def logps(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor: ...


class Precomputed:
    """``batch["reference_logps"]``: computed in one pass before training and stored with the prepared data."""

    def setup(self, module: pl.LightningModule) -> None:
        pass

    def logps(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        rows = batch["input_ids"].size(0)
        value = batch.get(REFERENCE_LOGPS_KEY)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (rows,):
            found = "none" if value is None else f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
            raise GymUserError(
                f"precompute_ref_log_probs is on, so every batch needs '{REFERENCE_LOGPS_KEY}' of shape ({rows},) "
                f"(one per row), got {found}. Prepare the data with the reference pass (the preference data "
                "settings' precompute_ref_log_probs), or set precompute_ref_log_probs to false."
            )
        return value.to(torch.float32)


class AdaptersOff:
    """The policy with its LoRA adapters switched off (LoRA/QLoRA: the base is the reference, no second copy)."""

    def setup(self, module: pl.LightningModule) -> None:
        pass

    def logps(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        # peft's disable_adapter also sets the adapters' requires_grad to False (tuners_utils.enable_adapters). The
        # reference runs before the policy, so under gym_fsdp the fit's first forward is this one, and FSDP2 reads
        # the trainable parameters' dtypes at its first forward (FSDPParamGroup.lazy_init): seeing none, bf16-mixed
        # gradients are reduced in bf16 and assigned to the fp32 adapters, which fails. The forward is without
        # gradient, so the flags are kept as they were inside the context. (GymFSDPStrategy also initialises FSDP2
        # before any forward; this covers FSDP2 under other strategies, such as Lightning's ModelParallelStrategy.)
        trainable = [p for p in module.model.parameters() if p.requires_grad]
        with torch.no_grad(), module.model.disable_adapter():
            for parameter in trainable:
                parameter.requires_grad_(True)
            return module.engine.sequence_logps(module.model, batch).logps


class PolicyAsReference:
    """The policy itself, without gradient: the reference of a full finetune before its first optimizer step (TRL's
    precompute pass uses the model being trained the same way)."""

    def setup(self, module: pl.LightningModule) -> None:
        pass

    def logps(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            return module.engine.sequence_logps(module.model, batch).logps


class FrozenCopy:
    """A frozen model built from ``source`` (``None``: the policy's own source and settings) by the module's one
    loader, held by the strategy (``protocols.HoldsFrozenModels``: whole where it replicates the policy, sharded
    where it shards it), else whole on the module's device in eval mode. A random-initialised source (a preset,
    ``pretrained=false``) takes the policy's initial values: no folder holds them.

    Args:
        source: A folder or hub name of the reference model (TRL's ``ref_model``, LLaMA-Factory's ``ref_model``).
        dtype: The dtype of its parameters (an objective's ``reference_dtype``: ``bfloat16`` halves a full-precision
            reference); ``None``: the policy's compute dtype as the strategy holds it.
    """

    def __init__(self, source: str | None = None, dtype: ReferenceDType | None = None) -> None:
        self.source = source
        self.dtype = dtype
        self.model: nn.Module | None = None
        self._initial: dict[str, torch.Tensor] | None = None
        self._holder: object = None  # the strategy that holds ``model``: another fit's strategy builds it again

    def takes_policy_values(self, module: pl.LightningModule) -> bool:
        """Whether the copy's values are the policy's initial ones (its own source, randomly initialised)."""
        own = self.source is None or self.source == module.model_source
        return own and (is_preset(module.model_source) or not module.hparams.pretrained)

    def remember_initial(self, module: pl.LightningModule) -> None:
        """Keep the policy's initial values on the CPU where this copy takes them and Lightning restores a checkpoint
        into the policy before ``on_fit_start`` (strategies that replicate it: gym_ddp, one process): called from
        ``configure_model``. Strategies that restore after ``on_fit_start`` (FSDP, DeepSpeed) hand over the policy
        itself (``HoldsFrozenModels``' ``copy_of``), sharded as they hold it."""
        if not self.takes_policy_values(module) or _restores_after_setup(_strategy_of(module)):
            return
        state = base_model_of(module.model).state_dict()
        if not any(t.is_meta for t in state.values()):
            self._initial = {key: value.detach().to("cpu", copy=True) for key, value in state.items()}

    def setup(self, module: pl.LightningModule) -> None:
        strategy = _strategy_of(module)
        if self.model is not None and self._holder is strategy:
            return
        initial, self._initial = self._initial, None
        takes = self.takes_policy_values(module) and initial is None
        copy_of = base_model_of(module.model) if takes else None

        def build(plan: BuildPlan) -> nn.Module:
            model = build_reference(module, self.source, plan)
            if initial is not None:
                _load_initial(model, initial, plan)
            return model

        self._holder = strategy
        if isinstance(strategy, HoldsFrozenModels):
            self.model = strategy.hold_frozen(
                build, copy_of, None if self.dtype is None else getattr(torch, self.dtype)
            )
            return
        if _shards_parameters(strategy):
            raise GymUserError(
                f"{type(strategy).__name__} shards the policy but cannot hold a frozen reference model the same way "
                "(it does not implement gym_lightning.protocols.HoldsFrozenModels), and a whole copy on every rank "
                "may not fit. Use a gym strategy (gym_fsdp, zero3), LoRA (the reference is the base with the "
                "adapters off), or precompute_ref_log_probs: true."
            )
        model = build(BuildPlan())
        if copy_of is not None:
            model.load_state_dict(copy_of.state_dict())
        if strategy is not None:
            model = module.trainer.precision_plugin.convert_module(model)
        if self.dtype is not None:
            model = model.to(getattr(torch, self.dtype))
        self.model = model.to(module.device)

    def logps(self, module: pl.LightningModule, batch: dict[str, Any]) -> torch.Tensor:
        if self.model is None:
            self.setup(module)
        with torch.no_grad():
            return module.engine.sequence_logps(self.model, batch).logps


def _load_initial(model: nn.Module, initial: dict[str, torch.Tensor], plan: BuildPlan) -> None:
    """The policy's remembered initial values into a reference built with storage under ``plan``."""
    if plan.on_meta or plan.record_random_init:
        raise RuntimeError(
            "The strategy restores checkpoints before on_fit_start (the policy's initial values were remembered) but "
            "builds frozen models without storage or partitioned: it must hand over the policy as copy_of instead."
        )
    model.load_state_dict(initial)


def build_reference(module: pl.LightningModule, source: str | None, plan: BuildPlan) -> nn.Module:
    """A frozen reference model built as ``CausalLMModule.configure_model`` builds the policy, without what only
    training needs (LoRA, gradient checkpointing, MLP tiles, fp32 master weights, compilation): the same loader,
    dtype, attention implementation and fused ops. ``source`` other than the policy's loads with the policy's dtype
    and attention but not its ``config_overrides`` (TRL loads a ``ref_model`` path the same way)."""
    hp = module.hparams
    own = source is None or source == module.model_source
    model = build_causal_lm(
        module.model_source if own else source,
        pretrained=hp.pretrained if own else True,
        config_overrides=hp.config_overrides if own else None,
        dtype=hp.torch_dtype,
        attn_implementation=hp.attn_implementation,
        trust_remote_code=hp.trust_remote_code,
        plan=plan,
    )
    if module.fused_ops is not None:
        apply_fused_ops(model, module.fused_ops)
    model.requires_grad_(False)
    return model.eval()


def is_adapted(model: nn.Module | None) -> bool:
    """Whether ``model`` is a peft model whose adapters can be switched off (LoRA, QLoRA)."""
    return model is not None and hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def reference_for(
    module: pl.LightningModule, precompute: bool, ref_model: str | None, dtype: ReferenceDType | None = None
) -> ReferenceLogps:
    """The reference a DPO/KTO run uses: the batches' precomputed values, the policy with its adapters off (LoRA
    without a separate ``ref_model``), else a frozen copy of ``ref_model`` or of the policy's source (in ``dtype``)."""
    if precompute:
        return Precomputed()
    if ref_model is None and is_adapted(module.model):
        return AdaptersOff()
    return FrozenCopy(ref_model, dtype)


def precompute_reference(
    module: pl.LightningModule, ref_model: str | None = None, dtype: ReferenceDType | None = None
) -> ReferenceLogps:
    """The reference for the pass that stores ``reference_logps`` with the data, before training: the policy with
    its adapters off (LoRA), a frozen copy of ``ref_model`` (in ``dtype``), else the policy itself (its first step
    not taken)."""
    if ref_model is not None:
        return FrozenCopy(ref_model, dtype)
    return AdaptersOff() if is_adapted(module.model) else PolicyAsReference()


def reference_dtype_problems(value: object) -> list[str]:
    """``reference_dtype`` checked (``None`` or a floating dtype's torch name), for an objective's ``problems()``."""
    if value is None or value in REFERENCE_DTYPES:
        return []
    return [f"reference_dtype must be one of {', '.join(REFERENCE_DTYPES)} or null (as the strategy holds the policy), "
            f"got {value!r}"]  # fmt: skip


def _strategy_of(module: pl.LightningModule) -> object:
    """The Trainer's strategy, or ``None`` without a Trainer."""
    try:
        return module.trainer.strategy if module.trainer is not None else None
    except RuntimeError:  # a LightningModule not attached to a Trainer
        return None


def _restores_after_setup(strategy: object) -> bool:
    """Whether Lightning restores a checkpoint into the policy only after ``on_fit_start`` under ``strategy`` (its
    ``restore_checkpoint_after_setup``: FSDP, DeepSpeed); ``None`` (no Trainer) and DDP restore before."""
    return bool(getattr(strategy, "restore_checkpoint_after_setup", False))


def _shards_parameters(strategy: object) -> bool:
    """Whether ``strategy`` holds the policy's parameters in shards (FSDP, model parallel, ZeRO-3)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return True
    return isinstance(strategy, DeepSpeedStrategy) and bool(strategy.zero_stage_3)


# ----------------------------------------------------------------------------------------------- batches
def rows_of(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    """The model inputs of ``batch``'s ``rows`` (a KTO batch's completion rows, or its KL rows)."""
    return {key: batch[key][rows] for key in MODEL_KEYS if batch.get(key) is not None}


def check_padded(batch: dict[str, Any], kind: str) -> int:
    """``B``: the number of pairs (or KTO examples) of a padded ``[2B, T]`` batch; refuses packed rows."""
    if batch.get("cu_seq_lens") is not None:
        raise GymUserError(
            f"Preference objectives read padded rows ({kind}: chosen/rejected or completion/KL rows), not packed "
            "ones; set the data's packing to false."
        )
    rows = batch["input_ids"].size(0)
    if rows % 2:
        raise GymUserError(f"A {kind} batch has 2B rows (B examples, then their second rows); got {rows} rows.")
    return rows // 2


def completion_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Per row, the completion tokens before the causal shift (TRL's ``completion_mask.sum(1)``)."""
    return (labels != IGNORE_INDEX).sum(-1)


def full_row_labels(batch: dict[str, Any]) -> torch.Tensor:
    """Every real token of each row as a target, prompt included (TRL's ORPO NLL): the ids where attended."""
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    return ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)


def prompt_segments(labels: torch.Tensor) -> torch.Tensor:
    """``cu_seq_lens`` that split every ``[rows, T]`` row in two documents, its prompt (before the first target)
    and the rest, so that one ``sequence_logps`` call sums a row's prompt and completion targets apart (documents
    ``2r`` and ``2r + 1``). Device ops only: no host sync."""
    rows, width = labels.shape
    starts = torch.arange(rows, device=labels.device) * width
    prompt = (labels != IGNORE_INDEX).int().argmax(-1)  # 0 where a row has no target: all of it is "completion"
    bounds = torch.stack([starts, starts + prompt], -1).reshape(-1)
    return torch.cat([bounds, bounds.new_full((1,), rows * width)])


# ----------------------------------------------------------------------------------------------- normalisation
class PendingSum:
    """Values summed over ranks in place (fp32, flattened), the all-reduce started at once (none on one rank, or
    ``world_size=1``) and waited for on the first read, so that it overlaps the forward run in between."""

    def __init__(self, local: torch.Tensor, world_size: int) -> None:
        self.value = local.detach().to(torch.float32).reshape(-1).clone()
        self._pending = start_rank_sum(self.value, world_size)

    def get(self) -> torch.Tensor:
        """The summed values, ``[n]``."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self.value


class StepMetrics:
    """Means of named metrics over the optimizer step's micro-batches so far, from device sums and counts.

    TRL appends each micro-batch's gathered mean and logs the average since the last log; here the sums of the
    step's micro-batches are pooled (the same means when micro-batches hold as many pairs) and, at the Trainer's
    logging steps (``global_step + 1`` a multiple of ``log_every_n_steps``, as ``callbacks.GymProgressBar``
    counts them), all-reduced over ranks before the division: one small collective at those steps, none between.
    """

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None
        self._step = -1

    def update(self, module: pl.LightningModule, values: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Add this micro-batch's ``{name: (sum, count)}``; returns the means, in ``values``' order."""
        trainer = module.trainer
        stacked = torch.stack([torch.stack([s.detach().float(), c.detach().float()]) for s, c in values.values()])
        if self._sums is None or trainer.global_step != self._step or self._sums.shape != stacked.shape:
            self._sums, self._step = stacked, trainer.global_step
        else:
            self._sums = self._sums + stacked
        sums = self._sums
        every = trainer.log_every_n_steps or 0
        if every > 0 and (trainer.global_step + 1) % every == 0 and trainer.world_size > 1:
            sums = sums.clone()
            pending = start_rank_sum(sums, trainer.world_size)
            if pending is not None:
                pending.wait()
        return sums[:, 0] / sums[:, 1]


def log_step_metrics(module: pl.LightningModule, names: list[str], means: torch.Tensor) -> None:
    """Log training metrics under TRL's names (no ``prog_bar``: Lightning would read them every batch)."""
    for name, value in zip(names, means.unbind(), strict=True):
        module.log(name, value, on_step=True, on_epoch=False)


def log_validation_metrics(module: pl.LightningModule, values: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Log ``val/<name>``: the epoch's pooled mean over every rank, ``sum / count`` (Lightning's weighted epoch mean,
    the count as the weight, summed over ranks at the epoch's end)."""
    for name, (total, count) in values.items():
        count = count.detach().float()
        value = total.detach().float() / count.clamp(min=1.0)
        module.log(f"val/{name}", value, on_step=False, on_epoch=True, sync_dist=True, batch_size=count)


def count_of(n: int, device: torch.device) -> torch.Tensor:
    """``n`` as a 0-d fp32 tensor on ``device``, made by a fill kernel (no host-to-device copy)."""
    return torch.full((), float(n), device=device)


def pair_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """TRL's DPO/CPO/ORPO metrics of one micro-batch as ``(sum, count)``: each a mean over pairs."""
    pairs = count_of(chosen_rewards.numel(), chosen_rewards.device)
    return {
        "rewards/chosen": (chosen_rewards.sum(), pairs),
        "rewards/rejected": (rejected_rewards.sum(), pairs),
        "rewards/accuracies": ((chosen_rewards > rejected_rewards).float().sum(), pairs),
        "rewards/margins": ((chosen_rewards - rejected_rewards).sum(), pairs),
        "logps/chosen": (chosen_logps.detach().sum(), pairs),
        "logps/rejected": (rejected_logps.detach().sum(), pairs),
    }


# ----------------------------------------------------------------------------------------------- objectives
class PreferenceObjective(Objective):
    """What every preference objective does beside its loss: switch dropout off (TRL's ``disable_dropout``), keep its
    reference out of pickles (a checkpoint's hyper-parameters hold the objective), normalise over pairs or tokens
    and log TRL's metrics. Subclasses keep their settings as public attributes (``settings()``)."""

    batch_kind: ClassVar[str] = "pairs"
    disable_dropout: bool = True

    def __init__(self) -> None:
        self._reference: ReferenceLogps | None = None
        self._metrics = StepMetrics()

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in vars(self).items() if not key.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        PreferenceObjective.__init__(self)
        self.__dict__.update(state)

    @override
    def configure_model(self, module: pl.LightningModule) -> None:
        if self.disable_dropout:  # TRL's disable_dropout_in_model: the policy's and reference's log-probs agree
            for layer in module.model.modules():
                if isinstance(layer, nn.Dropout):
                    layer.p = 0.0
        if self.reference_settings() is not None and isinstance(reference := self.reference(module), FrozenCopy):
            reference.remember_initial(module)

    def reference_settings(self) -> ReferenceSettings | None:
        """What an objective with a reference states about it; ``None``: reference-free."""
        return None

    @override
    def on_fit_start(self, module: pl.LightningModule) -> None:
        settings = self.reference_settings()
        if settings is None:
            return
        if settings.precompute:  # one pass now, stored with the data (objectives.reference_pass)
            provider = precompute_reference(module, settings.ref_model, settings.dtype)
            precompute_reference_pass(module, provider, settings.ref_model, isinstance(provider, AdaptersOff))
        self.reference(module).setup(module)

    def reference(self, module: pl.LightningModule) -> ReferenceLogps:
        """This run's reference provider (``reference_for``), chosen once."""
        if self._reference is None:
            settings = self.reference_settings()
            if settings is None:
                raise RuntimeError(f"{type(self).__name__} is reference-free")
            self._reference = reference_for(module, *settings)
        return self._reference

    def start_pair_count(self, module: pl.LightningModule, batch: dict[str, Any], pairs: int) -> PendingSum | None:
        """The step's pairs over ranks where the batch carries ``step_pairs`` (started now), else ``None``."""
        if STEP_PAIRS_KEY not in batch:
            return None
        local = torch.as_tensor(batch[STEP_PAIRS_KEY]).to(module.device)
        return PendingSum(local, module.trainer.world_size)

    def pair_mean(
        self, module: pl.LightningModule, losses: torch.Tensor, step_pairs: PendingSum | None
    ) -> torch.Tensor:
        """``losses`` (one per pair) as this micro-batch's share of the step's loss (module docstring)."""
        if step_pairs is None:
            return losses.mean()
        trainer = module.trainer
        return (
            losses.sum() * (trainer.world_size * trainer.accumulate_grad_batches) / step_pairs.get()[0].clamp(min=1.0)
        )

    def log_training(
        self, module: pl.LightningModule, loss: torch.Tensor, values: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Log ``train/loss`` (this micro-batch's, as ``sft`` logs it) and the step means of ``values``."""
        module.log("train/loss", loss.detach(), on_step=True, on_epoch=False)
        means = self._metrics.update(module, values)
        log_step_metrics(module, list(values), means)
        return means


def token_mean_scale(module: pl.LightningModule, tokens: PendingSum, training: bool) -> torch.Tensor:
    """The factor that turns a summed token loss into the micro-batch's token mean over every rank (DDP averages the
    ranks' gradients: multiplied back by the world size)."""
    world = module.trainer.world_size if training else 1
    return world / tokens.get()[0].clamp(min=1.0)


def start_token_count(module: pl.LightningModule, labels: torch.Tensor, training: bool) -> PendingSum:
    """This micro-batch's shifted target tokens of ``labels``, summed over ranks in training (started now)."""
    local = (labels[:, 1:] != IGNORE_INDEX).sum()
    return PendingSum(local, module.trainer.world_size if training else 1)


def with_router_loss(
    module: pl.LightningModule,
    loss: torch.Tensor,
    logged: torch.Tensor,
    router_aux: torch.Tensor | None,
    coef: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss plus a mixture of experts' weighted router loss, where the forward returned one."""
    if router_aux is None:
        return loss, logged
    weight = coef if coef is not None else getattr(base_model_of(module.model).config, "router_aux_loss_coef", 0.0)
    return loss + weight * router_aux, logged + weight * router_aux.detach()


__all__ = [
    "KTO_LABELS_KEY",
    "REFERENCE_DTYPES",
    "REFERENCE_LOGPS_KEY",
    "STEP_PAIRS_KEY",
    "AdaptersOff",
    "FrozenCopy",
    "PolicyAsReference",
    "Precomputed",
    "PreferenceObjective",
    "ReferenceDType",
    "ReferenceLogps",
    "ReferenceSettings",
    "StepMetrics",
    "build_reference",
    "precompute_reference",
    "reference_dtype_problems",
    "reference_for",
]
