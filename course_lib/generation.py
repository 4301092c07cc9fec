"""The autoregressive loop, written out: prefill -> decode_step -> ... -> a stop condition.

What it does: `prefill` runs the whole prompt once and fills the KV cache; `decode_step` feeds one
new token and reuses the cache; `generate` repeats pick-append until an end-of-turn token, a
maximum number of new tokens, a stop string, or the context window ends it, and says which one fired.
Every step is recorded (token, its probability, time) so lessons can show the loop as a table.
`stream` yields text as it is produced, through an incremental decoder that never emits half a
character. What it does not do: choose tokens other than by the `pick` function you pass (greedy by
default; sampling.py has the samplers) or batch several prompts (batching.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .forward import as_batch
from .runtime import synchronize


@dataclass
class Step:
    """One generated token: which, with what probability, and when (seconds since the request began)."""
    index: int
    token_id: int
    text: str
    prob: float
    at: float


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only, the stop token included if one fired
    text: str  # decoded new tokens, special tokens removed
    stop_reason: str  # "end_of_turn", "max_new_tokens", "stop_string" or "context_window"
    steps: list[Step] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float:
        """Seconds from the request to the first new token (prefill plus one pick)."""
        return self.steps[0].at

    @property
    def inter_token_seconds(self) -> list[float]:
        """Gaps between consecutive new tokens (one decode step each)."""
        return [b.at - a.at for a, b in zip(self.steps, self.steps[1:])]


def end_of_turn_ids(model, tokenizer) -> set[int]:
    """Token IDs that end an answer: the generation config's eos_token_id(s) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def greedy(logits: torch.Tensor) -> int:
    """The most probable token. Example: greedy(tensor([0.1, 2.0, 0.3])) -> 1"""
    return int(torch.argmax(logits))


@torch.inference_mode()
def prefill(model, input_ids, cache=None):
    """Run the prompt in one pass. Returns (logits of the last position (B, V), filled KV cache)."""
    from transformers import DynamicCache

    ids = as_batch(input_ids).to(model.device)  # (B, T)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float(), out.cache  # (B, V)


@torch.inference_mode()
def decode_step(model, token_ids, cache):
    """Feed one new token per row, reusing the cache. token_ids: (B,) or (B, 1). Returns ((B, V) logits, cache)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(-1, 1)  # (B, 1)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float(), out.cache  # (B, V)


def check_request(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Validate a generation request; returns the prompt as a flat list of IDs."""
    ids = [int(i) for i in (prompt_ids.flatten().tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token to continue from")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    window = model.config.max_position_embeddings
    if len(ids) >= window:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context window holds {window}: "
                         "shorten it (lesson 02 shows strategies) to leave room for an answer")
    return ids


def generate_steps(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *,
                   pick: Callable[[torch.Tensor], int] = greedy, stop_strings: tuple[str, ...] = ()
                   ) -> Iterator[Step]:
    """The loop as a generator: prefill once, then yield each chosen token as a Step, then
    decode_step it, until a stop condition fires. The GenerationResult is the generator's return value
    (generate() and stream() collect it for you)."""
    ids = check_request(model, prompt_ids, max_new_tokens)
    stop_ids = end_of_turn_ids(model, tokenizer)
    window = model.config.max_position_embeddings
    device = model.device
    synchronize(device)
    start = time.perf_counter()
    logits, cache = prefill(model, ids)
    result = GenerationResult(ids, [], "", "max_new_tokens")
    for index in range(max_new_tokens):
        row = logits[0]  # (V,)
        token = pick(row)
        prob = float(torch.softmax(row, dim=-1)[token])
        synchronize(device)
        step = Step(index, token, tokenizer.decode([token]), prob, time.perf_counter() - start)
        result.token_ids.append(token)
        result.steps.append(step)
        yield step
        if token in stop_ids:
            result.stop_reason = "end_of_turn"
            break
        if stop_strings and any(s and s in tokenizer.decode(result.token_ids) for s in stop_strings):
            result.stop_reason = "stop_string"
            break
        if len(ids) + len(result.token_ids) >= window:
            result.stop_reason = "context_window"
            break
        if index + 1 < max_new_tokens:  # note: no forward pass for a token we will never use
            logits, cache = decode_step(model, [token], cache)
    result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return result


def generate(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *,
             pick: Callable[[torch.Tensor], int] = greedy, stop_strings: tuple[str, ...] = (),
             on_step: Callable[[Step], None] | None = None) -> GenerationResult:
    """The whole loop to the end. pick maps (V,) logits to a token ID (greedy by default);
    on_step is called after every step (for live display)."""
    steps = generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick, stop_strings=stop_strings)
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        if on_step:
            on_step(step)


class IncrementalDecoder:
    """Turns token IDs into text pieces as they arrive, never emitting half a character.
    A byte-level tokenizer can split one character (an emoji, a CJK character, an accented letter)
    across tokens; decoding such a token alone gives U+FFFD. We hold text back while the decoded tail
    is incomplete, and the pieces always join to exactly the full decoded text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly "")."""
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):  # subtle: the last character is still missing bytes
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as U+FFFD, like a full decode)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def naive_pieces(tokenizer, token_ids) -> list[str]:
    """Each token decoded on its own: what a careless streamer sends (broken characters included)."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in token_ids]


def stream(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *,
           pick: Callable[[torch.Tensor], int] = greedy, stop_strings: tuple[str, ...] = ()) -> Iterator[str]:
    """Yield the answer as text pieces while it is generated; "".join(pieces) == generate(...).text."""
    decoder = IncrementalDecoder(tokenizer)
    for step in generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick, stop_strings=stop_strings):
        piece = decoder.push(step.token_id)
        if piece:
            yield piece
    rest = decoder.flush()
    if rest:
        yield rest
