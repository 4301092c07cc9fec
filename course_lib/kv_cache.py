"""The KV cache: what it saves in time, what it costs in memory, and what a server does when memory runs out.

What it does: generates greedily with the cache (generation.prefill + decode_step) and without it
(the whole sequence re-run every step), timing every new token; counts the token positions each way
pushes through the model; computes cache memory from the formula 2 x layers x key/value heads x head
dimension x bytes x tokens and measures it on the real cache object; and simulates a fixed KV memory
budget under two policies (reject new requests, or evict the oldest conversations).
What it does not do: page or share cache blocks between requests (that is what vLLM adds).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .generation import check_request, decode_step, prefill
from .runtime import synchronize


@dataclass
class TimedRun:
    """Greedy tokens and the seconds each new token took (the first includes the prompt's pass)."""
    cached: bool
    token_ids: list[int]
    seconds: list[float]
    positions_processed: int  # token positions pushed through the model in total

    @property
    def total(self) -> float:
        return sum(self.seconds)


@torch.inference_mode()
def run_with_cache(model, prompt_ids, n_new: int) -> TimedRun:
    """prefill once, then one decode_step per new token; no stop token, exactly n_new tokens."""
    ids = check_request(model, prompt_ids, n_new)
    run = TimedRun(True, [], [], len(ids))
    synchronize(model.device)
    start = time.perf_counter()
    logits, cache = prefill(model, ids)
    for i in range(n_new):
        token = int(logits[0].argmax())
        run.token_ids.append(token)
        if i + 1 < n_new:
            logits, cache = decode_step(model, [token], cache)
            run.positions_processed += 1
        synchronize(model.device)
        now = time.perf_counter()
        run.seconds.append(now - start)
        start = now
    return run


@torch.inference_mode()
def run_without_cache(model, prompt_ids, n_new: int) -> TimedRun:
    """Every step re-runs the whole sequence so far: what generation would cost with no KV cache."""
    ids = check_request(model, prompt_ids, n_new)
    run = TimedRun(False, [], [], 0)
    seq = torch.tensor([ids], device=model.device)  # (1, T), grows by one each step
    for _ in range(n_new):
        synchronize(model.device)
        start = time.perf_counter()
        logits = model(input_ids=seq, use_cache=False, logits_to_keep=1).logits  # (1, 1, V)
        token = int(logits[0, -1].argmax())
        run.positions_processed += seq.shape[1]
        seq = torch.cat([seq, torch.tensor([[token]], device=model.device)], dim=1)
        synchronize(model.device)
        run.seconds.append(time.perf_counter() - start)
        run.token_ids.append(token)
    return run


def positions_processed(prompt_len: int, n_new: int, cached: bool) -> int:
    """Token positions pushed through the model to produce n_new tokens.
    Example: prompt 10, 3 new -> cached 10 + 2 = 12; uncached 10 + 11 + 12 = 33"""
    if cached:
        return prompt_len + n_new - 1
    return sum(prompt_len + i for i in range(n_new))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int | float) -> float:
    """2 (keys and values) x layers x key/value heads x head dimension x bytes.
    Example: SmolLM2-135M in bfloat16: 2 * 30 * 3 * 64 * 2 = 23,040"""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def model_kv_bytes_per_token(config, dtype: torch.dtype) -> float:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                              torch.empty((), dtype=dtype).element_size())


def cache_bytes(cache) -> int:
    """Bytes actually held by a transformers cache object (every layer's key and value tensors)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if torch.is_tensor(tensor):
                total += tensor.numel() * tensor.element_size()
    return total


@dataclass
class Request:
    """One conversation: arrives at `arrival`, brings `prompt` tokens, then grows by one token per tick."""
    name: str
    arrival: int
    prompt: int
    answer: int


@dataclass
class Outcome:
    status: dict[str, str] = field(default_factory=dict)  # name -> "finished", "rejected", "evicted"
    usage: list[int] = field(default_factory=list)  # tokens held in the cache at each tick
    active: list[list[str]] = field(default_factory=list)  # who held memory at each tick


def simulate_budget(requests: list[Request], budget_tokens: int, policy: str) -> Outcome:
    """A server whose KV memory holds `budget_tokens` tokens, one tick per decode step.
    "reject": admit a request only if its prompt plus its full answer can be reserved; otherwise turn it
    away. "evict": admit whenever the prompt fits, and when memory runs out drop the oldest conversations."""
    if policy not in ("reject", "evict"):
        raise ValueError("policy must be 'reject' or 'evict'")
    if budget_tokens < 1:
        raise ValueError("the budget must hold at least one token")
    out, running = Outcome(), {}  # name -> [request, tokens held]
    held = lambda: sum(h for _, h in running.values())  # noqa: E731
    oldest = lambda: min(running, key=lambda n: running[n][0].arrival)  # noqa: E731
    for tick in range(max(r.arrival + r.answer for r in requests) + 1):
        for req in (r for r in requests if r.arrival == tick):
            if policy == "reject":
                reserved = sum(r.prompt + r.answer for r, _ in running.values())
                if reserved + req.prompt + req.answer > budget_tokens:
                    out.status[req.name] = "rejected"
                    continue
            else:
                while running and held() + req.prompt > budget_tokens:
                    out.status[(victim := oldest())] = "evicted"
                    del running[victim]
                if req.prompt > budget_tokens:
                    out.status[req.name] = "rejected"
                    continue
            running[req.name] = [req, req.prompt]
        for name in list(running):  # each running conversation decodes one token per tick
            req, _ = running[name]
            running[name][1] += 1
            if running[name][1] - req.prompt >= req.answer:
                out.status[name] = "finished"
                del running[name]
        while held() > budget_tokens:  # only the evict policy can overflow
            out.status[(victim := oldest())] = "evicted"
            del running[victim]
        out.usage.append(held())
        out.active.append(sorted(running))
    return out
