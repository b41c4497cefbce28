"""Give a sharded model that was built on the meta device its storage and its weights, one rank shard at a time.

The torchtitan recipe (meta device -> ``fully_shard`` -> ``to_empty`` -> initialise or load) for Hugging Face
models built on a meta-device ``models.plan.BuildPlan`` (which records each model's ``WeightsSource``):

- the weights are filled by the one loader every strategy uses (``models.fill``), through :class:`RowShards`, the
  adapter that says what this rank holds of each tensor: the dim-0 rows of its ``DTensor`` shard. Pretrained
  weights: every rank reads only the checkpoint rows its shards hold (safetensors slices are memory-mapped), so no
  rank ever holds more than its shards plus one tensor slice, and the file's dtype is cast to the parameter's. A
  random initialisation: drawn on global rank 0 by an ordinary CPU build from the random state recorded at build
  time (the numbers one process would draw with the same seed) and scattered one tensor at a time
  (``distribute_tensor``): rank 0 holds the full model once, the other ranks their shards plus one tensor;
- tensors that already had storage before sharding (e.g. LoRA adapters, see ``lora.draw_adapters``) keep
  their values, and so do torchmetrics states and the defaults ``reset()`` restores (``Metric._apply`` hands them
  to ``to_empty`` too, which left ``MeanMetric``'s weight at -1.59e34 with junk memory);
- what the checkpoint does not hold but Hugging Face computes (non-persistent buffers such as the rotary
  ``inv_freq``) is initialised by the model's own ``initialize_weights``, restricted to those tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchmetrics import Metric
from transformers import PreTrainedModel
from typing_extensions import override

from gym_lightning._compat import metric_state_defaults
from gym_lightning.errors import GymUserError
from gym_lightning.models.fill import fill_weights
from gym_lightning.models.holdings import Part, Rows, Value, Whole, WholeTensors
from gym_lightning.models.plan import WeightsSource, initialize_unsaved


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores (the local shard of a ``DTensor``)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether some parameter or buffer of ``module`` has no storage yet (on this rank)."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(local_tensor(t).is_meta for t in tensors)


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, built: list[tuple[nn.Module, WeightsSource]]) -> None:
    """Storage on ``device`` for every meta tensor of the (already sharded) ``module``, filled as described above;
    ``built`` is what the build plan recorded: each model inside ``module`` and where its weights come from.

    Collective when ``module`` holds a meta-built model; a no-op for a module without meta tensors.
    """
    if not has_meta_tensors(module):
        return
    inside = {id(m) for m in module.modules()}
    deferred = [(model, record) for model, record in built if id(model) in inside]
    if not deferred:
        raise GymUserError(
            "The module has tensors on the meta device but its build plan recorded no weights source to fill them: "
            "build the model in configure_model with gym_lightning.models.build_causal_lm(..., "
            "plan=gym_lightning.models.plan_of(self.trainer.strategy)), or build it with storage."
        )
    pending = {id(model): _meta_state_keys(model) for model, _ in deferred}
    kept = {name: local_tensor(t).clone() for name, t in _named_tensors(module) if not local_tensor(t).is_meta}
    with _metric_states_kept(module):
        module.to_empty(device=device)
    for name, tensor in _named_tensors(module):
        if name in kept:
            local_tensor(tensor).copy_(kept[name])
    for model, record in deferred:
        model.tie_weights()  # to_empty gives each module its own new tensor unless the parameter is swapped in place
        _fill(model, record, pending[id(model)])


@contextmanager
def _metric_states_kept(module: nn.Module) -> Iterator[None]:
    """Every torchmetrics state and default of ``module`` gets its value back, on its new device, after the body."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    saved = [(m, _metric_values(m)) for m in metrics]
    yield
    for metric, (defaults, states) in saved:
        device = metric.device
        metric_state_defaults(metric).update({k: _to(v, device) for k, v in defaults.items()})
        for key, value in states.items():
            setattr(metric, key, _to(value, device))


def _metric_values(metric: Metric) -> tuple[dict[str, object], dict[str, object]]:
    """Copies of ``metric``'s defaults and current states (tensors or lists of tensors)."""
    defaults = metric_state_defaults(metric)
    states = {key: getattr(metric, key) for key in defaults}
    meta = [key for key, v in [*defaults.items(), *states.items()] if any(t.is_meta for t in _tensors_in(v))]
    if meta:
        raise GymUserError(
            f"The metric {type(metric).__name__} has states on the meta device ({', '.join(sorted(set(meta)))}): "
            "they have no value to keep. Create metrics in the LightningModule's __init__, outside the "
            "meta-device build (configure_model / Trainer.init_module(empty_init=True))."
        )
    return {k: _to(v, None) for k, v in defaults.items()}, {k: _to(v, None) for k, v in states.items()}


def _tensors_in(value: object) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)]


def _to(value: object, device: torch.device | None) -> object:
    """A copy of a metric state (a tensor or a list of tensors), on ``device`` (``None``: where it is)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if device is None else value.to(device)
    return [_to(v, device) for v in value]


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _meta_state_keys(model: nn.Module) -> list[str]:
    return [key for key, t in model.state_dict(keep_vars=True).items() if local_tensor(t).is_meta]


def _fill(model: PreTrainedModel, record: WeightsSource, keys: list[str]) -> None:
    state = model.state_dict(keep_vars=True)
    fill_weights(model, record, {key: state[key] for key in keys}, RowShards())
    initialize_unsaved(model, state)


class RowShards(WholeTensors):
    """gym_fsdp's holdings (``models.holdings``): each rank holds the local shard of every ``DTensor``, a range of
    dim-0 rows wherever its placements make one (``Shard(0)`` and ``Replicate``); a tensor that is not a
    ``DTensor`` is held whole on every rank."""

    @override
    def part(self, tensor: torch.Tensor) -> Part:
        rows = _local_rows(tensor) if isinstance(tensor, DTensor) and tensor.dim() > 0 else None
        return Whole() if rows is None else Rows(*rows)

    @override
    def write(self, tensor: torch.Tensor, part: Part, value: Value) -> None:
        if not isinstance(tensor, DTensor):
            super().write(tensor, part, value)
            return
        held = value()
        if isinstance(part, Whole):  # not a row range: this rank's slice of the whole tensor (no communication)
            held = distribute_tensor(held, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        tensor.to_local().copy_(held)

    @override
    def send(self, full: torch.Tensor, target: torch.Tensor) -> None:
        if not isinstance(target, DTensor):
            super().send(full, target)
            return
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
        target.to_local().copy_(shard.to_local())


def _local_rows(target: DTensor) -> tuple[int, int] | None:
    """The range of dim-0 rows of ``target`` this rank holds, or ``None`` when its shard is not a row range."""
    if any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)) for p in target.placements):
        return None
    # Where the rows of a sharded tensor go, asked of DTensor itself (uneven shards included): shard the row indices
    # the same way, from local data (no communication).
    index = torch.arange(target.shape[0], device=local_tensor(target).device)
    rows = distribute_tensor(index, target.device_mesh, target.placements, src_data_rank=None).to_local().cpu()
    if rows.numel() == 0:
        return 0, 0
    first, last = int(rows[0]), int(rows[-1]) + 1
    return (first, last) if torch.equal(rows, torch.arange(first, last)) else None
