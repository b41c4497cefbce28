"""``CausalLMDataModule``: records from a bundled data set or files, tokenized for causal-LM finetuning."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, RandomSampler
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from gym_lightning._compat import rank_zero_info
from gym_lightning.data.collate import Collator, pack_samples
from gym_lightning.data.formats import FORMATS, TokenizedSample, resolve_format, tokenize_prompt, tokenize_records
from gym_lightning.data.loader import StepTokenDataLoader
from gym_lightning.data.sources import Record, read_records
from gym_lightning.data.synthetic import BUNDLED_DATASETS
from gym_lightning.errors import GymUserError
from gym_lightning.tokenizer import load_tokenizer


class SampleDataset(Dataset):
    """A map-style data set over tokenized samples (a ``Dataset``, so Lightning can attach a distributed sampler)."""

    def __init__(self, samples: list[TokenizedSample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> TokenizedSample:
        return self.samples[index]


class EpochShuffleSampler(RandomSampler):
    """A new permutation every pass, fixed by ``(seed, epoch)``, so a resumed run sees the same order again.

    Lightning calls ``set_epoch`` at the start of every epoch (for any sampler that has it); without that, each pass
    takes the next epoch. It is a ``RandomSampler`` so that Lightning still replaces it by its ``DistributedSampler``
    (seeded the same way, by ``seed_everything``) on several ranks. ``RandomSampler`` with a generator would continue
    the generator's stream instead, which a resumed process cannot reproduce.

    Args:
        data_source: The data set.
        seed: Seed of the permutations.
    """

    def __init__(self, data_source: Dataset, seed: int) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class CausalLMDataModule(LightningDataModule):
    """Tokenized data for causal-LM finetuning: a bundled data set or JSONL/JSON/text files.

    Args:
        dataset: Name of a bundled data set (``"addition"``: 2-digit additions with a fixed validation split).
            Mutually exclusive with ``train_files``.
        train_files: Training files or glob patterns (``.jsonl``, ``.json`` list of objects, ``.txt`` paragraphs).
        val_files: Validation files or glob patterns. Replace the bundled data set's validation split if given.
        predict_files: Files with prompts for ``predict`` (records with ``prompt``, alpaca ``instruction``/``input``,
            chat ``messages`` or ``text``). Without them, ``predict`` uses the validation prompts.
        val_split: Fraction of the training records held out for validation (a seeded permutation) when there are
            no ``val_files``; in ``[0, 1)``. Only for ``train_files``.
        format: Record format: ``"auto"`` (detect from the fields), ``"text"``, ``"alpaca"``, ``"chat"`` or
            ``"prompt_completion"``. See ``gym_lightning.data.formats``.
        tokenizer: Local folder or Hugging Face Hub name of the tokenizer; ``None`` uses the shipped tokenizer. The
            CLI links it from the model.
        trust_remote_code: Allow tokenizer code from the Hub to run (only for sources you trust).
        max_seq_length: Maximum tokens per sample (longer samples are cut) and per packed row.
        mask_prompt: Train only on the completion (prompt labels are ``-100``); ``False`` trains on every token.
        packing: Concatenate training samples into rows of ``max_seq_length`` tokens (see
            ``gym_lightning.data.collate`` for what attention isolation that gives).
        batch_size: Training micro-batch size per device (samples, or packed rows with ``packing``).
        eval_batch_size: Validation/prediction batch size per device; ``None`` means ``batch_size``.
        num_workers: DataLoader worker processes (0 loads in the main process).
        seed: Seed of the training shuffle and of ``val_split``.
    """

    def __init__(
        self,
        dataset: str | None = None,
        train_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        predict_files: str | list[str] | None = None,
        val_split: float = 0.0,
        format: Literal["auto", "text", "alpaca", "chat", "prompt_completion"] = "auto",
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        max_seq_length: int = 512,
        mask_prompt: bool = True,
        packing: bool = False,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
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
        self.dataset = dataset
        self.train_files, self.val_files, self.predict_files = train_files, val_files, predict_files
        self.val_split, self.format, self.tokenizer_source = val_split, format, tokenizer
        self.trust_remote_code, self.max_seq_length, self.mask_prompt = trust_remote_code, max_seq_length, mask_prompt
        self.packing, self.batch_size, self.num_workers, self.seed = packing, batch_size, num_workers, seed
        self.eval_batch_size = eval_batch_size or batch_size
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._resolved_format: str | None = None
        self._records: tuple[list[Record], list[Record]] | None = None
        self._samples: dict[str, list[TokenizedSample]] = {}

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_source, self.trust_remote_code)
        return self._tokenizer

    @property
    def micro_batch_size(self) -> int:
        """The per-device training micro-batch (``ProvidesMicroBatchSize``: DeepSpeed's micro-batch)."""
        return self.batch_size

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return len(self.tokenizer)

    @override
    def setup(self, stage: str) -> None:
        # Tokenize each split once: Lightning calls setup for every fit/validate/predict (setdefault would evaluate,
        # i.e. re-tokenize, its argument every time and then discard it).
        if stage == "fit" and "train" not in self._samples:
            self._samples["train"] = self._tokenize_train()
        if stage in ("fit", "validate") and "val" not in self._samples:
            self._samples["val"] = self._tokenize_val()
        if stage == "predict" and "predict" not in self._samples:
            self._samples["predict"] = self._tokenize_predict()

    @override
    def train_dataloader(self) -> DataLoader:
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        dataset = SampleDataset(self._stage_samples("train", "fit"))
        return StepTokenDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(dataset, self.seed),
            collate_fn=Collator(self.tokenizer.pad_token_id),
            num_workers=self.num_workers,
            accumulate_grad_batches=accumulate,
        )

    @override
    def val_dataloader(self) -> DataLoader | list:
        samples = self._stage_samples("val", "validate")
        if not samples:
            return []  # no validation data: Lightning skips validation
        return self._eval_loader(samples)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self._stage_samples("predict", "predict"))

    def _eval_loader(self, samples: list[TokenizedSample]) -> DataLoader:
        return DataLoader(
            SampleDataset(samples),
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=Collator(self.tokenizer.pad_token_id, with_prompts=True),
            num_workers=self.num_workers,
        )

    def _stage_samples(self, split: str, stage: str) -> list[TokenizedSample]:
        if split not in self._samples:
            self.setup(stage)
        return self._samples[split]

    def _split_records(self) -> tuple[list[Record], list[Record]]:
        """Training and validation records (validation may be empty), read once."""
        if self._records is None:
            self._records = self._read_split()
        return self._records

    def _read_split(self) -> tuple[list[Record], list[Record]]:
        if self.dataset is not None:
            bundled = BUNDLED_DATASETS[self.dataset]()
            return bundled.train, read_records(self.val_files) if self.val_files else bundled.val
        if self.train_files is None:
            raise GymUserError("There is no training data: set data.dataset (e.g. 'addition') or data.train_files.")
        train = read_records(self.train_files)
        if self.val_files:
            return train, read_records(self.val_files)
        if self.val_split == 0:
            return train, []
        order = list(range(len(train)))
        random.Random(self.seed).shuffle(order)
        num_val = max(1, round(len(train) * self.val_split))
        if num_val >= len(train):
            raise GymUserError(f"val_split={self.val_split} leaves no training record out of {len(train)}; lower it.")
        return [train[i] for i in sorted(order[num_val:])], [train[i] for i in sorted(order[:num_val])]

    def _train_format(self) -> str:
        """The training records' format (``"auto"`` resolved once, from the first training record)."""
        if self._resolved_format is None:
            self._resolved_format = resolve_format(self.format, self._split_records()[0])
        return self._resolved_format

    def _tokenize(self, records: list[Record]) -> list[TokenizedSample]:
        return tokenize_records(records, self._train_format(), self.tokenizer, self.max_seq_length, self.mask_prompt)

    def _tokenize_train(self) -> list[TokenizedSample]:
        samples = self._tokenize(self._split_records()[0])
        rows = pack_samples(samples, self.max_seq_length) if self.packing else samples
        packed = f" packed into {len(rows)} rows of up to {self.max_seq_length} tokens" if self.packing else ""
        rank_zero_info(f"Training data: {len(samples)} samples{packed}.")
        return rows

    def _tokenize_val(self) -> list[TokenizedSample]:
        records = self._split_records()[1]
        return self._tokenize(records) if records else []

    def _tokenize_predict(self) -> list[TokenizedSample]:
        if self.predict_files:
            records = read_records(self.predict_files)
            format = resolve_format(self.format, records, for_predict=True)
        else:
            records = self._split_records()[1]
            if not records:
                raise GymUserError("There is nothing to predict: set data.predict_files (or have validation data).")
            rank_zero_info("No data.predict_files: predicting the prompts of the validation data.")
            format = self._train_format()
        return [tokenize_prompt(r, format, self.tokenizer, self.max_seq_length) for r in records]


def _config_problems(args: dict) -> list[str]:
    """Every problem of the constructor arguments, so one error can list them all."""
    problems = []
    if args["dataset"] is not None and args["dataset"] not in BUNDLED_DATASETS:
        valid = ", ".join(sorted(BUNDLED_DATASETS))
        problems.append(f"dataset={args['dataset']!r} is not a bundled data set; choose one of: {valid}.")
    if args["dataset"] is not None and args["train_files"]:
        problems.append("set either dataset (a bundled data set) or train_files, not both.")
    if args["dataset"] is None and not args["train_files"] and not args["predict_files"]:
        problems.append("no data: set dataset (e.g. 'addition') or train_files (or predict_files to only predict).")
    if not 0.0 <= args["val_split"] < 1.0:
        problems.append(f"val_split={args['val_split']} must be in [0, 1) (the fraction of training records held out).")
    elif args["val_split"] > 0 and (args["val_files"] or args["dataset"] is not None):
        problems.append("val_split only applies to train_files without val_files; set it to 0.")
    if args["format"] not in FORMATS:
        problems.append(f"format={args['format']!r} is unknown; valid formats are: {', '.join(FORMATS)}.")
    for name, low in (("max_seq_length", 2), ("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0)):
        value = args[name]
        if value is None and name == "eval_batch_size":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"{name}={value!r} must be an integer >= {low}.")
    return problems
