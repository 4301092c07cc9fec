"""What a server does when its KV memory runs out (lesson 07): a fixed token budget under three policies, simulated.

What it does: `simulate_budget` replays `Request`s (arrival, prompt, answer length, the allowance a server is told)
tick by tick against a budget of cache tokens, and says what each policy does when the budget is full: "reject"
admits a request only if its prompt and allowance can be reserved, "evict" drops the oldest conversations,
"preempt" pauses the most recently admitted request and recomputes it later. The `Outcome` counts who finished, when, and what was lost or recomputed.
What it does not do: run a model or hold tensors (it counts tokens; lesson 13's paged scheduler does it for real).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    """One conversation: arrives at `arrival`, brings `prompt` tokens, then grows by one token per tick until its
    `answer` is done. `max_tokens`: the most it may write, what a server is told (it cannot know `answer` in
    advance); None = the answer's length, a server that knew the future."""
    name: str
    arrival: int
    prompt: int
    answer: int
    max_tokens: int | None = None

    @property
    def allowance(self) -> int:
        return self.answer if self.max_tokens is None else self.max_tokens


@dataclass
class Outcome:
    status: dict[str, str] = field(default_factory=dict)  # name -> "finished", "rejected", "evicted"
    usage: list[int] = field(default_factory=list)  # tokens held in the cache at each tick
    active: list[list[str]] = field(default_factory=list)  # who held memory at each tick
    lost: int = 0  # tokens computed, then thrown away (evicted, or preempted and recomputed later)
    preempted: dict[str, int] = field(default_factory=dict)  # name -> times it was preempted

    @property
    def finished(self) -> int:
        return sum(1 for v in self.status.values() if v == "finished")


POLICIES = ("reject", "evict", "preempt")


def simulate_budget(requests: list[Request], budget_tokens: int, policy: str) -> Outcome:
    """A server whose KV memory holds `budget_tokens` tokens, one tick per decode step.
    "reject": admit a request only if its prompt plus its allowance (max_tokens) can be reserved; otherwise turn it
    away (reserving the true answer length instead would need to know the future: max_tokens=None does that).
    "evict": admit whenever the prompt fits; when memory runs out drop the oldest conversations (lost for good).
    "preempt" (what vLLM does): admit whenever the prompt fits; when memory runs out, pause the most recently
    admitted request, free its memory, and put it first in the queue: when memory frees up it is readmitted
    and its prompt and the tokens it had already produced are computed again (the work lost), then it goes on."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(budget_tokens, int) or isinstance(budget_tokens, bool) or budget_tokens < 1:
        raise ValueError(f"the budget must be a whole number of tokens >= 1, got {budget_tokens!r}")
    out, running, waiting = Outcome(), {}, []  # running: name -> [request, tokens held, generated]; waiting FIFO
    held = lambda: sum(h for _, h, _ in running.values())  # noqa: E731
    oldest = lambda: min(running, key=lambda n: running[n][0].arrival)  # noqa: E731
    arrivals = sorted(requests, key=lambda r: r.arrival)
    tick, limit = 0, max(r.arrival for r in requests) + 20 * sum(r.prompt + r.answer for r in requests)
    while (arrivals or running or waiting) and tick < limit:
        while arrivals and arrivals[0].arrival == tick:
            req = arrivals.pop(0)
            if req.prompt > budget_tokens:
                out.status[req.name] = "rejected"
            elif policy == "reject":
                reserved = sum(r.prompt + r.allowance for r, _, _ in running.values())
                if reserved + req.prompt + req.allowance > budget_tokens:
                    out.status[req.name] = "rejected"
                else:
                    running[req.name] = [req, req.prompt, 0]
            elif policy == "evict":
                while running and held() + req.prompt > budget_tokens:
                    victim = oldest()
                    out.status[victim], out.lost = "evicted", out.lost + running.pop(victim)[1]
                running[req.name] = [req, req.prompt, 0]
            else:
                waiting.append([req, 0])
        while policy == "preempt" and waiting and held() + waiting[0][0].prompt + waiting[0][1] <= budget_tokens:
            req, generated = waiting.pop(0)  # (re)admitted: prompt and earlier tokens prefilled again
            running[req.name] = [req, req.prompt + generated, generated]
        for name in list(running):  # each running conversation decodes one token per tick
            entry = running[name]
            entry[1], entry[2] = entry[1] + 1, entry[2] + 1
            if entry[2] >= entry[0].answer:
                out.status[name] = "finished"
                del running[name]
        while held() > budget_tokens:  # evict and preempt can overflow while answers grow
            if policy == "evict":
                victim = oldest()
                out.status[victim], out.lost = "evicted", out.lost + running.pop(victim)[1]
            else:
                victim = list(running)[-1]  # the most recently admitted
                req, tokens, generated = running.pop(victim)
                out.lost += tokens
                out.preempted[victim] = out.preempted.get(victim, 0) + 1
                waiting.insert(0, [req, generated])
        out.usage.append(held())
        out.active.append(sorted(running))
        tick += 1
    return out
