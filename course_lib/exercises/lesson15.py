"""Checks for 15_structured_output: a yes/no mask by hand, what may follow {"age":, and a schema of your own."""
from __future__ import annotations

import json

from ..engine.structured import ChoiceMask, SchemaMask, generate_json
from . import check_prediction, safely, verdict

AGE_SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}}
CANDIDATES = [" 4", "4", "-", '"4"', "}"]


def check_yes_no(yes_no_allowed, tokenizer) -> bool:
    """yes_no_allowed(text_so_far) -> token IDs allowed next for the language {"yes", "no"}."""
    for text in ["", "y", "ye", "yes", "n", "no"]:
        ok, got = safely(yes_no_allowed, text)
        if not ok:
            return verdict(False, "", got)
        mask = ChoiceMask(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"), ["yes", "no"])
        mask.text = text
        want = set(mask.allowed().nonzero().flatten().tolist())
        if set(got or []) != want:
            return verdict(False, "", f"after {text!r} you allowed {len(set(got or []))} tokens, the rule allows {len(want)}. "
                           "Hint: token t is allowed if text + texts[t] starts one of the answers; the end-of-turn ID (END) only if text is one")
    return verdict(True, "your mask matches course_lib's ChoiceMask at every step", "")


def allowed_after(tokenizer, prefix: str = '{"age":') -> list[str]:
    """Which CANDIDATES the JSON engine allows after `prefix` (compact whitespace), by their first token."""
    mask = SchemaMask(tokenizer, AGE_SCHEMA)
    for t in tokenizer(prefix, add_special_tokens=False)["input_ids"]:
        mask.consume(t)
    allowed = mask.allowed()
    return [c for c in CANDIDATES if bool(allowed[tokenizer(c, add_special_tokens=False)["input_ids"][0]])]


def check_after_age(allowed_after_age, tokenizer) -> bool:
    ok, got = safely(allowed_after_age)
    if not ok:
        return verdict(False, "", got)
    want = allowed_after(tokenizer)
    if sorted(got or []) != sorted(want):
        return verdict(False, "", f"you said {got!r}. Hint: an integer must start here, with no space in compact JSON "
                       "(a digit or a minus sign); a string or a closing brace cannot")
    return verdict(True, f"the engine allows exactly {want}", "")


QUESTION = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]


def check_city_schema(city_schema, model, tokenizer) -> bool:
    import jsonschema
    ok, schema = safely(city_schema)
    if not ok:
        return verdict(False, "", schema)
    props = (schema or {}).get("properties", {})
    if set(props) != {"city", "population"} or schema.get("additionalProperties") is not False \
            or set(schema.get("required", [])) != {"city", "population"}:
        return verdict(False, "", "the schema needs exactly the properties city and population, both required, and "
                       "additionalProperties: false")
    if props["city"].get("maxLength") != 20 or props["population"].get("type") != "integer" \
            or props["population"].get("minimum") != 0 or props["population"].get("maximum") != 100_000_000:
        return verdict(False, "", "city needs maxLength 20; population type integer, minimum 0, maximum 100000000")
    r = generate_json(model, tokenizer, QUESTION, schema, 48)
    if not r.complete:
        return verdict(False, "", f"the answer did not finish within 48 tokens: {r.text!r}")
    jsonschema.validate(r.value, schema)
    unbounded = json.loads(json.dumps(schema))
    del unbounded["properties"]["population"]["maximum"]
    loose = generate_json(model, tokenizer, QUESTION, unbounded, 48)
    print(f"the same request with no maximum on population: {loose.text!r} (complete: {loose.complete})")
    return verdict(True, f"the model answered {r.text}, valid for your schema", "")


def check_inside_string_prediction(prediction, tokenizer, schema: dict, prefix: str = '{"name":"') -> bool:
    """prediction: your prediction, written BEFORE this runs, of how many of the vocabulary's tokens the schema's
    mask allows right after `prefix` (inside the name's string). The check feeds the prefix and counts."""
    def measure():
        mask = SchemaMask(tokenizer, schema)
        for token in tokenizer(prefix, add_special_tokens=False)["input_ids"]:
            mask.consume(token)
        return int(mask.allowed().sum())
    return check_prediction(prediction, measure, unit="tokens", what=f"allowed after {prefix}", tolerance=2.0,
                            hint="Inside a string almost anything may come next: only tokens that would break the "
                                 "string (a bare quote in the wrong place, control characters) or overrun its "
                                 "maxLength are masked")
