"""The launch lines of the HF Trainer's, TRL's, LLaMA-Factory's and this README's documentation run as printed.

``launch_lines.LINES`` holds each line verbatim with its source and the few changes made here (a tiny local Llama
folder for the model, small local files for the data, 2 optimizer steps, output under the test's folder). Every line
runs through ``gym train``/``gym fit`` in two torchrun launches, 1 CPU rank then 2 (``helpers/launch_worker.py`` runs
all lines in the same ranks, one after the other: one import and process-group start per launch), and each run must
leave its Hugging Face export (or, for LoRA lines, possibly the PEFT adapter) and a finite loss for both steps.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers.dist import REPO_ROOT, free_port, rank_env
from launch_lines import (
    DEEPSPEED_JSONS,
    GYM_README,
    LINES,
    LLAMA_FACTORY_DATASET_INFO,
    LaunchLine,
    argv_for,
    program_args,
)
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.slow

TOKENIZER = REPO_ROOT / "gym_lightning" / "assets" / "tokenizer"
LLAMA3_TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "chat_templates" / "llama3.jinja"
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
RECORDS = 64
STEPS = 2
NPROCS = (1, 2)
LAUNCH_TIMEOUT = 420  # seconds per launch; the whole matrix takes ~3 minutes on 2 cores when every line runs
# The preference lines' objective, and its loss before the first update, where the policy is its own reference (a
# frozen copy of the model, or the base with the adapters off): DPO's -log sigmoid(0) = log 2, KTO's 1 - sigmoid(0).
PREFERENCE_LINES = {
    "trl_dpo_quickstart": "dpo.DPO",
    "trl_dpo_script_lora": "dpo.DPO",
    "trl_kto_cli": "kto.KTO",
    "llamafactory_lora_dpo": "dpo.DPO",
    "llamafactory_lora_kto": "kto.KTO",
}
FIRST_LOSS = {"dpo.DPO": math.log(2), "kto.KTO": 0.5}


# ---------------------------------------------------------------------------------------------------- fixtures
def make_tiny_llama(folder: Path) -> Path:
    """A random Llama saved in bf16 as a real checkpoint is, with the shipped tokenizer made a Llama 3 one: its
    header/turn tokens, bos/eos and chat template (``tests/fixtures/chat_templates/llama3.jinja``).

    Linear layers take 64 or 128 inputs: QLoRA's 4-bit blocks are 64 weights of a row."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *LLAMA3_SPECIAL]})
    tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tokenizer.chat_template = LLAMA3_TEMPLATE.read_text()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,  # above every line's length setting (LLaMA-Factory's cutoff_len 2048)
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def _splits(folder: Path, records: list[Any], suffix: str, splits: dict[str, slice]) -> None:
    """A Hub data set's stand-in: one file per split (``train.jsonl``, ``test.jsonl``, ...), as ``datasets`` reads a
    folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in splits.items():
        if suffix == ".txt":  # paragraphs of plain text, as WikiText's raw lines
            (folder / f"{split}.txt").write_text("\n\n".join(records[part]) + "\n")
        else:
            _jsonl(folder / f"{split}{suffix}", records[part])


def write_data(folder: Path) -> Path:
    """Short local stand-ins, in each source's format, for the data sets the lines name."""
    train_test = {"train": slice(0, RECORDS), "test": slice(RECORDS, RECORDS + 16)}
    numbers = range(RECORDS + 16)
    # trl-lib/Capybara: conversations in "messages".
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i + 1}?"},
                {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}."},
            ]
        }
        for i in numbers
    ]
    _splits(folder / "trl-lib" / "Capybara", chats, ".jsonl", train_test)
    # smangrul/ultrachat-10k-chatml: prompt, prompt_id and the conversation in "messages".
    ultrachat = [{"prompt": c["messages"][0]["content"], "prompt_id": f"{i:04d}", **c} for i, c in enumerate(chats)]
    _splits(folder / "smangrul" / "ultrachat-10k-chatml", ultrachat, ".jsonl", train_test)
    # stanfordnlp/imdb: a review in "text" and its label.
    reviews = [{"text": f"Film number {i} was {'good' if i % 2 else 'dull'}.", "label": i % 2} for i in numbers]
    _splits(folder / "stanfordnlp" / "imdb", reviews, ".jsonl", train_test)
    # wikitext (wikitext-2-raw-v1): paragraphs of plain text in train/validation/test; run_clm's README's own files.
    paragraphs = [f"The river number {i} runs past the town of {i * 3} people." for i in numbers]
    wiki_splits = {
        "train": slice(0, RECORDS),
        "validation": slice(RECORDS, RECORDS + 8),
        "test": slice(RECORDS + 8, None),
    }
    _splits(folder / "wikitext", paragraphs, ".txt", wiki_splits)
    (folder / "wiki_train.txt").write_text("\n\n".join(paragraphs[:RECORDS]) + "\n")
    (folder / "wiki_valid.txt").write_text("\n\n".join(paragraphs[RECORDS:]) + "\n")
    # LLaMA-Factory's data/identity.json and data/alpaca_en_demo.json: JSON arrays of alpaca records.
    identity = [
        {"instruction": f"Who are you? ({i})", "input": "", "output": "I am a tiny test model."} for i in range(RECORDS)
    ]
    alpaca = [
        {"instruction": "Add the numbers.", "input": f"{i} and {i}", "output": str(2 * i)} for i in range(RECORDS)
    ]
    (folder / "identity.json").write_text(json.dumps(identity, indent=2))
    (folder / "alpaca_en_demo.json").write_text(json.dumps(alpaca, indent=2))
    # LLaMA-Factory's data/c4_demo.jsonl ({"text": ...} web pages) and its dataset_info.json entry. Short pages:
    # stage pt packs them all into one row of cutoff_len (2048) tokens, so a step is one row.
    pages = [{"text": f"Page {i}: the river runs past the town of {i * 3} people."} for i in numbers]
    _jsonl(folder / "c4_demo.jsonl", pages)
    (folder / "dataset_info.json").write_text(json.dumps(LLAMA_FACTORY_DATASET_INFO, indent=2))
    _preference_data(folder, numbers, train_test)
    return folder


def _preference_data(folder: Path, numbers: range, train_test: dict[str, slice]) -> None:
    """Preference stand-ins: trl-lib/ultrafeedback_binarized (conversational pairs, implicit prompt: chosen and
    rejected chats sharing the user turn, with their scores), trl-lib/kto-mix-14k (a prompt chat, a completion chat,
    a label), LLaMA-Factory's dpo_en_demo.json (sharegpt turns, chosen/rejected gpt turns) and kto_en_demo.json
    (role/content messages, a label)."""

    def chat(i: int, answer: int) -> list[dict[str, str]]:
        question = {"role": "user", "content": f"What is {i} plus {i + 1}?"}
        return [question, {"role": "assistant", "content": f"{i} plus {i + 1} is {answer}."}]

    pairs = [
        {"chosen": chat(i, 2 * i + 1), "rejected": chat(i, 2 * i + 3), "score_chosen": 9.0, "score_rejected": 2.0}
        for i in numbers
    ]
    _splits(folder / "trl-lib" / "ultrafeedback_binarized", pairs, ".jsonl", train_test)
    feedback = [
        {"prompt": chat(i, 0)[:1], "completion": chat(i, 2 * i + 1 + 2 * (i % 2))[1:], "label": i % 2 == 0}
        for i in numbers
    ]
    _splits(folder / "trl-lib" / "kto-mix-14k", feedback, ".jsonl", train_test)
    dpo_en_demo = [
        {
            "conversations": [{"from": "human", "value": f"What is {i} plus {i + 1}?"}],
            "chosen": {"from": "gpt", "value": f"It is {2 * i + 1}."},
            "rejected": {"from": "gpt", "value": f"It is {2 * i + 3}."},
        }
        for i in range(RECORDS)
    ]
    (folder / "dpo_en_demo.json").write_text(json.dumps(dpo_en_demo, indent=2))
    kto_en_demo = [{"messages": chat(i, 2 * i + 1 + 2 * (i % 3 == 0)), "label": i % 3 != 0} for i in range(RECORDS)]
    (folder / "kto_en_demo.json").write_text(json.dumps(kto_en_demo, indent=2))


@dataclass(frozen=True)
class Launch:
    """One torchrun launch of every line on ``nproc`` ranks: rank 0's result per line, and where each ran."""

    nproc: int
    seconds: float
    results: dict[str, dict[str, Any]]
    outs: dict[str, Path]
    log: str  # the tail of the launch's output, for failures


def launch_all(root: Path, places: dict[str, str], nproc: int) -> Launch:
    """Every line through ``gym_lightning.cli.main`` in one ``torchrun --nproc_per_node nproc`` launch."""
    folder = root / f"nproc{nproc}"
    outs = {line.name: folder / line.name for line in LINES}
    runs = [
        {"name": line.name, "argv": argv_for(line, {**places, "out": str(outs[line.name]), "nproc": str(nproc)})}
        for line in LINES
    ]
    spec = folder / "runs.json"
    spec.write_text(json.dumps(runs, indent=1))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
        str(REPO_ROOT / "tests" / "helpers" / "launch_worker.py"), str(spec),
    ]  # fmt: skip
    # The tokenized-data cache goes under the test's folder too, not into ~/.cache.
    env = rank_env(GYM_DATA_CACHE=str(root / "data-cache"))
    start = time.perf_counter()
    # A session of its own: on a timeout the ranks torchrun started are killed with it, not left running.
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
        ending = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        ending = f"timed out after {LAUNCH_TIMEOUT} s"
    seconds = time.perf_counter() - start
    log = f"launch {ending}\n--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-6000:]}"
    results_file = spec.with_name(f"{spec.name}.rank0.json")
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    print(f"launch of {len(LINES)} lines on {nproc} rank(s): {seconds:.0f} s", file=sys.stderr)
    for name, result in results.items():  # each line's own time in the launch (rank 0's)
        print(f"  {name}: {result['seconds']} s", file=sys.stderr)
    return Launch(nproc, seconds, results, outs, log)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Launch]:
    """Both launches, made once for every test of this module."""
    root = tmp_path_factory.mktemp("launch_lines")
    ds = root / "deepspeed"
    ds.mkdir()
    for name, (_, text) in DEEPSPEED_JSONS.items():
        (ds / name).write_text(text)
    places = {"model": str(make_tiny_llama(root / "tiny-llama3")), "data": str(write_data(root / "data"))}
    places["ds"] = str(ds)
    return {nproc: launch_all(root, places, nproc) for nproc in NPROCS}


# ------------------------------------------------------------------------------------------------------ checks
def _losses_of_trainer_state(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def _losses_of_metrics(out: Path) -> list[float]:
    (metrics,) = out.glob("lightning_logs/version_*/metrics.csv")
    with metrics.open() as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


def assert_exported(line: LaunchLine, export: Path) -> None:
    """A Hugging Face folder (config + safetensors weights), or for a LoRA line PEFT's adapter files."""
    full = (export / "config.json").is_file() and any(export.glob("*.safetensors"))
    adapter = (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()
    files = sorted(p.name for p in export.iterdir()) if export.is_dir() else "no folder"
    assert full or (line.adapter_only and adapter), f"{line.name}: no export in {export}: {files}"


def test_the_matrix_covers_every_source() -> None:
    # At least eight lines, from the HF Trainer's, TRL's, LLaMA-Factory's and this README's documentation, TRL's
    # `trl dpo` and LLaMA-Factory's DPO and KTO examples among them.
    sources = {line.name.split("_")[0] for line in LINES}
    assert len(LINES) >= 8 and {"hf", "trl", "llamafactory", "readme"} <= sources
    assert set(PREFERENCE_LINES) <= {line.name for line in LINES}


def test_the_readme_lines_are_quoted_as_the_readme_prints_them() -> None:
    # The other sources are pinned to a commit; this README changes with the code, so its quotes are checked here.
    readme = (REPO_ROOT / "README.md").read_text()
    quoted = [line for line in LINES if line.source.startswith(GYM_README)]
    assert quoted and all(line.original in readme for line in quoted)


@pytest.mark.parametrize("nproc", NPROCS)
@pytest.mark.parametrize("line", LINES, ids=lambda line: line.name)
def test_launch_line_trains_and_exports(launches: dict[int, Launch], line: LaunchLine, nproc: int) -> None:
    launch = launches[nproc]
    result = launch.results.get(line.name)
    assert result is not None, f"{line.name} did not run on {nproc} rank(s)\n{launch.log}"
    assert result["ok"], f"{line.name} on {nproc} rank(s): {result['error']}"
    out = launch.outs[line.name]
    assert_exported(line, out / "hf")
    # gym train writes HF's trainer_state.json; a gym fit config logs the loss to its CSV metrics.
    fit = program_args(line.original)[0] == "fit"
    losses = _losses_of_metrics(out) if fit else _losses_of_trainer_state(out)
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), f"{line.name}: losses {losses}"
    (config,) = out.glob("lightning_logs/version_*/config.yaml")
    settings = yaml.safe_load(config.read_text())
    if line.bf16:  # the line's --bf16 True / bf16: true trains in bf16 here too (CPU autocast)
        assert settings["trainer"]["precision"] == "bf16-mixed", line.name
    if (objective := PREFERENCE_LINES.get(line.name)) is not None:  # the stage's objective, its reference the policy
        assert settings["model"]["objective"]["class_path"] == f"gym_lightning.objectives.{objective}", line.name
        assert losses[0] == pytest.approx(FIRST_LOSS[objective], abs=1e-5), f"{line.name}: losses {losses}"
