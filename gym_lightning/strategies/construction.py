"""How a strategy asks model builders to construct a model: the contexts it wraps ``configure_model`` in.

A model builder (``gym_lightning.models.loading.build_causal_lm``) checks these flags and attaches a
``WeightsSource`` to the model it returns, so that the strategy can give the model its weights after sharding it,
without knowing which module or builder made it:

- ``deferred_weights()`` (``gym_fsdp``): build on the meta device, no storage; the strategy shards the empty model
  and each rank then loads its own shards (``strategies.materialize``);
- ``recorded_random_init()`` (ZeRO-3): build as usual under ``zero.Init`` and record what a random initialisation
  was drawn from, so that the strategy can replace it by one process's draw (``reference_state_dict``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

# Set by ``deferred_weights()``: build on the meta device and record where the weights come from instead.
_DEFERRED: ContextVar[bool] = ContextVar("gym_lightning_deferred_weights", default=False)
# Set by ``recorded_random_init()``: build as usual, and record what a random initialisation was drawn from.
_RECORD_RANDOM_INIT: ContextVar[bool] = ContextVar("gym_lightning_recorded_random_init", default=False)
WEIGHTS_SOURCE_ATTRIBUTE = "gym_weights_source"


@dataclass(frozen=True)
class WeightsSource:
    """Where the initial weights of a model come from, for a strategy that fills (or refills) them after sharding.

    Args:
        folder: Local folder whose ``*.safetensors`` files hold the weights; ``None`` for a random initialisation.
        config: The model config (a random initialisation is rebuilt from it: ``reference_state_dict``).
        options: The ``from_config`` keyword arguments of the build (dtype, attention implementation, ...).
        rng_state: The CPU random generator state when the model was built: a random initialisation draws from it,
            so it equals what one process building the model at that point draws, whatever the strategy or ranks.
    """

    folder: str | None
    config: PretrainedConfig
    options: dict[str, Any]
    rng_state: torch.Tensor


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Inside, ``build_causal_lm`` builds on the meta device (no storage) and attaches a ``WeightsSource``.

    A sharding strategy uses this as its construction context: it shards the empty model, gives each rank storage
    for its own shards only and then fills them from the record (``strategies.materialize``).
    """
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


@contextmanager
def recorded_random_init() -> Iterator[None]:
    """Inside, a randomly initialised ``build_causal_lm`` model carries a ``WeightsSource`` (``folder=None``).

    For strategies whose construction context draws random numbers differently from one process (DeepSpeed's
    ``zero.Init`` initialises on rank 0 after skipping torch's default initialisation): they replace the weights by
    ``reference_state_dict``'s, so that the initial weights depend on the seed only.
    """
    token = _RECORD_RANDOM_INIT.set(True)
    try:
        yield
    finally:
        _RECORD_RANDOM_INIT.reset(token)


def building_on_meta() -> bool:
    """Whether a builder should build on the meta device and attach a ``WeightsSource`` (``deferred_weights``)."""
    return _DEFERRED.get()


def recording_random_init() -> bool:
    """Whether a builder should attach a ``WeightsSource`` to a random initialisation (``recorded_random_init``)."""
    return _RECORD_RANDOM_INIT.get()


def weights_source_of(model: torch.nn.Module) -> WeightsSource | None:
    """The ``WeightsSource`` attached to ``model`` by ``build_causal_lm`` (see the contexts above), else ``None``."""
    # vars(), not getattr: wrappers such as peft's PeftModel forward unknown attributes to the model they wrap.
    return vars(model).get(WEIGHTS_SOURCE_ATTRIBUTE)


def reference_state_dict(source: WeightsSource) -> dict[str, torch.Tensor]:
    """The random initialisation of ``source`` as one CPU process draws it (the caller's generator is left as is).

    Holds the whole model: strategies call it on one rank and scatter or copy from there.
    """
    # On the CPU whatever the caller's default device: the recorded state is the CPU generator's (models.loading).
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.set_rng_state(source.rng_state)
        return AutoModelForCausalLM.from_config(source.config, **source.options).state_dict()
