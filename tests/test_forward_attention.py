import pytest
import torch

import course_lib
from course_lib.runner.attention import (apply_rotary, attention_by_hand, attention_weights, kv_groups,
                                         rotary_cos_sin, score_times, top_attended)
from course_lib.runner.forward import forward_logits
from course_lib.inside.anatomy import (block_by_hand, capture_shapes, flops_per_token, layer_outputs, logit_lens,
                                       memory_by_dtype, parameter_map)

TEXT = "What is the capital of France?"


@pytest.fixture(scope="module")
def eager():
    return course_lib.load_model(device="cpu", attn_implementation="eager", verbose=False)


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def test_parameter_map_totals_the_model(model):
    parts = parameter_map(model)
    assert sum(n for _, n in parts) == sum(p.numel() for p in model.parameters()) == 134_515_008
    assert parts[-1] == ("output head (tied to embedding)", 0)
    assert memory_by_dtype(1_000)["float32"] == 4_000 and memory_by_dtype(1_000)["bfloat16"] == 2_000


def test_shapes_through_the_model(model, ids):
    shapes = dict(capture_shapes(model, ids))
    T = len(ids)
    assert shapes["embedding"] == (1, T, 576)
    assert shapes["block 0: k projection"] == (1, T, 192)  # 3 key/value heads x 64
    assert shapes["block 0: feed-forward up"] == (1, T, 1536)
    assert all(shapes[f"block {i}"] == (1, T, 576) for i in range(30))
    assert shapes["output head (logits)"] == (1, T, 49152)


def test_logit_lens_last_row_is_the_real_prediction(model, ids):
    top, probs = logit_lens(model, ids)
    assert top.shape == (31, len(ids), 1)
    assert torch.equal(top[-1, :, 0], forward_logits(model, ids)[0].argmax(-1))
    assert ((probs > 0) & (probs <= 1)).all()


def test_paris_appears_in_the_lens(model, tokenizer):
    lens_ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    top, _ = logit_lens(model, lens_ids)
    assert tokenizer.decode([int(top[-1, -1, 0])]) == " Paris"


@pytest.mark.parametrize("layer", [0, 7, 29])
def test_block_by_hand_matches_the_library(model, ids, layer):
    hidden = layer_outputs(model, ids)
    assert torch.allclose(block_by_hand(model.model.layers[layer], hidden[layer], model.config), hidden[layer + 1],
                          atol=1e-4)


def test_block_without_rotary_does_not_match(model, ids, monkeypatch):
    """The equivalence test can fail: drop the rotary positions and the block no longer matches."""
    import course_lib.runner.attention as att
    hidden = layer_outputs(model, ids)
    monkeypatch.setattr(att, "apply_rotary", lambda x, cos, sin: x)
    assert not torch.allclose(block_by_hand(model.model.layers[3], hidden[3], model.config), hidden[4], atol=1e-3)


def test_attention_weights_are_causal_distributions(eager, ids):
    w = attention_weights(eager.model, ids)
    T = len(ids)
    assert w.shape == (30, 9, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(30, 9, T), atol=1e-5)
    assert (w.triu(diagonal=1) == 0).all()


def test_sdpa_model_refuses_to_give_weights(model, ids):
    with pytest.raises(ValueError, match="eager"):
        attention_weights(model, ids)


@pytest.mark.parametrize("layer", [0, 13, 29])
def test_head_by_hand_matches_the_model(eager, ids, layer):
    w = attention_weights(eager.model, ids)
    hidden = layer_outputs(eager.model, ids)
    _, ours = attention_by_hand(eager.model.model.layers[layer], hidden[layer], eager.model.config)
    assert torch.allclose(ours, w[layer], atol=1e-5)


def test_rotary_matches_the_library(model):
    pos = torch.arange(7)
    cos, sin = rotary_cos_sin(pos, 64, model.config.rope_parameters["rope_theta"])
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1, 7, 576), pos[None])
    assert torch.allclose(cos, ref_cos[0], atol=1e-5) and torch.allclose(sin, ref_sin[0], atol=1e-5)
    x = torch.randn(3, 7, 64)
    assert torch.allclose(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-4)  # a rotation


def test_kv_groups(model):
    assert kv_groups(model.config) == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8]}


def test_top_attended_finds_the_maximum():
    w = torch.zeros(2, 3, 4, 4)
    w[1, 2, 3, 1] = 0.9
    assert top_attended(w, 3, 1, k=1) == [(1, 2, pytest.approx(0.9))]


def test_score_times_and_flops():
    runs = score_times([16, 32, 48], 2, 8, repeats=3)
    assert [len(r) for r in runs] == [3, 3, 3] and all(s > 0 for r in runs for s in r)
    assert flops_per_token(100, 10) == 200  # the tied head is a full product for every token
    assert flops_per_token(110, 10, tied=False) == 200
