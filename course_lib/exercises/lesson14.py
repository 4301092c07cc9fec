"""Checks for 14_speculative_decoding: the speed-up formula, a prompt-lookup drafter, tokens per verify step."""
from __future__ import annotations

from ..engine.speculative import PromptLookup, expected_tokens_per_verify
from . import check_prediction, safely, verdict


def check_speedup(speedup) -> bool:
    """speedup(tokens_per_verify, step_ms, draft_ms, k, verify_ms) -> plain time per token / speculative time."""
    for case in [(3.0, 50.0, 0.0, 4, 60.0), (1.0, 50.0, 15.0, 4, 70.0), (2.5, 40.0, 10.0, 2, 45.0)]:
        ok, got = safely(speedup, *case)
        if not ok:
            return verdict(False, "", got)
        tpv, s, d, k, v = case
        want = tpv * s / (k * d + v)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
            return verdict(False, "", f"for {case} you said {got!r}, expected {want:.3f}. Hint: per verify step you pay "
                           "k drafts and one verify pass, and you get tokens_per_verify tokens; plain decoding pays step_ms each")
    return verdict(True, "a drafter that is free and always right at k=4 would give 5 tokens per pass", "")


def check_lookup(lookup) -> bool:
    """lookup(context, k, n=2) -> what followed the most recent earlier occurrence of the last n tokens."""
    cases = [([5, 6, 7, 8, 5, 6], 3), ([1, 2, 3], 2), ([4, 9, 4, 9, 1, 4, 9], 2), ([7, 7, 7, 7], 2)]
    for context, k in cases:
        ok, got = safely(lookup, list(context), k)
        if not ok:
            return verdict(False, "", got)
        tail = context[-2:]
        want = []
        for start in range(len(context) - 3, -1, -1):
            if context[start:start + 2] == tail:
                want = context[start + 2:start + 2 + k]
                break
        if list(got) != want:
            return verdict(False, "", f"for {context}, k={k} you proposed {got!r}, expected {want}. Hint: search "
                           "backwards from just before the tail, and return at most k tokens")
    same = PromptLookup(2).propose([5, 6, 7, 8, 5, 6], 3) == lookup([5, 6, 7, 8, 5, 6], 3)
    return verdict(same, "your drafter proposes what course_lib's PromptLookup(2) does", "it differs from PromptLookup(2)")


def check_tokens_per_verify(tokens_per_verify) -> bool:
    """tokens_per_verify(a, k) -> 1 + a + a^2 + ... + a^k."""
    for a, k in [(0.0, 4), (1.0, 4), (0.5, 2), (0.8, 6)]:
        ok, got = safely(tokens_per_verify, a, k)
        if not ok:
            return verdict(False, "", got)
        want = expected_tokens_per_verify(a, k)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
            return verdict(False, "", f"for a={a}, k={k} you said {got!r}, expected {want:.4f}. Hint: token i of the "
                           "draft counts only if all i before it were accepted too (probability a^i); add the model's own one")
    return verdict(True, "at a = 0.8, k = 6 a verify step yields about 3.9 tokens on average", "")


def check_verify_prediction(prediction, model, tokenizer, prompt_ids: list[int], k: int = 4, n: int = 40) -> bool:
    """prediction: your prediction, written BEFORE this runs, of the tokens per verify step of prompt lookup at k on
    this prompt (section 4 printed k = 2 and k = 6). Greedy, so the count repeats run after run."""
    from ..engine.generation import generate

    def measure():
        return generate(model, tokenizer, list(prompt_ids), n, stop_ids=(), draft=PromptLookup(3), k=k
                        ).speculative.tokens_per_verify
    return check_prediction(prediction, measure, unit="tokens per verify", what=f"at k = {k}", tolerance=1.25,
                            hint="A verify step yields at most k + 1 tokens, and only while the copied passage keeps "
                                 "matching: read how k = 2 and k = 6 compared")
