"""Checks for 01_tokenization: counting with two tokenizers, a word that a space changes, a BPE merge, a cost."""
from __future__ import annotations

from collections import Counter

from ..tokenization import cl100k_tokens, cost, encode
from . import safely, verdict

TEXTS = ["What is the capital of France?", "1,000,000 tokens", "Crème brûlée 東京 👨‍👩‍👧", "", "def f(x):\n    return x"]


def check_count_both(count_both, tokenizer) -> bool:
    """count_both(text) -> (tokens with the model's tokenizer, tokens with cl100k_base)."""
    for text in TEXTS:
        ok, got = safely(count_both, text)
        if not ok:
            return verdict(False, "", got)
        want = (len(encode(tokenizer, text)), len(cl100k_tokens(text)))
        if not isinstance(got, (tuple, list)) or tuple(got) != want:
            return verdict(False, "", f"for {text!r} you returned {got!r}, expected {want}. Hint: "
                           "len(tokenizer(text, add_special_tokens=False)['input_ids']) and len(cl100k().encode(text))")
    return verdict(True, f"both counts are right on {len(TEXTS)} texts", "")


def check_space_word(word: str, tokenizer) -> bool:
    """word: at least 5 letters, ONE token with a leading space (" word") but two or more without it."""
    if not isinstance(word, str) or not word.isalpha() or len(word) < 5:
        return verdict(False, "", "give a single word of at least 5 letters, like 'capital'")
    with_space, bare = encode(tokenizer, " " + word), encode(tokenizer, word)
    ok = len(with_space) == 1 and len(bare) >= 2
    return verdict(ok, f"' {word}' is 1 token ({with_space[0]}) but '{word}' is {len(bare)} tokens {bare}",
                   f"' {word}' gives {len(with_space)} token(s) and '{word}' gives {len(bare)}; "
                   "try a common word that usually follows a space mid-sentence, e.g. ' France' vs 'France'")


def check_first_merge(first_merge) -> bool:
    """first_merge(text) -> the most frequent pair of adjacent bytes of text.encode('utf-8'), as a tuple of ints."""
    for text in ["the cat sat on the mat", "aaabdaaabac", "été à l'hôtel", "ab"]:
        ok, got = safely(first_merge, text)
        if not ok:
            return verdict(False, "", got)
        data = text.encode("utf-8")
        counts = Counter(zip(data, data[1:]))
        best = max(counts.values())
        if not isinstance(got, tuple) or counts.get(got) != best:
            return verdict(False, "", f"for {text!r} you returned {got!r}; a most frequent pair occurs {best} times. "
                           "Hint: Counter(zip(data, data[1:])).most_common(1)[0][0]")
    return verdict(True, "that is the first step of byte-pair-encoding training", "")


def check_cost(cost_of, tokenizer) -> bool:
    """cost_of(text, price_per_million) -> the price of the text's model tokens at that price."""
    for text, price in [("What is the capital of France?", 3.0), ("Unbelievable " * 100, 0.5), ("", 10.0)]:
        ok, got = safely(cost_of, text, price)
        if not ok:
            return verdict(False, "", got)
        want = cost(len(encode(tokenizer, text)), price)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-12:
            return verdict(False, "", f"for {len(text)} characters at {price}/M you returned {got!r}, expected {want}. "
                           "Hint: tokens * price / 1_000_000")
    return verdict(True, "you can now price any text before you send it", "")
