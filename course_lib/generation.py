"""THE loop: prefill -> pick -> decode_step (or verify) -> pick -> ... -> a stop condition.

What it does: `prefill` runs the prompt(s) once and fills a KV cache (or, given a cache that holds the start
of the prompt, the next chunk of it: chunked prefill); `decode_step` feeds one new token per row and reuses
the cache; `verify` feeds the last token plus drafted tokens in one pass and rolls the cache back past the
ones the picker rejects. All three call forward.run_model, the one call into a model, and take one row or
many (left-padded, with an attention mask and position IDs), for any runner (forward.Runner) and any cache
(kv_cache.Cache). `generate_steps` is the one loop for one request: plain decoding, or, given a drafter
(speculative.py), speculative decoding as a branch of the same step, as gpt-fast does. `generate` and
`stream` drive it; the batch schedulers (batching.py) run the same stages on many rows, and the server
drives them. The drafters draft through `decode_n`, a stage of this module, not a loop of their own.
`Stopper` decides, for the loop and the schedulers alike, when a request is done and why (`STOP_REASONS`,
mapped to OpenAI's finish_reason by `FINISH_REASON`). `stream` yields text as it is produced through an
incremental decoder that never emits half a character, and keeps the GenerationResult for after the last
piece.
What it does not do: choose tokens other than by the `pick` you pass (greedy by default; sampling.py has
the samplers and the acceptance rule for drafted tokens), schedule many requests (batching.py), or time
anything but the moment each token is chosen (measure/ holds the timing experiments).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .forward import as_batch, run_model
from .kv_cache import length_of, new_cache, rollback
from .runtime import synchronize
from .sampling import Sampler, accept_draft, greedy

Pick = Callable[[torch.Tensor], "tuple[int, float]"]  # (V,) logits -> (token ID, its probability)

# The one stop vocabulary, and how each reason is reported to an OpenAI client.
STOP_REASONS = ("end_of_turn", "stop_string", "max_new_tokens", "context_window", "cancelled")
FINISH_REASON = {"end_of_turn": "stop", "stop_string": "stop", "max_new_tokens": "length",
                 "context_window": "length", "cancelled": "stop"}
# note: not stops. A scheduler's verdicts on a request that could not be served; a server reports them as
# errors (never as finish_reason "stop"), and FINISH_REASON has no entry for them on purpose.
FAILURES = ("rejected", "error")
CAPACITY_MARGIN = 64  # extra tokens a fresh cache makes room for when the caller does not say how many


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


def prefill(model, input_ids, cache=None, *, attention_mask=None, position_ids=None, capacity: int | None = None):
    """Run the prompt(s) in one pass. One row: prefill(model, ids). Many rows: left-padded (B, T) with
    attention_mask and position_ids (batching.left_pad makes them). capacity: tokens the new cache should
    hold (our model preallocates; transformers' grows). Given a cache that already holds the first tokens of
    a row, it runs the next ones after them: chunked prefill is prefill called once per chunk (the logits
    equal one whole prefill's, up to float rounding). Returns (last-position logits (B, V), the cache)."""
    ids = as_batch(input_ids).to(model.device)  # (B, T)
    if cache is None:
        cache = new_cache(model, ids.shape[0], capacity or ids.shape[1] + CAPACITY_MARGIN)
    logits, cache = run_model(model, ids, cache, attention_mask, position_ids)
    return logits[:, -1], cache  # (B, V)


def decode_step(model, token_ids, cache, *, attention_mask=None, positions=None):
    """Feed one new token per row, reusing the cache. token_ids: (B,) or (B, 1); attention_mask (B, S) covers
    the cache and the new token; positions (B,). Returns ((B, V) logits, cache)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(-1, 1)  # (B, 1)
    position_ids = positions.reshape(-1, 1) if positions is not None else None  # (B, 1)
    logits, cache = run_model(model, ids, cache, attention_mask, position_ids)
    return logits[:, -1], cache  # (B, V)


def decode_n(model, logits: torch.Tensor, cache, n: int, pick: Pick = greedy) -> tuple[list[int], list[float], object]:
    """n tokens in a row for one sequence: pick from (V,) logits, feed the token with decode_step, pick again...
    The last token is picked but not fed (nobody has asked for its logits yet). What a model drafter runs.
    Returns (tokens, their probabilities, the cache). Example: n=3 -> 3 tokens, 2 decode steps"""
    tokens, probs = [], []
    for i in range(n):
        token, prob = pick(logits)
        tokens.append(token)
        probs.append(prob)
        if i + 1 < n:
            logits, cache = decode_step(model, [token], cache)
            logits = logits[0]
    return tokens, probs, cache


@dataclass
class Verified:
    accepted: list[int]  # the drafted tokens the model agrees with
    bonus: int  # the model's own next token after them
    bonus_prob: float


def verify(model, cache, last: int, draft: list[int], pick: Pick = greedy) -> Verified:
    """One pass over [last] + draft on a cache that holds everything before `last`; the picker's rule
    (sampling.accept_draft: greedy's own choices, or speculative sampling with a Sampler) accepts a prefix of
    the draft; the cache is rolled back so it holds everything up to the last accepted token (the model's own
    next token is fed at the next step). Works on either runner's cache (kv_cache.rollback)."""
    start = length_of(cache)
    ids = torch.tensor([[last] + list(draft)], device=model.device)  # (1, k + 1)
    logits, cache = run_model(model, ids, cache, keep=len(draft) + 1)  # (1, k + 1, V)
    accepted, bonus, prob = accept_draft(logits[0], list(draft), pick)
    rollback(cache, start + 1 + len(accepted))  # keep `last` and the accepted draft
    return Verified(accepted, bonus, prob)


@dataclass
class SpecStats:
    """What speculative decoding did for one request (GenerationResult.speculative)."""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # indexes (in the answer) of tokens that were drafted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def check_draft(draft, k, pick) -> None:
    """A drafter, a positive k and a picker that can judge drafted tokens, or a clear error."""
    if pick is not greedy and not isinstance(pick, Sampler):
        raise ValueError("speculative decoding needs pick=greedy or a sampler from sampling.make_sampler (it must "
                         "read the sampler's distribution to accept or resample drafted tokens)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens drafted per verify step) must be a positive integer, got {k!r}")
    if not hasattr(draft, "propose"):
        raise TypeError("draft must be a drafter: an object with a propose(context, k) method")


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
    """The loop as a generator: prefill once, then yield each chosen token as a Step and run the next step,
    until a stop condition fires. The GenerationResult is the generator's return value (generate() and
    stream() collect it for you). stop_ids: None = the model's end-of-turn tokens; () = none, so exactly
    max_new_tokens are made (what model.generate's min_new_tokens does).
    draft: a drafter (speculative.py). Then each step is a verify: k tokens are proposed and checked in one
    pass (pick greedy, or a sampler from sampling.make_sampler: speculative sampling keeps its distribution);
    the result's `speculative` attribute holds the counts (SpecStats)."""
    ids = check_request(model, prompt_ids, max_new_tokens)
    if draft is not None:
        check_draft(draft, k, pick)
    window = model.config.max_position_embeddings
    stop_ids = end_of_turn_ids(model, tokenizer) if stop_ids is None else stop_ids
    stopper = Stopper(tokenizer, stop_ids, max_new_tokens, window - len(ids), stop_strings)
    result = GenerationResult(ids, [], "", "max_new_tokens")
    stats = result.speculative = SpecStats() if draft is not None else None
    device = model.device
    synchronize(device)
    start = time.perf_counter()
    room = len(ids) + max_new_tokens + (k + 1 if draft is not None else 0)  # a verify writes k + 1 before rolling back
    logits, cache = prefill(model, ids, capacity=min(window, room))
    token, prob = pick(logits[0])
    pending = [(token, prob, False)]  # tokens to emit: (id, probability, was it drafted)
    while True:
        for token, prob, drafted in pending:
            synchronize(device)
            if drafted:
                stats.accepted_at.append(len(result.token_ids))
            yield result.record(token, prob, tokenizer, time.perf_counter() - start)
            reason = stopper.update(token)
            if reason:
                return result.finish(reason, tokenizer)
        if draft is None:  # plain decoding: one position (note: only for a token we will use)
            logits, cache = decode_step(model, [token], cache)
            token, prob = pick(logits[0])
            pending = [(token, prob, False)]
            continue
        context = ids + result.token_ids  # speculative decoding: the same step, with drafted tokens verified
        room = min(k, window - len(context) - 1, max_new_tokens - len(result.token_ids))
        proposal = draft.propose(context, room)[:room] if room > 0 else []
        v = verify(model, cache, token, proposal, pick)
        stats.verify_steps, stats.drafted, stats.accepted = (stats.verify_steps + 1, stats.drafted + len(proposal),
                                                             stats.accepted + len(v.accepted))
        pending = [(t, 1.0, True) for t in v.accepted] + [(v.bonus, v.bonus_prob, False)]


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
