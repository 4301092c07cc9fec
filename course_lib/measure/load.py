"""The server under load: a mixed trace of chat requests arriving at random, replayed over HTTP on loopback.

What it does: `mixed_trace` makes a reproducible trace (Poisson arrivals at a given rate; three kinds of
prompt: short chats, questions that share the handbook as a long system prompt, and long documents that no
other request shares); `replay` sends each request at its time as a streaming chat completion (greedy, so
every answer can be checked against the same request alone) from its own thread, and records when each
piece of text arrived; `summarize` reports what serving engines report: time to first token and time
between tokens (p50 and p99, every gap of every request pooled, as vLLM's serving benchmark does),
throughput in tokens per second, and goodput: requests per second that met the latency targets you state.
`decode_gaps` measures, inside one process, the longest wait of a running request while a long prompt
arrives (whole prefill against chunked). Bounded: every request has a timeout, the trace a fixed size,
and only loopback addresses are accepted.
What it does not do: start servers (serving.start_server does) or judge the numbers (the bench's targets do).
"""
from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from ..text.context import HANDBOOK_QUESTIONS, handbook_messages
from ..runtime import median

CHATS = ("What is the capital of France?", "Name three colours.", "Why is the sky blue?", "Write a haiku about rain.",
         "Give me two tips for sleeping well.", "What is 7 times 8?", "Say hello in Spanish.",
         "What do bees make?")
KINDS = ("chat", "shared_prefix", "long_document")


@dataclass(frozen=True)
class TraceRequest:
    name: str
    kind: str  # one of KINDS
    at: float  # seconds after the trace starts
    messages: list
    max_tokens: int


def mixed_trace(rate: float, n: int, seed: int = 0, max_tokens: int = 32,
                shares: tuple[float, float, float] = (0.6, 0.2, 0.2)) -> list[TraceRequest]:
    """n requests arriving as a Poisson process of `rate` requests per second (exponential gaps), each a chat
    (short), a shared-prefix question (the handbook, about 1,100 tokens, as every such request's system prompt)
    or a long document (the handbook under a header naming the request: no other request shares its first block,
    so nothing is found in the prefix cache). Same seed, same trace. Example: mixed_trace(0.5, 12)"""
    if not rate > 0 or not isinstance(n, int) or n < 1:
        raise ValueError(f"need a rate > 0 requests per second and a whole number of requests >= 1, got {rate!r}, {n!r}")
    rng, at, out = random.Random(seed), 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        kind = rng.choices(KINDS, weights=shares)[0]
        if kind == "chat":
            messages = [{"role": "user", "content": rng.choice(CHATS)}]
        elif kind == "shared_prefix":
            messages = handbook_messages(rng.choice(HANDBOOK_QUESTIONS))
        else:
            messages = handbook_messages(rng.choice(HANDBOOK_QUESTIONS))
            messages[0] = {"role": "system", "content": f"Request {i}: a document of its own.\n\n" + messages[0]["content"]}
        out.append(TraceRequest(f"q{i}", kind, at, messages, max_tokens))
    return out


@dataclass
class Outcome:
    """What one request saw, in seconds since it was sent."""
    name: str
    kind: str
    sent: float  # seconds after the trace started
    pieces: list[float] = field(default_factory=list)  # arrival of each piece of text
    text: str = ""
    tokens: int = 0  # completion tokens (the server's usage count)
    finish: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.pieces[0] if self.pieces else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.pieces, self.pieces[1:])]


def _loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the load generator only sends to loopback addresses, not {host!r}")


def _send(client, url: str, req: TraceRequest, start: float, out: Outcome, timeout: float) -> None:
    body = {"model": "smollm2-135m-instruct", "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    wait = start + req.at - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    sent = time.perf_counter()
    out.sent = sent - start
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {response.read().decode()[:200]}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                    return
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content")
                    if piece:
                        out.pieces.append(time.perf_counter() - sent)
                        out.text += piece
                    if choice.get("finish_reason"):
                        out.finish = choice["finish_reason"]
    except Exception as err:  # noqa: BLE001 - a failed request is a result, not a crash of the load test
        out.error = f"{type(err).__name__}: {err}"


def replay(url: str, trace: list[TraceRequest], timeout: float = 300) -> tuple[list[Outcome], float]:
    """Send every request of the trace at its time, each from its own thread, and wait for all (at most `timeout`
    seconds each). Returns (outcomes in trace order, wall seconds from the first send to the last answer)."""
    import httpx
    _loopback(url)
    outcomes = [Outcome(r.name, r.kind, 0.0) for r in trace]
    limits = httpx.Limits(max_connections=len(trace) + 1)
    with httpx.Client(limits=limits) as client:
        start = time.perf_counter()
        threads = [threading.Thread(target=_send, args=(client, url, r, start, o, timeout), daemon=True)
                   for r, o in zip(trace, outcomes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout + trace[-1].at + 5)
        wall = time.perf_counter() - start - trace[0].at
    return outcomes, wall


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank. Example: percentile([1, 2, 3, 4], 50) -> 2"""
    if not values:
        return float("nan")
    values = sorted(values)
    rank = max(1, -(-len(values) * q // 100))
    return values[int(rank) - 1]


def summarize(outcomes: list[Outcome], wall: float, ttft_target_s: float, gap_target_s: float) -> dict:
    """Serving figures for one run. A request is good (counts toward goodput) if it finished without error, its
    first token came within ttft_target_s and no gap between its pieces exceeded gap_target_s."""
    done = [o for o in outcomes if o.error is None and o.finish is not None]
    gaps = [g for o in done for g in o.gaps]
    good = [o for o in done if o.ttft is not None and o.ttft <= ttft_target_s and max(o.gaps, default=0) <= gap_target_s]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    return {"requests": len(outcomes), "finished": len(done), "errors": [o.error for o in outcomes if o.error],
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "max_gap_s": max(gaps, default=float("nan")),
            "tokens_per_s": sum(o.tokens for o in done) / wall if wall > 0 else float("nan"),
            "goodput_rps": len(good) / wall if wall > 0 else float("nan"), "wall_s": wall}


def decode_gaps(model, prompt: list[int], long_prompt: list[int], token_budget: int | None, pool_blocks: int = 200,
                warmup: int = 3) -> dict:
    """One running request, then a long prompt arrives: the longest gap between the running request's tokens
    (seconds), and tokens per second over the whole run, on a PagedScheduler with this token budget (None: whole
    prefill). The course's model (model.Model); greedy; runs until both are done."""
    from ..engine.generation import step
    from ..engine.request import Job
    from ..engine.paged_scheduler import PagedScheduler
    from ..runner.paged import BlockPool
    short, long = Job("running", list(prompt), 48), Job("arriving", list(long_prompt), 8)
    batch = PagedScheduler(model, BlockPool.for_model(model, pool_blocks, prefix_caching=False), token_budget=token_budget)
    batch.add([short])
    stamps, start, arrived = [], time.perf_counter(), False
    while batch.jobs:
        if len(short.tokens) >= warmup and not arrived:
            batch.add([long])
            arrived = True
        for job, _, _, _ in step(batch):
            if job is short:
                stamps.append(time.perf_counter())
    seconds = time.perf_counter() - start
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"max_gap_s": max(gaps), "p99_gap_s": percentile(gaps, 99), "median_gap_s": median(gaps),
            "tokens_per_s": (len(short.tokens) + len(long.tokens)) / seconds, "tokens": short.tokens + long.tokens}
