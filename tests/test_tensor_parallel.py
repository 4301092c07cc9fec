"""Tensor parallelism over gloo (lesson 18): the split refuses what does not divide, a group of processes gives the
logits and tokens of one model (the tiny random model split in two; the real one in three, slow), and a rank that
fails is reported with its error, never a hang."""
import pytest
import torch

from course_lib.runner import tensor_parallel as tp


def test_a_world_size_that_does_not_divide_the_heads_is_refused(model):
    with pytest.raises(ValueError, match=r"needs 2 to divide the 3 key/value heads.*choose one of \[1, 3\]"):
        tp.check_split(model.config, 2)
    with pytest.raises(ValueError, match="whole number of processes"):
        tp.check_split(model.config, 0)
    with pytest.raises(ValueError, match="choose one of"):
        tp.run(2, [1, 2, 3], state={}, config=model.config)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]


def test_the_shards_add_up_to_the_model_in_one_process(tiny, prompt):
    """The same code with one rank is the whole model: equal to the library's logits. Two shards each hold half the
    query rows, and call the all-reduce twice per layer."""
    state, config = tiny.state_dict(), tiny.config
    shards = [tp.Shard.from_state(state, config, r, 2) for r in range(2)]
    whole = tp.Shard.from_state(state, config, 0, 1)
    ids = torch.tensor([prompt])
    expected = tiny(ids).logits[0].float()
    got = tp.forward(whole, ids, whole.new_cache(len(prompt)), 0, lambda t: None)[0]
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert shards[0].layers[0].q.shape[0] == whole.layers[0].q.shape[0] // 2 and shards[0].bytes() < whole.bytes()
    caches = [s.new_cache(len(prompt)) for s in shards]
    parts = []

    def reduce_later(t):  # note: the ranks cannot wait for each other in one process: check the split of one layer
        parts.append(t.clone())
    for shard, cache in zip(shards, caches):
        tp.forward(shard, ids, cache, 0, reduce_later)
    assert len(parts) == 2 * 2 * len(shards)  # two all-reduces per layer per rank


def test_two_processes_over_gloo_give_the_logits_and_tokens_of_one(tiny, prompt):
    state, config = tiny.state_dict(), tiny.config
    one = tp.run(1, prompt, steps=4, state=state, config=config, timeout=120)
    two = tp.run(2, prompt, steps=4, state=state, config=config, timeout=120)
    library = tiny(torch.tensor([prompt])).logits[0, -1].float()
    assert torch.allclose(one["logits"], library, atol=1e-4, rtol=1e-4)
    assert (two["logits"] - one["logits"]).abs().max() < 1e-4
    greedy = tiny.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5)[0, len(prompt):]
    assert two["tokens"] == one["tokens"] == greedy.tolist()
    assert len(two["step_s"]) == 4 and all(r > 0 for r in two["reduce_s"]) and all(r == 0 for r in one["reduce_s"])


def test_a_rank_that_fails_is_reported_not_hung(tiny, prompt):
    state = {k: v for k, v in tiny.state_dict().items() if "layers.1.mlp.down_proj" not in k}
    with pytest.raises(RuntimeError, match=r"rank \d: KeyError"):
        tp.run(2, prompt, steps=2, state=state, config=tiny.config, timeout=120)


@pytest.mark.slow
def test_the_real_model_split_in_three(model, prompt):
    """SmolLM2 (9 query heads, 3 key/value heads) over three processes, each loading the model from the cache."""
    three = tp.run(3, prompt, steps=6, timeout=600)
    library = model(torch.tensor([prompt])).logits[0, -1].float()
    assert (three["logits"] - library).abs().max() < 1e-3
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False, min_new_tokens=7)[0, len(prompt):]
    assert three["tokens"] == greedy.tolist()
