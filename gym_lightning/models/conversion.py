"""A checkpoint's layout and the model's, mapped through transformers' own conversion table, for loaders and exporters
that work one tensor (or one rank's rows of a tensor) at a time.

transformers 5 builds some models with a different tensor layout from the one their checkpoints store: a mixture of
experts (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) keeps one 3-D ``experts.gate_up_proj [E, 2I, h]`` and one
``experts.down_proj [E, h, I]`` per layer, while its checkpoints hold ``experts.{e}.gate_proj.weight`` etc. per
expert; other families rename keys. ``from_pretrained`` converts while it loads and ``save_pretrained`` converts
back, both from the table ``transformers.conversion_mapping.get_model_conversion_mapping(model)`` returns. Both need
whole tensors in one process, so a sharded loader (each rank reads only its slices) and the tensor-by-tensor
exporter use that same table here, through two pieces:

- :func:`checkpoint_sources`: for every model tensor, the checkpoint keys it is made of and the converter that makes
  it (none for a plain rename); :func:`convert` runs the converter on loaded tensors, optionally on a range of rows
  only (:attr:`TensorSource.by_rows`: the first operation stacks one checkpoint tensor per row, e.g. per expert, and
  no later one mixes rows, so a rank holding experts 4..7 reads those experts' tensors and nothing else);
- :func:`checkpoint_layout`: lazy model tensors -> lazy checkpoint tensors (the reverse conversion, run once per
  group of outputs when the first of them is loaded), so an export is a folder ``from_pretrained`` loads exactly as
  it loads the original checkpoint.

Nothing here is written twice from transformers: the patterns, key renaming and tensor operations are its own; this
module only groups keys and decides which rows a caller needs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    PrefixChange,
    Transpose,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
    rename_source_key,
)

from gym_lightning._compat import weight_conversions_of
from gym_lightning.errors import GymUserError
from gym_lightning.lazy import LazyTensor

Loader = Callable[[str], torch.Tensor]


def safetensors_files(source: str) -> list[Path]:
    """The ``*.safetensors`` weight files of a local folder (empty for anything else)."""
    folder = Path(source)
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


@dataclass
class TensorSource:
    """The checkpoint tensors one model tensor is made of.

    Args:
        target: The model's state-dict key.
        sources: Checkpoint keys per converter source pattern, each list in checkpoint order (experts 0, 1, ...);
            a plain rename has one pattern, ``""``, with one key.
        converter: transformers' ``WeightConverter`` that makes the tensor, ``None`` for a plain rename.
    """

    target: str
    sources: dict[str, list[str]] = field(default_factory=dict)
    converter: WeightConverter | None = None

    @property
    def keys(self) -> list[str]:
        """Every checkpoint key this tensor is made of."""
        return [key for keys in self.sources.values() for key in keys]

    @property
    def by_rows(self) -> bool:
        """Whether row ``i`` (dim 0) of the tensor comes from the ``i``-th key of each pattern alone: the converter
        first stacks the keys along dim 0 (``MergeModulelist(dim=0)``) and then only concatenates or transposes
        other dims. Then rows ``a:b`` are made from keys ``a:b``."""
        if self.converter is None:
            return False
        first, *rest = self.converter.operations
        return isinstance(first, MergeModulelist) and first.dim == 0 and all(map(_keeps_rows, rest))


def _keeps_rows(op: object) -> bool:
    if isinstance(op, Concatenate):
        return op.dim != 0
    if isinstance(op, Transpose):  # check_dims compares with the whole parameter's shape: not for a row range
        return 0 not in (op.dim0, op.dim1) and not op.check_dims
    return False


def checkpoint_sources(
    model: PreTrainedModel, checkpoint_keys: Iterable[str], model_keys: Iterable[str]
) -> dict[str, TensorSource]:
    """``{model key: TensorSource}`` for every key of ``model_keys`` that ``checkpoint_keys`` provide, as
    ``from_pretrained`` maps them (its conversion table, legacy renames and base-model prefix included)."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    wanted = dict.fromkeys(model_keys, True)
    found: dict[str, TensorSource] = {}
    # Natural order (experts 2 before 10), as transformers collects them: a converter stacks in this order.
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        target, pattern = rename_source_key(
            key, renamings, converters, base_model_prefix=model.base_model_prefix, meta_state_dict=wanted
        )
        if target not in wanted:
            continue  # a checkpoint tensor the model does not have (from_pretrained reports it as unexpected)
        entry = found.setdefault(target, TensorSource(target, converter=by_pattern.get(pattern or "")))
        entry.sources.setdefault(pattern or "", []).append(key)
    return found


def convert(
    source: TensorSource, load: Loader, model: PreTrainedModel, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """The model tensor ``source`` describes, from checkpoint tensors ``load(key)`` gives; with ``rows=(a, b)`` (only
    where :attr:`TensorSource.by_rows`) only its rows ``a:b``, reading only the keys they are made of."""
    if source.converter is None:
        (key,) = source.keys
        return load(key)
    if rows is not None and not source.by_rows:
        raise ValueError(f"{source.target}: its converter mixes rows; convert it whole.")
    converter = WeightConverter(
        source_patterns=source.converter.source_patterns,
        target_patterns=source.converter.target_patterns,
        operations=source.converter.operations,
    )  # a fresh one: a converter collects the tensors it is given
    for pattern, keys in source.sources.items():
        for key in keys[slice(*rows)] if rows is not None else keys:
            converter.add_tensor(source.target, key, pattern, lambda key=key: load(key))
    made = converter.convert(source.target, model=model, config=model.config)
    value = made[source.target] if source.target in made else next(iter(made.values()))
    return value[0] if isinstance(value, list) else value


def tied_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Keys grouped by tensor identity: tied weights (embeddings and LM head) are one tensor under two names."""
    groups: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        groups.setdefault(id(tensor), []).append(key)
    return list(groups.values())


def refuse_missing(folder: str, missing: list[str]) -> None:
    """The error for a checkpoint that lacks weights the model needs (none: nothing to say)."""
    if missing:
        raise GymUserError(
            f"The checkpoint in {folder!r} has no tensor for {', '.join(missing)}. Sharded loading needs every weight "
            "in the safetensors files: re-save the model with save_pretrained, or set model.pretrained=false to start "
            "from a random initialisation."
        )


class SafetensorsReader:
    """The tensors of a folder's ``*.safetensors`` files, memory-mapped: whole, or a range of rows (dim 0), read from
    whichever file holds them (the headers are read once, when the reader is made).

    Args:
        folder: The folder holding the ``*.safetensors`` files.
    """

    def __init__(self, folder: str | Path) -> None:
        self.where: dict[str, Path] = {}
        for path in safetensors_files(str(folder)):
            with safe_open(path, framework="pt") as file:
                self.where.update(dict.fromkeys(file.keys(), path))

    def load(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""
        with safe_open(self.where[key], framework="pt") as file:
            return file.get_tensor(key)

    def load_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (only those bytes are read)."""
        with safe_open(self.where[key], framework="pt") as file:
            return file.get_slice(key)[start:stop]


def flat_span(
    shape: tuple[int, ...], span: range, rows: Callable[[int, int], torch.Tensor], whole: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """Elements ``span`` of the flattening of a tensor of shape ``shape``, from its rows ``rows(first, last)`` that
    hold them (a 0-dim tensor from ``whole()``): only those rows are read or made.

    Args:
        shape: The full tensor's shape.
        span: The elements wanted, indices into the flattened full tensor.
        rows: Rows ``first:last`` (dim 0) of the full tensor.
        whole: The whole tensor (for a tensor without rows).
    """
    if not span:
        return torch.empty(0)
    if not shape:
        return whole().reshape(-1)[span.start : span.stop]
    first, last, offset = rows_of_span(shape, span)
    return rows(first, last).reshape(-1)[offset : offset + len(span)]


def rows_of_span(shape: tuple[int, ...], span: range) -> tuple[int, int, int]:
    """The rows ``first:last`` (dim 0) of a tensor of ``shape`` that hold the elements ``span`` of its flattening,
    and where ``span`` starts in those rows' flattening."""
    row = math.prod(shape[1:])
    first, last = span.start // row, -(-span.stop // row)
    return first, last, span.start - first * row


def read_rows(
    source: TensorSource, reader: SafetensorsReader, model: PreTrainedModel, first: int, last: int
) -> torch.Tensor:
    """Rows ``first:last`` (dim 0) of the model tensor ``source`` describes, reading as little as its conversion
    allows: only those rows of a renamed tensor, only their experts' tensors where the converter works by rows."""
    if source.converter is None:
        return reader.load_rows(source.keys[0], first, last)
    if source.by_rows:
        return convert(source, reader.load, model, (first, last))
    return convert(source, reader.load, model)[first:last]


# ------------------------------------------------------------------------------------------------ export
# transformers >= 5.2x has these two as module functions (core_model_loading.apply_converters/apply_renamings);
# 5.17, the oldest version gym_lightning supports, does not: the same few lines over the transforms' public
# ``rename_source_key``.
def _apply_converters(key: str, converters: list[WeightConverter]) -> tuple[str, str | None]:
    """``key`` renamed by the first converter that matches it, and that converter's source pattern (else None)."""
    for converter in converters:
        renamed, pattern = converter.rename_source_key(key)
        if pattern is not None:
            return renamed, pattern
    return key, None


def _apply_renamings(key: str, renamings: list[WeightRenaming]) -> str:
    """``key`` renamed by every renaming in turn."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def _reverse_transforms(model: PreTrainedModel) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    """The transforms ``save_pretrained`` applies (``revert_weight_conversion``): those the model was loaded with,
    else its class's table without prefix changes, reversed."""
    transforms = weight_conversions_of(model)
    if transforms is None:
        transforms = get_model_conversion_mapping(model, add_legacy=False)
        transforms = [t for t in transforms if not isinstance(t, PrefixChange)]
    reverse: list[WeightTransform] = [t.reverse_transform() for t in transforms[::-1]]
    return (
        [t for t in reverse if isinstance(t, WeightRenaming)],
        [t for t in reverse if isinstance(t, WeightConverter)],
    )


def checkpoint_layout(model: PreTrainedModel, tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """``tensors`` (keyed as ``model``'s state dict) under the names and shapes ``save_pretrained`` writes.

    A converted group (one layer's expert tensors) is loaded and converted back once, when the first of its
    checkpoint tensors is loaded, and released when the last one is: the exporter, which loads tensors in order,
    holds one group at a time. Loads of the model tensors keep their order, so collectives stay in step on every
    rank.
    """
    renamings, converters = _reverse_transforms(model)
    if not converters and not renamings:
        return tensors
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    # In the model's order; a converted group takes the place of its first member.
    order: list[tuple[str, LazyTensor] | dict[str, str]] = []
    groups: dict[str, dict[str, str]] = {}  # group name -> {model key: the converter's source pattern}
    for key, tensor in tensors.items():
        renamed, pattern = _apply_converters(key, converters)
        if pattern is None:
            order.append((_apply_renamings(key, renamings), tensor))
            continue
        if renamed not in groups:
            groups[renamed] = {}
            order.append(groups[renamed])
        groups[renamed][key] = pattern
    out: dict[str, LazyTensor] = {}
    for entry in order:
        if isinstance(entry, tuple):
            out[entry[0]] = entry[1]
        else:
            converter = by_pattern[next(iter(entry.values()))]
            out.update(_ReversedGroup(model, converter, {k: tensors[k] for k in entry}, entry, renamings).lazy())
    return out


class _ReversedGroup:
    """The checkpoint tensors one reversed converter makes from a group of model tensors, loaded together once."""

    def __init__(
        self,
        model: PreTrainedModel,
        converter: WeightConverter,
        inputs: dict[str, LazyTensor],
        patterns: dict[str, str],
        renamings: list[WeightRenaming],
    ) -> None:
        self.model, self.converter, self.inputs, self.patterns = model, converter, inputs, patterns
        self.renamings = renamings
        self.made: dict[str, torch.Tensor] | None = None

    def _run(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(self.converter)
        first = next(iter(values))
        renamed, _ = _apply_converters(first, [converter])
        for key, value in values.items():
            converter.add_tensor(renamed, key, self.patterns[key], value)
        made = converter.convert(renamed, model=self.model, config=self.model.config)
        return {_apply_renamings(k, self.renamings): v[0] if isinstance(v, list) else v for k, v in made.items()}

    def lazy(self) -> dict[str, LazyTensor]:
        meta = {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in self.inputs.items()}
        shapes = self._run(meta)
        return {key: LazyTensor(tuple(t.shape), t.dtype, lambda key=key: self._take(key)) for key, t in shapes.items()}

    def _take(self, key: str) -> torch.Tensor:
        if self.made is None:
            self.made = self._run({name: tensor.load() for name, tensor in self.inputs.items()})
        value = self.made.pop(key)
        if not self.made:
            self.made = None  # every output handed out: release the group
        return value


__all__ = [
    "Loader",
    "SafetensorsReader",
    "TensorSource",
    "checkpoint_layout",
    "checkpoint_sources",
    "convert",
    "flat_span",
    "read_rows",
    "refuse_missing",
    "rows_of_span",
    "safetensors_files",
    "tied_groups",
]
