"""The paged scheduler (lesson 13): continuous batching over a paged KV cache.

What it does: `PagedScheduler` admits queued jobs by free blocks with headroom (a watermark), refuses on arrival
what could never fit, prefills each prompt alone past its cached prefix, whole or in chunks within a per-step
token budget (chunked prefill: running requests keep decoding while a long prompt is read), decodes the running
rows in one batched call through their block tables, and preempts (recompute later), reserves or rejects when
the pool runs dry. Several answers to one prompt (n > 1: jobs whose `fork_of` names another job of the same add)
share it: the prompt is prefilled once, then each sibling takes the leader's blocks by reference (BlockPool.fork,
copy-on-write) and picks from the same logits with its own picker. It meets schedulers.BatchScheduler, so
generation.step, the drivers and the server run it.
What it does not do: manage the blocks themselves (the pool and its BlockManager do: paged.py, blocks.py), call
the model other than through the stages, or pack prompt chunks and decode rows into one model call (production
engines do).
"""
from __future__ import annotations

import collections

from ..runner.blocks import OutOfBlocks, Sequence, blocks_for
from .request import Job, check_request
from .schedulers import Clock, refuse_drafts
from .stages import decode_step, prefill

REJECTED = "rejected"  # a scheduler's verdict, not a stop: the request never ran (the memory could not hold it)
PAGED_POLICIES = ("preempt", "reserve", "reject")


def check_budget(token_budget, max_batch: int) -> int | None:
    """None (each prompt prefilled whole) or a whole number of tokens per step above max_batch (the running
    rows take one token each; the rest goes to prompts). Example: (256, 8) -> 256; (8, 8) is refused"""
    if token_budget is None:
        return None
    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget <= max_batch:
        raise ValueError(f"token_budget must be a whole number of tokens above max_batch ({max_batch}): each running "
                         f"request decodes one token per step and prompts get the rest; got {token_budget!r}")
    return token_budget


class PagedScheduler(Clock):
    """Continuous batching over a paged KV cache (lesson 13). Jobs wait in a queue and are admitted when the blocks
    for their prompt fit with `watermark` blocks to spare (headroom, so a newcomer is not admitted and then
    preempted at once); a job that could never fit the pool, prompt plus allowance, is refused when it arrives.
    Each step has a token budget: every running job decodes one token, and what is left of `token_budget` goes to
    prompts, in chunks, oldest first (chunked prefill: a long prompt no longer stalls the others; None = each
    prompt is prefilled whole in the step that admits it). The decode rows run as one batched call through their
    block tables and each prompt chunk as one call of its own (production engines pack both into one call).
    When a running job needs a block and none is free: "preempt" (vLLM's way) frees the most recently admitted
    job's blocks and puts it back at the front of the queue, to be recomputed later (prompt and tokens so far,
    minus what the prefix cache still holds). "reserve" (reserve-and-wait, what a server without preemption does)
    admits a job only once blocks for its prompt plus all its new tokens can be reserved, and keeps it waiting
    until then, so no running job ever runs short; "reject" turns such a job away instead. Same interface as
    PaddedScheduler (schedulers.BatchScheduler), so the server runs it."""

    def __init__(self, model, pool, policy: str = "preempt", max_batch: int = 8, clock: float | None = None,
                 token_budget: int | None = None, watermark: int | None = None):
        if policy not in PAGED_POLICIES:
            raise ValueError(f"policy must be one of {PAGED_POLICIES}, got {policy!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
        self.model, self.pool, self.policy, self.max_batch = model, pool, policy, max_batch
        self.token_budget = check_budget(token_budget, max_batch)
        blocks = pool.manager.num_blocks
        self.watermark = max(1, blocks // 100) if watermark is None else watermark  # vLLM keeps 1% free
        if not isinstance(self.watermark, int) or not 0 <= self.watermark < blocks:
            raise ValueError(f"watermark must be a whole number of blocks in [0, {blocks}), got {watermark!r}")
        self.waiting: list[Job] = []  # first in, first out; a preempted job goes back to the front
        self.running: list[Job] = []  # in order of admission
        self.seqs, self.logits, self.reserved = {}, {}, {}  # by job name: Sequence, (V,) logits, blocks reserved
        self.held: dict[str, list[Job]] = {}  # a leader's name -> the siblings waiting to fork its prompt's blocks
        self.forked = 0  # siblings that took a leader's blocks instead of a prefill of their own
        super().__init__(clock)
        self.window = model.config.max_position_embeddings
        self.preempted = self.recomputed_tokens = self.rejected = 0
        self.prefill_chunks = 0  # model calls that ran part (or all) of a prompt
        # note: bounded, so a server running for days does not grow them without end
        self.events = collections.deque(maxlen=100_000)  # (seconds, job name, what happened)
        self.memory = collections.deque(maxlen=100_000)  # per step: (seconds, blocks used, tokens a contiguous cache reserves)

    @property
    def jobs(self) -> list[Job]:
        return self.running + self.waiting + [j for forks in self.held.values() for j in forks]

    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.pool.manager.num_blocks * self.pool.block_size

    def fits(self, tokens: int) -> bool:
        """Could a request of this many tokens (prompt plus allowance) ever run in this pool, alone?"""
        return blocks_for(tokens, self.pool.block_size) <= self.pool.manager.num_blocks

    def add(self, newcomers: list[Job]) -> None:
        """Queue jobs (checked first: a bad prompt is refused here, not deep inside a later step). A job whose prompt
        plus allowance could never fit the pool is refused now (finish reason REJECTED), before any token."""
        refuse_drafts(newcomers)
        names = [j.name for j in newcomers]
        for job in newcomers:
            job.prompt = check_request(self.model, job.prompt, job.new_tokens)
            if job.name in self.seqs or names.count(job.name) > 1:
                raise ValueError(f"a job named {job.name!r} is already in this batch: names must be unique")
        leaders = {j.name: j for j in newcomers if not j.fork_of}
        for job in newcomers:
            leader = leaders.get(job.fork_of)
            if leader is not None and (leader.prompt != job.prompt or leader.cache_salt != job.cache_salt):
                raise ValueError(f"job {job.name!r} forks {leader.name!r} but their prompts (or cache salts) differ")
            group = 1 + sum(1 for j in newcomers if j.fork_of == job.name) if job.name in leaders else 1
            if group > self.max_batch:
                raise ValueError(f"job {job.name!r} asks for {group} answers but this scheduler runs at most "
                                 f"{self.max_batch} rows at once")
        for job in newcomers:
            if not self.fits(len(job.prompt) + job.new_tokens):
                self.rejected += 1
                job.finish(REJECTED, self.now())
                self.events.append((job.end, job.name, REJECTED))
                continue
            job.default_stopper(self.window)
            if job.fork_of in leaders:  # waits to share its leader's prompt
                self.held.setdefault(job.fork_of, []).append(job)
                self.events.append((self.now(), job.name, "held"))
                continue
            self._queue(job)
        for name in [n for n in self.held if leaders.get(n) is not None and leaders[n].finish_reason]:
            for orphan in self.held.pop(name):  # its leader was refused above: each goes alone
                self._queue(orphan)

    def _queue(self, job: Job) -> None:
        self.seqs[job.name] = Sequence(list(job.prompt), salt=job.cache_salt)
        self.waiting.append(job)
        self.events.append((self.now(), job.name, "queued"))

    def _leave(self, job: Job, reason: str, stamp: float) -> None:
        job.finish(reason, stamp)
        self.events.append((stamp, job.name, reason))
        if job in self.running:
            self.running.remove(job)
            self.pool.free(self.seqs[job.name])
        elif job in self.waiting:
            self.waiting.remove(job)
        else:
            for forks in self.held.values():
                if job in forks:
                    forks.remove(job)
        self.seqs.pop(job.name, None)
        self.logits.pop(job.name, None)
        self.reserved.pop(job.name, None)
        for orphan in self.held.pop(job.name, []):  # the leader left before its prompt was read: each goes alone
            self._queue(orphan)

    def _fork(self, stamp: float) -> None:
        """Every leader whose prompt is now read hands its blocks to its held siblings (by reference: a shared block
        is copied only when one of them writes into it) and its logits, so each picks its first token this step."""
        for name in [n for n in self.held if n in self.logits]:
            for job in self.held.pop(name):
                self.seqs[job.name] = self.pool.fork(self.seqs[name])
                self.logits[job.name] = self.logits[name]
                job.start = stamp
                self.running.append(job)
                self.forked += 1
                self.events.append((stamp, job.name, "forked"))

    def _admit(self) -> None:
        """Admit waiting jobs in order while their prompt's blocks fit with the watermark to spare (a job is admitted
        into an empty batch whenever it fits at all, so nothing waits forever). No model call: prompts are run by
        `_prefill`, within the step's budget."""
        manager = self.pool.manager
        while self.waiting and len(self.running) + 1 + len(self.held.get(self.waiting[0].name, ())) <= self.max_batch:
            job, stamp = self.waiting[0], self.now()  # note: a leader comes in with room for its held siblings
            seq = self.seqs[job.name]
            if job.cancelled:
                self._leave(job, "cancelled", stamp)
                continue
            need = blocks_for(len(job.prompt) + job.new_tokens, self.pool.block_size)
            if self.policy != "preempt" and sum(self.reserved.values()) + need > manager.num_blocks:
                if self.policy == "reserve":
                    break  # wait until a running job finishes and gives its reservation back
                self.rejected += 1
                self._leave(job, REJECTED, stamp)
                continue
            cost = self.pool.admit_cost(seq, extra=1)
            if cost > manager.num_blocks:  # it could never fit, even alone (a recomputed job that grew too long)
                self.rejected += 1
                self._leave(job, REJECTED, stamp)
                continue
            spare = self.watermark if self.running else 0
            if cost > manager.num_free - spare:
                break  # wait until running jobs give blocks back
            self.waiting.pop(0)
            if self.policy != "preempt":
                self.reserved[job.name] = need  # note: only once admitted, so a waiting job never counts itself
            before = seq.was_computed
            hit = self.pool.admit(seq)
            self.pool.grow(seq, len(seq.tokens))  # the whole prompt's blocks now: a prefill never stalls half-way
            self.recomputed_tokens += max(0, before - hit)
            if job.start != job.start:  # first admission (start is NaN until then)
                job.start = stamp
            self.events.append((stamp, job.name, "admitted"))
            self.running.append(job)

    def _prefill(self, budget: float) -> None:
        """Run prompt tokens of admitted jobs, oldest first, at most `budget` in all (a chunk per job per step);
        a job whose prompt is complete gets its logits, to pick its first token this very step."""
        for job in self.running:
            seq = self.seqs[job.name]
            left = len(seq.tokens) - seq.computed
            if left <= 0 or job.name in self.logits:
                continue
            if budget <= 0:
                break
            n = int(min(left, budget))
            logits, _ = prefill(self.model, seq.tokens[seq.computed:seq.computed + n], cache=self.pool.view([seq]))
            self.prefill_chunks += 1
            budget -= n
            if seq.computed == len(seq.tokens):
                self.logits[job.name] = logits[0]

    def _preempt(self, job: Job, stamp: float) -> None:
        seq = self.seqs[job.name]
        seq.was_computed = seq.computed  # what recomputing it will redo, less what the prefix cache keeps
        seq.preempted += 1
        self.pool.free(seq)
        self.running.remove(job)
        self.logits.pop(job.name, None)
        self.waiting.insert(0, job)
        self.preempted += 1
        self.events.append((stamp, job.name, "preempted"))

    def _decode(self, stamp: float) -> int:
        """One batched decode step for every running job with a token to feed (making room first, preempting the
        most recently admitted job while the pool is dry). Returns how many rows it ran."""
        ready = lambda: [j for j in self.running if self.seqs[j.name].computed == len(self.seqs[j.name].tokens) - 1]  # noqa: E731
        for job in ready():  # each needs a slot for the token it feeds
            seq = self.seqs[job.name]
            while job in self.running:
                try:
                    self.pool.grow(seq, seq.computed + 1)
                    break
                except OutOfBlocks:
                    self._preempt(self.running[-1], stamp)  # the most recently admitted (maybe this very job)
        rows = ready()
        if rows:
            seqs = [self.seqs[j.name] for j in rows]
            view = self.pool.view(seqs)
            tokens = [s.tokens[-1] for s in seqs]
            logits, _ = decode_step(self.model, tokens, view, attention_mask=view.attention_mask(1),
                                    positions=view.positions())
            self.logits.update({j.name: logits[i] for i, j in enumerate(rows)})
        return len(rows)

    def run(self) -> list:
        """One step's model calls: the cancelled leave; the tokens fed last step are decoded in one batched call;
        waiting jobs are admitted; prompts are read within what is left of the token budget. Returns
        (job, (1, V) logits, None) for every job that has logits to pick from."""
        stamp = self.now()
        for job in [j for j in self.jobs if j.cancelled]:
            self._leave(job, "cancelled", stamp)
        decoded = self._decode(stamp)
        self._admit()
        self._prefill(float("inf") if self.token_budget is None else self.token_budget - decoded)
        self._fork(stamp)
        held = sum(len(j.prompt) + j.new_tokens for j in self.running)
        self.memory.append((self.now(), self.pool.manager.num_used, held))
        return [(job, self.logits.pop(job.name)[None], None) for job in list(self.running) if job.name in self.logits]

    def feed(self, job: Job, tokens: list[int], accepted: int) -> None:
        self.seqs[job.name].tokens += tokens  # the last one is fed at the next step

    def finish(self, job: Job, reason: str, stamp: float) -> None:
        self._leave(job, reason, stamp)
