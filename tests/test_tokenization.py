import pytest

from course_lib.tokenization import cl100k, encode, tokens_of


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
