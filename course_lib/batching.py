"""Batching: several requests share each forward pass.

What it does: left-pads prompts of different lengths into one (B, T) batch with an attention mask
and per-row position IDs; and schedules a queue of requests either statically (fixed batches, each
waiting for its longest member) or continuously (a finished request's slot is refilled at once: its
KV cache rows are dropped and the newcomer's prefilled cache is padded and joined to the batch).
Every forward pass goes through generation.prefill / decode_step, every token through the job's
picker (greedy unless one is given: then it samples) and every stop through generation.Stopper, so
a batched request stops exactly as it would alone, stop strings included. Every request's timeline
is recorded. Works on the library's model and on the course's own (`model.Model`).
`PagedBatch` (lesson 13) schedules over a paged KV cache instead: admission by free blocks with headroom (a
watermark), refusal on arrival of what could never fit, each prompt prefilled alone past its cached prefix,
whole or in chunks within a per-step token budget (chunked prefill: running requests keep decoding while a
long prompt is read), preemption and recompute (or rejection) when the pool is full.
What it does not do: manage the blocks themselves (paged.py does), call the model other than through
generation's stages, or pack prompt chunks and decode rows into one model call (production engines do).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from . import kv_cache
from .generation import Job, Stopper, check_request, decode_step, end_of_turn_ids, prefill, step
from .paged import OutOfBlocks, Sequence, blocks_for


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) left-padded
    attention_mask: torch.Tensor  # (B, T) 1 = real token, 0 = padding
    position_ids: torch.Tensor  # (B, T) positions count real tokens only

    @property
    def padding(self) -> int:
        return int((self.attention_mask == 0).sum())


def left_pad(sequences: list[list[int]], pad_id: int) -> Batch:
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
    return Batch(ids, mask, positions)


def padding_waste(lengths: list[int]) -> tuple[int, int]:
    """(padding tokens, total tokens) when these lengths are padded to the longest. Example: [2, 5] -> (3, 10)"""
    return sum(max(lengths) - n for n in lengths), max(lengths) * len(lengths)


def generate_static(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, stop: bool = True) -> list[list[int]]:
    """Greedy generation for one static batch; each row stops at its end-of-turn token (if stop) or the limit."""
    stop_ids = frozenset(end_of_turn_ids(model, tokenizer)) if stop else frozenset()
    jobs = [Job(f"r{i}", list(p), max_new_tokens, stop_ids) for i, p in enumerate(prompts)]
    run_schedule(model, jobs, max_batch=len(jobs), continuous=False)
    return [j.tokens for j in jobs]


class ContinuousBatch:
    """The running batch of a continuous-batching server: its jobs, their KV cache, mask and positions.
    add() queues newcomers; each step (generation.step) runs `run`: it drops the rows that finished, runs one
    batched decode step for the tokens fed last step, then prefills the newcomers together and joins them
    (left-padded) to the batch; then every job picks one token."""

    def __init__(self, model, clock: float | None = None):
        self.model, self.rows, self.queued = model, [], []  # rows: jobs in the batch, in cache-row order
        self.cache = self.mask = self.logits = self.positions = None
        self.fed: dict[str, int] = {}  # job name -> the token to feed at the next run
        self.clock = time.perf_counter() if clock is None else clock
        self.window = model.config.max_position_embeddings

    @property
    def jobs(self) -> list[Job]:
        """The jobs not done yet: in the batch, then queued."""
        return [j for j in self.rows if not j.finish_reason] + self.queued

    def now(self) -> float:
        return time.perf_counter() - self.clock

    def add(self, newcomers: list[Job]) -> None:
        """Queue jobs; they are prefilled together at the next step."""
        for job in newcomers:
            if job.stopper is None:
                job.stopper = Stopper(None, job.stop_ids, job.new_tokens, self.window - len(job.prompt))
        self.queued += newcomers

    def _retire(self) -> None:
        """Drop the rows whose jobs are done (finished or cancelled) from every tensor of the batch."""
        keep = [i for i, j in enumerate(self.rows) if not j.finish_reason and not j.cancelled]
        for job in self.rows:
            if job.cancelled and not job.finish_reason:
                job.finish_reason, job.end = "cancelled", self.now()
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
            tokens = torch.tensor([self.fed.pop(j.name) for j in self.rows], dtype=torch.long, device=self.model.device)
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)  # (B, S + 1)
            self.logits, self.cache = decode_step(self.model, tokens, self.cache, attention_mask=self.mask,
                                                  positions=self.positions)
            self.positions = self.positions + 1
        newcomers = [j for j in self.queued if not j.cancelled]
        for job in self.queued:
            if job.cancelled:
                job.finish_reason, job.end = "cancelled", self.now()
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
        self.fed[job.name] = tokens[-1]

    def finish(self, job: Job, reason: str, stamp: float) -> None:
        job.finish_reason, job.end = reason, stamp  # its row leaves at the next run

    def step(self) -> list[tuple[Job, int]]:
        """One step of the one loop (generation.step): one token for every job. Returns what was emitted."""
        if not self.jobs:
            return []
        return [(job, token) for job, token, _, _ in step(self)]


def run_schedule(model, jobs: list[Job], max_batch: int, continuous: bool) -> list[Job]:
    """Serve jobs queued at time 0, at most max_batch at a time.
    Static: admit a full batch, run it until its longest job ends, then the next batch.
    Continuous: whenever a job ends, the next queued job takes its slot at the next step."""
    queue, batch = list(jobs), ContinuousBatch(model)
    while queue or batch.jobs:
        if queue and len(batch.jobs) < max_batch and (continuous or not batch.jobs):
            newcomers = queue[: max_batch - len(batch.jobs)]
            del queue[: len(newcomers)]
            batch.add(newcomers)
        batch.step()
    return jobs


REJECTED = "rejected"  # a scheduler's verdict, not a stop: the request never ran (the memory could not hold it)
PAGED_POLICIES = ("preempt", "reserve", "reject")


def check_budget(token_budget, max_batch: int) -> int | None:
    """None (each prompt prefilled whole) or a whole number of tokens per step above max_batch (the running
    rows take one token each; the rest goes to prompts). Example: (256, 8) -> 256; (8, 8) is refused"""
    if token_budget is None:
        return None
    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget <= max_batch:
        raise ValueError(f"token_budget must be a whole number of tokens above max_batch ({max_batch}): each running "
                         f"request decodes one token per step and prompts get the rest; got {token_budget!r}")
    return token_budget


class PagedBatch:
    """Continuous batching over a paged KV cache (lesson 13). Jobs wait in a queue and are admitted when the blocks
    for their prompt fit with `watermark` blocks to spare (headroom, so a newcomer is not admitted and then
    preempted at once); a job that could never fit the pool, prompt plus allowance, is refused when it arrives.
    Each step has a token budget: every running job decodes one token, and what is left of `token_budget` goes to
    prompts, in chunks, oldest first (chunked prefill: a long prompt no longer stalls the others; None = each
    prompt is prefilled whole in the step that admits it). The decode rows run as one batched call through their
    block tables and each prompt chunk as one call of its own (production engines pack both into one call).
    When a running job needs a block and none is free: "preempt" (vLLM's way) frees the most recently admitted
    job's blocks and puts it back at the front of the queue, to be recomputed later (prompt and tokens so far,
    minus what the prefix cache still holds). "reserve" (reserve-and-wait, what a server without preemption does)
    admits a job only once blocks for its prompt plus all its new tokens can be reserved, and keeps it waiting
    until then, so no running job ever runs short; "reject" turns such a job away instead. Same interface as
    ContinuousBatch (jobs, add, step), so the server runs it."""

    def __init__(self, model, pool, policy: str = "preempt", max_batch: int = 8, clock: float | None = None,
                 token_budget: int | None = None, watermark: int | None = None):
        if policy not in PAGED_POLICIES:
            raise ValueError(f"policy must be one of {PAGED_POLICIES}, got {policy!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
        self.model, self.pool, self.policy, self.max_batch = model, pool, policy, max_batch
        self.token_budget = check_budget(token_budget, max_batch)
        blocks = pool.manager.num_blocks
        self.watermark = max(1, blocks // 100) if watermark is None else watermark  # vLLM keeps 1% free
        if not isinstance(self.watermark, int) or not 0 <= self.watermark < blocks:
            raise ValueError(f"watermark must be a whole number of blocks in [0, {blocks}), got {watermark!r}")
        self.waiting: list[Job] = []  # first in, first out; a preempted job goes back to the front
        self.running: list[Job] = []  # in order of admission
        self.seqs, self.logits, self.reserved = {}, {}, {}  # by job name: Sequence, (V,) logits, blocks reserved
        self.clock = time.perf_counter() if clock is None else clock
        self.window = model.config.max_position_embeddings
        self.preempted = self.recomputed_tokens = self.rejected = 0
        self.prefill_chunks = 0  # model calls that ran part (or all) of a prompt
        # note: bounded, so a server running for days does not grow them without end
        self.events = collections.deque(maxlen=100_000)  # (seconds, job name, what happened)
        self.memory = collections.deque(maxlen=100_000)  # per step: (seconds, blocks used, tokens a contiguous cache reserves)

    @property
    def jobs(self) -> list[Job]:
        return self.running + self.waiting

    def now(self) -> float:
        return time.perf_counter() - self.clock

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.pool.manager.num_blocks * self.pool.block_size

    def fits(self, tokens: int) -> bool:
        """Could a request of this many tokens (prompt plus allowance) ever run in this pool, alone?"""
        return blocks_for(tokens, self.pool.block_size) <= self.pool.manager.num_blocks

    def add(self, newcomers: list[Job]) -> None:
        """Queue jobs (checked first: a bad prompt is refused here, not deep inside a later step). A job whose prompt
        plus allowance could never fit the pool is refused now (finish reason REJECTED), before any token."""
        names = [j.name for j in newcomers]
        for job in newcomers:
            job.prompt = check_request(self.model, job.prompt, job.new_tokens)
            if job.name in self.seqs or names.count(job.name) > 1:
                raise ValueError(f"a job named {job.name!r} is already in this batch: names must be unique")
        for job in newcomers:
            if not self.fits(len(job.prompt) + job.new_tokens):
                self.rejected += 1
                job.finish_reason, job.end = REJECTED, self.now()
                self.events.append((job.end, job.name, REJECTED))
                continue
            if job.stopper is None:
                job.stopper = Stopper(None, job.stop_ids, job.new_tokens, self.window - len(job.prompt))
            self.seqs[job.name] = Sequence(list(job.prompt), salt=job.cache_salt)
            self.waiting.append(job)
            self.events.append((self.now(), job.name, "queued"))

    def _leave(self, job: Job, reason: str, stamp: float) -> None:
        job.finish_reason, job.end = reason, stamp
        self.events.append((stamp, job.name, reason))
        if job in self.running:
            self.running.remove(job)
            self.pool.free(self.seqs[job.name])
        elif job in self.waiting:
            self.waiting.remove(job)
        self.seqs.pop(job.name, None)
        self.logits.pop(job.name, None)
        self.reserved.pop(job.name, None)

    def _admit(self) -> None:
        """Admit waiting jobs in order while their prompt's blocks fit with the watermark to spare (a job is admitted
        into an empty batch whenever it fits at all, so nothing waits forever). No model call: prompts are run by
        `_prefill`, within the step's budget."""
        manager = self.pool.manager
        while self.waiting and len(self.running) < self.max_batch:
            job, stamp = self.waiting[0], self.now()
            seq = self.seqs[job.name]
            if job.cancelled:
                self._leave(job, "cancelled", stamp)
                continue
            need = blocks_for(len(job.prompt) + job.new_tokens, self.pool.block_size)
            if self.policy != "preempt" and sum(self.reserved.values()) + need > manager.num_blocks:
                if self.policy == "reserve":
                    break  # wait until a running job finishes and gives its reservation back
                self.rejected += 1
                self._leave(job, REJECTED, stamp)
                continue
            cost = self.pool.admit_cost(seq, extra=1)
            if cost > manager.num_blocks:  # it could never fit, even alone (a recomputed job that grew too long)
                self.rejected += 1
                self._leave(job, REJECTED, stamp)
                continue
            spare = self.watermark if self.running else 0
            if cost > manager.num_free - spare:
                break  # wait until running jobs give blocks back
            self.waiting.pop(0)
            if self.policy != "preempt":
                self.reserved[job.name] = need  # note: only once admitted, so a waiting job never counts itself
            before = seq.was_computed
            hit = self.pool.admit(seq)
            self.pool.grow(seq, len(seq.tokens))  # the whole prompt's blocks now: a prefill never stalls half-way
            self.recomputed_tokens += max(0, before - hit)
            if job.start != job.start:  # first admission (start is NaN until then)
                job.start = stamp
            self.events.append((stamp, job.name, "admitted"))
            self.running.append(job)

    def _prefill(self, budget: float) -> None:
        """Run prompt tokens of admitted jobs, oldest first, at most `budget` in all (a chunk per job per step);
        a job whose prompt is complete gets its logits, to pick its first token this very step."""
        for job in self.running:
            seq = self.seqs[job.name]
            left = len(seq.tokens) - seq.computed
            if left <= 0 or job.name in self.logits:
                continue
            if budget <= 0:
                break
            n = int(min(left, budget))
            logits, _ = prefill(self.model, seq.tokens[seq.computed:seq.computed + n], cache=self.pool.view([seq]))
            self.prefill_chunks += 1
            budget -= n
            if seq.computed == len(seq.tokens):
                self.logits[job.name] = logits[0]

    def _preempt(self, job: Job, stamp: float) -> None:
        seq = self.seqs[job.name]
        seq.was_computed = seq.computed  # what recomputing it will redo, less what the prefix cache keeps
        seq.preempted += 1
        self.pool.free(seq)
        self.running.remove(job)
        self.logits.pop(job.name, None)
        self.waiting.insert(0, job)
        self.preempted += 1
        self.events.append((stamp, job.name, "preempted"))

    def _decode(self, stamp: float) -> int:
        """One batched decode step for every running job with a token to feed (making room first, preempting the
        most recently admitted job while the pool is dry). Returns how many rows it ran."""
        ready = lambda: [j for j in self.running if self.seqs[j.name].computed == len(self.seqs[j.name].tokens) - 1]  # noqa: E731
        for job in ready():  # each needs a slot for the token it feeds
            seq = self.seqs[job.name]
            while job in self.running:
                try:
                    self.pool.grow(seq, seq.computed + 1)
                    break
                except OutOfBlocks:
                    self._preempt(self.running[-1], stamp)  # the most recently admitted (maybe this very job)
        rows = ready()
        if rows:
            seqs = [self.seqs[j.name] for j in rows]
            view = self.pool.view(seqs)
            tokens = [s.tokens[-1] for s in seqs]
            logits, _ = decode_step(self.model, tokens, view, attention_mask=view.attention_mask(1),
                                    positions=view.positions())
            self.logits.update({j.name: logits[i] for i, j in enumerate(rows)})
        return len(rows)

    def run(self) -> list:
        """One step's model calls: the cancelled leave; the tokens fed last step are decoded in one batched call;
        waiting jobs are admitted; prompts are read within what is left of the token budget. Returns
        (job, (1, V) logits, None) for every job that has logits to pick from."""
        stamp = self.now()
        for job in [j for j in self.jobs if j.cancelled]:
            self._leave(job, "cancelled", stamp)
        decoded = self._decode(stamp)
        self._admit()
        self._prefill(float("inf") if self.token_budget is None else self.token_budget - decoded)
        held = sum(len(j.prompt) + j.new_tokens for j in self.running)
        self.memory.append((self.now(), self.pool.manager.num_used, held))
        return [(job, self.logits.pop(job.name)[None], None) for job in list(self.running) if job.name in self.logits]

    def feed(self, job: Job, tokens: list[int], accepted: int) -> None:
        self.seqs[job.name].tokens += tokens  # the last one is fed at the next step

    def finish(self, job: Job, reason: str, stamp: float) -> None:
        self._leave(job, reason, stamp)

    def step(self) -> list[tuple[Job, int]]:
        """One step of the one loop (generation.step): decode, admit, read prompts within the budget, and pick one
        token for every job that has logits. Returns what was emitted."""
        if not self.jobs:
            return []
        return [(job, token) for job, token, _, _ in step(self)]


def run_paged(model, jobs: list[Job], pool, policy: str = "preempt", max_batch: int = 8,
              arrivals: list[int] | None = None, token_budget: int | None = None) -> PagedBatch:
    """Serve jobs through a PagedBatch; arrivals[i] = the step at which job i arrives (all at 0 if None);
    token_budget: tokens per step (chunked prefill), None = each prompt whole.
    Returns the batch (its events, memory log and counters); the jobs hold their tokens and reasons."""
    arrivals = [0] * len(jobs) if arrivals is None else list(arrivals)
    if len(arrivals) != len(jobs):
        raise ValueError(f"{len(jobs)} jobs but {len(arrivals)} arrival steps")
    batch, order, step = PagedBatch(model, pool, policy, max_batch, token_budget=token_budget), sorted(range(len(jobs)), key=arrivals.__getitem__), 0
    while order or batch.jobs:
        arrived = [jobs[i] for i in order if arrivals[i] <= step]
        order = [i for i in order if arrivals[i] > step]
        if arrived:
            batch.add(arrived)
        batch.step()
        step += 1
    return batch
