"""Lesson 15: with the mask the answer is valid for its schema, every time; bad schemas are refused early."""
import json
from pathlib import Path

import jsonschema
import pytest

from course_lib.text.context import chat_ids
from course_lib.engine.generation import generate
from course_lib.engine.sampling import SamplingConfig, make_sampler
from course_lib.engine.structured import (ChoiceMask, MaskLog, PatternMask, SchemaError, SchemaMask, generate_json,
                                          masked_pick)

RECEIPTS = json.loads((Path(__file__).resolve().parents[1] / "data" / "receipts.json").read_text())["receipts"]
RECEIPT = {"type": "object", "additionalProperties": False, "required": ["name", "date", "amount"],
           "properties": {"name": {"type": "string", "maxLength": 40}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                          "amount": {"type": "number", "minimum": 0}}}
SCHEMAS = {
    "receipt": RECEIPT,
    "nested": {"type": "object", "required": ["person", "items"], "additionalProperties": False, "properties": {
        "person": {"type": "object", "required": ["name"], "additionalProperties": False,
                   "properties": {"name": {"type": "string", "maxLength": 40}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 30}}}},
    "enum_and_bounds": {"type": "object", "required": ["currency", "rating"], "additionalProperties": False, "properties": {
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY", "SEK"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}}},
}


# note: every string has a maxLength: a small model can otherwise write one string until the token limit
# (seen here with an unbounded array of strings), which no mask can turn into a finished answer.


def ask(receipt):
    return [{"role": "user", "content": "Extract the name, the date (YYYY-MM-DD) and the amount as JSON: " + receipt["text"]}]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_constrained_output_validates(model, tokenizer, name):
    for receipt in RECEIPTS[:3]:
        r = generate_json(model, tokenizer, ask(receipt), SCHEMAS[name], 96)
        assert r.complete and r.stop_reason == "end_of_turn", r.text
        jsonschema.validate(r.value, SCHEMAS[name])
        assert json.loads(r.text) == r.value and "  " not in r.text and "\n" not in r.text  # compact whitespace


def test_sampled_constrained_output_validates_too(model, tokenizer):
    pick = make_sampler(SamplingConfig(temperature=1.0), seed=3)
    r = generate_json(model, tokenizer, ask(RECEIPTS[3]), RECEIPT, 96, pick=pick)
    assert r.complete
    jsonschema.validate(r.value, RECEIPT)


def test_a_limit_inside_the_value_is_reported_not_returned_as_json(model, tokenizer):
    r = generate_json(model, tokenizer, ask(RECEIPTS[0]), RECEIPT, 5)
    assert not r.complete and r.value is None and r.stop_reason == "max_new_tokens"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


@pytest.mark.parametrize("schema", [{"type": "nope"}, "{not json", {"type": "object", "properties": {"a": {"$ref": "#/x"}}}])
def test_bad_schemas_fail_before_generation(tokenizer, schema):
    with pytest.raises(SchemaError, match="compiled"):
        SchemaMask(tokenizer, schema)


def test_the_hand_masks(model, tokenizer):
    log = MaskLog()
    yes_no = generate(model, tokenizer, chat_ids(tokenizer, "Is Paris the capital of France? Answer yes or no."), 5,
                      pick=masked_pick(ChoiceMask(tokenizer, 2, ["yes", "no"]), log=log))
    assert yes_no.text in ("yes", "no") and yes_no.stop_reason == "end_of_turn"
    assert log.allowed[-1] == 1 and 0 <= log.removed_mass[0] <= 1  # at the end only the end-of-turn token remains
    date = generate(model, tokenizer, chat_ids(tokenizer, "When did the Berlin Wall fall? Answer as YYYY-MM-DD."), 12,
                    pick=masked_pick(PatternMask(tokenizer, 2, "9999-99-99")))
    assert len(date.text) == 10 and date.text[4] == date.text[7] == "-" and date.text.replace("-", "").isdigit()


def test_pattern_and_choice_rules(tokenizer):
    m = PatternMask(tokenizer, 2, "9+")
    assert m.is_prefix("12") and not m.is_prefix("1a") and m.is_complete("7") and not m.is_complete("")
    c = ChoiceMask(tokenizer, 2, ["yes", "no"])
    assert c.is_prefix("ye") and not c.is_prefix("yo") and c.is_complete("no") and not c.is_complete("n")
    with pytest.raises(ValueError, match="choices"):
        ChoiceMask(tokenizer, 2, [])


@pytest.mark.parametrize("answer", ["日本", "café", "🙂 ok"])
def test_a_choice_mask_allows_a_non_ascii_answer_token_by_token(tokenizer, answer):
    """Masks work on bytes: an answer whose characters the tokenizer splits across tokens (each fragment's text
    alone is U+FFFD) is still allowed at every step, and the end only once it is whole."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    mask = ChoiceMask(tokenizer, 2, [answer, "no"])
    for i, t in enumerate(ids):
        allowed = mask.allowed()
        assert allowed[t], (answer, i, tokenizer.decode([t]))
        assert not allowed[2]  # not finished yet
        mask.consume(t)
    assert mask.allowed()[2] and mask.text == answer


def test_some_answer_above_is_split_inside_a_character(tokenizer):
    """The test above can fail a mask that works on decoded strings: at least one of its answers has a token that
    decodes to U+FFFD alone."""
    pieces = [tokenizer.decode([t]) for a in ["日本", "café", "🙂 ok"] for t in tokenizer(a, add_special_tokens=False)["input_ids"]]
    assert any("\ufffd" in p for p in pieces)


def _walk(mask, rng, end_id: int, limit: int = 80) -> list[int]:
    """A random path through the mask: a token drawn uniformly from what it allows, until the end token is drawn
    (each step that allows it draws it with probability one half) or `limit` tokens."""
    path = []
    for _ in range(limit):
        allowed = mask.allowed().nonzero().flatten().tolist()
        assert allowed, f"the mask allows nothing after {path}"  # a dead end: the mask let the output go astray
        if end_id in allowed and (rng.random() < 0.5 or allowed == [end_id]):
            return path + [end_id]
        token = rng.choice([t for t in allowed if t != end_id])
        mask.consume(token)
        path.append(token)
    return path


def test_choice_mask_by_exhaustive_search(tokenizer):
    """Every path the mask allows, searched exhaustively, spells one of the choices (sound), and every way the
    tokenizer's own pieces can spell a choice is among them (complete)."""
    import copy
    choices = ["yes", "no", "Paris", "東京"]
    ends, stack = set(), [(ChoiceMask(tokenizer, 2, choices), [])]
    while stack:
        mask, path = stack.pop()
        allowed = mask.allowed().nonzero().flatten().tolist()
        assert allowed, f"dead end after {path}"
        for token in allowed:
            if token == 2:
                ends.add(tuple(path))
                continue
            nxt = copy.deepcopy(mask)
            nxt.consume(token)
            stack.append((nxt, path + [token]))
    spelled = {bytes(b"".join(ChoiceMask(tokenizer, 2, choices).pieces[t] for t in p)).decode() for p in ends}
    assert spelled == set(choices)
    for choice in choices:
        assert tuple(tokenizer(choice, add_special_tokens=False)["input_ids"]) in ends


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_mask_random_walks_always_end_valid(tokenizer, name):
    """Sound by sampling: 40 random walks through the grammar's mask, each token drawn uniformly among those it
    allows, all end in JSON that validates; and complete on examples: a valid compact instance tokenized by the
    tokenizer is allowed token by token."""
    import random
    rng = random.Random(0)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    finished = 0
    for _ in range(40):
        mask = SchemaMask(tokenizer, SCHEMAS[name])
        path = _walk(mask, rng, end)
        if path and path[-1] == end:
            finished += 1
            text = tokenizer.decode(path[:-1])
            jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert finished >= 10  # most walks reach an end within the limit
    example = {"receipt": {"name": "Ana", "date": "2024-05-01", "amount": 12.5},
               "nested": {"person": {"name": "Bo"}, "items": ["tea", "cake"]},
               "enum_and_bounds": {"currency": "SEK", "rating": 4}}[name]
    mask = SchemaMask(tokenizer, SCHEMAS[name])
    for token in tokenizer(json.dumps(example, separators=(",", ":")), add_special_tokens=False)["input_ids"]:
        assert mask.allowed()[token]
        mask.consume(token)
    assert mask.complete and mask.allowed()[end]
