"""``GymStrategy``: the lifecycle gym_ddp, gym_fsdp and ZeRO share, combined with each one's Lightning strategy.

Every gym_lightning strategy starts its ranks the same way (a share of the CPU cores each, freed host memory given
back, the process group destroyed at exit, collectives watched by ``strategies.rank_failure``), names a rank that
stopped answering when a collective fails, verifies a checkpoint's manifest on every rank and never unpickles
arbitrary objects from it, and offers Ulysses sequence parallelism (``strategies.sequence``). The parallel degrees
all of that reads (the sampler's, the sequence groups', gym_fsdp's mesh) come from one ``ParallelDims``.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from gym_lightning._compat import set_attention_implementation
from gym_lightning.checkpointing.manifest import verify_checkpoint
from gym_lightning.checkpointing.safe_load import refuse_unsafe_pickles
from gym_lightning.errors import raise_if_problems
from gym_lightning.loss import LOSS_CHUNKS, AgreedCounts, start_max_counts
from gym_lightning.strategies._common import (
    configure_cpu_threads,
    destroy_process_group_at_exit,
    raise_strategy_problems,
    rendezvous_timeout,
    return_freed_host_memory,
)
from gym_lightning.strategies.parallel_dims import ParallelDims
from gym_lightning.strategies.placement import placed_after
from gym_lightning.strategies.rank_failure import RankWatch, report_rank_failure, watch_collectives
from gym_lightning.strategies.sequence import (
    SUPPORTED_CORE_ATTENTION,
    ULYSSES_ATTENTION,
    SequenceShard,
    activate,
    hf_config,
    new_sequence_group,
    raise_if_unsplittable,
    register_ulysses_attention,
    shard_batch,
)


class GymStrategy(ParallelStrategy):
    """Mixin of gym_lightning's strategies, listed before their Lightning parent (``DDPStrategy``,
    ``ModelParallelStrategy``, ``DeepSpeedStrategy``): the shared lifecycle, and sequence parallelism.

    With ``sequence_parallel_size`` > 1 the sampler deals batches to groups instead of ranks, each training batch is
    cut to this rank's slice, and the model's attention runs the exchange during training steps
    (``strategies.sequence``); ``setup`` creates the groups once the model exists.

    Args:
        timeout: Timeout of collective operations: a rank that does not arrive within it is named and the job ends
            (``strategies.rank_failure``); it must cover the longest wait of a healthy run (the first data
            preparation, a checkpoint save). The process group itself starts with at least torch's default
            (``_common.rendezvous_timeout``). gym train: ``--ddp_timeout`` (seconds).
        sequence_parallel_size: Ranks that share each training sequence (Ulysses; ``strategies.sequence``): each
            holds 1/N of its tokens and the data-parallel degree (the sampler's) is world size / N. 1: off.
            gym train: ``--sequence_parallel_size``.
        **kwargs: The Lightning parent's arguments.
    """

    sequence_parallel_size: int = 1
    _sequence: SequenceShard | None = None
    _sequence_config: Any = None

    def __init__(
        self, *, timeout: timedelta | None = default_pg_timeout, sequence_parallel_size: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(timeout=rendezvous_timeout(timeout), **kwargs)  # collectives: self.collective_timeout
        self.collective_timeout = timeout
        self._rank_watch: RankWatch | None = None
        self.sequence_parallel_size = sequence_parallel_size

    @property
    def parallel_dims(self) -> ParallelDims:
        """The run's parallel degrees (``strategies.parallel_dims``), from the ranks the Trainer gave the strategy."""
        return ParallelDims(self.num_nodes * self.num_processes, sequence=self.sequence_parallel_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dims = self.parallel_dims
        return {"num_replicas": dims.data_parallel, "rank": dims.data_parallel_rank(self.global_rank)}

    # ----------------------------------------------------------------------------------------------- environment
    @override
    def setup_environment(self) -> None:
        # Refused as soon as the ranks' number is known, before the process group, data and model: nothing to undo.
        self.parallel_dims.raise_if_invalid("Invalid sequence parallelism")
        raise_strategy_problems(type(self).__name__, self._environment_problems())
        configure_cpu_threads(self.root_device, self.num_processes)
        return_freed_host_memory(self.root_device)
        destroy_process_group_at_exit()
        self._start_process_group()
        self._rank_watch = watch_collectives(self.collective_timeout, self._watched_groups(), self.lightning_module)

    def _environment_problems(self) -> list[str]:
        """The strategy's configuration problems that show once the device and the ranks are known (none here)."""
        return []

    def _start_process_group(self) -> None:
        """The Lightning parent's ``setup_environment`` (device and process group); a strategy adds what must come
        just before or after it."""
        super().setup_environment()

    def _watched_groups(self) -> Iterable[Any]:
        """Process groups beside the default one whose collectives time out after ``timeout``."""
        return ()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        report_rank_failure(self._rank_watch, exception)  # a rank that stopped answering: named, ended

    @override
    def setup(self, trainer: Trainer) -> None:
        self.setup_sequence_parallel()
        # What no engine manages (metric states, buffers) goes to the device in its own dtype: DeepSpeed never moves
        # a zero.Init model and its bf16 convert_module casts metric states, bf16-true would cast them under DDP.
        with placed_after(self.lightning_module, self.root_device):
            super().setup(trainer)

    # ----------------------------------------------------------------------------------------------- call counts
    def start_agreed_counts(self, local: list[int]) -> AgreedCounts:
        """The counts every rank makes of the calls that may be collectives (``protocols.AgreesCallCounts``): the
        largest over all ranks of the LM-head calls (``loss.LOSS_CHUNKS``), started before the forward and read
        after it, so that it overlaps it (``loss.start_max_counts``, over host memory: no device is waited for);
        this rank's own MLP tiles (``loss.MLP_TILES``), which run inside a decoder layer that gym_ddp never gathers
        and gym_fsdp gathers once per pass, so no rank waits for another before its forward.

        The head is agreed because a strategy may gather it on each call (a shard unit of its own); where none does,
        the extra calls on the rank with fewer positions run on no position and add an exact zero to the loss.

        Args:
            local: This rank's counts (loss chunks, MLP tiles), in the order the caller reads them back.
        """
        return start_max_counts(local, (LOSS_CHUNKS,))

    # ----------------------------------------------------------------------------------------------- checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        verify_checkpoint(checkpoint_path, self.global_rank, self.world_size)  # every rank, before any reads
        # Checkpoints hold tensors and plain containers only: never unpickle arbitrary objects.
        with self._checkpoint_loading(checkpoint_path), refuse_unsafe_pickles(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)

    def _checkpoint_loading(self, checkpoint_path: Any) -> AbstractContextManager[None]:
        """Entered after the manifest was verified, around the Lightning parent's ``load_checkpoint``: what a strategy
        prepares before the read and repairs after it (nothing here)."""
        return nullcontext()

    # ----------------------------------------------------------------------------------------------- sequences
    def setup_sequence_parallel(self) -> None:
        """Check the model and the ranks, create the groups and register the exchange (no-op for size 1)."""
        size = self.sequence_parallel_size
        if size == 1:
            return
        config = hf_config(self.lightning_module)
        if config is None:
            raise_if_problems(
                "Invalid sequence parallelism",
                ["sequence_parallel_size > 1 needs a Hugging Face transformers model in the LightningModule."],
            )
        raise_if_unsplittable(config, size, self.world_size)
        register_ulysses_attention()
        group, rank = new_sequence_group(self.parallel_dims)
        self._sequence, self._sequence_config = SequenceShard(size, rank, group), config
        activate(self._sequence)

    def _attention(self, name: str) -> None:
        if self._sequence_config is not None:
            set_attention_implementation(self._sequence_config, name)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._sequence is not None:
            batch, self._sequence.spans = shard_batch(args[0], self._sequence.size, self._sequence.rank)
            args = (batch, *args[1:])
            self._attention(ULYSSES_ATTENTION)  # stays set through backward, whose recomputation attends again
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._attention(SUPPORTED_CORE_ATTENTION)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._attention(SUPPORTED_CORE_ATTENTION)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._attention(SUPPORTED_CORE_ATTENTION)
        return super().predict_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._attention(SUPPORTED_CORE_ATTENTION)  # an exported or reused model attends as it was built
        if self._sequence is not None:
            activate(None)
            self._sequence = None
        super().teardown()


__all__ = ["GymStrategy"]
