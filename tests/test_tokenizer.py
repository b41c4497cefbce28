"""The shipped tokenizer and ``load_tokenizer``."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from gym_lightning.errors import GymUserError
from gym_lightning.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "What is 23+45? The answer is 68.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Unicode: héllo wörld, ñ, 你好, emoji 😀🚀",
    "punctuation , . ! ? don't  \" ' ``",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "1234567890 3.14159 -42",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_shipped_tokenizer_basics(tokenizer):
    assert SHIPPED_TOKENIZER_DIR.is_dir()
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert tokenizer.encode("abc", add_special_tokens=True) == tokenizer.encode("abc", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345+678=91", add_special_tokens=False))
    assert tokens == list("12345+678=91")
    for digit in "0123456789":
        assert len(tokenizer.encode(digit, add_special_tokens=False)) == 1


def test_special_tokens_are_skipped_on_request(tokenizer):
    ids = tokenizer.encode("<|im_start|>hello<|im_end|><|endoftext|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello"


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    expected_prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected_prompt + "4<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected_prompt
    assert text.startswith(prompt)
    config = json.loads((SHIPPED_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in config["chat_template"]


def test_build_script_reproduces_shipped_files(tmp_path):
    """The committed assets are exactly what the script builds (deterministic, and not edited by hand)."""
    spec = importlib.util.spec_from_file_location("build_tokenizer", ROOT / "scripts" / "build_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (SHIPPED_TOKENIZER_DIR / name).read_bytes(), name


def test_load_from_local_folder(tmp_path, tokenizer):
    shutil.copytree(SHIPPED_TOKENIZER_DIR, tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.encode("hello 12") == tokenizer.encode("hello 12")


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(SHIPPED_TOKENIZER_DIR, folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((folder / name).read_text())
        config.pop("pad_token")
        (folder / name).write_text(json.dumps(config))
    loaded = load_tokenizer(str(folder))
    assert loaded.pad_token == loaded.eos_token == "<|endoftext|>"
    assert loaded.pad_token_id == loaded.eos_token_id


def test_unloadable_source_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="local folder") as info:
        load_tokenizer(str(tmp_path / "does" / "not" / "exist"))
    assert "preset" in str(info.value)


def test_special_tokens_named_by_the_run_replace_the_tokenizers_own() -> None:
    tokenizer = load_tokenizer(special_tokens={"eos_token": "<|im_end|>"})  # TRL's --eos_token for ChatML turns
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(
        "<|im_end|>"
    )
    assert tokenizer.pad_token == "<|endoftext|>"  # untouched
    with pytest.raises(GymUserError, match=r"(?s)2 problem.*'<\|nope\|>' is not a token.*not one of eos_token"):
        load_tokenizer(special_tokens={"eos_token": "<|nope|>", "sep_token": "<|im_end|>"})
