"""Timers: one median, one best-of, one stopwatch that waits for the device (STYLE rule 8: honest timing).

What it does: `median` (runtime's one median, the middle value: robust to one slow step on a busy machine),
`best_of` (the fastest of several timed calls after a warm-up, with the device synchronized around each: one step at
a fixed context), `greedy_gaps` (the bare greedy loop, each gap timed with its argmax: a run of steps),
`Stopwatch` (seconds since it started, synchronized first).
What it does not do: decide what to time (measure.speed, the bench sections do).
"""
from __future__ import annotations

import time
from typing import Callable

from ..runtime import median, synchronize  # noqa: F401 (median: the one median, used across measure/)

# The token fed to decode steps that are only timed: any token will do, since a step reads one embedding row
# whichever it is and its cost does not depend on the value; a fixed one keeps the runs alike.
TIMING_TOKEN = 42


def best_of(fn: Callable[[], object], repeats: int = 3, device="cpu", warmup: int = 1) -> tuple[float, object]:
    """(the fastest of `repeats` timed calls of fn, in seconds, and the last call's result); `warmup` untimed
    calls first; the device is synchronized before and after each timed call."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    out = None
    for _ in range(warmup):
        out = fn()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def greedy_gaps(step: Callable[[int], "object"], logits, n: int, device="cpu") -> tuple[list[int], list[float]]:
    """The bare greedy loop, timed: n times, pick the argmax of the last logits and feed it (`step(token)` returns the
    next logits, any shape whose last row is the next position's). Returns (the tokens, the seconds of each gap:
    argmax plus step, the device synchronized around it). The course's decode rates against llama.cpp's are read
    from these gaps, the argmax inside the timed part on both sides."""
    tokens, gaps = [], []
    for _ in range(n):
        synchronize(device)
        start = time.perf_counter()
        token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        logits = step(token)
        synchronize(device)
        gaps.append(time.perf_counter() - start)
        tokens.append(token)
    return tokens, gaps


class Stopwatch:
    """Seconds since start, after waiting for queued device work. Example: w = Stopwatch(dev); ...; w.seconds()"""

    def __init__(self, device="cpu"):
        self.device = device
        synchronize(device)
        self.start = time.perf_counter()

    def seconds(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.start
