"""Give a sharded model that was built on the meta device its storage and its weights, one rank shard at a time.

The torchtitan recipe (meta device -> ``fully_shard`` -> ``to_empty`` -> initialise or load) for Hugging Face
models built on a meta-device ``models.plan.BuildPlan`` (which records each model's ``WeightsSource``):

- pretrained weights are read with torch distributed checkpoint's ``HuggingFaceStorageReader``: every rank reads
  only the slices of the ``*.safetensors`` tensors that its shards hold (safetensors slices are memory-mapped), so no
  rank ever holds more than its shards plus one tensor slice, and the file's dtype is cast to the parameter's;
- a random initialisation is drawn on global rank 0 by an ordinary CPU build from the random state recorded at build
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
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchmetrics import Metric
from transformers import PreTrainedModel

from gym_lightning._compat import metric_state_defaults
from gym_lightning.errors import GymUserError
from gym_lightning.lora import checkpoint_key
from gym_lightning.models.conversion import (
    Loader,
    SafetensorsReader,
    TensorSource,
    convert,
    refuse_missing,
    tied_groups,
)
from gym_lightning.models.plan import WeightsSource, initialize_unsaved, reference_state_dict
from gym_lightning.models.quantized import RowQuantizer, sources_of
from gym_lightning.quant.linear import COMPONENTS


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
    if record.folder is not None:
        _read_checkpoint(model, record.folder, {key: state[key] for key in keys})
    else:
        _scatter_random_init(record, {key: state[key] for key in keys})
    initialize_unsaved(model, state)


def _read_checkpoint(model: PreTrainedModel, folder: str, targets: dict[str, torch.Tensor]) -> None:
    """Each rank reads the slices of the safetensors tensors that its shards of ``targets`` hold, mapped as
    ``from_pretrained`` maps them (``models.conversion``): renamed tensors through DCP's slice reads, converted ones
    (fused experts) from the checkpoint tensors of this rank's rows only."""
    reader = HuggingFaceStorageReader(folder)
    stored = reader.read_metadata().state_dict_metadata
    groups, sources, layers = sources_of(model, stored, targets)
    refuse_missing(folder, [key for key in groups if key not in sources])
    plain = {key: s for key, s in sources.items() if key not in layers}
    renamed = {s.keys[0]: targets[groups[key][0]] for key, s in plain.items() if s.converter is None}
    # In place: DCP copies each slice into the local shard of the (DTensor) parameter, casting to its dtype.
    dcp_load(renamed, storage_reader=reader)
    converted = [(s, targets[groups[key][0]]) for key, s in plain.items() if s.converter is not None]
    if converted or layers:
        reader = SafetensorsReader(folder)
        for source, target in converted:
            _read_converted(model, source, target, reader.load)
        _read_quantized(RowQuantizer(model, reader, sources, layers))


def _read_quantized(quantizer: RowQuantizer) -> None:
    """Each NF4 layer's shards (its codes and scales, all sharded by output rows) from the quantisation of the
    checkpoint rows this rank holds: no rank reads or quantises another rank's rows."""
    for key, layer in quantizer.layers.items():
        rows = _local_rows(layer.weight)
        if rows is None:
            raise ValueError(f"{key}: an NF4 layer must be sharded by output rows (Shard(0)), not {layer.weight}")
        if rows[1] == rows[0]:
            continue
        parts = quantizer.rows(key, *rows)
        for name, part in COMPONENTS.items():
            if hasattr(layer, name):
                local_tensor(getattr(layer, name)).copy_(parts[part])


def _read_converted(model: PreTrainedModel, source: TensorSource, target: torch.Tensor, load: Loader) -> None:
    """Fill this rank's part of ``target`` from the checkpoint tensors ``source`` converts; where the conversion
    works row by row (one expert per row), only the rows this rank holds are read and converted."""
    rows = _local_rows(target) if source.by_rows else None
    if rows is not None:
        if rows[1] > rows[0]:
            local_tensor(target).copy_(convert(source, load, model, rows))
        return
    full = convert(source, load, model)  # one whole tensor, then this rank's slice of it (no communication)
    if isinstance(target, DTensor):
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    local_tensor(target).copy_(full)


def _local_rows(target: torch.Tensor) -> tuple[int, int] | None:
    """The range of dim-0 rows of ``target`` this rank holds, or ``None`` when its shard is not a row range."""
    if not isinstance(target, DTensor):
        return 0, target.shape[0]
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


def _scatter_random_init(record: WeightsSource, targets: dict[str, torch.Tensor]) -> None:
    """Rank 0 draws the model as one process would (same random state), then scatters it tensor by tensor."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    reference: dict[str, torch.Tensor] = {}
    if rank == 0:
        reference = reference_state_dict(record)
    for group in tied_groups(targets):
        target = targets[group[0]]
        full = reference.pop(checkpoint_key(group[0])) if rank == 0 else torch.empty(target.shape)
        _copy_from_rank0(full.to(device=local_tensor(target).device, dtype=target.dtype), target)
        for key in group[1:]:
            reference.pop(checkpoint_key(key), None)


def _copy_from_rank0(full: torch.Tensor, target: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
        target.to_local().copy_(shard.to_local())
        return
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(full, src=0)
    target.copy_(full)
