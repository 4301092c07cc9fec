"""Checks for 06_generation_streaming: a loop by hand, a streamer that never breaks a character, TTFT's share, and the
arrival of the 80th token predicted before it is measured."""
from __future__ import annotations

from ..engine.request import GenerationResult, NewToken
from ..engine.generation import generate
from ..measure.speed import uncached_run
from . import check_prediction, fresh, safely, verdict

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


def _complete(tokenizer, ids: list[int]) -> str:
    """The text a streamer may have sent once these tokens arrived: the decoded text less an incomplete tail."""
    return tokenizer.decode(ids).rstrip("\ufffd")


def check_streamer(pieces_for, tokenizer) -> bool:
    """pieces_for(token_ids) -> one text piece per token, sent as that token arrives ("" while text is held back):
    never a U+FFFD, joining to the text, and at every token at least what the usual rule has sent by then (all the
    decoded text whenever it does not end in U+FFFD), so returning the whole text at the end, a non-streaming
    answer, fails. The fixed texts, then random mixes of them."""
    rng = fresh()
    mixes = ["".join(rng.sample(STREAM_TEXTS, 2)) + rng.choice(["👍", " ✓", "é", "!"]) for _ in range(2)]
    for text in STREAM_TEXTS + mixes:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ok, got = safely(pieces_for, ids)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, list) or not all(isinstance(p, str) for p in got) or "".join(got) != text:
            return verdict(False, "", f"for {text!r} your pieces are not text pieces that join to the text")
        if len(got) != len(ids):
            return verdict(False, "", f"for {text!r} ({len(ids)} tokens) you sent {len(got)} pieces: send one per "
                           "token as it arrives, an empty string while you hold text back")
        broken = [p for p in got if "\ufffd" in p]
        if broken:
            return verdict(False, "", f"for {text!r} you emitted broken characters {broken[:3]}: hold text back "
                           "while the decoded tail ends with '\\ufffd'")
        sent, due = "", ""
        for i, piece in enumerate(got):
            sent += piece
            decoded = tokenizer.decode(ids[:i + 1])
            if not decoded.endswith("\ufffd"):
                due = decoded  # the usual rule sends everything whenever the decoded text has no broken tail
            if not _complete(tokenizer, ids[:i + 1]).startswith(sent) or len(sent) < len(due):
                return verdict(False, "", f"for {text!r}, after token {i + 1} of {len(ids)} you had sent {sent!r}: "
                               "send the text as soon as the decoded text no longer ends in '\\ufffd'")
    return verdict(True, "no broken characters, nothing late, and the pieces join to exactly the text", "")


def check_ttft_share(ttft_share, model, tokenizer, prompt_ids: list[int]) -> bool:
    """ttft_share(result) -> time to first token / time of the last token, for a GenerationResult."""
    result = generate(model, tokenizer, prompt_ids, max_new_tokens=12)
    fake = GenerationResult([1], [5, 6, 7], "", "max_new_tokens",
                            [NewToken(0, 5, "", 1.0, 0.2), NewToken(1, 6, "", 1.0, 0.3), NewToken(2, 7, "", 1.0, 0.8)])
    for res, want in [(result, result.steps[0].at / result.steps[-1].at), (fake, 0.25)]:
        ok, got = safely(ttft_share, res)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, float) or abs(got - want) > 1e-9:
            return verdict(False, "", f"expected {want:.4f}, got {got!r}. Hint: result.steps[0].at / result.steps[-1].at")
    return verdict(True, "you can read prefill's share of the wait straight from the step times", "")


def check_arrival_prediction(prediction_s, model, tokenizer, prompt_ids: list[int], n: int = 80,
                             tolerance: float = 1.4) -> bool:
    """prediction_s: your prediction, written BEFORE this runs, of the seconds from the request until the n-th new
    token arrives for this prompt (no stop token: exactly n are made). Section 5 printed TTFT and the gaps."""
    def measure():
        return generate(model, tokenizer, list(prompt_ids), max_new_tokens=n, stop_ids=()).steps[-1].at
    return check_prediction(prediction_s, measure, unit="s", what=f"until token {n} arrived", tolerance=tolerance,
                            timed=True, hint="The first token costs the prompt's prefill (the TTFT); each later one costs one "
                                 "decode step (the median gap)")
