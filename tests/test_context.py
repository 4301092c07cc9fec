import json
from pathlib import Path

import pytest

from course_lib.context import (ContextOverflowError, budget_report, context_ids, fit_to_budget, render, segments,
                                validate_messages)

CONV = json.loads((Path(__file__).resolve().parents[1] / "data" / "conversation.json").read_text())["messages"]
SHORT = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("messages", [SHORT, SHORT[1:], CONV, CONV[1:], CONV[:3]], ids=range(5))
@pytest.mark.parametrize("gen", [True, False])
def test_segments_concatenate_to_the_context(tokenizer, messages, gen):
    segs = segments(tokenizer, messages, add_generation_prompt=gen)
    assert sum((s.ids for s in segs), []) == context_ids(tokenizer, messages, add_generation_prompt=gen)
    assert "".join(s.text for s in segs) == render(tokenizer, messages, add_generation_prompt=gen)
    assert (segs[-1].label == "generation prompt") == gen


def test_default_system_prompt_is_labelled(tokenizer):
    labels = [s.label for s in segments(tokenizer, SHORT[1:])]
    assert labels == ["default system prompt", "user", "generation prompt"]


def test_generation_prompt_is_the_assistant_header(tokenizer):
    assert segments(tokenizer, SHORT)[-1].text == "<|im_start|>assistant\n"


def test_budget_report(tokenizer):
    report = budget_report(tokenizer, CONV, 256)
    assert report.used == len(context_ids(tokenizer, CONV)) > 256
    assert not report.fits and report.remaining == 256 - report.used
    assert [label for label, _ in report.parts][:3] == ["system", "user", "assistant"]


@pytest.mark.parametrize("strategy", ["drop_oldest", "truncate_middle"])
@pytest.mark.parametrize("budget", [100, 180, 256, 300])
def test_strategies_fit_and_keep_system_and_last(tokenizer, strategy, budget):
    fit = fit_to_budget(tokenizer, CONV, budget, strategy)
    assert fit.tokens == len(context_ids(tokenizer, fit.messages)) <= budget
    assert fit.messages[0] == CONV[0] and fit.messages[-1] == CONV[-1]
    assert all(fit.messages[1:][i]["role"] != fit.messages[1:][i + 1]["role"] for i in range(len(fit.messages) - 2))


def test_drop_oldest_drops_the_fact_and_truncate_middle_keeps_it(tokenizer):
    assert 1 in fit_to_budget(tokenizer, CONV, 256, "drop_oldest").dropped
    kept = fit_to_budget(tokenizer, CONV, 256, "truncate_middle").messages
    assert CONV[1] in kept and CONV[2] in kept


def test_fitting_conversation_is_untouched(tokenizer):
    fit = fit_to_budget(tokenizer, CONV, 8192, "refuse")
    assert fit.messages == CONV and fit.dropped == []


def test_refuse_raises(tokenizer):
    with pytest.raises(ContextOverflowError, match="budget is 256"):
        fit_to_budget(tokenizer, CONV, 256, "refuse")


def test_budget_smaller_than_system_prompt(tokenizer):
    with pytest.raises(ContextOverflowError, match="system prompt alone"):
        fit_to_budget(tokenizer, CONV, 10)


@pytest.mark.parametrize("bad, error, message", [
    ([], ValueError, "non-empty"),
    ("hello", ValueError, "non-empty"),
    ([{"role": "wizard", "content": "hi"}], ValueError, "unknown role"),
    ([{"role": "user", "content": 42}], TypeError, "must be text"),
    ([{"role": "user", "content": None}], TypeError, "must be text"),
    ([{"content": "no role"}], ValueError, "'role' and 'content'"),
    (["just a string"], ValueError, "'role' and 'content'"),
])
def test_bad_messages(tokenizer, bad, error, message):
    with pytest.raises(error, match=message):
        validate_messages(bad)
    with pytest.raises(error, match=message):
        context_ids(tokenizer, bad)


def test_bad_strategy_and_budget(tokenizer):
    with pytest.raises(ValueError, match="unknown strategy"):
        fit_to_budget(tokenizer, SHORT, 100, "summarise")
    with pytest.raises(ValueError, match="positive"):
        fit_to_budget(tokenizer, SHORT, 0)
