"""Sampling: from next-token logits to one chosen token, as small pure functions.

What it does: temperature, top-k, top-p (nucleus), min-p and repetition penalty each reshape a
logits vector (V,) or batch (B, V); `logits_to_probs` chains them in the order transformers uses
(penalty, temperature, top-k, top-p, min-p); `sample` draws from the result with a seeded
generator; `make_sampler` returns a `pick` function for generation.generate, and `greedy` is the one greedy pick:
every picker returns (token, probability) from the distribution it computed. Filtered tokens get
-inf logits, so they have probability exactly 0. Temperature 0 means greedy: always the top token.
Drafted tokens (speculative decoding) are accepted here too, as a picker rule: `accept_draft` keeps the
longest prefix the greedy pick agrees with, or, with a Sampler, applies `accept_or_resample` (speculative
sampling), which keeps the sampler's distribution exactly.
What it does not do: call the model (pass it logits) or draw anything (plots.py, widgets.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runner.forward import entropy_bits


def _check_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits a token can be picked from: a non-empty (V,) or (B, V) tensor, no NaN, no +inf, and at least
    one finite value per row. Returned as float32."""
    if not torch.is_tensor(logits) or logits.dim() not in (1, 2) or logits.shape[-1] == 0:
        raise ValueError("logits must be a non-empty (V,) or (B, V) tensor")
    if not bool(torch.isfinite(logits).all()):  # the usual case: one pass over the vocabulary
        if torch.isnan(logits).any():
            raise ValueError("logits contain NaN: the model output is broken (check the dtype and the input IDs)")
        if torch.isposinf(logits).any():
            raise ValueError("logits contain +inf: no probability can be computed (check the model's dtype)")
        if not torch.isfinite(logits).any(dim=-1).all():
            raise ValueError("all logits of a row are -inf: filters or a mask removed every token, none can be picked")
    return logits.float()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_temperature(t) -> float:
    if not (_is_number(t) and t >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {t!r}")
    return float(t)


def check_top_k(k) -> int:
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 switches it off), got {k!r}")
    return k


def check_top_p(p) -> float:
    if not (_is_number(p) and 0 < p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 switches it off), got {p!r}")
    return float(p)


def check_min_p(p) -> float:
    if not (_is_number(p) and 0 <= p <= 1):
        raise ValueError(f"min_p must be in [0, 1] (0 switches it off), got {p!r}")
    return float(p)


def check_penalty(x) -> float:
    if not (_is_number(x) and x > 0):
        raise ValueError(f"repetition_penalty must be > 0 (1 switches it off), got {x!r}")
    return float(x)


def greedy(logits: torch.Tensor) -> tuple[int, float]:
    """The most probable token and its probability. Example: greedy(tensor([0., 2., 0.])) -> (1, 0.787...)"""
    row = (logits if torch.is_tensor(logits) and logits.dim() in (1, 2) else _check_logits(logits)).reshape(-1).float()
    total = float(torch.logsumexp(row, dim=-1))  # note: finite unless a NaN, +inf, all -inf or nothing: checked then
    token = int(torch.argmax(row)) if math.isfinite(total) else _check_logits(logits)
    return token, math.exp(float(row[token]) - total)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide logits by T: T < 1 sharpens, T > 1 flattens. Example: [2., 0.], T=2 -> [1., 0.]"""
    if check_temperature(temperature) == 0:
        raise ValueError("temperature must be > 0 here; temperature 0 means greedy (see logits_to_probs)")
    return _check_logits(logits) / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits, set the rest to -inf; k=0 keeps all. Example: [2., 1., .5], k=2 -> [2., 1., -inf]"""
    check_top_k(k)
    logits = _check_logits(logits)
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))  # note: ties with the k-th are all kept, as in transformers


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most probable tokens whose total probability first reaches p (the nucleus); the rest -inf.
    Example: probs [.5, .3, .2], p=0.7 -> keeps the first two"""
    check_top_p(p)
    logits = _check_logits(logits)
    ascending, order = torch.sort(logits, dim=-1)
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and all less likely ones
    remove_sorted = tail_mass <= (1 - p)  # note: same rule as transformers' TopPLogitsWarper
    remove_sorted[..., -1] = False  # the top token always survives
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less probable than min_p times the top token's probability; min_p=0 keeps all."""
    check_min_p(min_p)
    logits = _check_logits(logits)
    if min_p == 0:
        return logits
    probs = logits.softmax(dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(remove, float("-inf"))


def repetition_penalty(logits: torch.Tensor, previous_ids, penalty: float) -> torch.Tensor:
    """Make tokens already seen less likely: positive logits / penalty, negative logits * penalty (1.0 = off)."""
    check_penalty(penalty)
    logits = _check_logits(logits).clone()
    ids = torch.as_tensor(list(previous_ids), dtype=torch.long, device=logits.device)
    if penalty == 1.0 or ids.numel() == 0:
        return logits
    seen = logits[..., ids]
    logits[..., ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits


@dataclass(frozen=True)
class SamplingConfig:
    """All the knobs in one checked record. temperature=0 means greedy."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        check_temperature(self.temperature), check_top_k(self.top_k), check_top_p(self.top_p)
        check_min_p(self.min_p), check_penalty(self.repetition_penalty)


def filtered_logits(logits: torch.Tensor, config: SamplingConfig, previous_ids=()) -> torch.Tensor:
    """The chain, in transformers' order: penalty -> temperature -> top-k -> top-p -> min-p."""
    logits = repetition_penalty(logits, previous_ids, config.repetition_penalty)
    if config.temperature == 0:  # greedy: only the top token survives
        return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True), float("-inf"))
    logits = apply_temperature(logits, config.temperature)
    logits = top_k_filter(logits, config.top_k)
    if config.top_p < 1:
        logits = top_p_filter(logits, config.top_p)
    return min_p_filter(logits, config.min_p)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig = SamplingConfig(), previous_ids=()) -> torch.Tensor:
    """The distribution a sampler draws from after every filter. Same shape as logits, rows sum to 1."""
    return filtered_logits(logits, config, previous_ids).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, num_samples: int = 1) -> torch.Tensor:
    """Draw token IDs from a (V,) distribution (with replacement). Returns (num_samples,) long tensor."""
    return torch.multinomial(probs.float(), num_samples, replacement=True, generator=generator)


def effective_choices(probs: torch.Tensor) -> float:
    """2 ** entropy in bits: how many equally likely tokens would be as uncertain. 1 means certain."""
    return 2.0 ** entropy_bits(probs)


class Sampler:
    """A seeded picker: sampler(logits) -> (token, probability), the pick contract of generation.generate.
    Its parts are public for speculative sampling (lesson 14), which must read the same distribution and
    draw from the same generator: `distribution(logits)` (V,) after the filters, `draw(probs)`, `accept(token)`."""

    def __init__(self, config: SamplingConfig, seed: int | None = None, history: list[int] | None = None):
        self.config, self.seed = config, seed
        self.generator = None
        self.seen = list(history or [])  # the prompt and every chosen token (for the repetition penalty)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """(V,) probabilities the next token is drawn from, given everything chosen so far."""
        return logits_to_probs(logits, self.config, self.seen)

    def rng(self, device) -> torch.Generator | None:
        if self.generator is None and self.seed is not None:  # note: a generator lives on one device: make it there
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def draw(self, probs: torch.Tensor) -> int:
        return int(probs.argmax()) if self.config.temperature == 0 else int(sample(probs, self.rng(probs.device))[0])

    def accept(self, token: int) -> None:
        self.seen.append(token)

    def __call__(self, logits: torch.Tensor) -> tuple[int, float]:
        probs = self.distribution(logits)  # (V,), on the logits' device
        token = self.draw(probs)
        self.accept(token)
        return token, float(probs[token])


def make_sampler(config: SamplingConfig, seed: int | None = None, history: list[int] | None = None) -> Sampler:
    """A pick(logits) -> (token, probability) function for generation.generate; seeded, so a result can be
    repeated. The probability is the chosen token's in the distribution it was drawn from (after the filters).
    history: the prompt IDs, needed only for the repetition penalty (chosen tokens are appended)."""
    return Sampler(config, seed, history)


@dataclass(frozen=True)
class Reshaped:
    """What a sampling setting does to one distribution, for the top `show` tokens of the original."""
    ids: list[int]
    before: list[float]  # probabilities at temperature 1, no filter
    after: list[float]  # probabilities after this setting's chain
    kept: int  # how many tokens of the whole vocabulary keep a non-zero probability
    choices_before: float
    choices_after: float


def reshape(logits: torch.Tensor, config: SamplingConfig, show: int = 12, previous_ids=()) -> Reshaped:
    """Before/after probabilities of the `show` most likely tokens, plus the effective number of choices.
    previous_ids: the tokens seen so far, for the repetition penalty."""
    before = _check_logits(logits).softmax(dim=-1)  # (V,)
    after = logits_to_probs(logits, config, previous_ids)  # (V,)
    ids = torch.topk(before, show).indices
    return Reshaped(ids.tolist(), before[ids].tolist(), after[ids].tolist(), int((after > 0).sum()),
                    effective_choices(before), effective_choices(after))


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafted: int, generator: torch.Generator | None = None) -> int:
    """Speculative sampling's rule for one drafted token, which keeps the output distributed exactly as p:
    accept `drafted` with probability min(1, p/q); otherwise draw from max(0, p - q), renormalized.
    p: the model's probabilities (V,), q: the drafter's (V,), on one device; a deterministic drafter has q one-hot."""
    ratio = float(p[drafted] / q[drafted]) if q[drafted] > 0 else 0.0
    if float(torch.rand((), generator=generator, device=p.device)) < min(1.0, ratio):
        return drafted
    residual = (p - q).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q: nothing to correct
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def sample_verified(logits: torch.Tensor, draft: list[int], sampler: Sampler,
                    draft_probs: list[torch.Tensor] | None = None) -> tuple[list[int], int, float, list[float]]:
    """Speculative sampling over one verify pass (Leviathan et al. 2023; Chen et al. 2023). logits (k + 1, V): the
    model's at [last] + draft. For each drafted token in order, `accept_or_resample` with the drafter's
    distribution q: draft_probs[i] (V,) for a drafter that sampled its token from q, or one-hot on the token for
    a drafter that proposes deterministically (draft_probs None: accepted with probability p(token)). A rejected
    token is replaced by a draw from max(0, p - q) and the rest of the draft is dropped. If all are accepted, one
    more is drawn from the last position. Returns (accepted, the model's own token, its probability, each accepted
    token's probability in the model's distribution, as plain sampling records it); each output token is
    distributed exactly as plain sampling would draw it. sampler: a Sampler (filters, seed)."""
    if draft_probs is not None and len(draft_probs) != len(draft):
        raise ValueError(f"{len(draft_probs)} draft distributions for {len(draft)} drafted tokens")
    accepted, probs = [], []
    for i, token in enumerate(draft):
        p = sampler.distribution(logits[i])  # (V,)
        if draft_probs is not None:
            q = draft_probs[i].to(p.device, p.dtype)
        else:
            q = torch.zeros_like(p)
            q[token] = 1.0
        chosen = accept_or_resample(p, q, token, sampler.rng(p.device)) if sampler.config.temperature else int(p.argmax())
        sampler.accept(chosen)
        if chosen != token:
            return accepted, chosen, float(p[chosen]), probs
        accepted.append(token)
        probs.append(float(p[token]))
    p = sampler.distribution(logits[len(draft)])
    bonus = sampler.draw(p)
    sampler.accept(bonus)
    return accepted, bonus, float(p[bonus]), probs


def accept_draft(logits: torch.Tensor, draft: list[int], pick=greedy,
                 draft_probs: list[torch.Tensor] | None = None) -> tuple[list[int], int, float, list[float]]:
    """The picker rule for a verify pass. logits (k + 1, V): the model's at [last] + draft. pick=greedy keeps the
    longest prefix of the draft that greedy agrees with, then greedy's own next token; a Sampler applies
    `sample_verified` (draft_probs: the drafter's distributions, if it sampled). Returns (accepted draft tokens,
    the model's own next token, its probability, the accepted tokens' probabilities as plain decoding records
    them). Example: greedy choices [7, 9, 4] at a draft [7, 8] -> ([7], 9, p, [p of 7])"""
    if isinstance(pick, Sampler):
        return sample_verified(logits, draft, pick, draft_probs)
    if pick is not greedy:
        raise ValueError("drafted tokens can be checked with pick=greedy or a sampler from sampling.make_sampler "
                         "(it must read the sampler's distribution to accept or resample drafted tokens)")
    n, probs = 0, []
    for i, token in enumerate(draft):
        choice, p = greedy(logits[i])
        if choice != token:
            break
        n += 1
        probs.append(p)
    token, prob = greedy(logits[n])
    return draft[:n], token, prob, probs
