import pytest

from course_lib.text.tokenization import (bpe_encode, bpe_vocab, cl100k, cl100k_tokens, cost, economy, encode,
                                          model_tokens, piece_lengths, round_trips, tokens_of, train_bpe)


def test_cl100k_works_offline():
    enc = cl100k()
    assert enc.n_vocab > 100_000
    assert enc.decode(enc.encode("What is the capital of France?")) == "What is the capital of France?"
    assert len(enc.encode("What is the capital of France?")) == 7


@pytest.mark.parametrize("text, n", [("Unbelievable", 3), ("What is the capital of France?", 7)])
def test_known_token_counts(tokenizer, text, n):
    assert len(encode(tokenizer, text)) == n


def test_special_tokens_are_marked(tokenizer):
    toks = tokens_of(tokenizer, [1, 1780, 2])
    assert [t.special for t in toks] == [True, False, True]
    assert toks[2].text == "<|im_end|>"


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(TypeError, match="str"):
        encode(tokenizer, 42)



ROUND_TRIP = ["", "a", "What is the capital of France?", "café crème brûlée", "東京タワー", "안녕하세요",
              "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵", "  leading and trailing  ", "tab\tnew\nline\r\n", "naïve façade Ærø",
              "Crème brûlée à Paris, 東京タワー 👨‍👩‍👧!", "x" * 5000, "def f(x):\n    return x ** 2\n"]


@pytest.mark.parametrize("text", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_round_trip(tokenizer, text):
    assert round_trips(tokenizer, text)
    assert cl100k().decode(cl100k().encode(text)) == text


@pytest.mark.parametrize("text", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_token_bytes_join_to_the_text(tokenizer, text):
    assert b"".join(t.raw for t in model_tokens(tokenizer, text)) == text.encode()
    assert b"".join(t.raw for t in cl100k_tokens(text)) == text.encode()


def test_emoji_costs_several_byte_tokens(tokenizer):
    toks = model_tokens(tokenizer, "👍")
    assert len(toks) == 3 and not any(t.complete for t in toks)
    assert toks[0].text == "<F0 9F>"


def test_leading_space_and_case_change_ids(tokenizer):
    ids = {t: encode(tokenizer, t) for t in ["Paris", " Paris", "paris", "PARIS"]}
    assert len({tuple(v) for v in ids.values()}) == 4
    assert len(ids["Paris"]) == 1 and len(ids[" Paris"]) == 1


def test_digits_are_single_tokens_in_smollm(tokenizer):
    assert [t.text for t in model_tokens(tokenizer, "2024")] == ["2", "0", "2", "4"]
    assert [t.text for t in cl100k_tokens("2024")] == ["202", "4"]


def test_economy_and_cost(tokenizer):
    e = economy(tokenizer, "q", "What is the capital of France?")
    assert (e.words, e.chars, e.model_tokens, e.cl100k_tokens) == (6, 30, 7, 7)
    assert e.words_per_token["model"] == pytest.approx(6 / 7)
    assert cost(2_000, 3.0) == pytest.approx(0.006)
    with pytest.raises(ValueError):
        cost(-1, 3.0)
    with pytest.raises(ValueError, match="empty"):
        economy(tokenizer, "e", "")


def test_vocabulary_sizes(tokenizer):
    lengths = piece_lengths(tokenizer)
    assert len(lengths["model"]) == 49152 - len(tokenizer.all_special_ids)
    assert 100_000 < len(lengths["cl100k"]) < 100_300
    assert min(lengths["model"]) == 1


def test_bpe_trainer_learns_frequent_pairs():
    merges = train_bpe("aaabdaaabac", 3)
    vocab = bpe_vocab(merges)
    assert [vocab[n] for _, n in merges] == [b"aa", b"aaa", b"aaab"]  # minbpe's Wikipedia example, byte level
    assert bpe_encode("aaabdaaabac", merges) == [b"aaab", b"d", b"aaab", b"a", b"c"]
    assert b"".join(bpe_encode("unseen text é", merges)) == "unseen text é".encode()


def test_bpe_on_course_text():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "data" / "texts" / "english_prose.txt").read_text()
    merges = train_bpe(text, 50)
    assert len(merges) == 50 and len(bpe_encode(text, merges)) < len(text.encode()) * 0.7
    with pytest.raises(ValueError):
        train_bpe(text, -1)


def test_word_shapes_counts_whole_words_and_lone_marks(tokenizer):
    from course_lib.text.tokenization import word_shapes
    w = word_shapes(tokenizer, "Hi, you. Antidisestablishmentarianism!")
    assert (w["words"], w["whole_words"], w["split_words"]) == (3, 2, 1)  # the long word takes several tokens
    assert (w["punctuation"], w["punctuation_alone"]) == (3, 3)
    code = word_shapes(tokenizer, "if f(x): return g()")
    assert code["punctuation_merged"] >= 2  # "():" and "()" come merged, not one mark per token
    assert code["punctuation"] == code["punctuation_alone"] + code["punctuation_merged"] == 5
