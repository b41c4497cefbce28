"""The ``model.*`` settings of the flags: the model, optimizer and schedule (built as the HF Trainer builds them),
LoRA and the 4-bit base (TRL's ``ModelConfig``, PEFT's script, LLaMA-Factory's ``finetuning_type``), the fast path
(``--torch_compile``, Liger) and the stage's objective (``stages.objective_value``).

Defaults are ``TrainingArguments``' (TRL's configs change some: learning rate, logging steps, gradient checkpointing,
bf16; pass them) and gym_lightning's LoRA's (r 8, alpha 16, dropout 0, peft's targets). With LLaMA-Factory's
``finetuning_type: lora``, its own: every linear layer (``lora_target: all``), alpha twice the rank, gradient
checkpointing on (``disable_gradient_checkpointing``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gym_lightning.commands.train.llama_factory import FLASH_ATTN
from gym_lightning.commands.train.stages import objective_value
from gym_lightning.commands.train.trl import DTYPE_ALIASES
from gym_lightning.errors import GymUserError

# HF's liger_kernel_config keys -> models.fused.FusedOps fields (cross_entropy without the head: not offered, the
# fused linear cross-entropy is what saves the logits' memory).
LIGER_CONFIG_KEYS = {
    "rope": "rope",
    "swiglu": "swiglu",
    "rms_norm": "rms_norm",
    "fused_linear_cross_entropy": "linear_cross_entropy",
}


def lora_on(args: argparse.Namespace) -> bool:
    return bool(args.use_lora) or args.finetuning_type == "lora"


def four_bit(args: argparse.Namespace) -> bool:
    return bool(args.load_in_4bit) or args.quantization_bit == 4


def model_values(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``model.*`` setting of the flags (and ``export.output_dir``)."""
    warmup = args.warmup_steps
    ratio = warmup if 0 < warmup < 1 else args.warmup_ratio  # HF 5: warmup_steps < 1 is a ratio
    values: dict[str, Any] = {
        "model.model": args.model_name_or_path,
        "model.tokenizer": args.tokenizer_name,
        "model.torch_dtype": args.torch_dtype,
        "model.attn_implementation": args.attn_implementation
        or FLASH_ATTN.get(args.flash_attn)
        or ("flash_attention_2" if args.use_flash_attn else None),
        "model.trust_remote_code": args.trust_remote_code,
        # TRL's --eos_token/--pad_token: the tokenizer's own replaced (data, generation and export alike).
        "model.special_tokens": {
            name: token for name in ("eos_token", "pad_token") if (token := getattr(args, name)) is not None
        }
        or None,
        # LLaMA-Factory checkpoints gradients unless told not to; HF and TRL flags say it themselves.
        "model.gradient_checkpointing": bool(args.gradient_checkpointing)
        or (args.finetuning_type is not None and not args.disable_gradient_checkpointing),
        "model.lr": args.learning_rate,
        "model.weight_decay": args.weight_decay,
        "model.betas": [args.adam_beta1, args.adam_beta2],
        "model.eps": args.adam_epsilon,
        "model.optim": str(args.optim),
        "model.decay_rule": "hf",  # no decay on biases and LayerNorm/norm weights, HF's get_decay_parameter_names
        "model.hf_scheduler": str(args.lr_scheduler_type),  # HF's "constant" ignores the warm-up itself
        "model.scheduler_kwargs": json_dict(args.lr_scheduler_kwargs, "--lr_scheduler_kwargs"),
        "model.warmup_steps": 0 if warmup < 1 else int(warmup),
        "model.warmup_ratio": ratio,
        "export.output_dir": str(Path(args.output_dir or "trainer_output") / "hf"),
    }
    values |= fast_path_values(args)
    if lora_on(args):
        values["model.lora"] = _lora_values(args)
    if four_bit(args):
        values["model.quantization"] = _quantization_values(args)
    if (objective := objective_value(args)) is not None:
        values["model.objective"] = objective
    return values


def fast_path_values(args: argparse.Namespace) -> dict[str, Any]:
    """``model.compile`` and ``model.fused_ops`` of HF's --torch_compile* flags (a backend or mode turns compile on,
    as in transformers) and --use_liger_kernel / --liger_kernel_config (LLaMA-Factory's --enable_liger_kernel)."""
    values: dict[str, Any] = {}
    settings = {"backend": args.torch_compile_backend, "mode": args.torch_compile_mode}
    if args.torch_compile or any(value is not None for value in settings.values()):
        chosen = {key: value for key, value in settings.items() if value is not None}
        values["model.compile"] = chosen or True
    config = json_dict(args.liger_kernel_config, "--liger_kernel_config") or {}
    if not (args.use_liger_kernel or args.enable_liger_kernel or config):
        return values
    if unknown := sorted(set(config) - set(LIGER_CONFIG_KEYS) - {"cross_entropy"}):
        raise GymUserError(f"--liger_kernel_config keys {unknown} are not known; use {sorted(LIGER_CONFIG_KEYS)}")
    fused = {LIGER_CONFIG_KEYS[key]: bool(value) for key, value in config.items() if key in LIGER_CONFIG_KEYS}
    values["model.fused_ops"] = {"kernels": "liger", **fused}
    return values


def _lora_values(args: argparse.Namespace) -> dict[str, Any]:
    """``model.lora``: the flags given; with LLaMA-Factory's ``finetuning_type: lora`` its defaults for the others
    (every linear layer, alpha twice the rank), else ``LoRAArgs``' own."""
    llama_factory = args.finetuning_type == "lora"
    targets = lora_targets(args.lora_target_modules) or (["all-linear"] if llama_factory else None)
    alpha = args.lora_alpha
    if alpha is None and llama_factory:
        alpha = 2 * (args.lora_r or 8)
    parameters = lora_targets(args.lora_target_parameters, shorthand=False)
    lora = {
        "r": args.lora_r,
        "alpha": alpha,
        "dropout": args.lora_dropout,
        "target_modules": targets,
        "target_parameters": parameters,
    }
    return {key: value for key, value in lora.items() if value is not None}


def lora_targets(value: str | list[str] | None, shorthand: bool = True) -> list[str] | None:
    """LoRA target names from TRL/HF (a list, ``all-linear``) or LLaMA-Factory (a comma list, ``all``); with
    ``shorthand`` off (parameter targets) the names stay as given."""
    names = [part.strip() for item in ([value] if isinstance(value, str) else value or []) for part in item.split(",")]
    if not shorthand:
        return [name for name in names if name] or None
    names = ["all-linear" if name == "all" else name for name in names if name]
    return ["all-linear"] if "all-linear" in names else names or None


def _quantization_values(args: argparse.Namespace) -> dict[str, Any]:
    """``model.quantization`` of the HF/TRL 4-bit flags (or LLaMA-Factory's ``quantization_bit: 4``)."""
    # TRL computes in --dtype (its get_quantization_config); transformers' own default, fp32, is not taken: bf16 is
    # QLoRA's and gym_lightning's default.
    compute = args.bnb_4bit_compute_dtype or (args.torch_dtype if args.torch_dtype != "auto" else None)
    # transformers' BitsAndBytesConfig defaults to no double quantisation (the HF/TRL flag turns it on);
    # LLaMA-Factory's double_quantization to on.
    double_quant = args.bnb_4bit_use_double_quant if args.load_in_4bit else args.double_quantization
    quantization = {
        "quant_type": args.bnb_4bit_quant_type,
        "compute_dtype": DTYPE_ALIASES.get(compute, compute),
        "double_quant": double_quant,
        "quant_storage": args.bnb_4bit_quant_storage,
    }
    return {key: value for key, value in quantization.items() if value is not None}


def json_dict(kwargs: dict[str, Any] | str | None, flag: str) -> dict[str, Any] | None:
    """A dict flag of HF's (``--lr_scheduler_kwargs``, ``liger_kernel_config``): a dict (from a YAML/JSON file) or
    its JSON text (from the command line)."""
    if isinstance(kwargs, str):
        try:
            return json.loads(kwargs)
        except json.JSONDecodeError as err:
            raise GymUserError(f"{flag} {kwargs!r} is not JSON: {err}") from err
    return kwargs


__all__ = ["LIGER_CONFIG_KEYS", "fast_path_values", "four_bit", "json_dict", "lora_on", "lora_targets", "model_values"]
