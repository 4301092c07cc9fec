"""Speculative decoding (lesson 14): guess several tokens cheaply, check them in one pass, keep what agrees.

What it does: a drafter proposes up to k tokens; `verify` runs the model once on the last emitted token
plus the draft (k + 1 positions, through generation.run_model on the model's own cache), keeps the
longest prefix of the draft that matches the model's own greedy choices, adds the model's next token,
and rolls the cache back to what was accepted (one assignment on kv_cache.KVCache). Three drafters,
each an object with one method `propose(context, k) -> list[int]`: `PromptLookup` (copy what followed
the last few tokens earlier in the context), `ModelDrafter` (a cheaper model, for example the 4-bit
format of lesson 12, with its own cache) and `early_exit(model, n)` (the first n layers with the
model's head). `speculative_steps` is the loop's peer: it yields the same Steps and stops by the same
Stopper as generation.generate_steps, which hands over to it when given `draft=`. With a sampler
(sampling.make_sampler) it samples: `accept_or_resample` is the rule that keeps the model's
distribution exactly (`sample_verified` applies it; tested by chi-square, a wrong rule shown failing).
What it does not do: batch several requests, or draft trees of candidates (production engines do both).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from .generation import GenerationResult, Stopper, check_request, decode_step, end_of_turn_ids, prefill, run_model
from .kv_cache import KVCache
from .runtime import synchronize
from .sampling import Sampler, greedy


class PromptLookup:
    """Find the last `ngram` tokens (trying ngram, ngram - 1, ... down to 1) earlier in the context and
    propose the k tokens that followed them there. Costs no model call. Example: context [5, 6, 7, 5, 6] ->
    the last [5, 6] occurred at the start, followed by 7, so it proposes [7, 5, 6][:k]"""
    name = "prompt lookup"

    def __init__(self, ngram: int = 3):
        if not isinstance(ngram, int) or ngram < 1:
            raise ValueError(f"ngram must be a positive integer, got {ngram!r}")
        self.ngram = ngram

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # the most recent earlier occurrence first
                if context[start:start + n] == tail:
                    return context[start + n:start + n + k]
        return []


class ModelDrafter:
    """A cheaper model proposes k greedy tokens. It keeps its own cache across calls and rolls it back to the
    longest prefix it shares with the new context, so each call only feeds what changed."""

    def __init__(self, model, name: str = "cheaper model"):
        self.model, self.name = model, name
        self.cache: KVCache | None = None
        self.seen: list[int] = []  # the tokens whose keys and values are in self.cache

    def propose(self, context: list[int], k: int) -> list[int]:
        common = 0
        for a, b in zip(self.seen, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # note: re-feed at least the last token, to get its logits
        if self.cache is None:
            logits, self.cache = prefill(self.model, context, capacity=len(context) + 64)
        else:
            self.cache.rollback(common)
            logits, self.cache = prefill(self.model, context[common:], self.cache)
        self.seen = list(context)
        draft = []
        for i in range(k):
            token, _ = greedy(logits[0])
            draft.append(token)
            if i + 1 < k:
                logits, self.cache = decode_step(self.model, [token], self.cache)
                self.seen.append(token)
        return draft


def early_exit(model, layers: int) -> ModelDrafter:
    """A drafter made of the model's first `layers` blocks, its final norm and its head (no extra weights)."""
    if not 1 <= layers < len(model.layers):
        raise ValueError(f"layers must be between 1 and {len(model.layers) - 1}, got {layers}")
    short = copy.copy(model)
    short.layers = model.layers[:layers]
    short.config = copy.copy(model.config)
    short.config.num_hidden_layers = layers
    return ModelDrafter(short, name=f"first {layers} layers")


@dataclass
class Verified:
    accepted: list[int]  # the drafted tokens the model agrees with
    bonus: int  # the model's own next token after them
    bonus_prob: float


def verify(model, cache: KVCache, last: int, draft: list[int], sampler=None) -> Verified:
    """One pass over [last] + draft on the model's cache (which holds everything before `last`); accept the
    longest prefix the model agrees with (greedy: its own top choices; with a sampling.Sampler: the rule of
    `sample_verified`); roll the cache back so it holds everything up to the last accepted token."""
    start = cache.length
    ids = torch.tensor([[last] + draft], device=model.device)  # (1, k + 1)
    logits, _ = run_model(model, ids, cache, keep=len(draft) + 1)  # (1, k + 1, V)
    if sampler is not None:
        accepted, bonus, prob = sample_verified(logits[0], draft, sampler)
    else:
        n = 0
        for i, token in enumerate(draft):
            if greedy(logits[0, i])[0] != token:
                break
            n += 1
        accepted, (bonus, prob) = draft[:n], greedy(logits[0, n])
    cache.rollback(start + 1 + len(accepted))  # keep `last` and the accepted draft; the bonus is fed next time
    return Verified(accepted, bonus, prob)


def sample_verified(logits: torch.Tensor, draft: list[int], sampler) -> tuple[list[int], int, float]:
    """Speculative sampling over one verify pass. logits (k + 1, V): the model's at [last] + draft. For each
    drafted token in order, `accept_or_resample` with the drafter's distribution one-hot on it (our drafters
    propose deterministically): accepted with probability p(token), otherwise a token is drawn from p with the
    drafted one removed, and the rest of the draft is dropped. If all are accepted, one more is drawn from the
    last position. Returns (accepted, the model's own token, its probability); each output token is
    distributed exactly as plain sampling would draw it. sampler: a sampling.Sampler (its filters, its seed)."""
    accepted = []
    for i, token in enumerate(draft):
        p = sampler.distribution(logits[i])  # (V,)
        one_hot = torch.zeros_like(p)
        one_hot[token] = 1.0
        chosen = accept_or_resample(p, one_hot, token, sampler.rng(p.device)) if sampler.config.temperature else int(p.argmax())
        sampler.accept(chosen)
        if chosen != token:
            return accepted, chosen, float(p[chosen])
        accepted.append(token)
    p = sampler.distribution(logits[len(draft)])
    bonus = sampler.draw(p)
    sampler.accept(bonus)
    return accepted, bonus, float(p[bonus])


@dataclass
class SpecStats:
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # indexes (in the answer) of tokens that were drafted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def speculative_steps(model, tokenizer, prompt_ids, max_new_tokens: int = 64, *, draft, k: int = 4,
                      stop_strings=(), stop_ids=None, pick=greedy):
    """Generation with a drafter: the same Steps and stop conditions as generation.generate_steps. pick: greedy
    (the same tokens as plain greedy decoding) or a sampling.Sampler (make_sampler; speculative sampling: the
    same distribution as plain sampling). The result's `speculative` attribute holds the counts."""
    if pick is not greedy and not isinstance(pick, Sampler):
        raise ValueError("speculative decoding needs pick=greedy or a sampler from sampling.make_sampler (it must "
                         "read the sampler's distribution to accept or resample drafted tokens)")
    sampler = pick if isinstance(pick, Sampler) else None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens drafted per verify step) must be a positive integer, got {k!r}")
    if not hasattr(draft, "propose"):
        raise TypeError("draft must be a drafter: an object with a propose(context, k) method")
    ids = check_request(model, prompt_ids, max_new_tokens)
    window = model.config.max_position_embeddings
    stop_ids = end_of_turn_ids(model, tokenizer) if stop_ids is None else stop_ids
    stopper = Stopper(tokenizer, stop_ids, max_new_tokens, window - len(ids), stop_strings)
    stats = SpecStats()
    synchronize(model.device)
    begin = time.perf_counter()
    logits, cache = prefill(model, ids, capacity=min(window, len(ids) + max_new_tokens + k + 1))
    result = GenerationResult(ids, [], "", "max_new_tokens")
    result.speculative = stats
    token, prob = pick(logits[0])
    pending = [(token, prob, False)]  # tokens to emit: (id, probability, was it drafted)
    while True:
        for token, prob, drafted in pending:
            synchronize(model.device)
            if drafted:
                stats.accepted_at.append(len(result.token_ids))
            yield result.record(token, prob, tokenizer, time.perf_counter() - begin)
            reason = stopper.update(token)
            if reason:
                return result.finish(reason, tokenizer)
        context = ids + result.token_ids
        room = min(k, window - len(context) - 1, max_new_tokens - len(result.token_ids))
        proposal = draft.propose(context, room)[:room] if room > 0 else []
        v = verify(model, cache, result.token_ids[-1], proposal, sampler)
        stats.verify_steps += 1
        stats.drafted += len(proposal)
        stats.accepted += len(v.accepted)
        pending = [(t, 1.0, True) for t in v.accepted] + [(v.bonus, v.bonus_prob, False)]


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator | None = None) -> int:
    """Speculative sampling's rule for one drafted token, which keeps the output distributed exactly as p:
    accept `drafted` with probability min(1, p/q); otherwise draw from max(0, p - q), renormalized.
    p: the model's probabilities (V,), q: the drafter's (V,); a deterministic drafter has q one-hot."""
    ratio = float(p[drafted] / q[drafted]) if q[drafted] > 0 else 0.0
    if torch.rand((), generator=generator) < min(1.0, ratio):
        return drafted
    residual = (p - q).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q: nothing to correct
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


@torch.inference_mode()
def verify_cost(model, prompt_ids: list[int], ks: list[int], repeats: int = 5) -> dict[int, float]:
    """Milliseconds of one pass over k + 1 new positions on a cache holding prompt_ids (k = 0: a plain decode
    step), best of `repeats`; the cache is rolled back after each pass, so every pass sees the same context."""
    logits, cache = prefill(model, prompt_ids, capacity=len(prompt_ids) + max(ks) + 2)
    start, out = cache.length, {}
    for k in ks:
        ids = torch.full((1, k + 1), 42, device=model.device)  # (1, k + 1)
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            synchronize(model.device)
            t = time.perf_counter()
            run_model(model, ids, cache, keep=k + 1)
            synchronize(model.device)
            best = min(best, time.perf_counter() - t)
            cache.rollback(start)
        out[k] = best * 1000
    return out


def expected_tokens_per_verify(acceptance: float, k: int) -> float:
    """If each drafted token is accepted with probability a (independently, in order), a verify step yields
    1 + a + a^2 + ... + a^k tokens. Example: a = 0.5, k = 2 -> 1.75"""
    return sum(acceptance ** i for i in range(k + 1))
