"""Checks for 06_generation_streaming: a loop by hand, a streamer that never breaks a character, TTFT's share."""
from __future__ import annotations

from ..generation import GenerationResult, Step, generate
from ..measure.speed import uncached_run
from . import safely, verdict

STREAM_TEXTS = ["Crème brûlée à Paris, 東京タワー 👨‍👩‍👧!", "🎉🎂🥳 happy birthday 🇫🇷", "plain ASCII text", "naïve café 你好"]


def check_greedy_loop(greedy_loop, model, tokenizer, prompt_ids: list[int], n: int = 6) -> bool:
    """greedy_loop(ids, n) -> n new token IDs, each the argmax after running the model on ALL tokens so far."""
    ok, got = safely(greedy_loop, list(prompt_ids), n)
    if not ok:
        return verdict(False, "", got)
    want = uncached_run(model, list(prompt_ids), n).token_ids  # the reference: no cache, exactly n tokens
    if not isinstance(got, list) or [int(t) for t in got] != want:
        return verdict(False, "", f"expected {want} ({tokenizer.decode(want)!r}), got {got!r}. Hint: append each "
                       "chosen token to the ids before the next forward pass; return only the new ones")
    return verdict(True, f"your loop wrote {tokenizer.decode(want)!r}, token for token like course_lib's", "")


def check_streamer(pieces_for, tokenizer) -> bool:
    """pieces_for(token_ids) -> text pieces, one call per token's arrival, never with U+FFFD, joining to the text."""
    for text in STREAM_TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ok, got = safely(pieces_for, ids)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, list) or "".join(got) != text:
            return verdict(False, "", f"for {text!r} your pieces join to {''.join(map(str, got or []))!r}")
        broken = [p for p in got if "\ufffd" in p]
        if broken:
            return verdict(False, "", f"for {text!r} you emitted broken characters {broken[:3]}: hold text back "
                           "while the decoded tail ends with '\\ufffd'")
    return verdict(True, "no broken characters, and the pieces join to exactly the text", "")


def check_ttft_share(ttft_share, model, tokenizer, prompt_ids: list[int]) -> bool:
    """ttft_share(result) -> time to first token / time of the last token, for a GenerationResult."""
    result = generate(model, tokenizer, prompt_ids, max_new_tokens=12)
    fake = GenerationResult([1], [5, 6, 7], "", "max_new_tokens",
                            [Step(0, 5, "", 1.0, 0.2), Step(1, 6, "", 1.0, 0.3), Step(2, 7, "", 1.0, 0.8)])
    for res, want in [(result, result.steps[0].at / result.steps[-1].at), (fake, 0.25)]:
        ok, got = safely(ttft_share, res)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, float) or abs(got - want) > 1e-9:
            return verdict(False, "", f"expected {want:.4f}, got {got!r}. Hint: result.steps[0].at / result.steps[-1].at")
    return verdict(True, "you can read prefill's share of the wait straight from the step times", "")
