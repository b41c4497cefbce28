"""How a model is built: the plan a strategy hands the builder, and what the builder records in it for the strategy.

torchtitan builds a model on the meta device, shards it (``parallelize``), then gives it storage and weights
(``to_empty``, ``init_weights`` or a checkpoint load), with model code that knows nothing of parallelism. Lightning
builds the model in the LightningModule's ``configure_model``, so the strategy cannot call the builder itself; it
says how it wants models built through a :class:`BuildPlan` that the module passes to
``models.loading.build_causal_lm`` (``plan_of(trainer.strategy)``; a strategy provides one with ``build_plan()``,
``protocols.ProvidesBuildPlan``). The builder records, in that same plan, where each model's weights come from
(:class:`WeightsSource`); the strategy reads the record after ``configure_model`` and fills or replaces the weights:

- ``gym_fsdp`` plans a meta-device build: it shards the empty model, then each rank reads only its own shards
  (``strategies.materialize``);
- ZeRO-3 plans a recorded random initialisation: it builds under ``deepspeed.zero.Init`` (partitioned as created),
  and replaces a random draw by the one one process makes from the same seed (:func:`reference_state_dict`), or
  reads each partition's slice of a pretrained folder;
- every other strategy gets the default plan: an ordinary build on the current default device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from gym_lightning.protocols import ProvidesBuildPlan

META = torch.device("meta")


@dataclass(frozen=True)
class WeightsSource:
    """Where the initial weights of a built model come from, for a strategy that fills (or refills) them.

    Args:
        folder: Local folder whose ``*.safetensors`` files hold the weights; ``None`` for a random initialisation.
        config: The model config (a random initialisation is rebuilt from it: :func:`reference_state_dict`).
        options: The ``from_config`` keyword arguments of the build (dtype, attention implementation, ...).
        rng_state: The CPU random generator state when the model was built: a random initialisation draws from it,
            so it equals what one process building the model at that point draws, whatever the strategy or ranks.
    """

    folder: str | None
    config: PretrainedConfig
    options: dict[str, Any]
    rng_state: torch.Tensor


@dataclass
class BuildPlan:
    """How a strategy wants models built, and (filled by the builder) where their weights come from.

    Args:
        device: ``torch.device("meta")``: build with no storage and leave the weights to the strategy, which shards
            the empty model and then loads each rank's shards. ``None``: build on the current default device
            (Lightning's ``tensor_init_context`` sets it to the rank's device), drawing a random initialisation on
            the CPU generator first so that it depends on the seed alone.
        record_random_init: Build where the construction context puts the model (DeepSpeed's ``zero.Init``) and
            record a random initialisation's :class:`WeightsSource`, so that the strategy can replace that draw by
            one process's (:func:`reference_state_dict`).

    Attributes:
        built: ``(model, source)`` of each model built under this plan whose weights the strategy fills (meta
            builds) or may replace (recorded random initialisations), in build order. The strategy empties it with
            :meth:`take`.
    """

    device: torch.device | None = None
    record_random_init: bool = False
    fill_pretrained: bool = False
    built: list[tuple[nn.Module, WeightsSource]] = field(default_factory=list)

    @property
    def on_meta(self) -> bool:
        """Whether models are built on the meta device (no storage; the strategy loads the weights)."""
        return self.device is not None and self.device.type == "meta"

    def record(self, model: nn.Module, source: WeightsSource) -> None:
        """The builder's note that ``model``'s weights come from ``source``."""
        self.built.append((model, source))

    def take(self) -> list[tuple[nn.Module, WeightsSource]]:
        """The recorded ``(model, source)`` pairs, removed from the plan (each is filled once)."""
        built, self.built = self.built, []
        return built


def plan_of(strategy: object) -> BuildPlan:
    """The build plan ``strategy`` asks for (``build_plan()``, ``protocols.ProvidesBuildPlan``), else the default
    plan: an ordinary build on the current default device. ``None`` (no Trainer) gets the default plan too."""
    return strategy.build_plan() if isinstance(strategy, ProvidesBuildPlan) else BuildPlan()


def reference_state_dict(source: WeightsSource) -> dict[str, torch.Tensor]:
    """The random initialisation of ``source`` as one CPU process draws it (the caller's generator is left as is).

    Holds the whole model: strategies call it on one rank and scatter or copy from there.
    """
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(source.rng_state)
        return draw_on_cpu(source.config, source.options).state_dict()


def draw_on_cpu(config: PretrainedConfig, options: dict[str, Any]) -> PreTrainedModel:
    """One process's random initialisation of the model ``config`` describes: built on the CPU whatever the caller's
    default device, drawn by the CPU generator from its current state (the state ``WeightsSource`` records).

    Args:
        config: The model config.
        options: The ``from_config`` keyword arguments (dtype, attention implementation, ...).
    """
    with torch.device("cpu"):
        return AutoModelForCausalLM.from_config(config, **options)


def reference_buffers(source: WeightsSource) -> dict[str, torch.Tensor]:
    """The buffers no checkpoint holds (non-persistent: the rotary ``inv_freq``, ...) as one CPU process computes
    them, in their own dtype; the model is built on the meta device, so no parameter gets storage.

    A model built inside a construction context that changes how tensors are created (DeepSpeed's ``zero.Init``
    makes ``arange``/``zeros`` produce bf16 under bf16) computes them differently, and the logits then differ from
    a plain load's (docs/benchmarks-history.md, "Buffers computed under zero.Init").
    """
    with torch.random.fork_rng(devices=[]), META:
        model = AutoModelForCausalLM.from_config(source.config, **source.options)
    saved = set(model.state_dict())
    for name, module in model.named_modules():
        for key, buffer in list(module.named_buffers(recurse=False)):
            full = f"{name}.{key}" if name else key
            module.register_buffer(key, torch.empty_like(buffer, device="cpu"), persistent=full in saved)
    initialize_unsaved(model, model.state_dict(keep_vars=True))
    return {key: buffer for key, buffer in model.named_buffers() if key not in saved}


def initialize_unsaved(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Hugging Face's own initialisation for what no state dict holds (non-persistent buffers, e.g. rotary
    ``inv_freq``): every tensor of ``state`` is marked initialised, so ``initialize_weights`` leaves it alone."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)  # set on a meta build, would skip the module entirely
    for tensor in state.values():
        tensor._is_hf_initialized = True
    model.initialize_weights()


__all__ = [
    "META",
    "BuildPlan",
    "WeightsSource",
    "draw_on_cpu",
    "initialize_unsaved",
    "plan_of",
    "reference_buffers",
    "reference_state_dict",
]
