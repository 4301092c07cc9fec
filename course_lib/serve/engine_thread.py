"""The server's engine: one background thread that owns the model and runs the loop for every request.

What it does: `EngineThread` takes jobs from a queue (`submit`, with a listener per job), adds them to its batch
scheduler (a PaddedScheduler on the model as given, or, through `paged_engine`, lesson 13's PagedScheduler on the
course's own model and a fresh BlockPool), runs generation.step again and again, hands each listener its tokens
as they are picked and None at the end. A step that raises fails the requests in that batch (finish reason
"error", never a stop) and the thread goes on with a fresh scheduler.
What it does not do: speak HTTP or read OpenAI's dialect (serving.py and openai_api.py do).
"""
from __future__ import annotations

import collections
import queue
import threading

from ..runner.blocks import blocks_for
from ..engine.generation import step
from ..runner.model import Model
from ..runner.paged import BlockPool
from ..engine.paged_scheduler import PagedScheduler, check_budget
from ..engine.request import Job
from ..engine.schedulers import PaddedScheduler


class EngineThread:
    """A background thread that owns the model and serves jobs by continuous batching.
    start() launches the thread (the app's lifespan does it when the server starts); stop() ends it."""

    def __init__(self, model, max_batch: int = 8, make_batch=None):
        self.model, self.max_batch = model, max_batch
        self.make_batch = make_batch or (lambda: PaddedScheduler(model))  # a fresh scheduler (after an error too)
        self.pending: queue.Queue = queue.Queue()
        self.listeners: dict[str, callable] = {}
        self.batch = self.make_batch()
        self.served, self.error = 0, None
        self.finished: collections.deque = collections.deque(maxlen=64)  # (job name, stop reason), newest last
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="course-engine", daemon=True)

    def start(self) -> "EngineThread":
        if not self.thread.is_alive() and not self._stop.is_set():
            self.thread.start()
        return self

    def run_here(self) -> None:
        """Go on serving in the calling thread until stop(): the background thread ends after its current step (jobs
        sent meanwhile wait in the queue), then this thread runs the same loop. For a process whose main thread has
        nothing else to do, as llama-server runs its slots in its main thread.
        Why: on the course's 2-core machine the fused step ran about twice as slowly from a thread other than the
        process's main one at two OpenMP threads (one row: 3.4-4.8 ms a step in the main thread, 8.7-11.6 in another
        thread, 2026-12-07; lesson 13 times it); at one thread 5.0 against 6.1."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()
        self._stop.clear()
        self._run()

    def submit(self, job: Job, on_token) -> None:
        """Queue a job; on_token(token_id) is called from the engine thread, then on_token(None) at the end."""
        self.submit_all([(job, on_token)])

    def submit_all(self, pairs: list[tuple[Job, object]]) -> None:
        """Queue jobs that must reach the scheduler together (the n answers to one prompt: a paged scheduler forks
        the first one's blocks for the others), each with its listener."""
        for job, on_token in pairs:
            self.listeners[job.name] = on_token
        self.pending.put([job for job, _ in pairs])

    def active(self) -> list[str]:
        return [j.name for j in self.batch.jobs]

    def health(self) -> dict:
        """What the server's GET /health reports: requests running and served; the paged pool, answers that shared
        a prompt read, the slots and the compiled runner's steps where there are."""
        body = {"status": "ok", "active": self.active(), "served": self.served}
        pool = getattr(self.batch, "pool", None)
        if pool is not None:  # the paged cache: how full the pool is
            body["kv_blocks"] = {"used": pool.manager.num_used, "total": pool.manager.num_blocks,
                                 "prefix_hit_rate": round(pool.hit_rate, 4), "prefix_hit_tokens": pool.hits,
                                 "prefix_lookup_tokens": pool.lookups}
        if hasattr(self.batch, "reused_tokens"):  # slots: rows busy, prompt tokens a row's last request had written
            body["slots"] = {"busy": sum(r is not None for r in self.batch.rows), "total": len(self.batch.rows),
                             "reused_tokens": self.batch.reused_tokens, "steps": self.batch.steps}
        if hasattr(self.model, "static_calls"):  # the compiled runner: steps that ran compiled, and the rest
            body["compiled"] = {"static_steps": self.model.static_calls, "eager_calls": self.model.eager_calls,
                                "why_eager": self.model.why_eager}
        if getattr(self.batch, "forked", None) is not None:  # answers that shared a prompt read (n > 1)
            body["forked"] = self.batch.forked
        return body

    def _run(self) -> None:
        while not self._stop.is_set():
            newcomers = []
            while len(self.batch.jobs) + len(newcomers) < self.max_batch:
                try:
                    newcomers += self.pending.get(timeout=0.05 if not (self.batch.jobs or newcomers) else 0)
                except queue.Empty:
                    break
            for job in [j for j in newcomers if j.cancelled]:  # left before it was even admitted
                newcomers.remove(job)
                self._finish(job, "cancelled")
            try:
                if newcomers:
                    self.batch.add(newcomers)  # note: a scheduler may refuse a job here (finish reason "rejected")
                before = list(self.batch.jobs)
                for job, token, _, _ in (step(self.batch) if before else []):
                    self.listeners[job.name](token)
                for job in newcomers + before:
                    if job not in self.batch.jobs:
                        self._finish(job, job.finish_reason)
            except Exception as err:  # noqa: BLE001 - one bad step must not kill the server
                self.error = err
                for job in self.batch.jobs + newcomers:
                    job.finish_reason = "error"  # note: overrides any stop: the client must not read it as done
                    self._finish(job, "error")
                self.batch = self.make_batch()

    def _finish(self, job: Job, reason: str) -> None:
        listener = self.listeners.pop(job.name, None)
        if listener is None:  # already finished (or never submitted here)
            return
        job.finish_reason = job.finish_reason or reason
        self.finished.append((job.name, job.finish_reason))
        self.served += 1
        listener(None)

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)


KV_CACHES = ("contiguous", "paged", "slots")


def paged_engine(model, max_batch: int, kv_blocks: int | None = None, token_budget: int | None = None,
                 prefix_caching: bool = True):
    """(the course's model, a factory of PagedScheduler schedulers on a fresh pool) for EngineThread: lesson 13's paged
    cache with preemption. A transformers model is rewritten as model.Model on its weights.
    kv_blocks: the pool's size (default: one whole context window's worth); token_budget: tokens per step
    (chunked prefill; None = each prompt whole); prefix_caching: reuse the blocks of shared prompt prefixes."""
    check_budget(token_budget, max_batch)  # note: now, not in the engine thread
    ours = model if isinstance(model, Model) else Model.from_transformers(model)
    blocks = kv_blocks if kv_blocks is not None else blocks_for(ours.config.max_position_embeddings + 1)
    return ours, lambda: PagedScheduler(ours, BlockPool.for_model(ours, blocks, prefix_caching=prefix_caching),
                                    "preempt", max_batch, token_budget=token_budget)


def slot_engine(model, max_batch: int, token_budget: int | None = None, capacity: int = 2048):
    """(the course's model, a factory of SlotScheduler schedulers) for EngineThread: max_batch rows of `capacity`
    columns, each step one fused call over the decode tokens and prompt chunks within token_budget (None: each
    prompt whole). `model` is what fast_model(..., kv_cache="slots") returned."""
    from ..engine.slot_scheduler import SlotScheduler
    from ..runner.compiled import CompiledRunner
    ours = model.model if isinstance(model, CompiledRunner) else model
    SlotScheduler(ours, max_batch, capacity, token_budget)  # note: now, so a bad option fails here, not in the thread
    return ours, lambda: SlotScheduler(ours, max_batch, capacity, token_budget)


def fast_model(model, fmt: str | None = None, compiled: bool = False, kv_cache: str = "contiguous",
               rows_int8: int | None = None):
    """The model a server runs when asked for a weight format and the compiled step (issue: the fast path is the
    engine): the course's own model (a transformers model is rewritten), converted to `fmt` (one of
    runner.formats.FORMATS, from float32), then wrapped in runner.compiled's CompiledRunner when compiled=True and
    compiled before it serves (CompiledRunner.warm: no request waits for the compiler).
    The compiled step runs on the contiguous cache only: the paged cache's decode reads its block tables eagerly
    (lesson 16), so compiled=True with kv_cache="paged" is refused with that reason, not ignored. kv_cache="slots"
    runs the fused step only (engine.slot_scheduler): it needs compiled=True and a format the fused step takes.
    rows_int8: with fmt="int4", calls of that many rows or more (prefill, big batches) use the 4-bit layers' int8
    copy (runner.formats.Int4Linear)."""
    if rows_int8 is not None and fmt is None:
        raise ValueError("rows_int8 is an option of the 4-bit format: pass fmt='int4' with it")
    if fmt is None and not compiled:
        return model
    if kv_cache == "slots" and not compiled:
        raise ValueError("kv_cache='slots' runs every step as one fused C++ call: pass compiled=True (and "
                         "fmt='int4-q8', or 'int4' on a CPU with AVX-512 BF16)")
    if compiled and kv_cache == "paged":
        raise ValueError("compiled=True runs the static decode step on the contiguous cache; the paged cache's "
                         "decode reads its block tables eagerly: pass kv_cache='contiguous' (or compiled=False)")
    ours = model if isinstance(model, Model) else Model.from_transformers(model)
    if fmt is not None:
        from ..runner.formats import convert
        ours = convert(ours, fmt, rows_int8=rows_int8)
    if compiled:
        from ..runner.compiled import compiled_runner
        runner = compiled_runner(ours)
        if kv_cache == "slots" and runner.step_kind != "fused":
            from ..runner.fused_step import why_not_fused
            raise ValueError(f"kv_cache='slots' runs the fused step, which this model cannot: "
                             f"{why_not_fused(ours) or runner.why_eager}")
        if runner.step_kind == "compiled" and not runner.compiled_code:  # the fused step has nothing to compile
            print("compiling the decode step before serving (a single row, then a batch; up to a few minutes the "
                  "first time on a CPU)...", flush=True)
            print(f"compiled in {runner.warm():.0f} s", flush=True)
        return runner
    return ours

