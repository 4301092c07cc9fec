"""Lesson 14: speculative greedy decoding gives the very same tokens as plain greedy, for every drafter and k;
the sampling rule keeps the model's distribution (chi-square), and a wrong rule is caught."""
import pytest
import torch

from course_lib.runner import formats
from course_lib.text.context import chat_ids, edit_ids, story_ids
from course_lib.engine.generation import generate, stream
from course_lib.runner.model import Model
from course_lib.engine.sampling import accept_or_resample, logits_to_probs, make_sampler, SamplingConfig
from course_lib.engine.speculative import ModelDrafter, PromptLookup, early_exit

from test_sampling import _chi_square_p_value, real_logits  # noqa: F401 - real_logits is a fixture

@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


@pytest.fixture(scope="module")
def drafters(ours):
    return {"lookup": lambda: PromptLookup(3), "int4": lambda: ModelDrafter(formats.convert(ours, "int4")),
            "early": lambda: early_exit(ours, 8)}


def test_prompt_lookup_copies_what_followed():
    assert PromptLookup(2).propose([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    assert PromptLookup(3).propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # falls back to a shorter n-gram
    assert PromptLookup(3).propose([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="ngram"):
        PromptLookup(0)


def test_prompt_lookup_min_ngram_drafts_nothing_on_a_shorter_match():
    context = [1, 2, 3, 9, 4, 3]  # only the last token, 3, occurred before (followed by 9)
    assert PromptLookup(3).propose(context, 2) == [9, 4]  # a one-token match is taken
    assert PromptLookup(3, min_ngram=2).propose(context, 2) == []  # not with at least two required
    assert PromptLookup(3, min_ngram=2).propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # a two-token match is
    for bad in (0, 4, 1.5, True):
        with pytest.raises(ValueError, match="min_ngram"):
            PromptLookup(3, min_ngram=bad)


@pytest.mark.parametrize("name", ["lookup", "int4", "early"])
@pytest.mark.parametrize("k", [1, 4])
def test_same_tokens_as_plain_greedy(ours, tokenizer, drafters, name, k):
    for prompt in (edit_ids(tokenizer), chat_ids(tokenizer, "What is the capital of France?")):
        plain = generate(ours, tokenizer, prompt, 40)
        spec = generate(ours, tokenizer, prompt, 40, draft=drafters[name](), k=k)
        assert spec.token_ids == plain.token_ids and spec.stop_reason == plain.stop_reason
        assert spec.speculative.verify_steps <= len(spec.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lookup", "int4"])
def test_a_story_is_identical(ours, tokenizer, drafters, name):
    prompt = story_ids(tokenizer)
    plain = generate(ours, tokenizer, prompt, 128, stop_ids=())
    spec = generate(ours, tokenizer, prompt, 128, stop_ids=(), draft=drafters[name](), k=6)
    assert spec.token_ids == plain.token_ids


def test_prompt_lookup_accepts_a_lot_on_a_grounded_edit(ours, tokenizer):
    prompt = edit_ids(tokenizer)
    spec = generate(ours, tokenizer, prompt, 60, draft=PromptLookup(3), k=6)
    stats = spec.speculative
    assert stats.tokens_per_verify > 1.5 and 0 < stats.acceptance_rate <= 1
    assert len(spec.token_ids) <= 1 + stats.accepted + stats.verify_steps  # the first token, then accepted + 1 per verify


def test_stop_strings_and_streaming_behave_as_everywhere(ours, tokenizer):
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    stopped = generate(ours, tokenizer, prompt, 30, stop_strings=["France"], draft=PromptLookup(), k=4)
    assert stopped.stop_reason == "stop_string" and stopped.text == "The capital of "
    s = stream(ours, tokenizer, prompt, 30, draft=early_exit(ours, 6), k=3)
    assert "".join(s) == "The capital of France is Paris." and s.result.stop_reason == "end_of_turn"


def test_bad_draft_arguments_are_refused(ours, tokenizer):
    prompt = chat_ids(tokenizer, "Hi")
    with pytest.raises(ValueError, match="k"):
        generate(ours, tokenizer, prompt, 5, draft=PromptLookup(), k=0)
    with pytest.raises(TypeError, match="propose"):
        generate(ours, tokenizer, prompt, 5, draft="lookup")
    with pytest.raises(ValueError, match="layers"):
        early_exit(ours, 30)


def _draws(p, q, rule, n=20_000):
    """n outputs of the rule; each time the drafter first draws its guess from q (one-hot q: always the same)."""
    generator = torch.Generator().manual_seed(0)
    out = [rule(p, q, int(torch.multinomial(q, 1, generator=generator)), generator) for _ in range(n)]
    return torch.bincount(torch.tensor(out), minlength=p.numel())


def test_the_sampling_rule_keeps_the_models_distribution(real_logits):
    p = torch.softmax(real_logits[0].topk(12).values, -1)  # 12 real probabilities
    for q in (torch.nn.functional.one_hot(torch.tensor(3), 12).float(),  # a deterministic drafter
              torch.softmax(torch.linspace(1, -1, 12), -1)):  # a drafter with its own distribution
        assert _chi_square_p_value(_draws(p, q, accept_or_resample), p) > 1e-3


def test_a_wrong_rule_is_caught(real_logits):
    p = torch.softmax(real_logits[0].topk(12).values, -1)
    q = torch.nn.functional.one_hot(torch.tensor(3), 12).float()

    def wrong(p, q, drafted, generator):  # accept like the rule, but on rejection draw from p itself
        if torch.rand((), generator=generator) < min(1.0, float(p[drafted] / q[drafted])):
            return drafted
        return int(torch.multinomial(p, 1, generator=generator))

    assert _chi_square_p_value(_draws(p, q, wrong), p) < 1e-3


def _first_two(logits, draft, config, n, rule=None, monkeypatch=None, draft_probs=None):
    """n runs of sample_verified on fixed logits: counts of the first emitted token, and of the second given the
    first drafted token was accepted. draft: the drafted tokens, or a function drawing them anew for each run
    (with draft_probs, the distributions it draws from)."""
    from course_lib.engine import sampling as speculative  # the acceptance rules are picker rules (sampling.py)
    from course_lib.engine.sampling import make_sampler
    if rule is not None:
        monkeypatch.setattr(speculative, "accept_or_resample", rule)
    sampler = make_sampler(config, seed=0)
    first, second = torch.zeros(logits.shape[1]), torch.zeros(logits.shape[1])
    for _ in range(n):
        tokens = draft() if callable(draft) else draft
        accepted, bonus, _, _ = speculative.sample_verified(logits, tokens, sampler, draft_probs)
        out = accepted + [bonus]
        first[out[0]] += 1
        if accepted:
            second[out[1]] += 1
        sampler.seen.clear()
    return first, second


def test_speculative_sampling_keeps_each_tokens_distribution(real_logits):
    from course_lib.engine.sampling import SamplingConfig, logits_to_probs
    logits = real_logits[:, :].gather(1, real_logits[0].topk(16).indices.expand(3, 16))  # (3, 16): a real sub-vocabulary
    config = SamplingConfig(temperature=0.9, top_k=12)
    draft = [int(logits[0].argsort(descending=True)[1]), int(logits[1].argmax())]  # the second most likely, then the top
    first, second = _first_two(logits, draft, config, 12_000)
    for counts, row in ((first, 0), (second, 1)):
        p = logits_to_probs(logits[row], config)
        assert _chi_square_p_value(counts.long(), p) > 1e-3


def test_speculative_sampling_with_a_wrong_rule_is_caught(real_logits, monkeypatch):
    from course_lib.engine.sampling import SamplingConfig, logits_to_probs
    logits = real_logits[:, :].gather(1, real_logits[0].topk(16).indices.expand(3, 16))
    config = SamplingConfig(temperature=0.9, top_k=12)
    draft = [int(logits[0].argsort(descending=True)[1]), int(logits[1].argmax())]

    def wrong(p, q, drafted, generator):  # on rejection, draw from p itself (the drafted token can come back)
        if torch.rand((), generator=generator) < float(p[drafted]):
            return drafted
        return int(torch.multinomial(p, 1, generator=generator))

    first, _ = _first_two(logits, draft, config, 12_000, wrong, monkeypatch)
    assert _chi_square_p_value(first.long(), logits_to_probs(logits[0], config)) < 1e-3


def test_sampling_runs_in_the_loop_with_a_drafter(ours, tokenizer):
    from course_lib.engine.sampling import SamplingConfig, make_sampler
    prompt = edit_ids(tokenizer)
    greedy_run = generate(ours, tokenizer, prompt, 30)
    cold = generate(ours, tokenizer, prompt, 30, pick=make_sampler(SamplingConfig(temperature=0)), draft=PromptLookup(3))
    assert cold.token_ids == greedy_run.token_ids  # temperature 0 is greedy, drafted or not
    runs = [generate(ours, tokenizer, prompt, 30, pick=make_sampler(SamplingConfig(temperature=0.7), seed=s),
                     draft=PromptLookup(3)) for s in (1, 1, 2)]
    assert runs[0].token_ids == runs[1].token_ids  # seeded: repeatable
    assert all(r.speculative.accepted > 0 and r.stop_reason in ("end_of_turn", "max_new_tokens") for r in runs)
    with pytest.raises(ValueError, match="make_sampler"):
        generate(ours, tokenizer, prompt, 5, pick=lambda logits: (0, 1.0), draft=PromptLookup(3))


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_runs_on_the_library_model_too(tiny, tokenizer, k):
    """The library's DynamicCache rolls back by crop: prompt lookup and a model drafter (the library model drafting
    for itself) give plain greedy's tokens, and the step is the loop's own (no second loop)."""
    for prompt in (edit_ids(tokenizer), story_ids(tokenizer)):
        plain = generate(tiny, tokenizer, prompt, 24, stop_ids=())
        for drafter in (PromptLookup(2), ModelDrafter(tiny)):
            spec = generate(tiny, tokenizer, prompt, 24, stop_ids=(), draft=drafter, k=k)
            assert spec.token_ids == plain.token_ids
            assert spec.speculative.verify_steps < len(spec.token_ids)


def test_early_exit_needs_the_courses_model(tiny):
    with pytest.raises(TypeError, match="model.Model"):
        early_exit(tiny, 1)


def _sub_vocabulary(real_logits, rows=3, size=16):
    idx = real_logits[0].topk(size).indices.expand(rows, size)
    target = real_logits[:rows].gather(1, idx)  # (rows, 16) real logits
    drafter = target + torch.linspace(1.5, -1.5, size)  # a drafter that leans towards the first few tokens
    return target, drafter


def _sampled_runs(target, drafter, config, n, pass_q=True):
    """n verify steps of two drafted tokens, each drafted from the drafter's own distribution (as ModelDrafter
    does for a sampling model): _first_two's counts."""
    from course_lib.engine.sampling import logits_to_probs
    g = torch.Generator().manual_seed(1)
    qs = [logits_to_probs(drafter[i], config) for i in range(2)]
    return _first_two(target, lambda: [int(torch.multinomial(q, 1, generator=g)) for q in qs], config, n,
                      draft_probs=qs if pass_q else None)


def test_sampled_drafts_keep_each_tokens_distribution(real_logits):
    from course_lib.engine.sampling import SamplingConfig, logits_to_probs
    target, drafter = _sub_vocabulary(real_logits)
    config = SamplingConfig(temperature=1.0)
    first, second = _sampled_runs(target, drafter, config, 12_000)
    for counts, row in ((first, 0), (second, 1)):
        assert _chi_square_p_value(counts.long(), logits_to_probs(target[row], config)) > 1e-3


def test_sampled_drafts_with_a_wrong_resample_are_caught(real_logits, monkeypatch):
    """Accepted with min(1, p/q) as it should, but a rejection draws from p itself instead of max(0, p - q)."""
    from course_lib.engine import sampling
    from course_lib.engine.sampling import SamplingConfig, logits_to_probs

    def wrong(p, q, drafted, generator):
        if torch.rand((), generator=generator) < min(1.0, float(p[drafted] / q[drafted])):
            return drafted
        return int(torch.multinomial(p, 1, generator=generator))

    monkeypatch.setattr(sampling, "accept_or_resample", wrong)
    target, drafter = _sub_vocabulary(real_logits)
    config = SamplingConfig(temperature=1.0)
    first, _ = _sampled_runs(target, drafter, config, 12_000)
    assert _chi_square_p_value(first.long(), logits_to_probs(target[0], config)) < 1e-3


def test_sampled_drafts_judged_as_one_hot_keep_p_but_accept_less(real_logits):
    """A draft drawn from q and judged as if q were one-hot (accepted with p(x)) still gives p: the rule holds for
    any proposal, given the drawn token. It only accepts less: sum of q p, against sum of min(p, q)."""
    from course_lib.engine.sampling import SamplingConfig, logits_to_probs
    from course_lib.engine.speculative import acceptance
    target, drafter = _sub_vocabulary(real_logits)
    config = SamplingConfig(temperature=1.0)
    first, _ = _sampled_runs(target, drafter, config, 12_000, pass_q=False)
    p, q = logits_to_probs(target[0], config), logits_to_probs(drafter[0], config)
    assert _chi_square_p_value(first.long(), p) > 1e-3
    assert float((p * q).sum()) < acceptance(p, q)


def test_acceptance_is_one_minus_total_variation(real_logits):
    from course_lib.engine.speculative import acceptance
    target, drafter = _sub_vocabulary(real_logits)
    p, q = torch.softmax(target[0], -1), torch.softmax(drafter[0], -1)
    assert acceptance(p, q) == pytest.approx(1 - 0.5 * float((p - q).abs().sum()), abs=1e-6)
    assert acceptance(p, p) == pytest.approx(1.0)
    one_hot = torch.nn.functional.one_hot(q.argmax(), 16).float()
    assert acceptance(p, one_hot) == pytest.approx(float(p[q.argmax()]))
    g = torch.Generator().manual_seed(3)
    n = 20_000  # the rule's acceptance test, min(1, p/q) on x drawn from q, counted directly
    accepted = sum(float(torch.rand((), generator=g)) < min(1.0, float(p[x] / q[x]))
                   for x in torch.multinomial(q, n, replacement=True, generator=g).tolist())
    sigma = (acceptance(p, q) * (1 - acceptance(p, q)) / n) ** 0.5
    assert abs(accepted / n - acceptance(p, q)) < 4 * sigma


def test_a_model_drafter_samples_when_the_model_samples(tiny, tokenizer):
    from course_lib.engine.sampling import SamplingConfig, make_sampler
    prompt = story_ids(tokenizer)
    drafter = ModelDrafter(tiny)
    run = generate(tiny, tokenizer, prompt, 12, stop_ids=(), pick=make_sampler(SamplingConfig(temperature=1.0), seed=4),
                   draft=drafter, k=3)
    assert drafter.sampler is not None and drafter.probs is not None and len(drafter.probs) == 3
    assert all(float(q.sum()) == pytest.approx(1.0, abs=1e-4) for q in drafter.probs)
    assert run.speculative.verify_steps > 0
    greedy_drafter = ModelDrafter(tiny)
    generate(tiny, tokenizer, prompt, 6, stop_ids=(), draft=greedy_drafter, k=3)
    assert greedy_drafter.sampler is None and greedy_drafter.probs is None
    fixed = ModelDrafter(tiny, sample=False)
    generate(tiny, tokenizer, prompt, 6, stop_ids=(), pick=make_sampler(SamplingConfig(temperature=1.0), seed=4),
             draft=fixed, k=3)
    assert fixed.probs is None  # greedy drafts under a sampling model: q one-hot


def test_the_last_verify_counts_too(ours, tokenizer):
    """The model drafting for itself is accepted (nearly) always, the verify that ends the request included:
    accepted tokens are counted as they are emitted."""
    r = generate(ours, tokenizer, edit_ids(tokenizer), 20, stop_ids=(), draft=ModelDrafter(ours), k=4)
    s = r.speculative
    assert s.accepted == len(s.accepted_at)
    assert s.acceptance_rate > 0.95 and s.drafted <= 20


def test_drafted_tokens_record_the_models_probability(ours, tokenizer):
    """A drafted step records the model's probability of its token, as plain decoding does (it was 1.0)."""
    prompt = edit_ids(tokenizer)
    plain = generate(ours, tokenizer, prompt, 24, stop_ids=())
    spec = generate(ours, tokenizer, prompt, 24, stop_ids=(), draft=PromptLookup(3), k=4)
    assert spec.token_ids == plain.token_ids and spec.speculative.accepted > 0
    for a, b in zip(plain.steps, spec.steps):
        assert a.prob == pytest.approx(b.prob, abs=1e-4)


def _pair_counts(small, flatter, tokenizer, prompt, config, n, drafter_seed):
    """(first, second) token of n seeded runs through generate with a drafter, k = 1: the second is the verify
    pass's. drafter_seed None: derived from each run's seed (the default); an int: the same in all runs."""
    from collections import Counter
    pairs = Counter()
    for seed in range(n):
        drafter = ModelDrafter(flatter, seed=drafter_seed)
        r = generate(small, tokenizer, prompt, 2, stop_ids=(), pick=make_sampler(config, seed=seed), draft=drafter, k=1)
        pairs[tuple(r.token_ids)] += 1
    return pairs


def test_sampled_speculation_end_to_end_keeps_the_pairs_distribution(tiny, tokenizer):
    """Through generate, over many seeded runs: the first two tokens (the second drafted and judged) follow plain
    sampling's P(t1) P(t2 | t1), computed from the model. The drafter is the model with its logits scaled by 0.6,
    so its q shares p's support and differs from it. A drafter seeded alike in every run would draft the same
    token after the same t1 in all of them and skew the second token: that is caught."""
    import copy

    from course_lib.runner.forward import forward_logits
    small = Model.from_transformers(tiny)
    flat = copy.deepcopy(tiny)
    with torch.no_grad():
        flat.model.norm.weight.mul_(0.6)  # logits x 0.6: the same top 4 in the same order, flatter (q != p, same support)
    flatter = Model.from_transformers(flat)
    prompt = chat_ids(tokenizer, "Hi")
    config = SamplingConfig(temperature=1.0, top_k=4)
    p1 = logits_to_probs(forward_logits(small, prompt)[0, -1], config)
    support = p1.nonzero().flatten().tolist()
    exact = {}
    for t1 in support:
        p2 = logits_to_probs(forward_logits(small, prompt + [t1])[0, -1], config)
        exact.update({(t1, t2): float(p1[t1] * p2[t2]) for t2 in p2.nonzero().flatten().tolist()})
    keys = sorted(exact)
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)

    def p_value(pairs):
        assert set(pairs) <= set(keys)  # nothing outside the filters' support
        return _chi_square_p_value(torch.tensor([pairs[k] for k in keys], dtype=torch.float64), probs)

    right, fixed = (p_value(_pair_counts(small, flatter, tokenizer, prompt, config, 600, seed)) for seed in (None, 0))
    print(f"p-values: drafter seeded per run {right:.3g}, seeded alike {fixed:.3g}")
    assert right > 1e-3 and fixed < 1e-3
