"""Batching: several requests share each forward pass.

What it does: left-pads prompts of different lengths into one (B, T) batch with an attention mask
and per-row position IDs; runs greedy generation for a static batch; and schedules a queue of
requests either statically (fixed batches, each waiting for its longest member) or continuously
(a finished request's slot is refilled at once: its KV cache rows are dropped and the newcomer's
prefilled cache is padded and joined to the batch). Every request's timeline is recorded.
What it does not do: page the KV cache or sample (greedy only, so batched output can be checked
against each request run alone).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from .generation import end_of_turn_ids


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


@torch.inference_mode()
def batch_prefill(model, batch: Batch):
    """One forward pass over a padded batch. Returns (last-position logits (B, V), cache)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=batch.input_ids.to(model.device), attention_mask=batch.attention_mask.to(model.device),
                position_ids=batch.position_ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float(), out.cache


@torch.inference_mode()
def batch_decode_step(model, tokens: torch.Tensor, cache, mask: torch.Tensor, positions: torch.Tensor):
    """One new token per row. mask: (B, T_cache) before this step; positions: (B,) of the new tokens.
    Returns (logits (B, V), cache, mask (B, T_cache + 1))."""
    mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], dim=1)  # (B, T + 1)
    out = model(input_ids=tokens.reshape(-1, 1).to(model.device), attention_mask=mask.to(model.device),
                position_ids=positions.reshape(-1, 1).to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float(), out.cache, mask


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
    pick: Callable[[torch.Tensor], int] | None = None  # None = greedy
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False  # set from outside (a client left); the job leaves at the next step
    finish_reason: str = ""
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

    def now(self) -> float:
        return time.perf_counter() - self.clock

    def add(self, newcomers: list[Job]) -> None:
        batch = left_pad([j.prompt for j in newcomers], 0)
        logits, cache = batch_prefill(self.model, batch)
        lengths = batch.attention_mask.sum(dim=1)  # (B_new,)
        for job in newcomers:
            job.start = self.now()
        if self.jobs:
            self.cache, self.mask = _join(self.cache, self.mask, cache, batch.attention_mask)
            self.logits = torch.cat([self.logits, logits])
            self.positions = torch.cat([self.positions, lengths])
        else:
            self.cache, self.mask, self.logits, self.positions = cache, batch.attention_mask, logits, lengths
        self.jobs += newcomers

    def step(self) -> list[tuple[Job, int]]:
        """One token for every job; returns what was emitted. Finished and cancelled jobs leave the batch."""
        if not self.jobs:
            return []
        tokens = [j.pick(self.logits[i]) if j.pick else int(self.logits[i].argmax()) for i, j in enumerate(self.jobs)]
        stamp, emitted, keep = self.now(), [], []
        for row, (job, token) in enumerate(zip(self.jobs, tokens)):
            if job.cancelled:
                job.finish_reason, job.end = "cancelled", stamp
                continue
            job.tokens.append(token)
            emitted.append((job, token))
            if len(job.tokens) == 1:
                job.first_token = stamp
            if token in job.stop_ids or len(job.tokens) >= job.new_tokens:
                job.finish_reason = "stop" if token in job.stop_ids else "length"
                job.end = stamp
            else:
                keep.append(row)
        tokens = torch.tensor(tokens, dtype=torch.long)
        if len(keep) < len(self.jobs):  # drop finished rows from every tensor of the batch
            index = torch.tensor(keep, dtype=torch.long)
            self.jobs = [self.jobs[i] for i in keep]
            if not self.jobs:
                self.cache = self.mask = self.logits = self.positions = None
                return emitted
            self.cache.batch_select_indices(index.to(self.model.device))
            self.mask, tokens, self.positions = self.mask[index], tokens[index], self.positions[index]
            self.cache, self.mask = _trim(self.cache, self.mask)
        self.logits, self.cache, self.mask = batch_decode_step(self.model, tokens, self.cache, self.mask, self.positions)
        self.positions = self.positions + 1
        return emitted


def _join(cache_a, mask_a, cache_b, mask_b):
    """Concatenate two batched caches along the batch, left-padding the shorter in time. Returns (cache, mask)."""
    Ta, Tb = mask_a.shape[1], mask_b.shape[1]
    T = max(Ta, Tb)
    pad = lambda x, n: torch.nn.functional.pad(x, (0, 0, n, 0)) if n else x  # noqa: E731 - (B, KV, T, D) left pad T
    for la, lb in zip(cache_a.layers, cache_b.layers):
        la.keys = torch.cat([pad(la.keys, T - Ta), pad(lb.keys, T - Tb)], dim=0)
        la.values = torch.cat([pad(la.values, T - Ta), pad(lb.values, T - Tb)], dim=0)
    mask = torch.cat([torch.nn.functional.pad(mask_a, (T - Ta, 0)), torch.nn.functional.pad(mask_b, (T - Tb, 0))])
    return cache_a, mask


def _trim(cache, mask):
    """Drop leading columns that are padding in every row (left behind when a long request leaves)."""
    first = int(mask.any(dim=0).nonzero()[0])
    if first:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        mask = mask[:, first:]
    return cache, mask


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
