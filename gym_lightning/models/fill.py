"""One loader for the weights of a built model, whatever holds them: each rank fills only what it holds of each
tensor, as an adapter (``models.holdings``) says, from one of two sources a build plan records (``WeightsSource``):

- a pretrained folder: every tensor mapped as ``from_pretrained`` maps it (``models.conversion``: renamed keys and
  fused experts), NF4 weights quantised as read (``models.quantized.RowQuantizer``: linear layers by rows, fused
  experts by whole experts, from their own per-expert checkpoint tensors), reading only the checkpoint rows
  the held part is made of, so no rank ever holds more than its parts plus the rows of one tensor; NF4 layers
  first, then the other tensors in checkpoint order (adapters that write through collectives rely on that order);
- a random initialisation: one process's draw from the recorded random state (``models.plan.reference_state_dict``),
  made on rank 0 only and distributed by the adapter.

Checkpoint tensors the model does not use (e.g. the layers a ``config_overrides`` dropped) are named in one warning.
The loader knows nothing of the strategy: only the adapter does.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from functools import partial

import torch
from transformers import PreTrainedModel

from gym_lightning.lora import checkpoint_key, is_adapter_key
from gym_lightning.models.conversion import (
    SafetensorsReader,
    checkpoint_sources,
    convert,
    flat_span,
    read_rows,
    refuse_missing,
)
from gym_lightning.models.holdings import Holdings, Part, Rows, Span, WholeTensors, rank
from gym_lightning.models.plan import WeightsSource, initialize_unsaved, reference_state_dict
from gym_lightning.models.quantized import RowQuantizer, sources_of

RowReader = Callable[[int, int], torch.Tensor]
_LISTED = 8  # unused checkpoint tensors (or layer patterns) a warning names; the rest are counted


@torch.no_grad()
def fill_weights(
    model: PreTrainedModel, source: WeightsSource, targets: dict[str, torch.Tensor], holdings: Holdings
) -> None:
    """Fill what this rank holds of ``targets`` (tensors of ``model``'s state dict) from ``source``.

    Args:
        model: The model the tensors belong to (its conversion table maps the checkpoint).
        source: Where the weights come from: a folder, or a recorded random initialisation.
        targets: ``{state-dict key: tensor}`` to fill; tied tensors may appear under several keys.
        holdings: What this rank holds of each tensor, and how it is written.
    """
    if source.folder is None:
        reference = holdings.alone(reference_state_dict, source) if rank() == 0 else {}
        holdings.distribute(model, targets, reference)
    else:
        _fill_pretrained(model, source.folder, targets, holdings)


def _fill_pretrained(model: PreTrainedModel, folder: str, targets: dict[str, torch.Tensor], holdings: Holdings) -> None:
    reader = SafetensorsReader(folder)
    groups, sources, layers = sources_of(model, reader.where, targets)
    refuse_missing(folder, [key for key in groups if key not in sources and not is_adapter_key(key)])
    warn_unused(model, folder, list(reader.where))
    quantizer = RowQuantizer(model, reader, sources, layers)
    for key, weight in layers.items():  # NF4 linear layers and fused expert weights: their parts, row by row
        for name, param in weight.parameters().items():
            whole = partial(quantizer.whole, key, name)
            _fill_part(holdings, param, partial(quantizer.component, key, name), whole)
    for key, source in sources.items():
        if key not in layers:
            whole = partial(convert, source, reader.load, model)
            _fill_part(holdings, targets[groups[key][0]], partial(read_rows, source, reader, model), whole)


def _fill_part(holdings: Holdings, tensor: torch.Tensor, rows: RowReader, whole: Callable[[], torch.Tensor]) -> None:
    """Write the part of ``tensor`` this rank holds, made from only the rows it needs (``rows(first, last)``)."""
    part = holdings.part(tensor)
    if not part.empty:
        holdings.write(tensor, part, partial(part_value, part, rows, whole))


def part_value(part: Part, rows: RowReader, whole: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The values of ``part`` of a tensor, from its rows ``rows(first, last)`` or, for a whole one, ``whole()``."""
    if isinstance(part, Rows):
        return rows(part.first, part.last)
    if isinstance(part, Span):
        return flat_span(part.shape, part.elements, rows, whole)
    return whole()


@torch.no_grad()
def fill_on_cpu(model: PreTrainedModel, source: WeightsSource) -> None:
    """Give a meta-built model storage on the CPU and its weights from ``source``, one tensor at a time (NF4 layers
    quantised as read): one process never holds more than the model and one 16-bit tensor."""
    model.to_empty(device="cpu")
    model.tie_weights()
    state = model.state_dict(keep_vars=True)
    fill_weights(model, source, state, WholeTensors())
    initialize_unsaved(model, state)


def warn_unused(model: PreTrainedModel, folder: str, stored: list[str]) -> None:
    """One warning (on rank 0) naming the checkpoint tensors ``model`` does not use, as ``from_pretrained`` reports
    its unexpected keys: a ``config_overrides`` that drops layers otherwise trains a smaller model in silence."""
    if rank() != 0:
        return
    wanted = [checkpoint_key(key) for key in model.state_dict(keep_vars=True)]
    used = {key for source in checkpoint_sources(model, stored, wanted).values() for key in source.keys}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unused = [key for key in stored if key not in used and not any(p.search(key) for p in ignored)]
    if unused:
        warnings.warn(
            f"{len(unused)} tensors of the checkpoint in {folder!r} are not used by the model and were not loaded: "
            f"{abbreviated(unused, stored)} (a config_overrides such as num_hidden_layers changes the model's shape).",
            stacklevel=2,
        )


_INDEXED = re.compile(r"^(.*?)\.(\d+)\.")


def abbreviated(keys: list[str], stored: Iterable[str]) -> str:
    """``keys`` in one line: numbered blocks whose every stored tensor is in ``keys`` as a pattern
    (``model.layers.{3..15}.*``), the other keys by name, at most ``_LISTED`` items and a count of the rest."""
    blocks: dict[tuple[str, int], list[str]] = {}
    for key in stored:
        if (match := _INDEXED.match(key)) is not None:
            blocks.setdefault((match[1], int(match[2])), []).append(key)
    chosen = set(keys)
    whole = {block for block, members in blocks.items() if all(key in chosen for key in members)}
    spans: dict[str, list[int]] = {}
    names: list[str] = []
    for key in keys:
        match = _INDEXED.match(key)
        block = (match[1], int(match[2])) if match is not None else None
        if block in whole:
            spans.setdefault(block[0], []).append(block[1])
        else:
            names.append(key)
    items = [f"{prefix}.{_numbers(sorted(set(numbers)))}.*" for prefix, numbers in spans.items()] + names
    rest = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + rest


def _numbers(numbers: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``{3..5,9}``; one number as itself."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    text = ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs)
    return text if len(numbers) == 1 else f"{{{text}}}"


__all__ = ["abbreviated", "fill_on_cpu", "fill_weights", "part_value", "warn_unused"]
