"""``gym train``: Hugging Face Trainer flags mapped onto the LightningCLI configuration of ``gym fit``.

    gym train --model_name_or_path Qwen/Qwen3-0.6B --deepspeed configs/deepspeed/ds_zero3.json \\
        --train_file data.jsonl --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --bf16 True
    torchrun --nproc_per_node 2 -m gym_lightning train ...   # (or deepspeed, accelerate launch, srun) no --devices
    gym train run.yaml                                        # every flag from one YAML or JSON file, as HF scripts

Nothing here trains: the flags are parsed by ``transformers.HfArgumentParser`` over ``TrainingArguments`` (every
field, with HF's types and defaults) and this module's ``ModelArguments``/``DataArguments``/``GymArguments``, then
become dotted LightningCLI arguments (``--trainer.max_steps=...``) run through ``gym_lightning.cli.run_lightning_cli``,
the code path of ``python -m gym_lightning fit``. ``--print_config`` prints that run as YAML;
``python -m gym_lightning fit --config that.yaml`` repeats it. ``TrainingArguments.__post_init__`` is not run: it
initialises accelerate's ``PartialState`` (a process group under ``torchrun``) and DeepSpeed, which Lightning owns.

A ``TrainingArguments`` field that is not mapped is accepted at its default and refused, in one line naming the flag
and why, when set to anything else (``refused_flags``).

Mapping decisions (where Lightning and the HF Trainer differ):

- ``--output_dir``: ``trainer.default_root_dir`` (logs, ``checkpoints/``); the final model is exported as a
  Hugging Face folder to ``<output_dir>/hf`` (``export.output_dir``) — HF writes it to ``output_dir`` itself.
  ``<output_dir>/trainer_state.json`` holds HF's ``log_history`` (loss, learning_rate, epoch, step per optimizer
  step; eval_loss per validation) and ``<output_dir>/curves.png`` the loss/lr curves (``TrainerStateCallback``).
- ``--save_steps N``: ``gym_lightning.checkpointing.StepCheckpoint(every_n_steps=N)`` in ``<output_dir>/checkpoints``
  keeping the last ``--save_total_limit`` (all by default, as HF), ``last.ckpt`` linked; ``--save_strategy no``
  turns checkpointing off. ``--resume_from_checkpoint True`` resumes from that ``last.ckpt`` (HF: the newest
  checkpoint in output_dir), a path resumes from the path.
- ``--logging_steps``/``--eval_steps``/``--save_steps`` below 1 are ratios of ``--max_steps`` (rounded up, as HF),
  and ``--warmup_steps`` below 1 is a ratio of the total steps (``--warmup_ratio`` of transformers < 5 also works).
- ``--eval_steps N``: validation every N optimizer steps (Lightning counts micro-batches, so
  ``val_check_interval = N x accumulation``); ``--eval_strategy`` defaults to ``steps`` when ``--eval_steps`` is
  given, else ``no`` (as HF).
- ``--bf16``/``--fp16``: ``bf16-mixed``/``16-mixed`` (HF's flags select mixed precision with fp32 weights);
  ``--tf32`` sets torch's TF32 switches in each rank's process (``apply_tf32``), as HF does.
- ``--max_steps > 0`` overrides ``--num_train_epochs`` (as HF). A fraction of an epoch (``1.5``) trains
  ``ceil(1.5 x steps per epoch)`` optimizer steps, as HF: ``trainer.max_epochs = 2`` and an ``EpochFraction``
  callback that sets the step count once the DataLoader exists, before the optimizer and schedule are built.
- ``--optim``: ``model.optim``, built as the HF Trainer builds it (``optim.build_optimizer``: ``adamw_torch``,
  ``adamw_torch_fused`` (HF's default), ``sgd``, ``adagrad``, ``rmsprop``, ``adafactor``); the others need packages
  or devices not used here and are refused.
- ``--weight_decay``: on the HF Trainer's parameters (``model.decay_rule: hf``: not biases, LayerNorm/norm weights).
- ``--lr_scheduler_type``/``--lr_scheduler_kwargs``: ``model.hf_scheduler``/``model.scheduler_kwargs``, built by
  ``transformers.get_scheduler`` (HF's numbers, warm-up included); ``reduce_lr_on_plateau``/``greedy`` are refused.
- ``--torch_compile`` (``--torch_compile_backend``/``--torch_compile_mode`` turn it on too, as in transformers):
  ``model.compile``, each decoder layer compiled (``models.compiled``). ``--use_liger_kernel`` (LLaMA-Factory's
  ``--enable_liger_kernel``) and ``liger_kernel_config``: ``model.fused_ops`` with Liger's kernels (``models.fused``).
- ``--report_to``: one or more of ``csv``, ``tensorboard``, ``wandb``, ``mlflow`` (``all``: those installed), written
  under ``<output_dir>/logs``; ``--run_name`` names the run. ``none`` (HF's default: no external service) keeps
  ``gym fit``'s local CSV + TensorBoard logs, which ``trainer_state.json`` and ``curves.png`` do not need.
- ``--ddp_timeout SECONDS`` (HF's default 1800 is Lightning's too): the strategy's collective ``timeout``; a rank
  that does not arrive within it is named and the job ends (``strategies.rank_failure``). Without ``--strategy`` or
  ``--deepspeed`` it selects ``gym_ddp`` (the strategy Lightning's ``auto`` would pick is plain DDP).
- ``--strategy NAME``: ``trainer.strategy`` (``gym_ddp``, ``gym_fsdp``, ``zero1``..., or Lightning's names);
  ``--strategy gym_auto``: the planner picks the fastest strategy that fits this model, batch and hardware when the
  run starts, and says which and why in one line (``planner.auto``; ``gym plan`` shows the ranking). It refuses
  ``--ddp_timeout`` and ``--sequence_parallel_size``: they are arguments of a strategy not chosen yet.
- ``--deepspeed ds.json``: ``trainer.strategy = ZeROStrategy(config=ds.json)`` (stage from the JSON, ``"auto"``
  resolved from these flags). ``--gradient_accumulation_steps`` and ``--max_grad_norm`` left at HF's defaults take
  the JSON's explicit numbers (they are one setting each, see ``strategies/zero/hf_auto.py``).
- Errors from the run name ``gym fit`` settings; ``gym train`` adds the flag that sets each one
  (``trainer.accumulate_grad_batches (gym train: --gradient_accumulation_steps)``, ``SETTING_FLAGS``).
- Several processes: under ``torchrun``/``python -m torch.distributed.run``, ``accelerate launch`` (both set
  ``LOCAL_WORLD_SIZE``), the ``deepspeed`` launcher (``LOCAL_SIZE``, and ``--local_rank`` is accepted) and ``srun``
  (``SLURM_STEP_*``), ``--devices``/``--num_nodes`` come from the environment (``launcher_topology``; the deepspeed
  launcher's ``CROSS_RANK`` becomes Lightning's ``NODE_RANK``); without a launcher ``--devices N`` lets Lightning
  start the ranks.

TRL's SFT flags (``ScriptArguments``, ``SFTConfig`` beyond ``TrainingArguments``, ``ModelConfig``) and LLaMA-Factory's
train YAML keys are flags too; each one is mapped, accepted without effect where it changes nothing here, or refused
in one line (``EXTRA_REFUSED``) when set to a value gym_lightning cannot honour:

- ``--config run.yaml`` (TRL's ``trl sft --config``; also ``gym train run.yaml ...``, HF's one-file form): every key
  of the YAML/JSON file is a flag (any of its names: ``cutoff_len``, ``max_length``, ``lora_rank``, ``dtype``,
  ``use_peft``, ...; TRL's ``env`` mapping sets environment variables); flags on the command line override the file.
  Unknown keys are problems of the one error message, as refused flags are.
- The training data (``train_sources``): ``--train_file``, TRL's ``--dataset_name`` (a file, glob, folder or Hub set,
  ``--dataset_config``, ``--dataset_train_split``/``--dataset_test_split``) or ``--dataset`` (bundled, or
  LLaMA-Factory's files/``dataset_info.json`` names); ``--max_samples`` (LLaMA-Factory; HF's ``--max_train_samples``)
  caps each set; ``--dataset_text_field`` renames the text column.
- ``--max_seq_length`` (also ``--max_length``, ``--cutoff_len``, ``--model_max_length``) defaults to 1,024 tokens:
  TRL's ``max_length`` default and the cap of HF ``run_clm.py``'s block size (LLaMA-Factory's YAMLs set cutoff_len).
- Defaults are ``TrainingArguments``' (TRL's ``SFTConfig`` changes some: learning rate 2e-5, logging every 10
  steps, gradient checkpointing and bf16 on; pass them) and gym_lightning's LoRA's (r 8, alpha 16, dropout 0, peft's
  targets; TRL's: 16, 32, 0.05). With LLaMA-Factory's ``finetuning_type: lora``, its own: every linear layer
  (``lora_target: all``), alpha twice the rank, gradient checkpointing on (``disable_gradient_checkpointing``).
- Loss masking is one switch, ``data.mask_prompt``: on by default (completions, alpaca outputs and assistant turns
  are the targets); ``--completion_only_loss``/``--assistant_only_loss`` set it, ``--train_on_prompt`` turns it off.
  TRL trains conversational data on every token unless ``--assistant_only_loss``: pass ``--assistant_only_loss
  False`` for that.
- ``--packing`` (also LLaMA-Factory's ``neat_packing``): greedy rows of ``max_length`` tokens, padding-free with
  restarting positions (TRL's default ``bfd`` strategy is accepted as it); ``--padding_free`` alone is refused.
- ``--load_in_4bit`` (LLaMA-Factory: ``quantization_bit: 4``, double quantisation on as there) takes every value of
  transformers' ``BitsAndBytesConfig``: ``nf4``/``fp4``, any compute dtype (``--dtype`` is the compute dtype when
  ``--bnb_4bit_compute_dtype`` is not given, as TRL builds it), any ``quant_storage`` (the codes stay uint8: one info
  line, ``quant.config``).
- LLaMA-Factory's ``template``: gym_lightning renders chat data with the tokenizer's own chat template (one info
  line); a template whose turn markers that chat template lacks is refused (``TEMPLATE_MARKERS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, get_args

import yaml
from transformers import HfArgumentParser, TrainingArguments

from gym_lightning._compat import rank_zero_info
from gym_lightning.commands.train_sources import plan_data
from gym_lightning.data.formats import FORMATS
from gym_lightning.errors import GymUserError, raise_if_problems
from gym_lightning.optim import HFSchedulerName, OptimizerName
from gym_lightning.quant.config import COMPUTE_DTYPES, QUANT_STORAGES, QUANT_TYPES
from gym_lightning.strategies.zero.config import load_deepspeed_json
from gym_lightning.strategies.zero.hf_auto import adopted_value
from gym_lightning.vocabulary import AUTO_STRATEGY, SETTING_FLAGS  # SETTING_FLAGS: `gym fit` setting -> its flags

# The HF schedules and optimizers the module builds (transformers.get_scheduler; optim.build_optimizer).
SCHEDULERS: tuple[str, ...] = get_args(HFSchedulerName)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
# --report_to -> (Lightning logger class, the package it needs).
LOGGERS = {
    "csv": ("lightning.pytorch.loggers.CSVLogger", None),
    "tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", "tensorboard"),
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
}
HF_DDP_TIMEOUT = 1800  # seconds, TrainingArguments' default: Lightning's default collective timeout too
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters")
QUANT_FLAGS = ("bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage")
# transformers' BitsAndBytesConfig takes a compute dtype as any torch attribute name: these are torch's other names.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
# TRL's flags typed ``bool | None`` where None means "by the data": a bare flag still means True, as for plain bools.
OPTIONAL_BOOLS = ("completion_only_loss", "assistant_only_loss", "eval_packing")
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
# LLaMA-Factory keys of a config file that are no flags here: inference-only ones, and ones read only with a method
# that is refused anyway (freeze, PiSSA, LoRA+, ...), take any value; the others only LLaMA-Factory's default.
LLAMA_FACTORY_IGNORED = frozenset(
    {
        *("eval_num_beams", "infer_backend", "infer_dtype", "use_kv_cache", "use_reentrant_gc", "offload_folder"),
        *("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules", "pissa_iter", "pissa_convert"),
        *("loraplus_lr_embedding", "asft_alpha", "eaft_alpha", "low_cpu_mem_usage", "data_shared_file_system"),
        *("freeze_vision_tower", "freeze_multi_modal_projector"),
    }
)
LLAMA_FACTORY_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys(["eval_on_each_dataset", "preserve_thinking", "use_mca", "use_hyper_parallel"], False),
    **dict.fromkeys(["use_asft_loss", "use_eaft_loss", "freeze_language_model", "disable_shuffling"], False),
    **dict.fromkeys(["include_effective_tokens_per_second", "split_special_tokens", "shift_attn"], False),
    **dict.fromkeys(["use_unsloth_gc", "upcast_lmhead_output", "train_from_scratch", "use_v1_kernels"], False),
    **dict.fromkeys(["hyper_parallel_args", "early_stopping_steps", "adapter_folder", "cache_dir", "add_tokens"], None),
    **dict.fromkeys(
        ["add_special_tokens", "new_special_tokens_config", "mixture_of_depths", "moe_aux_loss_coef"], None
    ),
    **dict.fromkeys(["hf_hub_token", "ms_hub_token", "om_hub_token"], None),
    "use_fast_tokenizer": True,
    "init_special_tokens": "noise_init",
}
# TrainingArguments fields mapped below (or without effect here, e.g. local_rank: the launcher's rank, which
# Lightning reads from the environment). Every other field is refused unless at its default (refused_flags).
MAPPED_FIELDS = frozenset(
    [
        "output_dir",
        "per_device_train_batch_size",
        "num_train_epochs",
        "max_steps",
        "learning_rate",
        "lr_scheduler_type",
        "warmup_steps",
        "tf32",
        "optim",
        "lr_scheduler_kwargs",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "bf16",
        "fp16",
        "gradient_checkpointing",
        "dataloader_pin_memory",
        "torch_compile",
        "torch_compile_backend",
        "torch_compile_mode",
        "use_liger_kernel",
        "liger_kernel_config",
        "logging_steps",
        "report_to",
        "run_name",
        "eval_strategy",
        "eval_steps",
        "per_device_eval_batch_size",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "seed",
        "data_seed",
        "use_cpu",
        "dataloader_num_workers",
        "disable_tqdm",
        "do_train",
        "do_eval",
        "do_predict",
        "resume_from_checkpoint",
        "local_rank",
        "deepspeed",
        "ddp_timeout",
        "log_level",
        "log_level_replica",
    ]
)
# Why a field is refused, where there is more to say than that gym train has no equivalent.
REFUSAL_REASONS = {
    "push_to_hub": "gym train does not upload; upload <output_dir>/hf with `huggingface-cli upload`",
    # gym's FSDP is gym_fsdp (FSDP2, CPU and GPU): Lightning's own "fsdp" refuses CPU ranks.
    "fsdp": "use --strategy gym_fsdp (full_shard, one unit per decoder layer); shard_grad_op, hybrid_shard and offload "
    "are GymFSDPStrategy's init_args sharding and cpu_offload (gym fit's trainer.strategy)",
    "fsdp_config": "use --strategy gym_fsdp: it wraps each decoder layer itself, --gradient_checkpointing checkpoints "
    "activations; its other settings are GymFSDPStrategy's init_args (gym fit's trainer.strategy)",
    "optim_args": "the optimizers take --learning_rate, --weight_decay and (AdamW) --adam_beta1/2, --adam_epsilon",
    "average_tokens_across_devices": "gym_lightning always normalises the loss by the tokens of the whole step",
    "load_best_model_at_end": "the final model is the last one; pick a checkpoint from <output_dir>/checkpoints",
}
_TOKENIZER_FIX = "save a tokenizer folder with it (save_pretrained) and pass --tokenizer_name"
# TRL and LLaMA-Factory fields refused unless at their default (or one of the values listed): field -> (why, values).
EXTRA_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "model_revision": (
        "gym_lightning loads a Hub model's main revision; download that one "
        "(huggingface-cli download NAME --revision R --local-dir DIR) and pass the folder",
        ("main",),
    ),
    "lora_modules_to_save": ("gym_lightning trains the LoRA adapters only, no fully trained layer beside them", ()),
    "lora_task_type": ("gym train trains causal LMs (CAUSAL_LM)", ("CAUSAL_LM",)),
    "use_rslora": ("LoRA scales by alpha/r here; for rsLoRA's alpha/sqrt(r) pass --lora_alpha alpha x sqrt(r)", ()),
    "use_dora": ("DoRA is not wired into gym_lightning's LoRA", ()),
    "load_in_8bit": ("gym_lightning quantises the base to 4 bits only; use --load_in_4bit", ()),
    "quantization_bit": ("gym_lightning quantises to 4 bits only (quantization_bit: 4)", (None, 4)),
    "quantization_method": (
        "the 4-bit base is bitsandbytes' NF4/FP4 (quantization_method: bnb)",
        ("bnb", "bitsandbytes"),
    ),
    "stage": ("gym train runs supervised finetuning (stage: sft) only", ("sft",)),
    "finetuning_type": ("gym train trains LoRA adapters (lora) or the whole model (full)", (None, "lora", "full")),
    "flash_attn": ("flash attention 3 is not among gym_lightning's attn_implementation values", tuple(FLASH_ATTN)),
    "truncation_mode": ("samples are cut at the end here (keep_start)", ("keep_start",)),
    "packing_strategy": ("gym_lightning packs greedily in order (--packing, TRL's bfd accepted as it)", ("bfd",)),
    "eval_packing": ("validation data is never packed here", (None, False)),
    "pad_to_multiple_of": ("a batch is padded to its longest row here", ("auto", None, "None", "none")),
    "loss_type": ("gym_lightning trains with the NLL loss (chunked for large vocabularies)", ("nll", "chunked_nll")),
    "activation_offloading": ("activation offloading is not wired in; use --gradient_checkpointing", ()),
    "model_init_kwargs": ("use --torch_dtype, --attn_implementation and --trust_remote_code", ()),
    "router_aux_loss_coef": ("no such setting here; set router_aux_loss_coef in the model's config.json", ()),
    "chat_template_path": (f"chats use the tokenizer's chat template: {_TOKENIZER_FIX}", ()),
    "dataset_kwargs": ("gym_lightning always tokenizes the data itself", ()),
    "mask_history": ("every assistant turn is a target here", ()),
    "tool_format": ("tools go to the tokenizer's chat template (a tools column)", ()),
    "default_system": ("put the system message in the data (a system field or turn)", ()),
    "enable_thinking": ("chats are rendered by the tokenizer's chat template as they are", (True,)),
    "mix_strategy": ("several data sets are mixed by data.sources weights (gym fit)", ("concat",)),
    "interleave_probs": ("several data sets are mixed by data.sources weights (gym fit)", ()),
    "tokenized_path": ("tokenized data is cached by gym_lightning itself (data.cache_dir, $GYM_DATA_CACHE)", ()),
    "buffer_size": ("a stream is read in file order here (shuffle the files beforehand)", (16384,)),
    "ignore_pad_token_for_loss": ("padding is never in the loss here", (True,)),
    "add_special_tokens": ("samples are tokenized with the tokenizer's own rule (eos appended) here", (False,)),
    "append_concat_token": ("packed samples keep their own eos and restart positions here", (False,)),
    "media_dir": ("gym train trains on text only", ()),
    "use_unsloth": ("Unsloth is not used by gym_lightning", ()),
    "rope_scaling": ("set rope_scaling in the model's config.json", ()),
    "resize_vocab": ("the model's embeddings are used as they are", ()),
    "upcast_layernorm": ("use --bf16 (mixed precision keeps fp32 weights)", ()),
    "pure_bf16": ("use --bf16 (mixed) or --torch_dtype bfloat16", ()),
    "loraplus_lr_ratio": ("LoRA+ learning rates are not wired in", ()),
    "pissa_init": ("PiSSA initialisation is not wired in", ()),
    "create_new_adapter": ("adapters are created once per run", ()),
    "adapter_name_or_path": ("a run starts new adapters; continue one with --resume_from_checkpoint", ()),
    "use_galore": ("GaLore is not wired in", ()),
    "use_apollo": ("APOLLO is not wired in", ()),
    "use_badam": ("BAdam is not wired in", ()),
    "use_llama_pro": ("LLaMA Pro is not wired in", ()),
    "use_adam_mini": ("use --optim (adamw_torch_fused, adamw_torch, sgd, adagrad, rmsprop, adafactor)", ()),
    "use_muon": ("use --optim (adamw_torch_fused, adamw_torch, sgd, adagrad, rmsprop, adafactor)", ()),
    "use_dft_loss": ("gym_lightning trains with the NLL loss", ()),
    "compute_accuracy": ("validation reports eval_loss (and exact match with gym fit's model.val_exact_match)", ()),
    "quantization_device_map": ("the strategy places the 4-bit base", ()),
    "print_param_status": ("the model summary lists trainable parameters", ()),
}
_SETTING_PATTERN = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in SETTING_FLAGS) + r")(?![\w.])")


# ---------------------------------------------------------------------------------------------------- arguments
@dataclass
class ModelArguments:
    """The model flags of HF's ``run_clm.py``, TRL's ``ModelConfig`` and LLaMA-Factory's model and method keys."""

    model_name_or_path: str = field(metadata={"help": "Preset (tiny-llama, tiny-qwen3), folder or hub name."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision (TRL, LLaMA-Factory): main only."})
    torch_dtype: str | None = field(
        default=None,
        metadata={
            "aliases": ["--dtype"],
            "help": "Parameter dtype (TRL: --dtype).",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    attn_implementation: str | None = field(
        default=None, metadata={"choices": ["eager", "sdpa", "flash_attention_2", "flex_attention"]}
    )
    flash_attn: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "disabled", "sdpa", "fa2", "fa3"],
            "help": "LLaMA-Factory: disabled, sdpa, fa2 are --attn_implementation eager, sdpa, flash_attention_2.",
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code from the model repository."})
    stage: str = field(default="sft", metadata={"help": "LLaMA-Factory's stage: sft only."})
    finetuning_type: str | None = field(
        default=None,
        metadata={
            "help": "LLaMA-Factory: lora (--use_lora with its LoRA defaults: all-linear, alpha 2 x rank) or full."
        },
    )
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
    # TRL's ModelConfig / transformers' BitsAndBytesConfig names: the 4-bit base of QLoRA (gym_lightning.quant).
    load_in_4bit: bool = field(
        default=False,
        metadata={"aliases": ["--use_4bit_quantization"], "help": "Hold the frozen base in 4 bits (QLoRA)."},
    )
    load_in_8bit: bool = field(default=False, metadata={"help": "Refused: 4 bits only (--load_in_4bit)."})
    quantization_bit: int | None = field(default=None, metadata={"help": "LLaMA-Factory: 4 is --load_in_4bit."})
    quantization_method: str = field(default="bnb", metadata={"help": "LLaMA-Factory: bnb (bitsandbytes) only."})
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
    double_quantization: bool = field(default=True, metadata={"help": "LLaMA-Factory's, with quantization_bit 4."})
    bnb_4bit_quant_storage: str | None = field(
        default=None,
        metadata={
            "aliases": ["--bnb_4bit_quant_storage_dtype"],
            "choices": list(QUANT_STORAGES),
            "help": "Accepted; the codes stay uint8 (sharded per parameter).",
        },
    )


@dataclass
class DataArguments:
    """The data flags of HF's ``run_clm.py``, TRL's ``ScriptArguments``/``SFTConfig`` and LLaMA-Factory."""

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A bundled data set (addition), or LLaMA-Factory's dataset: a comma list of data files/folders "
            "or of names in <dataset_dir>/dataset_info.json."
        },
    )
    dataset_dir: str = field(default="data", metadata={"help": "LLaMA-Factory: the folder of dataset_info.json."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "TRL, run_clm: a data file, glob, folder (split by file names) or Hub set."}
    )
    dataset_config: str | None = field(
        default=None, metadata={"aliases": ["--dataset_config_name"], "help": "Subset of a Hub --dataset_name."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split of --dataset_name to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split of --dataset_name to validate on (read with evaluation on)."}
    )
    dataset_streaming: bool = field(
        default=False, metadata={"aliases": ["--streaming"], "help": "Read and tokenize on the fly (data.streaming)."}
    )
    datasets: list[str] | None = field(default=None, metadata={"help": "TRL's mixture; refused (gym fit's sources)."})
    test_split_size: float | None = field(default=None, metadata={"help": "TRL: fraction held out for validation."})
    train_file: list[str] | None = field(default=None, metadata={"help": "Training .jsonl/.json/.txt files or globs."})
    validation_file: list[str] | None = field(default=None, metadata={"help": "Validation files or globs."})
    eval_dataset: str | None = field(default=None, metadata={"help": "LLaMA-Factory: validation files/names."})
    validation_split_percentage: int = field(default=0, metadata={"help": "Percent of --train_file held out."})
    val_size: float = field(default=0.0, metadata={"help": "LLaMA-Factory: fraction held out for validation."})
    max_samples: int | None = field(
        default=None, metadata={"aliases": ["--max_train_samples"], "help": "Keep the first N records of each set."}
    )
    data_format: str = field(
        default="auto",
        metadata={"choices": list(FORMATS), "help": "Record format."},
    )
    dataset_text_field: str = field(default="text", metadata={"help": "TRL: the text column (format text)."})
    max_seq_length: int = field(
        default=1024,
        metadata={
            "aliases": ["--max_length", "--cutoff_len", "--model_max_length", "--max_seq_len"],
            "help": "Tokens per sample (TRL's default 1024).",
        },
    )
    truncation_mode: str = field(default="keep_start", metadata={"choices": ["keep_start", "keep_end"]})
    packing: bool = field(default=False, metadata={"help": "Pack training samples into full-length rows."})
    neat_packing: bool = field(default=False, metadata={"help": "LLaMA-Factory: --packing (no cross-attention)."})
    packing_strategy: str = field(default="bfd", metadata={"choices": ["bfd", "bfd_split", "wrapped"]})
    padding_free: bool = field(default=False, metadata={"help": "TRL: with --packing (gym's packing is padding-free)."})
    eval_packing: bool | None = field(default=None, metadata={"help": "TRL; validation is never packed."})
    pad_to_multiple_of: str | None = field(default="auto", metadata={"help": "TRL: auto only."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens."})
    completion_only_loss: bool | None = field(default=None, metadata={"help": "TRL: train on completions only."})
    assistant_only_loss: bool | None = field(default=None, metadata={"help": "TRL: train on assistant turns only."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"aliases": ["--preprocessing_num_workers"], "help": "Tokenization processes."}
    )
    shuffle_dataset: bool = field(default=False, metadata={"help": "TRL; accepted: every epoch is shuffled."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Accepted: the cache follows file contents."})
    preprocessing_batch_size: int = field(default=1000, metadata={"help": "LLaMA-Factory; accepted, no effect."})
    template: str | None = field(
        default=None, metadata={"help": "LLaMA-Factory: must be the tokenizer's own chat template."}
    )
    chat_template_path: str | None = field(default=None, metadata={"help": "TRL; refused (use --tokenizer_name)."})
    eos_token: str | None = field(
        default=None, metadata={"help": "TRL: a token of the vocabulary that ends turns and samples (e.g. <|im_end|>)."}
    )
    pad_token: str | None = field(default=None, metadata={"help": "TRL: a token of the vocabulary to pad with."})
    dataset_kwargs: str | None = field(default=None, metadata={"help": "TRL; refused."})
    mask_history: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    tool_format: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    default_system: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    enable_thinking: bool = field(default=True, metadata={"help": "LLaMA-Factory; True only."})
    mix_strategy: str = field(default="concat", metadata={"help": "LLaMA-Factory; concat only."})
    interleave_probs: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    tokenized_path: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})
    buffer_size: int = field(default=16384, metadata={"help": "LLaMA-Factory; refused."})
    ignore_pad_token_for_loss: bool = field(default=True, metadata={"help": "LLaMA-Factory; True only."})
    media_dir: str | None = field(default=None, metadata={"help": "LLaMA-Factory; refused."})


@dataclass
class GymArguments:
    """Flags of gym train beyond the HF Trainer's (and TRL's/LLaMA-Factory's training keys)."""

    devices: str | None = field(
        default=None, metadata={"help": "Devices per node (number, list, auto); default: the launcher's, else auto."}
    )
    num_nodes: int | None = field(default=None, metadata={"help": "Nodes; default: the launcher's, else 1."})
    accelerator: str = field(default="auto", metadata={"help": "cpu, gpu, cuda, auto."})
    strategy: str | None = field(
        default=None,
        metadata={
            "help": f"A Lightning strategy name instead of --deepspeed; {AUTO_STRATEGY}: the planner picks the fastest "
            "that fits this model, batch and hardware as the run starts (one line says which and why)."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Ranks sharing each sequence (Ulysses, as ALST/TRL name it); needs gym_ddp/gym_fsdp/ZeRO."},
    )
    warmup_ratio: float = field(default=0.0, metadata={"help": "transformers < 5: same as --warmup_steps < 1."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "transformers < 5; accepted, no effect."})
    print_config: bool = field(default=False, metadata={"help": "Print the equivalent `gym fit` YAML and exit."})
    plot_loss: bool = field(default=False, metadata={"help": "LLaMA-Factory; accepted: curves.png is always written."})
    disable_gradient_checkpointing: bool = field(
        default=False, metadata={"help": "LLaMA-Factory (which checkpoints by default, as gym train does with it)."}
    )
    loss_type: str = field(default="nll", metadata={"choices": ["nll", "dft", "chunked_nll"], "help": "TRL: nll."})
    activation_offloading: bool = field(default=False, metadata={"help": "TRL; refused."})
    model_init_kwargs: str | None = field(default=None, metadata={"help": "TRL; refused."})
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "TRL; refused."})
    ignore_bias_buffers: bool = field(default=False, metadata={"help": "TRL; accepted, no effect (as in trl sft)."})
    # The flags of PEFT's examples/sft/train.py, the script of HF's FSDP + QLoRA and DeepSpeed + QLoRA guides.
    splits: str | None = field(default=None, metadata={"help": "PEFT's script: 'train,test' splits of the data."})
    chat_template_format: str = field(
        default="none", metadata={"help": "PEFT's script; accepted: the tokenizer's own template and tokens are used."}
    )
    add_special_tokens: bool = field(default=False, metadata={"help": "PEFT's script: False only (its default)."})
    append_concat_token: bool = field(default=False, metadata={"help": "PEFT's script: False only (its default)."})
    use_reentrant: bool = field(default=False, metadata={"help": "PEFT's script; accepted (non-reentrant here)."})
    use_flash_attn: bool = field(default=False, metadata={"help": "PEFT's script: attn_implementation fa2."})
    use_unsloth: bool = field(default=False, metadata={"help": "LLaMA-Factory; refused."})
    enable_liger_kernel: bool = field(default=False, metadata={"help": "LLaMA-Factory: --use_liger_kernel."})
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


@dataclass
class GymTrainingArguments(TrainingArguments):
    """``TrainingArguments`` without ``__post_init__``: that one starts accelerate's ``PartialState`` (a process group
    under torchrun, DeepSpeed with --deepspeed) and checks devices; Lightning does both here."""

    def __post_init__(self) -> None:
        pass


DATACLASSES = (ModelArguments, DataArguments, GymTrainingArguments, GymArguments)


class TrainArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` whose errors are one line (exit 2, as ``CommandParser``) and suggest the closest flag."""

    def __init__(self) -> None:
        super().__init__(DATACLASSES, prog="gym train", allow_abbrev=False)
        for action in self._actions:
            if action.dest == "report_to":  # a list in HF's docs, but a plain str field for argparse
                action.nargs = "+"
            if action.dest in OPTIONAL_BOOLS and action.option_strings:
                action.nargs, action.const = "?", True
        self.add_argument(
            "--config",
            help="A YAML/JSON file of flags (TRL's --config; `gym train FILE` too); flags given here override it.",
        )
        self.description = "Finetune a causal LM with Hugging Face Trainer flags (runs `gym fit` underneath)."

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gym_lightning: error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_args(self, args: list[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
        if flags:
            self.error(f"unrecognized argument {flags[0]}{_suggestion(flags[0], self.valid_flags())}")
        if unknown:
            self.error(f"unexpected value {unknown[0]!r} (every value follows its flag, e.g. --max_steps 10)")
        return parsed

    def valid_flags(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]

    def key_destinations(self) -> dict[str, str]:
        """Every name a config file key may use (a flag without its dashes) -> the argument it sets."""
        names: dict[str, str] = {}
        for action in self._actions:
            # --no_X flags (store_false) set X to False: a key "no_X: true" is not a name of X.
            if isinstance(action, (argparse._HelpAction, argparse._StoreFalseAction)) or action.dest == "config":
                continue
            names |= {flag.lstrip("-"): action.dest for flag in action.option_strings}
        return names

    def set_config_defaults(self, values: Mapping[str, Any], source: str) -> list[str]:
        """The file's values as the arguments' defaults (TRL's ``set_defaults_with_config``: flags given on the
        command line then override them); returns a problem per key that is no flag or sets an argument twice."""
        names, problems = self.key_destinations(), []
        chosen: dict[str, str] = {}  # argument -> the key that set it
        for key, value in values.items():
            dest = names.get(str(key))
            if dest is None and key in LLAMA_FACTORY_DEFAULTS and value != LLAMA_FACTORY_DEFAULTS[key]:
                problems.append(
                    f"{source}: {key} {value!r} is not supported: gym train has no equivalent of LLaMA-Factory's "
                    f"{key}; leave it at {LLAMA_FACTORY_DEFAULTS[key]!r}."
                )
            elif key in LLAMA_FACTORY_IGNORED or key in LLAMA_FACTORY_DEFAULTS:
                continue  # a LLaMA-Factory key that changes nothing here
            elif dest is None:
                hint = _suggestion(f"--{key}", self.valid_flags()).replace("; did you mean --", "; did you mean ")
                problems.append(f"{source}: {key} is not a gym train flag{hint}")
            elif dest in chosen:
                problems.append(f"{source}: {chosen[dest]} and {key} both set {dest}; keep one.")
            else:
                chosen[dest] = key
                self.set_defaults(**{dest: value})
        for action in self._actions:
            if action.dest in chosen:
                action.required = False
        return problems


def _suggestion(flag: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(flag, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else ""


def build_parser() -> TrainArgumentParser:
    """The ``gym train`` flags: every ``TrainingArguments`` field (HF's names, types, defaults) and this module's."""
    return TrainArgumentParser()


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """All flags as one namespace: from the command line, over a ``.yaml``/``.yml``/``.json`` file given with
    ``--config FILE`` or first (HF and TRL style). Problems of the file's keys are kept in ``config_problems`` for
    :func:`flag_problems`, so that one message lists them with the refused flags."""
    parser = build_parser()
    argv, config = _config_file(list(argv))
    problems = parser.set_config_defaults(_read_config(config), config) if config else []
    args = parser.parse_args(argv)
    args.config, args.config_problems = config, problems
    if args.splits:  # PEFT's script: "train,test" names the training split, then the validation one
        names = [name.strip() for name in args.splits.split(",") if name.strip()]
        args.dataset_train_split = names[0] if names else args.dataset_train_split
        args.dataset_test_split = names[1] if len(names) > 1 else args.dataset_test_split
    return args


def _config_file(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without its config file, and that file: ``--config FILE``, ``--config=FILE`` or a first argument."""
    files = [argv.pop(0)] if argv and not argv[0].startswith("-") and argv[0].endswith(CONFIG_SUFFIXES) else []
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            files.append(argv[index + 1])
            del argv[index : index + 2]
            break
        if arg.startswith("--config="):
            files.append(argv.pop(index).split("=", 1)[1])
            break
    if len(files) > 1:
        raise GymUserError(f"gym train: two config files ({files[0]}, {files[1]}); give one (flags override it).")
    return argv, files[0] if files else None


def _read_config(path: str) -> dict[str, Any]:
    """The keys of a YAML or JSON config file; TRL's ``env`` mapping is set in the environment (as TRL does)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:  # missing, unreadable or malformed
        raise GymUserError(f"gym train {path}: {' '.join(str(err).split())}") from err
    if not isinstance(values, dict):
        raise GymUserError(f"gym train {path}: the file must hold a mapping of flag names to values.")
    env = values.pop("env", None) or {}
    if not isinstance(env, dict):
        raise GymUserError(f"gym train {path}: env must be a mapping of variable names to values.")
    os.environ.update({str(key): str(value) for key, value in env.items()})
    return values


def refused_flags(args: argparse.Namespace) -> list[str]:
    """One problem per ``TrainingArguments`` field that is set to a non-default value but not mapped here, and per
    TRL/LLaMA-Factory field of ``EXTRA_REFUSED`` set to a value not listed there."""
    problems = []
    # What the parser yields when a flag is not given (argparse passes string defaults through ``type``).
    parser_defaults = vars(build_parser().parse_args(["--model_name_or_path", "-"]))
    for spec in dataclasses.fields(TrainingArguments):
        if not spec.init or spec.name in MAPPED_FIELDS:
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        value = getattr(args, spec.name, default)
        # The parser's default can differ from the field's (debug: None vs "", include_num_input_tokens_seen:
        # False vs "no"); both count as unset. str(): an enum equals its value's text.
        if str(value) not in (str(default), str(parser_defaults.get(spec.name, default))):
            reason = REFUSAL_REASONS.get(spec.name, "gym train has no equivalent; leave it at its default")
            problems.append(f"--{spec.name} {value!r} is not supported: {reason}.")
    for name, (reason, accepted) in EXTRA_REFUSED.items():
        value = getattr(args, name)
        if str(value) not in {str(parser_defaults[name]), *map(str, accepted)} and value not in ([], {}):
            problems.append(f"--{name} {value!r} is not supported: {reason}.")
    return problems


# ------------------------------------------------------------------------------------------------------ mapping
def flag_problems(args: argparse.Namespace) -> list[str]:
    """Every combination of flags that cannot run, each with its fix (the config file's unknown keys first)."""
    problems = list(getattr(args, "config_problems", [])) + _choice_problems(args) + refused_flags(args)
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 exclude each other; pass one.")
    if args.deepspeed and args.strategy:
        problems.append("--deepspeed and --strategy both choose the strategy; pass one.")
    problems += _auto_strategy_problems(args)
    problems += plan_data(args, _eval_strategy(args) != "no").problems
    if str(args.optim) not in OPTIMIZERS:
        problems.append(
            f"--optim {args.optim}: not built by gym_lightning (it needs a package or a device not used here); "
            f"use one of {', '.join(OPTIMIZERS)}."
        )
    if str(args.lr_scheduler_type) not in SCHEDULERS:
        problems.append(
            f"--lr_scheduler_type {args.lr_scheduler_type}: follows a validation metric, which gym train does not "
            f"feed to schedules; use one of {', '.join(SCHEDULERS)}."
        )
    problems += _ratio_problems(args) + _report_to_problems(args) + _adapter_problems(args) + _loss_problems(args)
    if args.padding_free and not (args.packing or args.neat_packing):
        problems.append(
            "--padding_free True is not supported without --packing: a batch is padded to its longest row here; "
            "--packing makes padding-free rows (as TRL's packing does)."
        )
    if args.eval_steps is not None and str(args.eval_strategy) not in ("no", "steps"):
        problems.append(f"--eval_steps needs --eval_strategy steps, got {args.eval_strategy}.")
    if template := _template_problem(args):
        problems.append(template)
    return problems


def _auto_strategy_problems(args: argparse.Namespace) -> list[str]:
    """``--strategy gym_auto`` with a flag that sets an argument of the strategy: refused, since the strategy does not
    exist yet when the flags are mapped (the planner picks it as the run starts, ``cli.resolve_auto_strategy``) and
    not every strategy it may pick takes every argument.

    Args:
        args: The parsed flags.
    """
    if args.strategy != AUTO_STRATEGY:
        return []
    set_flags = [
        flag
        for flag, given in (
            ("--ddp_timeout", args.ddp_timeout != HF_DDP_TIMEOUT),
            ("--sequence_parallel_size", args.sequence_parallel_size != 1),
        )
        if given
    ]
    return [
        f"{flag} sets an argument of the strategy, and --strategy {AUTO_STRATEGY} leaves the choice to the planner; "
        f"drop {flag}, or name the strategy (gym plan --config run.yaml ranks them)."
        for flag in set_flags
    ]


def _choice_problems(args: argparse.Namespace) -> list[str]:
    """Values outside a flag's choices: argparse checks a flag's value, not a default that a config file set."""
    problems = []
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        if not action.choices or value is None or not action.option_strings:
            continue
        for item in value if isinstance(value, list) else [value]:
            if str(item) not in {str(choice) for choice in action.choices}:
                choices = ", ".join(map(str, action.choices))
                problems.append(f"{action.option_strings[0]} {item}: choose one of {choices}.")
    return problems


def _lora_on(args: argparse.Namespace) -> bool:
    return bool(args.use_lora) or args.finetuning_type == "lora"


def _four_bit(args: argparse.Namespace) -> bool:
    return bool(args.load_in_4bit) or args.quantization_bit == 4


def _adapter_problems(args: argparse.Namespace) -> list[str]:
    """LoRA and 4-bit flags that need the flag that turns them on, or contradict it."""
    problems = []
    given_lora = [f"--{name}" for name in LORA_FLAGS if getattr(args, name) is not None]
    if given_lora and not _lora_on(args):
        problems.append(f"{', '.join(given_lora)} need --use_lora.")
    if args.use_lora and args.finetuning_type == "full":
        problems.append("--use_lora and finetuning_type full contradict each other; pass one.")
    given_4bit = [f"--{name}" for name in QUANT_FLAGS if getattr(args, name) not in (None, False)]
    if given_4bit and not _four_bit(args):
        problems.append(f"{', '.join(given_4bit)} need --load_in_4bit.")
    if _four_bit(args) and not _lora_on(args):
        problems.append("--load_in_4bit freezes the base in 4 bits: add --use_lora (QLoRA) to train adapters on it.")
    return problems


def _loss_problems(args: argparse.Namespace) -> list[str]:
    """The loss-masking flags, which all set the one switch ``data.mask_prompt``."""
    chosen = {
        f"--{name} {value}": value
        for name in ("completion_only_loss", "assistant_only_loss")
        if (value := getattr(args, name)) is not None
    }
    if len(set(chosen.values())) > 1:
        return [f"{' and '.join(chosen)}: gym_lightning has one switch for both (data.mask_prompt); make them agree."]
    if args.train_on_prompt and any(chosen.values()):
        return [f"--train_on_prompt and {' '.join(chosen)} contradict each other; pass one."]
    return []


def _ratio_problems(args: argparse.Namespace) -> list[str]:
    # HF turns a ratio into steps with the total it computes from the data; here the total is known up front only
    # from --max_steps (the data set's size is known when Lightning builds the loader).
    flags = {"logging_steps": args.logging_steps, "eval_steps": args.eval_steps, "save_steps": args.save_steps}
    return [
        f"--{name} {value} is a ratio of the total steps: give --max_steps too, or a number of steps."
        for name, value in flags.items()
        if value is not None and 0 < value < 1 and args.max_steps <= 0
    ]


def _report_to_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    for name in _report_to(args.report_to):
        if name not in LOGGERS:
            problems.append(f"--report_to {name}: gym train logs to {', '.join(LOGGERS)} (or all, none).")
        elif (package := LOGGERS[name][1]) and importlib.util.find_spec(package) is None:
            problems.append(f"--report_to {name}: the {package} package is not installed (pip install {package}).")
    return problems


def _report_to(report_to: str | list[str] | None) -> list[str]:
    """HF's --report_to as a list of integrations; "all" is every installed one, "none" (HF's default) none."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "all" in names:
        return [name for name, (_, package) in LOGGERS.items() if package is None or importlib.util.find_spec(package)]
    return [name for name in names if name != "none"]


def to_cli_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``gym fit`` (LightningCLI) arguments equivalent to the parsed ``gym train`` flags.

    ``env`` (default ``os.environ``) tells the launcher's process layout (``launcher_topology``)."""
    raise_if_problems("Invalid gym train flags", flag_problems(args))
    ds_config = load_deepspeed_json(args.deepspeed) if args.deepspeed else {}
    # HF's defaults (1, 1.0) count as unset: the JSON's explicit numbers then win, as with HF's "auto".
    given_accumulation = None if args.gradient_accumulation_steps == 1 else args.gradient_accumulation_steps
    accumulation = adopted_value(ds_config.get("gradient_accumulation_steps"), given_accumulation) or 1
    clip = adopted_value(ds_config.get("gradient_clipping"), None if args.max_grad_norm == 1.0 else args.max_grad_norm)
    values: dict[str, Any] = {"seed_everything": args.seed}
    values |= _trainer_values(args, accumulation, 1.0 if clip is None else clip)
    values |= _topology_values(args, os.environ if env is None else env)
    values |= _model_values(args)
    values |= _data_values(args)
    cli_args = ["fit", *(f"--{key}={_format(value)}" for key, value in values.items())]
    if args.resume_from_checkpoint:
        resume = args.resume_from_checkpoint
        # HF: True resumes from the newest checkpoint of output_dir, which StepCheckpoint links as last.ckpt.
        cli_args.append(f"--ckpt_path={'last' if str(resume).lower() == 'true' else resume}")
    return cli_args


def launcher_topology(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(devices per node, nodes)`` of the launcher that started this process, ``None`` without one.

    torchrun (also ``python -m torch.distributed.run`` and ``accelerate launch``, which runs it) sets
    ``LOCAL_WORLD_SIZE``; the ``deepspeed`` launcher sets ``LOCAL_SIZE``; ``srun`` sets ``SLURM_STEP_NUM_TASKS`` and
    ``SLURM_STEP_NUM_NODES`` (only inside a job step, not in the batch script that calls srun).
    """
    if "WORLD_SIZE" in env and ("LOCAL_WORLD_SIZE" in env or "LOCAL_SIZE" in env):
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE") or env["LOCAL_SIZE"])
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_STEP_NUM_NODES" in env:
        world, nodes = int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_STEP_NUM_NODES"])
        local = world // max(1, nodes)
    else:
        return None
    if local < 1 or world % local:
        raise GymUserError(
            f"the launcher started {world} processes, not a multiple of {local} per node; start the same number of "
            "processes on every node."
        )
    return local, world // local


def launcher_node_rank(env: Mapping[str, str]) -> dict[str, str]:
    """``NODE_RANK`` for Lightning where the launcher names it otherwise: the ``deepspeed`` launcher sets
    ``CROSS_RANK`` only, and Lightning's environment reads ``NODE_RANK``/``GROUP_RANK`` (else node 0 everywhere,
    so the second node's ranks would collide with the first's)."""
    if "CROSS_RANK" in env and "NODE_RANK" not in env and "GROUP_RANK" not in env:
        return {"NODE_RANK": env["CROSS_RANK"]}
    return {}


def _topology_values(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    launched = launcher_topology(env)
    devices: int | str | list[int] = _devices(args.devices) if args.devices is not None else "auto"
    num_nodes = args.num_nodes if args.num_nodes is not None else 1
    if launched is not None:
        devices = launched[0] if args.devices is None else devices
        num_nodes = launched[1] if args.num_nodes is None else num_nodes
    return {"trainer.devices": devices, "trainer.num_nodes": num_nodes}


def _trainer_values(args: argparse.Namespace, accumulation: int, clip: float) -> dict[str, Any]:
    values: dict[str, Any] = {
        "trainer.accelerator": "cpu" if args.use_cpu else args.accelerator,
        "trainer.precision": "bf16-mixed" if args.bf16 else "16-mixed" if args.fp16 else "32-true",
        "trainer.accumulate_grad_batches": accumulation,
        "trainer.gradient_clip_val": clip,
        "trainer.log_every_n_steps": _steps(args.logging_steps, args.max_steps),
        "trainer.default_root_dir": args.output_dir or "trainer_output",
    }
    if args.disable_tqdm:
        values["trainer.enable_progress_bar"] = False
    if args.deepspeed:
        init_args = {"config": args.deepspeed if isinstance(args.deepspeed, dict) else str(args.deepspeed)}
        values["trainer.strategy"] = {"class_path": "gym_lightning.strategies.ZeROStrategy", "init_args": init_args}
    elif args.strategy:
        values["trainer.strategy"] = args.strategy
    if args.ddp_timeout != HF_DDP_TIMEOUT:
        timeout = {"timeout": str(timedelta(seconds=args.ddp_timeout))}
        values["trainer.strategy"] = with_init_args(values.get("trainer.strategy"), "--ddp_timeout", timeout)
    if args.sequence_parallel_size != 1:
        size = {"sequence_parallel_size": args.sequence_parallel_size}
        values["trainer.strategy"] = with_init_args(values.get("trainer.strategy"), "--sequence_parallel_size", size)
    if loggers := _report_to(args.report_to):
        values["trainer.logger"] = [
            _logger(name, values["trainer.default_root_dir"], args.run_name) for name in loggers
        ]
    if args.max_steps > 0:
        values |= {"trainer.max_steps": args.max_steps, "trainer.max_epochs": -1}
    else:
        values |= {"trainer.max_epochs": math.ceil(args.num_train_epochs)}
    return values | _eval_values(args, accumulation) | _callback_values(args)


def with_init_args(strategy: str | dict[str, Any] | None, flag: str, init_args: dict[str, Any]) -> dict[str, Any]:
    """``strategy`` (a registered name, a class dict, or ``None`` for auto, which becomes ``gym_ddp``) as a class
    dict with ``init_args`` added: what ``flag`` (``--ddp_timeout``, ``--sequence_parallel_size``) sets."""
    from lightning.pytorch.strategies import StrategyRegistry

    import gym_lightning.strategies  # noqa: F401 - registers gym_lightning's names

    if isinstance(strategy, dict):
        return {**strategy, "init_args": {**strategy.get("init_args", {}), **init_args}}
    name = "gym_ddp" if strategy in (None, "auto") else strategy
    if name not in StrategyRegistry:
        raise GymUserError(f"--strategy {name!r} is not a registered strategy name; see gym fit --help.")
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    if missing := [key for key in init_args if key not in inspect.signature(cls).parameters]:
        raise GymUserError(f"{flag}: strategy {name!r} ({cls.__name__}) has no {missing[0]} argument; drop it.")
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {**entry["init_params"], **init_args}}


def _steps(value: float, max_steps: int) -> int:
    """HF's logging/eval/save steps: a count, or below 1 a ratio of the total steps rounded up."""
    return math.ceil(value * max_steps) if 0 < value < 1 else int(value)


def _eval_strategy(args: argparse.Namespace) -> str:
    """HF's evaluation strategy: as given, else ``steps`` with ``--eval_steps``, ``epoch`` with ``--do_eval``."""
    given = str(args.eval_strategy) if str(args.eval_strategy) != "no" else None
    return given or ("steps" if args.eval_steps else "epoch" if args.do_eval else "no")


def _eval_values(args: argparse.Namespace, accumulation: int) -> dict[str, Any]:
    strategy = _eval_strategy(args)
    if strategy == "no":
        return {"trainer.limit_val_batches": 0, "trainer.num_sanity_val_steps": 0}
    if strategy == "epoch":
        return {"trainer.check_val_every_n_epoch": 1, "trainer.val_check_interval": None}
    # Lightning's interval counts micro-batches; HF's eval_steps counts optimizer steps (default: logging_steps).
    steps = _steps(args.eval_steps or args.logging_steps, args.max_steps)
    return {"trainer.check_val_every_n_epoch": None, "trainer.val_check_interval": steps * accumulation}


def _logger(name: str, output_dir: str, run_name: str | None) -> dict[str, Any]:
    class_path = LOGGERS[name][0]
    init_args: dict[str, Any] = {"save_dir": output_dir}
    if name in ("csv", "tensorboard"):
        init_args |= {"name": "logs"} | ({"version": run_name} if run_name else {})
    elif run_name:
        init_args["name" if name == "wandb" else "run_name"] = run_name
    return {"class_path": class_path, "init_args": init_args}


def _callback_values(args: argparse.Namespace) -> dict[str, Any]:
    output_dir = args.output_dir or "trainer_output"
    # trainer_state.json (log_history) and curves.png in output_dir, where HF users look (a CurvesCallback).
    state = {"class_path": "gym_lightning.callbacks.TrainerStateCallback", "init_args": {"output_dir": output_dir}}
    if args.max_steps <= 0 and args.num_train_epochs != int(args.num_train_epochs):
        # HF: ceil(epochs x steps per epoch) steps; the steps per epoch are known once the DataLoader exists.
        fraction = {
            "class_path": "gym_lightning.callbacks.EpochFraction",
            "init_args": {"epochs": args.num_train_epochs},
        }
        state = [state, fraction]
    else:
        state = [state]
    strategy = str(args.save_strategy)
    if strategy == "no":
        return {"trainer.enable_checkpointing": False, "trainer.callbacks": state}
    keep = -1 if args.save_total_limit is None else args.save_total_limit
    dirpath = str(Path(output_dir) / "checkpoints")
    if strategy == "steps":
        init_args = {"dirpath": dirpath, "every_n_steps": _steps(args.save_steps, args.max_steps), "keep_last": keep}
        checkpoint = {"class_path": "gym_lightning.checkpointing.StepCheckpoint", "init_args": init_args}
    else:
        init_args = {"dirpath": dirpath, "every_n_epochs": 1, "save_top_k": keep, "monitor": "step", "mode": "max"}
        checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": init_args}
    return {"trainer.enable_checkpointing": True, "trainer.callbacks": [checkpoint, *state]}


def _model_values(args: argparse.Namespace) -> dict[str, Any]:
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
        "model.scheduler_kwargs": _json_dict(args.lr_scheduler_kwargs, "--lr_scheduler_kwargs"),
        "model.warmup_steps": 0 if warmup < 1 else int(warmup),
        "model.warmup_ratio": ratio,
        "export.output_dir": str(Path(args.output_dir or "trainer_output") / "hf"),
    }
    values |= _fast_path_values(args)
    if _lora_on(args):
        values["model.lora"] = _lora_values(args)
    if _four_bit(args):
        values["model.quantization"] = _quantization_values(args)
    return values


# HF's liger_kernel_config keys -> models.fused.FusedOps fields (cross_entropy without the head: not offered, the
# fused linear cross-entropy is what saves the logits' memory).
LIGER_CONFIG_KEYS = {
    "rope": "rope",
    "swiglu": "swiglu",
    "rms_norm": "rms_norm",
    "fused_linear_cross_entropy": "linear_cross_entropy",
}


def _fast_path_values(args: argparse.Namespace) -> dict[str, Any]:
    """``model.compile`` and ``model.fused_ops`` of HF's --torch_compile* flags (a backend or mode turns compile on,
    as in transformers) and --use_liger_kernel / --liger_kernel_config (LLaMA-Factory's --enable_liger_kernel)."""
    values: dict[str, Any] = {}
    settings = {"backend": args.torch_compile_backend, "mode": args.torch_compile_mode}
    if args.torch_compile or any(value is not None for value in settings.values()):
        chosen = {key: value for key, value in settings.items() if value is not None}
        values["model.compile"] = chosen or True
    config = _json_dict(args.liger_kernel_config, "--liger_kernel_config") or {}
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


def _json_dict(kwargs: dict[str, Any] | str | None, flag: str) -> dict[str, Any] | None:
    """A dict flag of HF's (``--lr_scheduler_kwargs``, ``liger_kernel_config``): a dict (from a YAML/JSON file) or
    its JSON text (from the command line)."""
    if isinstance(kwargs, str):
        try:
            return json.loads(kwargs)
        except json.JSONDecodeError as err:
            raise GymUserError(f"{flag} {kwargs!r} is not JSON: {err}") from err
    return kwargs


def _data_values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {"data.dataset": None, "data.format": args.data_format}
    if not args.dataloader_pin_memory:  # HF's default (True) pins on a GPU only, as data.pin_memory's None does
        values["data.pin_memory"] = False
    values |= plan_data(args, _eval_strategy(args) != "no").values
    if values.get("data.columns") is None:
        values.pop("data.columns", None)
    values |= {
        "data.max_seq_length": args.max_seq_length,
        "data.packing": bool(args.packing or args.neat_packing),
        "data.mask_prompt": _mask_prompt(args),
        "data.batch_size": args.per_device_train_batch_size,
        "data.eval_batch_size": args.per_device_eval_batch_size,
        "data.num_workers": args.dataloader_num_workers,
        "data.seed": args.seed if args.data_seed is None else args.data_seed,
    }
    if args.dataset_num_proc is not None:
        values["data.num_proc"] = args.dataset_num_proc
    if args.dataset_streaming:
        values["data.streaming"] = True
    return values


def _mask_prompt(args: argparse.Namespace) -> bool:
    """``data.mask_prompt``: TRL's completion/assistant-only switches where given, else not ``--train_on_prompt``."""
    chosen = [value for value in (args.completion_only_loss, args.assistant_only_loss) if value is not None]
    return bool(chosen[0]) if chosen else not args.train_on_prompt


def _template_problem(args: argparse.Namespace) -> str | None:
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


def flag_notes(args: argparse.Namespace) -> list[str]:
    """Info lines about flags that are accepted with a meaning worth saying (printed on rank 0 before the run)."""
    notes = plan_data(args, _eval_strategy(args) != "no").notes
    if args.template is not None:
        notes.append(
            f"--template {args.template}: chats are rendered with the tokenizer's own chat template, and alpaca or "
            "prompt/completion records with gym_lightning's prompts (LLaMA-Factory renders those with the template)."
        )
    if str(args.chat_template_format).lower() != "none":
        notes.append(
            f"--chat_template_format {args.chat_template_format}: chats are rendered with the tokenizer's own chat "
            "template and vocabulary (PEFT's script would set that template, add its tokens and resize the "
            "embeddings), and --dataset_text_field names no column (that script writes the rendered chats there)."
        )
    return notes


def _devices(devices: str) -> int | str | list[int]:
    text = str(devices).strip()
    if text.isdigit() or (text.startswith("-") and text[1:].isdigit()):
        return int(text)
    if "," in text or text.startswith("["):
        return [int(part) for part in text.strip("[]").split(",") if part.strip()]
    return text


def _format(value: Any) -> str:
    """A value as jsonargparse reads it: JSON for containers/None/bools, plain text otherwise."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def flags_for_settings(message: str) -> str:
    """``message`` with ``(gym train: --flag)`` after the first mention, per line, of each setting a flag sets.

    Errors from below (the strategy, the module) name ``gym fit`` settings; a ``gym train`` user knows the flags.
    """
    return "\n".join(_flags_for_settings_in_line(line) for line in message.split("\n"))


def _flags_for_settings_in_line(line: str) -> str:
    seen: set[str] = set()

    def annotate(match: re.Match[str]) -> str:
        setting = match.group(1)
        if setting in seen:  # once per line: a conflict names its setting twice (the value and the fix)
            return setting
        seen.add(setting)
        return f"{setting} (gym train: {SETTING_FLAGS[setting]})"

    return _SETTING_PATTERN.sub(annotate, line)


def apply_tf32(tf32: bool | None) -> None:
    """HF's ``--tf32``: TF32 matmuls and convolutions on Ampere+ GPUs (no effect on CPU); ``None`` leaves torch's.

    Set in this process, before the run: every rank runs ``gym train`` itself (a launcher's, or Lightning's
    re-run of the command line), so each one sets it. Not part of the ``--print_config`` YAML."""
    if tf32 is None:
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``gym train``."""
    from gym_lightning.cli import run_lightning_cli

    args = parse_train_args(list(sys.argv[1:] if argv is None else argv))
    cli_args = to_cli_args(args)
    for note in flag_notes(args):
        rank_zero_info(note)
    apply_tf32(args.tf32)
    os.environ.update(launcher_node_rank(os.environ))
    if args.print_config:
        cli_args.insert(1, "--print_config")
    with warnings.catch_warnings():
        # LightningCLI warns when it gets args while sys.argv holds others; here the args ARE the translated argv
        # (sys.argv must stay as it is: Lightning re-runs it to start the other ranks).
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        try:
            run_lightning_cli(cli_args)
        except GymUserError as err:
            raise GymUserError(flags_for_settings(str(err))) from err


__all__ = [
    "DATACLASSES",
    "SETTING_FLAGS",
    "DataArguments",
    "GymArguments",
    "GymTrainingArguments",
    "ModelArguments",
    "TrainArgumentParser",
    "build_parser",
    "flag_notes",
    "flag_problems",
    "flags_for_settings",
    "launcher_node_rank",
    "launcher_topology",
    "lora_targets",
    "main",
    "parse_train_args",
    "refused_flags",
    "to_cli_args",
]
