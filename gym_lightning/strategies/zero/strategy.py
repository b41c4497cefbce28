"""DeepSpeed ZeRO stages 0-3 (+ CPU/NVMe offload) on CUDA and on CPU ranks, with Lightning owning accumulation.

Differences from Lightning's ``DeepSpeedStrategy`` and why:

- CPU ranks: Lightning refuses non-CUDA accelerators and passes ``root_device.index`` (``None`` on CPU) as
  DeepSpeed's device rank; DeepSpeed then fails in ``engine._set_distributed_vars``. We pass the local rank.
- Gradient accumulation: with Lightning's strategy the loss is divided by the accumulation count twice (Lightning
  divides, then ``engine.backward`` divides again because ``scale_wrt_gas=True``), and DeepSpeed counts
  micro-steps itself, so its windows drift from Lightning's whenever an epoch is not a multiple of the window.
  Here Lightning owns the boundary (``managed_gradient_accumulation: false``: ``engine.step()`` is called exactly
  when Lightning steps) and ``engine.backward(..., scale_wrt_gas=False)``: the module's loss is the only normalisation.
- Offload with the module's own torch optimizer is allowed (``zero_force_ds_cpu_optimizer: false``) so that fp32
  results match a single-process run with the same torch optimizer. ``cpu_optimizer="deepspeed"`` switches Adam/AdamW
  to DeepSpeed's fused ``DeepSpeedCPUAdam`` (same update rule, faster, different rounding order).
- ZeRO-3: the model is built inside ``deepspeed.zero.Init`` with the Hugging Face DeepSpeed integration active,
  so no rank ever holds the full model and HF still initialises (or loads) the weights correctly. A random
  initialisation drawn that way differs from one process's (HF skips torch's default initialisation under
  ``zero.Init`` and initialises on rank 0 only), so it is replaced by rank 0's ordinary CPU build from the same seed:
  the initial weights depend on the seed only, not on the strategy or the number of ranks.
- ZeRO-3 with torchmetrics: DeepSpeed's hooks are removed from parameter-free metric modules, whose overloaded
  ``!=`` otherwise invalidates ZeRO-3's prefetch trace on every step (``strategies.zero.trace``).
- ZeRO-3 with mixtures of experts: every MoE block becomes a leaf module (``strategies.zero.leaf``), so ranks whose
  tokens went to different experts still gather the same parameters. The other parts: ``strategies.zero``'s list.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch import nn
from torch.optim import Adam, AdamW, Optimizer
from typing_extensions import override

from gym_lightning._compat import (
    _StrategyRegistry,
    full_numel,
    init_deepspeed_config_if_needed,
    init_deepspeed_distributed,
    load_universal_next,
    rank_zero_info,
    rank_zero_warn,
    training_dataloader,
)
from gym_lightning.checkpointing.safe_load import use_weights_only_engine
from gym_lightning.errors import EveryRankError, GymUserError
from gym_lightning.lazy import LazyTensor, eager
from gym_lightning.loss import AgreedCounts, start_max_counts
from gym_lightning.models.facts import model_facts_of
from gym_lightning.models.plan import BuildPlan, WeightsSource
from gym_lightning.protocols import (
    micro_batch_size_of,
    optimizer_facts_of,
)
from gym_lightning.strategies.base import GymStrategy
from gym_lightning.strategies.frozen import Build, build_frozen, copy_values, freeze, hold_whole
from gym_lightning.strategies.zero.config import (
    OffloadDevice,
    apply_gym_defaults,
    load_deepspeed_json,
    offload_devices,
    zero_config,
    zero_plus_plus_problems,
)
from gym_lightning.strategies.zero.frozen import (
    check_zero3_dtype,
    engine_dtype,
    with_inference_hooks,
    write_partition,
)
from gym_lightning.strategies.zero.leaf import mark_decoder_leaf_modules, mark_moe_leaf_modules
from gym_lightning.strategies.zero.masters import reading_master_weights
from gym_lightning.strategies.zero.ops import load_ops, ops_needed
from gym_lightning.strategies.zero.resolve import (
    alst_sequence_parallel_size,
    checked_stage,
    inference_config,
    remote_device,
    run_config,
    training_facts,
)
from gym_lightning.strategies.zero.sizing import cap_bucket_sizes
from gym_lightning.strategies.zero.stage3 import (
    fill_partitions,
    full_tensor,
)
from gym_lightning.strategies.zero.trace import keep_zero3_trace_valid
from gym_lightning.strategies.zero.universal import (
    UNIVERSAL_TAG,
    checkpoint_world_size,
    convert_to_universal,
    refuse_unsafe_files,
    repair_zero3_universal_load,
)
from gym_lightning.vocabulary import register_presets

_T = TypeVar("_T")


def deepspeed_cpu_adam(optimizer: Optimizer) -> Optimizer:
    """DeepSpeed's fused CPU Adam with the param groups (and hyper-parameters) of a torch Adam/AdamW."""
    if type(optimizer) not in (Adam, AdamW):
        raise GymUserError(
            f"cpu_optimizer='deepspeed' replaces torch Adam/AdamW only, got {type(optimizer).__name__}; "
            "use cpu_optimizer='torch' or configure torch.optim.AdamW."
        )
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    decoupled = isinstance(optimizer, AdamW) or optimizer.defaults.get("decoupled_weight_decay", False)
    return DeepSpeedCPUAdam(optimizer.param_groups, adamw_mode=bool(decoupled))


class ZeROStrategy(GymStrategy, DeepSpeedStrategy):
    """DeepSpeed ZeRO on CUDA or CPU ranks, for any LightningModule, with Lightning owning gradient accumulation.

    Args:
        stage: ZeRO stage: ``0`` none (DeepSpeed's engine as data parallelism, HF's ``"stage": 0`` JSONs), ``1``
            shards optimizer state, ``2`` also gradients, ``3`` also parameters. Default 2,
            or the ``zero_optimization.stage`` of ``config``.
        offload_optimizer: Where optimizer state lives and the optimizer runs: ``"none"`` (on the device),
            ``"cpu"``, ``"nvme"`` (ZeRO-Infinity; needs ``nvme_path`` and Debian's ``libaio-dev``).
        offload_parameters: Where parameters live between uses (stage 3 only): ``"none"``, ``"cpu"``, ``"nvme"``.
        nvme_path: Folder on a fast local disk for NVMe offload (one per node; DeepSpeed only swaps tensors of
            at least 1 MiB per rank, smaller ones stay in memory).
        config: A DeepSpeed JSON config (path or dict), e.g. one written for the Hugging Face Trainer. Its
            ``zero_optimization`` replaces the arguments above (passing a conflicting ``stage`` is an error).
            ``"auto"`` values are filled from the Trainer and from what the module and data module state
            (``optimizer_facts()``, ``model_facts()``, ``micro_batch_size``: ``gym_lightning.protocols``) as the HF
            integration does, and explicit values that disagree with them fail before training, all listed in one
            error (see ``gym_lightning.strategies.zero.hf_auto``). ``gradient_accumulation_steps`` is the Trainer's
            ``accumulate_grad_batches``: ``gym fit``/``gym train`` adopt the JSON's number when the Trainer's is left
            at 1; in Python pass ``Trainer(accumulate_grad_batches=...)`` (a mismatch is an error). An
            ``optimizer``/``scheduler`` block makes DeepSpeed build them; without one the module's
            ``configure_optimizers`` is used. ZeRO++ keys (``zero_quantized_weights``, ``zero_quantized_gradients``,
            ``zero_hpz_partition_size``) pass through on CUDA and are refused, with the reason, on CPU ranks.
        cpu_optimizer: With optimizer offload: ``"torch"`` (default) runs the module's own torch optimizer on the
            offloaded fp32 partitions — results match a single-process run with that optimizer; ``"deepspeed"``
            replaces torch Adam/AdamW by DeepSpeed's fused ``DeepSpeedCPUAdam`` (several times faster on large
            models, same update rule, different rounding; JIT-compiled on first use).
        pin_memory: Pin offloaded host memory (faster host-device copies on CUDA, more locked RAM).
        bucket_size: Elements per all-gather / reduce bucket (memory vs. communication efficiency). ``None``: one
            decoder layer's elements when the module states its layer size, else 2e8 (``sizing.derived_bucket_size``).
        load_full_weights: Resume stage 3 from a single consolidated checkpoint file instead of a sharded folder.
        exclude_frozen_parameters: Leave frozen parameters (e.g. the base model under LoRA) out of checkpoints.
        logging_level: DeepSpeed's log level.
        accelerator: As for ``DeepSpeedStrategy`` (normally chosen by the Trainer).
        parallel_devices: As for ``DeepSpeedStrategy`` (normally chosen by the Trainer).
        cluster_environment: As for ``DeepSpeedStrategy`` (torchrun, SLURM, ... detected by the Trainer).
        precision_plugin: As for ``DeepSpeedStrategy``.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: nccl on CUDA, gloo on CPU).
        timeout: Timeout of collective operations, as for :class:`~gym_lightning.strategies.base.GymStrategy`.
        sequence_parallel_size: Ranks that share each training sequence (Ulysses, as DeepSpeed's ALST), as for
            :class:`~gym_lightning.strategies.base.GymStrategy`; ZeRO still partitions over all ranks. 1: off. A
            ``config`` written for ALST may carry it as ``"sequence_parallel_size"``: it is taken from there.
        leaf_decoder_layers: Stage 3: gather each decoder layer (the Hugging Face models' ``_no_split_modules``
            classes) whole, with no DeepSpeed hooks on its children (``mark_decoder_leaf_modules``); ignored when
            ``config`` has its own ``zero_optimization.leaf_module``. ``False``: DeepSpeed's per-submodule hooks.

    Precision: ``"32-true"``, ``"bf16-mixed"`` / ``"bf16-true"`` (DeepSpeed bf16 with fp32 master weights) and, on
    CUDA only, ``"16-mixed"`` (DeepSpeed fp16 with dynamic loss scaling, which skips overflowing steps).

    Mixtures of experts (stage 3): each MoE block class found in the model (``gym_lightning.models.moe``) is made a
    ZeRO-3 leaf module (its experts are gathered together; one log line names the classes). Blocks the rules miss:
    DeepSpeed's own ``"zero_optimization": {"leaf_module": {"classes": [...]}}`` in ``config`` (also ``names`` and
    ``name_suffixes``), which DeepSpeed applies as the engine starts.
    """

    strategy_name = "zero"
    # ZeRO1/2/3Strategy fix the stage with this instead of copying the signature; ``None``: the ``stage`` argument,
    # else the config's ``zero_optimization.stage``, else 2.
    fixed_stage: ClassVar[int | None] = None

    def __init__(
        self,
        stage: Literal[0, 1, 2, 3] | None = None,
        offload_optimizer: OffloadDevice = "none",
        offload_parameters: OffloadDevice = "none",
        nvme_path: str | None = None,
        config: str | dict[str, Any] | None = None,
        cpu_optimizer: Literal["torch", "deepspeed"] = "torch",
        pin_memory: bool = False,
        bucket_size: int | None = None,
        load_full_weights: bool = False,
        exclude_frozen_parameters: bool = False,
        logging_level: int = logging.WARN,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        sequence_parallel_size: int = 1,
        leaf_decoder_layers: bool = True,
    ) -> None:
        # The config's construction-time part (strategies.zero.resolve); the rest is resolve.run_config, once per run.
        user_config = None if config is None else load_deepspeed_json(config)
        sequence_parallel_size, user_config = alst_sequence_parallel_size(sequence_parallel_size, user_config)
        offload = (offload_optimizer, offload_parameters, nvme_path)
        resolved_stage = checked_stage(
            type(self).__name__, self.fixed_stage, stage, user_config, *offload, cpu_optimizer
        )
        # Only in gym_lightning's own config does an "auto" the module cannot fill fall back to DeepSpeed's default.
        self._generated_config = user_config is None
        if user_config is None:
            user_config = zero_config(resolved_stage, *offload, pin_memory, bucket_size)
        base = apply_gym_defaults(user_config)
        super().__init__(
            accelerator=accelerator,
            logging_level=logging_level,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            timeout=timeout,
            sequence_parallel_size=sequence_parallel_size,
            config=base,
            load_full_weights=load_full_weights,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        self.remote_device = remote_device(base, offload_parameters)
        self.stage = resolved_stage
        self.cpu_optimizer = cpu_optimizer
        self.leaf_decoder_layers = leaf_decoder_layers
        self._layers_gathered_whole = False  # decoder layers made leaf modules for training (_mark_leaf_modules)
        self._hf_deepspeed_config: Any = None
        # ZeRO-3: models are built under zero.Init with their random draw or their folder recorded (models.plan).
        self._build_plan = BuildPlan(record_random_init=resolved_stage == 3, fill_pretrained=resolved_stage == 3)

    def build_plan(self) -> BuildPlan:
        """How ``configure_model`` builds models (``protocols.ProvidesBuildPlan``): under ZeRO-3 a random
        initialisation's draw is recorded, and replaced by one process's before the engine starts."""
        return self._build_plan

    # ----------------------------------------------------------------------------------------------- environment
    @override
    def _environment_problems(self) -> list[str]:
        return zero_plus_plus_problems(self.config, self.root_device.type, self.world_size)

    @override
    def _start_process_group(self) -> None:
        # Before DeepSpeed asks for them (its CPU collectives load one as the process group starts): built once per
        # machine, not once per virtual environment (strategies.zero.ops).
        nvme = "nvme" in offload_devices(self.config)
        load_ops(ops_needed(self.root_device.type, self.cpu_optimizer, nvme=nvme, config=self.config))
        if self.root_device.type == "cuda":
            super()._start_process_group()
            return
        precision = str(self.precision_plugin.precision)
        if precision in ("16-mixed", "16-true"):
            raise GymUserError(
                f"precision={precision!r}: DeepSpeed has no fp16 on CPU ranks; use 'bf16-mixed' or '32-true' there."
            )
        # Lightning's DeepSpeedStrategy stops here on anything but CUDA; DeepSpeed itself runs on CPU (gloo).
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_distributed()
            return
        # Lightning validates CUDA device indices here; CPU devices have none.
        reset_seed()
        self.set_world_ranks()
        init_deepspeed_distributed(self)

    def _deepspeed_args(self) -> argparse.Namespace:
        # DeepSpeed's device rank: the CUDA index, or the local rank on CPU (Lightning passes None there).
        index = self.root_device.index
        return argparse.Namespace(device_rank=index if index is not None else self.local_rank)

    # ------------------------------------------------------------------------------------- accumulation + init
    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # Lightning decides the boundary and calls engine.step() only there (managed_gradient_accumulation=false).
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Caller-managed accumulation already defers the stage-1 reduction to step(); stages 2/3 reduce-scatter
        # every backward by design (DeepSpeed's no_sync() refuses them).
        yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        # Lightning already divided by accumulate_grad_batches; scale_wrt_gas=True would divide a second time.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def _format_batch_size_and_grad_accum_config(self) -> None:
        # Lightning calls this once per strategy, before the model exists under ZeRO-3: the facts are gathered (the
        # Trainer and module are only read; the Trainer's accumulation was settled before it was built,
        # cli.accumulation_from_strategy_config) and every config value follows from them in one call
        # (strategies.zero.resolve.run_config: layer-sized buffers, Hugging Face "auto" values, conflicts).
        if self.lightning_module is None:
            return
        module = self.lightning_module
        optimizer, model = optimizer_facts_of(module), model_facts_of(module)
        facts = training_facts(module.trainer, optimizer, model, self.config, self._micro_batch_size())
        self.config = run_config(self.config, facts, generated=self._generated_config)
        if "optimizer" in self.config and "scheduler" not in self.config:
            rank_zero_warn(
                "The DeepSpeed config has an optimizer block but no scheduler block: DeepSpeed builds the optimizer "
                "and the learning rate stays at optimizer.params.lr. Add a scheduler block (e.g. WarmupDecayLR with "
                '"auto" params) or drop the optimizer block to use the module\'s optimizer and schedule.'
            )

    def _micro_batch_size(self) -> int | None:
        """The per-device training micro-batch: as the data module (or module) states it, else the DataLoader's."""
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        stated = micro_batch_size_of(datamodule, self.lightning_module)
        return stated if stated is not None else self._loader_batch_size()

    def _loader_batch_size(self) -> int | None:
        # Lightning's _auto_select_batch_size assumes a batch sampler (a DataLoader with batch_size=None that yields
        # ready batches has none) and answers 1 when it cannot tell; None keeps "unknown" unknown.
        loader = training_dataloader(self.lightning_module.trainer)
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler_config = super()._init_optimizers()
        if self.cpu_optimizer != "deepspeed":
            return optimizer, scheduler_config
        fused = deepspeed_cpu_adam(optimizer)
        if scheduler_config is not None:
            # The scheduler only reads/writes param_groups' "lr"; point it at the replacement optimizer.
            scheduler_config.scheduler.optimizer = fused
        return fused, scheduler_config

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        self._fill_zero3_weights()
        self._mark_leaf_modules(model)
        # The one config step after the build (strategies.zero.resolve): the model's size is known only now. Under
        # stage 3 the parameters are already partitioned: ds_numel is a parameter's full size.
        self.config = cap_bucket_sizes(self.config, sum(full_numel(p) for p in model.parameters()))
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        use_weights_only_engine(engine)
        if self.zero_stage_3:
            keep_zero3_trace_valid(engine)
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        import deepspeed

        self._fill_zero3_weights()
        self._mark_leaf_modules(model, training=False)
        self.model, _, _, _ = deepspeed.initialize(
            args=self._deepspeed_args(),
            config=inference_config(self.config, self.zero_stage_3),
            model=model,
            dist_init_required=False,
        )
        use_weights_only_engine(self.model)
        if self.zero_stage_3:
            keep_zero3_trace_valid(self.model)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Lightning enters this context first, then model_sharded_context, and completes the DeepSpeed config in the
        # latter: by then the root device (CUDA) and the precision's default dtype (bf16-true) are in force, and
        # completing the config runs user code (the training DataLoader for the micro-batch size,
        # estimated_stepping_batches for "auto" scheduler keys, the module's facts): on an H200 a user's
        # train_dataloader drew from a CPU generator under the CUDA default device and failed. Completed here, before
        # any construction context is entered.
        if self.lightning_module is not None:
            init_deepspeed_config_if_needed(self)
        with super().tensor_init_context(empty_init=empty_init):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Keep HF's DeepSpeed integration alive while (and after) the model is built: under zero.Init, HF models
        # built from a config only get their weight initialisation (and from_pretrained its partitioned loading)
        # when it is active, and generate() then syncs ranks.
        init_deepspeed_config_if_needed(self)
        if self.zero_stage_3 and self._hf_deepspeed_config is None:
            self._hf_deepspeed_config = _activate_hf_deepspeed(self.config)
        with super().model_sharded_context():
            yield

    def _mark_leaf_modules(self, model: nn.Module, training: bool = True) -> None:
        """ZeRO-3's leaf modules (``strategies.zero.leaf``): mixture-of-experts blocks always (correctness), decoder
        layers unless ``leaf_decoder_layers`` is off (``mark_decoder_leaf_modules`` says when it still leaves them
        hooked)."""
        if not self.zero_stage_3:
            return
        mark_moe_leaf_modules(model)
        if self.leaf_decoder_layers:
            marked = mark_decoder_leaf_modules(model, self.config, training)
            self._layers_gathered_whole = bool(marked) if training else self._layers_gathered_whole

    @override
    def start_agreed_counts(self, local: list[int]) -> AgreedCounts:
        """As ``GymStrategy``'s, with one more count agreed at stage 3 where it must be: ZeRO-3 gathers a module's
        weights at each of its calls, so an MLP tile (``loss.MLP_TILES``) is a collective unless its decoder layer
        is a leaf module, gathered whole once per pass (``mark_decoder_leaf_modules``; not under LoRA)."""
        if not self.zero_stage_3 or self._layers_gathered_whole:
            return super().start_agreed_counts(local)
        return start_max_counts(local)

    def _fill_zero3_weights(self, plan: BuildPlan | None = None) -> None:
        """Give the models built under ``zero.Init`` (recorded in ``plan``, default the strategy's) their weights, each
        rank its partitions (``stage3.fill_partitions``: the one weight loader, ``models.fill``)."""
        fill_partitions((plan or self._build_plan).take(), self._without_zero_init)

    def hold_frozen(
        self, build: Build, copy_of: nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> nn.Module:
        """A frozen model (a preference objective's reference, ``protocols.HoldsFrozenModels``) held as the policy
        (``strategies.zero.frozen``): stages 0-2 whole on every rank in the engine's dtype; stage 3 built under
        ``zero.Init`` with a build plan of its own, each rank filling its partitions from the source (or copying
        ``copy_of``'s), its decoder layers leaf modules, gathered for each forward by an inference engine's hooks.
        ``dtype`` replaces the engine's dtype at stages 0-2; stage 3 refuses another (``check_zero3_dtype``).
        Collective: every rank calls it, and calls the returned model as it calls the policy."""
        if not self.zero_stage_3:
            return hold_whole(self, build, copy_of, dtype or engine_dtype(self.config))
        check_zero3_dtype(self.config, dtype)
        plan = BuildPlan(record_random_init=True, fill_pretrained=True)
        model = build_frozen(self, build, plan)
        self._fill_zero3_weights(plan)
        if copy_of is not None:
            copy_values(model, copy_of, write_partition)
        self._mark_leaf_modules(freeze(model), training=False)
        return with_inference_hooks(model, self._deepspeed_args(), inference_config(self.config, True))

    def _without_zero_init(self, build: Callable[[WeightsSource], _T], source: WeightsSource) -> _T:
        """``build(source)`` with the transformers DeepSpeed integration off: with it on, ``from_config`` would build
        under ``zero.Init`` again (a collective, when one rank builds) and initialise through gathers."""
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            return build(source)
        finally:
            if self._hf_deepspeed_config is not None:
                set_hf_deepspeed_config(self._hf_deepspeed_config)

    @override
    def teardown(self) -> None:
        if self._hf_deepspeed_config is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_deepspeed_config = None
        super().teardown()

    # ----------------------------------------------------------------------------------------------- checkpoints
    @contextmanager
    @override
    def _checkpoint_loading(self, checkpoint_path: Any) -> Generator[None, None, None]:
        # A checkpoint of another number of ranks is converted before the read and, under stage 3, repaired after it.
        # DeepSpeed's own loader unpickles with weights_only=False; the engine's loader was swapped for a
        # weights_only=True one (gym_lightning.checkpointing.safe_load), and a full-weights file loads the same way.
        saved = None if self.load_full_weights and self.zero_stage_3 else checkpoint_world_size(checkpoint_path)
        universal = saved is not None and saved != self.world_size
        if universal:
            self._prepare_universal(checkpoint_path, saved)
        yield
        if universal and self.zero_stage_3:
            repair_zero3_universal_load(self.deepspeed_engine, checkpoint_path)

    def _prepare_universal(self, checkpoint_path: Any, saved: int) -> None:
        """A checkpoint of ``saved`` ranks on this run's number: rank 0 converts it to a universal checkpoint (once;
        ``strategies.zero.universal``), every rank will then load that. A failed conversion fails every rank."""
        failure: Exception | None = None
        if self.is_global_zero:
            rank_zero_info(
                f"gym_lightning: {checkpoint_path} was written by {saved} ranks, this run has {self.world_size}: "
                "loading it as a DeepSpeed universal checkpoint (converted once, into its 'universal' folder)."
            )
            try:
                convert_to_universal(checkpoint_path)
            except Exception as err:  # reported on every rank below, so none waits for rank 0 in a collective
                failure = err
        problem = self.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
        if problem is not None:  # rank 0 keeps the conversion's traceback (GYM_DEBUG=1 shows it)
            raise EveryRankError(
                f"The ZeRO checkpoint {os.fspath(checkpoint_path)!r} was written by {saved} ranks and this run has "
                f"{self.world_size}; converting it to a DeepSpeed universal checkpoint failed ({problem}). Resume "
                "on the original number of ranks, or export it (gym export) and start a new run from that folder."
            ) from failure
        if not self.is_global_zero:
            refuse_unsafe_files(Path(checkpoint_path) / UNIVERSAL_TAG)
        load_universal_next(self.deepspeed_engine)

    def local_gradients(self, module: nn.Module) -> list[torch.Tensor] | None:
        """``None``: the engine owns the gradients (``.grad`` stays empty) and always steps, so ``NonFiniteGuard``
        can neither inspect nor drop them."""
        return None

    # ---------------------------------------------------------------------------------------------------- export
    def full_tensors(self, model: nn.Module) -> dict[str, LazyTensor]:
        """``model``'s state dict as lazy full CPU tensors (``gym_lightning.lazy``), for the exporter.

        Under stage 3 each parameter is gathered on its own when loaded (a collective: every rank loads in the same
        order), so an export holds one parameter at a time, not a module or the model. Stages 1 and 2 keep the
        whole model on every rank. Under stage 3 a trainable parameter's cast loads read the optimizer's fp32 master
        (``strategies.zero.masters``), as the checkpoint's export does.
        """
        state = model.state_dict(keep_vars=True)
        if not self.zero_stage_3:
            return {key: eager(value) for key, value in state.items()}
        return {key: reading_master_weights(value, full_tensor(value)) for key, value in state.items()}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry.register, cls, "zero")  # gym_lightning.vocabulary: zero1 ... zero_infinity


def _activate_hf_deepspeed(config: dict[str, Any]) -> Any:
    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:  # a plain LightningModule without transformers installed
        return None
    rank_zero_info("gym_lightning: ZeRO-3 model construction with the transformers DeepSpeed integration active.")
    return HfDeepSpeedConfig(config)


class ZeRO1Strategy(ZeROStrategy):
    """``ZeROStrategy(stage=1)``: optimizer state sharded over ranks. Arguments as for
    :class:`ZeROStrategy` (``offload_parameters`` needs stage 3 and is refused here)."""

    fixed_stage = 1


class ZeRO2Strategy(ZeROStrategy):
    """``ZeROStrategy(stage=2)``: optimizer state and gradients sharded over ranks. Arguments as for
    :class:`ZeROStrategy` (``offload_parameters`` needs stage 3 and is refused here)."""

    fixed_stage = 2


class ZeRO3Strategy(ZeROStrategy):
    """``ZeROStrategy(stage=3)``: optimizer state, gradients and parameters sharded over ranks.
    Arguments as for :class:`ZeROStrategy`."""

    fixed_stage = 3


__all__ = [
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "ZeROStrategy",
    "deepspeed_cpu_adam",
    "mark_decoder_leaf_modules",
    "mark_moe_leaf_modules",
    "training_facts",
]
