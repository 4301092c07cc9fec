"""Speculative decoding (lesson 14): guess several tokens cheaply, check them in one pass, keep what agrees.

What it does: holds the drafters. A drafter proposes up to k tokens, each an object with one method
`propose(context, k) -> list[int]` (and, optionally, `follow(pick)`, told how the model picks, and `probs`, the
distributions its last proposal was sampled from): `PromptLookup` (copy what followed the last few tokens earlier in the
context), `ModelDrafter` (a cheaper model, for example the 4-bit format of lesson 12, drafting through
stages.decode_n on its own cache: greedily for a greedy model; for a sampling model it samples from its own
distribution and keeps it, the q of speculative sampling) and `early_exit(model, n)` (the first n layers with the model's head).
The loop is generation's: `generate(..., draft=PromptLookup(), k=4)` makes each step a verify pass
(stages.verify, re-exported here for lesson 14: the last token plus the draft in one pass, the cache rolled
back past what is rejected), and the acceptance rule is a picker rule in sampling.py (`accept_draft`;
`accept_or_resample` and `sample_verified` for speculative sampling, re-exported here). Works on either runner
(the library's DynamicCache rolls back by crop); `early_exit` needs the course's model (it slices its layers).
What it does not do: batch several requests, draft trees of candidates (production engines do both), or time
anything (measure.speed.verify_cost does).
"""
from __future__ import annotations

import copy

import torch

from .request import SpecStats
from .stages import Verified, decode_n, prefill, verify
from ..runner.kv_cache import rollback
from .sampling import Sampler, accept_or_resample, greedy, sample_verified

__all__ = ["PromptLookup", "ModelDrafter", "early_exit", "expected_tokens_per_verify", "acceptance", "verify", "Verified",
           "SpecStats", "accept_or_resample", "sample_verified"]


class PromptLookup:
    """Find the last `ngram` tokens (trying ngram, ngram - 1, ... down to min_ngram) earlier in the context and
    propose the k tokens that followed them there. Costs no model call. Example: context [5, 6, 7, 5, 6] ->
    the last [5, 6] occurred at the start, followed by 7, so it proposes [7, 5, 6][:k].
    min_ngram (vLLM's prompt_lookup_min): a shorter match proposes nothing, and the step is a plain one; a
    one-token match on free text is mostly chance, and each wrong guess costs a row of the verify pass."""
    name = "prompt lookup"

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1:
            raise ValueError(f"ngram must be a positive integer, got {ngram!r}")
        if not isinstance(min_ngram, int) or isinstance(min_ngram, bool) or not 1 <= min_ngram <= ngram:
            raise ValueError(f"min_ngram must be an integer from 1 to ngram ({ngram}), got {min_ngram!r}")
        self.ngram, self.min_ngram = ngram, min_ngram

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # the most recent earlier occurrence first
                if context[start:start + n] == tail:
                    return context[start + n:start + n + k]
        return []


class ModelDrafter:
    """A cheaper model proposes k tokens. It keeps its own cache across calls and rolls it back to the longest
    prefix it shares with the new context, so each call only feeds what changed.
    How it drafts follows the model's picker (`follow(pick)`, which generate calls): greedy when the model is
    greedy; when the model samples, the drafter samples from its own distribution with the same settings and
    keeps those distributions in `probs`, the q of speculative sampling (sampling.sample_verified). sample=False
    keeps greedy drafts under a sampling model (q one-hot), to compare the two.
    seed: the drafter's own generator. None (the default) derives it from the model's sampler's seed, so a
    seeded run repeats, and runs with different seeds draft independently: a drafter seeded alike in every run
    would propose the same token for the same context in all of them, and over many runs the answers would no
    longer follow the model's distribution (within one run they would)."""

    def __init__(self, model, name: str = "cheaper model", sample: bool = True, seed: int | None = None):
        self.model, self.name, self.sample, self.seed = model, name, sample, seed
        self.cache = None  # any cache (kv_cache.Cache, or transformers' DynamicCache)
        self.seen: list[int] = []  # the tokens whose keys and values are in self.cache
        self.sampler: Sampler | None = None  # set by follow() when the model samples
        self.target: Sampler | None = None  # the model's sampler, whose history the drafter's filters read
        self.probs: list[torch.Tensor] | None = None  # q of each drafted token, when sampled; None: one-hot

    def follow(self, pick) -> None:
        """Draft as the model picks: a Sampler with a temperature -> sample with the same settings (own generator,
        seeded from `seed`, or from the model's sampler's seed), keeping q; anything else -> greedy."""
        sampling = isinstance(pick, Sampler) and pick.config.temperature > 0 and self.sample
        seed = self.seed
        if seed is None and sampling and pick.seed is not None:
            seed = (pick.seed * 1_000_003 + 12_345) % 2**63  # note: a stream of its own, fixed by the model's seed
        self.sampler = Sampler(pick.config, seed) if sampling else None
        self.target = pick if sampling else None
        self.probs = None  # note: a drafter reused under another picker must not hand over the last run's q

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
            rollback(self.cache, common)
            logits, self.cache = prefill(self.model, context[common:], self.cache)
        pick = greedy
        if self.sampler is not None:
            self.sampler.seen, self.probs = list(self.target.seen), []  # its filters see what the model's see
            pick = self._sample
        draft, _, self.cache = decode_n(self.model, logits[0], self.cache, k, pick)
        self.seen = list(context) + draft[:-1]  # every drafted token but the last was fed
        return draft

    def _sample(self, logits: torch.Tensor) -> tuple[int, float]:
        q = self.sampler.distribution(logits)  # (V,)
        token = self.sampler.draw(q)
        self.sampler.accept(token)
        self.probs.append(q)
        return token, float(q[token])


def early_exit(model, layers: int) -> ModelDrafter:
    """A drafter made of the model's first `layers` blocks, its final norm and its head (no extra weights)."""
    if not hasattr(model, "layers"):
        raise TypeError("early_exit slices the course's own model (model.Model): build one with "
                        "Model.from_transformers(model), or draft with PromptLookup() or ModelDrafter(a model)")
    if not 1 <= layers < len(model.layers):
        raise ValueError(f"layers must be between 1 and {len(model.layers) - 1}, got {layers}")
    config = copy.copy(model.config)  # note: a copy, so the full model keeps its own count
    config.num_hidden_layers = layers
    return ModelDrafter(model.with_parts(layers=model.layers[:layers], config=config), name=f"first {layers} layers")


def expected_tokens_per_verify(acceptance: float, k: int) -> float:
    """If each drafted token is accepted with probability a (independently, in order), a verify step yields
    1 + a + a^2 + ... + a^k tokens. Example: a = 0.5, k = 2 -> 1.75"""
    return sum(acceptance ** i for i in range(k + 1))


def acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """The probability that speculative sampling accepts a token drafted from q when the model samples from p:
    sum over tokens of q(x) min(1, p(x) / q(x)) = sum of min(p, q) = 1 - total variation distance(p, q).
    With a one-hot q (a greedy drafter) it is p of the drafted token. Example: p = q -> 1.0"""
    return float(torch.minimum(p, q.to(p.device, p.dtype)).sum())
