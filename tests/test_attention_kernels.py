"""Lesson 16's kernels against their references: online softmax against softmax, tiled attention against torch's
SDPA on the model's real queries, keys and values, paged decode attention against the gather, and the paged
cache's decode path (through the tables) against its gather path on whole runs."""
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.engine.request import Job
from course_lib.engine.generation import run_paged
from course_lib.runner.attention_kernels import (Partial, attention_traffic, decode_plan, gather_decode, merge,
                                                 online_softmax, paged_decode, paged_decode_by_hand,
                                                 partial_attention, score_matrix_bytes, tiled_attention,
                                                 written_out_attention)
from course_lib.text.context import chat_ids, handbook_ids, HANDBOOK_QUESTIONS
from course_lib.measure.attention import peak_bytes, scattered_rows
from course_lib.runner.model import Model, layer_qkv
from course_lib.runner.paged import BlockPool
from course_lib.runner.blocks import Sequence


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


@pytest.fixture(scope="module")
def real_qkv(ours, tokenizer):
    """Layer 7's queries, keys and values on 150 tokens of the handbook prompt (9 query heads over 3 key/value heads)."""
    return layer_qkv(ours, handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])[:150], 7)


# ----- online softmax and the merge rule -----

@pytest.mark.parametrize("length,piece", [(1, 1), (7, 1), (7, 3), (7, 7), (7, 100), (64, 5), (300, 64)])
def test_online_softmax_equals_softmax(length, piece):
    row = torch.randn(length, generator=torch.Generator().manual_seed(length)) * 5
    probs, trace = online_softmax(row, piece)
    assert torch.allclose(probs, torch.softmax(row, 0), atol=1e-6, rtol=1e-5)
    assert len(trace) == math.ceil(length / piece) and trace[-1][0] == pytest.approx(float(row.max()))


def test_online_softmax_handles_minus_infinity_anywhere():
    row = torch.tensor([float("-inf"), float("-inf"), 2.0, float("-inf"), -1.0, 30.0, float("-inf")])
    for piece in (1, 2, 3):  # the first pieces are all -inf: the running max is -inf there and must not give NaN
        assert torch.allclose(online_softmax(row, piece)[0], torch.softmax(row, 0), atol=1e-7)


def test_online_softmax_without_the_rescale_is_wrong():
    """The rule's one subtle step: when the maximum grows, the old sum shrinks by exp(m_old - m_new). Skip it
    and the answer is wrong whenever a later piece holds a larger value: the check above would catch it."""
    row = torch.tensor([1.0, 2.0, 8.0, 3.0])
    m, l = float("-inf"), 0.0
    for x in (row[:2], row[2:]):
        m = max(m, float(x.max()))
        l = l + float(torch.exp(x - m).sum())  # the rescale of l is missing
    assert not torch.allclose(torch.exp(row - m) / l, torch.softmax(row, 0), atol=1e-3)


def test_bad_softmax_input_is_refused():
    with pytest.raises(ValueError, match="one non-empty row"):
        online_softmax(torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="whole number"):
        online_softmax(torch.zeros(3), 0)


def test_merging_partials_over_split_keys_gives_attention_over_all(real_qkv):
    q, k, v = (t[0, :3].float() for t in real_qkv)  # first key/value head's group: q (3, T, D)... one head each
    q, k, v = q[0, -1:], k[0], v[0]  # one query against 150 keys
    whole = partial_attention(q, k, v)
    for cut in (1, 40, 149):
        left, right = partial_attention(q, k[:cut], v[:cut]), partial_attention(q, k[cut:], v[cut:])
        both = merge(left, right)
        assert torch.allclose(both.out, whole.out, atol=1e-6) and torch.allclose(both.lse, whole.lse, atol=1e-5)
    empty = Partial(torch.zeros_like(whole.out), torch.full_like(whole.lse, float("-inf")))
    assert torch.equal(merge(whole, empty).out, whole.out)  # a part with no keys weighs nothing
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    assert torch.allclose(whole.out, ref, atol=1e-6)


# ----- tiled attention -----

@pytest.mark.parametrize("tile_q,tile_k", [(16, 16), (64, 32), (7, 13), (150, 150), (1000, 1)])
def test_tiled_attention_equals_sdpa_on_the_models_real_tensors(real_qkv, tile_q, tile_k):
    q, k, v = real_qkv
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (tiled_attention(q, k, v, tile_q=tile_q, tile_k=tile_k) - ref).abs().max() <= 1e-5


def test_the_written_out_reference_equals_sdpa(real_qkv):
    q, k, v = real_qkv
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (written_out_attention(q, k, v) - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("new", [1, 5])
def test_tiled_attention_with_a_cache_equals_sdpa(real_qkv, new):
    """Decode (one new query) and a chunk (several) against keys that are already cached."""
    q, k, v = real_qkv
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, -new:]
    out = tiled_attention(q[:, :, -new:], k, v, start=k.shape[2] - new, tile_q=4, tile_k=32)
    assert (out - ref).abs().max() <= 1e-5


def test_tiles_after_the_diagonal_are_skipped(real_qkv):
    q, k, v = real_qkv
    trace = []
    tiled_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], tile_q=16, tile_k=16, trace=trace)
    assert [(qs, ks) for qs, ks, _ in trace] == [(qs, ks) for qs in range(0, 64, 16) for ks in range(0, qs + 16, 16)]
    running = torch.stack([m for qs, _, m in trace if qs == 48])  # the running max never falls
    assert (running[1:] >= running[:-1]).all()


def test_tiled_attention_refuses_mismatched_shapes(real_qkv):
    q, k, v = real_qkv
    with pytest.raises(ValueError, match="keys cover"):
        tiled_attention(q, k[:, :, :10], v[:, :, :10])


def test_traffic_counts_follow_the_shapes():
    out = attention_traffic(1024, 9, 3, 64)
    scores = 9 * 1024 * 1024 * 4
    assert out["written"] == 2 * scores + 9 * 1024 * 64 * 4
    tiles = attention_traffic(1024, 9, 3, 64, tile=256)  # 4 query tiles read 1 + 2 + 3 + 4 key/value tiles
    assert tiles["read"] == 9 * 1024 * 64 * 4 + 10 * 2 * 3 * 256 * 64 * 4
    assert tiles["written"] < out["written"] / 30  # the output only, against two score matrices


def test_the_score_matrix_size_follows_the_formula():
    assert score_matrix_bytes(8192, 9) == 8192 * 8192 * 9 * 4 == 2_415_919_104


# ----- paged decode attention -----

def pool_and_rows(lengths, block_size, seed=0):
    """Random pool (slots, 3, 64), rows' blocks scattered; the gather's read slots, right-aligned."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(per) + 2, generator=g).tolist()
    keys, values = (torch.randn((sum(per) + 2) * block_size, 3, 64, generator=g) for _ in range(2))
    tables, at = [], 0
    for n in per:
        tables.append(order[at:at + n] + [order[at]] * (max(per) - n))
        at += n
    S = max(lengths)
    read = []
    for table, n in zip(tables, lengths):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        read.append([slots[0]] * (S - n) + slots)
    q = torch.randn(len(lengths), 9, 64, generator=g)
    return q, keys, values, torch.tensor(tables), torch.tensor(lengths), torch.tensor(read)


@pytest.mark.parametrize("lengths,block_size", [([1], 16), ([40, 3, 17], 16), ([100, 99], 8), ([1000], 16), ([33, 64], 32)])
@pytest.mark.parametrize("tile_tokens,splits", [(16, 1), (64, 3), (1024, 1), (10_000, 2)])
def test_paged_decode_equals_the_gather(lengths, block_size, tile_tokens, splits):
    q, keys, values, tables, lens, read = pool_and_rows(lengths, block_size)
    ref = gather_decode(q, keys, values, read, lens)
    out = paged_decode(q, keys, values, decode_plan(tables, lens, block_size, tile_tokens, splits), block_size)
    assert (out - ref).abs().max() <= 1e-5


def test_walking_the_blocks_by_hand_equals_the_gather():
    q, keys, values, tables, lens, read = pool_and_rows([70, 21], 16)
    ref = gather_decode(q, keys, values, read, lens)
    steps = []
    out = paged_decode_by_hand(q[0], keys, values, tables[0].tolist(), 70, 16, steps)
    assert (out - ref[0]).abs().max() <= 1e-5
    assert [b for b, _ in steps] == tables[0, :5].tolist()  # 70 tokens: 5 blocks, the last part-full
    assert torch.allclose(sum(share for _, share in steps), torch.ones(9))  # every block's share of the mass


def test_a_tile_holds_about_the_tile_budget_whatever_the_batch():
    tables, lengths = torch.zeros(4, 64, dtype=torch.long), torch.full((4,), 1000)
    plan = decode_plan(tables, lengths, 16, tile_tokens=1024)
    assert {t.tokens for t in plan} == {256} and len(plan) == 4  # 4 rows x 256 tokens per tile
    assert len(decode_plan(tables[:1], lengths[:1], 16, tile_tokens=1024)) == 1
    assert {t.split for t in decode_plan(tables, lengths, 16, 1024, splits=4)} == {0, 1, 2, 3}


def test_bad_plans_are_refused():
    tables = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit"):
        decode_plan(tables, torch.tensor([49, 10]), 16)
    with pytest.raises(ValueError, match="do not fit"):
        decode_plan(tables, torch.tensor([0, 10]), 16)
    with pytest.raises(ValueError, match="split-K"):
        decode_plan(tables, torch.tensor([4, 10]), 16, splits=0)
    with pytest.raises(ValueError, match="lengths"):
        decode_plan(tables, torch.tensor([4]), 16)


# ----- the paged cache's decode path -----

def test_the_pool_refuses_an_unknown_attention(ours):
    with pytest.raises(ValueError, match="decode attention is one of"):
        BlockPool.for_model(ours, 4, attention="flash")


def test_decode_reads_in_place_and_prefill_through_the_gather(ours):
    pool = BlockPool.for_model(ours, 4)
    seq = Sequence([1, 2, 3])
    pool.grow(seq, 4)
    view = pool.view([seq])
    view.reserve(3)
    assert not view.reads_in_place  # a prompt: the gather
    seq.computed = 3
    view.reserve(4)
    assert view.reads_in_place
    with pytest.raises(RuntimeError, match="call attend"):
        view.write(0, torch.zeros(1, 3, 1, 64), torch.zeros(1, 3, 1, 64), 3)


def test_paged_and_gathered_decode_give_the_same_runs(ours, tokenizer):
    stop = {2}
    prompts = [chat_ids(tokenizer, q) for q in ("Why is the sky blue?", "Name three colours.", "What is 12 times 7?")]
    tokens = {}
    for attention in ("paged", "gather"):
        jobs = [Job(f"r{i}", p, 12, stop) for i, p in enumerate(prompts)]
        run_paged(ours, jobs, BlockPool.for_model(ours, 32, attention=attention), arrivals=[0, 1, 4])
        tokens[attention] = [j.tokens for j in jobs]
    assert tokens["paged"] == tokens["gather"]


def test_on_a_really_prefilled_pool_both_paths_give_the_same_logits(ours, tokenizer):
    from course_lib.measure.attention import same_output
    result = same_output(ours, tokenizer)
    assert result["same"] and result["paged_logits_max_diff"] <= 1e-4, result


def test_a_scattered_decode_step_allocates_no_copy_of_the_context(ours):
    """Random keys and values (their values do not change what is allocated): the gather holds a layer's whole
    copy, the paged step at most a tile's worth."""
    runs = {name: scattered_rows(ours, 4, 1000, 16, name) for name in ("paged", "gather")}
    from course_lib.measure.attention import decode_step, gather_bytes
    peaks = {}
    for name, (pool, seqs) in runs.items():
        pairs = [(a, b) for s in seqs for a, b in zip(s.blocks, s.blocks[1:])]
        assert sum(b - a == 1 for a, b in pairs) < len(pairs) / 4  # scattered: few blocks follow their predecessor
        peaks[name] = peak_bytes(lambda: decode_step(ours, pool, seqs))[0]
    per_layer = gather_bytes(*runs["gather"]) // 30
    tile = 2 * 1024 * 3 * 64 * 4  # keys and values of the plan's 1,024 tokens
    assert peaks["gather"] >= per_layer and peaks["paged"] < per_layer / 2  # 6.2 MB copied per layer against tiles
    assert peaks["paged"] >= tile  # the tile is counted: the measure sees the staged blocks


def test_peak_bytes_counts_allocations_not_views():
    x = torch.zeros(1000)
    assert peak_bytes(lambda: torch.ones(256))[0] == 1024
    assert peak_bytes(lambda: x.view(10, 100).t())[0] == 0
    assert peak_bytes(lambda: x.clone())[0] == 4000
    assert peak_bytes(lambda: [torch.ones(100) for _ in range(3)][-1])[0] == 400 * 3
