"""The autoregressive loop, written out: prefill -> pick -> decode_step -> pick -> ... -> a stop condition.

What it does: `prefill` runs the prompt(s) once and fills a KV cache; `decode_step` feeds one new token
per row and reuses the cache. Both take one row or many (left-padded, with an attention mask and
position IDs), for the library's model or the course's own (`model.Model`): they meet one contract,
the transformers call `model(input_ids=, attention_mask=, position_ids=, cache=, logits_to_keep=)`
returning `.logits` and `.cache`. `run_model` is the ONE place inference calls a model. Other calls
in course_lib: the deliberate no-cache run of lesson 07 (kv_cache.py) and the anatomy views that look
inside one forward pass with hooks (anatomy.py twice, attention.py, model.library_parts): 5 in all
besides this one; tests/test_model.py counts them.
`generate` repeats pick-append until a stop condition fires and says which (`STOP_REASONS`, mapped to
OpenAI's finish_reason by `FINISH_REASON`); `Stopper` decides that for the loop and for the batch
schedulers alike. `stream` yields text as it is produced through an incremental decoder that never
emits half a character, and keeps the GenerationResult for after the last piece.
What it does not do: choose tokens other than by the `pick` you pass (greedy by default; sampling.py
has the samplers) or schedule many requests (batching.py).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .forward import as_batch
from .kv_cache import new_cache
from .runtime import synchronize
from .sampling import greedy

Pick = Callable[[torch.Tensor], "tuple[int, float]"]  # (V,) logits -> (token ID, its probability)

# The one stop vocabulary, and how each reason is reported to an OpenAI client.
STOP_REASONS = ("end_of_turn", "stop_string", "max_new_tokens", "context_window", "cancelled")
FINISH_REASON = {"end_of_turn": "stop", "stop_string": "stop", "max_new_tokens": "length",
                 "context_window": "length", "cancelled": "stop"}


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
    stop_reason: str  # one of STOP_REASONS
    steps: list[Step] = field(default_factory=list)

    def record(self, token: int, prob: float, tokenizer, at: float) -> Step:
        """Append one new token (the loop and the speculative loop both record through here)."""
        step = Step(len(self.token_ids), token, tokenizer.decode([token]), prob, at)
        self.token_ids.append(token)
        self.steps.append(step)
        return step

    def finish(self, reason: str, tokenizer) -> "GenerationResult":
        self.stop_reason, self.text = reason, tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self

    @property
    def finish_reason(self) -> str:
        """The stop reason in OpenAI's words ("stop" or "length")."""
        return FINISH_REASON[self.stop_reason]

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
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def run_model(model, ids: torch.Tensor, cache, attention_mask=None, position_ids=None, keep: int = 1):
    """THE call into a model for inference. ids (B, T) on the model's device; cache None = no cache (one
    plain forward pass). keep: how many last positions get logits (0 = all). Returns (logits (B, keep, V) in
    float32 on the model's device, the cache)."""
    device = ids.device
    mask = attention_mask.to(device) if attention_mask is not None else None
    positions = position_ids.to(device) if position_ids is not None else None
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                logits_to_keep=keep)
    return out.logits[:, out.logits.shape[1] - (keep or out.logits.shape[1]):, :].float(), cache  # (B, keep, V)


def prefill(model, input_ids, cache=None, *, attention_mask=None, position_ids=None, capacity: int | None = None):
    """Run the prompt(s) in one pass. One row: prefill(model, ids). Many rows: left-padded (B, T) with
    attention_mask and position_ids (batching.left_pad makes them). capacity: tokens the new cache should
    hold (our model preallocates; transformers' grows). Returns (last-position logits (B, V), the cache)."""
    ids = as_batch(input_ids).to(model.device)  # (B, T)
    if cache is None:
        cache = new_cache(model, ids.shape[0], capacity or ids.shape[1] + 64)
    logits, cache = run_model(model, ids, cache, attention_mask, position_ids)
    return logits[:, -1], cache  # (B, V)


def decode_step(model, token_ids, cache, *, attention_mask=None, positions=None):
    """Feed one new token per row, reusing the cache. token_ids: (B,) or (B, 1); attention_mask (B, S) covers
    the cache and the new token; positions (B,). Returns ((B, V) logits, cache)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(-1, 1)  # (B, 1)
    position_ids = positions.reshape(-1, 1) if positions is not None else None  # (B, 1)
    logits, cache = run_model(model, ids, cache, attention_mask, position_ids)
    return logits[:, -1], cache  # (B, V)


def check_request(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Validate a one-prompt generation request; returns the prompt as a flat list of IDs.
    Accepts a list of ints, a (T,) tensor or a (1, T) tensor."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("the prompt is text, not token IDs: tokenize it first, for example "
                        "context.context_ids(tokenizer, messages) or tokenizer(text)['input_ids']")
    if torch.is_tensor(prompt_ids):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1:
            raise ValueError(f"got a batch of {prompt_ids.shape[0]} prompts: generate() takes one; "
                             "for several, use batching.generate_static or batching.run_schedule")
        if prompt_ids.dim() > 2 or prompt_ids.is_floating_point():
            raise ValueError(f"token IDs must be integers in a (T,) or (1, T) tensor, got {prompt_ids.dtype} "
                             f"of shape {tuple(prompt_ids.shape)}")
        ids = prompt_ids.flatten().tolist()
    else:
        if not isinstance(prompt_ids, Sequence) or any(isinstance(i, (list, tuple)) for i in prompt_ids):
            raise ValueError("the prompt must be a flat list of token IDs (for several prompts, see batching)")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in prompt_ids):
            raise ValueError("every token ID must be an int")
        ids = list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token to continue from")
    vocab = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token IDs {bad[:5]} are outside the vocabulary [0, {vocab}): "
                         "were they made by this model's tokenizer?")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    window = model.config.max_position_embeddings
    if len(ids) >= window:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context window holds {window}: "
                         "shorten it (lesson 02 shows strategies) to leave room for an answer")
    return ids


def check_stop_strings(stop_strings) -> tuple[str, ...]:
    """A sequence of non-empty strings. Example: ("\\n\\n", "END") -> ("\\n\\n", "END"); "END" is refused."""
    if isinstance(stop_strings, str):
        raise TypeError(f"stop_strings must be a list or tuple of strings, not one string: "
                        f"write stop_strings=[{stop_strings!r}] (a bare string would stop on each of its letters)")
    if stop_strings is None:
        return ()
    try:
        stops = tuple(stop_strings)
    except TypeError:
        raise TypeError(f"stop_strings must be a list or tuple of strings, got {stop_strings!r}") from None
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"every stop string must be a non-empty string, got {s!r}")
    return stops


class IncrementalDecoder:
    """Turns token IDs into text pieces as they arrive, never emitting half a character, in constant time
    per token. A byte-level tokenizer can split one character (an emoji, a CJK character, an accented
    letter) across tokens; decoding such a token alone gives U+FFFD. As production detokenizers do, we keep
    two offsets: we decode only a short window of recent tokens, hold text back while its tail is an
    incomplete character, and the pieces always join to exactly the full decoded text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # tokens before this one are fully emitted and never decoded again
        self.read = 0  # tokens before this one have had their text emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly "")."""
        self.ids.append(int(token_id))
        done = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if window.endswith("\ufffd") or len(window) < len(done):  # subtle: the last character is still missing bytes
            return ""
        piece = window[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as U+FFFD, like a full decode)."""
        done = self._decode(self.ids[self.prefix:self.read])
        piece = self._decode(self.ids[self.prefix:])[len(done):]
        self.prefix = self.read = len(self.ids)
        self.text += piece
        return piece


class Stopper:
    """Decides, token by token, whether one request is finished and why (the loop and the schedulers share it).
    Stop strings are looked for in the newly decoded tail only, so each token costs the same."""

    def __init__(self, tokenizer, stop_ids, max_new_tokens: int, room: int, stop_strings=()):
        self.stop_ids, self.max_new, self.room = frozenset(stop_ids), max_new_tokens, room
        self.stop_strings = check_stop_strings(stop_strings)
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.decoder = IncrementalDecoder(tokenizer) if self.stop_strings else None
        self.count = 0

    def update(self, token: int) -> str | None:
        """Record one new token; return its stop reason, or None to go on."""
        self.count += 1
        if token in self.stop_ids:
            return "end_of_turn"
        if self.decoder is not None:
            piece = self.decoder.push(token)
            tail = self.decoder.text[-(self.longest + len(piece)):] if piece else ""
            if piece and any(s in tail for s in self.stop_strings):
                return "stop_string"
        if self.count >= self.room:
            return "context_window"
        if self.count >= self.max_new:
            return "max_new_tokens"
        return None


def generate_steps(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
                   stop_strings: Sequence[str] = (), stop_ids=None, draft=None, k: int = 4) -> Iterator[Step]:
    """The loop as a generator: prefill once, then yield each chosen token as a Step, then
    decode_step it, until a stop condition fires. The GenerationResult is the generator's return value
    (generate() and stream() collect it for you). stop_ids: None = the model's end-of-turn tokens;
    () = none, so exactly max_new_tokens are made (what model.generate's min_new_tokens does).
    draft: a drafter (speculative.py): k tokens are proposed and checked in one pass; pick greedy or a
    sampler from sampling.make_sampler (speculative sampling keeps the sampler's distribution)."""
    if draft is not None:
        from .speculative import speculative_steps
        return (yield from speculative_steps(model, tokenizer, prompt_ids, max_new_tokens, draft=draft, k=k,
                                             stop_strings=stop_strings, stop_ids=stop_ids, pick=pick))
    ids = check_request(model, prompt_ids, max_new_tokens)
    window = model.config.max_position_embeddings
    stop_ids = end_of_turn_ids(model, tokenizer) if stop_ids is None else stop_ids
    stopper = Stopper(tokenizer, stop_ids, max_new_tokens, window - len(ids), stop_strings)
    device = model.device
    synchronize(device)
    start = time.perf_counter()
    logits, cache = prefill(model, ids, capacity=min(window, len(ids) + max_new_tokens))
    result = GenerationResult(ids, [], "", "max_new_tokens")
    while True:
        token, prob = pick(logits[0])
        synchronize(device)
        yield result.record(token, prob, tokenizer, time.perf_counter() - start)
        reason = stopper.update(token)
        if reason:
            return result.finish(reason, tokenizer)
        logits, cache = decode_step(model, [token], cache)  # note: only for a token we will use


def generate(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
             stop_strings: Sequence[str] = (), on_step: Callable[[Step], None] | None = None,
             stop_ids=None, draft=None, k: int = 4) -> GenerationResult:
    """The whole loop to the end. pick maps (V,) logits to (token ID, probability) (greedy by default);
    on_step is called after every step (for live display); stop_ids, draft and k as in generate_steps."""
    steps = generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick, stop_strings=stop_strings,
                           stop_ids=stop_ids, draft=draft, k=k)
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        if on_step:
            on_step(step)


def naive_pieces(tokenizer, token_ids) -> list[str]:
    """Each token decoded on its own: what a careless streamer sends (broken characters included)."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in token_ids]


class Stream:
    """Text pieces as they are generated; after the last one, `.result` holds the GenerationResult
    (stop reason, steps, timings). "".join(pieces) == result.text."""

    def __init__(self, steps: Iterator[Step], tokenizer):
        self._steps, self._decoder = steps, IncrementalDecoder(tokenizer)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                step = next(self._steps)
            except StopIteration as done:
                self.result = done.value
                break
            piece = self._decoder.push(step.token_id)
            if piece:
                yield piece
        rest = self._decoder.flush()
        if rest:
            yield rest


def stream(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
           stop_strings: Sequence[str] = (), draft=None, k: int = 4) -> Stream:
    """The answer as text pieces while it is generated: `for piece in stream(...)`. The request is checked
    at once (a bad one raises here, not at the first piece); keep the object to read `.result` at the end."""
    check_request(model, prompt_ids, max_new_tokens)
    check_stop_strings(stop_strings)
    return Stream(generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick,
                                 stop_strings=stop_strings, draft=draft, k=k), tokenizer)
