"""Slots: continuous batching in which every request owns one row of a contiguous cache, and each step is ONE call
of the course's fused C++ over the running requests' tokens and a prompt's next chunk together (issue: the fast
path is the engine).

What it does: `SlotScheduler` keeps `slots` rows of one KVCache of `capacity` columns each (llama-server's slots:
a request keeps its row from admission to its end, so nothing is copied when others join or leave). Each step
(`run`) frees the rows of finished requests and admits waiting ones (oldest first) into free rows, each into the
free row whose last request began as its prompt does (among equals, the one holding the fewest tokens, so a long
shared document waits in its row for the next question on it): the columns they share are kept, not read again (what
llama-server does with a slot's last prompt; a lesser prefix cache than the paged one, which shares blocks between
requests at once). Then it builds one list of tokens: each running request's last picked token at its row's next
column, then prompt tokens of requests still being read, oldest first, within `token_budget` tokens in all (chunked
prefill: a long prompt is read a chunk per step while the others keep decoding; when none is decoding, IDLE_CHUNK
tokens a step). fused_step.FusedDecode.tokens_at
runs them in one call: a chunk's tokens, written at consecutive columns of one row, each attend to that row's
columns up to their own (causal attention), and the head runs only for the tokens a request picks after. It meets
schedulers.BatchScheduler, so generation.step and the server run it (start_server(..., kv_cache="slots")).
A request's tokens do not depend on the budget or on what shares its steps: every token's numbers are computed
alone (the products round each row's activations by themselves), so a chunk gives, bit for bit, what reading its
tokens one at a time gives. They differ from the eager model's by rounding (lesson 12's near-tie rule).
Why: a step of the paged scheduler is one eager call for the decode rows plus one per prompt chunk, and a left-padded
batch copies every row's cache when a request joins; here a step is one call whatever it holds, and a step's cost
is its tokens' products plus their attention (lesson 13's serving peers measure it against llama-server).
What it does not do: share blocks between running requests or fork one prompt's answers (n > 1 reads the prompt
once per answer: the paged scheduler does both), preempt (a request whose prompt plus allowance does not fit a row
is refused on arrival, finish reason "rejected"), draft, or run a model the fused step cannot take
(fused_step.why_not_fused says why).
"""
from __future__ import annotations

import collections

from ..runner.fused_step import FusedDecode, why_not_fused
from .paged_scheduler import REJECTED, check_budget
from .request import Job, check_request
from .schedulers import Clock, refuse_drafts

IDLE_CHUNK = 256  # prompt tokens a step reads when no request is decoding (none waits between tokens)


class SlotScheduler(Clock):
    """`slots` requests at once, each in its own row of a `capacity`-column cache; every step one fused call over
    their decode tokens and at most `token_budget` tokens in all (None: each prompt read whole in the step that
    admits it). Example: s = SlotScheduler(convert(ours, "int4-q8")); s.add(jobs); then generation.step(s) while
    s.jobs (the server's engine thread does this with start_server(..., kv_cache="slots"))."""

    def __init__(self, model, slots: int = 8, capacity: int = 2048, token_budget: int | None = 32,
                 clock: float | None = None):
        reason = why_not_fused(model)
        if reason:
            raise ValueError(f"slots run the fused step: {reason}")
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots must be a whole number >= 1, got {slots!r}")
        window = model.config.max_position_embeddings
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 2 <= capacity <= window:
            raise ValueError(f"capacity must be a whole number of columns in [2, {window}], got {capacity!r}")
        super().__init__(clock)
        self.model, self.capacity, self.window = model, capacity, window
        self.token_budget = check_budget(token_budget, slots)
        self.code = FusedDecode(model)
        self.cache = model.new_cache(slots, capacity)  # (slots, KV, capacity, D) per layer, every row a request's
        self.rows: list[Job | None] = [None] * slots  # the request each row holds
        self.columns = [0] * slots  # columns written in each row
        self.written: list[list[int]] = [[] for _ in range(slots)]  # the tokens in each row's columns, kept after
        # its request leaves: a newcomer whose prompt starts the same way takes that row and skips those columns
        self.row_of: dict[str, int] = {}  # job name -> its row
        self.order: list[Job] = []  # the running requests, oldest admission first
        self.waiting: list[Job] = []
        self.read: dict[str, int] = {}  # job name -> prompt tokens written so far
        self.fed: dict[str, int] = {}  # job name -> the token to write at the next step
        self.rejected = self.steps = self.prefill_chunks = self.reused_tokens = 0
        self.step_sizes = collections.deque(maxlen=10_000)  # per step: (decode tokens, all tokens), newest last

    step_kind = "fused"  # what its steps run (the serving peers' records say it)

    @property
    def jobs(self) -> list[Job]:
        return [j for j in self.order if not j.finish_reason] + self.waiting

    def fits(self, tokens: int) -> bool:
        """Could a request of this many tokens (prompt plus allowance) run in one row? (the server asks)"""
        return tokens <= self.capacity

    def add(self, newcomers: list[Job]) -> None:
        """Queue jobs (each checked first). One whose prompt plus allowance does not fit a row is refused now
        (finish reason REJECTED), before any token."""
        refuse_drafts(newcomers)
        names = [j.name for j in self.jobs] + [j.name for j in newcomers]
        for job in newcomers:
            job.prompt = check_request(self.model, job.prompt, job.new_tokens)
            if names.count(job.name) > 1:
                raise ValueError(f"a job named {job.name!r} is already in this batch: names must be unique")
        for job in newcomers:
            if not self.fits(len(job.prompt) + job.new_tokens):
                self.rejected += 1
                job.finish(REJECTED, self.now())
                continue
            job.default_stopper(self.window)
            self.waiting.append(job)

    def _leave(self, job: Job) -> None:
        row = self.row_of.pop(job.name, None)
        if row is not None:
            self.rows[row] = None
            self.order = [j for j in self.order if j.name != job.name]
        self.waiting = [j for j in self.waiting if j is not job]
        self.read.pop(job.name, None)
        self.fed.pop(job.name, None)

    def _admit(self, stamp: float) -> None:
        for job in [j for j in self.waiting if j.cancelled]:
            job.finish("cancelled", stamp)
            self._leave(job)
        while self.waiting and None in self.rows:
            job = self.waiting.pop(0)
            free = [r for r, held in enumerate(self.rows) if held is None]
            shared = {r: _common(self.written[r], job.prompt) for r in free}
            # the row whose last request began as this prompt does; among equals the one holding the fewest tokens,
            # so a long prefix (a shared document) stays for a request that can use it
            row = max(free, key=lambda r: (shared[r], -len(self.written[r])))
            keep = min(shared[row], len(job.prompt) - 1)  # its last prompt token is read again: its logits
            self.written[row] = self.written[row][:keep]
            self.rows[row], self.columns[row], self.read[job.name], self.row_of[job.name] = job, keep, keep, row
            self.reused_tokens += keep
            self.order.append(job)
            if job.start != job.start:  # first admission (start is NaN until then)
                job.start = stamp

    def run(self) -> list:
        """One step: the cancelled leave, waiting jobs take free rows, then one fused call over each running job's
        fed token and prompt chunks within the budget. Returns (job, (1, V) logits, None) for every job that has
        logits to pick from (its token decoded, or its prompt's last chunk read)."""
        stamp = self.now()
        for job in [j for j in self.order if j.cancelled or j.finish_reason]:
            if not job.finish_reason:
                job.finish("cancelled", stamp)
            self._leave(job)
        self._admit(stamp)
        tokens, rows, columns, wanted, owners = [], [], [], [], []

        def put(job: Job, ids: list[int], picks: bool) -> None:
            row = self.row_of[job.name]
            tokens.extend(ids)
            rows.extend([row] * len(ids))
            columns.extend(range(self.columns[row], self.columns[row] + len(ids)))
            self.columns[row] += len(ids)
            self.written[row].extend(ids)
            if picks:
                wanted.append(len(tokens) - 1)
                owners.append(job)

        for job in self.order:
            if job.name in self.fed:
                put(job, [self.fed.pop(job.name)], True)
        # note: the budget keeps running requests' gaps short; with none decoding it protects nobody, so prompts
        # are read IDLE_CHUNK tokens a step (a new arrival still waits at most one such step for its first chunk)
        budget = (float("inf") if self.token_budget is None else
                  self.token_budget - len(tokens) if tokens else max(self.token_budget, IDLE_CHUNK))
        decoding = len(tokens)
        for job in self.order:
            done, prompt = self.read[job.name], job.prompt
            if done == len(prompt) or budget <= 0:
                continue
            n = int(min(len(prompt) - done, budget))
            self.read[job.name], budget = done + n, budget - n
            self.prefill_chunks += 1
            put(job, prompt[done:done + n], done + n == len(prompt))
        if not tokens:
            return []
        logits = self.code.tokens_at(tokens, self.cache, rows, columns, wanted)  # (len(wanted), V)
        self.steps += 1
        self.step_sizes.append((decoding, len(tokens)))
        return [(job, logits[i:i + 1], None) for i, job in enumerate(owners)]

    def feed(self, job: Job, tokens: list[int], accepted: int) -> None:
        self.fed[job.name] = tokens[-1]  # written at its row's next column at the next step

    def finish(self, job: Job, reason: str, stamp: float) -> None:
        job.finish(reason, stamp)
        self._leave(job)


def _common(a: list[int], b: list[int]) -> int:
    """How many tokens two lists share from the start. Example: ([1, 2, 3], [1, 2, 4]) -> 2"""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
