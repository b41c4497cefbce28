"""DPO at real size through the user's command line: ``gym train --stage dpo`` on 2 CPU ranks, then ``gym export``.

    python -m benchmarks.dpo_real_size                  # gym_fsdp and zero3, full and LoRA, 10 steps each
    python -m benchmarks.dpo_real_size --quick          # 3 steps, full finetune only
    python -m benchmarks.dpo_real_size --write-docs     # also replaces the section in docs/benchmarks.md

Builds once under ``--workdir``: a 51M-parameter Llama-shaped folder (hidden 512, 11 layers, GQA 8/4 heads, tied
32,000 embedding) of random weights saved by ``save_pretrained`` as bf16 safetensors with Qwen2.5-Instruct's
tokenizer settings (its ChatML chat template, ``<|im_end|>`` as EOS, ``<|endoftext|>`` as padding, a generation
config stopping at both; the vocabulary is the shipped 512-token BPE, which has the two turn markers); and
``--pairs`` conversational preference pairs in TRL's format (``prompt``/``chosen``/``rejected`` message lists):
templated questions over varied topics, some with a system turn or an earlier exchange, a helpful answer (150-370
tokens) against an unhelpful one (40-120: a refusal, a vague or off-topic reply, a wrong shortcut).

Each run is the real launch line as a subprocess (``gym train --stage dpo ... --devices 2``, its ``--print_config``
kept as ``run.yaml``): a full finetune holds a frozen reference copy held like the policy, LoRA turns the adapters
off for the reference. Per run the table gives seconds per step (TensorBoard's wall time of the logged steps), each
rank's peak resident memory (MemoryCallback's ``memory.json``, added by ``--skip_memory_metrics False``), the
planner's figure (``gym plan --config run.yaml``, or its refusal), the loss and TRL's reward metrics first -> last
(``trainer_state.json``), and the export check: ``gym export`` of the last checkpoint reloaded with plain
``transformers`` (its chat template renders a conversation), logits equal to the run's own export's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.docs import write_section
from benchmarks.common.launch import python_module
from benchmarks.common.paths import REPO_ROOT

SECTION = "## DPO at real size"
MIB = 2**20
MODEL_FIELDS: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 11, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": True, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
}  # fmt: skip
# Qwen2.5-Instruct's chat template as its tokenizer_config.json ships it (default system prompt, tool calls).
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


def build_folder(folder: Path) -> None:
    """The random-init model saved as a downloaded Qwen2.5-Instruct-style checkpoint is (own process: it holds it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from gym_lightning.tokenizer import load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    config = AutoConfig.for_model(
        "llama", **MODEL_FIELDS, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], do_sample=True, temperature=0.7, top_p=0.8,
    )  # fmt: skip
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size="100MB")
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    print(f"wrote {folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)


# Conversational preference data: (subject, what it is, steps, a tip, a common mistake) per topic.
TOPICS: list[tuple[str, str, list[str], str, str]] = [
    (
        "set up a Python virtual environment",
        "an isolated folder with its own interpreter and packages",
        [
            "run python -m venv .venv in the project folder",
            "activate it with source .venv/bin/activate",
            "install what the project needs with pip install -r requirements.txt",
        ],
        "add .venv to your .gitignore so it never ends up in the repository",
        "installing packages globally with sudo pip, which can break system tools",
    ),
    (
        "bake sourdough bread",
        "a bread leavened by wild yeast and lactic acid bacteria from a starter",
        [
            "feed the starter the night before so it is active",
            "mix flour, water, salt and starter, then rest the dough",
            "stretch and fold every half hour, shape it, and proof it overnight in the fridge",
        ],
        "bake in a preheated Dutch oven with the lid on for the first twenty minutes",
        "using a starter that has not doubled, which gives a dense loaf",
    ),
    (
        "write a cover letter",
        "a one-page letter that connects your experience to one specific job",
        [
            "read the job description and pick the three requirements that matter most",
            "open with why this role and this company",
            "give one concrete result for each requirement",
        ],
        "keep it under 400 words and address it to a person when you can",
        "repeating the resume line by line instead of telling a short story",
    ),
    (
        "prepare for a job interview",
        "a conversation where both sides check whether the role fits",
        [
            "research the company's products and recent news",
            "prepare stories about your work in the STAR format",
            "write down three questions you want to ask them",
        ],
        "practise out loud with a friend or record yourself once",
        "memorising answers word for word, which sounds stiff",
    ),
    (
        "start running as a beginner",
        "building an aerobic base slowly so joints and tendons can adapt",
        [
            "start with run-walk intervals three times a week",
            "increase total time by about ten percent per week",
            "keep most runs at a pace where you can still talk",
        ],
        "good shoes fitted at a running store prevent many early injuries",
        "running every day at full effort in the first month",
    ),
    (
        "budget on a monthly salary",
        "a plan that gives every unit of income a job before the month starts",
        [
            "list your fixed costs such as rent, utilities and insurance",
            "set a savings amount and move it on payday",
            "track variable spending weekly and adjust categories",
        ],
        "automate the savings transfer so it happens before you can spend it",
        "budgeting only once and never looking at it again",
    ),
    (
        "learn a new language",
        "steady exposure plus active recall over months",
        [
            "learn the 500 most common words with spaced repetition",
            "listen to simple podcasts every day",
            "speak with a tutor or exchange partner once a week",
        ],
        "short daily sessions beat long weekly ones for memory",
        "studying grammar tables for weeks without ever speaking",
    ),
    (
        "use git branches",
        "lightweight pointers to commits that let you work on changes in isolation",
        [
            "create a branch with git switch -c feature-name",
            "commit small logical changes with clear messages",
            "open a pull request and merge after review",
        ],
        "pull the main branch often so your branch does not drift far",
        "committing straight to main on a shared repository",
    ),
    (
        "care for a houseplant",
        "matching light, water and soil to what the species needs",
        [
            "find out whether the plant likes bright or indirect light",
            "water when the top few centimetres are dry",
            "repot into a slightly larger pot every year or two",
        ],
        "a pot with drainage holes matters more than any fertiliser",
        "watering on a fixed schedule regardless of the soil",
    ),
    (
        "improve sleep",
        "regular timing and a calm environment that let the body's clock do its work",
        [
            "go to bed and wake up at the same time every day",
            "keep the bedroom dark, quiet and cool",
            "avoid caffeine after early afternoon",
        ],
        "get daylight in the morning to anchor the body clock",
        "lying in bed awake for hours instead of getting up for a while",
    ),
    (
        "write unit tests",
        "small automated checks that one function behaves as intended",
        [
            "pick a function and list the cases it must handle",
            "write one test per case with a clear name",
            "run the tests in continuous integration on every change",
        ],
        "a test should fail when the behaviour it checks is broken, so check that once",
        "testing implementation details that change with every refactor",
    ),
    (
        "negotiate a salary",
        "a discussion about the value you bring, anchored on market data",
        [
            "research the salary range for the role and city",
            "let them make the first offer if you can",
            "counter with a specific number and the reasons for it",
        ],
        "consider the whole package: bonus, leave, remote work and training budget",
        "accepting the first offer on the spot out of politeness",
    ),
    (
        "plan a road trip",
        "a route with realistic driving days and some slack",
        [
            "choose the must-see stops and draw the route",
            "limit driving to about five hours a day",
            "book the first and last nights, keep the middle flexible",
        ],
        "check the car's tyres, oil and spare wheel before leaving",
        "planning so tightly that one delay ruins the whole schedule",
    ),
    (
        "make a good cup of coffee",
        "extracting the right amount from freshly ground beans",
        [
            "use about sixty grams of coffee per litre of water",
            "grind just before brewing, to suit the method",
            "use water just off the boil, around ninety-three degrees",
        ],
        "weigh coffee and water for a consistent result",
        "using stale pre-ground coffee and boiling water",
    ),
    (
        "read a scientific paper",
        "a structured report whose parts you can read out of order",
        [
            "read the abstract and the figures first",
            "read the conclusion to see what they claim",
            "go through the methods to judge whether the claim holds",
        ],
        "write a three-sentence summary in your own words afterwards",
        "reading every line from start to end on the first pass",
    ),
    (
        "set up a home network",
        "a router, good placement and secure settings",
        [
            "place the router centrally and off the floor",
            "change the admin password and use WPA3 or WPA2",
            "update the router firmware",
        ],
        "a mesh system helps in large or multi-storey homes",
        "leaving the default admin password in place",
    ),
    (
        "train a puppy to sit",
        "rewarding the behaviour you want the moment it happens",
        [
            "hold a treat above its nose and move it back slowly",
            "say sit as its bottom touches the floor",
            "reward at once and repeat in short sessions",
        ],
        "keep sessions to five minutes and end on a success",
        "repeating the command many times when the puppy ignores it",
    ),
    (
        "reduce food waste at home",
        "buying, storing and cooking so that less ends up in the bin",
        [
            "plan meals for the week and shop with a list",
            "store older food at the front of the fridge",
            "cook leftovers into soups, stir-fries or frittatas",
        ],
        "freeze bread and ripe bananas before they spoil",
        "buying in bulk without a plan to use it",
    ),
    (
        "give a short presentation",
        "one clear message supported by a few points",
        [
            "decide the one sentence the audience should remember",
            "build three points that support it",
            "rehearse with a timer twice",
        ],
        "use slides with few words and large visuals",
        "reading the slides aloud to the audience",
    ),
    (
        "choose a laptop for programming",
        "enough memory, a good keyboard and a screen you can work on",
        [
            "get at least sixteen gigabytes of memory",
            "prefer a fast SSD of 512 gigabytes or more",
            "try the keyboard and screen in a shop if you can",
        ],
        "battery life matters if you work away from a desk",
        "paying for a gaming graphics card you will not use",
    ),
    (
        "understand compound interest",
        "interest earned on earlier interest, so growth speeds up over time",
        [
            "start with the principal and the yearly rate",
            "each year add the rate times the current balance",
            "compare a few time spans to see the curve bend upwards",
        ],
        "the rule of 72 estimates the doubling time: 72 divided by the rate in percent",
        "ignoring fees, which compound against you in the same way",
    ),
    (
        "clean a cast iron pan",
        "removing food while keeping the thin layer of seasoning",
        [
            "rinse it with hot water while it is still warm",
            "scrub stuck bits with coarse salt or a brush",
            "dry it on the stove and wipe on a thin film of oil",
        ],
        "a little soap is fine on modern seasoning",
        "leaving it to soak in the sink, which makes it rust",
    ),
    (
        "write a SQL query that joins two tables",
        "combining rows from two tables on a matching column",
        [
            "name both tables and give them short aliases",
            "write the join condition in the ON clause",
            "select only the columns you need and filter with WHERE",
        ],
        "check the row count before and after the join to catch duplicates",
        "forgetting the join condition, which gives every combination of rows",
    ),
    (
        "stay focused while working from home",
        "a routine and a workspace that separate work from the rest",
        [
            "set fixed working hours and a start ritual",
            "work in blocks of about fifty minutes with short breaks",
            "turn off notifications during focus blocks",
        ],
        "a separate corner or desk helps the brain switch modes",
        "working from the bed or sofa all day",
    ),
]
ASKS = [
    "How do I {s}?", "Can you explain how to {s}?", "What's the best way to {s}?", "I want to {s}. Where do I start?",
    "Could you give me a step-by-step guide to {s}?", "Any advice on how to {s}?",
    "I've never tried to {s} before. What should I know?", "What do people usually get wrong when they {s}?",
]  # fmt: skip
CONTEXTS = [
    "", "I'm a complete beginner. ", "I only have an hour this weekend. ", "My friend recommended I try this. ",
    "I tried once and it went badly. ", "Please keep it practical. ", "I'm asking for my teenage kid. ",
]  # fmt: skip
SYSTEMS = [
    "You are a helpful assistant.", "You are a concise, friendly assistant. Answer in plain language.",
    "You are an expert tutor who explains things step by step.",
]  # fmt: skip
OPENERS = ["Sure!", "Good question.", "Happy to help.", "Here is a practical way to do it.", "Of course."]
CLOSERS = [
    "Take it one step at a time and it gets easier quickly.", "Let me know if you want more detail on any step.",
    "Good luck, you've got this.", "If something goes wrong, tell me what you saw and we can fix it.", "",
]  # fmt: skip


def _helpful(rng: random.Random, topic: tuple[str, str, list[str], str, str]) -> str:
    subject, what, steps, tip, mistake = topic
    parts = [rng.choice(OPENERS), f"To {subject}, it helps to know what it is: {what}."]
    if rng.random() < 0.6:
        numbered = (f"{i}. {step[0].upper()}{step[1:]}." for i, step in enumerate(steps, 1))
        parts.append("Here are the steps:\n" + "\n".join(numbered))
    else:
        parts.append(f"First, {steps[0]}. Then {steps[1]}. Finally, {steps[2]}.")
    if rng.random() < 0.7:
        parts.append(f"A useful tip: {tip}.")
    if rng.random() < 0.7:
        parts.append(f"The most common mistake is {mistake}.")
    parts.append(rng.choice(CLOSERS))
    return " ".join(p for p in parts if p).replace(" Here are", "\n\nHere are")


def _unhelpful(rng: random.Random, topic: tuple[str, str, list[str], str, str], other: tuple[str, ...]) -> str:
    subject, _, steps, _, mistake = topic
    kind = rng.randrange(4)
    if kind == 0:
        return f"I'm not able to help with that. You could search online for how to {subject}."
    if kind == 1:
        return f"It depends on a lot of things, really. Everyone does it differently, so just try to {subject} and see."
    if kind == 2:  # off-topic: answers another question
        return f"Sure! To {other[0]}, {other[2][0]}. That's about it."
    return f"Honestly the fastest way is {mistake}. Skip the rest, {steps[0]} is not really needed."


def _pair(rng: random.Random) -> dict[str, Any]:
    topic, other = rng.sample(TOPICS, 2)
    question = rng.choice(CONTEXTS) + rng.choice(ASKS).format(s=topic[0])
    prompt: list[dict[str, str]] = []
    if rng.random() < 0.3:
        prompt.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if rng.random() < 0.25:  # an earlier exchange
        prompt += [
            {"role": "user", "content": rng.choice(ASKS).format(s=other[0])},
            {"role": "assistant", "content": _helpful(rng, other)},
        ]
    prompt.append({"role": "user", "content": question})
    chosen = [{"role": "assistant", "content": _helpful(rng, topic)}]
    rejected = [{"role": "assistant", "content": _unhelpful(rng, topic, other)}]
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def build_data(path: Path, pairs: int) -> None:
    """``pairs`` TRL conversational preference records (seeded, so every build writes the same file)."""
    rng = random.Random(0)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w") as f:
        for _ in range(pairs):
            f.write(json.dumps(_pair(rng)) + "\n")
    partial.rename(path)


# (strategy, mode): the strategy as the user names it (zero3 through HF's --deepspeed JSON, as TRL's docs launch it).
RUNS: list[tuple[str, str]] = [("gym_fsdp", "full"), ("zero3", "full"), ("gym_fsdp", "lora"), ("zero3", "lora")]
STRATEGY_FLAGS = {
    "gym_fsdp": ["--strategy", "gym_fsdp"],
    "zero3": ["--deepspeed", str(REPO_ROOT / "configs" / "deepspeed" / "ds_zero3.json")],
}
LORA_FLAGS = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
CONVERSATION = [
    {"role": "user", "content": "How do I start running as a beginner?"},
]  # fmt: skip


def gym(*args: str) -> list[str]:
    """The user's ``gym`` command (this interpreter, so the checkout's package is the one run)."""
    return python_module("gym_lightning", *args)


def train_flags(folder: Path, data: Path, out: Path, strategy: str, mode: str, steps: int) -> list[str]:
    """TRL's ``trl dpo`` line (DPOConfig's fields) with the run's strategy and 2 CPU ranks."""
    flags = [
        "train", "--stage", "dpo", "--model_name_or_path", str(folder), "--dataset_name", str(data),
        "--beta", "0.1", "--loss_type", "sigmoid", "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2", "--max_length", "512", "--max_prompt_length", "256",
        "--learning_rate", "5e-6" if mode == "full" else "5e-5", "--bf16", "True", "--max_steps", str(steps),
        "--logging_steps", "1", "--save_steps", str(steps), "--skip_memory_metrics", "False",
        "--output_dir", str(out), "--devices", "2", "--use_cpu", "True", *STRATEGY_FLAGS[strategy],
    ]  # fmt: skip
    return flags + (LORA_FLAGS if mode == "lora" else [])


def sft_plan_step_peak(folder: Path, strategy: str, mode: str) -> int | None:
    """The planner's host peak per rank in the training step for SFT rows of the same shape (a pair's two 512-token
    rows, policy only, no reference), for scale beside the measured DPO peak."""
    flags = ["plan", "--model", str(folder), "--strategy", strategy, "--gpus_per_node", "2", "--accelerator", "cpu",
             "--micro_batch_size", "2", "--seq_length", "512", "--precision", "bf16-mixed", "--json"]  # fmt: skip
    if mode == "lora":
        flags += ["--lora_r", "16"]
    done = subprocess.run(gym(*flags), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    plan = json.loads(done.stdout)
    chosen = [s for s in plan["strategies"] if s["strategy"] == strategy]
    return int(chosen[0]["phases"]["step"]["host"]) if chosen else None


def launch(out: Path, flags: list[str]) -> tuple[float, str]:
    """Run ``gym train`` (its printed config first, kept as ``run.yaml``); wall seconds and the log's tail."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    printed = subprocess.run(gym(*flags, "--print_config"), capture_output=True, text=True, check=True)
    (out / "run.yaml").write_text(printed.stdout)
    start = time.perf_counter()
    with (out / "train.log").open("w") as log:
        done = subprocess.run(gym(*flags), stdout=log, stderr=subprocess.STDOUT, check=False)
    text = (out / "train.log").read_text(errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"gym train failed ({done.returncode}); see {out / 'train.log'}:\n{text[-3000:]}")
    return time.perf_counter() - start, text


def plan_of(out: Path) -> tuple[int | None, str]:
    """``gym plan --config run.yaml``'s host peak per rank in the step, or the planner's own one-line refusal."""
    done = subprocess.run(
        gym("plan", "--config", str(out / "run.yaml"), "--accelerator", "cpu", "--json"),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    plan = json.loads(done.stdout)
    selected = [s for s in plan["strategies"] if s["key"] == plan.get("selected") or s["strategy"] == plan["selected"]]
    return (int(selected[0]["phases"]["step"]["host"]) if selected else None), "planned"


def step_seconds(out: Path) -> float | None:
    """Seconds per optimizer step after the first: the TensorBoard log's wall time of each step's logged loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(out.glob("lightning_logs/version_*/events.out.tfevents.*"))
    if not events:
        return None
    accumulator = EventAccumulator(str(events[-1]))
    accumulator.Reload()
    walls = [e.wall_time for e in accumulator.Scalars("train/loss")]
    return (walls[-1] - walls[0]) / (len(walls) - 1) if len(walls) > 1 else None


def memory_peaks(out: Path) -> list[int]:
    """Each rank's peak resident memory during fit (MemoryCallback's ``memory.json``)."""
    reports = sorted(out.glob("**/memory.json"))
    if not reports:
        raise RuntimeError(f"no memory.json under {out}: --skip_memory_metrics False adds MemoryCallback")
    return [int(rank["peak_host_rss"]) for rank in json.loads(reports[-1].read_text())["ranks"]]


def first_last(out: Path) -> dict[str, tuple[float, float]]:
    """Loss and TRL's reward metrics at the first and the last logged step (``trainer_state.json``)."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if "loss" in entry]
    keys = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")
    return {key: (logged[0][key], logged[-1][key]) for key in keys}


def export_check(out: Path, source: Path) -> dict[str, Any]:
    """``gym export`` of the last checkpoint, reloaded by plain transformers: its chat template renders a
    conversation, its logits on it equal those of the run's own export (``<out>/hf``) and differ from the source's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = out / "export"
    subprocess.run(
        gym("export", "--checkpoint", str(out / "checkpoints" / "last.ckpt"), "--output_dir", str(exported)),
        check=True, capture_output=True,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(exported)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]

    def logits(folder: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(folder)  # the folder's dtype (bf16, as the source)
        with torch.no_grad():
            return model(ids).logits.float()

    reloaded, run_export, start = logits(exported), logits(out / "hf"), logits(source)
    return {
        "template": text.startswith("<|im_start|>system\nYou are Qwen") and text.endswith("<|im_start|>assistant\n"),
        "equal": bool(torch.equal(reloaded, run_export)),
        "max_diff_vs_run_export": float((reloaded - run_export).abs().max()),
        "max_diff_vs_source": float((reloaded - start).abs().max()),
        "tokens": int(ids.shape[1]),
        "dtype": str(AutoModelForCausalLM.from_pretrained(exported).dtype),
    }


def measure(work: Path, folder: Path, data: Path, strategy: str, mode: str, steps: int) -> dict[str, Any]:
    out = work / "runs" / f"{strategy}-{mode}"
    flags = train_flags(folder, data, out, strategy, mode, steps)
    print(f"== {strategy} {mode}: gym {' '.join(flags)}", flush=True)
    wall, _ = launch(out, flags)
    planned, plan_note = plan_of(out)
    row = {
        "strategy": strategy, "mode": mode, "steps": steps, "wall_s": wall, "s_per_step": step_seconds(out),
        "peak_rss": memory_peaks(out), "planned": planned, "plan_note": plan_note,
        "sft_plan": sft_plan_step_peak(folder, strategy, mode), "metrics": first_last(out),
        "export": export_check(out, folder), "command": "gym " + " ".join(flags),
    }  # fmt: skip
    print(json.dumps(row, indent=1), flush=True)
    return row


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def _arrow(pair: tuple[float, float], digits: int = 3) -> str:
    return f"{pair[0]:.{digits}f} -> {pair[1]:.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The measured table in Markdown (MiB are 2**20 bytes)."""
    lines = [
        "| strategy | mode | steps | s/step | peak RSS per rank, MiB | planned (gym plan --config) "
        "| SFT plan, same rows | loss | rewards/margins | rewards/accuracies | export reload |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['strategy']} | {row['mode']} | {row['steps']} | failed: {row['error'][:300]} |")
            continue
        export = row["export"]
        same = "equal" if export["equal"] else f"DIFFERS by up to {export['max_diff_vs_run_export']:.3g}"
        check = (
            f"{same} ({export['dtype'].removeprefix('torch.')}, {export['tokens']} tokens; vs source "
            f"{export['max_diff_vs_source']:.3g}); template {'ok' if export['template'] else 'WRONG'}"
        )
        planned = _mib(row["planned"]) if row["planned"] is not None else "not modelled"
        s_step = "-" if row["s_per_step"] is None else f"{row['s_per_step']:.1f}"
        metrics = row["metrics"]
        lines.append(
            f"| {row['strategy']} | {row['mode']} | {row['steps']} | {s_step} | "
            f"{' / '.join(_mib(p) for p in row['peak_rss'])} | {planned} | {_mib(row['sft_plan'])} | "
            f"{_arrow(metrics['loss'])} | {_arrow(metrics['rewards/margins'])} | "
            f"{_arrow(metrics['rewards/accuracies'], 2)} | {check} |"
        )
    return "\n".join(lines)


def _notes(rows: list[dict[str, Any]]) -> str:
    """What the table alone does not say: the plan's refusal, the SFT plan's scale, a differing export."""
    unplanned = [row for row in rows if "error" not in row and row["planned"] is None]
    plan_note = (
        "`gym plan --config <work>/runs/<strategy>-<mode>/run.yaml --accelerator cpu` (each run's printed config) "
        f'answers "{unplanned[0]["plan_note"].split(".yaml: ")[-1]}": the planner\'s DPO stage '
        "(the reference as the strategy holds it, two rows per pair, the reference forward) is another branch's; "
        "rerun this script once it lands and the planned column fills in.\n\n"
        if unplanned
        else ""
    )
    ratios = [r["sft_plan"] / max(r["peak_rss"]) for r in rows if r.get("sft_plan") and r.get("peak_rss")]
    if ratios:  # the planner's SFT step figure beside the measured DPO peak, which holds a reference besides
        plan_note += (
            f"The SFT plan of the same rows is {min(ratios):.2f}-{max(ratios):.2f}x the measured DPO peak although "
            "it holds no reference: at this size the planner's host figure for CPU ranks is above what a rank "
            "holds (the planner's step figure at 51M, not a DPO term).\n\n"
        )
    differs = [r for r in rows if "export" in r and not r["export"]["equal"]]
    export_note = (
        "A LoRA export that differs: under zero3 the run's own export merges the engine's bf16 copies of the adapter "
        "factors, `gym export` the checkpoint's fp32 ones (each merged weight one bf16 rounding apart; the fp32 "
        "merge is `gym export`'s). Open: one of the two paths must change.\n\n"
        if any(r["strategy"] == "zero3" and r["mode"] == "lora" for r in differs)
        else ""
    )
    return plan_note + export_note


def docs_section(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The section of docs/benchmarks.md: the command, the table, how to read it, and what a GPU still owes."""
    quick = " --quick" if args.quick else ""
    work = str(args.workdir.resolve())
    launches = "\n".join(
        "    " + row["command"].replace(work, "<work>").replace(str(REPO_ROOT) + "/", "")
        for row in rows
        if "command" in row
    )
    notes = _notes(rows)
    return f"""{SECTION}

`python -m benchmarks.dpo_real_size{quick} --write-docs`: a 51M-parameter Llama-shaped folder (random weights, bf16
safetensors from `save_pretrained`, Qwen2.5-Instruct's ChatML chat template, `<|im_end|>` as EOS) and {args.pairs}
conversational preference pairs in TRL's format (system turns, earlier exchanges; chosen answers of 150-370 tokens,
rejected ones of 40-120), through `gym train --stage dpo` on 2 CPU ranks over gloo, {args.steps} optimizer steps of 2
pairs per rank (micro-batch 1 pair, accumulation 2, 512 tokens, `--bf16`). Data preparation tokenizes every pair
(once per node, cached for the later runs). Full finetunes hold the frozen reference copy the way the strategy holds
the policy; LoRA runs use the base with the adapters off. The machine was shared with other jobs: seconds per step
are indicative only.

{table(rows)}

Columns: s/step is the wall time between the first and the last step's logged loss (TensorBoard) over the steps
between them; peak RSS per rank is MemoryCallback's `peak_host_rss` (`--skip_memory_metrics False`; rank 0 / rank
1, fit up to the final checkpoint, the export after fit not included); planned is `gym plan --config` of the run's
printed config; "SFT plan, same rows" is `gym plan --stage sft` for the same folder and strategy at micro-batch 2 x
512 tokens (the pair's two rows, policy only, no reference), for scale only; loss and rewards are
`trainer_state.json`'s first and last logged steps; the export check is `gym export` of `checkpoints/last.ckpt`
reloaded with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer` (the chat template renders a conversation
with the default system prompt), its logits equal (`torch.equal`) to those of the run's own export `<output_dir>/hf`,
and the largest difference from the untrained source's logits (nonzero: the weights trained).

{notes}Owed to a GPU: the same lines at 0.5-1B (Qwen2.5-0.5B-Instruct's shape) on 2 GPUs under gym_fsdp
and zero3, full and LoRA: peak allocated per rank against `gym plan --stage dpo`, step time against one policy
forward and backward over the concatenated batch plus one reference forward, and bf16 autocast with CUDA kernels
(here CPU autocast).

The launch lines (the work dir's paths):

{launches}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "gym_dpo_real_size")
    parser.add_argument("--pairs", type=int, default=3000, help="conversational preference pairs to build")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--runs", nargs="+", default=[f"{s}:{m}" for s, m in RUNS], help="strategy:mode, ...")
    parser.add_argument("--quick", action="store_true", help="3 steps, the full finetunes only")
    parser.add_argument("--write-docs", action="store_true", help="replace the section in docs/benchmarks.md")
    parser.add_argument("--from-results", action="store_true", help="no runs: the table of <workdir>/results.json")
    args = parser.parse_args()
    runs = [tuple(r.split(":")) for r in args.runs]
    if args.quick:
        args.steps, runs = 3, [r for r in runs if r[1] == "full"]
    work = args.workdir.resolve()
    folder, data = work / "models" / "llama-51m-chatml", work / f"pairs-{args.pairs}.jsonl"
    (work / "models").mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").exists() and not args.from_results:
        subprocess.run([sys.executable, __file__, "--build-folder", str(folder)], check=True)
    if not data.exists() and not args.from_results:
        build_data(data, args.pairs)
    # Kept per run (a rerun of some runs replaces only theirs); a run that fails is a row saying how.
    results = work / "results.json"
    kept = {f"{r['strategy']}:{r['mode']}": r for r in json.loads(results.read_text())} if results.exists() else {}
    for strategy, mode in [] if args.from_results else runs:
        try:
            kept[f"{strategy}:{mode}"] = measure(work, folder, data, strategy, mode, args.steps)
        except RuntimeError as error:
            last = str(error).strip().splitlines()[-1]
            kept[f"{strategy}:{mode}"] = {"strategy": strategy, "mode": mode, "steps": args.steps, "error": last}
            print(f"{strategy} {mode} failed: {error}", flush=True)
        results.write_text(json.dumps(list(kept.values()), indent=1))
    order = [f"{s}:{m}" for s, m in RUNS]
    rows = sorted(kept.values(), key=lambda r: order.index(f"{r['strategy']}:{r['mode']}"))
    print(table(rows))
    if args.write_docs:
        write_section(SECTION, docs_section(rows, args))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--build-folder":  # own process: it holds the whole model once
        build_folder(Path(sys.argv[2]))
    else:
        main()
