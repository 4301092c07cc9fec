"""The decode side as a batch (lesson 18): lesson 13's paged scheduler, fed prompts read in another process.

What it does: `ShippedScheduler` is a PagedScheduler whose requests arrive as shipped blocks (serve/disagg.py's
frames) instead of prompts: `adopt` writes a frame's keys and values into this pool and queues the request; each
step, adopted requests join the running batch while rows are free. The last prompt position is computed again
here (one token), so this side has the logits it picks the first token from, as the scheduler always does; the
prefill side's own first token is kept in the header for comparison. Everything else, decoding in one batched call
through the block tables and leaving, is the paged scheduler's.
What it does not do: read prompts (the prefill process does), receive frames (the caller reads them from the
socket between steps) or evict: a frame that does not fit the pool is refused with OutOfBlocks.
"""
from __future__ import annotations

from ..engine.paged_scheduler import PagedScheduler
from ..engine.request import Job
from .disagg import TransferError, unpack


class ShippedScheduler(PagedScheduler):
    """A PagedScheduler whose requests come in as shipped blocks: `expect(job)` announces one, `adopt(header,
    payload)` takes its frame. No prompt is read here beyond its last token."""

    def __init__(self, model, pool, **options):
        super().__init__(model, pool, **options)
        self.expected: dict[str, Job] = {}
        self.arrived: list[Job] = []  # adopted, waiting for a free row

    def expect(self, job: Job) -> None:
        """Announce a request whose blocks will come from the prefill side."""
        if job.name in self.expected or job.name in self.seqs:
            raise ValueError(f"a job named {job.name!r} is already expected or running here: names must be unique")
        self.expected[job.name] = job

    def adopt(self, header: dict, payload: bytes) -> Job:
        """Write a frame's blocks into this pool and queue its request; refuses one nobody announced, one whose tokens
        differ from the announced prompt, and (from unpack) a truncated or mismatched one."""
        job = self.expected.get(header.get("request"))
        if job is None:
            raise TransferError(f"blocks arrived for request {header.get('request')!r}, which this decode side does "
                                f"not expect (expecting {sorted(self.expected) or 'none'})")
        if list(header["tokens"]) != list(job.prompt) or header["computed"] != len(job.prompt):
            raise TransferError(f"the blocks for {job.name!r} hold {header['computed']} computed tokens that are not "
                                f"its {len(job.prompt)}-token prompt")
        seq = unpack(self.pool, header, payload)
        del self.expected[job.name]
        seq.computed -= 1  # the last position is computed again here: its logits give the first token
        job.default_stopper(self.window)
        self.seqs[job.name] = seq
        self.arrived.append(job)
        self.events.append((self.now(), job.name, "arrived"))
        return job

    @property
    def jobs(self) -> list[Job]:
        return super().jobs + self.arrived

    def run(self) -> list:
        stamp = self.now()
        while self.arrived and len(self.running) < self.max_batch:
            job = self.arrived.pop(0)
            job.start = stamp
            self.running.append(job)
        return super().run()

    def _leave(self, job: Job, reason: str, stamp: float) -> None:
        if job in self.arrived:  # cancelled before it got a row: its blocks go back
            self.arrived.remove(job)
            self.pool.free(self.seqs[job.name])
        super()._leave(job, reason, stamp)
