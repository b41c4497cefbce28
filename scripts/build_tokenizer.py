"""Build the small byte-level BPE tokenizer shipped in ``gym_lightning/assets/tokenizer/``.

Run ``python scripts/build_tokenizer.py`` (optionally ``--output DIR``). The corpus is generated here, so the
result is reproducible without any download: the bundled addition task, generic English prose, the alpaca
instruction template and ChatML conversations.

Design choices (why):
- Byte-level BPE (GPT-2 style) can encode any UTF-8 string, so ``decode(encode(x)) == x`` for every input.
- Every digit is its own token (``Digits(individual_digits=True)`` before ``ByteLevel``), as in LLaMA and Qwen:
  multi-digit tokens make arithmetic much harder to learn for a tiny model.
- A vocabulary of 512 keeps the embedding matrix of a tiny model small (256 bytes + 3 specials + 253 merges).
- ``<|endoftext|>`` is both eos and pad; ``<|im_start|>`` / ``<|im_end|>`` frame ChatML turns as in Qwen.
- ``tokenizer_config.json`` is written by hand (not by ``save_pretrained``) so that the files do not depend on the
  installed ``transformers`` version and the chat template stays inside the JSON config.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Training BPE is deterministic for a fixed corpus, but pin the thread pool anyway so that word counting cannot
# depend on the machine. Must be set before the Rust thread pool starts.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "gym_lightning" / "assets" / "tokenizer"

# Qwen-style ChatML without Qwen's default system prompt. Supports ``add_generation_prompt``.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

ENGLISH = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Language models learn to predict the next token from the tokens that came before it. Training a model means
showing it many examples and adjusting its weights so that its predictions improve. We finetune a small model on
a simple task, check the loss on held-out data, and then ask it questions to see what it has learned.
Please answer the following question. What is the capital of France? The capital of France is Paris.
Write a short poem about the sea. The sea is wide and deep and blue, it sings to me and sings to you.
Summarize the text below in one sentence. Translate the sentence into German. Explain why the sky is blue.
Sunlight is scattered by the air, and blue light is scattered more than red light, so the sky looks blue.
You are a helpful assistant. Thank you! You're welcome. How can I help you today? I don't know, but I'll try.
Hello, world! This is a test of the tokenizer: numbers, punctuation, and spaces should all survive.
def add(a, b):
    return a + b
print("The answer is", add(2, 3))
"""

ALPACA_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"

INSTRUCTIONS = [
    ("Add the two numbers.", "12 and 30", "42"),
    ("Give three tips for staying healthy.", "", "Eat well, sleep enough and exercise every day."),
    ("What is the opposite of hot?", "", "The opposite of hot is cold."),
    ("Rewrite the sentence in the past tense.", "She walks to school.", "She walked to school."),
    ("Name a primary color.", "", "Red is a primary color."),
]

CONVERSATIONS = [
    [("system", "You are a helpful assistant."), ("user", "What is 2+2?"), ("assistant", "2+2 is 4.")],
    [("user", "Hello! Who are you?"), ("assistant", "I am a small language model. How can I help you?")],
    [("user", "Tell me a joke."), ("assistant", "Why did the chicken cross the road? To get to the other side.")],
]


def addition_lines() -> list[str]:
    """Every ``a+b=c`` line of the bundled addition task (digits are single tokens, so this trains the symbols)."""
    return [f"{a}+{b}={a + b}" for a in range(100) for b in range(100)]


def chatml(conversation: list[tuple[str, str]]) -> str:
    """The ChatML rendering of a conversation (same layout as ``CHAT_TEMPLATE``)."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in conversation)


def corpus() -> list[str]:
    """The training corpus, in a fixed order."""
    texts = addition_lines()
    texts += [f"What is {a}+{b}? The answer is {a + b}." for a in range(0, 100, 7) for b in range(0, 100, 11)]
    texts += ENGLISH.split("\n") * 20
    texts += [ALPACA_TEMPLATE.format(instruction=i, input=x, output=o) for i, x, o in INSTRUCTIONS] * 20
    texts += [chatml(conversation) for conversation in CONVERSATIONS] * 20
    return texts


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE with single-digit tokens on ``corpus()``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps character offsets exact (leading spaces belong to their token).
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` readable by transformers 4.x and 5.x."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # cleanup would break the exact round trip (" ." -> ".")
        "model_max_length": 4096,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "additional_special_tokens": SPECIAL_TOKENS[1:]}


def build(output: Path) -> None:
    """Train the tokenizer and write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(output / "tokenizer.json"), pretty=True)
    files = {"tokenizer_config.json": tokenizer_config(), "special_tokens_map.json": special_tokens_map()}
    for name, content in files.items():
        (output / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote a {tokenizer.get_vocab_size()}-token tokenizer to {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="folder to write (default: %(default)s)")
    build(parser.parse_args().output)


if __name__ == "__main__":
    main()
