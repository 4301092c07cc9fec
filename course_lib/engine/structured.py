"""Structured output (lesson 15): mask the logits so that the answer can only be valid, token by token.

What it does: before each pick, every token that would make the output impossible gets logit -inf.
By hand, to see it: `ChoiceMask` (one of fixed answers) and `PatternMask` (a character pattern such as an
integer or a date), computed from the decoded text of all 49,152 tokens: a token is allowed if the text so
far plus the token is still a valid prefix, and the end-of-turn token only where the language may end. For
real JSON Schema: `SchemaMask`, on the grammar engine llguidance (a Rust library from PyPI, CPU, offline;
the engine behind llama.cpp's and vLLM's JSON modes). Each mask becomes a picker with `masked_pick`, so
greedy, sampling, streaming and the server work as everywhere else. `generate_json` returns the text, the
parsed value and whether it is complete; a schema the engine cannot compile is an error before any
generation. Whitespace is compact (no runs of spaces or newlines for a small model to wander into).
What it does not do: check a schema's semantics beyond what the engine compiles (jsonschema validates the
result in the tests), or batch the mask computation across requests.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field

import torch

from .sampling import greedy


RECEIPT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "date", "amount"],
                  "properties": {"name": {"type": "string", "maxLength": 40},
                                 "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                 "amount": {"type": "number", "minimum": 0}}}


def receipts() -> list[dict]:
    """The course's receipts (data/receipts.json): text plus the expected name, date and amount."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "data" / "receipts.json"
    return json.loads(path.read_text())["receipts"]


def receipt_request(text: str) -> list[dict]:
    """The extraction request for one receipt, as chat messages."""
    return [{"role": "user", "content": "Extract the name, the date (YYYY-MM-DD) and the amount as JSON: " + text}]


class SchemaError(ValueError):
    """A JSON Schema the grammar engine cannot compile."""


@functools.lru_cache(maxsize=4)
def _texts(tokenizer) -> tuple[str, ...]:
    return tuple(tokenizer.decode([i]) for i in range(len(tokenizer)))


def token_texts(tokenizer) -> tuple[str, ...]:
    """The decoded text of every token ID, computed once per tokenizer (about a second for 49,152)."""
    return _texts(tokenizer)


@functools.lru_cache(maxsize=4)
def _bytes(tokenizer) -> tuple[bytes, ...]:
    from ..text.tokenization import tokens_of
    return tuple(b"" if t.special else t.raw for t in tokens_of(tokenizer, range(len(tokenizer))))


def token_bytes(tokenizer) -> tuple[bytes, ...]:
    """The exact bytes of every token ID (b"" for special tokens), computed once per tokenizer. A token may hold
    part of a character: "日" is three bytes, and may come as three tokens whose texts alone are each U+FFFD."""
    return _bytes(tokenizer)


def _complete_prefix(data: bytes) -> str | None:
    """data decoded, if it is valid UTF-8 that ends with a whole character; None if it ends inside a character
    (or is not UTF-8 at all)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class PrefixMask:
    """A hand-written mask for a tiny language given by two tests on a string: `is_prefix` (can still become
    valid) and `is_complete` (valid as it stands). It works on bytes underneath: a token that ends inside a
    character is allowed when `is_prefix_bytes` says the bytes so far can still become valid (the default
    asks `is_prefix` of the whole characters only once they are whole, so it refuses a split character: right
    for ASCII languages; ChoiceMask overrides it to accept any answer's bytes)."""

    def __init__(self, tokenizer, end_id: int):
        self.pieces, self.end_id, self.data = token_bytes(tokenizer), end_id, b""

    @property
    def text(self) -> str:
        """The output so far (a character still missing bytes shows as U+FFFD)."""
        return self.data.decode("utf-8", errors="replace")

    @text.setter
    def text(self, value: str) -> None:
        self.data = value.encode("utf-8")

    def is_prefix(self, s: str) -> bool:
        raise NotImplementedError

    def is_complete(self, s: str) -> bool:
        raise NotImplementedError

    def is_prefix_bytes(self, data: bytes) -> bool:
        s = _complete_prefix(data)
        return s is not None and self.is_prefix(s)

    def allowed(self) -> torch.Tensor:
        """(V,) bool: which tokens keep the output a valid prefix now."""
        ok = [bool(b) and self.is_prefix_bytes(self.data + b) for b in self.pieces]
        done = _complete_prefix(self.data)
        ok[self.end_id] = done is not None and self.is_complete(done)
        return torch.tensor(ok)

    def consume(self, token: int) -> None:
        if token != self.end_id:
            self.data += self.pieces[token]


class ChoiceMask(PrefixMask):
    """One of fixed answers. Example: ChoiceMask(tok, 2, ["yes", "no"]) allows "y", "ye", "yes", then only the end."""

    def __init__(self, tokenizer, end_id: int, choices: list[str]):
        super().__init__(tokenizer, end_id)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        self.choices = list(choices)

    def is_prefix(self, s: str) -> bool:
        return any(c.startswith(s) for c in self.choices)

    def is_prefix_bytes(self, data: bytes) -> bool:  # any answer's bytes, so a split character is allowed midway
        return any(c.encode("utf-8").startswith(data) for c in self.choices)

    def is_complete(self, s: str) -> bool:
        return s in self.choices


class PatternMask(PrefixMask):
    """A fixed character pattern: 9 stands for a digit, anything else for itself; a trailing + lets the last
    class repeat. Examples: "9+" an integer, "9999-99-99" a date."""

    def __init__(self, tokenizer, end_id: int, pattern: str):
        super().__init__(tokenizer, end_id)
        self.repeat = pattern.endswith("+")
        self.pattern = pattern.rstrip("+")
        if not self.pattern:
            raise ValueError("the pattern is empty")

    def _fits(self, s: str) -> bool:
        for i, ch in enumerate(s):
            p = self.pattern[i] if i < len(self.pattern) else (self.pattern[-1] if self.repeat else None)
            if p is None or (ch not in "0123456789" if p == "9" else ch != p):
                return False
        return True

    def is_prefix(self, s: str) -> bool:
        return self._fits(s)

    def is_complete(self, s: str) -> bool:
        return self._fits(s) and len(s) >= len(self.pattern) and (self.repeat or len(s) == len(self.pattern))


class SchemaMask:
    """JSON Schema through llguidance: the allowed-token mask of the grammar's current state."""

    def __init__(self, tokenizer, schema: dict | str):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self._torch = llguidance.torch
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        except Exception as err:  # noqa: BLE001 - the engine's own message is the useful part
            raise SchemaError(f"the schema could not be compiled: {err}") from None
        self.lltok = _lltokenizer(tokenizer)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.lltok)
        if problem:
            raise SchemaError(f"the schema could not be compiled: {problem}")
        self.matcher = llguidance.LLMatcher(self.lltok, grammar)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.lltok.vocab_size)  # (1, V/32) int32
        self.end_id = self.lltok.eos_token

    def allowed(self) -> torch.Tensor:
        self._torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        bits = self.bitmask[0]  # (V/32,): bit j of word w allows token 32 w + j
        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits[:, None] >> shifts) & 1).bool().reshape(-1)[: self.lltok.vocab_size]

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        return self.matcher.is_accepting()


@functools.lru_cache(maxsize=4)
def _lltokenizer(tokenizer):
    import llguidance.hf
    return llguidance.hf.from_tokenizer(tokenizer)


@dataclass
class MaskLog:
    """What the mask did at each step: allowed tokens, the probability mass it removed, its time."""
    allowed: list[int] = field(default_factory=list)
    removed_mass: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def masked_pick(mask, pick=greedy, log: MaskLog | None = None):
    """A picker that applies `mask` (anything with allowed() -> (V,) bool and consume(token)) before `pick`."""
    def masked(logits: torch.Tensor) -> tuple[int, float]:
        start = time.perf_counter()
        allowed = mask.allowed().to(logits.device)
        V = logits.shape[-1]
        if allowed.numel() < V:  # the model's head may be wider than the tokenizer
            allowed = torch.cat([allowed, allowed.new_zeros(V - allowed.numel())])
        if log is not None:
            log.seconds.append(time.perf_counter() - start)
            log.allowed.append(int(allowed.sum()))
            log.removed_mass.append(float(torch.softmax(logits.float(), -1)[~allowed[:V]].sum()))
        token, prob = pick(logits.masked_fill(~allowed[:V], float("-inf")))
        mask.consume(token)
        return token, prob
    return masked


@dataclass
class JsonResult:
    text: str
    value: object  # the parsed JSON, or None if incomplete
    complete: bool  # False: the token limit was reached inside the value (text is not valid JSON)
    stop_reason: str
    mask: MaskLog


def generate_json(model, tokenizer, messages, schema: dict, max_new_tokens: int = 128, *, pick=greedy) -> JsonResult:
    """Ask for an answer that follows `schema`. The schema is compiled before any generation (SchemaError if
    the engine cannot); the text always parses and validates when complete is True; if the token limit ends
    the answer inside the value, complete is False and value is None (never broken JSON passed as valid)."""
    from ..text.context import context_ids
    from .generation import generate
    mask = SchemaMask(tokenizer, schema)
    log = MaskLog()
    result = generate(model, tokenizer, context_ids(tokenizer, messages), max_new_tokens,
                      pick=masked_pick(mask, pick, log))
    complete = mask.complete and result.stop_reason == "end_of_turn"
    return JsonResult(result.text, json.loads(result.text) if complete else None, complete, result.stop_reason, log)
