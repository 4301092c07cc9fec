"""A workshop room on one server: simulated learners at a learner's pace (the bench's section `workshop`).

What it does: `learner_script` is what one learner sends while working through lessons 06, 10 and 13: a short chat,
a short story streamed, a question about the handbook (lesson 13's shared system prompt), each after a pause to
read the last answer (think time, seeded per learner). `room_load` runs that many learners at once against one
server, each in its own thread and closed loop (the next request leaves only once the last answer is read and the
pause is over), every answer streamed and greedy, and reports per learner count what serving engines report: time
to first token p50 and p99, time between tokens p99 (every gap of every answer pooled), answers finished and
errors. `learners_within` is the largest learner count whose figures met the room's targets. `SECTION` starts the
room's server (serve/room.room_server, on loopback, the room's defaults) and runs it for several counts.
What it does not do: simulate the learners' own notebooks (each also runs the model in its kernel, on its own
cores in a real room), or send anywhere but loopback.
"""
from __future__ import annotations

import random
import threading
import time

from ..text.context import HANDBOOK_QUESTIONS, handbook_messages
from .load import CHATS, Outcome, TraceRequest, _loopback, _send, percentile
from .section import Section

# What a learner waits for before the stream stops feeling live: the first words within 2 s, then no pause longer
# than a quarter of a second (at least four tokens a second, about reading pace).
ROOM_TARGETS = {"ttft_p99_s": 2.0, "itl_p99_s": 0.25}
STORY = "Write a short story about a robot who learns to paint."


def learner_script(learner: int, requests: int = 4, max_tokens: int = 32, seed: int = 0) -> list[TraceRequest]:
    """One learner's requests in order (lesson 06's chat and story, lesson 13's handbook question), `at` = 0: they
    leave when the learner is ready. Same learner and seed, same script. Example: learner_script(3, requests=4)"""
    if requests < 1 or max_tokens < 1:
        raise ValueError(f"a learner sends at least one request of at least one token, got {requests}, {max_tokens}")
    rng = random.Random(seed * 1_000 + learner)
    make = [lambda: [{"role": "user", "content": rng.choice(CHATS)}],
            lambda: [{"role": "user", "content": STORY}],
            lambda: handbook_messages(rng.choice(HANDBOOK_QUESTIONS))]
    kinds = ("chat", "story", "shared_prefix")
    return [TraceRequest(f"learner{learner}-{i}", kinds[i % 3], 0.0, make[i % 3](),
                         2 * max_tokens if kinds[i % 3] == "story" else max_tokens) for i in range(requests)]


def _learner(client, url: str, script: list[TraceRequest], think: tuple[float, float], rng: random.Random,
             outcomes: list[Outcome], timeout: float) -> None:
    time.sleep(rng.uniform(0, think[1]))  # learners do not start in step
    for req in script:
        out = Outcome(req.name, req.kind, 0.0)
        _send(client, url, req, time.perf_counter(), out, timeout)
        outcomes.append(out)
        time.sleep(rng.uniform(*think))  # reading the answer, editing the next cell


def room_load(url: str, learners: int, requests: int = 4, max_tokens: int = 32, think: tuple[float, float] = (2.0, 6.0),
              seed: int = 0, timeout: float = 120) -> dict:
    """`learners` simulated learners at once against the server at url (loopback), each running learner_script closed
    loop with a pause drawn from `think` seconds between answers. Figures pooled over every answer."""
    import httpx
    _loopback(url)
    if not isinstance(learners, int) or learners < 1 or not 0 <= think[0] <= think[1]:
        raise ValueError(f"need a whole number of learners >= 1 and think = (shortest, longest) seconds, got "
                         f"{learners!r}, {think!r}")
    outcomes: list[Outcome] = []
    with httpx.Client(limits=httpx.Limits(max_connections=learners + 1)) as client:
        start = time.perf_counter()
        threads = [threading.Thread(target=_learner, daemon=True,
                                    args=(client, url, learner_script(i, requests, max_tokens, seed), think,
                                          random.Random(seed * 7_919 + i), outcomes, timeout))
                   for i in range(learners)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=requests * (timeout + think[1]) + think[1] + 5)
        wall = time.perf_counter() - start
    done = [o for o in outcomes if o.error is None and o.finish is not None]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    gaps = [g for o in done for g in o.gaps]
    return {"learners": learners, "requests": learners * requests, "finished": len(done),
            "errors": [o.error for o in outcomes if o.error], "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "tokens": sum(o.tokens for o in done), "wall_s": wall}


def within(row: dict, targets: dict = ROOM_TARGETS) -> bool:
    """Every request answered, and the p99s under the targets."""
    return (row["finished"] == row["requests"] and row["ttft_p99_s"] <= targets["ttft_p99_s"]
            and row["itl_p99_s"] <= targets["itl_p99_s"])


def learners_within(rows: list[dict], targets: dict = ROOM_TARGETS) -> int:
    """The largest learner count that met the targets, with every smaller count measured meeting them too (0: none)."""
    best = 0
    for row in sorted(rows, key=lambda r: r["learners"]):
        if not within(row, targets):
            break
        best = row["learners"]
    return best


def workshop_figures(model, tokenizer, quick: bool = False, counts: tuple[int, ...] | None = None) -> dict:
    """The room's server on loopback (its defaults, float32), warmed with one handbook question (a room's server has
    read the shared system prompt long before), then each learner count in turn."""
    import httpx
    import torch
    from ..serve.room import ROOM_DEFAULTS, room_server
    from ..serve.serving import free_port
    counts = counts or ((1, 3) if quick else (1, 4, 8, 16, 24))
    kwargs = ({"requests": 2, "max_tokens": 6, "think": (0.05, 0.2)} if quick else
              {"requests": 4, "max_tokens": 32, "think": (2.0, 6.0)})
    server = room_server(model, tokenizer, free_port(), max_concurrent=max(counts) + 1)
    try:
        httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=300,
                   json={"messages": handbook_messages(HANDBOOK_QUESTIONS[0]), "max_tokens": 2, "temperature": 0})
        rows = [room_load(server.url, n, **kwargs) for n in counts]
    finally:
        server.stop()
    return {"fmt": "float32", "server": {**ROOM_DEFAULTS, "max_concurrent": max(counts) + 1},
            "threads": torch.get_num_threads(), "think_s": list(kwargs["think"]), "requests_each": kwargs["requests"],
            "max_tokens": kwargs["max_tokens"], "targets": ROOM_TARGETS, "learners": rows,
            "learners_within_targets": learners_within(rows)}


def _targets(result: dict) -> list:
    w = result["workshop"]
    return [(f"workshop.learners {row['learners']}: every request answered", f"{row['finished']} of {row['requests']}",
             row["finished"] == row["requests"]) for row in w["learners"]]


def _report(result: dict) -> list:
    w = result["workshop"]
    lines = [f"workshop.learners {row['learners']:>3}: TTFT p50 {row['ttft_p50_s']:.2f} s, p99 {row['ttft_p99_s']:.2f} s, "
             f"time between tokens p99 {1000 * row['itl_p99_s']:.0f} ms, {row['finished']} of {row['requests']} answered"
             for row in w["learners"]]
    return lines + [f"workshop: this machine serves {w['learners_within_targets']} learners within TTFT p99 "
                    f"{w['targets']['ttft_p99_s']} s and time between tokens p99 {w['targets']['itl_p99_s']} s "
                    f"({w['threads']} threads, {w['fmt']}, a request every {w['think_s'][0]}-{w['think_s'][1]} s per learner)"]


SECTION = Section("workshop", "a room of learners on one shared server (workshop mode)",
                  lambda m, t, q: {"workshop": workshop_figures(m, t, quick=q)}, _targets, _report)
