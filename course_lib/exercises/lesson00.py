"""Checks for 00_pipeline_tour: count tokens, predict the next token, and run the whole loop."""
from __future__ import annotations

import torch

from ..text.context import chat_ids
from ..engine.generation import generate
from ..runner.forward import forward_logits
from . import check_prediction, fresh, off, safely, verdict

TEXTS = ["What is the capital of France?", "Unbelievable!", "Paris, 2024 🇫🇷", ""]
QUESTIONS = ["What is the capital of Italy?", "What is 2 + 2?"]
WORDS = ["river", "Tokyo", "quantum", "bread", "12345", "naïve", "🙂", "don't", "  spaces", "HTTP", "λ", "\n"]
MORE_QUESTIONS = ["What colour is the sky?", "Name a planet.", "What is the capital of Spain?", "Say hello.",
                  "What is 3 + 4?", "Who wrote Hamlet?", "What do bees make?"]


def _random_text(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))


def check_count_tokens(count_tokens, tokenizer) -> bool:
    """count_tokens(text) -> number of token IDs the model's tokenizer gives (no special tokens)."""
    rng = fresh()
    texts = TEXTS + [_random_text(rng) for _ in range(3)]
    for text in texts:
        ok, got = safely(count_tokens, text)
        if not ok:
            return verdict(False, "", got)
        want = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if got != want or not isinstance(got, int):
            return verdict(False, "", f"for {text!r} you returned {got!r}, {off(got, want)}. "
                           "Hint: len(tokenizer(text)['input_ids'])")
    return verdict(True, f"your counts match the tokenizer on {len(texts)} texts, the empty one included", "")


@torch.inference_mode()
def check_next_token(next_token, model, tokenizer) -> bool:
    """next_token(ids) -> the greedy next token ID after a list of token IDs (one forward pass)."""
    for question in QUESTIONS + [fresh().choice(MORE_QUESTIONS)]:
        ids = chat_ids(tokenizer, question)
        ok, got = safely(next_token, ids)
        if not ok:
            return verdict(False, "", got)
        want = int(forward_logits(model, ids)[0, -1].argmax())
        if not isinstance(got, int) or got != want:
            shown = f" ({tokenizer.decode([got])!r})" if isinstance(got, int) and 0 <= got < len(tokenizer) else ""
            return verdict(False, "", f"for {question!r} you returned {got!r}{shown}, not the greedy choice. "
                           "Hint: argmax of the logits at the LAST position, as int")
    return verdict(True, "you picked the greedy next token from the last position's logits", "")


def check_answer(answer, model, tokenizer) -> bool:
    """answer(question) -> the model's greedy reply text, via the chat template and course_lib's loop."""
    for question in QUESTIONS[:1] + [fresh().choice(MORE_QUESTIONS)]:
        ok, got = safely(answer, question)
        if not ok:
            return verdict(False, "", got)
        want = generate(model, tokenizer, chat_ids(tokenizer, question), max_new_tokens=48).text
        if got != want:
            same = next((i for i, (a, b) in enumerate(zip(str(got), want)) if a != b), min(len(str(got)), len(want)))
            return verdict(False, "", f"for {question!r} you returned {got!r}, which leaves the greedy reply at "
                           f"character {same}. Hint: apply_chat_template with add_generation_prompt=True, then "
                           "generate(...).text with max_new_tokens=48")
    return verdict(True, "your function runs the whole pipeline: template, loop, stop, detokenize", "")


def check_loop_share_prediction(prediction, model, tokenizer, context_ids: list[int], n: int = 100) -> bool:
    """prediction: your prediction, written BEFORE this runs, of the share (0 to 1) of the end-to-end time that the
    decode loop takes when the answer is n tokens long instead of the 8 timed above (no stop: exactly n)."""
    def measure():
        r = generate(model, tokenizer, list(context_ids), max_new_tokens=n, stop_ids=())
        return (r.steps[-1].at - r.steps[0].at) / r.steps[-1].at  # after the first token / until the last
    return check_prediction(prediction, measure, unit="share of the time", what=f"in the decode loop for {n} tokens",
                            tolerance=1.1, timed=True, hint="The first token's cost (prefill) is paid once; every further token "
                                                "adds one decode step, so the loop's share grows with the answer")
