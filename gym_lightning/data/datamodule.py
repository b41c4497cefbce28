"""``CausalLMDataModule``: records from a bundled data set or files, tokenized for causal-LM finetuning."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from gym_lightning._compat import rank_zero_info
from gym_lightning.data.collate import Collator
from gym_lightning.data.formats import (
    FORMATS,
    PREFERENCE_FORMATS,
    FormatName,
    TokenizedSample,
    resolve_format,
    tokenize_prompt,
)
from gym_lightning.data.loader import BATCH_INDEX_KEY, StepTokenDataLoader
from gym_lightning.data.pairs import (
    PairCollator,
    PreferenceRows,
    UnpairedCollator,
    kind_of_columns,
    kind_of_format,
    kind_problems,
    settings_problems,
)
from gym_lightning.data.preference import (
    PreferenceSettings,
    TruncationMode,
    tokenize_preference_dataset,
)
from gym_lightning.data.prepare import (
    DataSource,
    Settings,
    build_or_load,
    check_sources,
    fingerprint,
    load_records_dataset,
    mix,
    pack_dataset,
    peek_format,
    records_to_dataset,
    resolve_source_format,
    split_indices,
    stream_dataset,
    tokenize_dataset,
)
from gym_lightning.data.reference import LogpsFn, precompute
from gym_lightning.data.sources import MIX_STRATEGIES, MixStrategy, read_records, source_fingerprint
from gym_lightning.data.synthetic import BUNDLED_DATASETS
from gym_lightning.errors import GymUserError
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.tokenizer import load_tokenizer

DEFAULT_CACHE_DIR = "~/.cache/gym_lightning/data"


class SampleDataset(Dataset):
    """A map-style data set over in-memory samples or rows (a ``Dataset``, so Lightning can attach a sampler)."""

    def __init__(self, samples: Sequence[TokenizedSample | dict[str, Any]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> TokenizedSample | dict[str, Any]:
        return self.samples[index]


class PromptView(Dataset):
    """The generation prompts of a tokenized validation set (prediction without ``predict_files``)."""

    def __init__(self, rows: datasets.Dataset) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> TokenizedSample:
        row = self.rows[index]
        ids = row["prompt_ids"]
        return TokenizedSample(
            ids, [IGNORE_INDEX] * len(ids), prompt_ids=ids, prompt=row["prompt"], reference=row["reference"]
        )


class EpochShuffleSampler(DistributedSampler):
    """A new permutation every pass, fixed by ``(seed, epoch)``, dealt out to the data-parallel ranks.

    Rank ``r`` of ``W`` takes ``permutation[r::W]`` (``DistributedSampler``'s order, padded to a multiple of ``W``),
    so the first ``n`` batches of all ranks together are the permutation's first ``n x batch x W`` samples whatever
    ``W`` is: a run resumed on another number of ranks continues with the same samples (``data.loader``), and one
    process sees what ``W`` ranks see together. Lightning leaves a ``DistributedSampler`` alone; its own would be
    seeded by ``seed_everything`` instead of ``seed``, so one process and ``W`` ranks would order the data
    differently whenever the two seeds differ. Lightning calls ``set_epoch`` at the start of every epoch; without
    that, each pass takes the next epoch.

    Args:
        data_source: The data set.
        seed: Seed of the permutations.
        num_replicas: Data-parallel ranks.
        rank: This rank among them.
    """

    def __init__(self, data_source: Dataset, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(data_source, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)

    def __iter__(self) -> Iterator[int]:
        order = super().__iter__()  # this pass's order, drawn now: a pass left early still moves to the next epoch
        self.epoch += 1
        return order


class CausalLMDataModule(LightningDataModule):
    """Tokenized data for causal-LM finetuning: a bundled data set, files, Hub data sets, or a weighted mix.

    Data is read and tokenized with Hugging Face ``datasets`` once per node and cached (see
    ``gym_lightning.data.prepare``): ``prepare_data`` (local rank 0) builds the cache, every rank memory-maps it.
    Preference records (formats ``preference``, ``kto``) give the preference objectives' batches (``batch_kind``,
    ``gym_lightning.data.pairs``), with the reference model's log-probabilities once ``precompute_reference_logps``
    has stored them beside the prepared data.

    Args:
        dataset: Name of a bundled data set (``"addition"``: 2-digit additions with a fixed validation split;
            ``"addition_preference"``: the same as preference pairs, for DPO after the quickstart).
            Mutually exclusive with ``train_files`` and ``sources``.
        train_files: Training files or glob patterns (``.jsonl``, ``.json``, ``.csv``, ``.parquet``, ``.txt``
            paragraphs, ``.arrow``) or a Hugging Face Hub data set name (its ``train`` split).
        sources: Several training data sets mixed with weights and per-set caps (``DataSource``: ``path``,
            ``format``, ``columns``, ``weight``, ``max_samples``, ``split``, ``subset``). Instead of ``train_files``.
        mix: How ``sources`` become one training set (LLaMA-Factory's ``mix_strategy`` names): ``interleave_over``
            (the default) draws from each in proportion to its ``weight`` until every one is drawn completely (a
            smaller share repeats), ``interleave_under`` until the first runs out, ``concat`` takes each record once,
            one set after the other (the sampler shuffles every epoch; weights must stay 1).
        val_files: Validation files or glob patterns. Replace the bundled data set's validation split if given.
        predict_files: Files with prompts for ``predict`` (records with ``prompt``, alpaca ``instruction``/``input``,
            chat ``messages``/``conversations`` or ``text``). Without them, ``predict`` uses the validation prompts.
        val_split: Fraction of the training records held out for validation (a seeded permutation of each set)
            when there are no ``val_files``; in ``[0, 1)``. Only for ``train_files``/``sources``.
        format: Record format of ``train_files`` (and ``val_files``/``predict_files``): ``"auto"`` (detect from the
            fields), ``"text"``, ``"alpaca"``, ``"sharegpt"``, ``"messages"`` (alias ``"chat"``),
            ``"prompt_completion"``, or the preference formats ``"preference"`` (paired) and ``"kto"`` (unpaired).
            See ``gym_lightning.data.formats`` and ``gym_lightning.data.preference``; ``batch_kind`` says which
            batches the data gives.
        columns: Renames fields of ``train_files``/``val_files`` to the format's names, ``{format field: column}``.
        tokenizer: Local folder or Hugging Face Hub name of the tokenizer; ``None`` uses the shipped tokenizer. The
            CLI links it from the model.
        trust_remote_code: Allow tokenizer code from the Hub to run (only for sources you trust).
        special_tokens: Tokens of the vocabulary that replace the tokenizer's own (``{"eos_token": "<|im_end|>"}``);
            the CLI links them from the model's.
        max_seq_length: Maximum tokens per sample (longer samples are cut) and per packed row; of preference data,
            per row of prompt + answer (TRL's ``max_length``).
        truncation_mode: How a preference row longer than ``max_seq_length`` is cut: ``"keep_start"`` (its end goes;
            examples whose prompt alone fills it are dropped, as in TRL) or ``"keep_end"`` (its start goes; paired
            data only). Other data keeps starts.
        max_prompt_length: Preference data: keep at most the last this many prompt tokens (older TRL's and
            LLaMA-Factory's prompt cut, before ``max_seq_length``); ``None`` keeps the whole prompt.
        mask_prompt: Train only on the completion (prompt labels are ``-100``); ``False`` trains on every token.
        packing: Concatenate training samples into rows of ``max_seq_length`` tokens, padding-free: rows carry
            restarting ``position_ids`` and no ``attention_mask`` (see ``gym_lightning.data.collate``).
        batch_size: Training micro-batch size per device (samples, or packed rows with ``packing``).
        eval_batch_size: Validation/prediction batch size per device; ``None`` means ``batch_size``.
        num_workers: DataLoader worker processes (0 loads in the main process).
        pin_memory: Collate batches into page-locked host memory, so their copy to the GPU is asynchronous; ``None``:
            when the Trainer computes on CUDA (HF's ``dataloader_pin_memory``, on by default there). A copy from
            pageable memory waits for the GPU's queued work (a host sync per batch): the GPU then idles while the next
            step's first kernels are launched.
        num_proc: Tokenization processes (``None``: up to 8 for sets over 50,000 records, else 1).
        streaming: Read and tokenize ``train_files``/``sources`` on the fly (``datasets`` streaming), for sets larger
            than the disk: nothing is cached, rows come in file order (no shuffle: shuffle the files beforehand),
            each rank reads every world-size-th row, and checkpoints hold the stream's position, so a resume
            continues exactly. Not with ``packing``, ``val_split``, ``val_files``, ``dataset`` or ``num_workers``.
        cache_dir: Where tokenized data is cached (``None``: ``$GYM_DATA_CACHE`` or ``~/.cache/gym_lightning/data``);
            the location is logged.
        seed: Seed of the training shuffle, of ``val_split`` and of the mix.
    """

    def __init__(
        self,
        dataset: str | None = None,
        train_files: str | list[str] | None = None,
        sources: list[DataSource] | None = None,
        mix: MixStrategy = "interleave_over",
        val_files: str | list[str] | None = None,
        predict_files: str | list[str] | None = None,
        val_split: float = 0.0,
        format: FormatName = "auto",
        columns: dict[str, str] | None = None,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        special_tokens: dict[str, str] | None = None,
        max_seq_length: int = 512,
        truncation_mode: TruncationMode = "keep_start",
        max_prompt_length: int | None = None,
        mask_prompt: bool = True,
        packing: bool = False,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        num_proc: int | None = None,
        streaming: bool = False,
        cache_dir: str | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        problems = _config_problems(locals())
        if problems:
            raise GymUserError("Invalid data configuration:\n" + "\n".join(f"  - {p}" for p in problems))
        # The tokenizer is the model's (the CLI links it from model.tokenizer, resolved to the model's folder or hub
        # name): it is logged with the module's hyper-parameters, and Lightning refuses to merge a key that both hold
        # with different values (None there, the resolved name here).
        self.save_hyperparameters(ignore=["tokenizer"])
        self.dataset, self.sources, self.mix = dataset, list(sources or []), mix
        self.train_files, self.val_files, self.predict_files = train_files, val_files, predict_files
        self.val_split, self.format, self.columns, self.tokenizer_source = val_split, format, columns, tokenizer
        self.trust_remote_code, self.max_seq_length, self.mask_prompt = trust_remote_code, max_seq_length, mask_prompt
        self.special_tokens = dict(special_tokens) if special_tokens else None
        self.truncation_mode, self.max_prompt_length = truncation_mode, max_prompt_length
        self.packing, self.batch_size, self.num_workers, self.seed = packing, batch_size, num_workers, seed
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_proc, self.streaming, self.pin_memory = num_proc, streaming, pin_memory
        self.cache_dir = Path(cache_dir or os.environ.get("GYM_DATA_CACHE", DEFAULT_CACHE_DIR)).expanduser()
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._splits: dict[str, datasets.Dataset] | None = None
        self._predict: list[TokenizedSample] | None = None
        self._train_format: str | None = None
        self._cache_entry: Path | None = None
        self._references: dict[str, np.ndarray] = {}  # split -> [rows, 2] precomputed reference log-probabilities

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_source, self.trust_remote_code, self.special_tokens)
        return self._tokenizer

    @property
    def micro_batch_size(self) -> int:
        """The per-device training micro-batch (``ProvidesMicroBatchSize``: DeepSpeed's micro-batch)."""
        return self.batch_size

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return len(self.tokenizer)

    @property
    def batch_kind(self) -> str:
        """The training batches: ``"lm"`` (SFT formats), ``"pairs"`` (``preference``) or ``"unpaired"`` (``kto``),
        which the command line checks against the objective's (``data.pairs.batch_kind_problem``). From the prepared
        data once it is there, else from the formats (``auto``: each source's first record, read as a stream)."""
        if self._splits is not None:
            return kind_of_columns(self._splits["train"].column_names)
        if self.dataset is not None:
            return kind_of_format(BUNDLED_DATASETS[self.dataset]().format)  # ~50 ms: no second table of formats
        if not (self.train_files or self.sources):
            return "lm"
        kinds = {kind_of_format(peek_format(source, self.cache_dir)) for source in self._train_sources()}
        self._raise_kind_problems(kinds)
        return kinds.pop()

    def _kind_settings(self) -> dict[str, Any]:
        names = ("packing", "streaming", "mask_prompt", "truncation_mode", "max_prompt_length")
        return {name: getattr(self, name) for name in names}

    def _raise_kind_problems(self, kinds: set[str]) -> None:
        if problems := kind_problems(kinds, self._kind_settings()):
            raise GymUserError("Invalid data configuration:\n" + "\n".join(f"  - {p}" for p in problems))

    def _preference_settings(self) -> PreferenceSettings:
        return PreferenceSettings(self.max_seq_length, self.truncation_mode, self.max_prompt_length)

    def _collate(self, kind: str, with_prompts: bool = False) -> Any:
        """The collate function of ``kind`` batches (``data.collate`` or ``data.pairs``)."""
        pad = self.tokenizer.pad_token_id
        if kind == "pairs":
            return PairCollator(pad, self.max_seq_length, self.truncation_mode)
        if kind == "unpaired":
            return UnpairedCollator(pad, self.max_seq_length)
        return Collator(pad, with_prompts=with_prompts)

    def _rows(self, split: datasets.Dataset, name: str, references: bool = True) -> Dataset:
        """A prepared split as the loader reads it: as is (``lm``), or as ``PreferenceRows`` (KL partners in chunks
        of ``batch_size``, as TRL chunks by the per-device training batch; the attached reference values)."""
        kind = kind_of_columns(split.column_names)
        if kind == "lm":
            return split
        chunk = self.batch_size if kind == "unpaired" else None
        return PreferenceRows(split, chunk, self._references if references else None, name)

    def precompute_reference_logps(self, logps: LogpsFn, reference_id: str, batch_size: int | None = None) -> None:
        """TRL's ``precompute_ref_log_probs``, data side: every preference split's reference log-probabilities, read
        from the data cache or computed by ``logps`` and stored there (``gym_lightning.data.reference``); training
        batches then carry ``reference_logps``. Call it on every rank together (it is collective: data-parallel
        forwards, a gather), after the strategy has set the model up and before the training loader is made
        (``Objective.on_fit_start``).

        Args:
            logps: A batch of this data module's kind (on the CPU, as collated) -> ``[2B]`` summed log-probabilities
                of its rows' targets under the reference model, in row order (the reference provider's forward,
                under ``torch.no_grad()``; it moves the batch to its device).
            reference_id: Names the reference model (``data.reference.model_fingerprint(folder, dtype=...)``): another
                id, another stored file.
            batch_size: Rows per forward (``None``: ``eval_batch_size``).
        """
        kind = self.batch_kind
        if kind == "lm":
            raise GymUserError("precompute_ref_log_probs needs preference data (format preference or kto).")
        splits = {
            name: (self._rows(rows, name, references=False), self._cache_entry)
            for name, rows in self._tokenized().items()
        }
        place = self._data_parallel_place()
        cut = {"max_length": self.max_seq_length, "truncation_mode": self.truncation_mode}
        cut["kl_chunk"] = self.batch_size if kind == "unpaired" else None
        batch, where = batch_size or self.eval_batch_size, (place["rank"], place["num_replicas"])
        values = precompute(splits, self._collate(kind), logps, cut, reference_id, batch, where, self._gather())
        self._references.update(values)

    def _gather(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """All ranks' tensors, stacked (the strategy's ``all_gather``, on its device); ``None`` in one process."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        if strategy is None or strategy.world_size == 1:
            return None

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            return strategy.all_gather(tensor.to(strategy.root_device))

        return gather

    @override
    def prepare_data(self) -> None:
        # Lightning calls this on the local rank 0 of every node before any setup: the node's tokenization.
        if (self.dataset is not None or self.train_files or self.sources) and not self.streaming:
            self._tokenized()

    @override
    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate") and not self.streaming:
            self._tokenized()

    @override
    def train_dataloader(self) -> DataLoader:
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        if self.streaming:
            return self._stream_loader(accumulate)
        train = self._tokenized()["train"]
        kind, rows = kind_of_columns(train.column_names), self._rows(train, "train")
        return StepTokenDataLoader(
            rows,
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(rows, self.seed, **self._data_parallel_place()),
            collate_fn=self._collate(kind),
            num_workers=self.num_workers,
            pin_memory=self._pins(),
            accumulate_grad_batches=accumulate,
            pairs=kind != "lm",
        )

    def _pins(self) -> bool:
        """Whether batches are collated into pinned memory (``pin_memory``; ``None``: when training on CUDA)."""
        if self.pin_memory is not None:
            return self.pin_memory
        strategy = self.trainer.strategy if self.trainer is not None else None
        return strategy is not None and strategy.root_device.type == "cuda"

    def _data_parallel_place(self) -> dict[str, int]:
        """``num_replicas``/``rank`` of this process among the data-parallel ranks (the strategy's sampler
        arguments, as Lightning gives its own distributed sampler); one replica without a parallel strategy."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        if not kwargs:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": int(kwargs["num_replicas"]), "rank": int(kwargs["rank"])}

    def _stream_loader(self, accumulate: int) -> DataLoader:
        self._raise_kind_problems({self.batch_kind})  # preference data is not streamed
        streams = [stream_dataset(s, self.tokenizer, self._settings(), self.cache_dir) for s in self._train_sources()]
        stream = mix(streams, [s.weight for s in self._train_sources()], self.seed, self.mix)
        place = self._data_parallel_place()
        if place["num_replicas"] > 1:
            # Lightning gives iterable data sets no distributed sampler: each rank takes its share here.
            stream = split_dataset_by_node(stream, rank=place["rank"], world_size=place["num_replicas"])
        return StepTokenDataLoader(
            stream,
            batch_size=self.batch_size,
            collate_fn=Collator(self.tokenizer.pad_token_id),
            pin_memory=self._pins(),
            accumulate_grad_batches=accumulate,
            stream_ranks=place["num_replicas"],
        )

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A streamed batch tells its loader that it is the one now being trained (see ``mark_in_use``)."""
        index = batch.pop(BATCH_INDEX_KEY, None) if isinstance(batch, dict) else None
        if index is not None and self.trainer is not None:
            loader = self.trainer.train_dataloader
            if isinstance(loader, StepTokenDataLoader):
                loader.mark_in_use(index)
        return batch

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.streaming:
            return []
        splits = self._tokenized()
        if "val" not in splits or len(splits["val"]) == 0:
            return []  # no validation data: Lightning skips validation
        kind = kind_of_columns(splits["val"].column_names)
        return self._eval_loader(self._rows(splits["val"], "val"), self._collate(kind, with_prompts=True))

    @override
    def predict_dataloader(self) -> DataLoader:
        if self.predict_files:
            if self._predict is None:
                records = read_records(self.predict_files)
                format = resolve_format(self.format, records, for_predict=True)
                self._predict = [tokenize_prompt(r, format, self.tokenizer, self.max_seq_length) for r in records]
            return self._eval_loader(SampleDataset(self._predict))
        val = self._tokenized().get("val") if (self.dataset or self.train_files or self.sources) else None
        if val is None or len(val) == 0:
            raise GymUserError("There is nothing to predict: set data.predict_files (or have validation data).")
        if kind_of_columns(val.column_names) != "lm":
            raise GymUserError("The validation data holds preference pairs, not prompts: set data.predict_files.")
        rank_zero_info("No data.predict_files: predicting the prompts of the validation data.")
        return self._eval_loader(PromptView(val))

    def _eval_loader(self, dataset: Dataset, collate: Any = None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=collate or Collator(self.tokenizer.pad_token_id, with_prompts=True),
            num_workers=self.num_workers,
            pin_memory=self._pins(),
        )

    def _settings(self) -> Settings:
        # The seed changes the tokenized data only through val_split and the mix; otherwise (it orders the shuffle,
        # which happens at load time) it stays out of the fingerprint, so runs with other seeds share the cache.
        seed = self.seed if self.val_split > 0 or len(self.sources) > 1 else 0
        return Settings(self.max_seq_length, self.mask_prompt, self.packing, self.val_split, seed, self.num_proc)

    def _train_sources(self) -> list[DataSource]:
        if self.sources:
            return self.sources
        if self.train_files is None:
            raise GymUserError("There is no training data: set data.dataset (e.g. 'addition') or data.train_files.")
        return [DataSource(self.train_files, format=self.format, columns=self.columns)]

    def _tokenized(self) -> dict[str, datasets.Dataset]:
        """The tokenized splits, from the cache (built on first use; see ``gym_lightning.data.prepare``)."""
        if self._splits is None:
            sources = [] if self.dataset is not None else self._train_sources()
            val = source_fingerprint(self.val_files, "train", None) if self.val_files else None
            extra = {"bundled": self.dataset, "val": val, "format": self.format, "columns": self.columns}
            # Only when set (only preference data takes them; mix only away from its default): at their defaults,
            # the keys of other data stay the ones earlier versions gave, so their caches stay valid.
            if self.truncation_mode != "keep_start" or self.max_prompt_length is not None:
                extra["preference"] = {"truncation_mode": self.truncation_mode, "prompt": self.max_prompt_length}
            if self.mix != "interleave_over":
                extra["mix"] = self.mix
            key = fingerprint(sources, self.tokenizer, self._settings(), json.dumps(extra))
            self._cache_entry = self.cache_dir.expanduser().resolve() / key
            self._splits = build_or_load(self.cache_dir, key, self._build)
            packed = " packed" if self.packing else ""
            rank_zero_info(f"Training data: {len(self._splits['train'])}{packed} rows (int32, memory-mapped).")
        return self._splits

    def _tokenize(
        self, rows: datasets.Dataset, format: str, with_prompts: bool, label: str, cache_file: Path
    ) -> datasets.Dataset:
        if format in PREFERENCE_FORMATS:
            return tokenize_preference_dataset(
                rows, format, self.tokenizer, self._settings(), self._preference_settings(), label, str(cache_file)
            )
        return tokenize_dataset(rows, format, self.tokenizer, self._settings(), with_prompts, label, cache_file)

    def _build(self, staging: Path) -> dict[str, datasets.Dataset]:
        """Read, split, tokenize, mix and pack (runs once per cache entry)."""
        if self.dataset is not None:
            bundled = BUNDLED_DATASETS[self.dataset]()
            rows = records_to_dataset(bundled.train)
            train_parts = [self._tokenize(rows, bundled.format, False, self.dataset, staging / "train-0.arrow")]
            weights, val_parts = (
                [1.0],
                [] if self.val_files else [(records_to_dataset(bundled.val), bundled.format, f"{self.dataset}[val]")],
            )
            self._train_format = bundled.format
            self._raise_kind_problems({kind_of_format(bundled.format)})
        else:
            train_parts, weights, val_parts = self._build_sources(staging)
        if self.val_files:
            rows, label = load_records_dataset(DataSource(self.val_files, columns=self.columns), self.cache_dir)
            val_parts = [
                (rows, self._train_format or resolve_source_format(DataSource(self.val_files), rows, label), label)
            ]
        train = mix(train_parts, weights, self.seed, self.mix)
        if self.packing:
            train = pack_dataset(train, self.max_seq_length, staging)
        elif len(train_parts) > 1:  # the mix is an indices mapping over the parts: write it out in order
            train = train.flatten_indices(cache_file_name=str(staging / "train.arrow"))
        splits = {"train": train}
        val = [
            self._tokenize(rows, format, True, label, staging / f"val-{index}.arrow")
            for index, (rows, format, label) in enumerate(val_parts)
        ]
        if val:
            splits["val"] = datasets.concatenate_datasets(val) if len(val) > 1 else val[0]
        return splits

    def _build_sources(
        self, staging: Path
    ) -> tuple[list[datasets.Dataset], list[float], list[tuple[datasets.Dataset, str, str]]]:
        train_parts, weights, val_parts = [], [], []
        loaded = [load_records_dataset(source, self.cache_dir) for source in self._train_sources()]
        formats = [resolve_source_format(s, *rows) for s, rows in zip(self._train_sources(), loaded, strict=True)]
        self._raise_kind_problems({kind_of_format(format) for format in formats})
        for index, (source, (rows, label), format) in enumerate(
            zip(self._train_sources(), loaded, formats, strict=True)
        ):
            self._train_format = self._train_format or format
            if self.val_split > 0 and not self.val_files:
                train_index, val_index = split_indices(len(rows), self.val_split, self.seed)
                val_parts.append((rows.select(val_index), format, f"{label} [val_split]"))
                rows = rows.select(train_index)
            train_parts.append(self._tokenize(rows, format, False, label, staging / f"train-{index}.arrow"))
            weights.append(source.weight)
        return train_parts, weights, val_parts


def _config_problems(args: dict) -> list[str]:
    """Every problem of the constructor arguments, so one error can list them all."""
    problems = []
    chosen = [name for name in ("dataset", "train_files", "sources") if args[name]]
    if args["dataset"] is not None and args["dataset"] not in BUNDLED_DATASETS:
        valid = ", ".join(sorted(BUNDLED_DATASETS))
        problems.append(f"dataset={args['dataset']!r} is not a bundled data set; choose one of: {valid}.")
    if len(chosen) > 1:
        problems.append(f"set one of dataset (a bundled data set), train_files or sources, not {' and '.join(chosen)}.")
    if not chosen and not args["predict_files"]:
        problems.append("no data: set dataset (e.g. 'addition') or train_files (or predict_files to only predict).")
    if not 0.0 <= args["val_split"] < 1.0:
        problems.append(f"val_split={args['val_split']} must be in [0, 1) (the fraction of training records held out).")
    elif args["val_split"] > 0 and (args["val_files"] or args["dataset"] is not None):
        problems.append("val_split only applies to train_files without val_files; set it to 0.")
    if args["format"] not in FORMATS:
        problems.append(f"format={args['format']!r} is unknown; valid formats are: {', '.join(FORMATS)}.")
    problems += check_sources(args["sources"] or [])
    problems += settings_problems(args)
    if args["mix"] not in MIX_STRATEGIES:
        problems.append(f"mix={args['mix']!r} is unknown; choose one of {', '.join(MIX_STRATEGIES)}.")
    elif args["mix"] == "concat" and any(source.weight != 1.0 for source in args["sources"] or []):
        problems.append("mix=concat takes every record once: source weights apply to interleave mixes; drop them.")
    if args["streaming"]:
        clashes = [n for n in ("packing", "val_split", "val_files", "dataset", "num_workers") if args[n]]
        if clashes:
            problems.append(f"streaming: true does not work with {', '.join(clashes)}; unset them or stream off.")
    for name, low in (("max_seq_length", 2), ("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0)):
        value = args[name]
        if value is None and name == "eval_batch_size":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"{name}={value!r} must be an integer >= {low}.")
    return problems
