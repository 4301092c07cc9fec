"""Causal probes: the controls of ablation and patching, and patching checked against a second implementation
(the course's own model run block by block, course_lib.runner.model's functions, with the patch written in between)."""
import pytest
import torch

from course_lib.inside import probes
from course_lib.runner.model import Model, block, embed, head

CLEAN = ("What is the capital of France?", "The capital of France is")
CORRUPT = ("What is the capital of Germany?", "The capital of Germany is")


@pytest.fixture(scope="module")
def pair(tokenizer):
    clean, corrupt = probes.answer_ids(tokenizer, *CLEAN), probes.answer_ids(tokenizer, *CORRUPT)
    return clean, corrupt, probes.token_id(tokenizer, " Paris"), probes.token_id(tokenizer, " Berlin")


def test_the_prompts_differ_only_at_the_country(pair):
    clean, corrupt, _, _ = pair
    differ = [i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b]
    assert len(clean) == len(corrupt) and len(differ) == 2 and probes.first_difference(clean, corrupt) == differ[0]


def test_the_real_model_knows_both_answers(model, pair):
    """The metric is meaningful: clean prefers Paris, corrupted prefers Berlin."""
    clean, corrupt, good, bad = pair
    p = probes.patch_residual(model, clean, corrupt, good, bad, positions=[len(clean) - 1])
    assert p["clean"] > 3 and p["corrupt"] < -3


def test_patching_controls(tiny, pair):
    clean, corrupt, good, bad = pair
    differ = probes.first_difference(clean, corrupt)
    p = probes.patch_residual(tiny, clean, corrupt, good, bad, positions=list(range(len(clean))))
    r = p["recovered"]  # (L + 1, T)
    assert r[:, :differ].abs().max() < 1e-4  # before the first difference both runs are the same: nothing changes
    assert abs(float(r[-1, -1]) - 1) < 1e-4  # the whole final residual at the last position: all of it comes back
    same = [i for i in range(differ + 1, len(clean)) if clean[i] == corrupt[i]]
    assert r[0, same].abs().max() < 1e-4  # the embedding of a token both prompts share: nothing to patch
    fast = probes.patch_residual(tiny, clean, corrupt, good, bad)  # the default: only from the first difference on
    assert fast["positions"][0] == differ and torch.allclose(fast["recovered"], r[:, differ:], atol=1e-4)


def test_ablation_controls(tiny, pair):
    clean, _, good, bad = pair
    L, H = tiny.config.num_hidden_layers, tiny.config.num_attention_heads
    D = tiny.config.hidden_size // H
    outputs = probes.head_outputs(tiny, clean)  # (L, T, H, D)
    assert outputs.shape == (L, len(clean), H, D)
    means = probes.mean_head_outputs(tiny, [clean, clean[:-3]])
    for m in (None, means):
        effects, base = probes.ablate_heads(tiny, clean, good, bad, means=m)
        assert effects.shape == (L, H) and (effects != 0).any()  # removing a head does move this model
        assert probes.ablated_metric(tiny, clean, good, bad, [], means=m) == pytest.approx(base, abs=1e-6)  # nothing
        for layer, h in [(0, 0), (L - 1, H - 1)]:  # the batched sweep agrees with one head ablated alone
            alone = probes.ablated_metric(tiny, clean, good, bad, [(layer, h)], means=m)
            assert alone - base == pytest.approx(float(effects[layer, h]), abs=1e-4)
    with pytest.raises(ValueError, match="no head"):
        probes.ablated_metric(tiny, clean, good, bad, [(L, 0)])


def test_patching_agrees_with_a_second_implementation(tiny, pair):
    """The library's hooks against the course's own model run block by block with the patch in between."""
    clean, corrupt, good, bad = pair
    ours = Model.from_transformers(tiny)
    T = len(clean)
    positions = torch.arange(T)[None]  # (1, T)
    cos, sin = ours.cos[positions].unsqueeze(1), ours.sin[positions].unsqueeze(1)

    def run(ids, patch=None):  # patch = (layer, position, stream): block inputs 0..L-1, then L = the last output
        x = embed(ours, torch.tensor([ids]))
        streams = []
        for i in range(len(ours.layers) + 1):
            if patch and patch[0] == i:
                x = x.clone()
                x[0, patch[1]] = patch[2][i][patch[1]]
            streams.append(x[0].clone())
            if i < len(ours.layers):
                x = block(ours, i, x, cos, sin, None, 0, None)
        logits = head(ours, x[:, -1:])[0, -1]
        return float(logits[good] - logits[bad]), streams

    m_clean, stream = run(clean)
    m_corrupt, _ = run(corrupt)
    p = probes.patch_residual(tiny, clean, corrupt, good, bad)
    assert p["clean"] == pytest.approx(m_clean, abs=1e-4) and p["corrupt"] == pytest.approx(m_corrupt, abs=1e-4)
    for layer in range(len(ours.layers) + 1):
        for j, pos in enumerate(p["positions"]):
            want = (run(corrupt, (layer, pos, stream))[0] - m_corrupt) / (m_clean - m_corrupt)
            assert float(p["recovered"][layer, j]) == pytest.approx(want, abs=1e-3), (layer, pos)


def test_head_patching_of_every_head_at_once_is_the_whole_attention(tiny, pair):
    clean, corrupt, good, bad = pair
    r = probes.patch_heads(tiny, clean, corrupt, good, bad)
    assert r.shape == (tiny.config.num_hidden_layers, tiny.config.num_attention_heads)
    assert torch.isfinite(r).all()


def test_attention_to_and_top_heads():
    w = torch.zeros(2, 3, 4, 4)
    w[1, 2, -1, 1] = 0.75
    w[1, 2, -1, 2] = 0.25
    scores = probes.attention_to(w, -1, [1, 2])
    assert scores[1, 2] == 1.0 and scores.sum() == 1.0
    assert probes.top_heads(scores, 1) == [(1, 2, 1.0)]


def test_bad_inputs_are_refused(tiny, tokenizer):
    with pytest.raises(ValueError, match="one-token answer"):
        probes.token_id(tokenizer, " Washington D.C.")
    with pytest.raises(ValueError, match="same length"):
        probes.patch_residual(tiny, [1, 2, 3], [1, 2], 5, 6)


def test_feed_forward_ablation_controls(tiny, pair):
    """Each row of the batched sweep ablates one layer's feed-forward block: it agrees with that layer ablated alone
    (a hook of our own, written here again), and mean ablation by the prompt's own activations at every position
    changes nothing."""
    clean, _, good, bad = pair
    L = tiny.config.num_hidden_layers
    acts = probes.mlp_inputs(tiny, clean)  # (L, T, I)
    assert acts.shape[:2] == (L, len(clean))
    means = probes.mean_mlp_inputs(tiny, [clean, clean[:-2]])
    for m in (None, means):
        effects, base = probes.ablate_mlps(tiny, clean, good, bad, means=m)
        assert effects.shape == (L,) and (effects != 0).any()
        for layer in (0, L - 1):
            def hook(mod, args):
                return (torch.zeros_like(args[0]) if m is None else m[layer].expand_as(args[0]).to(args[0].dtype),)
            handle = tiny.model.layers[layer].mlp.down_proj.register_forward_pre_hook(hook)
            try:
                with torch.inference_mode():
                    logits = tiny(input_ids=torch.tensor([clean])).logits[0, -1]
            finally:
                handle.remove()
            assert float(logits[good] - logits[bad]) - base == pytest.approx(float(effects[layer]), abs=1e-4)
    short = clean[:1]  # one position: its mean activation is its own, so replacing it by the mean changes nothing
    own = probes.mean_mlp_inputs(tiny, [short])
    effects, _ = probes.ablate_mlps(tiny, short, good, bad, means=own)
    assert effects.abs().max() < 1e-4


def test_a_feed_forward_block_matters_for_the_real_answer(model, pair):
    clean, _, good, bad = pair
    effects, base = probes.ablate_mlps(model, clean, good, bad)  # zero ablation
    assert base > 3 and float(effects.min()) < -base / 2  # some layer's block carries much of the answer
