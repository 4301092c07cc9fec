"""The stages of the loop: each runs the model once (or n times) through forward.run_model, the one call into a model.

What it does: `prefill` runs the prompt(s) once and fills a KV cache (or, given a cache that holds the start of the
prompt, the next chunk of it: chunked prefill); `decode_step` feeds one new token per row and reuses the cache;
`verify_pass` feeds the last token plus drafted tokens in one pass (speculative decoding) and `verify` applies the
picker's acceptance rule to it; `decode_n` picks and feeds n tokens in a row (what a model drafter runs). Each takes
one row or many (left-padded, with an attention mask and position IDs), for any runner (forward.Runner) and any
cache (kv_cache.Cache). A notebook can call each on its own; the schedulers call them, and generation.step drives
the schedulers.
What it does not do: decide which requests run (the schedulers do), loop over steps (generation.py does) or record
a request's tokens (request.Job does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runner.forward import as_batch, run_model
from ..runner.kv_cache import length_of, new_cache, rollback
from .request import Pick
from .sampling import Sampler, accept_draft, greedy

CAPACITY_MARGIN = 64  # extra tokens a fresh cache makes room for when the caller does not say how many


def prefill(model, input_ids, cache=None, *, attention_mask=None, position_ids=None, capacity: int | None = None):
    """Run the prompt(s) in one pass. One row: prefill(model, ids). Many rows: left-padded (B, T) with
    attention_mask and position_ids (schedulers.left_pad makes them). capacity: tokens the new cache should
    hold (our model preallocates; transformers' grows). Given a cache that already holds the first tokens of
    a row, it runs the next ones after them: chunked prefill is prefill called once per chunk (the logits
    equal one whole prefill's, up to float rounding). Returns (last-position logits (B, V), the cache)."""
    ids = as_batch(input_ids).to(model.device)  # (B, T)
    if cache is None:
        cache = new_cache(model, ids.shape[0], capacity or ids.shape[1] + CAPACITY_MARGIN)
    logits, cache = run_model(model, ids, cache, attention_mask, position_ids)
    return logits[:, -1], cache  # (B, V)


def decode_step(model, token_ids, cache, *, attention_mask=None, positions=None):
    """Feed one new token per row, reusing the cache. token_ids: (B,) or (B, 1); attention_mask (B, S) covers
    the cache and the new token; positions (B,). Returns ((B, V) logits, cache)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(-1, 1)  # (B, 1)
    position_ids = positions.reshape(-1, 1) if positions is not None else None  # (B, 1)
    logits, cache = run_model(model, ids, cache, attention_mask, position_ids)
    return logits[:, -1], cache  # (B, V)


def decode_n(model, logits: torch.Tensor, cache, n: int, pick: Pick = greedy) -> tuple[list[int], list[float], object]:
    """n tokens in a row for one sequence: pick from (V,) logits, feed the token with decode_step, pick again...
    The last token is picked but not fed (nobody has asked for its logits yet). What a model drafter runs.
    Returns (tokens, their probabilities, the cache). Example: n=3 -> 3 tokens, 2 decode steps"""
    tokens, probs = [], []
    for i in range(n):
        token, prob = pick(logits)
        tokens.append(token)
        probs.append(prob)
        if i + 1 < n:
            logits, cache = decode_step(model, [token], cache)
            logits = logits[0]
    return tokens, probs, cache


@dataclass
class Verified:
    accepted: list[int]  # the drafted tokens the model agrees with
    bonus: int  # the model's own next token after them
    bonus_prob: float


def verify_pass(model, cache, last: int, draft: list[int]) -> torch.Tensor:
    """One pass over [last] + draft on a cache that holds everything before `last`: the model's logits at each of
    those positions, (k + 1, V). The cache now holds them all; roll it back past what the picker rejects."""
    ids = torch.tensor([[last] + list(draft)], device=model.device)  # (1, k + 1)
    logits, _ = run_model(model, ids, cache, keep=len(draft) + 1)  # (1, k + 1, V)
    return logits[0]


def verify(model, cache, last: int, draft: list[int], pick: Pick = greedy, draft_probs=None) -> Verified:
    """verify_pass, then the picker's rule (sampling.accept_draft: greedy's own choices, or speculative sampling
    with a Sampler, reading the drafter's distributions draft_probs if it sampled) accepts a prefix of the draft, and the cache is rolled back so it holds everything up to the
    last accepted token (the model's own next token is fed at the next step). Works on either runner's cache
    (kv_cache.rollback). The loop does the same three things across one step (Alone.run, step, Alone.feed)."""
    start = length_of(cache)
    accepted, bonus, prob, _ = accept_draft(verify_pass(model, cache, last, draft), list(draft), pick, draft_probs)
    rollback(cache, start + 1 + len(accepted))  # keep `last` and the accepted draft
    return Verified(accepted, bonus, prob)


def check_draft(draft, k, pick) -> None:
    """A drafter, a positive k and a picker that can judge drafted tokens, or a clear error."""
    if pick is not greedy and not isinstance(pick, Sampler):
        raise ValueError("speculative decoding needs pick=greedy or a sampler from sampling.make_sampler (it must "
                         "read the sampler's distribution to accept or resample drafted tokens)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens drafted per verify step) must be a positive integer, got {k!r}")
    if not hasattr(draft, "propose"):
        raise TypeError("draft must be a drafter: an object with a propose(context, k) method")
