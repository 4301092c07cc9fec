import pytest
import torch

from course_lib.runner.forward import forward_logits, probabilities, top_candidates
from course_lib.engine.stages import decode_step, prefill
from course_lib.engine.request import end_of_turn_ids
from course_lib.engine.generation import generate, stream

from conftest import chat_ids

QUESTIONS = ["What is the capital of France?", "What is the capital gains tax in France?",
             "Write a haiku about the sea."]


@pytest.mark.parametrize("question", QUESTIONS)
def test_loop_equals_model_generate(model, tokenizer, question):
    ids = chat_ids(tokenizer, question)
    ours = generate(model, tokenizer, ids, max_new_tokens=24)
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    assert ours.token_ids == theirs[0, len(ids):].tolist()


def test_prefill_and_decode_step_match_a_full_forward(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    full = forward_logits(model, ids + [504, 3575])[0]  # (T, V)
    logits, cache = prefill(model, ids)
    assert torch.allclose(logits[0], full[len(ids) - 1], atol=1e-4)
    logits, cache = decode_step(model, [504], cache)
    assert torch.allclose(logits[0], full[len(ids)], atol=1e-4)
    logits, cache = decode_step(model, [3575], cache)
    assert torch.allclose(logits[0], full[len(ids) + 1], atol=1e-4)
    assert cache.get_seq_length() == len(ids) + 2


def test_stop_reasons(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    assert generate(model, tokenizer, ids, max_new_tokens=40).stop_reason == "end_of_turn"
    short = generate(model, tokenizer, ids, max_new_tokens=3)
    assert short.stop_reason == "max_new_tokens" and len(short.token_ids) == 3
    stopped = generate(model, tokenizer, ids, max_new_tokens=40, stop_strings=("France",))
    assert stopped.stop_reason == "stop_string" and stopped.text == "The capital of "  # the stop string is cut
    assert tokenizer.decode(stopped.token_ids).endswith("France")  # it was generated, then cut from the text


def test_steps_are_recorded_in_time_order(model, tokenizer):
    result = generate(model, tokenizer, chat_ids(tokenizer, "What is the capital of France?"), max_new_tokens=10)
    ats = [s.at for s in result.steps]
    assert ats == sorted(ats) and result.time_to_first_token == ats[0] > 0
    assert len(result.inter_token_seconds) == len(ats) - 1
    assert all(0 < s.prob <= 1 for s in result.steps)
    assert "".join(s.text for s in result.steps[:-1]) == result.text


def test_end_of_turn_is_im_end(model, tokenizer):
    assert end_of_turn_ids(model, tokenizer) == {2}
    assert tokenizer.decode([2]) == "<|im_end|>"


@pytest.mark.parametrize("prompt, n, message", [([], 5, "empty"), ([1780], 0, "positive"),
                                                ([1780], -3, "positive"), ([1780], 2.5, "positive")])
def test_bad_requests(model, tokenizer, prompt, n, message):
    with pytest.raises(ValueError, match=message):
        generate(model, tokenizer, prompt, max_new_tokens=n)


def test_prompt_longer_than_context_window(model, tokenizer):
    too_long = [1780] * (model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="context window"):
        generate(model, tokenizer, too_long, max_new_tokens=1)


def test_top_candidates_are_sorted_probabilities(model, tokenizer):
    probs = probabilities(forward_logits(model, chat_ids(tokenizer, "What is the capital of France?"))[0, -1])
    assert abs(float(probs.sum()) - 1) < 1e-4
    top = top_candidates(tokenizer, probs, k=10)
    assert [c.rank for c in top] == list(range(1, 11))
    assert all(a.prob >= b.prob for a, b in zip(top, top[1:]))
    assert top[0].text == "The"  # the answer starts with a sentence, not with "Paris"


from course_lib.engine.text_out import IncrementalDecoder, naive_pieces

STREAM_TEXTS = ["Crème brûlée à Paris, 東京タワー 👨‍👩‍👧!", "🎉🎂🥳 happy birthday 🇫🇷🇯🇵", "naïve façade Ærø",
                "안녕하세요 世界", "plain text", "", "👍" * 20, "mixed 1,234.56 € and ¥"]


@pytest.mark.parametrize("text", STREAM_TEXTS, ids=range(len(STREAM_TEXTS)))
def test_incremental_decoder_never_breaks_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_naive_decoding_does_break_characters(tokenizer):
    ids = tokenizer("東京 👍", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in p for p in naive_pieces(tokenizer, ids))


@pytest.mark.parametrize("question", ["What is 'hello' in Chinese?", "Give me three emojis that describe summer.",
                                      "What is the capital of France?"])
def test_streamed_text_equals_generated_text(model, tokenizer, question):
    ids = chat_ids(tokenizer, question)
    pieces = list(stream(model, tokenizer, ids, max_new_tokens=30))
    assert "".join(pieces) == generate(model, tokenizer, ids, max_new_tokens=30).text
    assert all(pieces)


def test_stream_stops_on_bad_request(model, tokenizer):
    with pytest.raises(ValueError, match="empty"):
        list(stream(model, tokenizer, [], max_new_tokens=5))


def test_a_stream_never_sends_its_stop_string(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    s = stream(model, tokenizer, ids, 30, stop_strings=["France", "Paris"])
    pieces = list(s)
    assert "".join(pieces) == s.result.text == "The capital of " and s.result.stop_reason == "stop_string"
