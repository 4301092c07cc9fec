"""Batching: several requests share each forward pass.

What it does: left-pads prompts of different lengths into one (B, T) batch with an attention mask
and per-row position IDs; and schedules a queue of requests either statically (fixed batches, each
waiting for its longest member) or continuously (a finished request's slot is refilled at once: its
KV cache rows are dropped and the newcomer's prefilled cache is padded and joined to the batch).
Every forward pass goes through generation.prefill / decode_step, every token through the job's
picker (greedy unless one is given: then it samples) and every stop through generation.Stopper, so
a batched request stops exactly as it would alone, stop strings included. Every request's timeline
is recorded. Works on the library's model and on the course's own (`model.Model`).
What it does not do: page the KV cache (lesson 13).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import kv_cache
from .generation import Pick, Stopper, decode_step, end_of_turn_ids, prefill
from .sampling import greedy


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


@dataclass
class Job:
    """One request being served: prompt, how many tokens it may have, and when things happened."""
    name: str
    prompt: list[int]
    new_tokens: int
    stop_ids: frozenset = frozenset()  # tokens that end it early (end of turn); empty = run to new_tokens
    pick: Pick | None = None  # None = greedy
    stopper: Stopper | None = None  # None = made at admission from stop_ids and new_tokens (no stop strings)
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False  # set from outside (a client left); the job leaves at the next step
    finish_reason: str = ""  # one of generation.STOP_REASONS once it is done
    start: float = float("nan")  # seconds since the run began: admitted to a batch
    first_token: float = float("nan")
    end: float = float("nan")


class ContinuousBatch:
    """The running batch of a continuous-batching server: its jobs, their KV cache, mask and positions.
    add() prefills newcomers and joins them; step() picks one token per job, retires finished jobs,
    and runs one batched decode step for the rest."""

    def __init__(self, model, clock: float | None = None):
        self.model, self.jobs = model, []
        self.cache = self.mask = self.logits = self.positions = None
        self.clock = time.perf_counter() if clock is None else clock
        self.window = model.config.max_position_embeddings

    def now(self) -> float:
        return time.perf_counter() - self.clock

    def add(self, newcomers: list[Job]) -> None:
        device = self.model.device
        batch = left_pad([j.prompt for j in newcomers], 0)
        mask = batch.attention_mask.to(device)
        room = max(j.new_tokens for j in newcomers)
        logits, cache = prefill(self.model, batch.input_ids, attention_mask=mask,
                                position_ids=batch.position_ids, capacity=batch.input_ids.shape[1] + room)
        lengths = mask.sum(dim=1)  # (B_new,) on the device
        for job in newcomers:
            job.start = self.now()
            if job.stopper is None:
                job.stopper = Stopper(None, job.stop_ids, job.new_tokens, self.window - len(job.prompt))
        if self.jobs:
            self.cache, self.mask = kv_cache.join(self.cache, self.mask, cache, mask)
            self.logits = torch.cat([self.logits, logits])
            self.positions = torch.cat([self.positions, lengths])
        else:
            self.cache, self.mask, self.logits, self.positions = cache, mask, logits, lengths
        self.jobs += newcomers

    def step(self) -> list[tuple[Job, int]]:
        """One token for every job; returns what was emitted. Finished and cancelled jobs leave the batch."""
        if not self.jobs:
            return []
        tokens = [(j.pick or greedy)(self.logits[i])[0] for i, j in enumerate(self.jobs)]
        stamp, emitted, keep = self.now(), [], []
        for row, (job, token) in enumerate(zip(self.jobs, tokens)):
            if job.cancelled:
                job.finish_reason, job.end = "cancelled", stamp
                continue
            job.tokens.append(token)
            emitted.append((job, token))
            if len(job.tokens) == 1:
                job.first_token = stamp
            reason = job.stopper.update(token)
            if reason:
                job.finish_reason, job.end = reason, stamp
            else:
                keep.append(row)
        device = self.model.device
        tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        if len(keep) < len(self.jobs):  # drop finished rows from every tensor of the batch
            self.jobs = [self.jobs[i] for i in keep]
            if not self.jobs:
                self.cache = self.mask = self.logits = self.positions = None
                return emitted
            index = torch.tensor(keep, dtype=torch.long, device=device)
            kv_cache.select_rows(self.cache, index)
            self.mask, tokens, self.positions = self.mask[index], tokens[index], self.positions[index]
            self.cache, self.mask = kv_cache.trim(self.cache, self.mask)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)  # (B, S + 1)
        self.logits, self.cache = decode_step(self.model, tokens, self.cache, attention_mask=self.mask,
                                              positions=self.positions)
        self.positions = self.positions + 1
        return emitted


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


def throughput_latency(model, prompt: list[int], batch_sizes: list[int], new_tokens: int) -> list[dict]:
    """The same prompt B times in one static batch, exactly new_tokens each: aggregate tokens per second
    and the latency every request sees (they all finish together)."""
    rows = []
    for size in batch_sizes:
        jobs = [Job(f"r{i}", prompt, new_tokens) for i in range(size)]
        start = time.perf_counter()
        run_schedule(model, jobs, size, continuous=False)
        seconds = time.perf_counter() - start
        rows.append({"batch": size, "seconds": seconds, "tokens_per_s": size * new_tokens / seconds,
                     "latency_s": seconds})
    return rows
