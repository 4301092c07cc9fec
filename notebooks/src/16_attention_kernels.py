# %% [markdown]
# # 16 · Attention kernels: softmax in pieces, attention in tiles, decode through the pages
#
# **Goal.** Lesson 04 computed attention the way a textbook writes it: every query against every key, a
# T x T matrix of scores, softmax over each row, then the values. Engines never hold that matrix. They
# compute softmax in pieces with a running maximum (online softmax), attention tile by tile
# (FlashAttention), and at decode time they read each sequence's keys and values from the blocks of a
# paged pool where they lie (PagedAttention), merging partial results (FlashDecoding). This lesson writes
# each of them in plain torch, proves it equal to the reference on the model's real tensors, and measures
# what it saves.
#
# **You will**
# - size the score matrix against the context and see where its memory goes;
# - compute a softmax in pieces by hand, then a real attention row of the model;
# - run attention tile by tile and watch the running maximum;
# - walk a block table one block at a time, then run the vectorised version the course's paged cache now
#   uses, and time it against copying the blocks into one tensor first.

# %% [markdown]
# ## Set-up

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import course_lib
from course_lib.views import plots_kernels
from course_lib.runner.attention_kernels import (attention_traffic, decode_plan, merge, online_softmax, paged_decode,
                                                 paged_decode_by_hand, partial_attention, score_matrix_bytes,
                                                 tiled_attention, written_out_attention)
from course_lib.text.context import HANDBOOK_QUESTIONS, handbook_ids
from course_lib.runner.forward import run_model
from course_lib.runner.kv_cache import model_kv_bytes_per_token
from course_lib.measure.attention import layer_shaped, peak_bytes, step_times
from course_lib.runner.model import Model, layer_qkv
from course_lib.runner.paged import BlockPool
from course_lib.runner.blocks import Sequence

torch.set_num_threads(1)  # one thread, set explicitly: the timings below compare paths within this run
model, tokenizer = course_lib.load_model()
ours = Model.from_transformers(model)  # lesson 11's model, float32, on the library's weights
H, KV, D = ours.heads, ours.kv_heads, ours.head_dim
print(f"{len(ours.layers)} layers, {H} query heads sharing {KV} key/value heads of {D} numbers | threads:",
      torch.get_num_threads())

# %% [markdown]
# ## 1. Why the score matrix is the problem
#
# Written out, one layer's attention over T tokens holds a T x T score matrix per query head, then a
# second one after softmax. The KV cache grows with T; the scores grow with T squared. From the model's
# own shapes:

# %%
tokens = [512, 1024, 2048, 4096, 8192]
scores = [score_matrix_bytes(t, H) for t in tokens]
kv = [model_kv_bytes_per_token(model.config, torch.float32) * t for t in tokens]
weights = ours.weight_bytes()
for t, s, k in zip(tokens, scores, kv):
    print(f"{t:>5} tokens: scores of one layer {s / 1e6:8.1f} MB | KV cache of all {len(ours.layers)} layers "
          f"{k / 1e6:6.1f} MB | weights {weights / 1e6:.0f} MB")
plots_kernels.plot_score_memory(tokens, scores, kv, weights)
plt.show()

# %% [markdown]
# At the model's full window of 8,192 tokens, one layer's scores in float32 outweigh every weight of the
# model several times over, and a prompt that long runs 30 layers. Measured, not computed: the bytes of
# every tensor torch allocates while one layer's attention runs over 2,048 tokens (random values, the
# model's shapes), written out as lesson 04 did (`written_out_attention`) against torch's own
# `scaled_dot_product_attention` (SDPA):

# %%
q, k, v = layer_shaped(ours, 2048)  # random values with the model's head shapes
naive_peak, naive_out = peak_bytes(lambda: written_out_attention(q, k, v))  # the whole (1, H, T, T) matrix
sdpa_peak, sdpa_out = peak_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
print(f"2,048 tokens, one layer: written out allocates {naive_peak / 1e6:.0f} MB at its peak, SDPA {sdpa_peak / 1e6:.1f} MB "
      f"(its output alone is {sdpa_out.numel() * 4 / 1e6:.1f} MB); same result within "
      f"{(naive_out - sdpa_out).abs().max():.1e}")

# %% [markdown]
# On this CPU, torch's SDPA already allocates little more than its output: its CPU kernel is itself a
# tiled one (the counter sees the tensors operators return, not a kernel's private scratch space, which
# for a tiled kernel is one tile per thread). The rest of the lesson writes that algorithm out.
#
# ## 2. Softmax in pieces
#
# softmax(x)_i = exp(x_i - m) / l, with m the row's maximum and l the sum of exp(x_j - m). To compute it
# without seeing the whole row at once, keep a running maximum m and a running sum l. When a new piece
# arrives, the maximum may grow; the sum so far was taken against the old maximum, so it is multiplied by
# exp(m_old - m_new) before the piece's own terms are added. A small row, in pieces of two:

# %%
row = torch.tensor([2.0, 5.0, 1.0, 7.0, 3.0, 4.0])
probs, trace = online_softmax(row, 2)
for i, (m, l) in enumerate(trace):
    print(f"after piece {i + 1} {row[2 * i:2 * i + 2].tolist()}: running max {m:.0f}, running sum {l:.4f}")
print("online:", [round(p, 4) for p in probs.tolist()])
print("torch: ", [round(p, 4) for p in torch.softmax(row, 0).tolist()])

# %% [markdown]
# The sum after the second piece is not the first sum plus the new terms: the maximum jumped from 5 to 7,
# and the old terms shrank by exp(5 - 7) before being added. Now a real row: the scores of the last query
# of the handbook question (lesson 13's long prompt) against all its keys, in layer 10, head 0.

# %%
ids = handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])
q10, k10, v10 = layer_qkv(ours, ids, 10)  # (1, H, T, D), (1, KV, T, D), (1, KV, T, D), rotary applied
real_row = (q10[0, 0, -1] @ k10[0, 0].T) / D ** 0.5  # head 0 uses key/value head 0
for piece in (1, 16, 128, len(ids)):
    got, steps = online_softmax(real_row, piece)
    print(f"pieces of {piece:>4}: {len(steps):>4} pieces, largest difference from torch.softmax "
          f"{(got - torch.softmax(real_row, 0)).abs().max():.1e}")

# %% [markdown]
# ## 3. Merging partial results
#
# The same rule merges whole attention outputs. Attend one query to the first part of the keys, then
# separately to the rest: each part gives an output normalised over its own keys and the log of its
# softmax denominator (lse = m + log l). The merge weighs each output by its share of the total mass,
# exp(lse_part - lse_total). This is what lets a kernel split keys across tiles, blocks or processors.

# %%
qh, kh, vh = q10[0, 0, -1:], k10[0, 0], v10[0, 0]  # head 0's last query, its keys and values
whole = partial_attention(qh, kh, vh)
for cut in (100, len(ids) // 2, len(ids) - 1):
    left, right = partial_attention(qh, kh[:cut], vh[:cut]), partial_attention(qh, kh[cut:], vh[cut:])
    both = merge(left, right)
    share = torch.exp(left.lse - whole.lse).item()
    print(f"keys cut at {cut:>4}: the first part holds {share:.1%} of the mass; merged output differs from the "
          f"whole by {(both.out - whole.out).abs().max():.1e}")

# %% [markdown]
# ## 4. Attention in tiles (FlashAttention's forward)
#
# Take a tile of queries and walk the key tiles left to right, keeping per query a running maximum, a
# running sum and a running output, all rescaled whenever the maximum grows. Only one tile of scores
# exists at a time. In causal attention a key tile wholly after the query tile's last query contributes
# nothing, so it is never read. Here on layer 10's real queries, keys and values (all heads), in tiles of
# 128 x 128:

# %%
tile = 128
trace = []
tiled = tiled_attention(q10, k10, v10, tile_q=tile, tile_k=tile, trace=trace)
reference = F.scaled_dot_product_attention(q10, k10, v10, is_causal=True, enable_gqa=True)
print(f"{len(ids)} tokens in tiles of {tile}: {len(trace)} tiles computed; largest difference from SDPA "
      f"{(tiled - reference).abs().max():.1e}")
last = trace[-1][0]
plots_kernels.plot_tiles(trace, len(ids), tile, tile, query_tile=last, head=0)
plt.show()

# %% [markdown]
# Left: the order in which the tiles are computed, and the tiles after the diagonal that causal attention
# skips (close to half; the title counts them). Right: for the
# last query tile, each query's running maximum after each key tile. Where a line steps up, everything
# summed before is scaled down by exp(old - new); where it is flat, nothing is rescaled. The tiles of
# different query rows are independent: a GPU kernel gives each its own block of threads.
#
# A decode step is the same function with one query at the end of the context (`start`), and so is a
# chunk of a prompt against a cache. The bytes at 4,096 tokens, measured as in section 1 (random values,
# the model's shapes):

# %%
decode = tiled_attention(q10[:, :, -1:], k10, v10, start=len(ids) - 1)
print(f"decode of the last token: differs from SDPA's last row by {(decode - reference[:, :, -1:]).abs().max():.1e}")
q, k, v = layer_shaped(ours, 4096)
tiled_peak = peak_bytes(lambda: tiled_attention(q, k, v, tile_q=256, tile_k=256))[0]
sdpa_peak = peak_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))[0]
print(f"4,096 tokens, one layer: tiled {tiled_peak / 1e6:.1f} MB at its peak, SDPA {sdpa_peak / 1e6:.1f} MB; "
      f"written out it would hold {2 * score_matrix_bytes(4096, H) / 1e6:,.0f} MB of scores and probabilities")
for n in (4096, 8192):  # counted from the shapes: what each version moves to and from memory
    out, tiles = attention_traffic(n, H, KV, D), attention_traffic(n, H, KV, D, tile=256)
    print(f"{n} tokens, one layer: written out reads {out['read'] / 1e6:,.0f} MB and writes {out['written'] / 1e6:,.0f} MB; "
          f"in tiles of 256 it reads {tiles['read'] / 1e6:,.0f} MB and writes {tiles['written'] / 1e6:,.0f} MB")

# %% [markdown]
# The counts say where the time of a long prefill goes when the matrix is written out: moving it, four
# passes over T x T numbers per head, against re-reading the keys and values once per query tile. Our
# version allocates more than SDPA's kernel (a tile of scores, of probabilities and of partial outputs
# per step, each a separate tensor), but beyond its output a fixed amount: nothing in it grows with the
# square of the context.
#
# ## 5. Decode through the pages
#
# Lesson 13's pool keeps a sequence's keys and values in blocks scattered over the pool; a block table
# says where. Until this lesson the course's paged cache copied every row's blocks into one padded tensor
# per layer at every decode step (the gather), then ran attention on the copy. Instead, walk the table:
# attend to each block where it lies (a view of the pool, nothing copied), merge as you go. Here the
# handbook question is prefilled into a pool of blocks of 64 tokens handed out in a shuffled order (as
# after many requests), then its last query of layer 10 walks the table:

# %%
pool = BlockPool.for_model(ours, num_blocks=40, block_size=64)
pool.manager.shuffle(seed=0)
seq = Sequence(list(ids))
pool.grow(seq, len(ids))
run_model(ours, torch.tensor([ids]), pool.view([seq]))  # the prompt's prefill fills the blocks
print("block table:", seq.blocks)
steps = []
by_hand = paged_decode_by_hand(q10[0, :, -1], pool.keys[10], pool.values[10], seq.blocks, len(ids), 64, steps)
print(f"walked {len(steps)} blocks; differs from SDPA's last row by {(by_hand - reference[0, :, -1]).abs().max():.1e}")
shares = [float(share.mean()) for _, share in steps]
top = max(range(len(shares)), key=shares.__getitem__)
print(f"share of the mass, averaged over heads: first block {shares[0]:.0%}, last block {shares[-1]:.0%}, largest: "
      f"logical block {top} ({shares[top]:.0%})")
plots_kernels.plot_block_walk(seq.blocks, shares)
plt.show()

# %% [markdown]
# Each bar is one block's share of the softmax mass, averaged over heads: the weight its partial result
# gets in the merge. Read where the mass sits in the printed line: the first block holds the first tokens,
# on which many heads park attention they do not need elsewhere (lesson 04's heatmaps showed it), and the
# last block holds the question itself. The merge does not care: every block's result is weighed by
# exactly its share.
#
# A Python loop over blocks teaches the algorithm and is slow. The vectorised version plans the walk once
# per step for every layer (`decode_plan`): it reads a tile of whole blocks of every row at once (about
# 1,024 tokens in all, a copy small enough to stay in the processor's cache and be used at once), runs
# torch's fused kernel on the tile, which also returns the log-sum-exp, and merges tiles by the rule of
# section 3. With `splits`, the blocks are cut into ranges whose partial results are computed apart and
# merged at the end: split-K, what FlashDecoding does to keep a GPU busy on one long sequence.

# %%
tables, lengths = torch.tensor([seq.blocks]), torch.tensor([len(ids)])
for tile_tokens, splits in [(1024, 1), (128, 1), (128, 4)]:
    plan = decode_plan(tables, lengths, 64, tile_tokens, splits)
    out = paged_decode(q10[:, :, -1], pool.keys[10], pool.values[10], plan, 64)
    print(f"tiles of {plan[0].tokens} tokens, {splits} split(s): {len(plan)} tiles; differs from SDPA by "
          f"{(out[0] - reference[0, :, -1]).abs().max():.1e}")

# %% [markdown]
# ## 6. Through the tables against the gather
#
# The paged cache (`BlockPool(attention=...)`) runs decode either way: "paged", through the block tables
# (the default now), or "gather", the copy, kept as the reference the tests compare against. One whole
# decode step of the model, 4 rows with their blocks scattered over the pool, at growing context and at
# several block sizes. The keys and values are random numbers here (a step's time does not depend on
# them); the equality on real prefilled pools is in the tests and the bench. Median of 3 steps each,
# the two paths alternating; the bars on the plot run from the fastest to the slowest of the three:

# %%
by_context = [step_times(ours, 4, n, 16, repeats=3) for n in (250, 500, 1000)]
by_block = [step_times(ours, 4, 500, bs, repeats=3) for bs in (8, 16, 64)]
for r in by_context + by_block:
    print(f"{r['rows']} rows x {r['tokens']:>4} tokens, blocks of {r['block_size']:>2}: through the tables "
          f"{r['paged_ms']:6.1f} ms, gathered {r['gather_ms']:6.1f} ms ({r['speedup']:.2f}x) | the gather writes "
          f"{r['gather_bytes'] / 1e6:5.1f} MB per step; peak allocated {r['paged_peak_bytes'] / 1e6:.1f} vs "
          f"{r['gather_peak_bytes'] / 1e6:.1f} MB")
plots_kernels.plot_decode_attention(by_context, by_block)
plt.show()

# %% [markdown]
# Read the printed lines. The gather's copy grows with the rows and their context; it is written to
# memory, then read again by attention, at every layer of every step. Through the tables, the step
# allocates about one tile per layer whatever the context. Whether that is faster here depends on the
# context: at short contexts the copy is small and the two paths are close (a busy machine can reverse
# their order between runs); the longer the context, the more the copy costs. With the gather, block size
# only changes how long the runs of neighbouring slots are that the copy reads, one slot index per token;
# through the tables it changes how many blocks each tile reads, one index per block. Where the bars'
# ranges overlap, the run cannot tell the two apart. Lesson 13's trace (three handbook questions over a thousand
# tokens long, beside short chats) sits at the right end of the left panel.
#
# The benchmark measures the same at 4 rows of 1,000 tokens and at 1 row of 4,000 (`python -m course_lib
# bench --only attention`); the newest committed run:

# %%
committed = sorted(Path("../data/benchmarks").glob("bench-*attention*.json"))
if committed:
    run = json.loads(committed[-1].read_text())
    a = run["attention"]
    print(committed[-1].name, "|", run["machine"]["device"], run["threads"], "thread(s) | same output:", a["same_output"])
    for name in a["paged_step_ms"]:
        print(f"  {name}: through the tables {a['paged_step_ms'][name]:.1f} ms, gathered {a['gather_step_ms'][name]:.1f} "
              f"ms ({a['paged_speedup'][name]:.2f}x); the gather writes {a['gather_bytes_per_step'][name] / 1e6:.0f} MB")
    print(f"  prefill of {a['prefill_tokens']} tokens, one layer: tiled {a['tiled_peak_bytes'] / 1e6:.1f} MB, "
          f"SDPA {a['sdpa_peak_bytes'] / 1e6:.1f} MB, written out {a['naive_peak_bytes'] / 1e6:.0f} MB")
else:
    print("no committed attention run: make one with python -m course_lib bench --only attention")

# %% [markdown]
# ## 7. What production kernels add
#
# - **FlashAttention** (Dao et al., 2022; FlashAttention-2, 2023) is section 4 written as one GPU kernel:
#   the tiles live in on-chip memory, so the scores never reach the GPU's main memory at all. torch's SDPA
#   calls it on CUDA, and calls a tiled CPU kernel here (section 1 measured its allocation).
# - **PagedAttention** (Kwon et al., 2023, vLLM) is section 5 as a kernel: each thread block reads its
#   keys straight from the pool through the block table. Our vectorised version stages one tile of whole
#   blocks per step in plain torch; a kernel reads them into registers and shared memory instead.
# - **FlashDecoding** (Dao et al., 2023) is split-K for decode: one long sequence's blocks are cut into
#   ranges processed in parallel and merged by the log-sum-exp rule, so a GPU is busy even at batch 1.
# - torch's own route to paged attention is **FlexAttention** with a block mask that maps logical to
#   physical blocks; it is compiled (`torch.compile`) on the CPU as on CUDA, which takes seconds to
#   minutes the first time for every new shape. The course does not pay that in a lesson.
#
# A prompt's prefill through the paged cache still gathers (one row, many queries: lesson 13's chunks
# re-read their cached blocks that way); production engines run prefill through paged kernels too.
#
# ## Summary
#
# - Written out, attention holds a T x T matrix per head and layer: at the model's 8,192-token window one
#   layer's scores outweigh all its weights. Engines never build it.
# - Online softmax keeps a running maximum and a running sum, rescaling the sum when the maximum grows;
#   the same log-sum-exp rule merges partial attention results over any split of the keys.
# - Tiled attention computes one tile of scores at a time, skips the tiles causal attention never needs,
#   and equals SDPA on the model's real tensors (section 4 printed by how much).
# - Decode through the block tables reads each row's keys and values block by block (a tile of blocks at a
#   time) and merges the partial results; the course's paged cache now does so by default and no longer
#   copies every row's whole context at every layer. Section 6 measured the step against the copy in this run.
#
# ---
# ## Exercises
#
# **1.** Write `merge_sums(m1, l1, m2, l2)`: two pieces of a row, each with its own running max m and sum
# l of exp(x - m); return (m, l) for both pieces together.

# %%
from course_lib.exercises import lesson16 as ex

def merge_sums(m1, l1, m2, l2):
    ...  # your code here
    raise NotImplementedError

ex.check_merge(merge_sums)

# %% [markdown]
# **2.** Write `gather_bytes(rows, tokens)`: the bytes one decode step's gather writes on this model in
# float32, for `rows` sequences of `tokens` tokens each (every layer; the shapes are printed in the set-up).

# %%
def gather_bytes(rows, tokens):
    ...  # your code here
    raise NotImplementedError

ex.check_gather_bytes(gather_bytes)

# %% [markdown]
# **3.** Write `tiles_computed(tokens, tile)`: how many tiles causal attention computes over `tokens`
# tokens with square tiles of `tile` (the check counts them with `tiled_attention`'s own trace).

# %%
def tiles_computed(tokens, tile):
    ...  # your code here
    raise NotImplementedError

ex.check_tiles(tiles_computed)

# %% [markdown]
# **4. Predict, then measure.** Section 6 timed a decode step through the tables for 4 rows at 250, 500 and
# 1,000 tokens. Predict the milliseconds at **2,000** tokens per row and write them in `prediction_ms`; the check
# builds the pool and measures (median of 3).

# %%
prediction_ms = None  # your prediction: ms per step, 4 rows x 2,000 tokens
ex.check_step_prediction(prediction_ms, ours, tokens=2000)

# %% [markdown]
# **Next:** 17 · long context: what a long conversation costs per step, what happens at the end of the
# window, and a cache in 8 bits.
