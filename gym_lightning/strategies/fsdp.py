"""Fully sharded data parallel (PyTorch FSDP2, ``fully_shard``) that runs on CPU (gloo) and CUDA (nccl).

Lightning's ``FSDPStrategy`` wraps FSDP1 and refuses CPU; its ``ModelParallelStrategy`` runs FSDP2 anywhere but
leaves sharding to the user's ``configure_model``. This strategy does the sharding itself, the way torchtitan does
for Llama (https://github.com/pytorch/torchtitan, ``parallelize_llama``): one FSDP unit per transformer decoder layer,
an untied input embedding and LM head each a unit of its own, then one unit per top-level child of the
LightningModule, so model code knows nothing of parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel
from typing_extensions import override

from gym_lightning._compat import (
    _StrategyRegistry,
    checkpoint_activations,
    initialize_fsdp_now,
    rank_zero_info,
    set_model_parallel_sizes,
)
from gym_lightning.checkpointing.io import PartialFileCheckpointIO
from gym_lightning.errors import EveryRankError, GymUserError
from gym_lightning.lazy import LazyTensor, eager
from gym_lightning.models.decoder_layers import decoder_layer_names
from gym_lightning.models.moe import moe_blocks
from gym_lightning.models.plan import META, BuildPlan
from gym_lightning.precision import ClipsWithAnyOptimizer, fp32_master_weights, shard_aware_scaler
from gym_lightning.strategies._common import raise_strategy_problems
from gym_lightning.strategies.base import GymStrategy
from gym_lightning.strategies.frozen import Build, build_frozen, cast_parameters, copy_values, freeze
from gym_lightning.strategies.materialize import has_meta_tensors, materialize
from gym_lightning.strategies.parallel_dims import ParallelDims, size_problems
from gym_lightning.strategies.placement import placed_after
from gym_lightning.vocabulary import register_presets

Sharding = Literal["full", "grad_op", "hybrid", "none"]
SHARDINGS: tuple[str, ...] = ("full", "grad_op", "hybrid", "none")
FSDP_GRADIENT_COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16")
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def find_layer_classes(model: nn.Module, override_names: Iterable[str] | None = None) -> set[str]:
    """Class names of the transformer blocks to shard one by one.

    ``override_names`` wins; otherwise the union of ``_no_split_modules`` of every Hugging Face model inside
    ``model`` (the classes HF itself never splits across devices, i.e. its decoder layers).
    """
    return set(override_names) if override_names else decoder_layer_names(model)


def shard_replicas(sharding: str, num_nodes: int, num_processes: int) -> int | None:
    """The replicate degree of ``sharding`` (``ParallelDims.replicate``): ``None`` (a 1-D mesh over all ranks) for
    full/grad_op; HSDP replicates across nodes and shards within a node; "none" replicates everywhere (shard groups
    of 1 = DDP)."""
    if sharding in ("full", "grad_op"):
        return None
    return num_nodes if sharding == "hybrid" else num_nodes * num_processes


def build_shard_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh ``fully_shard`` shards over: 1-D (shard), or 2-D (replicate, shard) for hybrid/none."""
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)


def mixed_precision_policy(precision: str, gradient_compression: str) -> MixedPrecisionPolicy:
    """FSDP2 policy from the Trainer's precision: bf16 compute with fp32 gradient reduction under ``bf16-mixed``.

    ``gradient_compression`` fp16/bf16 lowers the dtype of the gradient reduce-scatter only (FSDP's equivalent
    of DDP's compression hooks).
    """
    param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    reduce_dtype = _HALF.get(gradient_compression, torch.float32 if param_dtype is not None else None)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


# Host shards (cpu_offload) are all-gathered by full_tensor() and reduced by gradient clipping over the process group
# of their device: with NCCL alone that fails ("No backend type associated with device type cpu", pytorch 148532),
# so the group gets gloo for CPU tensors beside NCCL for CUDA ones, as torchtune's recipes do under CPU offload.
OFFLOAD_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend(requested: str | None, device_type: str, cpu_offload: bool) -> str:
    """The backend of the default process group: ``requested`` if given, else gloo on CPU, nccl on CUDA, and
    :data:`OFFLOAD_BACKEND` on CUDA with ``cpu_offload`` (host shards need a CPU backend)."""
    offloading = cpu_offload and device_type == "cuda"
    if requested is not None:
        if offloading and "cpu:" not in requested and requested != "gloo":
            raise GymUserError(
                f"GymFSDPStrategy(cpu_offload=True, process_group_backend={requested!r}): the offloaded shards live "
                f"in host memory and {requested!r} has no backend for CPU tensors. Use {OFFLOAD_BACKEND!r}, or leave "
                "process_group_backend unset."
            )
        return requested
    if offloading:
        return OFFLOAD_BACKEND
    return torch.distributed.Backend.default_device_backend_map.get(device_type, "gloo")


def shard_storage_device(root_device: torch.device, cpu_offload: bool) -> torch.device:
    """Where a meta-built model's shards get their storage: the host under CUDA ``cpu_offload`` (FSDP2 keeps them
    there; building them on the GPU first would put a whole fp32 shard on it during the load), else the device."""
    return torch.device("cpu") if cpu_offload and root_device.type == "cuda" else root_device


def unsharded_parameter_names(model: nn.Module) -> list[str]:
    """Parameters that FSDP does not manage: they would train with no gradient synchronisation at all."""
    return [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]


class GymFSDPStrategy(ClipsWithAnyOptimizer, GymStrategy, ModelParallelStrategy):
    """FSDP2 over all ranks, one shard unit per decoder layer, for any LightningModule on CPU or CUDA.

    Shard units: every module whose class name is in ``layer_classes`` (default: the decoder-layer classes that the
    Hugging Face model lists in ``_no_split_modules``); an untied input embedding and LM head, each alone
    (:func:`vocabulary_units`); then every top-level child of the LightningModule that holds parameters (for a
    Hugging Face model: the rest, the final norm, or a tied embedding and head). Parameters set directly on the
    LightningModule cannot be sharded and are refused. Modules the user already sharded in ``configure_model``
    are left as they are.

    Args:
        sharding: ``"full"`` (shard parameters, gradients and optimizer state; re-gather parameters for backward —
            ZeRO-3-like), ``"grad_op"`` (keep gathered parameters from forward to backward: more memory, less
            traffic — ZeRO-2-like), ``"hybrid"`` (shard within a node, replicate across nodes), ``"none"``
            (replicate everywhere, like DDP).
        layer_classes: Class names of the blocks to shard individually (e.g. ``["LlamaDecoderLayer"]``); default
            from ``_no_split_modules``. It is an error if a name given here matches no module.
        activation_checkpointing: Recompute each decoder layer's activations in backward instead of storing them.
        cpu_offload: Keep sharded parameters, gradients and optimizer state in host memory and run the optimizer
            there (CUDA only; on CPU ranks everything already lives in host memory and this is a no-op).
        gradient_compression: ``"none"``, or ``"fp16"`` / ``"bf16"`` to reduce-scatter gradients in half precision.
            PowerSGD is a DDP communication hook and does not exist for FSDP.
        save_distributed_checkpoint: ``True``: each rank writes its shard (a checkpoint folder, torch distributed
            checkpoint format; it reshards on load, so it may be resumed on another number of ranks). ``False``: rank 0
            gathers a single full file.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: nccl on CUDA, gloo on CPU, and
            ``"cpu:gloo,cuda:nccl"`` on CUDA with ``cpu_offload``, whose host shards need a CPU backend).
        timeout: Timeout of collective operations (also on the shard mesh's groups), as for
            :class:`~gym_lightning.strategies.base.GymStrategy`.
        sequence_parallel_size: Ranks that share each training sequence, as for
            :class:`~gym_lightning.strategies.base.GymStrategy`; parameters stay sharded over all ranks. 1: off.

    The Trainer precision picks the FSDP mixed-precision policy: ``"bf16-mixed"`` computes in bf16 and reduces
    gradients in fp32 (sharded master weights stay fp32); ``"32-true"`` and ``"bf16-true"`` keep one dtype;
    ``"16-mixed"`` autocasts to fp16 and scales the loss with ``precision.GymShardedGradScaler``, on the host under
    ``cpu_offload``.
    Gradient clipping (``gradient_clip_val``) clips by the global norm of the sharded gradients, with fused
    optimizers too (``precision.GymMixedPrecision``).
    """

    strategy_name = "gym_fsdp"

    def __init__(
        self,
        sharding: Sharding = "full",
        layer_classes: list[str] | None = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        gradient_compression: Literal["none", "fp16", "bf16"] = "none",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        sequence_parallel_size: int = 1,
    ) -> None:
        problems = _fsdp_problems(sharding, layer_classes, gradient_compression) + size_problems(sequence_parallel_size)
        raise_strategy_problems(type(self).__name__, problems)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            sequence_parallel_size=sequence_parallel_size,
        )
        # save_distributed_checkpoint=False writes one file through the CheckpointIO: in place, not via TMPDIR.
        self.checkpoint_io = PartialFileCheckpointIO()
        self.sharding = sharding
        self.layer_classes = list(layer_classes) if layer_classes else None
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.gradient_compression = gradient_compression
        self._shard_mesh: DeviceMesh | None = None
        self._build_plan = BuildPlan(device=META)
        self._kept_gathered: list[FSDPModule] = []  # units FSDP does not reshard after backward (LM heads)

    @property
    @override
    def parallel_dims(self) -> ParallelDims:
        nodes, processes = self.num_nodes, self.num_processes
        replicate = shard_replicas(self.sharding, nodes, processes)
        return ParallelDims(nodes * processes, sequence=self.sequence_parallel_size, replicate=replicate)

    @override
    def _start_process_group(self) -> None:
        dims = self.parallel_dims
        # Lightning's mesh (data_parallel x tensor_parallel) spans every rank: the module's configure_model may use
        # it; the sampler reads the data-parallel degree from ParallelDims.
        set_model_parallel_sizes(self, data_parallel=dims.world_size // dims.tensor, tensor_parallel=dims.tensor)
        super()._start_process_group()
        self._shard_mesh = build_shard_mesh(dims, self.root_device.type)

    @override
    def _watched_groups(self) -> Iterable[Any]:
        return self._shard_mesh.get_all_groups() if self._shard_mesh is not None else ()

    @override
    def _get_process_group_backend(self) -> str:
        return process_group_backend(self.process_group_backend, self.root_device.type, self.cpu_offload)

    def build_plan(self) -> BuildPlan:
        """How ``configure_model`` builds models (``protocols.ProvidesBuildPlan``): on the meta device, with no
        storage; ``setup()`` shards them, then each rank materialises and loads only its own shards
        (``strategies.materialize``)."""
        return self._build_plan

    @override
    def setup(self, trainer: Trainer) -> None:
        if self.model is None or self.accelerator is None:
            raise RuntimeError(f"{type(self).__name__}.setup() needs the Trainer to connect a model and accelerator.")
        self.accelerator.setup(trainer)
        self._scale_losses_shard_aware()
        self.setup_sequence_parallel()
        # What no engine manages (metric states, buffers) computes on the device, whatever the shards' storage.
        with placed_after(self.model, self.root_device):
            self.model = self.precision_plugin.convert_module(self.model)
            fp32_master_weights(self.model, self.precision_plugin)
            storage = shard_storage_device(self.root_device, self.cpu_offload)
            if storage == self.root_device and not has_meta_tensors(self.model):
                # Under cpu_offload the model stays where it was built: fully_shard moves one unit at a time to the
                # device and its shards to the host, so a whole model never lands on the GPU. A meta model gets its
                # storage after sharding, below.
                self.model_to_device()
            self.shard_module(self.model)
            materialize(self.model, storage, self._build_plan.take())
            # Before any forward: a LoRA preference objective's first forward is its reference's, adapters off.
            initialize_fsdp_now(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _scale_losses_shard_aware(self) -> None:
        """Under ``16-mixed``, torch's sharded loss scaler (``precision.GymShardedGradScaler``) where Lightning made a
        plain ``GradScaler``: each rank holds only its gradient shards, so with a plain one a rank that found an
        overflow in its shards skipped the step and halved its scale while the others stepped. It lives where the
        optimizer steps: the host under ``cpu_offload``."""
        plugin = self.precision_plugin
        if (scaler := getattr(plugin, "scaler", None)) is not None:
            offloaded = self.cpu_offload or self.root_device.type == "cpu"
            plugin.scaler = shard_aware_scaler(scaler, "cpu" if offloaded else self.root_device.type)

    def shard_module(self, module: nn.Module) -> None:
        """Apply activation checkpointing and ``fully_shard`` to ``module``'s layers and top-level children."""
        if own := [name for name, _ in module.named_parameters(recurse=False)]:
            raise GymUserError(
                f"{type(self).__name__} cannot shard parameters set directly on the LightningModule ({own}); "
                "move them into a submodule (an nn.Module attribute)."
            )
        refuse_integer_parameters(module)
        kwargs = self._fully_shard_kwargs()
        for layer in self._layers(module):
            if self.activation_checkpointing:
                checkpoint_activations(layer)
            if not isinstance(layer, FSDPModule):
                fully_shard(layer, **kwargs)
        units = vocabulary_units(module)
        for unit in units:
            _shard_vocabulary_unit(unit, kwargs)
        self._kept_gathered = [u.module for u in units if not u.first_in_forward and isinstance(u.module, FSDPModule)]
        for child in module.children():
            _shard_unit(child, kwargs)
        if missing := unsharded_parameter_names(module):
            raise RuntimeError(f"FSDP left these parameters unsharded (they would not be synchronised): {missing}")

    def hold_frozen(
        self, build: Build, copy_of: nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> nn.Module:
        """A frozen model (a preference objective's reference, ``protocols.HoldsFrozenModels``) sharded as the policy:
        built on the meta device under a build plan of its own (``setup`` took the policy's), sharded per decoder
        layer (:meth:`shard_frozen`), then each rank materialises and loads only its shards from the source
        (``strategies.materialize``); ``copy_of``'s shards are copied in where it gives the initial values. Under
        ``bf16-mixed`` the parameters are stored in bf16, the dtype FSDP would gather them in for compute anyway;
        ``dtype`` (the objective's ``reference_dtype``) replaces it, for storage and compute. Collective: every rank
        calls it, and calls the returned model as it calls the policy."""
        plan = BuildPlan(device=META)
        model = self.precision_plugin.convert_module(build_frozen(self, build, plan))
        dtype = dtype or self._fully_shard_kwargs()["mp_policy"].param_dtype
        cast_parameters(model, dtype)
        storage = shard_storage_device(self.root_device, self.cpu_offload)
        if storage == self.root_device and not has_meta_tensors(model):  # a non-safetensors folder: built whole
            model = model.to(storage)
        self.shard_frozen(model, dtype)
        materialize(model, storage, plan.take())
        if copy_of is not None:
            copy_values(model, copy_of, write_shard)
        return freeze(model)

    def shard_frozen(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        """``fully_shard`` a frozen model into the policy's units (each decoder layer, an untied embedding and LM head,
        the rest in the root), every unit resharded after its forward: it has no backward to keep parameters for;
        gathered in ``dtype`` where given, else in the policy's."""
        kwargs = {**self._fully_shard_kwargs(), "reshard_after_forward": True}
        if dtype is not None:
            kwargs["mp_policy"] = replace(kwargs["mp_policy"], param_dtype=dtype)
        for layer in self._layers(model):
            fully_shard(layer, **kwargs)
        for unit in vocabulary_units(model):
            fully_shard(unit.module, **kwargs)
        fully_shard(model, **kwargs)
        # torch < 2.13's fully_shard makes every shard a trainable parameter (FSDP2_INTEGER_PARAMETERS).
        model.requires_grad_(False)

    def _layers(self, module: nn.Module) -> list[nn.Module]:
        names = find_layer_classes(module, self.layer_classes)
        layers = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        if self.layer_classes and not layers:
            found = sorted({type(m).__name__ for m in module.modules()})
            raise GymUserError(f"layer_classes={self.layer_classes} matched no module; module classes present: {found}")
        if not layers:
            rank_zero_info("gym_fsdp: no decoder layers found; each top-level submodule is one shard unit.")
        elif blocks := [b for b in moe_blocks(module) if any(b in set(layer.modules()) for layer in layers)]:
            # A rank gathers a layer's experts with the rest of its layer; expert parallelism is not offered.
            rank_zero_info(
                f"gym_fsdp: mixture of experts: {len(layers)} shard units ({', '.join(sorted(names))}), each with its "
                f"{type(blocks[0]).__name__} and all of its experts inside; every rank gathers a layer's experts whole."
            )
        return layers

    def _fully_shard_kwargs(self) -> dict[str, Any]:
        offload: OffloadPolicy = OffloadPolicy()
        if self.cpu_offload and self.root_device.type == "cuda":
            offload = CPUOffloadPolicy(pin_memory=True)
        elif self.cpu_offload:
            rank_zero_info("gym_fsdp: cpu_offload is a no-op on CPU ranks (parameters already live in host memory).")
        return {
            "mesh": self._shard_mesh,
            # None: reshard every unit after forward except the root, whose parameters backward needs first anyway
            # (torch's fully_shard docs); True on the root too cost one extra all-gather per step. grad_op: never.
            "reshard_after_forward": None if self.sharding != "grad_op" else False,
            "mp_policy": mixed_precision_policy(str(self.precision_plugin.precision), self.gradient_compression),
            "offload_policy": offload,
        }

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        for unit in self._kept_gathered:  # their gradients are reduced; the optimizer steps the shards next
            unit.reshard()

    def local_gradients(self, module: nn.Module) -> list[torch.Tensor] | None:
        """This rank's gradient shards of ``module`` as plain tensors (for ``NonFiniteGuard``); no collective."""
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        return [g.to_local() if isinstance(g, DTensor) else g for g in grads]

    def full_tensors(self, model: nn.Module) -> dict[str, LazyTensor]:
        """``model``'s state dict as lazy full CPU tensors (``gym_lightning.lazy``), for the exporter: each sharded
        parameter is all-gathered on its own when loaded (a collective: every rank loads in the same order)."""
        return {key: _full_tensor(value) for key, value in model.state_dict(keep_vars=True).items()}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry.register, cls, "fsdp")  # gym_lightning.vocabulary: gym_fsdp


# The first torch whose FSDP2 keeps a parameter's requires_grad when it makes the shard (pytorch PR 177948): before,
# fully_shard made every shard ``nn.Parameter(dtensor)`` (requires_grad=True), which integer tensors refuse.
FSDP2_INTEGER_PARAMETERS = (2, 13)


def fsdp2_holds_integer_parameters(version: str | None = None) -> bool:
    """Whether this torch's (or ``version``'s) ``fully_shard`` can shard integer parameters (a 4-bit base's codes)."""
    release = (version or torch.__version__).split("+")[0].split(".")
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in release[:2]) >= FSDP2_INTEGER_PARAMETERS


def refuse_integer_parameters(module: nn.Module, version: str | None = None) -> None:
    """One line, on every rank alike, where this torch's FSDP2 cannot shard ``module``'s integer parameters."""
    if fsdp2_holds_integer_parameters(version):
        return
    integer = [name for name, param in module.named_parameters() if not param.is_floating_point()]
    if integer:
        raise EveryRankError(
            f"gym_fsdp cannot shard the integer parameters of a 4-bit base ({integer[0]}, {len(integer)} in all) with "
            f"torch {version or torch.__version__}: its FSDP2 makes every shard a trainable parameter, which integer "
            "tensors cannot be (fixed in torch 2.13, pytorch PR 177948). Install torch>=2.13, or train QLoRA under "
            "trainer.strategy zero3 or gym_ddp, which hold it on this torch."
        )


def _fsdp_problems(sharding: str, layer_classes: Any, gradient_compression: str) -> list[str]:
    problems = []
    if sharding not in SHARDINGS:
        problems.append(f"sharding={sharding!r} is not one of {SHARDINGS}.")
    if layer_classes is not None and (
        not isinstance(layer_classes, (list, tuple)) or not all(isinstance(n, str) for n in layer_classes)
    ):
        problems.append(f"layer_classes must be a list of class names (str), got {layer_classes!r}.")
    if gradient_compression == "powersgd":
        problems.append(
            "gradient_compression='powersgd' is a DDP communication hook and does not exist for FSDP; use "
            "'fp16'/'bf16' (half-precision reduce-scatter) or strategy gym_ddp."
        )
    elif gradient_compression not in FSDP_GRADIENT_COMPRESSIONS:
        problems.append(f"gradient_compression={gradient_compression!r} is not one of {FSDP_GRADIENT_COMPRESSIONS}.")
    return problems


@dataclass(frozen=True)
class VocabularyUnit:
    """A vocabulary-sized module sharded as an FSDP unit of its own, and how long it stays gathered.

    Args:
        module: The input embedding or the (untied) LM head.
        first_in_forward: ``True`` for the embedding (gathered for its forward, freed, gathered again for its
            backward, the last); ``False`` for the LM head, used last in forward and first in backward, which stays
            gathered from its forward until the backward has finished (:meth:`GymFSDPStrategy.post_backward`).
    """

    module: nn.Module
    first_in_forward: bool


def vocabulary_units(module: nn.Module) -> list[VocabularyUnit]:
    """The input embedding and the untied LM head of every Hugging Face causal LM in ``module``, each to be sharded
    as a unit of its own, as torchtitan shards an untied Llama (``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``).

    Left in the model's root unit, which is gathered from the start of forward to the end of backward, the two were
    held together through every layer's forward and backward: two ``[vocab, hidden]`` matrices (2.4 GB of bf16 at
    Qwen3's 151,936 x 4,096) beside the layer in use, all-gathered at once. A tied pair is one weight, which FSDP
    needs in one unit, used first and last in forward: it stays in the root. The final norm stays in the root too
    (torchtitan groups it with the head): a unit of several modules of which a chunked loss calls only the head
    crashed FSDP2's backward (segmentation fault, torch 2.11 and 2.13, 2 CPU ranks).
    """
    units: list[VocabularyUnit] = []
    for model in _causal_lms(module):
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embedding is None or head is None or getattr(head, "weight", None) is getattr(embedding, "weight", False):
            continue
        units += [VocabularyUnit(embedding, True), VocabularyUnit(head, False)]
    return units


def _causal_lms(module: nn.Module) -> list[nn.Module]:
    """The outermost modules of ``module`` with both input and output embeddings (transformers' ``*ForCausalLM``,
    found inside a peft wrapper too)."""
    found: list[nn.Module] = []
    inside: set[nn.Module] = set()
    for candidate in module.modules():
        if candidate in inside or not isinstance(candidate, PreTrainedModel):
            continue
        if candidate.get_output_embeddings() is not None:
            found.append(candidate)
            inside.update(candidate.modules())
    return found


def _shard_vocabulary_unit(unit: VocabularyUnit, kwargs: dict[str, Any]) -> None:
    """``fully_shard`` a :class:`VocabularyUnit` (unless it is sharded already: a user's own ``configure_model``
    sharding is left as it is); the strategy reshards the LM head's unit after each backward.

    The head is not resharded by FSDP after its backward: a chunked loss (``loss.chunked_summed_cross_entropy``)
    calls it once per chunk, and FSDP2 then resharded it after each chunk's backward and all-gathered it again for
    the next (17 all-gathers a step instead of 8 at 13 chunks, measured on 2 CPU ranks); kept, it is gathered once
    per forward and its gradient reduce-scattered once. ``grad_op`` never reshards after forward.
    """
    if isinstance(unit.module, FSDPModule):
        return
    reshard = unit.first_in_forward and kwargs["reshard_after_forward"] is not False
    sharded = fully_shard(unit.module, **{**kwargs, "reshard_after_forward": reshard})
    if not unit.first_in_forward:
        sharded.set_reshard_after_backward(False)


def write_shard(target: torch.Tensor, source: torch.Tensor) -> None:
    """``source``'s values into what this rank holds of ``target``: its local shard when ``target`` is a ``DTensor``
    (copied shard to shard where both are sharded alike, no communication; else cut from the full tensor, which a
    sharded ``source`` all-gathers)."""
    if not isinstance(target, DTensor):
        target.data.copy_(source.full_tensor() if isinstance(source, DTensor) else source.detach())
        return
    alike = isinstance(source, DTensor) and (source.device_mesh, source.placements) == (
        target.device_mesh,
        target.placements,
    )
    if alike:
        target.to_local().copy_(source.to_local())
        return
    full = source.full_tensor() if isinstance(source, DTensor) else source.detach()
    shard = distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
    target.to_local().copy_(shard.to_local())


def _full_tensor(value: torch.Tensor) -> LazyTensor:
    if not isinstance(value, DTensor):
        return eager(value)
    return LazyTensor(tuple(value.shape), value.dtype, lambda: value.detach().full_tensor().cpu())


def _shard_unit(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """``fully_shard`` a module that has parameters; containers without a ``forward`` (``ModuleList``,
    ``ModuleDict``), which ``fully_shard`` refuses, are descended into instead."""
    if isinstance(module, FSDPModule) or not any(True for _ in module.parameters()):
        return
    if isinstance(module, nn.ModuleList | nn.ModuleDict):
        for child in module.children():
            _shard_unit(child, kwargs)
        return
    fully_shard(module, **kwargs)
