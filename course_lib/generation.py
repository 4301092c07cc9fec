"""THE loop: one step, run again and again until every request is done.

What it does: the stages first. `prefill` runs the prompt(s) once and fills a KV cache (or, given a cache
that holds the start of the prompt, the next chunk of it: chunked prefill); `decode_step` feeds one new
token per row and reuses the cache; `verify_pass` feeds the last token plus drafted tokens in one pass
(speculative decoding); `decode_n` picks and feeds n tokens in a row (what a model drafter runs). All of
them call forward.run_model, the one call into a model, and take one row or many (left-padded, with an
attention mask and position IDs), for any runner (forward.Runner) and any cache (kv_cache.Cache).
Then the step. `step(scheduler)` is the one step for every shape of work, as in nano-vllm and vLLM: the
scheduler runs the model once on what it scheduled and hands back, per row, its logits (and its drafted
tokens, if any); each `Job`'s picker chooses the next token, or accepts a prefix of the draft
(sampling.accept_draft), the job records it and its stop condition (`Stopper`: `STOP_REASONS`, mapped to
OpenAI's finish_reason by `FINISH_REASON`), and the scheduler is told what to feed next or that the job is
done. `Alone` is the scheduler of one request on a contiguous cache (prefill, then a decode step, or a
verify pass when the job has a drafter); batching.py has the others (static, continuous, paged). Drivers:
`generate_steps` / `generate` / `stream` run `step` on `Alone`; batching's `run_schedule` / `run_paged`, the
server's thread and the bench run it on their schedulers. `stream` yields text as it is produced through an
incremental decoder that never emits half a character, and keeps the GenerationResult for after the last
piece.
What it does not do: choose tokens other than by the `pick` you pass (greedy by default; sampling.py has
the samplers and the acceptance rule for drafted tokens), decide which requests run (the schedulers do),
or time anything but the moment each token is chosen (measure/ holds the timing experiments).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .forward import as_batch, run_model
from .kv_cache import length_of, new_cache, rollback
from .request import (FAILURES, FINISH_REASON, STOP_REASONS, GenerationResult, HoldBack, IncrementalDecoder, Job, Pick,
                      SpecStats, Step, Stopper, check_request, check_stop_strings, end_of_turn_ids, naive_pieces)
from .runtime import synchronize
from .sampling import Sampler, accept_draft, greedy

__all__ = ["FAILURES", "FINISH_REASON", "STOP_REASONS", "GenerationResult", "IncrementalDecoder", "Job", "Pick",
           "SpecStats", "Step", "Stopper", "check_request", "check_stop_strings", "end_of_turn_ids", "naive_pieces",
           "prefill", "decode_step", "decode_n", "verify_pass", "verify", "Verified", "check_draft", "step", "Alone",
           "generate_steps", "generate", "Stream", "stream", "CAPACITY_MARGIN"]
CAPACITY_MARGIN = 64  # extra tokens a fresh cache makes room for when the caller does not say how many


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


def verify_pass(model, cache, last: int, draft: list[int]) -> torch.Tensor:
    """One pass over [last] + draft on a cache that holds everything before `last`: the model's logits at each of
    those positions, (k + 1, V). The cache now holds them all; roll it back past what the picker rejects."""
    ids = torch.tensor([[last] + list(draft)], device=model.device)  # (1, k + 1)
    logits, _ = run_model(model, ids, cache, keep=len(draft) + 1)  # (1, k + 1, V)
    return logits[0]


def verify(model, cache, last: int, draft: list[int], pick: Pick = greedy, draft_probs=None) -> Verified:
    """verify_pass, then the picker's rule (sampling.accept_draft: greedy's own choices, or speculative sampling
    with a Sampler, reading the drafter's distributions draft_probs if it sampled) accepts a prefix of the draft, and the cache is rolled back so it holds everything up to the
    last accepted token (the model's own next token is fed at the next step). Works on either runner's cache
    (kv_cache.rollback). The loop does the same three things across one step (Alone.run, step, Alone.feed)."""
    start = length_of(cache)
    accepted, bonus, prob, _ = accept_draft(verify_pass(model, cache, last, draft), list(draft), pick, draft_probs)
    rollback(cache, start + 1 + len(accepted))  # keep `last` and the accepted draft
    return Verified(accepted, bonus, prob)


def check_draft(draft, k, pick) -> None:
    """A drafter, a positive k and a picker that can judge drafted tokens, or a clear error."""
    if pick is not greedy and not isinstance(pick, Sampler):
        raise ValueError("speculative decoding needs pick=greedy or a sampler from sampling.make_sampler (it must "
                         "read the sampler's distribution to accept or resample drafted tokens)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens drafted per verify step) must be a positive integer, got {k!r}")
    if not hasattr(draft, "propose"):
        raise TypeError("draft must be a drafter: an object with a propose(context, k) method")


def step(scheduler) -> list[tuple[Job, int, float, bool]]:
    """THE step, for one request or many: the scheduler runs the model once on what it scheduled (prompts or
    their next chunks, the tokens fed last step, or a verify pass over drafted tokens) and hands back, for each
    row that has logits, (job, logits (1 + drafted, V), the drafted tokens or None). Then each job's picker
    chooses (or accepts drafted tokens by sampling.accept_draft), the job records each token and its stop
    condition, and the scheduler is told what to feed next or that the job is done. Returns what was emitted:
    (job, token, probability, was it drafted). generate, stream, the batch schedulers and the server drive it."""
    rows = scheduler.run()
    stamp, emitted = scheduler.now(), []
    for job, logits, draft in rows:
        if job.cancelled:
            scheduler.finish(job, "cancelled", stamp)
            continue
        pick = job.pick or greedy
        if draft is None:  # plain decoding: one position
            token, prob = pick(logits[0])
            picked = [(token, prob, False)]
        else:  # a verify pass: the accepted draft, then the model's own next token
            probs = getattr(job.draft, "probs", None)  # a drafter that sampled keeps its distributions (ModelDrafter)
            accepted, token, prob, kept = accept_draft(logits, draft, pick, None if probs is None else probs[:len(draft)])
            picked = [(t, p, True) for t, p in zip(accepted, kept)] + [(token, prob, False)]
        for token, prob, drafted in picked:
            emitted.append((job, token, prob, drafted))
            reason = job.emit(token, stamp)
            if reason:
                scheduler.finish(job, reason, stamp)
                break
        else:
            scheduler.feed(job, [t for t, _, _ in picked], len(picked) - 1)
    return emitted


class Alone:
    """The scheduler of one request on a contiguous cache: what generate runs. Its first step prefills the prompt;
    each later one feeds the last token (decode_step), or, when the job has a drafter, the last token plus up to
    k drafted ones (verify_pass), and rolls the cache back past the ones the picker rejected."""

    def __init__(self, model, job: Job, capacity: int):
        self.model, self.job, self.capacity = model, job, capacity
        self.cache, self.last, self.start = None, None, 0
        self.stats = SpecStats() if job.draft is not None else None
        self.clock = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.clock

    def run(self) -> list:
        job, model = self.job, self.model
        if job.finish_reason:
            return []
        if self.cache is None:
            logits, self.cache = prefill(model, job.prompt, capacity=self.capacity)
            return [(job, logits, None)]  # (1, V)
        if job.draft is None:
            logits, self.cache = decode_step(model, [self.last], self.cache)
            return [(job, logits, None)]
        context = job.prompt + job.tokens
        room = min(job.k, model.config.max_position_embeddings - len(context) - 1, job.new_tokens - len(job.tokens))
        proposal = job.draft.propose(context, room)[:room] if room > 0 else []
        self.start = length_of(self.cache)
        self.stats.verify_steps, self.stats.drafted = self.stats.verify_steps + 1, self.stats.drafted + len(proposal)
        return [(job, verify_pass(model, self.cache, self.last, proposal), list(proposal))]  # (k + 1, V)

    def feed(self, job: Job, tokens: list[int], accepted: int) -> None:
        """The job goes on: its last token is fed at the next step; a verify pass keeps only what was accepted."""
        if self.stats is not None and self.last is not None:
            rollback(self.cache, self.start + 1 + accepted)  # keep the fed token and the accepted draft
        self.last = tokens[-1]

    def finish(self, job: Job, reason: str, stamp: float) -> None:
        job.finish_reason, job.end = reason, stamp


def generate_steps(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
                   stop_strings: Sequence[str] = (), stop_ids=None, draft=None, k: int = 4) -> Iterator[Step]:
    """The loop for one request, as a generator: `step` on the Alone scheduler until the request is done, each
    chosen token yielded as a Step as soon as it is picked. The GenerationResult is the generator's return value
    (generate() and stream() collect it for you). stop_ids: None = the model's end-of-turn tokens; () = none, so
    exactly max_new_tokens are made (what model.generate's min_new_tokens does).
    draft: a drafter (speculative.py). Then each step is a verify: k tokens are proposed and checked in one
    pass (pick greedy, or a sampler from sampling.make_sampler: speculative sampling keeps its distribution);
    the result's `speculative` attribute holds the counts (SpecStats)."""
    ids = check_request(model, prompt_ids, max_new_tokens)
    if draft is not None:
        check_draft(draft, k, pick)
        if hasattr(draft, "follow"):
            draft.follow(pick)  # a model drafter samples from its own distribution when the model samples
    window = model.config.max_position_embeddings
    stop_ids = end_of_turn_ids(model, tokenizer) if stop_ids is None else stop_ids
    stopper = Stopper(tokenizer, stop_ids, max_new_tokens, window - len(ids), stop_strings)
    job = Job("generate", ids, max_new_tokens, pick=pick, stopper=stopper, draft=draft, k=k)
    room = len(ids) + max_new_tokens + (k + 1 if draft is not None else 0)  # a verify writes k + 1 before rolling back
    scheduler = Alone(model, job, capacity=min(window, room))
    result = GenerationResult(ids, [], "", "max_new_tokens")
    result.speculative = scheduler.stats
    device = model.device
    synchronize(device)
    start = time.perf_counter()
    while not job.finish_reason:
        for _, token, prob, drafted in step(scheduler):
            synchronize(device)
            if drafted:  # note: counted here, as emitted, so the last verify (which may end the request) counts too
                scheduler.stats.accepted += 1
                scheduler.stats.accepted_at.append(len(result.token_ids))
            yield result.record(token, prob, tokenizer, time.perf_counter() - start)
    return result.finish(job.finish_reason, tokenizer, stopper.stop_strings)


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


class Stream:
    """Text pieces as they are generated; after the last one, `.result` holds the GenerationResult
    (stop reason, steps, timings). "".join(pieces) == result.text."""

    def __init__(self, steps: Iterator[Step], tokenizer, stop_strings: Sequence[str] = ()):
        self._steps, self._decoder, self._hold = steps, IncrementalDecoder(tokenizer), HoldBack(stop_strings)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                step = next(self._steps)
            except StopIteration as done:
                self.result = done.value
                break
            piece = self._hold.push(self._decoder.push(step.token_id))  # a stop string is never sent
            if piece:
                yield piece
        rest = self._hold.push(self._decoder.flush()) + self._hold.flush()
        if rest:
            yield rest


def stream(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
           stop_strings: Sequence[str] = (), draft=None, k: int = 4) -> Stream:
    """The answer as text pieces while it is generated: `for piece in stream(...)`. The request is checked
    at once (a bad one raises here, not at the first piece); keep the object to read `.result` at the end."""
    check_request(model, prompt_ids, max_new_tokens)
    check_stop_strings(stop_strings)
    return Stream(generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick,
                                 stop_strings=stop_strings, draft=draft, k=k), tokenizer, stop_strings)
