"""FSDP2 (gym_fsdp): parameters, gradients and optimizer state sharded over the ranks (``full``), kept gathered from
forward to backward (``grad_op``), sharded within a node and replicated across (``hybrid``); ``cpu_offload`` keeps
the fp32 shards, gradients and optimizer state on the host.

Memory: torch AMP's layout sharded, ``16Ψ/N`` with AdamW. The gathered units are data (:func:`fsdp_units`): one per
decoder layer, and the modules left over, either as one root unit (the embedding, the final norm and, untied, the LM
head, gathered together: :data:`LAYOUT` ``"root"``) or as two units of their own (the embedding; the norm and the
head: ``"split"``, torchtitan's layout). A unit marked ``kept`` stays gathered from forward to backward (FSDP2 does
not reshard the root, nor torchtitan's last unit). On GPUs NCCL gathers in place: the kept units beside the unit in
use and the one prefetched; gloo (CPU ranks) receives into a temporary of the gathered size, so the largest unit
exists twice beside the previous forward's last output. One unit's fp32 gradient is unsharded before its
reduce-scatter. Loading builds on the meta device: each rank reads its rows of one tensor at a time.

Time: every micro-batch gathers each unit in forward and (``full``) again in backward and reduce-scatters its
gradients (no ``no_sync`` under accumulation); the first gather and the last reduce-scatter have nothing to hide
behind. Hybrid sharding all-reduces its gradient shard across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.comm import Group
from gym_lightning.planner.families.base import (
    CostModel,
    ModelStates,
    PhasePeak,
    Traffic,
    place,
    quant_read_bytes,
    tensor_rows_bytes,
)
from gym_lightning.planner.hardware import Hardware
from gym_lightning.planner.params import frozen_bytes, layer_bytes, param_counts, tensor_groups, unit_bytes
from gym_lightning.planner.spec import RunSpec

Layout = Literal["root", "split"]
# gym_fsdp's units besides the decoder layers: "split" (strategies.fsdp: an untied embedding, and the norm with the
# head, as units of their own, torchtitan's layout; a tied pair stays in the root unit) or "root" (embedding + norm
# + head gathered together, the strategy before issue 55; kept for comparison).
LAYOUT: Layout = "split"


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: ``elements`` gathered at once (``trainable`` of them get gradients), in ``gathered`` bytes
    (the compute dtype, NF4 weights at their 4-bit size); ``kept``: gathered from forward to backward."""

    name: str
    elements: int
    trainable: int
    gathered: float
    kept: bool = False


def fsdp_units(shape: ModelShape, spec: RunSpec, per_element: int, layout: Layout = LAYOUT) -> list[Unit]:
    """gym_fsdp's units in forward order for ``layout`` (:data:`LAYOUT`): the decoder layers, and the embedding,
    final norm and LM head as one root unit or as two units. ``per_element``: bytes of a gathered element."""
    counts, h, embedding = param_counts(shape, spec), shape.hidden_size, shape.embedding_params()
    full = spec.lora_r == 0
    layer = Unit("layer", counts.layer, _layer_trainable(shape, spec), layer_bytes(shape, spec, per_element))
    head = 0 if shape.tied_embeddings else embedding
    layers = [layer] * shape.num_layers
    if layout == "root":
        root = embedding + head  # the final norm is negligible
        return [Unit("root", root, root if full else 0, per_element * root, kept=True), *layers]
    if shape.tied_embeddings:  # one weight for both: it stays in the root unit, gathered from forward to backward
        return [Unit("root", embedding, embedding if full else 0, per_element * embedding, kept=True), *layers]
    tail = head + h
    return [
        Unit("embedding", embedding, embedding if full else 0, per_element * embedding),
        *layers,
        Unit("norm+head", tail, tail if full else 0, per_element * tail, kept=True),
    ]


def _layer_trainable(shape: ModelShape, spec: RunSpec) -> int:
    """Trainable elements of one decoder layer (its adapters under LoRA)."""
    groups = [g for g in tensor_groups(shape, spec) if g.name.startswith(("layer.", "lora.")) and g.trainable]
    return sum(g.numel * g.count for g in groups) // shape.num_layers


class FSDP(CostModel):
    """Cost model of gym_fsdp (see the module docstring)."""

    def dtype_bytes(self) -> tuple[int, int, int, int]:
        return 4, 2 if self.half else 4, 0, 0

    def units(self) -> list[Unit]:
        return fsdp_units(self.shape, self.spec, self.gathered_bytes())

    def states(self) -> ModelStates:
        t, n = self.counts.trainable, self.shards
        p, pf, _, _ = self.dtype_bytes()
        params = (p * t + frozen_bytes(self.shape, self.spec, pf)) / n
        states = ModelStates(params, p * t / n, self.optimizer_state_bytes() * t / n)
        if self.strategy.offload_optimizer == "none":
            return states
        return self.offloaded_states(states.optimizer_state, params)

    def reference_shards(self) -> int:
        return self.shards

    def reference_gather(self, hw: Hardware) -> tuple[float, float]:
        """The copy, sharded as the policy, gathered unit by unit in its forward (the first unit shows)."""
        spec, units = self.spec, self.units()
        shard = self.group(spec.gpus_per_node if self.strategy.hybrid else spec.world_size, hw)
        gather = shard.all_gather(self.reference_gathered_bytes(), len(units))
        return gather, gather * units[0].gathered / sum(u.gathered for u in units)

    def buffers(self) -> float:
        units = self.units()
        gradient = 4 * max(u.trainable for u in units)
        if self.strategy.keep_gathered:
            compute = self.gathered_bytes()
            whole = compute * self.counts.trainable + frozen_bytes(self.shape, self.spec, compute)
            return whole + gradient
        layer = layer_bytes(self.shape, self.spec, self.gathered_bytes())
        if self.spec.accelerator == "cpu":
            # gloo receives into a temporary of the gathered size: the largest unit's output and gloo's copy, beside
            # an untied head kept gathered through backward (while the embedding is gathered again for its own) and
            # the previous forward's last all-gather output, which FSDP2 frees only at the next unit's copy-out.
            head = sum(u.gathered for u in units if u.kept and u.name == "norm+head")
            other = max(u.gathered for u in units if u.name != "norm+head")
            return head + 2 * other + layer + gradient
        kept = sum(u.gathered for u in units if u.kept)
        vocabulary = max((u.gathered for u in units if not u.kept and u.name != "layer"), default=0.0)
        # NCCL gathers in place: the kept units beside the layer in use and the one prefetched, or beside the
        # embedding gathered again for its backward, and at least the two largest modules (the rule before kept
        # units were counted).
        two_largest = 2 * unit_bytes(self.shape, self.spec, self.gathered_bytes())
        return max(kept + 2 * layer, kept + vocabulary, two_largest) + gradient

    def load_peak(self) -> PhasePeak:
        if self.spec.quantization != "none":
            return self.qlora_load_peak()
        t, f, n = self.counts.trainable, self.counts.frozen, self.spec.world_size
        shard = (4 * t + self.dtype_bytes()[1] * f) / n  # meta build -> fully_shard -> to_empty -> fp32 shards
        read = tensor_rows_bytes(self.shape, self.spec, n)
        if self.strategy.offload_parameters != "none":  # cpu_offload: the shards live on the host
            return place(self.spec, 0.0, shard + read)
        return place(self.spec, shard, read)

    def qlora_load_peak(self) -> PhasePeak:
        """Each rank holds its 4-bit shard and the fp32 adapters while it reads and quantises one tensor's rows."""
        n, t = self.spec.world_size, self.counts.trainable
        base = frozen_bytes(self.shape, self.spec, 2 if self.half else 4)
        return place(self.spec, (4 * t + base) / n + quant_read_bytes(self.shape, self.spec, n))

    def host_load_bytes(self) -> float:
        spec = self.spec
        if spec.quantization != "none":
            return float(spec.checkpoint_file_bytes)
        return spec.gpus_per_node * tensor_rows_bytes(self.shape, spec, spec.world_size)

    def traffic(self, hw: Hardware) -> Traffic:
        spec, units = self.spec, self.units()
        shard = self.group(spec.gpus_per_node if self.strategy.hybrid else spec.world_size, hw)
        params, grads = self.parameter_bytes(), self.gradient_bytes()
        gather, scatter = shard.all_gather(params, len(units)), shard.reduce_scatter(grads, len(units))
        whole = sum(u.gathered for u in units)
        first, last = units[0].gathered / whole, units[-1].gathered / whole
        backward = scatter + (0.0 if self.strategy.keep_gathered else gather)
        if self.strategy.hybrid and spec.nodes > 1:
            replicas = Group(spec.nodes, spec.nodes, hw.network)  # one rank per node: every hop crosses the fabric
            backward += replicas.all_reduce(grads / spec.gpus_per_node)
        return Traffic(gather, gather * first, backward, scatter * last)

    def offload_seconds(self, hw: Hardware) -> float:
        if not self.strategy.offloads:
            return 0.0
        return self.sharded_offload_seconds(hw, 4, 4)  # CPUOffloadPolicy: fp32 shards on the host, fp32 gradients


__all__ = ["FSDP", "LAYOUT", "Unit", "fsdp_units"]
