"""Solutions for 15_structured_output."""
from course_lib.engine.structured import token_texts

model = tokenizer = None


def yes_no_allowed(text_so_far):
    texts = token_texts(tokenizer)
    answers = ["yes", "no"]
    ids = [i for i, t in enumerate(texts) if t and any(a.startswith(text_so_far + t) for a in answers)]
    return ids + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if text_so_far in answers else [])


def allowed_after_age():
    return ["4", "-"]


def city_schema():
    return {"type": "object", "additionalProperties": False, "required": ["city", "population"],
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}}}


def inside_string_prediction():
    """Inside a string nearly every token is allowed: those without a quote or a control character, roughly."""
    from course_lib.engine.structured import token_texts
    texts = token_texts(tokenizer)
    return sum(1 for t in texts if '"' not in t and "\\" not in t and all(ord(c) >= 32 for c in t))
