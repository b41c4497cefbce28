"""``NonFiniteGuard``: stop training, or drop the optimizer step, when a loss or gradient becomes NaN or infinite."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from typing_extensions import override

from gym_lightning._compat import optimizer_unscales_itself, rank_zero_warn
from gym_lightning.errors import GymUserError
from gym_lightning.protocols import ProvidesLocalGradients

NonFiniteAction = Literal["stop", "skip"]
NONFINITE_ACTIONS: tuple[str, ...] = ("stop", "skip")


class NonFiniteLossError(RuntimeError):
    """The training loss or gradients became NaN or infinite; training stopped before the optimizer step."""


def local_gradients(strategy: Strategy, module: torch.nn.Module) -> list[torch.Tensor] | None:
    """This rank's gradients of ``module`` as plain tensors, or ``None`` where an engine owns them (DeepSpeed).

    A strategy that defines ``local_gradients(module)`` answers for itself (``protocols.ProvidesLocalGradients``;
    gym_lightning's do); for any other the gradients are the parameters' ``.grad``.
    """
    if isinstance(strategy, ProvidesLocalGradients):
        return strategy.local_gradients(module)
    # Lightning's own DeepSpeedStrategy has no such method, and its engine keeps the gradients out of `.grad` too:
    # walking `.grad` would find nothing and report "finite".
    if isinstance(strategy, DeepSpeedStrategy):
        return None
    return [p.grad for p in module.parameters() if p.grad is not None]


def nonfinite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (on ``device``, no host sync) if any element of ``tensors`` is NaN or infinite, else 0.0.

    One fused norm over all tensors (foreach kernels) rather than an ``isfinite`` mask per tensor: the norm is
    NaN/inf iff an element is (or the squares overflow fp32, which has diverged anyway).
    """
    if not tensors:
        return torch.zeros((), device=device)
    total = torch.nn.utils.get_total_norm(list(tensors), error_if_nonfinite=False)
    return torch.isfinite(total).logical_not().float().to(device)


def sum_over_ranks(flags: torch.Tensor, strategy: Strategy, world: int) -> torch.Tensor:
    """``flags`` summed over the ``world`` ranks: one all-reduce on the default process group when it spans them.

    Lightning's ``strategy.reduce`` runs ``barrier()`` before every all-reduce (``_sync_ddp`` in
    lightning.fabric.utilities.distributed): a second blocking round trip where every rank waits for the slowest.
    The flags need only the sum (docs/benchmarks-history.md, "The non-finite flags' all-reduce"). Other set-ups
    (no default process group, or one that does not span the Trainer's ranks) keep ``strategy.reduce``.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        return flags
    return strategy.reduce(flags, reduce_op="sum")


def where_it_steps(flag: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """``flag`` (a device scalar) where ``optimizer`` reads it, complete: copied to the host, waiting for it, when
    the optimizer steps parameters in host memory (FSDP ``cpu_offload``) and the flag is on an accelerator.

    torch's fused optimizers copy ``found_inf`` to each parameter's device with ``non_blocking=True``
    (``torch.optim.adam._fused_adam``, torch 2.11 to 2.13); from the GPU to the host that is an asynchronous copy
    into pinned memory, which the fused CPU kernel reads at once, before the copy (and the flags' all-reduce before
    it) has landed: a rank could apply the step its peers skipped. A flag already on the host is used as it is.
    """
    if flag.device.type == "cpu":
        return flag
    # A group's parameters share a placement under FSDP (offloaded or not): its first tells, with no walk per step.
    if any(group["params"][0].device.type == "cpu" for group in optimizer.param_groups if group["params"]):
        return flag.to("cpu")  # blocking: the host waits for the flag, and so for the all-reduce it comes from
    return flag


class NonFiniteGuard(Callback):
    """Catch a NaN/infinite training loss (on any rank) or gradient before the optimizer step applies it.

    Works with any LightningModule and strategy. Each micro-batch's loss is checked as it reaches ``backward``
    (``on_before_backward``: the ``training_step`` loss, divided by the accumulation count and, under fp16 mixed
    precision, multiplied by the loss scale; neither changes whether it is finite). Before the optimizer step the
    loss flags and this rank's gradient flag travel to every rank in one collective, so all ranks decide the same.
    Gradients come from the strategy's ``local_gradients(module)`` when it has one (local shards under
    ``gym_fsdp``), else from the parameters' ``.grad``. Under DeepSpeed (ZeRO) the engine owns the gradients: only
    the loss is checked there.

    No host sync per step with torch's fused optimizers (the module's default ``adamw_torch_fused``) outside fp16
    loss scaling: the flags are handed to the optimizer as ``found_inf``, the same device tensor ``GradScaler``
    gives them, so the fused kernel itself leaves the weights, moments and step count untouched when a flag is
    set, and the flags are copied to the host without waiting (pinned buffer, ``non_blocking``, CUDA event) and
    read one step later, before the next update, or before a checkpoint is written, whichever comes first.
    Reading them at once would stop the host until the GPU has run the whole backward, so the next step's kernels
    could not be queued ahead. An optimizer that steps in host memory (``gym_fsdp`` ``cpu_offload``) gets its flag
    on the host, once it is complete (:func:`where_it_steps`): one wait, where the offloaded step waits for its
    gradients anyway. Any other optimizer (or a ``GradScaler``) reads the flags at once: one host sync.

    Args:
        action: ``"stop"`` raises ``NonFiniteLossError`` naming the step before its update is applied, so nothing
            is saved over the last good checkpoint. ``"skip"`` drops that optimizer step (all gradients discarded,
            the learning-rate schedule still advances), counts it in ``skipped_steps`` (kept in checkpoints) and
            logs the count as ``train/skipped_nonfinite_steps``. ``"skip"`` is refused at the start of ``fit``
            under DeepSpeed, whose engine always steps.
    """

    def __init__(self, action: NonFiniteAction = "stop") -> None:
        if action not in NONFINITE_ACTIONS:
            raise GymUserError(f"NonFiniteGuard: action must be 'stop' or 'skip', got {action!r}.")
        self.action = action
        self.skipped_steps = 0
        self._loss_flag: torch.Tensor | None = None
        self._flags = _HostFlags()
        self._logged_skips = -1
        self._skipping_on: torch.optim.Optimizer | None = None  # the optimizer holding our found_inf

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loss_flag = None
        if self.action == "skip" and local_gradients(trainer.strategy, pl_module) is None:
            raise GymUserError(
                f"NonFiniteGuard(action='skip') cannot drop an optimizer step under {type(trainer.strategy).__name__} "
                "(its engine holds the gradients and always steps); use action='stop' (the default) or a "
                "gym_ddp/gym_fsdp strategy."
            )
        self._flags = _HostFlags(2 * trainer.world_size, pl_module.device)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # A device flag summed over the step's micro-batches; read once per step (see the class docstring).
        flag = torch.isfinite(loss.detach()).logical_not().float().sum()
        self._loss_flag = flag if self._loss_flag is None else self._loss_flag + flag

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._settle()  # the previous step's flags, if still on their way: before this step can change anything
        flags = self._step_flags(trainer, pl_module)
        step = _StepId(trainer.global_step + 1, trainer.current_epoch, trainer.world_size)
        if self._skips_on_device(trainer, pl_module, optimizer):
            # torch's fused kernels skip the whole update where found_inf == 1 (GradScaler's contract with them).
            optimizer.found_inf = where_it_steps((flags.sum() > 0).float(), optimizer)  # type: ignore[attr-defined]
            self._skipping_on = optimizer
            self._flags.start(flags, step)
            return
        self._decide(self._flags.read_now(flags), step, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop_skipping_on_device()
        if self.action == "skip" and self._should_log_skips(trainer):
            self._logged_skips = self.skipped_steps
            pl_module.log("train/skipped_nonfinite_steps", float(self.skipped_steps), on_step=True, on_epoch=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle()  # the last step's flags

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_skipping_on_device()
        self._flags.drop()

    def _should_log_skips(self, trainer: pl.Trainer) -> bool:
        """Log the count when it changed or at the Trainer's logging steps: ``self.log`` turns the number into a
        device tensor (a host-to-device copy that waits for the GPU on CUDA), so not on every micro-batch."""
        every = max(1, int(trainer.log_every_n_steps or 1))
        return self.skipped_steps != self._logged_skips or trainer.global_step % every == 0

    def _skips_on_device(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> bool:
        """Whether this step's update can be dropped by the optimizer itself (torch's fused kernels take
        ``found_inf``), with no ``GradScaler`` setting its own, and gradients that are ours to drop."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return (
            scaler is None
            and optimizer_unscales_itself(optimizer)
            and local_gradients(trainer.strategy, pl_module) is not None
        )

    def _stop_skipping_on_device(self) -> None:
        if self._skipping_on is not None:
            vars(self._skipping_on).pop("found_inf", None)  # a later step without the guard must not be skipped
            self._skipping_on = None

    def _settle(self) -> None:
        """Decide on the step whose flags are on their way to the host (nothing when none is)."""
        if (pending := self._flags.finish()) is not None:
            self._decide(*pending, optimizer=None)

    def _step_flags(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.Tensor:
        """``[2 * world]`` device flags, summed over ranks: loss flags, then gradient flags, one slot per rank."""
        world, rank, device = trainer.world_size, trainer.global_rank, pl_module.device
        loss = self._loss_flag if self._loss_flag is not None else torch.zeros((), device=device)
        grads = nonfinite_flag(local_gradients(trainer.strategy, pl_module) or [], device)
        # [[loss], [grads]] padded with zeros to [2, world] around column `rank`: two kernels, no host data.
        mine = torch.stack([loss.to(device, torch.float32), grads.to(torch.float32)]).unsqueeze(1)
        flags = torch.nn.functional.pad(mine, (rank, world - 1 - rank)).flatten()
        self._loss_flag = None
        return sum_over_ranks(flags, trainer.strategy, world)

    def _decide(self, values: list[float], step: _StepId, optimizer: torch.optim.Optimizer | None) -> None:
        """Stop or skip if ``values`` (the host copy of a step's flags) hold a non-finite loss or gradient.

        ``optimizer``: the one whose step is about to run (its gradients are dropped to skip it); ``None`` when the
        fused kernel already skipped that step on the device.
        """
        loss_ranks = [r for r in range(step.world) if values[r]]
        grad_ranks = [r for r in range(step.world) if values[step.world + r]]
        ranks = loss_ranks or grad_ranks
        if not ranks:
            return
        what = "loss" if loss_ranks else "gradient"
        if self.action == "stop":
            raise NonFiniteLossError(_stop_message(step, what, ranks))
        if optimizer is not None:
            # Gradients set to None make torch optimizers skip every parameter: no update, no moment or step change.
            optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        rank_zero_warn(f"Skipped optimizer step {step.number}: non-finite {what} on rank(s) {ranks}.")

    @override
    def state_dict(self) -> dict[str, Any]:
        self._settle()  # a checkpoint counts (or, with "stop", is never written after) the step still in flight
        return {"skipped_steps": self.skipped_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


class _StepId(NamedTuple):
    """Which optimizer step a set of flags belongs to: its 1-based number, its epoch, the world size."""

    number: int
    epoch: int
    world: int


class _HostFlags:
    """A step's flags on their way to the host without stopping it: a pinned host buffer (on CUDA), a
    ``non_blocking`` copy into it and an event recorded after the copy; read after the event, a step later.

    Args:
        size: Flags per step (``2 * world_size``).
        device: Where the flags are computed.
    """

    def __init__(self, size: int = 0, device: torch.device | None = None) -> None:
        cuda = device is not None and device.type == "cuda"
        self._device = device
        self._host = torch.zeros(size, dtype=torch.float32, pin_memory=cuda)
        self._values = self._host.numpy()  # a view: reading it later is no tensor op
        self._event: Any = None
        self._step: _StepId | None = None

    def start(self, flags: torch.Tensor, step: _StepId) -> None:
        """Copy ``flags`` to the host buffer without waiting for them."""
        self._host.copy_(flags, non_blocking=True)
        if self._device is not None and self._device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._step = step

    def finish(self) -> tuple[list[float], _StepId] | None:
        """The flags started last and their step, once their copy has landed (``None`` when none is pending). A
        step later the event has long been passed: ``synchronize`` then returns at once."""
        if self._step is None:
            return None
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        step, self._step, self._event = self._step, None, None
        return self._values.tolist(), step

    def read_now(self, flags: torch.Tensor) -> list[float]:
        """The flags on the host at once: one host sync (optimizers that cannot skip a step themselves)."""
        return flags.tolist()

    def drop(self) -> None:
        self._step, self._event = None, None


def _stop_message(step: _StepId, what: str, ranks: list[int]) -> str:
    done = step.number - 1
    return (
        f"Non-finite training {what} (NaN or inf) on rank(s) {ranks} in optimizer step {step.number} (epoch "
        f"{step.epoch}; {done} steps completed). Training stopped before this step was applied, so no "
        "checkpoint holds it and the last checkpoint is the last good state. Lower the learning rate, add gradient "
        "clipping or check this step's data; or set nonfinite.action=skip (NonFiniteGuard(action='skip')) to drop "
        "such steps and continue."
    )


__all__ = [
    "NONFINITE_ACTIONS",
    "NonFiniteAction",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "local_gradients",
    "where_it_steps",
]
