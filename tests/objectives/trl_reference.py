"""TRL 1.16's trainers as the reference definition of the preference objectives: each built once on a tiny folder,
then asked for the loss and metrics of one collated batch under the settings of a test case (the trainers read their
settings from attributes at every ``compute_loss``). TRL is a test-only dependency: import this module after
``pytest.importorskip("trl")``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

# fp32 (TRL turns bf16 autocast on by default, on a CPU too), one step, nothing saved or reported.
OUTPUT = {"report_to": "none", "use_cpu": True, "bf16": False, "save_strategy": "no", "max_steps": 1}


def _metrics(trainer: Any) -> dict[str, float]:
    """The metrics the trainer's last ``compute_loss`` appended (TRL averages them at each log)."""
    found = {key: values[-1] for key, values in trainer._metrics["train"].items() if values}
    trainer._metrics["train"].clear()
    return found


def dpo_trainer(policy: Path, reference: Path, pairs: list[tuple[str, str, str]], out: Path) -> Any:
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs])
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=len(pairs), **OUTPUT)
    ref = AutoModelForCausalLM.from_pretrained(reference)
    return DPOTrainer(model=str(policy), ref_model=ref, args=args, train_dataset=data)


def dpo_step(trainer: Any, settings: dict[str, Any]) -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
    """TRL's collated batch, its loss and its metrics under ``settings`` (``DPOConfig`` field names)."""
    args = {"loss_type": ["sigmoid"], "loss_weights": None, "label_smoothing": 0.0, "beta": 0.1,
            "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 0.5, **settings}  # fmt: skip
    loss_types = [args["loss_type"]] if isinstance(args["loss_type"], str) else list(args["loss_type"])
    trainer.loss_types = loss_types
    trainer.loss_weights = args["loss_weights"] or [1.0] * len(loss_types)
    trainer.label_smoothing, trainer.beta = args["label_smoothing"], args["beta"]
    trainer.f_divergence_type = args["f_divergence_type"]
    trainer.f_alpha_divergence_coef = args["f_alpha_divergence_coef"]
    trainer.args.discopop_tau = args.get("discopop_tau", 0.05)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return batch, float(loss), _metrics(trainer)


def cpo_trainer(policy: Path, pairs: list[tuple[str, str, str]], out: Path, orpo: bool = False) -> Any:
    """``CPOTrainer`` (SimPO: ``loss_type="simpo"``) or ``ORPOTrainer``."""
    if orpo:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer

    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs])
    args = Config(output_dir=str(out), per_device_train_batch_size=len(pairs), remove_unused_columns=False, **OUTPUT)
    return Trainer(model=str(policy), args=args, train_dataset=data)


def cpo_step(trainer: Any, settings: dict[str, Any]) -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
    """CPO's/ORPO's concatenated batch, loss and metrics under ``settings`` (``CPOConfig``/``ORPOConfig`` names)."""
    for name, value in settings.items():
        setattr(trainer, name, value)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    pad = trainer.processing_class.pad_token_id
    concatenated = trainer.concatenated_inputs(batch, padding_value=pad)
    trainer.model.train()
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    return concatenated, float(loss), metrics


def kto_trainer(
    policy: Path, reference: Path, examples: list[tuple[str, str, bool]], out: Path, loss_type: str = "kto"
) -> Any:
    from trl import KTOConfig, KTOTrainer

    data = Dataset.from_list([{"prompt": p, "completion": c, "label": d} for p, c, d in examples])
    args = KTOConfig(output_dir=str(out), per_device_train_batch_size=len(examples), loss_type=loss_type, **OUTPUT)
    ref = AutoModelForCausalLM.from_pretrained(reference)
    return KTOTrainer(model=str(policy), ref_model=ref, args=args, train_dataset=data)


def kto_step(trainer: Any, settings: dict[str, Any]) -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
    """KTO's collated batch (completion and KL rows), loss and metrics under ``settings`` (``KTOConfig`` names)."""
    for name, value in settings.items():
        setattr(trainer, name, value)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return batch, float(loss), _metrics(trainer)
