"""Timers: one median, one best-of, one stopwatch that waits for the device (STYLE rule 8: honest timing).

What it does: `median` (the middle value: robust to one slow step on a busy machine), `best_of` (the fastest
of several timed calls after a warm-up, with the device synchronized around each), `Stopwatch` (seconds since
it started, synchronized first).
What it does not do: decide what to time (measure.speed, the bench sections do).
"""
from __future__ import annotations

import time
from typing import Callable

from ..runtime import synchronize

# The token fed to decode steps that are only timed: any token will do, since a step reads one embedding row
# whichever it is and its cost does not depend on the value; a fixed one keeps the runs alike.
TIMING_TOKEN = 42


def median(values) -> float:
    """The middle value (the upper one of an even count). Example: [3, 1, 2] -> 2; [1, 2, 3, 4] -> 3"""
    values = sorted(values)
    if not values:
        raise ValueError("median of no values")
    return values[len(values) // 2]


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


class Stopwatch:
    """Seconds since start, after waiting for queued device work. Example: w = Stopwatch(dev); ...; w.seconds()"""

    def __init__(self, device="cpu"):
        self.device = device
        synchronize(device)
        self.start = time.perf_counter()

    def seconds(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.start
