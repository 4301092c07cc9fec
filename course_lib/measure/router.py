"""Replicas behind sglang-router, measured (lesson 18, the bench's fleet.router): a trace of questions in groups,
each group sharing a long system prompt, replayed through the router under each policy and to one replica alone.

What it does: `grouped_trace` makes the trace (Poisson arrivals, groups interleaved at random, a tag in front of
every prompt so that no run finds an earlier run's prefixes in the replicas' caches); `policy_run` replays it
through a router with one policy and reports the serving figures (measure/load.summarize) with each replica's
requests and prefix hit rate over that run alone; `alone_run` replays it to one replica without a router;
`death_run` kills one replica while a trace is in flight and reports how every request ended (answered, an
error, or lost: neither, which must never happen); `router_figures` is the bench's fleet.router.
What it does not do: start the router binary or the replicas (serve/replicas.py does), or pick the policy for
you: the figures hold for this trace, these replicas and this machine only.
"""
from __future__ import annotations

import random
import threading

from .load import TraceRequest, replay, summarize

TTFT_TARGET_S, GAP_TARGET_S = 10.0, 2.0  # goodput's targets on a 2-core CPU (a GPU service states tighter ones)


def grouped_trace(tag: str, groups: int = 3, per_group: int = 4, prefix_chars: int = 1200, rate: float = 1.0,
                  seed: int = 0, max_tokens: int = 8) -> list[TraceRequest]:
    """groups x per_group questions; the questions of one group share a system prompt of `prefix_chars`
    characters of the makerspace handbook, behind "<tag> group <g>", so groups differ from their first block
    and a new tag shares nothing with an old one. Example: grouped_trace("run1", groups=2, per_group=3)"""
    from ..text.context import HANDBOOK_QUESTIONS, handbook_messages
    for name, value in (("groups", groups), ("per_group", per_group), ("prefix_chars", prefix_chars)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    rng = random.Random(seed)
    doc = handbook_messages(HANDBOOK_QUESTIONS[0])[0]["content"][:prefix_chars]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    out, at = [], 0.0
    for i, g in enumerate(order):
        at += rng.expovariate(rate)
        messages = [{"role": "system", "content": f"{tag} group {g}. {doc}"},
                    {"role": "user", "content": rng.choice(HANDBOOK_QUESTIONS)}]
        out.append(TraceRequest(f"{tag}-q{i}-g{g}", f"group{g}", at, messages, max_tokens))
    return out


def _pools(replicas) -> list[dict]:
    from ..serve.replicas import health
    return [health(r.url) for r in replicas]


def _per_replica(before: list[dict], after: list[dict]) -> list[dict]:
    rows = []
    for b, a in zip(before, after):
        looked = a["kv_blocks"]["prefix_lookup_tokens"] - b["kv_blocks"]["prefix_lookup_tokens"]
        hit = a["kv_blocks"]["prefix_hit_tokens"] - b["kv_blocks"]["prefix_hit_tokens"]
        rows.append({"requests": a["served"] - b["served"], "prompt_tokens": looked, "hit_tokens": hit,
                     "hit_rate": hit / looked if looked else 0.0})
    return rows


def _figures(url: str, replicas, trace) -> dict:
    before = _pools(replicas)
    outcomes, wall = replay(url, trace)
    rows = _per_replica(before, _pools(replicas))
    looked = sum(r["prompt_tokens"] for r in rows)
    out = summarize(outcomes, wall, TTFT_TARGET_S, GAP_TARGET_S)
    out["lost"] = sum(o.error is None and o.finish is None for o in outcomes)  # neither answered nor refused
    out.update(replicas=rows, hit_rate=sum(r["hit_tokens"] for r in rows) / looked if looked else 0.0,
               texts=[o.text for o in outcomes])
    return out


def policy_run(replicas, policy: str, trace) -> dict:
    """The trace through sglang-router with `policy`, in front of `replicas` (started, serving)."""
    from ..serve.replicas import Router
    router = Router([r.url for r in replicas], policy).start()
    try:
        return _figures(router.url, replicas, trace)
    finally:
        router.stop()


def alone_run(replica, trace) -> dict:
    """The trace sent straight to one replica: one core's worth of serving, no router."""
    return _figures(replica.url, [replica], trace)


def death_run(replicas, trace, kill_after_s: float, policy: str = "round_robin") -> dict:
    """Replay `trace` through the router and kill the last replica `kill_after_s` seconds in. Every request must end
    answered or with an error; `lost` counts those that did neither (the test holds it at zero)."""
    from ..serve.replicas import Router
    router = Router([r.url for r in replicas], policy).start()
    victim = replicas[-1]
    timer = threading.Timer(kill_after_s, victim.kill)
    try:
        timer.start()
        outcomes, wall = replay(router.url, trace, timeout=120)
    finally:
        timer.cancel()
        router.stop()
    answered = [o for o in outcomes if o.error is None and o.finish is not None]
    failed = [o for o in outcomes if o.error is not None]
    return {"requests": len(outcomes), "answered": len(answered), "errors": [o.error for o in failed],
            "lost": len(outcomes) - len(answered) - len(failed), "killed_at_s": kill_after_s,
            "sent_after_kill": sum(o.sent > kill_after_s for o in outcomes),
            "answered_after_kill": sum(o.sent > kill_after_s for o in answered), "wall_s": wall}


def router_figures(quick: bool = False) -> dict:
    """The bench's fleet.router: two replicas (one core, one thread each) behind sglang-router, round robin against
    cache-aware, and one replica alone, on the same grouped trace (a fresh tag per run)."""
    from ..serve.replicas import POLICIES, RouterMissing, router_command, start_replicas
    try:
        router_command()
    except RouterMissing as err:
        return {"skipped": str(err)}
    shape = dict(groups=2, per_group=2, prefix_chars=400, rate=4.0) if quick else \
        dict(groups=4, per_group=6, prefix_chars=3000, rate=1.0)
    replicas = start_replicas(2, kv_blocks=600, max_tokens_cap=32, max_concurrent=64)  # a queue, not 429s
    try:
        runs = {policy: policy_run(replicas, policy, grouped_trace(policy, **shape)) for policy in POLICIES}
        runs["one_replica"] = alone_run(replicas[0], grouped_trace("alone", **shape))
    finally:
        for r in replicas:
            r.stop()
    for run in runs.values():
        run.pop("texts")
    return {"replicas": 2, "threads_per_replica": 1, "trace": shape, "ttft_target_s": TTFT_TARGET_S,
            "gap_target_s": GAP_TARGET_S, "policies": runs}
