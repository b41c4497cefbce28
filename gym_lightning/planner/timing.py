"""Time of one optimizer step per strategy: the sum of pure terms, each with a unit test against a hand computation
(tests/planner/test_timing.py; docs/planner.md, "Step time", derives them and validates the sum).

* **Compute** (``planner.compute``): the micro-batch's GEMMs at a size-dependent efficiency, flash attention, the
  memory-bound elementwise work, a mixture of experts' per-expert loop, all over the project's kernel efficiency;
  activation checkpointing adds the decoder layers' forward again.
* **Collectives** (``planner.comm``): each family's bytes (``CostModel.traffic``) at latency plus bandwidth, the
  latency growing with the ring; hidden behind the compute of the same phase but for the part with nothing to hide
  behind, and slowing that compute while they run (``Network.contention``).
* **Hooks**: ZeRO-3's per-module fetches on the host (``CostModel.hook_seconds``).
* **The slowest rank**: the step waits for the slowest of the ranks' compute (``comm.slowest_of``).
* **Optimizer step**: memory-bound, bytes per trainable element over the device's memory bandwidth; sharded
  strategies step their partition. **Offload**: PCIe copies, the CPU optimizer, NVMe swaps (not hidden).
* **Gradient accumulation**: compute and per-micro-batch collectives (FSDP's and ZeRO-2/3's) scale with the
  micro-batches; DDP's all-reduce and ZeRO-1's reduction run once per optimizer step.
* **Preference stages**: the forwards without gradient (a reference's, KTO's KL rows') with their gathers
  (``CostModel.no_grad_traffic``) in each micro-batch; ``precompute_ref_log_probs`` moves the reference's forward
  to one pass before training (:func:`reference_pass_seconds`, a one-off in :meth:`Speed.hours`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.comm import Group, contention_seconds, overlapped_seconds, slowest_of
from gym_lightning.planner.compute import flops_per_token, forward_seconds, micro_batch_compute
from gym_lightning.planner.families import cost_model
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.spec import RunSpec, local_tokens
from gym_lightning.planner.strategies import Strategy

# What the scaling efficiency compares with: one GPU, no wrapper, the whole optimizer step on the device.
PLAIN = Strategy("plain", "plain loop", "none", "replicated", sharding="none", ddp=True)
# The plain PyTorch loop measured on one H200 (docs/planner.md, "Calibration"): the row gym_lightning's own kernel
# efficiency is calibrated on (planner.machines).
PLAIN_LOOP = {"model": "qwen3-1.7b", "gpu": "h200-sxm", "micro_batch": 4, "seq_length": 2048, "tokens_per_s": 25_764}


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one rank, by term (``total`` is the sum of all but ``communication``)."""

    compute: float  # forward + backward of every micro-batch
    recompute: float  # activation checkpointing's second forward
    communication: float  # every collective of the step, hidden or not
    exposed_communication: float  # the part compute did not hide
    sequence_parallel: float  # Ulysses all-to-alls (between attention and the rest: nothing to hide behind)
    optimizer: float  # the optimizer step on the device
    offload: float  # PCIe copies, the CPU optimizer, NVMe swaps
    hooks: float = 0.0  # ZeRO-3's per-module fetches on the host
    contention: float = 0.0  # compute slowed by the collectives hidden behind it
    dispersion: float = 0.0  # waiting for the slowest rank
    no_grad_forward: float = 0.0  # of compute: the forwards without gradient (a reference's, KTO's KL rows')

    @property
    def total(self) -> float:
        shown = (self.compute, self.recompute, self.exposed_communication, self.sequence_parallel, self.optimizer)
        return sum(shown) + self.offload + self.hooks + self.contention + self.dispersion

    def as_dict(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def optimizer_seconds(elements: float, bytes_per_element: float, memory_bandwidth: float) -> float:
    """A memory-bound optimizer step: ``elements x bytes / bandwidth``."""
    return elements * bytes_per_element / memory_bandwidth


def sequence_parallel_seconds(shape: ModelShape, spec: RunSpec, hw: Hardware) -> float:
    """Ulysses' all-to-alls of one micro-batch (DeepSpeed Ulysses, Jacobs et al. 2023): per layer, q, k and v in
    and the attention output back, in forward and again for their gradients in backward (and once more when
    activation checkpointing recomputes the forward); ``tokens x width x a_b`` bytes each."""
    sp = spec.sequence_parallel_size
    if sp <= 1:
        return 0.0
    tokens = local_tokens(spec, spec.micro_batch_size)
    per_layer = tokens * (2 * shape.q_width + 2 * shape.kv_width) * spec.training.activation_bytes
    passes = 3 if spec.activation_checkpointing else 2
    group = Group(sp, -(-sp // spec.gpus_per_node), hw.network)
    return passes * shape.num_layers * group.all_to_all(per_layer)


def step_time(shape: ModelShape, strategy: Strategy, spec: RunSpec, hw: Hardware) -> StepTime:
    """Seconds of one optimizer step of ``spec.accumulate_grad_batches`` micro-batches on one rank."""
    model, net, micro = cost_model(strategy, shape, spec), hw.network, spec.accumulate_grad_batches
    c = micro_batch_compute(shape, spec, hw.kernels)
    backward = c.backward + c.recompute
    moved, quiet = model.traffic(hw), model.no_grad_traffic(hw)
    fwd = overlapped_seconds(c.forward, moved.forward, moved.forward_exposed, net.overlap)
    bwd = overlapped_seconds(backward, moved.backward, moved.backward_exposed, net.overlap)
    last = overlapped_seconds(bwd, moved.last_backward, moved.last_backward_exposed, net.overlap)
    no_grad = overlapped_seconds(c.no_grad, quiet.forward, quiet.forward_exposed, net.overlap)
    phases = (micro - 1) * (fwd + bwd) + fwd + last + micro * no_grad
    work = c.forward + backward + c.no_grad
    exposed = phases + moved.after_step - micro * work
    communication = micro * (moved.forward + moved.backward + quiet.forward) + moved.last_backward + moved.after_step
    contention = 0.0
    if net.overlap:
        contention = micro * contention_seconds(c.forward, moved.forward, moved.forward_exposed, net.contention)
        contention += micro * contention_seconds(backward, moved.backward, moved.backward_exposed, net.contention)
        contention += contention_seconds(bwd, moved.last_backward, moved.last_backward_exposed, net.contention)
        contention += micro * contention_seconds(c.no_grad, quiet.forward, quiet.forward_exposed, net.contention)
    elements = model.optimizer_elements()
    return StepTime(
        compute=micro * (c.forward + c.backward + c.no_grad),
        recompute=micro * c.recompute,
        communication=communication,
        exposed_communication=max(0.0, exposed),
        sequence_parallel=micro * sequence_parallel_seconds(shape, spec, hw),
        optimizer=optimizer_seconds(elements, model.step_traffic_bytes(), hw.memory_bandwidth),
        offload=model.offload_seconds(hw),
        hooks=micro * model.hook_seconds(hw),
        contention=contention,
        dispersion=slowest_of(micro * work, spec.world_size, net.dispersion),
        no_grad_forward=micro * c.no_grad,
    )


def reference_pass_seconds(shape: ModelShape, strategy: Strategy, spec: RunSpec, hw: Hardware) -> float:
    """``precompute_ref_log_probs``: seconds of the pass before training over one optimizer step's examples (0
    without it). Each micro-batch's rows run forward once through the pass's reference
    (``objectives.preference.precompute_reference``: a ``ref_model`` copy, else the policy itself, with its adapters
    off under LoRA) with its gathers and ZeRO-3's fetches; no backward, no optimizer. The values are stored with
    the data: the pass runs once, not once per epoch (:meth:`Speed.hours`)."""
    if spec.reference_hold != "precomputed":
        return 0.0
    model, kind = cost_model(strategy, shape, spec), spec.training.kind
    base = replace(spec, lora_r=0, lora_target_parameters=())
    tokens = local_tokens(spec, spec.micro_batch_size, kind.rows)
    compute = forward_seconds(shape, base, tokens, hw.kernels) / hw.kernels.efficiency
    if spec.ref_model is not None:
        gather, exposed = model.reference_gather(hw)
    else:
        moved = model.traffic(hw)
        gather, exposed = moved.forward, moved.forward_exposed
    one = overlapped_seconds(compute, gather, exposed, hw.network.overlap) + model.pass_hook_seconds(hw)
    return spec.accumulate_grad_batches * one


@dataclass(frozen=True)
class Speed:
    """What :func:`speed` predicts for one strategy.

    Args:
        step: The step's terms.
        tokens_per_step: Tokens of one optimizer step over the whole job.
        tokens_per_second_per_gpu: Job tokens per second / GPUs.
        mfu: Model FLOPs per second per GPU / the dense peak.
        scaling: Tokens per second per GPU / a plain loop's on one GPU (no strategy, memory aside): 1.0 is linear
            scaling; above it, sharding the optimizer step saved more than communication cost.
        reference_pass: ``precompute_ref_log_probs``' pass before training, seconds per optimizer step of data
            (:func:`reference_pass_seconds`; 0 without it).
    """

    step: StepTime
    tokens_per_step: int
    tokens_per_second_per_gpu: float
    mfu: float
    scaling: float
    reference_pass: float = 0.0

    def hours(self, tokens: float, gpus: int, epochs: float = 1.0) -> float:
        """Wall-clock hours of training ``tokens`` (``epochs`` passes over the data) on ``gpus`` GPUs, with the
        reference pass over the data once before training."""
        training = tokens / (self.tokens_per_second_per_gpu * gpus)
        return (training + self.reference_pass_seconds(tokens, epochs)) / 3600

    def reference_pass_seconds(self, tokens: float, epochs: float = 1.0) -> float:
        """Seconds of the reference pass over the data of ``tokens`` trained in ``epochs`` (once, not per epoch)."""
        return tokens / epochs / self.tokens_per_step * self.reference_pass


def tokens_per_step(spec: RunSpec) -> int:
    """Tokens of one optimizer step over the job: ``s x b x sequences x accumulation x data-parallel groups``."""
    per_group = spec.seq_length * spec.micro_batch_size * spec.training.kind.sequences * spec.accumulate_grad_batches
    return per_group * spec.data_parallel_size


def speed(shape: ModelShape, strategy: Strategy, spec: RunSpec, hw: Hardware) -> Speed:
    """Step time, tokens/s per GPU, MFU and scaling efficiency of ``strategy`` (see :class:`Speed`)."""
    step = step_time(shape, strategy, spec, hw)
    tokens = tokens_per_step(spec)
    per_gpu = tokens / step.total / spec.world_size
    flops = flops_per_token(shape, spec).model * tokens / step.total / spec.world_size
    alone = replace(spec, gpus_per_node=1, nodes=1, sequence_parallel_size=1)
    single_rate = tokens_per_step(alone) / step_time(shape, PLAIN, alone, hw).total
    once = reference_pass_seconds(shape, strategy, spec, hw)
    return Speed(step, tokens, per_gpu, flops / hw.peak_flops, per_gpu / single_rate, once)


__all__ = [
    "PLAIN",
    "PLAIN_LOOP",
    "Hardware",
    "Speed",
    "StepTime",
    "optimizer_seconds",
    "reference_pass_seconds",
    "sequence_parallel_seconds",
    "speed",
    "step_time",
    "tokens_per_step",
]
