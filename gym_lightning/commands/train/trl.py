"""TRL's flags: ``ScriptArguments`` and ``DatasetMixtureConfig`` (the data), ``ModelConfig`` (the model, LoRA, 4 bits)
and the fields each trainer's config adds to ``TrainingArguments``: ``SFTConfig`` (stages sft and pt), ``DPOConfig``
(dpo), ``KTOConfig`` (kto), ``trl.experimental``'s ``ORPOConfig`` (orpo) and ``CPOConfig`` (simpo, its loss_type
simpo).

A field's meaning depends on the config, as in TRL: ``loss_type`` is ``nll``/``dft`` in ``SFTConfig``, ``sigmoid``,
``ipo``, ... in ``DPOConfig``, ``kto`` in ``KTOConfig``; the stage (``stages.STAGES``) says which table reads the
flags, and a field of another stage's config is refused unless at TRL's default (``FIELD_DEFAULTS``). The fields only
the preference configs have are flags (``PreferenceArguments``), with LLaMA-Factory's names of the same settings as
aliases (``pref_beta`` is ``--beta``); ``preference`` turns them into the objective's settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gym_lightning.commands.train.rows import Row, accepted, mapped, merged, refused
from gym_lightning.quant.config import COMPUTE_DTYPES, QUANT_STORAGES, QUANT_TYPES

# transformers' BitsAndBytesConfig takes a compute dtype as any torch attribute name: these are torch's other names.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
_ONLY_NLL = (
    "SFTConfig's loss_type is nll here (chunked for large vocabularies; dft is not wired in); DPOConfig's loss types "
    "(sigmoid, ipo, hinge, ...) are --stage dpo's, KTOConfig's --stage kto's"
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
        default=None,
        metadata={"help": "TRL: the stage's loss (SFTConfig: nll; DPOConfig: sigmoid, ipo, ...; KTOConfig: kto)."},
    )
    activation_offloading: bool = field(default=False, metadata={"help": "TRL; refused."})
    model_init_kwargs: str | None = field(default=None, metadata={"help": "TRL; refused."})
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "TRL: DPO/KTO's router loss weight (stages sft, pt: refused)."}
    )
    ignore_bias_buffers: bool = field(default=False, metadata={"help": "TRL; accepted, no effect (as in trl sft)."})


@dataclass
class PreferenceArguments:
    """The fields of TRL's preference configs (``DPOConfig``, ``KTOConfig``, ``ORPOConfig``, ``CPOConfig``) that
    ``SFTConfig`` lacks, LLaMA-Factory's names of the same settings as aliases, and ``ref_model`` and
    ``max_prompt_length`` (LLaMA-Factory's and older TRL's). ``None``: the objective's default (TRL's)."""

    beta: float | None = field(
        default=None,
        metadata={
            "aliases": ["--pref_beta"],
            "help": "DPO/KTO: the deviation from the reference; ORPO: the odds ratio's weight; SimPO: the reward "
            "scale (TRL's 0.1; LLaMA-Factory: pref_beta).",
        },
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "DPO: one weight per --loss_type."})
    label_smoothing: float | None = field(default=None, metadata={"help": "DPO robust/EXO, SimPO: label noise."})
    precompute_ref_log_probs: bool | None = field(
        default=None, metadata={"help": "DPO/KTO: one reference pass before training, stored with the data."}
    )
    precompute_ref_batch_size: int | None = field(default=None, metadata={"help": "DPO/KTO: refused."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Preference stages: dropout off (TRL's default; --no_disable_dropout)."}
    )
    use_weighting: bool | None = field(default=None, metadata={"help": "DPO: WPO's weighting; refused."})
    ld_alpha: float | None = field(default=None, metadata={"help": "DPO: LD-DPO (LLaMA-Factory too); refused."})
    f_divergence_type: str | None = field(
        default=None,
        metadata={
            "choices": ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"],
            "help": "DPO: the f-divergence (f-DPO).",
        },
    )
    f_alpha_divergence_coef: float | None = field(default=None, metadata={"help": "DPO: alpha_divergence's alpha."})
    discopop_tau: float | None = field(default=None, metadata={"help": "DPO: DiscoPOP's temperature."})
    sync_ref_model: bool | None = field(default=None, metadata={"help": "DPO/KTO: TR-DPO's updates; refused."})
    ref_model_mixup_alpha: float | None = field(default=None, metadata={"help": "DPO/KTO: with sync_ref_model."})
    ref_model_sync_steps: int | None = field(default=None, metadata={"help": "DPO/KTO: with sync_ref_model."})
    desirable_weight: float | None = field(
        default=None, metadata={"aliases": ["--kto_chosen_weight"], "help": "KTO: weight of desirable examples."}
    )
    undesirable_weight: float | None = field(
        default=None, metadata={"aliases": ["--kto_rejected_weight"], "help": "KTO: weight of undesirable ones."}
    )
    simpo_gamma: float | None = field(default=None, metadata={"help": "SimPO: the target reward margin (0.5)."})
    cpo_alpha: float | None = field(
        default=None, metadata={"help": "SimPO: the chosen completions' NLL weight (CPO-SimPO; default 0: SimPO)."}
    )
    alpha: float | None = field(default=None, metadata={"help": "SimPO: AlphaPO's reward shape (0: SimPO)."})
    max_completion_length: int | None = field(default=None, metadata={"help": "ORPO/CPO: encoder-decoder only."})
    padding_value: int | None = field(default=None, metadata={"help": "ORPO: accepted (padding is masked out)."})
    generate_during_eval: bool | None = field(default=None, metadata={"help": "ORPO/CPO: refused (gym predict)."})
    is_encoder_decoder: bool | None = field(default=None, metadata={"help": "ORPO/CPO: causal LMs only."})
    ref_model: str | None = field(
        default=None,
        metadata={
            "help": "DPO/KTO: the reference model's folder or hub name (LLaMA-Factory's ref_model; default: the "
            "policy's source, or with LoRA the base with the adapters off)."
        },
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Preference stages: keep at most the last N prompt tokens (older TRL's)."}
    )


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
# The preference configs' rows (DPOConfig, KTOConfig, ORPOConfig, CPOConfig): most set the init_args of
# model.objective (``preference`` computes them, LLaMA-Factory's keys with them).
_REFERENCE_FIXED = (
    "TR-DPO mixes the policy into the reference during training; the reference here is frozen (or absent: LoRA, "
    "precompute_ref_log_probs)"
)
_PREFERENCE_SHARED: dict[str, Row] = {
    "model_init_kwargs": _SHARED["model_init_kwargs"],
    "trust_remote_code": _SHARED["trust_remote_code"],
    "dataset_num_proc": _SHARED["dataset_num_proc"],
    "max_length": mapped("data.max_seq_length: prompt + answer per row (default 1024, TRL's)", flag="max_seq_length"),
    "disable_dropout": mapped("model.objective's disable_dropout (on unless False, as TRL's)"),
}
_REFERENCE: dict[str, Row] = {
    "router_aux_loss_coef": mapped("model.objective's router_aux_loss_coef (None: the model config's)"),
    "pad_to_multiple_of": _SHARED["pad_to_multiple_of"],
    "precompute_ref_log_probs": mapped(
        "model.objective's precompute_ref_log_probs: one reference pass before training, stored with the prepared "
        "data (a resume reuses it); training then holds no reference"
    ),
    "precompute_ref_batch_size": refused(
        "the reference pass runs in batches of --per_device_eval_batch_size (data.eval_batch_size): set that"
    ),
    "beta": mapped("model.objective's beta: the deviation from the reference (default 0.1, TRL's)"),
    "activation_offloading": _SHARED["activation_offloading"],
    "sync_ref_model": refused(_REFERENCE_FIXED, False),
    "ref_model_mixup_alpha": accepted("read only with sync_ref_model (refused here)"),
    "ref_model_sync_steps": accepted("read only with sync_ref_model (refused here)"),
}
DPO_CONFIG: dict[str, Row] = (
    _PREFERENCE_SHARED
    | _REFERENCE
    | {
        "truncation_mode": mapped(
            "data.truncation_mode: keep_start cuts a row's end (examples whose prompt fills max_length are dropped), "
            "keep_end its start"
        ),
        "padding_free": refused(
            "preference rows are padded (the chosen and rejected rows in one batch); padding-free rows are not "
            "wired in for them",
            False,
        ),
        "loss_type": mapped(
            "model.objective's loss_type: sigmoid, hinge, ipo, robust, exo_pair, nca_pair, bco_pair, sppo_hard, "
            "apo_zero, apo_down, discopop, sigmoid_norm, sft (aot and aot_unpaired are refused: they sort within a "
            "micro-batch, so the loss would depend on how ranks split the batch)"
        ),
        "loss_weights": mapped("model.objective's loss_weights (one per loss_type, summed as TRL's MPO)"),
        "ld_alpha": refused(
            "LD-DPO weights the tokens beyond the shorter completion, which needs per-token log-probabilities; the "
            "engine sums each sequence's"
        ),
        "f_divergence_type": mapped("model.objective's f_divergence_type (f-DPO)"),
        "f_alpha_divergence_coef": mapped("model.objective's f_alpha_divergence_coef"),
        "label_smoothing": mapped("model.objective's label_smoothing: robust's flip probability, EXO's epsilon"),
        "use_weighting": refused("WPO weights pairs by per-token probabilities the engine does not return", False),
        "discopop_tau": mapped("model.objective's discopop_tau"),
        "pad_token": _SHARED["pad_token"],
    }
)
KTO_CONFIG: dict[str, Row] = (
    _PREFERENCE_SHARED
    | _REFERENCE
    | {
        "loss_type": mapped("model.objective's loss_type: kto, or apo_zero_unpaired (no KL term)"),
        "desirable_weight": mapped("model.objective's desirable_weight (LLaMA-Factory's kto_chosen_weight)"),
        "undesirable_weight": mapped("model.objective's undesirable_weight (LLaMA-Factory's kto_rejected_weight)"),
    }
)
# The fields only trl.experimental's ORPOConfig and CPOConfig have (their trainers' older tokenization).
_REFERENCE_FREE: dict[str, Row] = {
    "max_completion_length": accepted("TRL reads it for encoder-decoder models only; gym train trains causal LMs"),
    "generate_during_eval": refused("validation computes the loss and TRL's metrics; gym predict generates", False),
    "is_encoder_decoder": refused("gym train trains causal LMs (decoder-only)", False),
}
ORPO_CONFIG: dict[str, Row] = (
    _PREFERENCE_SHARED
    | _REFERENCE_FREE
    | {
        "beta": mapped("model.objective's beta: the odds ratio loss's weight (the paper's lambda; default 0.1)"),
        "padding_value": accepted("padded positions are masked out (they hold the tokenizer's pad token here)"),
    }
)
CPO_CONFIG: dict[str, Row] = (
    _PREFERENCE_SHARED
    | _REFERENCE_FREE
    | {
        "beta": mapped("model.objective's beta: the reward scale (default 0.1)"),
        "label_smoothing": mapped("model.objective's label_smoothing: the conservative form's, in [0, 0.5)"),
        "loss_type": mapped(
            "simpo (SimPO) or alphapo (simpo with cpo_alpha 0, as TRL's); CPO's own sigmoid, hinge and ipo are "
            "refused (--stage simpo trains SimPO)"
        ),
        "cpo_alpha": mapped(
            "model.objective's cpo_alpha: the chosen completions' NLL weight (CPO-SimPO); 0 unless given (SimPO, "
            "as TRL's docs set it), where CPOConfig's own default is 1.0"
        ),
        "simpo_gamma": mapped("model.objective's simpo_gamma: the target reward margin (default 0.5)"),
        "alpha": mapped("model.objective's alpha: AlphaPO's reward shape (0: SimPO's log-probability)"),
    }
)
# TRL 1.16's default of each field that not every config has: a stage whose config lacks the field takes it at these
# values (they change nothing there) and refuses others.
FIELD_DEFAULTS: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(("chat_template_path", "dataset_kwargs", "eos_token", "eval_packing", "pad_token"), (None,)),
    **dict.fromkeys(("completion_only_loss", "router_aux_loss_coef", "precompute_ref_batch_size"), (None,)),
    **dict.fromkeys(("loss_weights", "ld_alpha", "max_completion_length", "padding_value"), (None,)),
    **dict.fromkeys(("shuffle_dataset", "packing", "padding_free", "activation_offloading"), (False,)),
    **dict.fromkeys(("assistant_only_loss", "precompute_ref_log_probs", "use_weighting", "sync_ref_model"), (False,)),
    **dict.fromkeys(("generate_during_eval", "is_encoder_decoder"), (False, None)),
    "dataset_text_field": ("text",),
    "truncation_mode": ("keep_start",),
    "packing_strategy": ("bfd",),
    "pad_to_multiple_of": ("auto",),
    "loss_type": ("nll", "sigmoid", "kto"),
    "disable_dropout": (True,),
    "f_divergence_type": ("reverse_kl",),
    "f_alpha_divergence_coef": (0.5,),
    "label_smoothing": (0.0,),
    "beta": (0.1,),
    "discopop_tau": (0.05,),
    "ref_model_mixup_alpha": (0.6,),
    "ref_model_sync_steps": (512,),
    "desirable_weight": (1.0,),
    "undesirable_weight": (1.0,),
    "cpo_alpha": (1.0,),
    "simpo_gamma": (0.5,),
    "alpha": (0.0,),
}
# Every TRL table, for the checks that do not depend on the stage (model and data flags).
TRL_COMMON = merged(SCRIPT_ARGUMENTS, MODEL_CONFIG)
TRL_CONFIGS: dict[str, dict[str, Row]] = {
    "SFTConfig": SFT_CONFIG,
    "DPOConfig": DPO_CONFIG,
    "KTOConfig": KTO_CONFIG,
    "ORPOConfig": ORPO_CONFIG,
    "CPOConfig": CPO_CONFIG,
}
# Where TRL 1.16 defines each config (the field tables' test reads them; ORPO and CPO are experimental there).
TRL_CONFIG_PATHS = {name: f"trl.{name}" for name in ("SFTConfig", "DPOConfig", "KTOConfig")}
TRL_CONFIG_PATHS |= {"ORPOConfig": "trl.experimental.orpo.ORPOConfig", "CPOConfig": "trl.experimental.cpo.CPOConfig"}
# TrainingArguments defaults each TRL config changes (gym train keeps HF's: pass these to get TRL's).
TRL_DEFAULTS = {"learning_rate": "2e-5 (SFT), 1e-6 (DPO, KTO, ORPO, CPO)", "logging_steps": "10"}
TRL_DEFAULTS |= {"gradient_checkpointing": "True", "bf16": "True where supported"}

__all__ = [
    "CPO_CONFIG",
    "DPO_CONFIG",
    "DTYPE_ALIASES",
    "FIELD_DEFAULTS",
    "KTO_CONFIG",
    "MODEL_CONFIG",
    "ORPO_CONFIG",
    "SCRIPT_ARGUMENTS",
    "SFT_CONFIG",
    "TRL_COMMON",
    "TRL_CONFIGS",
    "TRL_CONFIG_PATHS",
    "TRL_DEFAULTS",
    "PreferenceArguments",
    "TrlDataArguments",
    "TrlModelArguments",
]
