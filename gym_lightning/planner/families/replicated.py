"""Replicated data parallelism: gym_ddp (torch DDP) and FSDP2 without sharding; every rank holds everything.

Memory (docs/planner.md, "Model states"): torch AMP under ``bf16-mixed`` keeps fp32 trainable parameters and
gradients (16Ψt with AdamW, no separate master), the frozen base in the compute dtype. gym_ddp's gradients are DDP's
reducer buckets (``gradient_as_bucket_view``, zeroed in place), one copy, and one rank runs no DDP at all; FSDP
without sharding keeps a bucket-sized copy beside them. Autocast caches a 16-bit copy of each weight it casts until
backward has used it (one layer's under activation checkpointing). Loading: ``from_pretrained`` on every rank, the
loaded copy held until the last tensor is cast to fp32.

Time: one all-reduce of the gradients per optimizer step, in 25 MiB buckets during the last micro-batch's backward
(the last bucket after it); PowerSGD sends its factors (Vogels et al. 2019), a compression hook 16-bit gradients.
"""

from __future__ import annotations

import math

from gym_lightning.planner.families.base import CostModel, ModelStates, PhasePeak, Traffic, place, quant_read_bytes
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.params import frozen_bytes, quantized_base

# DDP's bucket (torch's ``bucket_cap_mb`` default, 25 MiB): the last one is reduced after backward has ended.
DDP_BUCKET_BYTES = 25 * 2**20


class Replicated(CostModel):
    """Cost model of gym_ddp and FSDP2 ``sharding="none"`` (see the module docstring)."""

    @property
    def shards(self) -> int:
        return 1

    def dtype_bytes(self) -> tuple[int, int, int, int]:
        return 4, 2 if self.half else 4, 0, 0

    def states(self) -> ModelStates:
        t = self.counts.trainable
        p, pf, _, _ = self.dtype_bytes()
        params = p * t + frozen_bytes(self.shape, self.spec, pf)
        states = ModelStates(params, p * t, self.optimizer_state_bytes() * t)
        if self.strategy.offload_optimizer == "none":
            return states
        return self.offloaded_states(states.optimizer_state, params)

    def bucket_copy(self) -> float:
        """Reducer buckets beside the fp32 gradients: none for gym_ddp (its gradients are the buckets)."""
        return 0.0 if self.strategy.ddp else 4.0 * self.counts.trainable

    def buffers(self) -> float:
        # NF4 weights are never cast: their layer dequantises them itself and frees the copy after the matmul.
        layers = self.shape.num_layers * self.shape.layer_params() - quantized_base(self.shape, self.spec).weights
        casts = 0 if self.spec.activation_checkpointing or not self.half else 2 * layers
        return self.bucket_copy() + casts

    def resident_buffers(self) -> float:
        return self.bucket_copy()

    def export_buffers(self) -> float:
        return 0.0  # Lightning tears the strategy down before on_fit_end: the wrapper and its buckets are gone

    def load_peak(self) -> PhasePeak:
        if self.spec.quantization != "none":
            return self.qlora_load_peak()
        t, f = self.counts.trainable, self.counts.frozen
        d = self.spec.checkpoint_dtype_bytes
        return place(self.spec, 4 * t + self.dtype_bytes()[1] * f + d * (t + f))

    def qlora_load_peak(self) -> PhasePeak:
        """Each process fills its whole 4-bit model on the host, then casts the adapters to fp32 (after the read)."""
        base = frozen_bytes(self.shape, self.spec, 2 if self.half else 4)
        read, extra = quant_read_bytes(self.shape, self.spec, 1), 4 * self.counts.trainable
        if self.spec.accelerator == "cpu":
            return place(self.spec, base + max(read, extra))
        return place(self.spec, base + extra, base + read)

    def host_load_bytes(self) -> float:
        spec = self.spec
        load_dtype = 2 if self.half else 4
        if spec.quantization != "none":
            filled = frozen_bytes(self.shape, spec, load_dtype) + quant_read_bytes(self.shape, spec, 1)
            return spec.gpus_per_node * filled
        return spec.gpus_per_node * load_dtype * self.counts.total_with_adapters

    def traffic(self, hw: Hardware) -> Traffic:
        world = self.group(self.spec.world_size, hw)
        grads = self.gradient_bytes()
        total = world.all_reduce(grads, calls=math.ceil(grads / DDP_BUCKET_BYTES))
        last = world.all_reduce(min(DDP_BUCKET_BYTES, grads))
        return Traffic(last_backward=total, last_backward_exposed=last)

    def gradient_bytes(self) -> float:
        """Bytes every trainable gradient is reduced in (PowerSGD: its rank-r factors, fp32)."""
        if self.spec.gradient_compression == "powersgd" and self.strategy.ddp:
            return 4 * powersgd_elements(self)
        return super().gradient_bytes()

    def offload_seconds(self, hw: Hardware) -> float:
        if not self.strategy.offloads:
            return 0.0
        return self.sharded_offload_seconds(hw, 4, 4)  # FSDP2's CPUOffloadPolicy: fp32 shards, fp32 gradients


def powersgd_elements(model: CostModel) -> float:
    """Elements PowerSGD all-reduces for the trainable weights: ``r (m + n)`` per matrix (its P and Q factors,
    Vogels et al. 2019), vectors and matrices it would not shrink whole."""
    from gym_lightning.planner.families.base import trainable_tensor_shapes

    rank, total = model.spec.powersgd_rank, 0.0
    for m, n, count in trainable_tensor_shapes(model.shape, model.spec):
        low = rank * (m + n)
        total += count * (low if n > 1 and low < m * n else m * n)
    return total


__all__ = ["DDP_BUCKET_BYTES", "Replicated", "powersgd_elements"]
