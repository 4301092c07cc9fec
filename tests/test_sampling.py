import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from course_lib.runner.forward import forward_logits
from course_lib.engine.generation import generate
from course_lib.engine.sampling import (SamplingConfig, apply_temperature, effective_choices, logits_to_probs,
                                        make_sampler, min_p_filter, repetition_penalty, reshape, sample,
                                        top_k_filter, top_p_filter)

from conftest import chat_ids


@pytest.fixture(scope="module")
def real_logits(model, tokenizer):
    """Next-token logits of the real model on three prompts: (3, V)."""
    rows = [forward_logits(model, chat_ids(tokenizer, q))[0, -1]
            for q in ["What is the capital of France?", "What is the capital gains tax in France?",
                      "Write a short story about a robot who learns to paint."]]
    return torch.stack(rows)


def _hf(processor, logits, input_ids=None):
    ids = input_ids if input_ids is not None else torch.zeros((logits.shape[0], 1), dtype=torch.long)
    return processor(ids, logits.clone())


@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 1.6])
def test_temperature_matches_transformers(real_logits, t):
    assert torch.allclose(apply_temperature(real_logits, t), _hf(TemperatureLogitsWarper(t), real_logits))


@pytest.mark.parametrize("k", [1, 5, 40, 1000])
def test_top_k_matches_transformers(real_logits, k):
    assert torch.equal(top_k_filter(real_logits, k), _hf(TopKLogitsWarper(k), real_logits))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_matches_transformers(real_logits, p):
    assert torch.equal(top_p_filter(real_logits, p), _hf(TopPLogitsWarper(p), real_logits))


@pytest.mark.parametrize("m", [0.01, 0.1, 0.5])
def test_min_p_matches_transformers(real_logits, m):
    assert torch.equal(min_p_filter(real_logits, m), _hf(MinPLogitsWarper(m), real_logits))


@pytest.mark.parametrize("penalty", [0.8, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(real_logits, penalty):
    previous = torch.tensor([[504, 3575, 282, 4649, 47, 504]] * 3)
    ours = torch.stack([repetition_penalty(row, previous[0].tolist(), penalty) for row in real_logits])
    assert torch.allclose(ours, _hf(RepetitionPenaltyLogitsProcessor(penalty), real_logits, previous))


def test_filters_keep_at_least_the_top_token(real_logits):
    for row in real_logits:
        top = int(row.argmax())
        for filtered in (top_k_filter(row, 1), top_p_filter(row, 1e-9), min_p_filter(row, 1.0)):
            assert torch.isfinite(filtered).sum() >= 1 and torch.isfinite(filtered[top])


def test_small_examples():
    assert top_k_filter(torch.tensor([2.0, 1.0, 0.5]), 2).tolist() == [2.0, 1.0, float("-inf")]
    probs = torch.tensor([0.5, 0.3, 0.2]).log()
    assert torch.isfinite(top_p_filter(probs, 0.7)).tolist() == [True, True, False]
    assert torch.isfinite(top_p_filter(probs, 0.5)).tolist() == [True, False, False]


def test_temperature_zero_is_greedy(real_logits):
    for row in real_logits:
        probs = logits_to_probs(row, SamplingConfig(temperature=0))
        assert float(probs[int(row.argmax())]) == 1.0
        assert sample(probs, torch.Generator().manual_seed(1), 200).unique().tolist() == [int(row.argmax())]


def test_probs_are_distributions(real_logits):
    cfg = SamplingConfig(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02)
    probs = logits_to_probs(real_logits, cfg)
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and (probs >= 0).all()


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; tokens with small expected counts are pooled into one bin."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)]).double()
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=0.6), SamplingConfig(top_k=10),
                                 SamplingConfig(top_p=0.8), SamplingConfig(temperature=1.3, min_p=0.05)],
                         ids=["plain", "T0.6", "topk10", "topp0.8", "T1.3minp"])
def test_draws_match_the_distribution(real_logits, cfg):
    probs = logits_to_probs(real_logits[0], cfg)
    draws = sample(probs, torch.Generator().manual_seed(1234), 20_000)
    counts = torch.bincount(draws, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0  # nothing filtered is ever drawn
    assert _chi_square_p_value(counts, probs) > 1e-3


def test_chi_square_catches_a_wrong_sampler(real_logits):
    right = logits_to_probs(real_logits[0], SamplingConfig(temperature=0.6))
    wrong_draws = sample(logits_to_probs(real_logits[0], SamplingConfig(temperature=0.7)),
                         torch.Generator().manual_seed(1234), 20_000)
    assert _chi_square_p_value(torch.bincount(wrong_draws, minlength=right.numel()), right) < 1e-3


def test_seeded_generation_repeats(model, tokenizer):
    ids = chat_ids(tokenizer, "Write a short story about a robot who learns to paint.")
    cfg = SamplingConfig(temperature=0.9, top_p=0.95)
    run = lambda seed: generate(model, tokenizer, ids, 15, pick=make_sampler(cfg, seed=seed)).token_ids  # noqa: E731
    assert run(7) == run(7)
    assert run(7) != run(8) or run(7) != run(9)


def test_greedy_sampler_equals_default_loop(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    pick = make_sampler(SamplingConfig(temperature=0), seed=0)
    assert generate(model, tokenizer, ids, 20, pick=pick).token_ids == generate(model, tokenizer, ids, 20).token_ids


def test_effective_choices():
    assert effective_choices(torch.tensor([1.0, 0.0])) == pytest.approx(1.0)
    assert effective_choices(torch.full((8,), 1 / 8)) == pytest.approx(8.0)


def test_reshape(real_logits):
    r = reshape(real_logits[0], SamplingConfig(top_k=3), show=6)
    assert r.kept == 3 and sum(a > 0 for a in r.after) == 3 and r.choices_after < r.choices_before
    assert r.before == sorted(r.before, reverse=True)


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(repetition_penalty=0), "repetition_penalty")])
def test_bad_settings(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**bad)


def test_nan_logits_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        logits_to_probs(torch.tensor([0.0, math.nan, 1.0]))
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(torch.tensor([1.0]), 0)
