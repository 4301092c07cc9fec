"""Bad input gets a clear error from the function that owns the argument, before any forward pass."""
import pytest
import torch

from course_lib.text.context import budget_report, fit_to_budget
from course_lib.engine.text_out import IncrementalDecoder
from course_lib.engine.request import check_stop_strings
from course_lib.engine.generation import generate, stream
from course_lib.views.html_views import token_chips
from course_lib.engine.sampling import (SamplingConfig, apply_temperature, greedy, make_sampler, min_p_filter,
                                        repetition_penalty, top_k_filter, top_p_filter)
from course_lib.text.tokenization import model_tokens, tokens_of

from conftest import chat_ids

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0])


class NoForward:
    """The real model's config, but any forward pass fails the test: checks must come first."""

    def __init__(self, model):
        self.config, self.device, self.generation_config = model.config, model.device, model.generation_config

    def __call__(self, **_):
        raise AssertionError("the model was called before the bad argument was refused")


@pytest.mark.parametrize("prompt, error, words", [
    ("12", TypeError, "tokenize"), (b"12", TypeError, "tokenize"),
    (torch.tensor([[1, 2], [3, 4]]), ValueError, "batching"), ([1, 2, 99_999], ValueError, "vocabulary"),
    ([5, -1], ValueError, "vocabulary"), ([[1, 2]], ValueError, "flat list"), (torch.tensor([1.5, 2.0]), ValueError, "integers"),
])
def test_bad_prompts_are_refused_before_the_model_runs(model, tokenizer, prompt, error, words):
    with pytest.raises(error, match=words):
        generate(NoForward(model), tokenizer, prompt, 5)
    with pytest.raises(error, match=words):
        stream(NoForward(model), tokenizer, prompt, 5)  # raises at the call, not at the first piece


def test_good_prompt_shapes_are_accepted(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    want = generate(model, tokenizer, ids, 4).token_ids
    assert generate(model, tokenizer, torch.tensor(ids), 4).token_ids == want
    assert generate(model, tokenizer, torch.tensor([ids]), 4).token_ids == want


@pytest.mark.parametrize("stops, error", [("Paris", TypeError), ([""], ValueError), ([3], ValueError),
                                          (["ok", None], ValueError), (5, TypeError)])
def test_bad_stop_strings_are_refused_before_the_model_runs(model, tokenizer, stops, error):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    with pytest.raises(error, match="stop"):
        generate(NoForward(model), tokenizer, ids, 5, stop_strings=stops)
    assert check_stop_strings(["a", "bc"]) == ("a", "bc") and check_stop_strings(None) == ()


@pytest.mark.parametrize("call, words", [
    (lambda: top_p_filter(LOGITS, 0), "top_p"), (lambda: top_p_filter(LOGITS, 1.5), "top_p"),
    (lambda: min_p_filter(LOGITS, 2), "min_p"), (lambda: top_k_filter(LOGITS, -3), "top_k"),
    (lambda: top_k_filter(LOGITS, 2.5), "top_k"), (lambda: apply_temperature(LOGITS, True), "temperature"),
    (lambda: apply_temperature(LOGITS, -1), "temperature"), (lambda: apply_temperature(LOGITS, float("nan")), "temperature"),
    (lambda: repetition_penalty(LOGITS, [0], 0), "repetition_penalty"),
    (lambda: SamplingConfig(temperature=True), "temperature"), (lambda: SamplingConfig(top_p=0), "top_p"),
])
def test_every_filter_checks_its_own_argument(call, words):
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.parametrize("bad", [torch.tensor([0.0, float("nan")]), torch.tensor([float("-inf")] * 3),
                                 torch.tensor([1.0, float("inf")])])
def test_no_picker_returns_a_token_from_unusable_logits(bad):
    with pytest.raises(ValueError, match="logits"):
        greedy(bad)
    with pytest.raises(ValueError, match="logits"):
        make_sampler(SamplingConfig(temperature=0.7), seed=0)(bad)


def test_pickers_return_the_token_and_its_probability():
    token, prob = greedy(LOGITS)
    assert token == 0 and prob == pytest.approx(float(torch.softmax(LOGITS, -1)[0]))
    token, prob = make_sampler(SamplingConfig(temperature=1.0, top_k=1), seed=0)(LOGITS)
    assert token == 0 and prob == pytest.approx(1.0)  # the probability in the distribution it drew from


def test_incremental_decoder_decodes_a_short_window_and_joins_exactly(tokenizer):
    text = ("Crème brûlée à Paris, 東京タワー 👨‍👩‍👧! " * 60) + "naïve café 你好"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    longest = []

    class Spy:
        def decode(self, window, **kw):
            longest.append(len(window))
            return tokenizer.decode(window, **kw)

    decoder = IncrementalDecoder(Spy())
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) and not any("\ufffd" in p for p in pieces)
    assert len(ids) > 1000 and max(longest) <= 12  # constant work per token, not the whole answer


def test_stop_string_found_across_pieces(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    r = generate(model, tokenizer, ids, 30, stop_strings=["of Fr"])
    assert r.stop_reason == "stop_string" and r.text == "The capital "  # "France" is one token; "of Fr" is cut


def test_tokens_of_refuses_ids_outside_the_vocabulary(tokenizer):
    with pytest.raises(ValueError, match="vocabulary"):
        tokens_of(tokenizer, [1, 10**6])
    assert [t.id for t in tokens_of(tokenizer, torch.tensor([504, 3575]))] == [504, 3575]


def test_a_pasted_book_draws_a_bounded_number_of_chips(tokenizer):
    tokens = model_tokens(tokenizer, "The bank is closed because they had no money left. " * 4000)
    html = token_chips(tokens, f"{len(tokens)} tokens")
    assert len(tokens) > 40_000 and f"{len(tokens) - 2000:,} more tokens" in html
    assert len(html) < 1_000_000  # was about 76 MB for 200,000 characters


@pytest.mark.parametrize("budget", [True, 0, -5, 2.5])
def test_budget_must_be_a_positive_int(tokenizer, budget):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="budget"):
        fit_to_budget(tokenizer, messages, budget)
    with pytest.raises(ValueError, match="budget"):
        budget_report(tokenizer, messages, budget)


def test_hold_back_never_sends_a_stop_string_whatever_the_pieces():
    """Every way of cutting a text into pieces: the pieces sent join to the text before the first stop string."""
    import random
    from course_lib.engine.text_out import HoldBack, cut_at_stop
    rng = random.Random(0)
    for text, stops in [("The capital of France is Paris.", ["of Fr", "is"]), ("aaab", ["ab"]), ("xyz", ["q"]),
                        ("stop at the end.", ["end."]), ("ab", ["abc"]), ("", ["a"]), ("a..b", [".", ".."])]:
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1)))) if len(text) > 1 else []
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            hold = HoldBack(stops)
            sent = [hold.push(p) for p in pieces] + [hold.flush()]
            assert "".join(sent) == cut_at_stop(text, stops), (text, pieces, sent)
            assert not any(s in "".join(sent) for s in stops)
    assert HoldBack().push("abc") == "abc"  # no stop strings: nothing held
