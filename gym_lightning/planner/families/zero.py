"""DeepSpeed ZeRO (gym's ZeROStrategy and Lightning's DeepSpeedStrategy): stage 1 partitions the optimizer state,
stage 2 also the gradients, stage 3 also the parameters (Rajbhandari et al. 2020, Sec. 5); the optimizer and the
parameters can live on the host or NVMe (ZeRO-Offload / -Infinity).

Memory: DeepSpeed keeps the model in its 16-bit dtype under ``bf16-mixed`` with fp32 master partitions (also in fp32
training), and converts the gradient partition to fp32 for the step (one optimizer sub-group at a time under stage
3: ``sub_group_size``, one decoder layer by gym's rule). Stage 3 keeps tensors under the persistence threshold whole
on every rank (within the model persistence budget), gathers about two modules at a time (the one in use and the
prefetched; gloo receives into a temporary of the gathered size, so twice that on CPU ranks) and holds one module's
gradient; its reduce bucket is one decoder layer (``bucket_size``), two under stage 2's ``overlap_comm``. Loading:
stages 1-2 build the whole 16-bit model on every rank, flatten it and clone the master partition; stage 3 builds
under ``zero.Init`` and each rank reads its partitions' slices.

Time: stage 1 reduce-scatters once per optimizer step after backward, stage 2 every micro-batch in layer buckets
(the last after backward); both all-gather the updated 16-bit parameters after the step. Stage 3 gathers each
module in forward and again in backward (prefetched: the first shows) and reduce-scatters in backward. Each gather
is one module hook on the host (DeepSpeed's fetch and its stream wait), paid per hooked module and pass
(:meth:`ZeRO.hook_seconds`): per decoder layer under gym's leaf rule, per submodule otherwise.
"""

from __future__ import annotations

import math

from gym_lightning.planner.families.base import CostModel, ModelStates, PhasePeak, Traffic, place, quant_read_bytes
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.params import frozen_bytes, quantized_base, unit_bytes

# DeepSpeed's step also converts the 16-bit gradient partition to fp32 (2 in, 4 out) and writes the 16-bit parameter
# copy after it (2): bytes per element beside the optimizer's own.
DEEPSPEED_STEP_EXTRA = 8
# ZeRO-Infinity's pinned swap buffers: DeepSpeed's default buffer_count x buffer_size (elements) per rank.
NVME_SWAP_ELEMENTS = 5 * 100_000_000


class ZeRO(CostModel):
    """Cost model of the ZeRO stages (see the module docstring)."""

    @property
    def shards(self) -> int:
        return self.spec.world_size

    @property
    def stage(self) -> int:
        return self.strategy.stage

    def dtype_bytes(self) -> tuple[int, int, int, int]:
        frozen = 2 if self.half else 4
        return (2, frozen, 4, 4) if self.half else (4, frozen, 4, 0)

    def bucket_elements(self) -> int:
        """Elements of DeepSpeed's reduce bucket: the knob, by default one decoder layer (``ZeROStrategy``'s
        ``derived_bucket_size``), capped at the model's size."""
        size = self.shape.layer_params() if self.spec.bucket_size is None else self.spec.bucket_size
        return min(size, self.counts.total_with_adapters)

    def states(self) -> ModelStates:
        t, n = self.counts.trainable, self.shards
        p, pf, _, fp32_grad = self.dtype_bytes()
        base = frozen_bytes(self.shape, self.spec, pf)
        params = (p * t + base) / n + self.persistent_bytes(with_nf4=True) if self.stage == 3 else p * t + base
        grads = p * t if self.stage <= 1 else p * t / n
        if self.stage >= 1:
            grads += fp32_grad * self._fp32_grad_elements(t / n)
        optimizer = self.optimizer_state_bytes() * t / n if self.stage >= 1 else self.optimizer_state_bytes() * t
        if self.strategy.offload_optimizer == "none":
            return ModelStates(params, grads, optimizer)
        return self.offloaded_states(optimizer, params)

    def _fp32_grad_elements(self, partition: float) -> float:
        """Stage 3 converts one optimizer sub-group at a time to fp32 (``sub_group_size``, one decoder layer by
        ZeROStrategy's rule; DeepSpeed's own default is 1e9); stages 1-2 the whole partition."""
        if self.stage != 3:
            return partition
        group = self.shape.layer_params() if self.spec.sub_group_size is None else self.spec.sub_group_size
        return min(partition, group)

    def persistent_bytes(self, with_nf4: bool = False) -> float:
        """Stage 3's tensors kept whole on every rank (with the NF4 ones' small statistics when ``with_nf4``)."""
        if self.stage != 3:
            return 0.0
        extra = quantized_base(self.shape, self.spec).persistent_bytes if with_nf4 else 0
        return self.counts.persistent * self.dtype_bytes()[0] + extra

    def reference_shards(self) -> int:
        return self.shards if self.stage == 3 else 1

    def reference_bytes(self) -> float:
        """Stage 3 partitions the copy as the policy, its persistent tensors whole on every rank."""
        if self.stage != 3 or self.reference_offloaded():
            return super().reference_bytes()
        persistent = self.reference_dtype_bytes() * self.counts.persistent if self.reference_whole_bytes() else 0.0
        return (self.reference_whole_bytes() - persistent) / self.shards + persistent

    def reference_gather(self, hw: Hardware) -> tuple[float, float]:
        """Stage 3 fetches the copy's modules in its forward as the policy's (the embedding's first gather shows)."""
        if self.stage != 3:
            return 0.0, 0.0
        persistent = min(self.reference_dtype_bytes(), self.gathered_bytes()) * self.counts.persistent
        gather = self.group(self.spec.world_size, hw).all_gather(
            self.reference_gathered_bytes() - persistent, self.fetched_modules()
        )
        return gather, gather * self.shape.embedding_params() / max(self.counts.total_with_adapters, 1)

    def buffers(self) -> float:
        p = self.dtype_bytes()[0]
        bucket = p * self.bucket_elements()
        if self.stage < 3:
            return float(bucket * (2 if self.stage == 2 else 1))
        gathered = 2 * unit_bytes(self.shape, self.spec, p)
        if self.spec.accelerator == "cpu":
            gathered *= 2  # gloo receives an all-gather into a temporary of the whole gathered size
        return gathered + p * self.counts.largest_trainable_unit + bucket

    def resident_buffers(self) -> float:
        p = self.dtype_bytes()[0]
        return float(p * self.bucket_elements() * (2 if self.stage == 2 else 1))

    def held_after_step(self) -> float:
        """Stages 1-2 free their 16-bit gradients and the fp32 gradient partition after the step."""
        states = self.states()
        return states.params + states.optimizer_state if self.stage < 3 else states.total

    def load_peak(self) -> PhasePeak:
        if self.spec.quantization != "none":
            return self.qlora_load_peak()
        t, f, n = self.counts.trainable, self.counts.frozen, self.shards
        p, pf, _, _ = self.dtype_bytes()
        states = self.states()
        if self.stage < 3:
            # The whole 16-bit model, its flat copy, and the master partition cloned from a 16-bit partition copy.
            return place(self.spec, p * t + pf * f + p * t + p * t / n + 4 * t / n, states.host)
        on_device = states.params + p * t / n + 4 * t / n + 2 * p * self.counts.largest_unit
        return place(self.spec, on_device, states.host)

    def qlora_load_peak(self) -> PhasePeak:
        t, n = self.counts.trainable, self.shards
        p = self.dtype_bytes()[0]
        base = frozen_bytes(self.shape, self.spec, p)
        if self.stage == 3:
            read = max(quant_read_bytes(self.shape, self.spec, n), 2 * unit_bytes(self.shape, self.spec, p))
            return place(self.spec, self.states().params + p * t / n + 4 * t / n + read)
        read, extra = quant_read_bytes(self.shape, self.spec, 1), p * t + p * t + p * t / n + 4 * t / n
        if self.spec.accelerator == "cpu":
            return place(self.spec, base + max(read, extra))
        return place(self.spec, base + extra, base + read)

    def host_load_bytes(self) -> float:
        spec = self.spec
        load_dtype = 2 if self.half else 4
        copies = spec.gpus_per_node if self.stage < 3 else 1
        if spec.quantization != "none":
            if self.stage == 3:
                return float(spec.checkpoint_file_bytes)
            return copies * (frozen_bytes(self.shape, spec, load_dtype) + quant_read_bytes(self.shape, spec, 1))
        return copies * load_dtype * self.counts.total_with_adapters

    def swap_buffers(self) -> float:
        if self.strategy.offload_optimizer != "nvme":
            return 0.0
        return self.spec.gpus_per_node * NVME_SWAP_ELEMENTS * (4 + (2 if self.half else 4))

    # ------------------------------------------------------------------------------------------------ time
    def reduced_bytes(self) -> int:
        return 2 if self.half else 4  # DeepSpeed reduces in its 16-bit model dtype

    def step_traffic_bytes(self) -> int:
        return super().step_traffic_bytes() + DEEPSPEED_STEP_EXTRA

    def traffic(self, hw: Hardware) -> Traffic:
        world = self.group(self.spec.world_size, hw)
        buckets = math.ceil(self.counts.total_with_adapters / self.bucket_elements()) if self.stage >= 2 else 1
        scatter = world.reduce_scatter(self.gradient_bytes(), buckets)
        last = 1 / buckets
        if self.stage < 3:
            updated = world.all_gather(self.gathered_bytes() * self.counts.trainable)
            if self.stage == 1:
                return Traffic(after_step=scatter + updated)
            return Traffic(backward=scatter, backward_exposed=scatter * last, after_step=updated)
        fetched = self.fetched_modules()
        gather = world.all_gather(self.parameter_bytes(exclude_persistent=True), fetched)
        first = self.shape.embedding_params() / max(self.counts.total_with_adapters, 1)
        return Traffic(gather, gather * first, gather + scatter, scatter * last)

    def fetched_modules(self) -> int:
        """Modules stage 3 gathers once per pass: each decoder layer whole under gym's leaf rule
        (``knobs.zero3_leaf_layers``), else each of its submodules with parameters (its linears and norms); and the
        embedding and, untied, the LM head (the final norm persists)."""
        per_layer = 1
        if not self.spec.zero3_leaf_layers:
            norms = 4 if self.shape.qk_norm else 2
            per_layer = len(self.shape.linear_shapes()) + norms + (2 if self.shape.is_moe else 0)
        return self.shape.num_layers * per_layer + (1 if self.shape.tied_embeddings else 2)

    def hook_seconds(self, hw: Hardware) -> float:
        """One micro-batch's fetches on the host: each fetched module once in forward, once in backward, once more
        when activation checkpointing recomputes it, and once in each forward without gradient (the reference's,
        a copy's modules as many as the policy's; KTO's KL rows': ``RunSpec.no_grad_passes``)."""
        passes = (3 if self.spec.activation_checkpointing else 2) + self.spec.no_grad_passes
        return passes * self.pass_hook_seconds(hw)

    def pass_hook_seconds(self, hw: Hardware) -> float:
        """Stage 3 fetches each of its modules once per pass."""
        return self.fetched_modules() * hw.host.zero3_fetch if self.stage == 3 else 0.0

    def offload_seconds(self, hw: Hardware) -> float:
        if not self.strategy.offloads:
            return 0.0
        return self.sharded_offload_seconds(hw, self.reduced_bytes(), self.gathered_bytes())


__all__ = ["DEEPSPEED_STEP_EXTRA", "ZeRO"]
