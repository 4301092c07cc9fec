"""Lesson 13's measurements on the paged KV cache, on the real model.

What it does: builds the lesson's trace of requests (questions about a 1,100-token handbook, which
share it as a prefix, mixed with short chat questions, arriving a few steps apart); serves it through
paged_scheduler.PagedScheduler and reports the memory a contiguous cache would reserve (each request's prompt
plus its whole token allowance, lesson 11's cache) against the blocks the paged cache holds, step by
step; times the first token of a question with and without a prefix-cache hit; and runs every request
alone through generation.generate on the contiguous cache, to check the paged runs give the same tokens.
What it does not do: draw (plots_perf does) or call the model except through the scheduler and generate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.request import end_of_turn_ids, Job
from ..engine.paged_scheduler import PagedScheduler
from ..engine.generation import generate, run_paged
from ..text.context import HANDBOOK_QUESTIONS, chat_ids, handbook_ids
from ..runner.kv_cache import model_kv_bytes_per_token
from ..runner.paged import BlockPool, PagedCache
from ..runner.blocks import blocks_for
from ..runtime import median
from .section import Section

SHORT_QUESTIONS = ("What is the capital of France?", "Name three colours.", "Why is the sky blue?",
                   "Write a haiku about rain.", "What is 12 times 7?")


def trace_jobs(model, tokenizer, new_tokens: int = 96) -> tuple[list[Job], list[int]]:
    """The lesson's trace: 3 handbook questions (about 1,130 tokens each, 1,100 of them shared) and 5 short
    chat questions, interleaved, arriving 2 decode steps apart. Returns (jobs, arrival steps)."""
    stop = frozenset(end_of_turn_ids(model, tokenizer))
    prompts = [("handbook-1", handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0]))]
    for i, q in enumerate(SHORT_QUESTIONS):
        prompts.append((f"short-{i + 1}", chat_ids(tokenizer, q)))
        if i < 2:
            prompts.append((f"handbook-{i + 2}", handbook_ids(tokenizer, HANDBOOK_QUESTIONS[i + 1])))
    jobs = [Job(name, ids, new_tokens, stop) for name, ids in prompts]
    return jobs, [2 * i for i in range(len(jobs))]


@dataclass
class TraceRun:
    """One trace served: the scheduler (events, memory log, counters), its pool, the jobs, and the time taken."""
    batch: PagedScheduler
    pool: BlockPool
    jobs: list[Job]
    seconds: float
    bytes_per_token: float

    @property
    def contiguous_bytes(self) -> list[float]:
        """Per step: what lesson 11's cache would hold for the running jobs (prompt + allowance each)."""
        return [held * self.bytes_per_token for _, _, held in self.batch.memory]

    @property
    def paged_bytes(self) -> list[int]:
        """Per step: the blocks in use, in bytes (a shared block counted once)."""
        return [used * self.pool.block_bytes for _, used, _ in self.batch.memory]

    @property
    def done(self) -> list[Job]:
        """The jobs that ran to a stop (not turned away, not cancelled)."""
        return [j for j in self.jobs if j.finish_reason not in ("rejected", "cancelled", "")]

    @property
    def finished(self) -> int:
        return len(self.done)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(j.tokens) for j in self.jobs) / self.seconds

    def timeline(self) -> dict:
        """The run as plain data, what plots_perf.plot_paged_runs draws: seconds, (seconds, blocks in use) per step,
        the scheduler's (seconds, job name, what happened) events, and the counts its title reads."""
        return {"seconds": self.seconds, "blocks_used": [(t, used) for t, used, _ in self.batch.memory],
                "events": list(self.batch.events), "finished": self.finished, "tokens_per_s": self.tokens_per_s,
                "recomputed_tokens": self.batch.recomputed_tokens}

    def waits(self) -> dict[str, dict[str, float]]:
        """Per finished job, seconds from its arrival (queued) to its first token and to its end."""
        queued = {}
        for t, who, what in self.batch.events:
            if what == "queued":
                queued[who] = t
        return {j.name: {"first_token": j.first_token - queued[j.name], "end": j.end - queued[j.name]}
                for j in self.done if j.name in queued}

    def mean_wait_to_end(self) -> float:
        """Seconds from arrival to the last token, averaged over the jobs that ran to a stop."""
        ends = [w["end"] for w in self.waits().values()]
        return sum(ends) / len(ends) if ends else float("nan")


def run_trace(model, jobs: list[Job], arrivals: list[int], num_blocks: int, policy: str = "preempt",
              max_batch: int = 8, prefix_caching: bool = True, attention: str = "paged") -> TraceRun:
    """Serve the trace on a fresh pool of num_blocks blocks (decode attention `attention`: paged.ATTENTION).
    The jobs are copied: the same list can be run again under another policy."""
    jobs = [Job(j.name, list(j.prompt), j.new_tokens, j.stop_ids, j.pick) for j in jobs]
    pool = BlockPool.for_model(model, num_blocks, prefix_caching=prefix_caching, attention=attention)
    start = time.perf_counter()
    batch = run_paged(model, jobs, pool, policy, max_batch, arrivals)
    seconds = time.perf_counter() - start
    pool.manager.check()
    return TraceRun(batch, pool, jobs, seconds, model_kv_bytes_per_token(model.config, model.dtype))


def alone_tokens(model, tokenizer, jobs: list[Job]) -> dict[str, list[int]]:
    """Each job's prompt run alone by generation.generate on the contiguous cache (same limit, same stops)."""
    return {j.name: generate(model, tokenizer, j.prompt, max_new_tokens=j.new_tokens, stop_ids=j.stop_ids).token_ids
            for j in jobs}


def prefix_ttft(model, tokenizer, questions=HANDBOOK_QUESTIONS[:4], prefix_caching: bool = True,
                num_blocks: int = 100) -> list[dict]:
    """Handbook questions asked one after another on one pool: time to first token (admission to the first
    token: the prefill of what is not cached, plus one pick) and how many prompt tokens came from the cache."""
    pool, rows = BlockPool.for_model(model, num_blocks, prefix_caching=prefix_caching), []
    for q in questions:
        job, hits = Job("q", handbook_ids(tokenizer, q), 1), pool.hits
        batch = run_paged(model, [job], pool)
        rows.append({"question": q, "prompt_tokens": len(job.prompt), "reused_tokens": pool.hits - hits,
                     "ttft_s": job.first_token - job.start, "token": job.tokens[0]})
        assert not batch.jobs
    pool.manager.check()
    return rows


def gather_seconds(pool: BlockPool, seqs, repeats: int = 5) -> float:
    """Seconds to gather these sequences' keys and values from their blocks into one (B, KV, S, D) tensor per
    layer, as PagedCache.write does for a prompt and, with attention="gather", for every decode step (the default
    decode reads the blocks through the tables instead: lesson 16). The median of `repeats`."""
    from ..runtime import synchronize
    _, read = PagedCache(pool, list(seqs)).slots(0)  # (B, S)
    device = pool.keys[0].device
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for keys, values in zip(pool.keys, pool.values):
            keys[read].transpose(1, 2), values[read].transpose(1, 2)  # (B, KV, S, D) each
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def budget_blocks(run: TraceRun, share: float = 0.85) -> int:
    """A pool smaller than the trace's peak (share of it), yet big enough for its longest request alone."""
    peak = max(used for _, used, _ in run.batch.memory)
    longest = max(blocks_for(len(j.prompt) + j.new_tokens, run.pool.block_size) for j in run.jobs)
    return max(int(share * peak), longest + 1)


def bench_section(model, tokenizer, quick: bool = False) -> dict:
    """The bench's `paged` section (lesson 13) on the course's own model built on `model`'s weights."""
    from ..runner.model import Model
    ours = model if isinstance(model, Model) else Model.from_transformers(model)
    jobs, arrivals = trace_jobs(ours, tokenizer, 8 if quick else 96)
    if quick:
        jobs, arrivals = jobs[:3], arrivals[:3]
    alone = alone_tokens(ours, tokenizer, jobs)
    roomy = run_trace(ours, jobs, arrivals, 160)
    budget = budget_blocks(roomy)
    tight = {p: run_trace(ours, jobs, arrivals, budget, p) for p in ("preempt", "reserve", "reject")}
    questions = HANDBOOK_QUESTIONS[:2 if quick else 4]
    hit, miss = prefix_ttft(ours, tokenizer, questions), prefix_ttft(ours, tokenizer, questions, prefix_caching=False)
    same = (all(j.tokens == alone[j.name] for j in roomy.jobs) and all(j.tokens == alone[j.name] for j in tight["preempt"].jobs)
            and all(j.tokens == alone[j.name] for j in tight["reject"].jobs if j.finish_reason != "rejected")
            and all(j.tokens == alone[j.name] for j in tight["reserve"].jobs)
            and [r["token"] for r in hit] == [r["token"] for r in miss])
    ttft_hit, ttft_miss = median([r["ttft_s"] for r in hit[1:]]), median([r["ttft_s"] for r in miss])
    hits = sum(r["reused_tokens"] for r in hit)
    return {
        "same_tokens": same, "requests": len(jobs), "block_size": roomy.pool.block_size,
        "kv_bytes_contiguous": max(roomy.contiguous_bytes), "kv_bytes_paged": max(roomy.paged_bytes),
        "trace_prefix_hit_rate": roomy.pool.hit_rate,
        "prefix_tokens": max(r["reused_tokens"] for r in hit), "prefix_hit_rate": hits / sum(r["prompt_tokens"] for r in hit),
        "ttft_no_prefix_s": ttft_miss, "ttft_prefix_s": ttft_hit, "prefix_ttft_ratio": ttft_miss / ttft_hit,
        "budget_blocks": budget, "preempted": tight["preempt"].batch.preempted,
        "recomputed_tokens": tight["preempt"].batch.recomputed_tokens,
        "finished_preempt": tight["preempt"].finished, "finished_reject": tight["reject"].finished,
        "tokens_per_s_preempt": tight["preempt"].tokens_per_s, "tokens_per_s_reject": tight["reject"].tokens_per_s,
        "finished_reserve": tight["reserve"].finished, "tokens_per_s_reserve": tight["reserve"].tokens_per_s,
        "seconds_preempt": tight["preempt"].seconds, "seconds_reserve": tight["reserve"].seconds,
        "mean_wait_to_end_s": {p: r.mean_wait_to_end() for p, r in tight.items()},
    }


def _targets(result: dict) -> list:
    out = []
    p = result["paged"]
    out.append(("paged: same tokens as the contiguous cache (alone, batched, prefix hits, preempted)",
                str(p["same_tokens"]), p["same_tokens"]))
    out.append(("paged: at most half the bytes of the contiguous cache on the trace",
                f"{p['kv_bytes_paged'] / 1e6:.0f} vs {p['kv_bytes_contiguous'] / 1e6:.0f} MB",
                p["kv_bytes_paged"] <= 0.5 * p["kv_bytes_contiguous"]))
    out.append((f"paged: a {p['prefix_tokens']}-token prefix hit cuts time to first token at least 3x",
                f"{p['prefix_ttft_ratio']:.1f}x", p["prefix_ttft_ratio"] >= 3.0))
    return out


def _report(result: dict) -> list:
    lines = []
    p = result["paged"]
    lines.append(f"paged: trace of {p['requests']} requests, peak KV {p['kv_bytes_paged'] / 1e6:.0f} MB paged vs "
                 f"{p['kv_bytes_contiguous'] / 1e6:.0f} MB contiguous; first token {p['ttft_no_prefix_s']:.3f} s -> "
                 f"{p['ttft_prefix_s']:.3f} s with a prefix hit ({p['prefix_ttft_ratio']:.1f}x, hit rate "
                 f"{p['prefix_hit_rate']:.2f}); {p['budget_blocks']} blocks: preempt finished {p['finished_preempt']} "
                 f"({p['preempted']} preemptions, {p['recomputed_tokens']} tokens recomputed), reject {p['finished_reject']}"
                 + (f", reserve-and-wait {p['finished_reserve']} in {p['seconds_reserve']:.1f} s against preempt's {p['seconds_preempt']:.1f} s" if 'finished_reserve' in p else ""))
    return lines


SECTION = Section("paged", "lesson 13: paged KV cache, prefix caching, preemption",
                  lambda m, t, q: {"paged": bench_section(m, t, q)}, _targets, _report)
