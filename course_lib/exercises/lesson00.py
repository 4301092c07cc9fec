"""Checks for 00_pipeline_tour: count tokens, predict the next token, and run the whole loop."""
from __future__ import annotations

import torch

from ..context import chat_ids
from ..generation import generate
from ..forward import forward_logits
from . import safely, verdict

TEXTS = ["What is the capital of France?", "Unbelievable!", "Paris, 2024 🇫🇷", ""]
QUESTIONS = ["What is the capital of Italy?", "What is 2 + 2?"]


def check_count_tokens(count_tokens, tokenizer) -> bool:
    """count_tokens(text) -> number of token IDs the model's tokenizer gives (no special tokens)."""
    for text in TEXTS:
        ok, got = safely(count_tokens, text)
        if not ok:
            return verdict(False, "", got)
        want = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if got != want:
            return verdict(False, "", f"for {text!r} you returned {got!r}; the tokenizer gives {want} IDs. "
                           "Hint: len(tokenizer(text)['input_ids'])")
    return verdict(True, f"your counts match the tokenizer on {len(TEXTS)} texts, the empty one included", "")


@torch.inference_mode()
def check_next_token(next_token, model, tokenizer) -> bool:
    """next_token(ids) -> the greedy next token ID after a list of token IDs (one forward pass)."""
    for question in QUESTIONS:
        ids = chat_ids(tokenizer, question)
        ok, got = safely(next_token, ids)
        if not ok:
            return verdict(False, "", got)
        want = int(forward_logits(model, ids)[0, -1].argmax())
        if not isinstance(got, int) or got != want:
            return verdict(False, "", f"for {question!r} you returned {got!r}, the greedy choice is {want} "
                           f"({tokenizer.decode([want])!r}). Hint: argmax of the logits at the LAST position, as int")
    return verdict(True, "you picked the greedy next token from the last position's logits", "")


def check_answer(answer, model, tokenizer) -> bool:
    """answer(question) -> the model's greedy reply text, via the chat template and course_lib's loop."""
    for question in QUESTIONS:
        ok, got = safely(answer, question)
        if not ok:
            return verdict(False, "", got)
        want = generate(model, tokenizer, chat_ids(tokenizer, question), max_new_tokens=48).text
        if got != want:
            return verdict(False, "", f"for {question!r} you returned {got!r}; the greedy reply is {want!r}. "
                           "Hint: apply_chat_template with add_generation_prompt=True, then generate(...).text")
    return verdict(True, "your function runs the whole pipeline: template, loop, stop, detokenize", "")
