"""Checks for 01_tokenization: counting with two tokenizers, a word that a space changes, a BPE merge, a cost."""
from __future__ import annotations

from collections import Counter

from ..text.tokenization import cl100k_tokens, cost, encode
from . import check_prediction, fresh, off, safely, verdict

TEXTS = ["What is the capital of France?", "1,000,000 tokens", "Crème brûlée 東京 👨‍👩‍👧", "", "def f(x):\n    return x"]
PIECES = ["the", "Paris", "1,984", "tokenization", "東京", "🎉", "x = 3", "naïve", "!!", "\n", "    ", "internationally"]


def _random_text(rng) -> str:
    return " ".join(rng.choice(PIECES) for _ in range(rng.randint(3, 12)))


def check_count_both(count_both, tokenizer) -> bool:
    """count_both(text) -> (tokens with the model's tokenizer, tokens with cl100k_base)."""
    rng = fresh()
    texts = TEXTS + [_random_text(rng) for _ in range(3)]
    for text in texts:
        ok, got = safely(count_both, text)
        if not ok:
            return verdict(False, "", got)
        want = (len(encode(tokenizer, text)), len(cl100k_tokens(text)))
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return verdict(False, "", f"for {text!r} you returned {got!r}: give a tuple of two counts, the model's "
                           "first")
        wrong = [f"the {name} count is {off(g, w)}" for name, g, w in zip(("model's", "cl100k"), got, want) if g != w]
        if wrong:
            return verdict(False, "", f"for {text!r} you returned {tuple(got)!r}: {' and '.join(wrong)}. Hint: "
                           "len(tokenizer(text, add_special_tokens=False)['input_ids']) and len(cl100k().encode(text))")
    return verdict(True, f"both counts are right on {len(texts)} texts", "")


def check_space_word(word: str, tokenizer) -> bool:
    """word: at least 5 letters, ONE token with a leading space (" word") but two or more without it."""
    if not isinstance(word, str) or not word.isalpha() or len(word) < 5:
        return verdict(False, "", "give a single word of at least 5 letters, like 'capital'")
    with_space, bare = encode(tokenizer, " " + word), encode(tokenizer, word)
    ok = len(with_space) == 1 and len(bare) >= 2
    return verdict(ok, f"' {word}' is 1 token ({with_space[0]}) but '{word}' is {len(bare)} tokens {bare}",
                   f"' {word}' gives {len(with_space)} token(s) and '{word}' gives {len(bare)}; "
                   "capitalised names often have a token of their own either way ('France' does); try everyday "
                   "lower-case words, which the tokenizer mostly meets after a space")


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
    """cost_of(prompt, answer, price_in, price_out) -> the price of one request: the prompt's model tokens at
    price_in and the answer's at price_out, both in dollars per million tokens."""
    rng = fresh()
    cases = [("What is the capital of France?", "The capital of France is Paris.", 3.0, 15.0), ("", "", 1.0, 2.0)]
    cases += [(_random_text(rng), _random_text(rng) * rng.randint(1, 40), rng.choice([0.15, 0.5, 2.5, 3.0]),
               rng.choice([0.6, 4.0, 10.0, 15.0])) for _ in range(3)]
    for prompt, answer, price_in, price_out in cases:
        ok, got = safely(cost_of, prompt, answer, price_in, price_out)
        if not ok:
            return verdict(False, "", got)
        want = cost(len(encode(tokenizer, prompt)), price_in) + cost(len(encode(tokenizer, answer)), price_out)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9 * max(want, 1e-9):
            return verdict(False, "", f"for a {len(prompt)}-character prompt and a {len(answer)}-character answer at "
                           f"{price_in}/{price_out} per million you returned {got!r}, {off(got, want)}. Hint: count "
                           "tokens, not characters or words; each side at its own price, per million")
    return verdict(True, "an answer token costs more than a prompt token, and you can price both before you send", "")


SPANISH = ("El veloz murciélago hindú comía feliz cardillo y kiwi; la cigüeña tocaba el saxofón detrás del "
           "palenque de paja.")


def check_count_prediction(prediction, tokenizer, text: str = SPANISH) -> bool:
    """prediction: your prediction, written BEFORE this runs, of the model's tokens for `text` (the table of
    characters per token above is the guide). The check counts them."""
    return check_prediction(prediction, lambda: len(encode(tokenizer, text)), unit="tokens",
                            what=f"for these {len(text)} characters", tolerance=1.25,
                            hint="This tokenizer was trained mostly on English: accented words in another language "
                                 "break into more pieces than English prose does")
