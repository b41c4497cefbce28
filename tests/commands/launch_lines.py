"""Launch lines copied from the documentation users follow, as data for ``test_launch_lines.py``.

Each ``LaunchLine`` holds the line (or YAML file) exactly as its source prints it, the URL it comes from, and every
change made to run it here: the model becomes a tiny local Llama folder, the data set a small local file, the run
is cut to 2 optimizer steps with its output under the test's temporary folder; a flag that has to go is listed in
``remove`` with the reason. Nothing else is changed: ``gym train`` promises the same flags as the HF Trainer, TRL and
LLaMA-Factory, so ``trl sft``, ``python run_clm.py``, ``python trl/scripts/sft.py``, ``llamafactory-cli train`` and
the ``deepspeed``/``torchrun``/``accelerate launch`` launchers in front of a script all become ``gym train`` with the
line's own flags (the test starts the ranks with torchrun, which is how gym train learns the world size); TRL's
``trl dpo``/``trl kto`` (and its ``trl/scripts/dpo.py``) are ``gym train --stage dpo``/``--stage kto``, the stage
being what the command names.

Placeholders in substituted values: ``{model}`` the tiny model folder, ``{data}`` the folder of the local data (a
Hub data set ``owner/name`` becomes the folder ``{data}/owner/name`` holding its splits as ``train``/``test``/...
files, the layout ``datasets`` reads as splits; a file name stays a file),
``{ds}`` the folder of the DeepSpeed JSON files (``DEEPSPEED_JSONS``), ``{out}`` this run's output folder, ``{nproc}``
the number of processes of the launch.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Where the copies were taken from: the commit of each repository's snapshot read on 2026-12-04, so a citation still
# points at the quoted text after the file changes upstream (LLaMA-Factory renamed its llama3 examples to qwen3 in
# its commit 95ac3f2; the llama3 ones are the ones its README still shows).
TRANSFORMERS_CLM_README = (
    "https://github.com/huggingface/transformers/blob/00aff44a1d63c9017ee0da9308ad4b7ba045bbf9/"
    "examples/pytorch/language-modeling/README.md"
)
TRANSFORMERS_DEEPSPEED_DOC = (
    "https://github.com/huggingface/transformers/blob/019da1e8268a76436582cccc51c03638d267aa5b/"
    "docs/source/en/deepspeed.md"
)
TRL = "https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8/"
PEFT = "https://github.com/huggingface/peft/blob/5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40/"
LLAMA_FACTORY = "https://github.com/hiyouga/LLaMA-Factory/blob/000526908ae92cc1567130559f04a3436855e0cd/"
# TRL's trl/scripts/dpo.py docstring is the same text in that commit and in the trl 1.16.0 wheel (the version the
# preference objectives follow); its docs/ are quoted at that commit (the newest snapshot read, 1.10.0.dev).
# The snapshot read on 2026-12-05 for the qwen3 pretraining example (its file is unchanged since 95ac3f2).
LLAMA_FACTORY_LATEST = "https://github.com/hiyouga/LLaMA-Factory/blob/ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30/"
GYM_README = "README.md of this repository"

# The arguments run_clm.py's README gives for "your own training and validation files"; the DeepSpeed guide's launch
# lines say `your_program.py <normal cl args> --deepspeed ds_config.json`, and these are run_clm.py's normal args.
RUN_CLM_OWN_FILES_ARGS = """\
    --model_name_or_path gpt2 \\
    --train_file path_to_train_file \\
    --validation_file path_to_validation_file \\
    --per_device_train_batch_size 8 \\
    --per_device_eval_batch_size 8 \\
    --do_train \\
    --do_eval \\
    --output_dir /tmp/test-clm"""

# DeepSpeed JSON files, verbatim, written into {ds} by the test.
DEEPSPEED_JSONS: dict[str, tuple[str, str]] = {
    # The file the transformers DeepSpeed guide's single-GPU line passes (`--deepspeed tests/deepspeed/...`).
    "ds_config_zero2.json": (
        "https://github.com/huggingface/transformers/blob/00e12e7c54598e50e7bef1540db3408f81916de1/"
        "tests/deepspeed/ds_config_zero2.json",
        """\
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "bf16": {
        "enabled": "auto"
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
""",
    ),
    # The guide's own ds_config_zero3.json (section "Notebook": `cat <<'EOT' > ds_config_zero3.json`).
    "ds_config_zero3.json": (
        TRANSFORMERS_DEEPSPEED_DOC + " (section Notebook)",
        """\
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "offload_param": {
            "device": "cpu",
            "pin_memory": true
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
""",
    ),
    "ds_z3_config.json": (
        LLAMA_FACTORY + "examples/deepspeed/ds_z3_config.json",
        """\
{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "zero_allow_untested_optimizer": true,
  "fp16": {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "bf16": {
    "enabled": "auto"
  },
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": false,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  }
}
""",
    ),
}

# LLaMA-Factory's three example YAMLs share everything below `### method`'s own keys; kept verbatim per file anyway
# (a reader compares each with its source).
LLAMA_FACTORY_LORA_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: alpaca_en_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
_LF_FULL_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
deepspeed: examples/deepspeed/ds_z3_config.json  # choices: [ds_z0_config.json, ds_z2_config.json, ds_z3_config.json]

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: alpaca_en_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
_LF_QLORA_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
quantization_bit: 4  # choices: [8 (bnb/hqq/eetq), 4 (bnb/hqq), 3 (hqq), 2 (hqq)]
quantization_method: bnb  # choices: [bnb, hqq, eetq]
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
# examples/train_lora/llama3_lora_pretrain.yaml and qwen3_lora_pretrain.yaml: stage pt on data/c4_demo.jsonl.
_LF_LORA_PRETRAIN = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: pt
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: c4_demo
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/pretrain
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: c4_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
_LF_QWEN3_LORA_PRETRAIN = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true

### method
stage: pt
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: c4_demo
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/lora/pretrain
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: c4_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
# examples/train_lora/llama3_lora_dpo.yaml and llama3_lora_kto.yaml: stage dpo on dpo_en_demo (sharegpt ranking
# pairs), stage kto on kto_en_demo (chats with a kto_tag column), both LoRA (the reference: the base, adapters off).
_LF_LORA_DPO = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: dpo
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
pref_beta: 0.1
pref_loss: sigmoid  # choices: [sigmoid (dpo), orpo, simpo]

### dataset
dataset: dpo_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/dpo
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: dpo_en_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
_LF_LORA_KTO = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: kto
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
pref_beta: 0.1

### dataset
dataset: kto_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/kto
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""
# data/dataset_info.json's entries the lines name, verbatim: c4_demo ({"text": ...} records read through the alpaca
# prompt column), dpo_en_demo (sharegpt ranking: conversations, chosen/rejected turns) and kto_en_demo (OpenAI-style
# messages with a kto_tag column, label). The test writes them with local stand-in files into the data folder, which
# those lines name as dataset_dir.
LLAMA_FACTORY_DATASET_INFO = {
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
    "dpo_en_demo": {
        "file_name": "dpo_en_demo.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
    "kto_en_demo": {
        "file_name": "kto_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
}
_LF_CHANGES: dict[str, Any] = {
    "model_name_or_path": "{model}",
    "dataset": "{data}/identity.json,{data}/alpaca_en_demo.json",
    "output_dir": "{out}",
}

# The few-steps settings every line gets: HF's own --max_steps (it overrides --num_train_epochs, as in HF).
FEW_STEPS = {"--max_steps": "2"}


@dataclass(frozen=True)
class LaunchLine:
    """One documented launch line and what was changed to run it on 2 tiny steps here.

    ``original`` is the line as printed (shell text with its backslash continuations). A line whose flags come from a
    file (``llamafactory-cli train x.yaml``, ``trl sft --config x.yaml``) keeps that file's text, verbatim, in
    ``config``: the test writes it, changed by ``replace``/``add``/``remove`` (YAML keys), and passes the written
    path where the line names the file. ``fill`` replaces text of the line before it is parsed (a documented
    template's ``<normal cl args>``). ``replace``/``add``/``remove`` are flags (with ``--``) for a flag line, keys for
    a YAML file, dotted overrides for ``gym fit``.
    """

    name: str
    source: str
    original: str
    replace: dict[str, Any] = field(default_factory=dict)  # flag/key -> new value (placeholders allowed)
    add: dict[str, Any] = field(default_factory=dict)  # flags/keys the line lacks: the few-steps settings
    remove: dict[str, str] = field(default_factory=dict)  # flag/key -> why it cannot stay
    config: str | None = None  # the YAML file the line runs, verbatim
    fill: dict[str, str] = field(default_factory=dict)  # template text -> the cited text that fills it
    adapter_only: bool = False  # a LoRA run whose export may be the PEFT adapter instead of a merged folder

    @property
    def bf16(self) -> bool:
        """Whether the line trains in bf16 (its own ``--bf16``/``bf16: true``)."""
        text = self.config if self.config is not None else self.original
        return bool(re.search(r"--bf16(\s+True)?(\s|$)|^bf16:\s*true", text, re.MULTILINE))


LINES: tuple[LaunchLine, ...] = (
    # ------------------------------------------------------------------------------------ Hugging Face transformers
    LaunchLine(
        name="hf_run_clm_own_files",
        source=TRANSFORMERS_CLM_README + ' ("GPT-2/GPT and causal language modeling": own training/validation files)',
        original="python run_clm.py \\\n" + RUN_CLM_OWN_FILES_ARGS,
        replace={
            "--model_name_or_path": "{model}",
            "--train_file": "{data}/wiki_train.txt",
            "--validation_file": "{data}/wiki_valid.txt",
            "--output_dir": "{out}",
        },
        add=FEW_STEPS,
    ),
    LaunchLine(
        name="hf_run_clm_wikitext",
        source=TRANSFORMERS_CLM_README + ' ("GPT-2/GPT and causal language modeling": WikiText-2)',
        original="""\
python run_clm.py \\
    --model_name_or_path gpt2 \\
    --dataset_name wikitext \\
    --dataset_config_name wikitext-2-raw-v1 \\
    --per_device_train_batch_size 8 \\
    --per_device_eval_batch_size 8 \\
    --do_train \\
    --do_eval \\
    --output_dir /tmp/test-clm""",
        replace={"--model_name_or_path": "{model}", "--dataset_name": "{data}/wikitext", "--output_dir": "{out}"},
        add=FEW_STEPS,
        remove={
            "--dataset_config_name": "names a subset of the Hub's wikitext; the local folder standing in for it (its "
            "train/validation/test files) has none, and gym train refuses a subset for local data"
        },
    ),
    LaunchLine(
        name="hf_deepspeed_launcher_zero2",
        source=TRANSFORMERS_DEEPSPEED_DOC
        + ' ("Multi-node deployment", deepspeed launcher; <normal cl args> = run_clm.py\'s own-files args from '
        + TRANSFORMERS_CLM_README
        + "; ds_config.json = the guide's tests/deepspeed/ds_config_zero2.json)",
        original="""\
deepspeed --num_gpus 8 --num_nodes 2 --hostfile hostfile --master_addr hostname1 --master_port=9901 \\
your_program.py <normal cl args> --deepspeed ds_config.json""",
        fill={"your_program.py": "run_clm.py", "<normal cl args>": RUN_CLM_OWN_FILES_ARGS},
        replace={
            "--model_name_or_path": "{model}",
            "--train_file": "{data}/wiki_train.txt",
            "--validation_file": "{data}/wiki_valid.txt",
            "--output_dir": "{out}",
            "--deepspeed": "{ds}/ds_config_zero2.json",
        },
        add=FEW_STEPS,
    ),
    LaunchLine(
        name="hf_torchrun_deepspeed_zero3",
        source=TRANSFORMERS_DEEPSPEED_DOC
        + ' ("Multi-node deployment", torchrun; <normal cl args> = run_clm.py\'s own-files args from '
        + TRANSFORMERS_CLM_README
        + "; ds_config.json = the guide's ds_config_zero3.json)",
        original="""\
python -m torch.run --nproc_per_node=8 --nnode=2 --node_rank=0 --master_addr=hostname1 \\
--master_port=9901 your_program.py <normal cl args> --deepspeed ds_config.json""",
        fill={"your_program.py": "run_clm.py", "<normal cl args>": RUN_CLM_OWN_FILES_ARGS},
        replace={
            "--model_name_or_path": "{model}",
            "--train_file": "{data}/wiki_train.txt",
            "--validation_file": "{data}/wiki_valid.txt",
            "--output_dir": "{out}",
            "--deepspeed": "{ds}/ds_config_zero3.json",
        },
        add=FEW_STEPS,
    ),
    # ------------------------------------------------------------------------------------------------------- TRL
    LaunchLine(
        name="trl_sft_quickstart",
        source=TRL + 'docs/source/quickstart.md ("Command Line Interface")',
        original="""\
trl sft --model_name_or_path Qwen/Qwen2.5-0.5B \\
    --dataset_name trl-lib/Capybara""",
        replace={"--model_name_or_path": "{model}", "--dataset_name": "{data}/trl-lib/Capybara"},
        # No --output_dir in the line: TRL's default (trainer_output in the working directory) would be the repo.
        add={**FEW_STEPS, "--output_dir": "{out}"},
    ),
    LaunchLine(
        name="trl_sft_config_file",
        source=TRL + 'docs/source/clis.md ("Using Configuration Files", SFT)',
        original="trl sft --config sft_config.yaml",
        config="""\
# sft_config.yaml
model_name_or_path: Qwen/Qwen2.5-0.5B
dataset_name: stanfordnlp/imdb
""",
        replace={"model_name_or_path": "{model}", "dataset_name": "{data}/stanfordnlp/imdb"},
        add={"max_steps": 2, "output_dir": "{out}"},
    ),
    LaunchLine(
        name="trl_sft_script_lora_packing",
        source=TRL + "trl/scripts/sft.py (module docstring, # LoRA)",
        original="""\
python trl/scripts/sft.py \\
    --model_name_or_path Qwen/Qwen2-0.5B \\
    --dataset_name trl-lib/Capybara \\
    --learning_rate 2.0e-4 \\
    --num_train_epochs 1 \\
    --packing \\
    --per_device_train_batch_size 2 \\
    --gradient_accumulation_steps 8 \\
    --eos_token '<|im_end|>' \\
    --eval_strategy steps \\
    --eval_steps 100 \\
    --use_peft \\
    --lora_r 32 \\
    --lora_alpha 16 \\
    --output_dir Qwen2-0.5B-SFT \\
    --push_to_hub""",
        replace={
            "--model_name_or_path": "{model}",
            "--dataset_name": "{data}/trl-lib/Capybara",
            "--output_dir": "{out}",
        },
        add=FEW_STEPS,
        remove={"--push_to_hub": "uploads the model to the Hub: nothing may leave this machine (gym train refuses it)"},
        adapter_only=True,
    ),
    LaunchLine(
        name="trl_qlora",
        source=TRL + 'docs/source/peft_integration.md ("Using QLoRA with TRL", Command Line)',
        original="""\
python trl/scripts/sft.py \\
    --model_name_or_path meta-llama/Llama-2-7b-hf \\
    --dataset_name trl-lib/Capybara \\
    --load_in_4bit \\
    --use_peft \\
    --lora_r 32 \\
    --lora_alpha 16 \\
    --per_device_train_batch_size 1 \\
    --gradient_accumulation_steps 16 \\
    --output_dir Llama-2-7b-QLoRA""",
        replace={
            "--model_name_or_path": "{model}",
            "--dataset_name": "{data}/trl-lib/Capybara",
            "--output_dir": "{out}",
        },
        add=FEW_STEPS,
        adapter_only=True,
    ),
    LaunchLine(
        name="trl_dpo_quickstart",
        source=TRL + 'docs/source/quickstart.md ("Command Line Interface", DPO)',
        original="""\
trl dpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
    --dataset_name trl-lib/ultrafeedback_binarized""",
        replace={"--model_name_or_path": "{model}", "--dataset_name": "{data}/trl-lib/ultrafeedback_binarized"},
        # A full finetune: the reference is a frozen copy of the model (whole on each rank: DDP replicates).
        add={**FEW_STEPS, "--output_dir": "{out}"},
    ),
    LaunchLine(
        name="trl_dpo_script_lora",
        source=TRL + 'trl/scripts/dpo.py (module docstring, "# LoRA"; the same in the trl 1.16.0 wheel)',
        original="""\
python trl/scripts/dpo.py \\
    --dataset_name trl-lib/ultrafeedback_binarized \\
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \\
    --learning_rate 5.0e-6 \\
    --num_train_epochs 1 \\
    --per_device_train_batch_size 2 \\
    --max_steps 1000 \\
    --gradient_accumulation_steps 8 \\
    --eval_strategy steps \\
    --eval_steps 50 \\
    --output_dir Qwen2-0.5B-DPO \\
    --no_remove_unused_columns \\
    --use_peft \\
    --lora_r 32 \\
    --lora_alpha 16""",
        replace={
            "--model_name_or_path": "{model}",
            "--dataset_name": "{data}/trl-lib/ultrafeedback_binarized",
            "--output_dir": "{out}",
            "--max_steps": "2",  # the line's own flag: 1000 steps become the matrix's 2
        },
        adapter_only=True,
    ),
    LaunchLine(
        name="trl_kto_cli",
        source=TRL + 'docs/source/clis.md ("Basic Usage", KTO)',
        original="""\
trl kto \\
  --model_name_or_path Qwen/Qwen2.5-0.5B \\
  --dataset_name trl-lib/kto-mix-14k""",
        replace={"--model_name_or_path": "{model}", "--dataset_name": "{data}/trl-lib/kto-mix-14k"},
        add={**FEW_STEPS, "--output_dir": "{out}"},
    ),
    LaunchLine(
        name="peft_fsdp_qlora",
        source=PEFT + 'docs/source/accelerate/fsdp.md ("Use PEFT QLoRA and FSDP for finetuning large models")',
        original="""\
accelerate launch --config_file "configs/fsdp_config_qlora.yaml"  train.py \\
--seed 100 \\
--model_name_or_path "meta-llama/Llama-2-70b-hf" \\
--dataset_name "smangrul/ultrachat-10k-chatml" \\
--chat_template_format "chatml" \\
--add_special_tokens False \\
--append_concat_token False \\
--splits "train,test" \\
--max_seq_len 2048 \\
--num_train_epochs 1 \\
--logging_steps 5 \\
--log_level "info" \\
--logging_strategy "steps" \\
--eval_strategy "epoch" \\
--save_strategy "epoch" \\
--push_to_hub \\
--hub_private_repo True \\
--hub_strategy "every_save" \\
--bf16 True \\
--packing True \\
--learning_rate 1e-4 \\
--lr_scheduler_type "cosine" \\
--weight_decay 1e-4 \\
--warmup_steps 0 \\
--max_grad_norm 1.0 \\
--output_dir "llama-sft-qlora-fsdp" \\
--per_device_train_batch_size 2 \\
--per_device_eval_batch_size 2 \\
--gradient_accumulation_steps 2 \\
--gradient_checkpointing True \\
--use_reentrant True \\
--dataset_text_field "content" \\
--use_flash_attn True \\
--use_peft_lora True \\
--lora_r 8 \\
--lora_alpha 16 \\
--lora_dropout 0.1 \\
--lora_target_modules "all-linear" \\
--use_4bit_quantization True \\
--use_nested_quant True \\
--bnb_4bit_compute_dtype "bfloat16" \\
--bnb_4bit_quant_storage_dtype "bfloat16\"""",
        replace={
            "--model_name_or_path": "{model}",
            "--dataset_name": "{data}/smangrul/ultrachat-10k-chatml",
            "--output_dir": "{out}",
        },
        add=FEW_STEPS,
        remove={
            "--push_to_hub": "uploads to the Hub: nothing may leave this machine (gym train refuses it)",
            "--hub_private_repo": "a setting of the Hub upload removed with --push_to_hub",
            "--hub_strategy": "a setting of the Hub upload removed with --push_to_hub",
            "--use_flash_attn": "FlashAttention 2 kernels need a CUDA GPU; these ranks are CPU processes",
        },
        adapter_only=True,
    ),
    # ----------------------------------------------------------------------------------------------- LLaMA-Factory
    LaunchLine(
        name="llamafactory_lora_sft",
        source=LLAMA_FACTORY + "README.md (Quickstart) and examples/train_lora/llama3_lora_sft.yaml",
        original="llamafactory-cli train examples/train_lora/llama3_lora_sft.yaml",
        config=LLAMA_FACTORY_LORA_SFT,
        replace=_LF_CHANGES,
        add={"max_steps": 2},
        adapter_only=True,
    ),
    LaunchLine(
        name="llamafactory_full_sft_ds_z3",
        source=LLAMA_FACTORY
        + "examples/README.md (Full-Parameter Fine-Tuning, multiple GPUs) and examples/train_full/llama3_full_sft.yaml",
        original="FORCE_TORCHRUN=1 llamafactory-cli train examples/train_full/llama3_full_sft.yaml",
        config=_LF_FULL_SFT,
        replace={**_LF_CHANGES, "deepspeed": "{ds}/ds_z3_config.json"},
        add={"max_steps": 2},
    ),
    LaunchLine(
        name="llamafactory_qlora_4bit",
        source=LLAMA_FACTORY
        + "examples/README.md (QLoRA Fine-Tuning, 4/8-bit Bitsandbytes)"
        + " and examples/train_qlora/llama3_lora_sft_otfq.yaml",
        original="llamafactory-cli train examples/train_qlora/llama3_lora_sft_otfq.yaml",
        config=_LF_QLORA_SFT,
        replace=_LF_CHANGES,
        add={"max_steps": 2},
        adapter_only=True,
    ),
    LaunchLine(
        name="llamafactory_lora_pretrain",
        source=LLAMA_FACTORY
        + "examples/README.md (LoRA Fine-Tuning, (Continuous) Pre-Training), "
        + "examples/train_lora/llama3_lora_pretrain.yaml and data/dataset_info.json (c4_demo)",
        original="llamafactory-cli train examples/train_lora/llama3_lora_pretrain.yaml",
        config=_LF_LORA_PRETRAIN,
        # dataset: c4_demo stays: the name is read from dataset_info.json in dataset_dir (LLaMA-Factory's own data/).
        replace={"model_name_or_path": "{model}", "output_dir": "{out}"},
        add={"dataset_dir": "{data}", "max_steps": 2},
        adapter_only=True,
    ),
    LaunchLine(
        name="llamafactory_lora_dpo",
        source=LLAMA_FACTORY
        + "examples/README.md (LoRA Fine-Tuning, DPO/ORPO/SimPO Training), "
        + "examples/train_lora/llama3_lora_dpo.yaml and data/dataset_info.json (dpo_en_demo)",
        original="llamafactory-cli train examples/train_lora/llama3_lora_dpo.yaml",
        config=_LF_LORA_DPO,
        # dataset: dpo_en_demo stays: the name is read from dataset_info.json in dataset_dir (LLaMA-Factory's data/).
        replace={"model_name_or_path": "{model}", "output_dir": "{out}"},
        add={"dataset_dir": "{data}", "max_steps": 2},
        adapter_only=True,
    ),
    LaunchLine(
        name="llamafactory_lora_kto",
        source=LLAMA_FACTORY
        + "examples/README.md (LoRA Fine-Tuning, KTO Training), "
        + "examples/train_lora/llama3_lora_kto.yaml and data/dataset_info.json (kto_en_demo)",
        original="llamafactory-cli train examples/train_lora/llama3_lora_kto.yaml",
        config=_LF_LORA_KTO,
        replace={"model_name_or_path": "{model}", "output_dir": "{out}"},
        add={"dataset_dir": "{data}", "max_steps": 2},
        adapter_only=True,
    ),
    # ---------------------------------------------------------------------------------------------- this README
    LaunchLine(
        name="readme_gym_train_zero3",
        source=GYM_README + ' ("Hugging-Face-style DeepSpeed JSON and `gym train`")',
        original="""\
gym train --model_name_or_path Qwen/Qwen3-8B --deepspeed configs/deepspeed/ds_zero3.json \\
  --train_file data/train.jsonl --per_device_train_batch_size 1 --gradient_accumulation_steps 16 \\
  --learning_rate 2e-5 --num_train_epochs 1 --bf16 True --output_dir outputs/qwen3-8b --devices 8""",
        # --devices: the README's line asks for 8 GPUs; a launch here has {nproc} ranks (under torchrun the README
        # drops --devices; keeping it, set to the launch's count, checks that an explicit count agrees).
        replace={
            "--model_name_or_path": "{model}",
            "--train_file": "{data}/trl-lib/Capybara/train.jsonl",
            "--output_dir": "{out}",
            "--devices": "{nproc}",
        },
        add=FEW_STEPS,
    ),
    LaunchLine(
        name="readme_gym_fit_zero3",
        source=GYM_README + ' ("Strategies (DDP, FSDP2, DeepSpeed ZeRO-1/2/3) — on CPU too")',
        original=".venv/bin/python -m gym_lightning fit --config configs/zero3.yaml",
        # The shipped config already trains the tiny-llama preset on the bundled addition set: no model or data to
        # swap. Its devices: 2 must match the launch; the rest are the few-steps settings, as dotted overrides (the
        # README's own way of changing a config without editing it).
        add={
            "--trainer.devices": "{nproc}",
            "--trainer.max_steps": "2",
            "--trainer.log_every_n_steps": "1",
            "--trainer.default_root_dir": "{out}",
            "--export.output_dir": "{out}/hf",
        },
    ),
)

# LLaMA-Factory's newer pretraining example, the llama3 one's twin (model and output folder aside): not run (the
# matrix runs the llama3 one); test_train_tables.py checks that both become the same gym fit arguments.
LLAMA_FACTORY_QWEN3_PRETRAIN = LaunchLine(
    name="llamafactory_qwen3_lora_pretrain",
    source=LLAMA_FACTORY_LATEST + "examples/train_lora/qwen3_lora_pretrain.yaml; data/dataset_info.json",
    original="llamafactory-cli train examples/train_lora/qwen3_lora_pretrain.yaml",
    config=_LF_QWEN3_LORA_PRETRAIN,
    replace={"model_name_or_path": "{model}", "output_dir": "{out}"},
    add={"dataset_dir": "{data}", "max_steps": 2},
    adapter_only=True,
)

# Launcher words in front of the training program: everything up to and including them is the launcher's; TRL's
# commands and scripts of the preference stages name their stage.
_PROGRAMS = {("trl", "sft"): [], ("trl", "dpo"): ["--stage", "dpo"], ("trl", "kto"): ["--stage", "kto"]}
_PROGRAMS |= {("llamafactory-cli", "train"): [], ("gym", "train"): [], ("gym_lightning", "train"): []}
_SCRIPTS = {"trl/scripts/dpo.py": ["--stage", "dpo"], "trl/scripts/kto.py": ["--stage", "kto"]}


def program_args(command: str) -> tuple[str, list[str]]:
    """``("train" | "fit", the program's own arguments)`` of a shell line: environment assignments, the launcher
    (deepspeed, torchrun, accelerate launch, python -m ...) and the program (``run_clm.py``, ``trl sft``,
    ``llamafactory-cli train``, ``gym train``) are dropped, the program's flags kept in order (after the stage that
    ``trl dpo``/``trl kto`` or TRL's ``scripts/dpo.py`` names)."""
    tokens = shlex.split(command.replace("\\\n", " "))
    for index, token in enumerate(tokens):
        if token.endswith(".py"):
            return "train", [*_SCRIPTS.get(token, []), *tokens[index + 1 :]]
        if (program := tuple(tokens[index : index + 2])) in _PROGRAMS:
            return "train", [*_PROGRAMS[program], *tokens[index + 2 :]]
        if token == "gym_lightning" and tokens[index + 1 : index + 2] == ["fit"]:
            return "fit", tokens[index + 2 :]
    raise ValueError(f"no training program in {command!r}")


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (``--flag value`` or ``--flag=value``); raises if the flag is absent,
    so a substitution can never silently miss."""
    for index, arg in enumerate(args):
        if arg == flag:
            return [*args[: index + 1], value, *args[index + 2 :]]
        if arg.startswith(flag + "="):
            return [*args[:index], f"{flag}={value}", *args[index + 1 :]]
    raise KeyError(f"{flag} is not in the line")


def _drop_flag(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (a following word that is not a flag); raises if it is absent."""
    for index, arg in enumerate(args):
        if arg == flag or arg.startswith(flag + "="):
            has_value = arg == flag and index + 1 < len(args) and not args[index + 1].startswith("--")
            return [*args[:index], *args[index + (2 if has_value else 1) :]]
    raise KeyError(f"{flag} is not in the line")


def _fill(value: Any, places: dict[str, str]) -> Any:
    return value.format(**places) if isinstance(value, str) else value


def argv_for(line: LaunchLine, places: dict[str, str]) -> list[str]:
    """The ``gym_lightning.cli.main`` arguments that run ``line`` with its substitutions; a YAML file the line runs
    is written (changed) to ``{out}/<its name>``. ``places`` fills the placeholders (model, data, ds, out, nproc)."""
    text = line.original
    for template, cited in line.fill.items():
        text = text.replace(template, cited)
    command, args = program_args(text)
    out = Path(places["out"])
    out.mkdir(parents=True, exist_ok=True)
    if line.config is not None:
        settings = yaml.safe_load(line.config)
        for key in line.remove:
            del settings[key]
        for key, value in line.replace.items():
            if key not in settings:
                raise KeyError(f"{line.name}: {key} is not in the file")
            settings[key] = _fill(value, places)
        settings.update({key: _fill(value, places) for key, value in line.add.items()})
        # The line names its file by the source's path; it runs the changed copy.
        (source_path,) = [arg for arg in args if arg.endswith((".yaml", ".yml", ".json"))]
        written = out / Path(source_path).name
        written.write_text(yaml.safe_dump(settings, sort_keys=False))
        args = [str(written) if arg == source_path else arg for arg in args]
    else:
        for flag in line.remove:
            args = _drop_flag(args, flag)
        for flag, value in line.replace.items():
            args = _set_flag(args, flag, _fill(value, places))
        for flag, value in line.add.items():
            args += [flag, _fill(value, places)]
    return [command, *args]


__all__ = [
    "DEEPSPEED_JSONS",
    "GYM_README",
    "LINES",
    "LLAMA_FACTORY_DATASET_INFO",
    "LLAMA_FACTORY_QWEN3_PRETRAIN",
    "LaunchLine",
    "argv_for",
    "program_args",
]
