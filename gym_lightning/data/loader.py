"""A DataLoader that tells each micro-batch how many target tokens its optimizer step holds, and can resume mid-epoch.

Lightning gives ``training_step`` one micro-batch at a time, so the module cannot know the token count of the
whole gradient-accumulation window by itself. This loader reads the window ahead (as the Hugging Face Trainer's
``get_batch_samples`` does) and attaches the local count to every batch of the window as ``step_target_tokens``.
The module sums that count over data-parallel ranks. Preference batches (``data.pairs``: two rows per example) also
get ``step_pairs``, the window's examples on this rank, for objectives that average over examples. Windows restart
at every epoch and hold ``accumulate_grad_batches`` batches, exactly the grouping Lightning's loop uses to decide
when to step. The resume position below counts data set rows, which for preference data are examples (pairs).

Mid-epoch resume: Lightning's fit loop saves ``state_dict()`` of every training DataLoader that has one in the
checkpoint and, when it restarts inside an epoch, hands it back through ``load_state_dict`` before iterating
(``lightning/pytorch/loops/fit_loop.py``, ``_load_combined_loader_states``). The state is the number of batches
this loader already handed out in the current pass; the next pass skips them, so training continues with the next
micro-batch of the interrupted epoch. Skipped batches are still read (so that the window grouping, which starts at
the epoch's first batch, stays the same) but never reach the model. The sampler must give the same order for the
same epoch (Lightning's ``DistributedSampler`` and ``CausalLMDataModule``'s sampler do, via ``set_epoch``).

A streamed data set (``datasets.IterableDataset``, which has ``state_dict``/``load_state_dict``) keeps its own
position instead: the state saved is the data set's state right after the last batch handed out, and resuming
loads it back (``num_workers`` must then be 0, so that the state is the main process's). Lightning fetches a
stream's next batch before training the current one, so each streamed batch carries its index and the data module
reports the batch actually being trained (``mark_in_use``); the saved position is that batch's. A plain
``DataLoader`` subclass, so that Lightning can still re-create it with a distributed sampler.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from gym_lightning.errors import GymUserError
from gym_lightning.loss import count_target_tokens
from gym_lightning.protocols import STEP_TOKENS_KEY

BATCH_INDEX_KEY = "stream_batch_index"  # streamed batches only; CausalLMDataModule.on_before_batch_transfer pops it
STEP_PAIRS_KEY = "step_pairs"  # preference batches: this rank's examples (pairs) in the optimizer step


def batches_to_skip(state: dict[str, Any], batch_size: int, num_replicas: int, num_batches: int) -> int:
    """Batches of this pass to skip to continue after ``state``'s position (0 when that pass was complete).

    The position is kept as samples consumed over all ranks: rank ``r`` of a ``DistributedSampler`` takes
    ``permutation[r::W]``, so the first ``n`` batches of all ranks together are exactly the permutation's first
    ``n * batch_size * W`` samples, whatever ``W`` is. That lets a run saved on 2 ranks resume on 1.
    """
    consumed = int(state["samples_consumed"])
    per_batch = batch_size * num_replicas
    if consumed % per_batch:
        raise GymUserError(
            f"Cannot resume the data position: {consumed} samples were consumed in the interrupted epoch, not a "
            f"multiple of the new global batch ({batch_size} per rank x {num_replicas} rank(s)). Resume with a "
            "batch size and number of ranks whose product divides it, or from an end-of-epoch checkpoint."
        )
    skip = consumed // per_batch
    return 0 if skip >= num_batches else skip


class StepTokenDataLoader(DataLoader):
    """``DataLoader`` whose batches (dicts with ``labels``) carry ``step_target_tokens``; resumable mid-epoch.

    Args:
        *args: As for ``torch.utils.data.DataLoader``.
        accumulate_grad_batches: Micro-batches per optimizer step (the Trainer's ``accumulate_grad_batches``).
        stream_ranks: For a streamed data set already split between the data-parallel ranks
            (``split_dataset_by_node``): how many ranks share it (a map-style set's sampler says so itself).
        pairs: Batches hold two rows per example (``pairs``/``unpaired``): attach ``step_pairs`` too. Their
            ``step_target_tokens`` counts the targets of all rows (KTO's KL rows included).
        **kwargs: As for ``torch.utils.data.DataLoader``.
    """

    def __init__(
        self, *args: Any, accumulate_grad_batches: int = 1, stream_ranks: int = 1, pairs: bool = False, **kwargs: Any
    ) -> None:
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise GymUserError(
                f"accumulate_grad_batches must be a positive integer, got {accumulate_grad_batches!r}; "
                "set trainer.accumulate_grad_batches to 1 or more."
            )
        super().__init__(*args, **kwargs)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.stream_ranks = stream_ranks
        self.pairs = pairs
        self._yielded = 0  # batches handed out in the current pass
        self._skip = 0  # batches the next pass skips (set by load_state_dict)
        self._resumed_at: int | None = None  # batches of the interrupted epoch already trained (resumed_batches)
        self._position: Any = None  # a streamed data set's state after the last batch handed out (or in use)
        self._pending: dict[int, Any] = {}  # streamed: positions of batches handed out, by index (see mark_in_use)

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        self._resumed_at = None
        self._yielded = 0
        batches = self._with_positions(super().__iter__())
        index = 0
        while window := list(islice(batches, self.accumulate_grad_batches)):
            counts = {STEP_TOKENS_KEY: torch.stack([count_target_tokens(batch["labels"]) for batch, _ in window]).sum()}
            if self.pairs:
                counts[STEP_PAIRS_KEY] = torch.tensor(sum(len(batch["input_ids"]) // 2 for batch, _ in window))
            if self.pin_memory and torch.accelerator.is_available():  # the DataLoader's own condition for pinning
                # The batch was pinned by the DataLoader; the counts join it after.
                counts = {key: value.pin_memory() for key, value in counts.items()}
            for batch, position in window:
                index += 1
                if index <= skip:
                    continue
                batch.update(counts)
                self._yielded, self._position = index, position  # set before the consumer sees the batch
                if position is not None:
                    batch[BATCH_INDEX_KEY] = index
                    self._pending = {i: p for i, p in self._pending.items() if i > index - 8}
                    self._pending[index] = position
                yield batch

    def mark_in_use(self, index: int) -> None:
        """The streamed batch ``index`` is the one being trained: make the saved position the one right after it.

        Lightning reads a loader without a length (a stream) one batch ahead (``_PrefetchDataFetcher``: it fetches
        batch k+1 before running batch k, to know whether k is the last), so when a checkpoint is taken after batch
        k this loader has already handed out k+1; saving that position would skip batch k+1 on resume (found by
        tests/data/test_stream_resume.py). ``CausalLMDataModule.on_before_batch_transfer``, which Lightning calls on
        the batch it is about to train, calls this; without it (plain iteration) the last batch handed out counts.
        """
        if index in self._pending:
            self._yielded, self._position = index, self._pending[index]

    def _stateful_dataset(self) -> bool:
        return callable(getattr(self.dataset, "state_dict", None)) and callable(
            getattr(self.dataset, "load_state_dict", None)
        )

    def _with_positions(self, batches: Iterator[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], Any]]:
        """Each batch with the stateful (streamed) data set's position right after it; the window is read ahead, so
        the position must be taken per batch, not when a checkpoint asks."""
        stateful = self._stateful_dataset()
        for batch in batches:
            yield batch, (copy.deepcopy(self.dataset.state_dict()) if stateful else None)

    def _num_replicas(self) -> int:
        if isinstance(self.sampler, DistributedSampler):
            return self.sampler.num_replicas
        return self.stream_ranks if self._stateful_dataset() else 1

    def state_dict(self) -> dict[str, Any]:
        """Position in the current pass, as samples consumed over all ranks (see ``batches_to_skip``), and the layout
        it was consumed with (per-rank batch, ranks, accumulation)."""
        state = {
            "samples_consumed": self._yielded * int(self.batch_size or 1) * self._num_replicas(),
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "batch_size": int(self.batch_size or 1),
            "num_replicas": self._num_replicas(),
        }
        if self._stateful_dataset():
            state["dataset_state"] = self._position  # a streamed data set: its own position (datasets' state_dict)
        return state

    @property
    def resumed_batches(self) -> int | None:
        """Batches of the interrupted epoch already trained, counted in this loader's batches (all of them when it
        ended), from the position loaded last; ``None`` until one is loaded, and once the next pass has begun."""
        return self._resumed_at

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next pass start after the saved position, also on another number of ranks or per-rank batch:
        then the position must fall on an accumulation window of the new layout (``_window_problem``)."""
        if self._stateful_dataset():
            if (problem := self._stream_resume_problem(state_dict)) is not None:
                raise GymUserError(problem)
            if state_dict.get("dataset_state") is not None:
                self.dataset.load_state_dict(state_dict["dataset_state"])
            return
        skip = batches_to_skip(state_dict, int(self.batch_size or 1), self._num_replicas(), len(self))
        if (problem := self._window_problem(state_dict, skip)) is not None:
            raise GymUserError(problem)
        self._skip = skip
        per_batch = int(self.batch_size or 1) * self._num_replicas()
        self._resumed_at = min(len(self), int(state_dict["samples_consumed"]) // per_batch)

    def _layout(self) -> tuple[int, int, int]:
        return int(self.batch_size or 1), self._num_replicas(), self.accumulate_grad_batches

    def _window_problem(self, state: dict[str, Any], skip: int) -> str | None:
        """Why the resumed pass would not group its batches as the interrupted one did, else ``None``.

        Windows group ``accumulate_grad_batches`` batches from the start of every pass, skipped ones included. With the
        layout unchanged any position continues the interrupted window; with another one (more ranks, another
        batch or accumulation) the position must be a whole number of the new windows, as a checkpoint taken after
        an optimizer step is when the global batch (batch x ranks x accumulation) stays the same."""
        saved = (state.get("batch_size"), state.get("num_replicas"), state.get("accumulate_grad_batches"))
        known = tuple(value if value is not None else now for value, now in zip(saved, self._layout(), strict=True))
        if known == self._layout() or skip % self.accumulate_grad_batches == 0:
            return None
        batch, ranks, accumulate = known
        return (
            f"Cannot resume the data position: the checkpoint was taken {state['samples_consumed']} samples into the "
            f"epoch with {batch} per rank x {ranks} rank(s) x {accumulate} accumulation, and with this run's "
            f"{self._layout()[0]} x {self._layout()[1]} x {self.accumulate_grad_batches} that is not a whole number of "
            "optimizer steps. Resume with the same global batch (batch x ranks x accumulation), or the same layout."
        )

    def _stream_resume_problem(self, state: dict[str, Any]) -> str | None:
        # Each rank reads every world-size-th row of a stream and keeps its own position in it.
        saved_ranks = state.get("num_replicas")
        if saved_ranks is not None and saved_ranks != self._num_replicas() and state.get("samples_consumed"):
            return (
                f"A streamed data set was checkpointed mid-epoch on {saved_ranks} rank(s) and this run has "
                f"{self._num_replicas()}: each rank's position in the stream cannot be mapped onto another number of "
                "ranks. Resume on the same number of ranks, or from an end-of-epoch checkpoint."
            )
        saved = state.get("accumulate_grad_batches", self.accumulate_grad_batches)
        if saved != self.accumulate_grad_batches and state.get("samples_consumed"):
            return (
                f"The checkpoint was taken mid-epoch with accumulate_grad_batches={saved}, this run uses "
                f"{self.accumulate_grad_batches}: the accumulation windows of a streamed epoch would not line up. "
                f"Resume with trainer.accumulate_grad_batches={saved}, or from an end-of-epoch checkpoint."
            )
        return None
