"""The flags of PEFT's ``examples/sft/train.py``, the script HF's FSDP + QLoRA and DeepSpeed + QLoRA guides run: its
``ModelArguments`` and ``DataTrainingArguments`` (its training arguments are TRL's ``SFTConfig``).

Its defaults differ from gym train's where a flag is left out (LoRA r 64, alpha 16, dropout 0.1 and seven attention
and MLP targets; compute dtype float16): the guides' lines give them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_lightning.commands.train.rows import Row, accepted, mapped, refused

_TOKENS = "samples are tokenized with the tokenizer's own rule (eos appended) here"


@dataclass
class PeftScriptArguments:
    """The flags of PEFT's script that no other source has."""

    splits: str | None = field(default=None, metadata={"help": "PEFT's script: 'train,test' splits of the data."})
    chat_template_format: str = field(
        default="none", metadata={"help": "PEFT's script; accepted: the tokenizer's own template and tokens are used."}
    )
    add_special_tokens: bool = field(default=False, metadata={"help": "PEFT's script: False only (its default)."})
    append_concat_token: bool = field(default=False, metadata={"help": "PEFT's script: False only (its default)."})
    use_reentrant: bool = field(default=False, metadata={"help": "PEFT's script; accepted (non-reentrant here)."})
    use_flash_attn: bool = field(default=False, metadata={"help": "PEFT's script: attn_implementation fa2."})


PEFT_SCRIPT: dict[str, Row] = {
    "model_name_or_path": mapped("model.model"),
    "chat_template_format": accepted(
        "chats are rendered with the tokenizer's own chat template and vocabulary (the script sets chatml/zephyr, adds "
        "its tokens and resizes the embeddings); one info line says so"
    ),
    "lora_alpha": mapped("model.lora.alpha"),
    "lora_dropout": mapped("model.lora.dropout"),
    "lora_r": mapped("model.lora.r"),
    "lora_target_modules": mapped("model.lora.target_modules (a comma list)"),
    "use_nested_quant": mapped("model.quantization.double_quant", flag="bnb_4bit_use_double_quant"),
    "bnb_4bit_compute_dtype": mapped("model.quantization.compute_dtype"),
    "bnb_4bit_quant_storage_dtype": mapped("model.quantization.quant_storage", flag="bnb_4bit_quant_storage"),
    "bnb_4bit_quant_type": mapped("model.quantization.quant_type"),
    "use_flash_attn": mapped("model.attn_implementation flash_attention_2"),
    "use_peft_lora": mapped("model.lora", flag="use_lora"),
    "use_8bit_quantization": refused("gym_lightning quantises the base to 4 bits only; use --load_in_4bit"),
    "use_4bit_quantization": mapped("model.quantization", flag="load_in_4bit"),
    "use_reentrant": accepted("activation checkpointing is non-reentrant here"),
    "use_unsloth": refused("Unsloth is not used by gym_lightning"),
    "dataset_name": mapped("data.train_files or data.sources, as TRL's --dataset_name"),
    "append_concat_token": refused("packed samples keep their own eos and restart positions here", False),
    "add_special_tokens": refused(_TOKENS, False),
    "splits": mapped("--dataset_train_split and --dataset_test_split ('train,test')"),
}

__all__ = ["PEFT_SCRIPT", "PeftScriptArguments"]
