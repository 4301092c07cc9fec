"""The bench's `structured` section (lesson 15): free against constrained JSON on the course's receipts.

What it does: the share of answers that parse and validate, free and with the JSON Schema mask, and the mask's
milliseconds per token against a decode step's; with its targets.
What it does not do: build masks (structured.py does).
"""
from __future__ import annotations

import json

from .section import Section
from ..runtime import median


def structured_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 15: the receipts of data/receipts.json asked free and with the JSON Schema mask: the share that
    parse and validate; milliseconds per token of the engine's mask, of the hand-written mask, and of a
    decode step (medians)."""
    import jsonschema
    from ..text.context import chat_ids
    from ..engine.generation import generate
    from ..engine.structured import (ChoiceMask, MaskLog, generate_json, masked_pick, RECEIPT_SCHEMA,
                                     receipt_request, receipts)
    items = receipts()[:2] if quick else receipts()
    valid_free = valid_constrained = 0
    mask_s, decode_s = [], []
    for r in items:
        messages = receipt_request(r["text"])
        free = generate(model, tokenizer, chat_ids(tokenizer, messages[0]["content"]), 80)
        decode_s += free.inter_token_seconds
        inner = free.text[free.text.find("{"):free.text.rfind("}") + 1]  # generous: prose around the object is cut
        try:
            jsonschema.validate(json.loads(inner), RECEIPT_SCHEMA)
            valid_free += 1
        except (ValueError, jsonschema.ValidationError):
            pass
        constrained = generate_json(model, tokenizer, messages, RECEIPT_SCHEMA, 96)
        mask_s += constrained.mask.seconds[1:]  # note: the first mask includes compiling the grammar's lexer
        try:
            jsonschema.validate(constrained.value, RECEIPT_SCHEMA)
            valid_constrained += constrained.complete
        except jsonschema.ValidationError:
            pass
    log = MaskLog()
    generate(model, tokenizer, chat_ids(tokenizer, "Is Paris the capital of France? Answer yes or no."), 4,
             pick=masked_pick(ChoiceMask(tokenizer, 2, ["yes", "no"]), log=log))
    return {"requests": len(items), "valid_free": valid_free / len(items), "valid_constrained": valid_constrained / len(items),
            "mask_ms_per_token": 1000 * median(mask_s), "hand_mask_ms_per_token": 1000 * median(log.seconds),
            "decode_ms_per_token": 1000 * median(decode_s)}


def _targets(result: dict) -> list:
    out = []
    st = result["structured"]
    out.append(("structured: every constrained answer valid", f"{st['valid_constrained']:.0%} (free: {st['valid_free']:.0%})",
                st["valid_constrained"] == 1.0))
    out.append(("structured: the engine's mask under a tenth of a decode step",
                f"{st['mask_ms_per_token']:.2f} vs {st['decode_ms_per_token']:.1f} ms", st["mask_ms_per_token"] < st["decode_ms_per_token"] / 10))
    return out


SECTION = Section("structured", "lesson 15: structured output",
                  lambda m, t, q: {"structured": structured_section(m, t, q)}, _targets)
