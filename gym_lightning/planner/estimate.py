"""Per-GPU and per-node memory of a finetuning step for one strategy, and whether it fits (pure, no torch).

:func:`estimate` asks the strategy's cost model (``planner.families``) for its model states and buffers, adds the
strategy-independent activations and logits (``planner.activations``), and finds the largest micro-batch that fits.
The names the rest of the package and the benchmarks read are kept here too: :data:`Setup` is the run's
:class:`~gym_lightning.planner.spec.RunSpec`, and :func:`model_states`, :func:`buffer_bytes`,
:func:`host_bytes_per_node` ask a strategy's cost model. docs/planner.md, "Model", derives every term.
"""

from __future__ import annotations

from dataclasses import dataclass

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.activations import (
    CHUNKED_LOSS_MIN_VOCAB,
    activation_bytes,
    activation_bytes_per_layer,
    attention_exchange_bytes,
    check_setup,
    logits_bytes,
    loss_chunked,
    mlp_tile_bytes,
    mlp_tiles,
    sequence_parallel_problems,
    sp_kv_width,
)
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.families.base import ModelStates, quant_read_bytes, supported, tensor_rows_bytes
from gym_lightning.planner.params import (
    NF4_BLOCK,
    NF4_CHUNK_BYTES,
    NF4_COMPUTE_BYTES,
    NF4_SCALE_BLOCK,
    OPTIMIZER_STATE_BYTES,
    ParamCounts,
    dequant_bytes,
    frozen_bytes,
    layer_bytes,
    nf4_tensors,
    param_counts,
    quantized_base,
    tensor_groups,
    unit_bytes,
)
from gym_lightning.planner.spec import RunSpec, local_tokens
from gym_lightning.planner.strategies import STRATEGIES, STRATEGY_BY_KEY, STRATEGY_KEYS, Strategy, planner_strategy

# The run description under the name the planner's callers have used; one class, not a second description.
Setup = RunSpec


def model_states(shape: ModelShape, strategy: Strategy, spec: RunSpec) -> ModelStates:
    """Per-GPU model-state bytes of ``strategy`` (its cost model's); the optimizer column includes fp32 masters."""
    return cost_model(strategy, shape, spec).states()


def buffer_bytes(shape: ModelShape, strategy: Strategy, spec: RunSpec) -> float:
    """The step's temporary buffers of ``strategy``: gathered units, buckets, autocast's 16-bit weight copies and
    one NF4 layer's dequantised weight."""
    return cost_model(strategy, shape, spec).step_buffers()


def host_bytes_per_node(shape: ModelShape, strategy: Strategy, spec: RunSpec) -> float:
    """Host RAM per node: the larger of loading the checkpoint and the offloaded states, plus each process."""
    return cost_model(strategy, shape, spec).host_per_node()


modelled = supported


@dataclass(frozen=True)
class Estimate:
    """Memory of one strategy: bytes per GPU by category (``reference``: a preference stage's frozen reference
    copy, held as the strategy holds the policy), host and NVMe bytes per node, and whether it fits."""

    strategy: Strategy
    params: float
    grads: float
    optimizer_state: float
    activations: float
    logits: float
    buffers: float
    host_per_node: float
    nvme_per_node: float
    fits_gpu: bool
    fits_host: bool
    max_micro_batch: int
    modelled: bool = True  # False: figures not computed for this combination (see :func:`modelled`), never "fits"
    reference: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_state

    @property
    def gpu_total(self) -> float:
        return self.model_states + self.activations + self.logits + self.buffers + self.reference

    @property
    def fits(self) -> bool:
        return self.modelled and self.fits_gpu and self.fits_host


def largest_micro_batch(shape: ModelShape, spec: RunSpec, fixed: float) -> int:
    """The largest micro-batch whose activations and logits fit beside ``fixed`` bytes (0 if none). A bisection,
    not a division: with the chunked loss the logits stop growing at one chunk, so memory is not linear in it."""

    def fits(batch: int) -> bool:
        used = fixed + activation_bytes(shape, spec, batch) + logits_bytes(shape, spec, batch)
        return used <= spec.usable_gpu_memory

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def estimate(shape: ModelShape, strategy: Strategy, spec: RunSpec) -> Estimate:
    """Everything the planner reports for ``strategy``; a :class:`GymUserError` for impossible sequence-parallel
    settings (``activations.check_setup``)."""
    check_setup(shape, spec)
    model = cost_model(strategy, shape, spec)
    states = model.states()
    buffers, reference = model.step_buffers(), model.reference_bytes()
    fixed = states.total + buffers + reference
    host = model.host_per_node()
    known = model.modelled()
    largest = largest_micro_batch(shape, spec, fixed) if known else 0
    b = spec.micro_batch_size
    activations, logits = activation_bytes(shape, spec, b), logits_bytes(shape, spec, b)
    return Estimate(
        strategy=strategy,
        params=states.params,
        grads=states.grads,
        optimizer_state=states.optimizer_state,
        activations=activations,
        logits=logits,
        buffers=buffers,
        host_per_node=host,
        nvme_per_node=spec.gpus_per_node * (states.nvme + model.reference_host_bytes("nvme")),
        fits_gpu=fixed + activations + logits <= spec.usable_gpu_memory,
        fits_host=host <= spec.host_memory,
        max_micro_batch=largest,
        modelled=known,
        reference=reference,
    )


def estimate_all(shape: ModelShape, spec: RunSpec) -> list[Estimate]:
    """One :class:`Estimate` per strategy, fastest first."""
    return [estimate(shape, strategy, spec) for strategy in STRATEGIES]


def recommend(estimates: list[Estimate]) -> Estimate | None:
    """The fastest strategy that fits on the GPUs and in host memory (``estimates`` ordered fastest first)."""
    return next((e for e in estimates if e.fits), None)


def zero_bucket_elements(shape: ModelShape, spec: RunSpec) -> int:
    """Elements of DeepSpeed's reduce bucket (``families.zero.ZeRO.bucket_elements``)."""
    return cost_model(STRATEGY_BY_KEY["zero2"], shape, spec).bucket_elements()  # type: ignore[attr-defined]


__all__ = [
    "CHUNKED_LOSS_MIN_VOCAB",
    "NF4_BLOCK",
    "NF4_CHUNK_BYTES",
    "NF4_COMPUTE_BYTES",
    "NF4_SCALE_BLOCK",
    "OPTIMIZER_STATE_BYTES",
    "STRATEGIES",
    "STRATEGY_BY_KEY",
    "STRATEGY_KEYS",
    "Estimate",
    "GymUserError",
    "ModelStates",
    "ParamCounts",
    "Setup",
    "Strategy",
    "activation_bytes",
    "activation_bytes_per_layer",
    "attention_exchange_bytes",
    "buffer_bytes",
    "check_setup",
    "dequant_bytes",
    "estimate",
    "estimate_all",
    "frozen_bytes",
    "host_bytes_per_node",
    "largest_micro_batch",
    "layer_bytes",
    "local_tokens",
    "logits_bytes",
    "loss_chunked",
    "mlp_tile_bytes",
    "mlp_tiles",
    "model_states",
    "modelled",
    "nf4_tensors",
    "param_counts",
    "planner_strategy",
    "quant_read_bytes",
    "quantized_base",
    "recommend",
    "sequence_parallel_problems",
    "sp_kv_width",
    "tensor_groups",
    "tensor_rows_bytes",
    "unit_bytes",
    "zero_bucket_elements",
]
