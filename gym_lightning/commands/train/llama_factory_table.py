"""How ``gym train`` reads every field of LLaMA-Factory's hparams: its model, data and finetuning arguments and what
its training arguments add to transformers' ``Seq2SeqTrainingArguments``.

A key of an LLaMA-Factory YAML is a ``gym train`` flag where a row is ``mapped`` (``Row.flag`` names the flag where
the name differs: ``cutoff_len`` is ``--max_seq_length``); ``accepted`` keys are read by LLaMA-Factory only in modes
gym train does not run (inference, export, multimodal inputs, a refused method's own settings); ``refused`` keys take
their LLaMA-Factory default (``Row.default``, for keys that are no flag here) and are refused otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gym_lightning.commands.train.rows import Row, accepted, mapped, refused
from gym_lightning.commands.train.trl import DPO_CONFIG, MODEL_CONFIG


def _off(why: str, default: Any = False) -> Row:
    """A key that is no flag here, taken at its LLaMA-Factory default only."""
    return refused(why, default=default)


_INFERENCE = accepted("an inference setting of LLaMA-Factory's chat and eval commands (not read while training)")
_EXPORT = accepted("a setting of llamafactory-cli export; gym export writes <output_dir>/hf's folder")
_MEDIA = accepted("a multimodal input setting; gym train trains on text")
_HUB_TOKEN = accepted("Hub tokens come from the environment (HF_TOKEN) or huggingface-cli login")
_KT = "KTransformers is not used by gym_lightning"
_VOCAB = "the tokenizer's vocabulary is used as it is (save a tokenizer with the tokens added, --tokenizer_name)"
_PPO = "PPO arrives with no stage here (online RL: generation, a reward and a value model in the loop)"
_ONLY_WITH = "read only with {} (refused here)"

MODEL: dict[str, Row] = {
    "model_name_or_path": mapped("model.model"),
    "adapter_name_or_path": refused("a run starts new adapters; continue one with --resume_from_checkpoint"),
    "adapter_folder": _off("adapters are created once per run", None),
    "cache_dir": _off("models and data sets use the Hugging Face cache (HF_HOME)", None),
    "use_fast_tokenizer": _off("the tokenizer loads as AutoTokenizer loads it (fast where there is one)", True),
    "resize_vocab": refused("the model's embeddings are used as they are"),
    "split_special_tokens": _off("special tokens are never split here"),
    "add_tokens": _off(_VOCAB, None),
    "add_special_tokens": refused(_VOCAB),
    "new_special_tokens_config": _off(_VOCAB, None),
    "init_special_tokens": _off(_VOCAB, "noise_init"),
    "model_revision": MODEL_CONFIG["model_revision"],
    "low_cpu_mem_usage": accepted("models are built on the meta device and loaded once here anyway"),
    "rope_scaling": refused("set rope_scaling in the model's config.json"),
    "flash_attn": refused(
        "flash attention 3 is not among gym_lightning's attn_implementation values", "auto", "disabled", "sdpa", "fa2"
    ),
    "shift_attn": _off("LongLoRA's shifted sparse attention is not wired in"),
    "mixture_of_depths": _off("mixture of depths is not wired in", None),
    "use_unsloth": refused("Unsloth is not used by gym_lightning"),
    "use_unsloth_gc": _off("Unsloth is not used by gym_lightning"),
    "enable_liger_kernel": mapped("model.fused_ops with Liger's kernels (--use_liger_kernel)"),
    "moe_aux_loss_coef": _off("set router_aux_loss_coef in the model's config.json", None),
    "disable_gradient_checkpointing": mapped("model.gradient_checkpointing false (on by default, as in LLaMA-Factory)"),
    "use_reentrant_gc": accepted("activation checkpointing is non-reentrant here"),
    "upcast_layernorm": refused("use --bf16 (mixed precision keeps fp32 weights)"),
    "upcast_lmhead_output": _off("the loss is computed in fp32 here (chunked head)"),
    "train_from_scratch": _off("training starts from the model's weights"),
    "infer_backend": _INFERENCE,
    "offload_folder": _INFERENCE,
    "use_kv_cache": _INFERENCE,
    "use_v1_kernels": _off("LLaMA-Factory's v1 kernels are not used; --use_liger_kernel fuses"),
    "infer_dtype": _INFERENCE,
    "hf_hub_token": _HUB_TOKEN,
    "ms_hub_token": _off("ModelScope is not read", None),
    "om_hub_token": _off("Modelers is not read", None),
    "print_param_status": refused("the model summary lists trainable parameters"),
    "trust_remote_code": mapped("model.trust_remote_code (and the tokenizer's)"),
    "quantization_method": refused(
        "the 4-bit base is bitsandbytes' NF4/FP4 (quantization_method: bnb)", "bitsandbytes"
    ),
    "quantization_bit": refused("gym_lightning quantises to 4 bits only (quantization_bit: 4)", 4),
    "quantization_type": mapped("model.quantization.quant_type (nf4, fp4)", flag="bnb_4bit_quant_type"),
    "double_quantization": mapped("model.quantization.double_quant (on, as LLaMA-Factory's, with quantization_bit 4)"),
    "quantization_device_map": refused("the strategy places the 4-bit base"),
    **dict.fromkeys(
        ("image_max_pixels", "image_min_pixels", "image_do_pan_and_scan", "crop_to_patches", "video_max_pixels"), _MEDIA
    ),
    **dict.fromkeys(
        ("video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video", "audio_sampling_rate"), _MEDIA
    ),
    **dict.fromkeys(
        ("export_dir", "export_size", "export_device", "export_quantization_bit", "export_quantization_dataset"),
        _EXPORT,
    ),
    **dict.fromkeys(
        ("export_quantization_nsamples", "export_quantization_maxlen", "export_legacy_format", "export_hub_model_id"),
        _EXPORT,
    ),
    "use_kt": _off(_KT),
    **dict.fromkeys(
        ("kt_cpu_activation", "kt_weight_path", "kt_non_expert_weight_path", "kt_expert_checkpoint_path"),
        accepted(_ONLY_WITH.format("use_kt")),
    ),
    **dict.fromkeys(
        ("kt_use_lora_experts", "kt_lora_expert_num", "kt_lora_expert_intermediate_size"),
        accepted(_ONLY_WITH.format("use_kt")),
    ),
    **dict.fromkeys(
        ("vllm_maxlen", "vllm_gpu_util", "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config"), _INFERENCE
    ),
    **dict.fromkeys(
        ("sglang_maxlen", "sglang_mem_fraction", "sglang_tp_size", "sglang_config", "sglang_lora_backend"), _INFERENCE
    ),
}
DATA: dict[str, Row] = {
    "template": mapped("checked against the tokenizer's chat template, which renders the chats (one info line)"),
    "dataset": mapped("data.train_files or data.sources: data files, folders or dataset_info.json names"),
    "eval_dataset": mapped("data.val_files (files, or dataset_info.json names of files)"),
    "dataset_dir": mapped("the folder of dataset_info.json (ONLINE: every name a Hub data set)"),
    "media_dir": refused("gym train trains on text only"),
    "cutoff_len": mapped("data.max_seq_length", flag="max_seq_length"),
    "train_on_prompt": mapped("data.mask_prompt false"),
    "mask_history": refused("every assistant turn is a target here"),
    "streaming": mapped("data.streaming", flag="dataset_streaming"),
    "buffer_size": refused("a stream is read in file order here (shuffle the files beforehand)", 16384),
    "mix_strategy": mapped("data.mix: concat (its default), interleave_under, interleave_over"),
    "interleave_probs": mapped("the sources' weights (data.sources[].weight) of an interleave mix"),
    "overwrite_cache": accepted("the tokenized cache is keyed by the files' contents"),
    "preprocessing_batch_size": accepted("tokenization batches are 1,000 records here"),
    "preprocessing_num_workers": mapped("data.num_proc", flag="dataset_num_proc"),
    "max_samples": mapped("data.sources[].max_samples (the first N records of each set)"),
    "eval_num_beams": _INFERENCE,
    "ignore_pad_token_for_loss": refused("padding is never in the loss here", True),
    "val_size": mapped("data.val_split (a fraction; a count is refused)"),
    "eval_on_each_dataset": _off("validation reports one eval_loss over all validation data"),
    "packing": mapped("data.packing (stage pt: on unless false, as in LLaMA-Factory)"),
    "neat_packing": mapped("data.packing: packed rows never attend across samples here"),
    "tool_format": refused("tools go to the tokenizer's chat template (a tools column)"),
    "default_system": refused("put the system message in the data (a system field or turn)"),
    "enable_thinking": refused("chats are rendered by the tokenizer's chat template as they are", True),
    "preserve_thinking": _off("chats are rendered by the tokenizer's chat template as they are"),
    "tokenized_path": refused("tokenized data is cached by gym_lightning itself (data.cache_dir, $GYM_DATA_CACHE)"),
    "data_shared_file_system": accepted("each node tokenizes once into its own cache (a shared one works too)"),
}
FINETUNING: dict[str, Row] = {
    **dict.fromkeys(
        ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"),
        accepted(_ONLY_WITH.format("finetuning_type freeze")),
    ),
    "additional_target": replace(MODEL_CONFIG["lora_modules_to_save"], flag="lora_modules_to_save"),
    **dict.fromkeys(
        ("module_dropout", "oft_rank", "oft_block_size", "oft_target"),
        accepted(_ONLY_WITH.format("finetuning_type oft")),
    ),
    "create_new_adapter": refused("adapters are created once per run"),
    "lora_alpha": mapped("model.lora.alpha (default twice the rank, as LLaMA-Factory's)"),
    "lora_dropout": mapped("model.lora.dropout"),
    "lora_rank": mapped("model.lora.r", flag="lora_r"),
    "lora_target": mapped("model.lora.target_modules (all: every linear layer, its default)", "lora_target_modules"),
    "loraplus_lr_ratio": refused("LoRA+ learning rates are not wired in"),
    "loraplus_lr_embedding": accepted(_ONLY_WITH.format("loraplus_lr_ratio")),
    "use_rslora": MODEL_CONFIG["use_rslora"],
    "use_dora": MODEL_CONFIG["use_dora"],
    "pissa_init": refused("PiSSA initialisation is not wired in"),
    **dict.fromkeys(("pissa_iter", "pissa_convert"), accepted(_ONLY_WITH.format("pissa_init"))),
    "pref_beta": mapped("model.objective's beta (TRL's --beta; default 0.1)", flag="beta"),
    "pref_ftx": mapped(
        "the chosen completions' NLL, each completion's token mean over pairs, at this weight: stage dpo's loss_type "
        "sft (sft_average sequence), pref_loss simpo's cpo_alpha; refused with pref_loss orpo (its loss holds that "
        "NLL already) and stage kto"
    ),
    "pref_bco_weight": _off(
        "BCO's running reward baseline is not wired in (TRL's loss_type bco_pair is the pairwise loss without it)", 0.0
    ),
    "pref_loss": mapped(
        "sigmoid, hinge, ipo: stage dpo's loss_type (ipo per token, as LLaMA-Factory's); orpo, simpo: stages orpo, "
        "simpo; kto_pair refused (train stage kto on the pairs)"
    ),
    "dpo_label_smoothing": mapped(
        "cDPO's smoothing e of the sigmoid loss: loss_type [sigmoid, robust] weighted [2(1-e), -(1-2e)] with "
        "label_smoothing e, which is the same loss"
    ),
    "kto_chosen_weight": mapped("model.objective's desirable_weight (stage kto)", flag="desirable_weight"),
    "kto_rejected_weight": mapped("model.objective's undesirable_weight (stage kto)", flag="undesirable_weight"),
    "simpo_gamma": mapped("model.objective's simpo_gamma (pref_loss simpo; default 0.5)"),
    "ppo_buffer_size": _off(_PPO, 1),
    "ppo_epochs": _off(_PPO, 4),
    "ppo_score_norm": _off(_PPO),
    "ppo_target": _off(_PPO, 6.0),
    "ppo_whiten_rewards": _off(_PPO),
    "ref_model": mapped(
        "model.objective's ref_model (stages dpo, kto): the reference's folder; default: the policy's source, or with "
        "LoRA the base with the adapters off"
    ),
    "ref_model_adapters": _off(
        "the reference is ref_model's folder as it is: merge the adapters into it first (peft's merge_and_unload)", None
    ),
    "ref_model_quantization_bit": _off(
        "the reference is held in the policy's dtype (under QLoRA it is the 4-bit base with the adapters off)", None
    ),
    "reward_model": _off(_PPO, None),
    "reward_model_adapters": _off(_PPO, None),
    "reward_model_quantization_bit": _off(_PPO, None),
    "reward_model_type": _off(_PPO, "lora"),
    "ld_alpha": DPO_CONFIG["ld_alpha"],
    "use_galore": refused("GaLore is not wired in"),
    **dict.fromkeys(
        ("galore_target", "galore_rank", "galore_update_interval", "galore_scale", "galore_proj_type"),
        accepted(_ONLY_WITH.format("use_galore")),
    ),
    "galore_layerwise": accepted(_ONLY_WITH.format("use_galore")),
    "use_apollo": refused("APOLLO is not wired in"),
    **dict.fromkeys(
        ("apollo_target", "apollo_rank", "apollo_update_interval", "apollo_scale", "apollo_proj", "apollo_proj_type"),
        accepted(_ONLY_WITH.format("use_apollo")),
    ),
    **dict.fromkeys(
        ("apollo_scale_type", "apollo_layerwise", "apollo_scale_front"), accepted(_ONLY_WITH.format("use_apollo"))
    ),
    "use_badam": refused("BAdam is not wired in"),
    **dict.fromkeys(
        ("badam_mode", "badam_start_block", "badam_switch_mode", "badam_switch_interval", "badam_update_ratio"),
        accepted(_ONLY_WITH.format("use_badam")),
    ),
    **dict.fromkeys(("badam_mask_mode", "badam_verbose"), accepted(_ONLY_WITH.format("use_badam"))),
    "use_swanlab": _off("SwanLab is not among --report_to's loggers (csv, tensorboard, wandb, mlflow)"),
    **dict.fromkeys(
        ("swanlab_project", "swanlab_workspace", "swanlab_run_name", "swanlab_mode", "swanlab_api_key"),
        accepted(_ONLY_WITH.format("use_swanlab")),
    ),
    **dict.fromkeys(
        ("swanlab_logdir", "swanlab_lark_webhook_url", "swanlab_lark_secret"),
        accepted(_ONLY_WITH.format("use_swanlab")),
    ),
    "pure_bf16": refused("use --bf16 (mixed) or --torch_dtype bfloat16"),
    "stage": mapped("the stage (--stage): pt, sft, dpo (pref_loss orpo, simpo: stages orpo, simpo), kto; rm, ppo no"),
    "finetuning_type": refused("gym train trains LoRA adapters (lora) or the whole model (full)", None, "lora", "full"),
    "use_llama_pro": refused("LLaMA Pro is not wired in"),
    "use_adam_mini": refused("use --optim (adamw_torch_fused, adamw_torch, sgd, adagrad, rmsprop, adafactor)"),
    "use_mca": _off("Megatron-Core is not used: --strategy picks DDP, FSDP2 or ZeRO"),
    "use_megatron_bridge": _off("Megatron-Core is not used: --strategy picks DDP, FSDP2 or ZeRO"),
    "use_hyper_parallel": _off("use --strategy and --sequence_parallel_size"),
    "hyper_parallel_args": _off("use --strategy and --sequence_parallel_size", None),
    "hyper_parallel_cp_size": _off("use --sequence_parallel_size", 1),
    "use_muon": refused("use --optim (adamw_torch_fused, adamw_torch, sgd, adagrad, rmsprop, adafactor)"),
    "use_dft_loss": refused("gym_lightning trains with the NLL loss"),
    "use_asft_loss": _off("gym_lightning trains with the NLL loss"),
    "asft_alpha": accepted(_ONLY_WITH.format("use_asft_loss")),
    "use_eaft_loss": _off("gym_lightning trains with the NLL loss"),
    "eaft_alpha": accepted(_ONLY_WITH.format("use_eaft_loss")),
    "freeze_vision_tower": _MEDIA,
    "freeze_multi_modal_projector": _MEDIA,
    "freeze_language_model": _off("the language model trains (or its LoRA adapters)"),
    "compute_accuracy": refused("validation reports eval_loss (and exact match with gym fit's model.val_exact_match)"),
    "disable_shuffling": _off("the training data is shuffled every epoch"),
    "early_stopping_steps": _off("training runs --max_steps/--num_train_epochs", None),
    "plot_loss": accepted("curves.png is always written"),
    "include_effective_tokens_per_second": _off("token counts are not added to the logs"),
}
_RAY = accepted("a setting of LLaMA-Factory's Ray launch (USE_RAY); torchrun, srun or deepspeed launch gym train")
_PROFILER = accepted(_ONLY_WITH.format("enable_torch_profiler"))
_GENERATION = accepted(_ONLY_WITH.format("predict_with_generate"))
TRAINING: dict[str, Row] = {
    **dict.fromkeys(("ray_num_workers", "ray_init_kwargs", "master_addr", "master_port"), _RAY),
    "fp8": _off("fp8 training is not wired in; use --bf16"),
    **dict.fromkeys(("fp8_backend", "fp8_enable_fsdp_float8_all_gather"), accepted(_ONLY_WITH.format("fp8"))),
    "enable_torch_profiler": _off("use gym fit's trainer.profiler (Lightning's PyTorchProfiler)"),
    **dict.fromkeys(("profiler_output_dir", "profiler_wait_steps", "profiler_warmup_steps"), _PROFILER),
    **dict.fromkeys(("profiler_active_steps", "profiler_repeat", "profiler_record_shapes"), _PROFILER),
    **dict.fromkeys(("profiler_profile_memory", "profiler_with_stack", "profile_modules"), _PROFILER),
    "overwrite_output_dir": accepted("<output_dir> is reused as it is (checkpoints are kept by step)"),
    # Seq2SeqTrainingArguments
    "sortish_sampler": _off("the training data is shuffled every epoch"),
    "predict_with_generate": _off("validation computes eval_loss only (gym predict generates)"),
    **dict.fromkeys(("generation_max_length", "generation_num_beams", "generation_config"), _GENERATION),
}
TABLES: dict[str, dict[str, Row]] = {
    "ModelArguments": MODEL,
    "DataArguments": DATA,
    "FinetuningArguments": FINETUNING,
    "TrainingArguments (beyond transformers')": TRAINING,
}

__all__ = ["DATA", "FINETUNING", "MODEL", "TABLES", "TRAINING"]
