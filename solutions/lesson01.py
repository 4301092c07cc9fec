from collections import Counter

from course_lib.text.tokenization import cl100k, cost

model = tokenizer = None


def count_both(text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]), len(cl100k().encode(text))


def word():
    """A word that is one token after a space but several without one (searched, not guessed)."""
    for candidate in ["capital", "station", "library", "window", "garden", "system", "people", "France"]:
        spaced = tokenizer(" " + candidate, add_special_tokens=False)["input_ids"]
        bare = tokenizer(candidate, add_special_tokens=False)["input_ids"]
        if len(candidate) >= 5 and len(spaced) == 1 and len(bare) >= 2:
            return candidate
    return None


def first_merge(text):
    data = text.encode("utf-8")
    return Counter(zip(data, data[1:])).most_common(1)[0][0]


def cost_of(prompt, answer, price_in, price_out):
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return cost(count(prompt), price_in) + cost(count(answer), price_out)


def count_prediction(text):
    """Characters per token of the lesson's French text, a Latin-script language with accents, applied here."""
    from pathlib import Path
    french = (Path(__file__).resolve().parents[1] / "data" / "texts" / "french.txt").read_text()
    per_token = len(french) / len(tokenizer(french, add_special_tokens=False)["input_ids"])
    return len(text) / per_token
