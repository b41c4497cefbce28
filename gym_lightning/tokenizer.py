"""Loading tokenizers: the small one shipped with the package, a local folder, or a Hugging Face Hub name.

The shipped tokenizer (built by ``scripts/build_tokenizer.py``) is a 512-token byte-level BPE with single-digit
tokens, ``<|endoftext|>`` as eos and pad, and a ChatML chat template. It needs no network.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gym_lightning._compat import rank_zero_info
from gym_lightning.errors import GymUserError, raise_if_problems

# The special tokens a run may name instead of the tokenizer's own (TRL's --eos_token / --pad_token): e.g. Qwen base
# models end a ChatML turn with <|im_end|> but name <|endoftext|> as eos.
SPECIAL_TOKEN_NAMES: tuple[str, ...] = ("eos_token", "pad_token", "bos_token")

SHIPPED_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"


def load_tokenizer(
    source: str | None = None, trust_remote_code: bool = False, special_tokens: Mapping[str, str] | None = None
) -> PreTrainedTokenizerBase:
    """Load a tokenizer, set the special tokens the run names, and make sure it has a pad token.

    Args:
        source: A local folder or a Hugging Face Hub name; ``None`` loads the shipped tokenizer.
        trust_remote_code: Allow tokenizer code from the Hub to run (only for sources you trust).
        special_tokens: ``{"eos_token": "<|im_end|>", ...}`` (names in ``SPECIAL_TOKEN_NAMES``): tokens of the
            vocabulary that replace the tokenizer's own; the data, generation and the exported tokenizer use them.

    Raises:
        ValueError: The tokenizer cannot be found or fetched, or it has neither a pad nor an eos token.
    """
    location = str(SHIPPED_TOKENIZER_DIR) if source is None else str(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise GymUserError(
            f"Could not load the tokenizer {location!r}: {error}\n"
            "Pass a local folder that holds tokenizer.json / tokenizer_config.json, a model preset (which uses the "
            "shipped tokenizer), or a Hugging Face Hub name on a machine that can reach the Hub (or has it cached)."
        ) from error
    set_special_tokens(tokenizer, special_tokens or {}, location)
    _ensure_pad_token(tokenizer, location)
    return tokenizer


def set_special_tokens(tokenizer: PreTrainedTokenizerBase, tokens: Mapping[str, str], location: str) -> None:
    """Make each of ``tokens`` (name -> token) the tokenizer's, after checking all of them (one error for all)."""
    vocabulary = tokenizer.get_vocab() if tokens else {}
    problems = []
    for name, token in tokens.items():
        if name not in SPECIAL_TOKEN_NAMES:
            problems.append(f"special_tokens.{name}: not one of {', '.join(SPECIAL_TOKEN_NAMES)}.")
        elif token not in vocabulary:
            problems.append(
                f"special_tokens.{name} {token!r} is not a token of the tokenizer {location!r}: name one of its "
                "tokens (tokenizer.json's added_tokens or vocabulary), or drop it to keep the tokenizer's own."
            )
    raise_if_problems("Invalid special tokens", problems)
    for name, token in tokens.items():
        setattr(tokenizer, name, token)


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase, location: str) -> None:
    """Pad with eos when the tokenizer has no pad token (as most base Llama tokenizers); padding is masked anyway."""
    if tokenizer.pad_token is not None:
        return
    if tokenizer.eos_token is None:
        raise GymUserError(
            f"The tokenizer {location!r} has neither a pad token nor an eos token; add a pad_token to its "
            "tokenizer_config.json or use another tokenizer."
        )
    tokenizer.pad_token = tokenizer.eos_token
    rank_zero_info(f"The tokenizer {location!r} has no pad token; padding with its eos token {tokenizer.eos_token!r}.")
