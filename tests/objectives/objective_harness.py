"""What the objective tests share: tiny model folders, the parts of a Trainer an objective reads, TRL's collated
batches in the contract's layout (``objectives.preference``), and a plain per-row log-probability reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gym_lightning import CausalLMModule
from gym_lightning.loss import IGNORE_INDEX
from gym_lightning.tokenizer import load_tokenizer

SHAPE = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64}
PAIRS = [  # prompt, chosen, rejected: completions of different lengths, so per-token and per-pair means differ
    ("1+1=", " 2", " 11 is the sum"),
    ("2+3=", " 5 of course", " 23"),
    ("7*6=", " 42", " 13 or 76"),
    ("9-4=", " 5", " 94 minus"),
]
UNPAIRED = [  # prompt, completion, desirable
    ("1+1=", " 2", True),
    ("2+3=", " 23 or so", False),
    ("7*6=", " 42", True),
    ("9-4=", " 13", False),
    ("3+3=", " 6 of them", True),
]


def save_folder(folder: Path, seed: int) -> Path:
    """A tiny Llama with HF's initialisation drawn from ``seed``, saved with the shipped tokenizer."""
    from gym_lightning.models.loading import build_causal_lm
    from gym_lightning.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    build_causal_lm("tiny-llama", config_overrides=SHAPE).save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    return folder


@dataclass
class FakeTrainer:
    """The Trainer attributes an objective reads, for one process (``strategy=None``: no strategy)."""

    world_size: int = 1
    global_step: int = 0
    log_every_n_steps: int = 1
    accumulate_grad_batches: int = 1
    strategy: Any = None
    precision_plugin: Any = None


@dataclass
class Harness:
    """``CausalLMModule``'s parts an objective uses, around a real module built without a Trainer; ``log`` records
    the last value of each name (and its keyword arguments)."""

    module: CausalLMModule
    trainer: FakeTrainer = field(default_factory=FakeTrainer)
    logged: dict[str, torch.Tensor] = field(default_factory=dict)
    log_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def log(self, name: str, value: torch.Tensor, **kwargs: Any) -> None:
        self.logged[name] = value.detach().clone()
        self.log_kwargs[name] = kwargs

    def values(self, *names: str) -> dict[str, float]:
        return {name: float(self.logged[name]) for name in names}


def harness(folder: Path | str, objective: Any, **module_args: Any) -> Harness:
    """A module on ``folder`` with ``objective``, its model built (``configure_model``) and set up for training."""
    module = CausalLMModule(str(folder), objective=objective, **module_args)
    module.configure_model()
    module.model.train()
    wrapped = Harness(module)
    objective.on_fit_start(wrapped)
    return wrapped


def _padded(rows: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for lab in labels])
    return {"input_ids": ids, "attention_mask": mask, "labels": target, "position_ids": (mask.cumsum(-1) - 1).clamp(0)}


def _tokenizer(folder: Path | str) -> Any:
    return load_tokenizer(None if folder == "tiny-llama" else str(folder))  # a preset: the shipped tokenizer


def tokenized_pairs(folder: Path | str) -> dict[str, torch.Tensor]:
    """``PAIRS`` in the contract's layout, tokenized by the folder's tokenizer (right padding, prompt masked)."""
    tokenizer = _tokenizer(folder)
    rows, labels = [], []
    for column in (1, 2):
        for pair in PAIRS:
            prompt, completion = tokenizer(pair[0])["input_ids"], tokenizer(pair[column])["input_ids"]
            rows.append(prompt + completion)
            labels.append([IGNORE_INDEX] * len(prompt) + completion)
    return _padded(rows, labels)


def tokenized_unpaired(folder: Path | str, examples: int = 4) -> dict[str, torch.Tensor]:
    """The first ``examples`` of ``UNPAIRED`` in the contract's layout: completion rows, then the KL rows
    (prompt ``i`` with another example's completion, ``i + 1 mod B`` here), and ``kto_labels``."""
    tokenizer = _tokenizer(folder)
    prompts = [tokenizer(p)["input_ids"] for p, _, _ in UNPAIRED[:examples]]
    completions = [tokenizer(c)["input_ids"] for _, c, _ in UNPAIRED[:examples]]
    shifted = completions[1:] + completions[:1]
    rows, labels = [], []
    for answers in (completions, shifted):
        for prompt, completion in zip(prompts, answers, strict=True):
            rows.append(prompt + completion)
            labels.append([IGNORE_INDEX] * len(prompt) + completion)
    return {**_padded(rows, labels), "kto_labels": torch.tensor([d for _, _, d in UNPAIRED[:examples]])}


def pairs_batch(trl: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's ``DataCollatorForPreference`` output (``input_ids``, ``attention_mask``, ``completion_mask``, chosen rows
    then rejected rows) in the contract's layout: the same rows, ``labels`` the completion tokens."""
    mask = trl["attention_mask"]
    return {
        "input_ids": trl["input_ids"],
        "attention_mask": mask,
        "labels": trl["input_ids"].masked_fill(trl["completion_mask"] == 0, IGNORE_INDEX),
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }


def concatenated_batch(trl: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPO's/ORPO's ``concatenated_inputs`` (chosen rows then rejected rows, labels prompt-masked) as the contract's."""
    mask = trl["concatenated_attention_mask"]
    return {
        "input_ids": trl["concatenated_input_ids"],
        "attention_mask": mask,
        "labels": trl["concatenated_labels"],
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }


def unpaired_batch(trl: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's ``DataCollatorForUnpairedPreference`` output: completion rows then ``KL_`` rows, padded to one width
    (without KL rows, as for ``apo_zero_unpaired``, the completion rows again: the loss does not read them)."""
    width = max(trl["input_ids"].size(1), trl.get("KL_input_ids", trl["input_ids"]).size(1))

    def padded(key: str, value: int) -> torch.Tensor:
        parts = [trl[key], trl.get(f"KL_{key}", trl[key])]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.size(1)), value=value) for p in parts])

    ids, mask, completion = padded("input_ids", 0), padded("attention_mask", 0), padded("completion_mask", 0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(completion == 0, IGNORE_INDEX),
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "kto_labels": trl["label"].bool(),
    }


def row_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the summed log-probabilities of the next-token targets and their count, from plain logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, :-1].float(), -1)
    targets = batch["labels"][:, 1:]
    picked = logps.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    keep = targets != IGNORE_INDEX
    return (picked * keep).sum(-1), keep.sum(-1)


def differences(trl_loss: float, trl_metrics: dict[str, float], ours: Harness, names: set[str]) -> dict[str, float]:
    """``|ours - TRL|`` of the loss and of each metric in ``names`` (all must be logged by ours and TRL)."""
    missing = sorted((names - set(trl_metrics)) | (names - set(ours.logged)))
    assert not missing, f"metrics missing: {missing}"
    found = {name: abs(float(ours.logged[name]) - trl_metrics[name]) for name in sorted(names)}
    return {"loss": abs(float(ours.logged["train/loss"]) - trl_loss), **found}
