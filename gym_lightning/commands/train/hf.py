"""Hugging Face's flags: every ``TrainingArguments`` field (HF's names, types and defaults: the parser is
``HfArgumentParser`` over them) and the model and data flags of its ``run_clm.py`` example, with the table of how
each ``TrainingArguments`` field is read (``TRAINING_ARGUMENTS``).

``TrainingArguments.__post_init__`` is not run (``GymTrainingArguments``): it starts accelerate's ``PartialState`` (a
process group under torchrun) and DeepSpeed, which Lightning owns here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from gym_lightning.commands.train.rows import Row, accepted, mapped, refused

HF_DDP_TIMEOUT = 1800  # seconds, TrainingArguments' default: Lightning's default collective timeout too
# A field of another transformers version than the table's: refused unless at its default.
UNKNOWN_FIELD = refused("gym train has no equivalent; leave it at its default")
_HUB = "gym train does not upload; upload <output_dir>/hf with `huggingface-cli upload`"
_EVAL = "validation computes eval_loss only (no predictions or compute_metrics); leave it at its default"
_LOADER = "the DataLoader takes torch's defaults besides --dataloader_num_workers and --dataloader_pin_memory"
_BEST = "checkpoints are kept by step (--save_total_limit) and the final model is the last one"
_DDP = "a setting of gym fit's DDP strategy (trainer.strategy gym_ddp, init_args {})"
_TRACKIO = "trackio is not among --report_to's loggers (csv, tensorboard, wandb, mlflow)"
_CHECKPOINTING = "gradient checkpointing is non-reentrant, one decoder layer a unit: use --gradient_checkpointing"

TRAINING_ARGUMENTS: dict[str, Row] = {
    "output_dir": mapped("trainer.default_root_dir (logs, checkpoints/); the model is exported to <output_dir>/hf"),
    "per_device_train_batch_size": mapped("data.batch_size"),
    "num_train_epochs": mapped("trainer.max_epochs; a fraction trains ceil(fraction x steps per epoch) steps"),
    "max_steps": mapped("trainer.max_steps (overrides --num_train_epochs, as in HF)"),
    "learning_rate": mapped("model.lr"),
    "lr_scheduler_type": mapped("model.hf_scheduler (transformers.get_scheduler); plateau and greedy are refused"),
    "lr_scheduler_kwargs": mapped("model.scheduler_kwargs"),
    "warmup_steps": mapped("model.warmup_steps; below 1 a ratio of the total steps (model.warmup_ratio)"),
    "optim": mapped("model.optim, built as the HF Trainer builds it (optim.build_optimizer)"),
    "optim_args": refused(
        "the optimizers take --learning_rate, --weight_decay and (AdamW) --adam_beta1/2, --adam_epsilon"
    ),
    "weight_decay": mapped("model.weight_decay, on HF's parameters (model.decay_rule hf: not biases or norms)"),
    "adam_beta1": mapped("model.betas[0]"),
    "adam_beta2": mapped("model.betas[1]"),
    "adam_epsilon": mapped("model.eps"),
    "optim_target_modules": refused("GaLore/APOLLO optimizers are not built here; use --optim"),
    "gradient_accumulation_steps": mapped("trainer.accumulate_grad_batches (a DeepSpeed JSON's number if left at 1)"),
    "average_tokens_across_devices": refused("the loss is always normalised by the tokens of the whole step"),
    "max_grad_norm": mapped("trainer.gradient_clip_val (a DeepSpeed JSON's gradient_clipping if left at 1.0)"),
    "label_smoothing_factor": refused("the loss is the plain token cross-entropy; label smoothing is not wired in"),
    "bf16": mapped("trainer.precision bf16-mixed (fp32 weights, as HF's flag)"),
    "fp16": mapped("trainer.precision 16-mixed"),
    "bf16_full_eval": refused("validation runs in the training precision (--bf16/--fp16)"),
    "fp16_full_eval": refused("validation runs in the training precision (--bf16/--fp16)"),
    "tf32": mapped("torch's TF32 switches, set in each rank's process"),
    "activation_checkpointing": refused(_CHECKPOINTING),
    "activation_checkpointing_kwargs": refused(_CHECKPOINTING),
    "gradient_checkpointing": mapped("model.gradient_checkpointing (each decoder layer)"),
    "gradient_checkpointing_kwargs": refused(_CHECKPOINTING),
    "torch_compile": mapped("model.compile (each decoder layer compiled, models.compiled)"),
    "torch_compile_backend": mapped("model.compile.backend (turns compilation on, as in transformers)"),
    "torch_compile_mode": mapped("model.compile.mode (turns compilation on, as in transformers)"),
    "use_liger_kernel": mapped("model.fused_ops with Liger's kernels (models.fused)"),
    "liger_kernel_config": mapped("model.fused_ops' switches (rope, swiglu, rms_norm, fused_linear_cross_entropy)"),
    "use_cache": refused("training never uses the KV cache"),
    "neftune_noise_alpha": refused("NEFTune's embedding noise is not wired in"),
    "torch_empty_cache_steps": refused("the CUDA cache is left to torch's allocator"),
    "auto_find_batch_size": refused("gym plan (or --strategy gym_auto) finds what fits before the run"),
    "logging_strategy": refused("the loss is logged every --logging_steps optimizer steps (steps)"),
    "logging_steps": mapped("trainer.log_every_n_steps; below 1 a ratio of --max_steps"),
    "logging_first_step": refused("the steps logged are the multiples of --logging_steps"),
    "log_on_each_node": refused("rank 0 logs"),
    "logging_nan_inf_filter": refused("a non-finite loss is gym fit's nonfinite section's to handle (NonFiniteGuard)"),
    "include_num_input_tokens_seen": refused("token counts are not added to the logs"),
    "log_level": accepted("gym_lightning's messages keep their own level"),
    "log_level_replica": accepted("gym_lightning's messages keep their own level"),
    "disable_tqdm": mapped("trainer.enable_progress_bar false"),
    "report_to": mapped("trainer.logger: csv, tensorboard, wandb, mlflow (all: those installed) in <output_dir>/logs"),
    "run_name": mapped("the loggers' run name (version, name or run_name)"),
    "project": refused(_TRACKIO),
    "trackio_space_id": refused(_TRACKIO),
    "trackio_bucket_id": refused(_TRACKIO),
    "trackio_static_space_id": refused(_TRACKIO),
    "eval_strategy": mapped("trainer.val_check_interval / check_val_every_n_epoch (steps with --eval_steps)"),
    "eval_steps": mapped("trainer.val_check_interval: N optimizer steps x accumulation (Lightning counts batches)"),
    "eval_delay": refused("validation starts at the first --eval_steps"),
    "per_device_eval_batch_size": mapped("data.eval_batch_size"),
    "prediction_loss_only": refused(_EVAL),
    "eval_on_start": refused("validation runs every --eval_steps (Lightning's sanity check is two batches)"),
    "eval_do_concat_batches": refused(_EVAL),
    "eval_use_gather_object": refused(_EVAL),
    "eval_accumulation_steps": refused(_EVAL),
    "include_for_metrics": refused(_EVAL),
    "batch_eval_metrics": refused(_EVAL),
    "save_only_model": refused("checkpoints hold what a resume needs; the final model is exported to <output_dir>/hf"),
    "save_strategy": mapped("trainer.callbacks: StepCheckpoint (steps), ModelCheckpoint (epoch), none (no)"),
    "save_steps": mapped("StepCheckpoint(every_n_steps) in <output_dir>/checkpoints, last.ckpt linked"),
    "save_on_each_node": refused("checkpoints are written once per job, into one folder"),
    "save_total_limit": mapped("StepCheckpoint(keep_last) / ModelCheckpoint(save_top_k); all by default, as HF"),
    "enable_jit_checkpoint": refused("checkpoints are written at --save_steps (atomically: a crash keeps the last)"),
    "push_to_hub": refused(_HUB),
    "hub_token": refused(_HUB),
    "hub_private_repo": refused(_HUB),
    "hub_model_id": refused(_HUB),
    "hub_strategy": refused(_HUB),
    "hub_always_push": refused(_HUB),
    "hub_revision": refused(_HUB),
    "load_best_model_at_end": refused(
        "the final model is the last one; pick a checkpoint from <output_dir>/checkpoints"
    ),
    "metric_for_best_model": refused(_BEST),
    "greater_is_better": refused(_BEST),
    "ignore_data_skip": refused("a resume continues at the saved data position (checkpointing.loader_state)"),
    "restore_callback_states_from_checkpoint": refused("a resume restores what Lightning's callbacks save"),
    "full_determinism": refused("--seed seeds every rank; deterministic kernels are not switched on"),
    "seed": mapped("seed_everything (and data.seed unless --data_seed)"),
    "data_seed": mapped("data.seed (the shuffle, the validation split and the mix)"),
    "use_cpu": mapped("trainer.accelerator cpu"),
    "accelerator_config": refused("accelerate is not used: Lightning places the data"),
    "parallelism_config": refused("use --strategy (gym_ddp, gym_fsdp, zero1-3) and --sequence_parallel_size"),
    "dataloader_drop_last": refused("the last, partial batch of an epoch is kept"),
    "dataloader_num_workers": mapped("data.num_workers"),
    "dataloader_pin_memory": mapped("data.pin_memory false when off (on: pinned on a GPU, as data.pin_memory null)"),
    "dataloader_persistent_workers": refused(_LOADER),
    "dataloader_prefetch_factor": refused(_LOADER),
    "dataloader_multiprocessing_context": refused(_LOADER),
    "dataloader_in_order": refused("batches come in the sampler's order"),
    "remove_unused_columns": accepted(
        "the data module builds every batch from its format's fields, whatever the data set's other columns (TRL's "
        "preference scripts pass --no_remove_unused_columns)"
    ),
    "label_names": refused("the labels are the data module's (labels)"),
    "train_sampling_strategy": refused("the training data is shuffled every epoch (random)"),
    "length_column_name": refused("batches are not grouped by length"),
    "ddp_find_unused_parameters": refused(_DDP.format("find_unused_parameters")),
    "ddp_bucket_cap_mb": refused("DDP's bucket size is torch's default"),
    "ddp_broadcast_buffers": refused("DDP broadcasts buffers as torch does by default"),
    "ddp_static_graph": refused(_DDP.format("static_graph")),
    "ddp_backend": refused(_DDP.format("process_group_backend")),
    "ddp_timeout": mapped("the strategy's collective timeout (gym_ddp without --strategy or --deepspeed)"),
    "fsdp": refused(
        "use --strategy gym_fsdp (full_shard, one unit per decoder layer); shard_grad_op, hybrid_shard and offload "
        "are GymFSDPStrategy's init_args sharding and cpu_offload (gym fit's trainer.strategy)"
    ),
    "fsdp_config": refused(
        "use --strategy gym_fsdp: it wraps each decoder layer itself, --gradient_checkpointing checkpoints "
        "activations; its other settings are GymFSDPStrategy's init_args (gym fit's trainer.strategy)"
    ),
    "deepspeed": mapped('trainer.strategy ZeROStrategy(config=ds.json), its "auto" values from these flags'),
    "debug": refused("HF's debug modes have no equivalent here"),
    "skip_memory_metrics": mapped(
        "False adds trainer.callbacks MemoryCallback: per-rank parameter, gradient, optimizer and peak memory, "
        "its table and memory.json in the log directory (gym plan predicts them)"
    ),
    "do_train": accepted("gym train trains"),
    "do_eval": mapped("validation every epoch unless --eval_strategy/--eval_steps say otherwise"),
    "do_predict": accepted("nothing is predicted after training (gym predict does that)"),
    "resume_from_checkpoint": mapped("ckpt_path: True resumes from <output_dir>/checkpoints/last.ckpt, a path from it"),
    "local_rank": accepted("the launcher's rank, which Lightning reads from the environment"),
}
# Why a TrainingArguments field is refused (as the table says).
REFUSAL_REASONS = {name: row.note for name, row in TRAINING_ARGUMENTS.items() if row.kind == "refused"}
# The fields that set something, or take any value.
MAPPED_FIELDS = frozenset(name for name, row in TRAINING_ARGUMENTS.items() if row.kind != "refused")


@dataclass
class GymTrainingArguments(TrainingArguments):
    """``TrainingArguments`` without ``__post_init__``: that one starts accelerate's ``PartialState`` (a process group
    under torchrun, DeepSpeed with --deepspeed) and checks devices; Lightning does both here."""

    def __post_init__(self) -> None:
        pass


@dataclass
class ModelArguments:
    """The model flags of HF's ``run_clm.py`` (TRL's and LLaMA-Factory's share them)."""

    model_name_or_path: str = field(metadata={"help": "Preset (tiny-llama, tiny-qwen3), folder or hub name."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
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
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code from the model repository."})


@dataclass
class DataArguments:
    """The data flags of HF's ``run_clm.py`` (and TRL's ``ScriptArguments`` names of the same settings)."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "TRL, run_clm: a data file, glob, folder (split by file names) or Hub set."}
    )
    dataset_config: str | None = field(
        default=None, metadata={"aliases": ["--dataset_config_name"], "help": "Subset of a Hub --dataset_name."}
    )
    dataset_streaming: bool = field(
        default=False, metadata={"aliases": ["--streaming"], "help": "Read and tokenize on the fly (data.streaming)."}
    )
    train_file: list[str] | None = field(default=None, metadata={"help": "Training .jsonl/.json/.txt files or globs."})
    validation_file: list[str] | None = field(default=None, metadata={"help": "Validation files or globs."})
    validation_split_percentage: int = field(default=0, metadata={"help": "Percent of --train_file held out."})
    max_samples: int | None = field(
        default=None, metadata={"aliases": ["--max_train_samples"], "help": "Keep the first N records of each set."}
    )
    max_seq_length: int = field(
        default=1024,
        metadata={
            "aliases": ["--max_length", "--cutoff_len", "--model_max_length", "--max_seq_len"],
            "help": "Tokens per sample (TRL's default 1024).",
        },
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"aliases": ["--preprocessing_num_workers"], "help": "Tokenization processes."}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Accepted: the cache follows file contents."})


# The flags of run_clm.py (HF's causal-LM example) that gym train reads, and what each sets.
RUN_CLM: dict[str, Row] = {
    "model_name_or_path": mapped("model.model (a preset, a folder or a Hub name)"),
    "tokenizer_name": mapped("model.tokenizer"),
    "torch_dtype": mapped("model.torch_dtype"),
    "trust_remote_code": mapped("model.trust_remote_code (and the tokenizer's)"),
    "dataset_name": mapped("data.train_files (a file, glob or folder) or data.sources (a Hub data set)"),
    "dataset_config_name": mapped("the Hub data set's subset (data.sources[].subset)", flag="dataset_config"),
    "train_file": mapped("data.train_files"),
    "validation_file": mapped("data.val_files"),
    "validation_split_percentage": mapped("data.val_split (a percentage of the training records)"),
    "max_train_samples": mapped("data.sources[].max_samples (the first N records of each set)", flag="max_samples"),
    "streaming": mapped("data.streaming", flag="dataset_streaming"),
    "preprocessing_num_workers": mapped("data.num_proc", flag="dataset_num_proc"),
    "overwrite_cache": accepted("the tokenized cache is keyed by the files' contents"),
}

__all__ = [
    "HF_DDP_TIMEOUT",
    "MAPPED_FIELDS",
    "REFUSAL_REASONS",
    "RUN_CLM",
    "TRAINING_ARGUMENTS",
    "UNKNOWN_FIELD",
    "DataArguments",
    "GymTrainingArguments",
    "ModelArguments",
]
