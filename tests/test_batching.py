import pytest

from course_lib.engine.schedulers import PaddedScheduler, left_pad, padding_waste
from course_lib.engine.request import Job
from course_lib.engine.generation import generate, generate_static, run_schedule, step

from conftest import chat_ids

QUESTIONS = ["What is the capital of France?", "Write a short story about a robot who learns to paint.",
             "What is 2 + 2?", "Hi", "Give me three tips for staying focused while studying at home."]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, q, system=None) for q in QUESTIONS]


def test_left_pad_layout():
    b = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert b.padding == 2 and padding_waste([3, 1]) == (2, 6)
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], 0)


# The scheduling mechanics hold for any model: they run on the tiny random model (conftest.tiny); the real
# model's batches are checked in test_stop_ids_end_a_job below and in test_model / test_serving.

def test_batched_greedy_equals_each_alone(tiny, tokenizer, prompts):
    batched = generate_static(tiny, tokenizer, prompts, max_new_tokens=32)
    for p, b in zip(prompts, batched):
        assert b == generate(tiny, tokenizer, p, max_new_tokens=32).token_ids


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
def test_schedules_give_each_job_its_own_tokens(tiny, tokenizer, prompts, continuous):
    jobs = [Job(f"r{i}", prompts[i % len(prompts)], n) for i, n in enumerate([12, 3, 20, 7, 1, 9, 15])]
    run_schedule(tiny, jobs, max_batch=3, continuous=continuous)
    for job in jobs:
        assert job.tokens == generate(tiny, tokenizer, job.prompt, job.new_tokens, stop_ids=()).token_ids, job.name
        assert job.start <= job.first_token <= job.end


def test_continuous_admits_as_soon_as_a_slot_frees(tiny, prompts):
    jobs = [Job("long", prompts[1], 20), Job("short", prompts[0], 2), Job("waiting", prompts[2], 4)]
    run_schedule(tiny, jobs, max_batch=2, continuous=True)
    assert jobs[2].start < jobs[0].end  # joined while the long job was still running
    static = [Job("long", prompts[1], 20), Job("short", prompts[0], 2), Job("waiting", prompts[2], 4)]
    run_schedule(tiny, static, max_batch=2, continuous=False)
    assert static[2].start >= static[0].end  # static waits for the whole batch


def test_cancelled_job_leaves_the_batch(tiny, tokenizer, prompts):
    model = tiny
    batch = PaddedScheduler(model)
    a, b = Job("a", prompts[0], 50), Job("b", prompts[1], 5)
    batch.add([a, b])
    step(batch)
    a.cancelled = True
    step(batch)
    assert [j.name for j in batch.jobs] == ["b"] and a.finish_reason == "cancelled"
    while batch.jobs:
        step(batch)
    assert b.tokens == generate(model, tokenizer, prompts[1], 5, stop_ids=()).token_ids


def test_stop_ids_end_a_job(model, tokenizer, prompts):
    job = Job("q", prompts[0], 50, frozenset({2}))
    run_schedule(model, [job], max_batch=1, continuous=True)
    assert job.tokens[-1] == 2 and job.finish_reason == "end_of_turn"
    assert tokenizer.decode(job.tokens, skip_special_tokens=True) == "The capital of France is Paris."


def test_padded_batches_on_the_real_model(model, tokenizer, prompts):
    """The real model, prompts of 37 to 42 tokens left-padded into one batch: each row's first logits within 1e-4
    of the prompt run alone (float32: padding changes the order of additions, not the function; 1e-4 is far above
    the float32 rounding seen, about 1e-5, and far below the gap between two tokens that would flip a greedy pick
    on these prompts), and the same greedy tokens."""
    import torch

    from course_lib.runner.forward import run_model
    chosen = prompts[:3]
    batch = left_pad(chosen, tokenizer.pad_token_id)
    assert batch.padding > 0
    with torch.inference_mode():
        together, _ = run_model(model, batch.input_ids, None, batch.attention_mask, batch.position_ids, keep=1)
        for row, prompt in enumerate(chosen):
            solo, _ = run_model(model, torch.tensor([prompt]), None, keep=1)
            assert torch.allclose(solo[0, -1], together[row, -1], atol=1e-4, rtol=0)
    for prompt, tokens in zip(chosen, generate_static(model, tokenizer, chosen, max_new_tokens=16)):
        assert tokens == generate(model, tokenizer, prompt, max_new_tokens=16).token_ids
