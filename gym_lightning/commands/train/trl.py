"""TRL's flags: ``ScriptArguments`` and ``DatasetMixtureConfig`` (the data), ``ModelConfig`` (the model, LoRA, 4 bits)
and the fields each trainer's config adds to ``TrainingArguments``: ``SFTConfig`` (stages sft and pt), ``DPOConfig``
and ``KTOConfig`` (the preference stages, placed and refused until they land).

A field's meaning depends on the config, as in TRL: ``loss_type`` is ``nll``/``dft`` in ``SFTConfig`` and
``sigmoid``, ``ipo``, ... in ``DPOConfig``; the stage (``stages.STAGES``) says which table reads the flags. The fields
only the preference configs have are flags (``PreferenceArguments``) so that a line that sets them is refused with
its reason rather than an unknown flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_lightning.commands.train.rows import Row, accepted, mapped, merged, preference, refused
from gym_lightning.quant.config import COMPUTE_DTYPES, QUANT_STORAGES, QUANT_TYPES

# transformers' BitsAndBytesConfig takes a compute dtype as any torch attribute name: these are torch's other names.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
_ONLY_NLL = (
    "SFTConfig's loss_type is nll here (chunked for large vocabularies; dft is not wired in); DPOConfig's loss types "
    "(sigmoid, ipo, hinge, ...) are --stage dpo's, which arrives with the preference stage"
)


@dataclass
class TrlModelArguments:
    """TRL's ``ModelConfig`` flags (LoRA and the 4-bit base), with the names PEFT's script and LLaMA-Factory use."""

    model_revision: str = field(default="main", metadata={"help": "Hub revision (TRL, LLaMA-Factory): main only."})
    use_lora: bool = field(
        default=False, metadata={"aliases": ["--use_peft", "--use_peft_lora"], "help": "Train LoRA adapters only."}
    )
    lora_r: int | None = field(default=None, metadata={"aliases": ["--lora_rank"], "help": "LoRA rank (default 8)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 16)."})
    lora_dropout: float | None = field(default=None, metadata={"help": "LoRA dropout (default 0)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "aliases": ["--lora_target"],
            "help": "Layers to adapt: q_proj v_proj (or LLaMA-Factory's q_proj,v_proj), all-linear (or all).",
        },
    )
    lora_target_parameters: list[str] | None = field(
        default=None,
        metadata={
            "help": "TRL: mixture-of-experts weights to adapt: all-experts (every routed and shared expert) or peft "
            "names such as experts.gate_up_proj experts.down_proj (a comma list too)."
        },
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"aliases": ["--additional_target"], "help": "TRL, LLaMA-Factory; refused."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "TRL: CAUSAL_LM only."})
    use_rslora: bool = field(default=False, metadata={"help": "Refused: pass --lora_alpha alpha x sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "Refused."})
    load_in_4bit: bool = field(
        default=False,
        metadata={"aliases": ["--use_4bit_quantization"], "help": "Hold the frozen base in 4 bits (QLoRA)."},
    )
    load_in_8bit: bool = field(
        default=False,
        metadata={"aliases": ["--use_8bit_quantization"], "help": "Refused: 4 bits only (--load_in_4bit)."},
    )
    bnb_4bit_quant_type: str | None = field(
        default=None,
        metadata={"aliases": ["--quantization_type"], "choices": list(QUANT_TYPES), "help": "4-bit code book (nf4)."},
    )
    bnb_4bit_compute_dtype: str | None = field(
        default=None,
        metadata={
            "choices": [*COMPUTE_DTYPES, *DTYPE_ALIASES],
            "help": "Dequantise to (default: --dtype, else bfloat16).",
        },
    )
    bnb_4bit_use_double_quant: bool = field(
        default=False,
        metadata={
            "aliases": ["--use_bnb_nested_quant", "--use_nested_quant"],
            "help": "Quantise the scales too (4.14 bits a weight).",
        },
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None,
        metadata={
            "aliases": ["--bnb_4bit_quant_storage_dtype"],
            "choices": list(QUANT_STORAGES),
            "help": "Accepted; the codes stay uint8 (sharded per parameter).",
        },
    )


@dataclass
class TrlDataArguments:
    """TRL's data flags: ``ScriptArguments``' splits, ``DatasetMixtureConfig`` and ``SFTConfig``'s data fields."""

    dataset_train_split: str = field(default="train", metadata={"help": "Split of --dataset_name to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split of --dataset_name to validate on (read with evaluation on)."}
    )
    datasets: list[str] | None = field(default=None, metadata={"help": "TRL's mixture; refused (gym fit's sources)."})
    test_split_size: float | None = field(default=None, metadata={"help": "TRL: fraction held out for validation."})
    dataset_text_field: str = field(default="text", metadata={"help": "TRL: the text column (format text)."})
    truncation_mode: str = field(default="keep_start", metadata={"choices": ["keep_start", "keep_end"]})
    packing: bool | None = field(
        default=None, metadata={"help": "Pack training samples into full-length rows (default: the stage's)."}
    )
    packing_strategy: str = field(default="bfd", metadata={"choices": ["bfd", "bfd_split", "wrapped"]})
    padding_free: bool = field(default=False, metadata={"help": "TRL: with --packing (gym's packing is padding-free)."})
    eval_packing: bool | None = field(default=None, metadata={"help": "TRL; validation is never packed."})
    pad_to_multiple_of: str | None = field(default="auto", metadata={"help": "TRL: auto only."})
    completion_only_loss: bool | None = field(default=None, metadata={"help": "TRL: train on completions only."})
    assistant_only_loss: bool | None = field(default=None, metadata={"help": "TRL: train on assistant turns only."})
    shuffle_dataset: bool = field(default=False, metadata={"help": "TRL; accepted: every epoch is shuffled."})
    chat_template_path: str | None = field(default=None, metadata={"help": "TRL; refused (use --tokenizer_name)."})
    eos_token: str | None = field(
        default=None, metadata={"help": "TRL: a token of the vocabulary that ends turns and samples (e.g. <|im_end|>)."}
    )
    pad_token: str | None = field(default=None, metadata={"help": "TRL: a token of the vocabulary to pad with."})
    dataset_kwargs: str | None = field(default=None, metadata={"help": "TRL; refused."})
    loss_type: list[str] | None = field(
        default=None, metadata={"help": "TRL: the stage's loss (SFTConfig: nll; DPOConfig's arrive with dpo)."}
    )
    activation_offloading: bool = field(default=False, metadata={"help": "TRL; refused."})
    model_init_kwargs: str | None = field(default=None, metadata={"help": "TRL; refused."})
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "TRL; refused."})
    ignore_bias_buffers: bool = field(default=False, metadata={"help": "TRL; accepted, no effect (as in trl sft)."})


@dataclass
class PreferenceArguments:
    """The fields only TRL's ``DPOConfig``/``KTOConfig`` have: placed, refused until the preference stage lands."""

    beta: float | None = field(default=None, metadata={"help": "DPO/KTO: the KL weight (TRL: 0.1)."})
    label_smoothing: float | None = field(default=None, metadata={"help": "DPO: robust DPO's label noise."})
    loss_weights: list[float] | None = field(default=None, metadata={"help": "DPO: weights of several loss_type."})
    precompute_ref_log_probs: bool | None = field(default=None, metadata={"help": "DPO/KTO: one reference pass."})
    precompute_ref_batch_size: int | None = field(default=None, metadata={"help": "DPO/KTO: its batch size."})
    disable_dropout: bool | None = field(default=None, metadata={"help": "DPO/KTO: dropout off (TRL: True)."})
    use_weighting: bool | None = field(default=None, metadata={"help": "DPO: WPO's weighting."})
    ld_alpha: float | None = field(default=None, metadata={"help": "DPO: LD-DPO's verbose-token weight."})
    f_divergence_type: str | None = field(default=None, metadata={"help": "DPO: the f-divergence."})
    f_alpha_divergence_coef: float | None = field(default=None, metadata={"help": "DPO: its alpha."})
    discopop_tau: float | None = field(default=None, metadata={"help": "DPO: DiscoPOP's temperature."})
    sync_ref_model: bool | None = field(default=None, metadata={"help": "DPO/KTO: TR-DPO's reference updates."})
    ref_model_mixup_alpha: float | None = field(default=None, metadata={"help": "DPO/KTO: their mix."})
    ref_model_sync_steps: int | None = field(default=None, metadata={"help": "DPO/KTO: their interval."})
    desirable_weight: float | None = field(default=None, metadata={"help": "KTO: weight of desirable examples."})
    undesirable_weight: float | None = field(default=None, metadata={"help": "KTO: of undesirable ones."})


SCRIPT_ARGUMENTS: dict[str, Row] = {
    "dataset_name": mapped("data.train_files (a file, glob or folder: its train split) or data.sources (Hub)"),
    "dataset_config": mapped("the Hub data set's subset (data.sources[].subset)"),
    "dataset_train_split": mapped("the split trained on (a folder's train*.jsonl, a Hub split)"),
    "dataset_test_split": mapped("data.val_files (a folder's test split; read with evaluation on, as TRL)"),
    "dataset_streaming": mapped("data.streaming"),
    "ignore_bias_buffers": accepted("no effect, as in trl sft"),
    # DatasetMixtureConfig
    "datasets": refused("TRL's mixture is not read: pass one set with --dataset_name, or mix with gym fit's sources"),
    "streaming": mapped("data.streaming", flag="dataset_streaming"),
    "test_split_size": mapped("data.val_split (a fraction of the training records)"),
}
MODEL_CONFIG: dict[str, Row] = {
    "model_name_or_path": mapped("model.model"),
    "model_revision": refused(
        "gym_lightning loads a Hub model's main revision; download that one "
        "(huggingface-cli download NAME --revision R --local-dir DIR) and pass the folder",
        "main",
    ),
    "dtype": mapped("model.torch_dtype (and the 4-bit compute dtype unless given)", flag="torch_dtype"),
    "attn_implementation": mapped("model.attn_implementation"),
    "use_peft": mapped("model.lora (TRL's r 16/alpha 32/dropout 0.05 are not taken: gym's 8/16/0)", flag="use_lora"),
    "lora_r": mapped("model.lora.r"),
    "lora_alpha": mapped("model.lora.alpha"),
    "lora_dropout": mapped("model.lora.dropout"),
    "lora_target_modules": mapped("model.lora.target_modules (all-linear: every linear layer)"),
    "lora_target_parameters": mapped("model.lora.target_parameters (all-experts: every expert weight)"),
    "lora_modules_to_save": refused("gym_lightning trains the LoRA adapters only, no fully trained layer beside them"),
    "lora_task_type": refused("gym train trains causal LMs (CAUSAL_LM)", "CAUSAL_LM"),
    "use_rslora": refused("LoRA scales by alpha/r here; for rsLoRA's alpha/sqrt(r) pass --lora_alpha alpha x sqrt(r)"),
    "use_dora": refused("DoRA is not wired into gym_lightning's LoRA"),
    "load_in_8bit": refused("gym_lightning quantises the base to 4 bits only; use --load_in_4bit"),
    "load_in_4bit": mapped("model.quantization (bitsandbytes' NF4/FP4 codes, gym_lightning.quant)"),
    "bnb_4bit_quant_type": mapped("model.quantization.quant_type"),
    "use_bnb_nested_quant": mapped("model.quantization.double_quant", flag="bnb_4bit_use_double_quant"),
    "bnb_4bit_quant_storage": mapped("model.quantization.quant_storage (the codes stay uint8: one info line)"),
}
# SFTConfig's fields beyond TrainingArguments (stages sft and pt: TRL's plain-text SFT is SFTConfig too).
_SHARED: dict[str, Row] = {
    "model_init_kwargs": refused("use --torch_dtype, --attn_implementation and --trust_remote_code"),
    "trust_remote_code": mapped("model.trust_remote_code (and the tokenizer's)"),
    "router_aux_loss_coef": refused("no such setting here; set router_aux_loss_coef in the model's config.json"),
    "dataset_num_proc": mapped("data.num_proc"),
    "max_length": mapped("data.max_seq_length (default 1024, TRL's)", flag="max_seq_length"),
    "truncation_mode": refused("samples are cut at the end here (keep_start)", "keep_start"),
    "padding_free": mapped("with --packing: its rows are padding-free (alone it is refused: a batch is padded)"),
    "pad_to_multiple_of": refused("a batch is padded to its longest row here", "auto", None, "None", "none"),
    "activation_offloading": refused("activation offloading is not wired in; use --gradient_checkpointing"),
    "pad_token": mapped("model.special_tokens.pad_token"),
}
SFT_CONFIG: dict[str, Row] = _SHARED | {
    "chat_template_path": refused(
        "chats use the tokenizer's chat template: save a tokenizer folder with it (save_pretrained) and pass "
        "--tokenizer_name"
    ),
    "dataset_text_field": mapped("the text column: data.columns {text: FIELD} (and stage pt's text)"),
    "dataset_kwargs": refused("gym_lightning always tokenizes the data itself"),
    "eos_token": mapped("model.special_tokens.eos_token (ends turns and samples)"),
    "shuffle_dataset": accepted("every epoch is shuffled here"),
    "packing": mapped("data.packing: greedy rows of max_length, padding-free, restarting positions (stage pt: on)"),
    "packing_strategy": refused("gym_lightning packs greedily in order (--packing, TRL's bfd accepted as it)", "bfd"),
    "eval_packing": refused("validation data is never packed here", None, False),
    "completion_only_loss": mapped("data.mask_prompt (completions are the targets)"),
    "assistant_only_loss": mapped("data.mask_prompt (assistant turns are the targets)"),
    "loss_type": refused(_ONLY_NLL, "nll", "chunked_nll"),
}
# The fields of the preference configs that SFTConfig lacks (refused in every stage until those land).
PREFERENCE_FIELDS: dict[str, Row] = {
    "beta": preference("DPOConfig's/KTOConfig's beta"),
    "label_smoothing": preference("DPOConfig's label_smoothing"),
    "loss_weights": preference("DPOConfig's loss_weights"),
    "precompute_ref_log_probs": preference("DPOConfig's/KTOConfig's precompute_ref_log_probs"),
    "precompute_ref_batch_size": preference("DPOConfig's/KTOConfig's precompute_ref_batch_size"),
    "disable_dropout": preference("DPOConfig's/KTOConfig's disable_dropout"),
    "use_weighting": preference("DPOConfig's use_weighting"),
    "ld_alpha": preference("DPOConfig's ld_alpha"),
    "f_divergence_type": preference("DPOConfig's f_divergence_type"),
    "f_alpha_divergence_coef": preference("DPOConfig's f_alpha_divergence_coef"),
    "discopop_tau": preference("DPOConfig's discopop_tau"),
    "sync_ref_model": preference("DPOConfig's/KTOConfig's sync_ref_model"),
    "ref_model_mixup_alpha": preference("DPOConfig's/KTOConfig's ref_model_mixup_alpha"),
    "ref_model_sync_steps": preference("DPOConfig's/KTOConfig's ref_model_sync_steps"),
    "desirable_weight": preference("KTOConfig's desirable_weight"),
    "undesirable_weight": preference("KTOConfig's undesirable_weight"),
}
_DPO_ONLY = (
    *("disable_dropout", "precompute_ref_log_probs", "precompute_ref_batch_size", "loss_weights", "ld_alpha"),
    *("f_divergence_type", "f_alpha_divergence_coef", "label_smoothing", "beta", "use_weighting", "discopop_tau"),
    *("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"),
)
_KTO_ONLY = (
    *("disable_dropout", "precompute_ref_log_probs", "precompute_ref_batch_size", "beta", "desirable_weight"),
    *("undesirable_weight", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"),
)
DPO_CONFIG: dict[str, Row] = (
    _SHARED
    | {name: PREFERENCE_FIELDS[name] for name in _DPO_ONLY}
    | {"loss_type": preference("DPOConfig's loss_type (sigmoid, ipo, hinge, robust, sft, ...)")}
)
KTO_CONFIG: dict[str, Row] = (
    {name: row for name, row in _SHARED.items() if name not in ("truncation_mode", "padding_free", "pad_token")}
    | {name: PREFERENCE_FIELDS[name] for name in _KTO_ONLY}
    | {"loss_type": preference("KTOConfig's loss_type (kto)")}
)
# Every TRL table, for the checks that do not depend on the stage (model and data flags).
TRL_COMMON = merged(SCRIPT_ARGUMENTS, MODEL_CONFIG)
TRL_CONFIGS: dict[str, dict[str, Row]] = {"SFTConfig": SFT_CONFIG, "DPOConfig": DPO_CONFIG, "KTOConfig": KTO_CONFIG}
# TrainingArguments defaults each TRL config changes (gym train keeps HF's: pass these to get TRL's).
TRL_DEFAULTS = {"learning_rate": "2e-5 (SFT), 1e-6 (DPO, KTO)", "logging_steps": "10", "gradient_checkpointing": "True"}
TRL_DEFAULTS |= {"bf16": "True where supported"}

__all__ = [
    "DPO_CONFIG",
    "DTYPE_ALIASES",
    "KTO_CONFIG",
    "MODEL_CONFIG",
    "PREFERENCE_FIELDS",
    "SCRIPT_ARGUMENTS",
    "SFT_CONFIG",
    "TRL_COMMON",
    "TRL_CONFIGS",
    "TRL_DEFAULTS",
    "PreferenceArguments",
    "TrlDataArguments",
    "TrlModelArguments",
]
