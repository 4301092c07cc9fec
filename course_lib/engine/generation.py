"""THE loop: one step, run again and again until every request is done, and the drivers that run it.

What it does: `step(scheduler)` is the one step for every shape of work, as in nano-vllm and vLLM: the scheduler
(schedulers.Scheduler) runs the model once on what it scheduled and hands back, per row, its logits (and its
drafted tokens, if any); each `Job`'s picker chooses the next token, or accepts a prefix of the draft
(sampling.accept_draft), the job records it and its stop condition (request.Stopper), and the scheduler is told
what to feed next or that the job is done. Drivers, all above the schedulers they drive: `generate_steps` /
`generate` / `stream` run `step` on `Alone` (one request); `run_schedule` and `generate_static` on a
PaddedScheduler (static or continuous batching); `run_paged` on a PagedScheduler (lesson 13); the server's engine
thread and the bench run it on theirs. `stream` yields text as it is produced through request.TextOut (never half
a character, never a stop string) and keeps the GenerationResult for after the last piece.
What it does not do: run the model (the stages do, called by the schedulers), choose tokens other than by the
`pick` you pass (greedy by default; sampling.py has the samplers), decide which requests run (the schedulers do),
or time anything but the moment each token is chosen (measure/ holds the timing experiments).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Callable, Iterator

from .paged_scheduler import PagedScheduler
from .request import GenerationResult, Job, Pick, NewToken, Stopper, check_request, check_stop_strings, end_of_turn_ids
from .text_out import TextOut
from ..runner.compiled import compiled_runner
from ..runtime import synchronize
from .sampling import accept_draft, greedy
from .schedulers import Alone, PaddedScheduler
from .stages import check_draft


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
            job.note_logprobs(logits[0], token)
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


def generate_steps(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
                   stop_strings: Sequence[str] = (), stop_ids=None, draft=None, k: int = 4,
                   compiled: bool = False) -> Iterator[NewToken]:
    """The loop for one request, as a generator: `step` on the Alone scheduler until the request is done, each
    chosen token yielded as a NewToken record as soon as it is picked. The GenerationResult is the generator's return value
    (generate() and stream() collect it for you). stop_ids: None = the model's end-of-turn tokens; () = none, so
    exactly max_new_tokens are made (what model.generate's min_new_tokens does).
    draft: a drafter (speculative.py). Then each step is a verify: k tokens are proposed and checked in one
    pass (pick greedy, or a sampler from sampling.make_sampler: speculative sampling keeps its distribution);
    the result's `speculative` attribute holds the counts (SpecStats).
    compiled: run the decode steps compiled (runner.compiled.CompiledRunner, the course's own model only): the same
    loop, the cache sized in buckets, each bucket compiled the first time (up to a minute on the CPU)."""
    if compiled:
        model = compiled_runner(model)
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
             stop_strings: Sequence[str] = (), on_step: Callable[[NewToken], None] | None = None,
             stop_ids=None, draft=None, k: int = 4, compiled: bool = False) -> GenerationResult:
    """The whole loop to the end. pick maps (V,) logits to (token ID, probability) (greedy by default);
    on_step is called after every step (for live display); stop_ids, draft, k and compiled as in generate_steps."""
    steps = generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick, stop_strings=stop_strings,
                           stop_ids=stop_ids, draft=draft, k=k, compiled=compiled)
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

    def __init__(self, steps: Iterator[NewToken], tokenizer, stop_strings: Sequence[str] = ()):
        self._steps, self._out = steps, TextOut(tokenizer, stop_strings)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                step = next(self._steps)
            except StopIteration as done:
                self.result = done.value
                break
            piece = self._out.push(step.token_id)  # request.TextOut: a stop string is never sent
            if piece:
                yield piece
        rest = self._out.flush()
        if rest:
            yield rest


def stream(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, pick: Pick = greedy,
           stop_strings: Sequence[str] = (), draft=None, k: int = 4, compiled: bool = False) -> Stream:
    """The answer as text pieces while it is generated: `for piece in stream(...)`. The request is checked
    at once (a bad one raises here, not at the first piece); keep the object to read `.result` at the end."""
    model = compiled_runner(model) if compiled else model
    check_request(model, prompt_ids, max_new_tokens)
    check_stop_strings(stop_strings)
    return Stream(generate_steps(model, tokenizer, prompt_ids, max_new_tokens, pick=pick,
                                 stop_strings=stop_strings, draft=draft, k=k, compiled=compiled), tokenizer,
                  stop_strings)


def run_schedule(model, jobs: list[Job], max_batch: int, continuous: bool) -> list[Job]:
    """Serve jobs queued at time 0, at most max_batch at a time.
    Static: admit a full batch, run it until its longest job ends, then the next batch.
    Continuous: whenever a job ends, the next queued job takes its slot at the next step."""
    queue, batch = list(jobs), PaddedScheduler(model)
    while queue or batch.jobs:
        if queue and len(batch.jobs) < max_batch and (continuous or not batch.jobs):
            newcomers = queue[: max_batch - len(batch.jobs)]
            del queue[: len(newcomers)]
            batch.add(newcomers)
        step(batch)
    return jobs


def generate_static(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, stop: bool = True) -> list[list[int]]:
    """Greedy generation for one static batch; each row stops at its end-of-turn token (if stop) or the limit."""
    stop_ids = frozenset(end_of_turn_ids(model, tokenizer)) if stop else frozenset()
    jobs = [Job(f"r{i}", list(p), max_new_tokens, stop_ids) for i, p in enumerate(prompts)]
    run_schedule(model, jobs, max_batch=len(jobs), continuous=False)
    return [j.tokens for j in jobs]


def run_paged(model, jobs: list[Job], pool, policy: str = "preempt", max_batch: int = 8,
              arrivals: list[int] | None = None, token_budget: int | None = None) -> PagedScheduler:
    """Serve jobs through a PagedScheduler; arrivals[i] = the step at which job i arrives (all at 0 if None);
    token_budget: tokens per step (chunked prefill), None = each prompt whole.
    Returns the batch (its events, memory log and counters); the jobs hold their tokens and reasons."""
    arrivals = [0] * len(jobs) if arrivals is None else list(arrivals)
    if len(arrivals) != len(jobs):
        raise ValueError(f"{len(jobs)} jobs but {len(arrivals)} arrival steps")
    batch = PagedScheduler(model, pool, policy, max_batch, token_budget=token_budget)
    order, count = sorted(range(len(jobs)), key=arrivals.__getitem__), 0
    while order or batch.jobs:
        arrived = [jobs[i] for i in order if arrivals[i] <= count]
        order = [i for i in order if arrivals[i] > count]
        if arrived:
            batch.add(arrived)
        step(batch)
        count += 1
    return batch
