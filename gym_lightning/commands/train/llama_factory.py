"""LLaMA-Factory's keys that are ``gym train`` flags (``llamafactory-cli train x.yaml`` becomes ``gym train x.yaml``),
its templates and its mix of several data sets; ``llama_factory_table`` says how every key of its hparams is read.

Its ``template`` renders the data in LLaMA-Factory; here chats are rendered with the tokenizer's own chat template,
so a template whose turn markers that chat template lacks is refused (``TEMPLATE_MARKERS``). Its ``mix_strategy``
(``concat`` by default) and ``interleave_probs`` become ``data.mix`` and the sources' weights.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from gym_lightning.errors import GymUserError

# LLaMA-Factory's flash_attn -> transformers' attn_implementation ("auto": the model's default).
FLASH_ATTN = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}
# LLaMA-Factory templates -> a turn marker of the same chat format in a tokenizer's chat template (its format_user).
TEMPLATE_MARKERS = {
    **dict.fromkeys(
        ("chatml", "qwen", "qwen2_vl", "qwen3", "qwen3_nothink", "qwen3_5", "smollm", "yi"), "<|im_start|>"
    ),
    **dict.fromkeys(("mistral", "ministral3", "llama2"), "[INST]"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3"), "<start_of_turn>"),
    **dict.fromkeys(("phi", "glm4", "olmo"), "<|user|>"),
    "llama3": "<|start_header_id|>",
    "llama4": "<|header_start|>",
    "phi4": "<|im_sep|>",
    "deepseek3": "<｜User｜>",
    "gpt_oss": "<|start|>",
}
# LLaMA-Factory's own prompt formats, which no model's chat template is.
PROMPT_TEMPLATES = ("default", "empty", "alpaca", "vicuna")


@dataclass
class LlamaFactoryArguments:
    """LLaMA-Factory's keys that are flags here (its other keys are read from its YAML files only)."""

    finetuning_type: str | None = field(
        default=None,
        metadata={
            "help": "LLaMA-Factory: lora (--use_lora with its LoRA defaults: all-linear, alpha 2 x rank) or full."
        },
    )
    flash_attn: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "disabled", "sdpa", "fa2", "fa3"],
            "help": "LLaMA-Factory: disabled, sdpa, fa2 are --attn_implementation eager, sdpa, flash_attention_2.",
        },
    )
    quantization_bit: int | None = field(default=None, metadata={"help": "LLaMA-Factory: 4 is --load_in_4bit."})
    quantization_method: str = field(default="bnb", metadata={"help": "LLaMA-Factory: bnb (bitsandbytes) only."})
    double_quantization: bool = field(default=True, metadata={"help": "LLaMA-Factory's, with quantization_bit 4."})
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A bundled data set (addition, addition_preference), or LLaMA-Factory's dataset: a comma list of "
            "data files/folders or of names in <dataset_dir>/dataset_info.json."
        },
    )
    dataset_dir: str = field(default="data", metadata={"help": "LLaMA-Factory: the folder of dataset_info.json."})
    eval_dataset: str | None = field(default=None, metadata={"help": "LLaMA-Factory: validation files/names."})
    val_size: float = field(default=0.0, metadata={"help": "LLaMA-Factory: fraction held out for validation."})
    neat_packing: bool = field(default=False, metadata={"help": "LLaMA-Factory: --packing (no cross-attention)."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens."})
    preprocessing_batch_size: int = field(default=1000, metadata={"help": "LLaMA-Factory; accepted, no effect."})
    template: str | None = field(
        default=None, metadata={"help": "LLaMA-Factory: must be the tokenizer's own chat template."}
    )
    mix_strategy: str = field(
        default="concat", metadata={"help": "LLaMA-Factory: concat, interleave_under, interleave_over (data.mix)."}
    )
    interleave_probs: str | None = field(
        default=None, metadata={"help": "LLaMA-Factory: one probability per data set of an interleave mix."}
    )
    pref_loss: str | None = field(
        default=None,
        metadata={
            "choices": ["sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"],
            "help": "LLaMA-Factory's stage dpo loss: sigmoid, hinge, ipo (DPO's loss_type), orpo, simpo (stages orpo, "
            "simpo); kto_pair refused.",
        },
    )
    pref_ftx: float | None = field(
        default=None, metadata={"help": "LLaMA-Factory: the chosen completions' NLL weight (stages dpo, simpo)."}
    )
    dpo_label_smoothing: float | None = field(
        default=None, metadata={"help": "LLaMA-Factory: the sigmoid loss's label smoothing (cDPO), in [0, 0.5)."}
    )
    mask_history: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    tool_format: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    default_system: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    enable_thinking: bool = field(default=True, metadata={"help": "LLaMA-Factory; True only."})
    tokenized_path: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    buffer_size: int = field(default=16384, metadata={"help": "LLaMA-Factory; refused."})
    ignore_pad_token_for_loss: bool = field(default=True, metadata={"help": "LLaMA-Factory; True only."})
    media_dir: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    plot_loss: bool = field(default=False, metadata={"help": "LLaMA-Factory; accepted: curves.png is always written."})
    disable_gradient_checkpointing: bool = field(
        default=False, metadata={"help": "LLaMA-Factory (which checkpoints by default, as gym train does with it)."}
    )
    enable_liger_kernel: bool = field(default=False, metadata={"help": "LLaMA-Factory: --use_liger_kernel."})
    use_unsloth: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    rope_scaling: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    resize_vocab: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    upcast_layernorm: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    pure_bf16: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    loraplus_lr_ratio: float | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    pissa_init: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    create_new_adapter: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    adapter_name_or_path: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    use_galore: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    use_apollo: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    use_badam: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    use_llama_pro: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    use_adam_mini: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused (--optim)."})
    use_muon: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused (--optim)."})
    use_dft_loss: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    compute_accuracy: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    quantization_device_map: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    print_param_status: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})


def mix_problems(args: argparse.Namespace, sources: int) -> list[str]:
    """``interleave_probs`` that cannot weigh ``sources`` data sets (``mix_strategy``'s value is a flag problem)."""
    if args.interleave_probs is None:
        return []
    if args.mix_strategy == "concat":
        return ["--interleave_probs weighs an interleave mix: give --mix_strategy interleave_under/over, or drop it."]
    try:
        weights = interleave_weights(args.interleave_probs)
    except ValueError:
        return [f"--interleave_probs {args.interleave_probs!r}: give one number per data set, e.g. 0.7,0.3."]
    if len(weights) != sources or not all(weight > 0 for weight in weights):
        return [f"--interleave_probs gives {len(weights)} positive weights for {sources} data sets; give one each."]
    return []


def interleave_weights(probs: str | list[float]) -> list[float]:
    """LLaMA-Factory's ``interleave_probs`` (a comma list, or a YAML list) as numbers."""
    parts = probs if isinstance(probs, list) else [part for part in str(probs).split(",") if part.strip()]
    return [float(part) for part in parts]


def template_problem(args: argparse.Namespace) -> str | None:
    """LLaMA-Factory's ``template`` refused where it is not the tokenizer's own chat template (a turn marker of
    its format missing from the tokenizer's chat template); ``None`` where it is, or where that cannot be told."""
    name = args.template
    if name is None:
        return None
    if name in PROMPT_TEMPLATES:
        return (
            f"--template {name}: LLaMA-Factory's own prompt format; gym_lightning renders chats with the "
            "tokenizer's chat template (alpaca records with its alpaca prompt): drop template."
        )
    marker = TEMPLATE_MARKERS.get(name)
    chat_template = _tokenizer_chat_template(args) if marker else None
    if marker is None or chat_template is None or marker in chat_template:
        return None
    has = f"another chat template (without {marker})" if chat_template else "no chat template"
    return (
        f"--template {name}: the tokenizer has {has}, and gym_lightning renders chats with the tokenizer's own "
        f"template; use a tokenizer with the {name} template (--tokenizer_name) or drop template."
    )


def _tokenizer_chat_template(args: argparse.Namespace) -> str | None:
    """The chat template of the run's tokenizer (``""`` for none); ``None`` where it cannot be loaded here."""
    from gym_lightning.models.presets import resolve_tokenizer_source
    from gym_lightning.tokenizer import load_tokenizer

    try:
        source = resolve_tokenizer_source(args.model_name_or_path, args.tokenizer_name)
        tokenizer = load_tokenizer(source, args.trust_remote_code)
    except GymUserError:  # offline, or a typo that the run reports in its own words
        return None
    return tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""


def template_note(args: argparse.Namespace) -> list[str]:
    """The info line of a ``template`` that is taken."""
    if args.template is None:
        return []
    return [
        f"--template {args.template}: chats are rendered with the tokenizer's own chat template, and alpaca or "
        "prompt/completion records with gym_lightning's prompts (LLaMA-Factory renders those with the template)."
    ]


__all__ = [
    "FLASH_ATTN",
    "PROMPT_TEMPLATES",
    "TEMPLATE_MARKERS",
    "LlamaFactoryArguments",
    "interleave_weights",
    "mix_problems",
    "template_note",
    "template_problem",
]
