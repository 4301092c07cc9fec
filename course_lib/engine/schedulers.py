"""The schedulers' contract, and the schedulers on a contiguous cache: one request alone, or left-padded batches.

What it does: `Scheduler` is the contract generation.step drives (`run` the model once on what is scheduled and
hand back each row's logits; `now`; `feed` a job's next tokens; `finish` a job), and `BatchScheduler` adds a queue
(`jobs`, `add`). `Alone` serves one request on a contiguous cache (prefill, then a decode step, or a verify pass
when the job has a drafter). `PaddedScheduler` serves many: prompts left-padded into one (B, T) batch
(`left_pad`: an attention mask and per-row position IDs); each step drops the rows that finished, runs one batched
decode step, then prefills the newcomers together and joins them to the batch. Static or continuous batching is
the driver's choice of when to `add` (generation.run_schedule). Every forward pass goes through the stages module,
every stop through the job's Stopper, so a batched request stops exactly as it would alone.
What it does not do: loop (generation.step and its drivers do), pick tokens (the job's picker does), or draft:
a batch scheduler refuses a job with a drafter instead of ignoring it. The paged scheduler is paged_scheduler.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..runner import kv_cache
from ..runner.kv_cache import length_of, rollback
from .request import Job, SpecStats
from .stages import decode_step, prefill, verify_pass


@runtime_checkable
class Scheduler(Protocol):
    """What generation.step drives. run(): the model once on what is scheduled, returning (job, logits (1 + drafted,
    V), drafted tokens or None) per row that has logits; feed(): the job goes on with these tokens (`accepted` of
    them drafted); finish(): the job is done; now(): seconds since the scheduler's clock started."""

    def run(self) -> list: ...

    def now(self) -> float: ...

    def feed(self, job: Job, tokens: list[int], accepted: int) -> None: ...

    def finish(self, job: Job, reason: str, stamp: float) -> None: ...


@runtime_checkable
class BatchScheduler(Scheduler, Protocol):
    """A Scheduler with a queue: `jobs` (not done yet), `add(jobs)`. The server and the batch drivers take any."""

    @property
    def jobs(self) -> list[Job]: ...

    def add(self, newcomers: list[Job]) -> None: ...


class Clock:
    """A scheduler's clock: `now()` is seconds since it started (or since the `clock` it was given)."""

    def __init__(self, clock: float | None = None):
        self.clock = time.perf_counter() if clock is None else clock

    def now(self) -> float:
        return time.perf_counter() - self.clock

    def finish(self, job: Job, reason: str, stamp: float) -> None:
        job.finish(reason, stamp)


def refuse_drafts(jobs: list[Job]) -> None:
    """Batch schedulers decode one token per row: a job with a drafter is refused, never silently run without it."""
    drafted = [j.name for j in jobs if j.draft is not None]
    if drafted:
        raise ValueError(f"jobs {drafted} have a drafter, but a batch scheduler decodes one token per row: run "
                         "speculative decoding one request at a time (generation.generate(..., draft=...))")


class Alone(Clock):
    """The scheduler of one request on a contiguous cache: what generate runs. Its first step prefills the prompt;
    each later one feeds the last token (decode_step), or, when the job has a drafter, the last token plus up to
    k drafted ones (verify_pass), and rolls the cache back past the ones the picker rejected."""

    def __init__(self, model, job: Job, capacity: int):
        super().__init__()
        self.model, self.job, self.capacity = model, job, capacity
        self.cache, self.last, self.start = None, None, 0
        self.stats = SpecStats() if job.draft is not None else None

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


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # (B, T) left-padded
    attention_mask: torch.Tensor  # (B, T) 1 = real token, 0 = padding
    position_ids: torch.Tensor  # (B, T) positions count real tokens only

    @property
    def padding(self) -> int:
        return int((self.attention_mask == 0).sum())


def left_pad(sequences: list[list[int]], pad_id: int) -> PaddedBatch:
    """Pad on the LEFT so every row's last real token sits in the last column (where the next token is read)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every sequence in a batch needs at least one token")
    T = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(sequences), T), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(sequences):
        ids[row, T - len(seq):] = torch.tensor(seq)
        mask[row, T - len(seq):] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, T): a row's first real token is position 0
    return PaddedBatch(ids, mask, positions)


def padding_waste(lengths: list[int]) -> tuple[int, int]:
    """(padding tokens, total tokens) when these lengths are padded to the longest. Example: [2, 5] -> (3, 10)"""
    return sum(max(lengths) - n for n in lengths), max(lengths) * len(lengths)


class PaddedScheduler(Clock):
    """The running batch on a contiguous cache: its jobs, their KV cache, mask and positions. add() queues
    newcomers; each step (generation.step) runs `run`: it drops the rows that finished, runs one batched decode
    step for the tokens fed last step, then prefills the newcomers together and joins them (left-padded) to the
    batch; then every job picks one token. Continuous batching when the driver adds a job as soon as a row frees,
    static when it waits for the whole batch to end (generation.run_schedule)."""

    def __init__(self, model, clock: float | None = None):
        super().__init__(clock)
        self.model, self.rows, self.queued = model, [], []  # rows: jobs in the batch, in cache-row order
        self.cache = self.mask = self.logits = self.positions = None
        self.fed: dict[str, int] = {}  # job name -> the token to feed at the next run
        self.window = model.config.max_position_embeddings

    @property
    def jobs(self) -> list[Job]:
        """The jobs not done yet: in the batch, then queued."""
        return [j for j in self.rows if not j.finish_reason] + self.queued

    def add(self, newcomers: list[Job]) -> None:
        """Queue jobs; they are prefilled together at the next step."""
        refuse_drafts(newcomers)
        for job in newcomers:
            job.default_stopper(self.window)
        self.queued += newcomers

    def _retire(self) -> None:
        """Drop the rows whose jobs are done (finished or cancelled) from every tensor of the batch."""
        keep = [i for i, j in enumerate(self.rows) if not j.finish_reason and not j.cancelled]
        for job in self.rows:
            if job.cancelled and not job.finish_reason:
                job.finish("cancelled", self.now())
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = self.mask = self.logits = self.positions = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.model.device)
        kv_cache.select_rows(self.cache, index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.cache, self.mask = kv_cache.trim(self.cache, self.mask)

    def _prefill(self, newcomers: list[Job]):
        device = self.model.device
        batch = left_pad([j.prompt for j in newcomers], 0)
        mask = batch.attention_mask.to(device)
        room = max(j.new_tokens for j in newcomers)
        logits, cache = prefill(self.model, batch.input_ids, attention_mask=mask,
                                position_ids=batch.position_ids, capacity=batch.input_ids.shape[1] + room)
        for job in newcomers:
            job.start = self.now()
        return logits, cache, mask, mask.sum(dim=1)  # lengths (B_new,) on the device

    def run(self) -> list:
        """One step's model calls: retire, decode the tokens fed last step (one batched call), prefill and join
        the newcomers. Returns (job, (1, V) logits, None) for every row."""
        self._retire()
        if self.rows:
            if hasattr(self.model, "fit_cache"):  # a compiled runner: keep the cache in a bucket's shape (runner.compiled)
                self.cache = self.model.fit_cache(self.cache)
            tokens = torch.tensor([self.fed.pop(j.name) for j in self.rows], dtype=torch.long, device=self.model.device)
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)  # (B, S + 1)
            self.logits, self.cache = decode_step(self.model, tokens, self.cache, attention_mask=self.mask,
                                                  positions=self.positions)
            self.positions = self.positions + 1
        newcomers = [j for j in self.queued if not j.cancelled]
        for job in self.queued:
            if job.cancelled:
                job.finish("cancelled", self.now())
        self.queued = []
        if newcomers:
            logits, cache, mask, lengths = self._prefill(newcomers)
            if self.rows:
                self.cache, self.mask = kv_cache.join(self.cache, self.mask, cache, mask)
                self.logits = torch.cat([self.logits, logits])
                self.positions = torch.cat([self.positions, lengths])
            else:
                self.cache, self.mask, self.logits, self.positions = cache, mask, logits, lengths
            self.rows += newcomers
        return [(job, self.logits[i:i + 1], None) for i, job in enumerate(self.rows)]

    def feed(self, job: Job, tokens: list[int], accepted: int) -> None:
        self.fed[job.name] = tokens[-1]  # its row leaves at the next run once finished
