"""One row of ``gym train``'s tables: how a field of a source's config (HF's ``TrainingArguments``, TRL's
``SFTConfig``, LLaMA-Factory's hparams, ...) is read here.

- ``mapped``: it sets a ``gym fit`` setting (``note`` says which);
- ``accepted``: any value is taken and changes nothing here (``note`` says why);
- ``refused``: its default (and the values in ``allowed``, which change nothing here) is taken; any other value is
  refused in one line, ``--NAME VALUE is not supported: <note>.``, which says why and what to do instead.

``flag`` is the ``gym train`` argument the field sets, where that is not the field's own name (LLaMA-Factory's
``cutoff_len`` sets ``max_seq_length``). ``default`` is the source's default of a field that is no flag here (a
key of a config file only), against which a given value is compared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["mapped", "accepted", "refused"]
KINDS: tuple[Kind, ...] = ("mapped", "accepted", "refused")
NO_DEFAULT = object()  # ``Row.default`` of a field that is a gym train flag (the parser's default counts)


@dataclass(frozen=True)
class Row:
    """How ``gym train`` reads one field of a source's config.

    Args:
        kind: ``mapped``, ``accepted`` or ``refused``.
        note: The setting it becomes (mapped), or why it changes nothing (accepted) or is refused (with the fix).
        flag: The ``gym train`` argument it sets, where that is not the field's own name.
        allowed: Values of a refused field taken besides its default (they change nothing here).
        default: The source's default of a field that is a config-file key only (not a flag).
    """

    kind: Kind
    note: str
    flag: str | None = None
    allowed: tuple[Any, ...] = ()
    default: Any = NO_DEFAULT

    def takes(self, value: Any, default: Any) -> bool:
        """Whether ``value`` (with ``default`` the parser's or the source's default) is taken without a refusal.

        Compared as text, as argparse and YAML give it: an enum equals its value's text, ``"None"`` is ``None``, a
        list flag's one value (``--loss_type nll``) is that value."""
        if self.kind != "refused" or value in ([], {}):
            return True
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        return str(value) in {str(default), *map(str, self.allowed)}


def mapped(note: str, flag: str | None = None) -> Row:
    return Row("mapped", note, flag)


def accepted(why: str, default: Any = NO_DEFAULT) -> Row:
    return Row("accepted", why, default=default)


def refused(why: str, *allowed: Any, default: Any = NO_DEFAULT) -> Row:
    return Row("refused", why, allowed=tuple(allowed), default=default)


def refusal(name: str, value: Any, row: Row) -> str:
    """The one line of a refused value."""
    shown = value[0] if isinstance(value, list) and len(value) == 1 else value
    return f"--{name} {shown!r} is not supported: {row.note}."


def counts(table: Mapping[str, Row], names: Iterable[str]) -> dict[str, int]:
    """How many of ``names`` the table maps, accepts and refuses (the coverage figures of docs/gym-train.md)."""
    found = Counter(table[name].kind for name in names)
    return {kind: found[kind] for kind in KINDS}


def merged(*tables: Mapping[str, Row]) -> dict[str, Row]:
    """One table of several, the first table's row winning where two hold the same field."""
    result: dict[str, Row] = {}
    for table in tables:
        result |= {name: row for name, row in table.items() if name not in result}
    return result


__all__ = [
    "KINDS",
    "NO_DEFAULT",
    "Kind",
    "Row",
    "accepted",
    "counts",
    "mapped",
    "merged",
    "refusal",
    "refused",
]
