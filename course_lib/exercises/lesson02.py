"""Checks for 02_context_assembly: count a context, measure template overhead, keep what fits, rescue a fact."""
from __future__ import annotations

import json
from pathlib import Path

from ..context import ContextOverflowError, context_ids, fit_to_budget
from ..generation import generate
from . import safely, verdict

CONVERSATION = Path(__file__).resolve().parents[2] / "data" / "conversation.json"
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c 👍"}],
]


def load_conversation() -> dict:
    return json.loads(CONVERSATION.read_text())


def check_count_context(count_context, tokenizer) -> bool:
    """count_context(messages) -> tokens the model reads, with the generation prompt."""
    for chat in CHATS:
        ok, got = safely(count_context, chat)
        if not ok:
            return verdict(False, "", got)
        want = len(context_ids(tokenizer, chat))
        if got != want:
            return verdict(False, "", f"for {chat} you returned {got!r}, the model reads {want} tokens. Hint: "
                           "apply_chat_template(..., add_generation_prompt=True, return_dict=True)['input_ids']")
    return verdict(True, "you count what the model reads, template and generation prompt included", "")


def check_overhead(answer, tokenizer) -> bool:
    """answer: tokens the template adds around the one-token message 'Hi' with system prompt 'Be brief.'
    (everything except the text tokens of 'Be brief.' and 'Hi'), generation prompt included."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in chat)
    want = len(context_ids(tokenizer, chat)) - text
    return verdict(answer == want, f"{want} tokens of template for {text} tokens of text",
                   f"you said {answer!r}. Count the whole context, then subtract the tokens of the two texts")


def check_keep_recent(keep_recent, tokenizer) -> bool:
    """keep_recent(messages, budget) -> the system message plus the most recent messages that fit."""
    messages = load_conversation()["messages"]
    for budget in (120, 200, 256, 1000):
        ok, got = safely(keep_recent, messages, budget)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, list) or not got or got[0] != messages[0] or got[-1] != messages[-1]:
            return verdict(False, "", f"budget {budget}: keep the system message first and the last message last")
        tail = got[1:]
        if tail != messages[len(messages) - len(tail):]:
            return verdict(False, "", f"budget {budget}: after the system message, keep a run of the MOST RECENT messages")
        if len(context_ids(tokenizer, got)) > budget:
            return verdict(False, "", f"budget {budget}: what you kept needs {len(context_ids(tokenizer, got))} tokens")
        if len(got) < len(messages):
            one_more = [messages[0]] + messages[len(messages) - len(tail) - 1:]
            if len(context_ids(tokenizer, one_more)) <= budget:
                return verdict(False, "", f"budget {budget}: one more message would still fit; keep as many as fit")
    return verdict(True, "that is the 'drop the oldest' strategy, one message at a time", "")


def check_rescue(system_prompt: str, model, tokenizer) -> bool:
    """system_prompt: a system prompt that lets the model still answer the dog's name at a 256-token budget."""
    if not isinstance(system_prompt, str) or not system_prompt.strip():
        return verdict(False, "", "write a system prompt (a non-empty string)")
    conv = load_conversation()
    messages = [{"role": "system", "content": system_prompt}] + conv["messages"][1:]
    try:
        fit = fit_to_budget(tokenizer, messages, 256, "drop_oldest")
    except ContextOverflowError as err:
        return verdict(False, "", f"{err}: keep the system prompt short")
    reply = generate(model, tokenizer, context_ids(tokenizer, fit.messages), max_new_tokens=30).text
    ok = conv["fact"].lower() in reply.lower()
    return verdict(ok, f"the turn with the fact was dropped, yet the model answered {reply!r}",
                   f"the model answered {reply!r}. The system prompt is never dropped: what could it carry?")
