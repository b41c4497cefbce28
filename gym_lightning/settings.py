"""Settings dataclasses read from plain data: YAML and a checkpoint's hyper-parameters give a mapping where a Python
caller gives the dataclass itself (``LoRAArgs``, ``QuantizationArgs``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from gym_lightning.errors import GymUserError

T = TypeVar("T")


def settings_from(cls: type[T], value: T | Mapping[str, Any] | None, name: str, what: str) -> T | None:
    """``value`` as ``cls``: as given, or built from a mapping of its fields; ``None`` stays ``None``. A value of
    another kind or an unknown key is refused in one line that names the setting ``name`` (``what`` it holds)."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise GymUserError(f"{name} must be {what}, got {value!r}.")
    known = {spec.name for spec in fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(value) - known):
        raise GymUserError(f"{name} has unknown settings {unknown}; the settings are {sorted(known)}.")
    return cls(**value)


__all__ = ["settings_from"]
