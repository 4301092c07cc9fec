# %% [markdown]
# # 11 · The model written out, with a KV cache of our own
#
# **Goal.** Part II starts here: instead of watching the library's model, we write SmolLM2 out in plain
# torch on the very same weights, check each piece against the library as it appears, give it a cache
# we own, and race it against `model.generate`: same tokens, side by side.
#
# **You will**
# - build the model piece by piece (embedding, RMSNorm, rotary positions, grouped-query attention,
#   SwiGLU, the tied head) and measure how far each piece is from the library's (in float32: nowhere);
# - run `prefill` and `decode_step` on a preallocated cache you can size, read and roll back;
# - race the two implementations, find out why the same bytes can be read faster, and read a profile
#   that says where a decode step's time goes;
# - write the decode step at static shapes, and see what compiling it saves.

# %% [markdown]
# ## Set-up
#
# The library's model is loaded as in every lesson; ours is built from its tensors (q|k|v and gate|up are
# fused into one matrix each, so each layer does four matrix products; section 8 explains the order
# each matrix is stored in).
# The code lives in `course_lib/runner/model.py` (about 300 lines; `course_lib/runner/layout.py` holds section 8's layout choice): read it beside this notebook.

# %%
import json
import timeit
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots_perf
from course_lib.runner import model as m
from course_lib.runner.layout import LAYOUT_GAIN
from course_lib.text.context import context_ids, filler_ids, story_ids
from course_lib.engine.generation import generate
from course_lib.engine.stages import prefill, decode_step
from course_lib.measure.race import race, long_context, decode_profile, layout_gains, our_step_seconds, step_anatomy

model, tokenizer = course_lib.load_model()
ours = m.Model.from_transformers(model)
print("threads:", torch.get_num_threads(), "| parameters:", f"{m.parameter_count(ours):,}")
messages = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
ids = context_ids(tokenizer, messages)
library = m.library_parts(model, ids)  # what the library computes at each stage, caught with hooks
x_ids = torch.tensor([ids], device=ours.device)  # (B=1, T)

# %% [markdown]
# ## 1. Embedding: a table lookup
#
# Each token ID picks one row of a (V, hidden) matrix: 49,152 rows of 576 numbers.

# %%
x = m.embed(ours, x_ids)  # (1, T, hidden)
print("embedding matrix:", tuple(ours.embedding.shape), "| prompt vectors:", tuple(x.shape))
print("largest difference from the library:", float((x[0] - library["embedding"]).abs().max()))

# %% [markdown]
# ## 2. RMSNorm: one scale per vector
#
# Before attention and before the feed-forward, each vector is divided by its root-mean-square and
# multiplied by a learned weight. No mean is subtracted and there is no bias (that is LayerNorm).
# The library computes it in float32 whatever the model's dtype; ours does the same.

# %%
layer0 = ours.layers[0]
h = m.norm(x, layer0.attn_norm, ours.eps)  # (1, T, hidden)
print(f"root-mean-square before: {float(x[0, -1].pow(2).mean().sqrt()):.4f} | after (weight aside): "
      f"{float((h[0, -1] / layer0.attn_norm).pow(2).mean().sqrt()):.4f}")
print("largest difference from the library:", float((h[0] - library["norm0"]).abs().max()))

# %% [markdown]
# ## 3. Rotary positions: where order enters
#
# Attention by itself is blind to order. Rotary embedding turns each pair of dimensions of a query or key
# by an angle proportional to the token's position. At position 0 nothing turns. The property that
# matters: the score between a query at position p and a key at position p - d depends on the distance d,
# not on p. We check it on real projections of the prompt's last token.

# %%
from course_lib.runner.attention import apply_rotary
D = ours.head_dim
H = ours.heads  # the fused output holds H query heads, then the key heads, then the value heads
q_raw, k_raw = layer0.qkv(h)[0, -1, :D], layer0.qkv(h)[0, -1, H * D:(H + 1) * D]  # head 0's query, kv head 0's key
turn = lambda v, p: apply_rotary(v[None], ours.cos[p:p + 1], ours.sin[p:p + 1])[0]  # noqa: E731
print("position 0 changes the vector by", float((turn(q_raw, 0) - q_raw).abs().max()))
for p in [5, 50, 500, 5000]:
    print(f"query at {p:>4}, key at {p - 3:>4}: score {float(turn(q_raw, p) @ turn(k_raw, p - 3)):.4f}")

# %% [markdown]
# The score is the same at every p (up to float rounding): only the distance, 3, counts.
#
# ## 4. One attention layer: 9 query heads, 3 key/value heads
#
# `m.attention` projects q, k and v with one fused matrix, turns q and k, writes k and v into the cache,
# and runs scaled dot-product attention. Grouped-query attention: each key/value head serves 3 query
# heads. Instead of copying each key/value head 3 times, we fold the 3 query heads into the query axis,
# so the cache is read once per layer, not three times.

# %%
T = len(ids)
positions = torch.arange(T, device=ours.device)[None]  # (1, T)
cos, sin = ours.cos[positions].unsqueeze(1), ours.sin[positions].unsqueeze(1)  # (1, 1, T, D)
a = m.attention(ours, layer0, 0, h, cos, sin, cache=None, start=0, mask=None)  # (1, T, hidden), no cache yet
print("attention output:", tuple(a.shape), "| largest difference:", float((a[0] - library["attention0"]).abs().max()))
b = m.block(ours, 0, x, cos, sin, cache=None, start=0, mask=None)  # x + attention, then + feed-forward (SwiGLU)
print("block 0 output:  ", tuple(b.shape), "| largest difference:", float((b[0] - library["block0"]).abs().max()))

# %% [markdown]
# ## 5. The whole stack and the head
#
# Thirty blocks, the final norm, then the output head: the embedding matrix used a second time
# (tied weights), so 576-number vectors become 49,152 logits. We compare every position.

# %%
for i in range(len(ours.layers)):
    x = m.block(ours, i, x, cos, sin, cache=None, start=0, mask=None)
print("after 30 blocks, largest difference:", float((x[0] - library["stack"]).abs().max()))
logits = m.head(ours, x)[0]  # (T, V)
print("logits", tuple(logits.shape), "| largest difference at any position:",
      float((logits - library["logits"]).abs().max()))
print("our greedy next token:", repr(tokenizer.decode([int(logits[-1].argmax())])))

# %% [markdown]
# The differences are zero or a few millionths in float32: the same arithmetic in a slightly different
# order. The tests hold ours to 1e-4 on every position of the running examples and of a 1,200-token
# prompt, and to the same greedy tokens as `model.generate` on them and on a 256-token story.
#
# ## 6. A cache of our own
#
# `kv_cache.KVCache` preallocates, per layer, keys and values of shape (B, KV heads, capacity, D) and
# writes each step in place. `length` says how many columns are filled; rolling back is one assignment.
# Its size follows lesson 07's formula exactly, and we check it against the bytes the tensors hold.

# %%
from course_lib.runner.kv_cache import model_kv_bytes_per_token
cache = ours.new_cache(1, 64)
print("keys of layer 0:", tuple(cache.keys[0].shape), "| bytes held:", f"{cache.nbytes():,}",
      "| formula:", f"{64 * model_kv_bytes_per_token(ours.config, ours.dtype):,.0f}")
logits, cache = prefill(ours, ids, cache)
print("after prefill:", cache.length, "columns filled")
step_logits, cache = decode_step(ours, [int(logits[0].argmax())], cache)
print("after one decode step:", cache.length, "| same logits as a full forward pass:",
      bool((step_logits[0] - m.library_parts(model, ids + [int(logits[0].argmax())])["logits"][-1]).abs().max() < 1e-4))

# %%
cache.rollback(len(ids))  # forget the decoded token: one assignment
again, cache = decode_step(ours, [int(logits[0].argmax())], cache)
print("rolled back and decoded again: identical logits?", torch.equal(again, step_logits))

# %% [markdown]
# Because ours is called like the library's model (`input_ids`, `attention_mask`, `position_ids`,
# `cache`, `logits_to_keep`), the course's one loop runs it unchanged: `generate`, `stream`, batching
# and the server all accept it.

# %%
answer = generate(ours, tokenizer, ids, 24)
print(repr(answer.text), "| stop:", answer.stop_reason, "| time to first token:", f"{answer.time_to_first_token * 1000:.0f} ms")

# %% [markdown]
# ## 7. The race
#
# The same story, 64 greedy tokens, no early stop, by `model.generate` and by our model under the
# course's `generate`. Warm-up first, then three timings each, alternating; the best of each is the
# bar, and the line across it spans all three, so a race decided by a busy moment looks like one.

# %%
story = story_ids(tokenizer)
result = race(ours, model, tokenizer, story, n_new=64, repeats=3)
spread = lambda rates: f"{min(rates):.1f}-{max(rates):.1f}"  # noqa: E731
print("same tokens:", result["same_tokens"], f"| ours {result['tokens_per_s']:.1f} tok/s "
      f"(runs {spread(result['tokens_per_s_runs'])}), model.generate {result['generate_tokens_per_s']:.1f} tok/s "
      f"(runs {spread(result['generate_tokens_per_s_runs'])}), ratio {result['ratio']:.2f}")
separated = (min(result["tokens_per_s_runs"]) > max(result["generate_tokens_per_s_runs"])
             or min(result["generate_tokens_per_s_runs"]) > max(result["tokens_per_s_runs"]))
print("across the three runs each:", "every run of the faster side beat every run of the slower one" if separated
      else "the runs overlap: this race is within the noise of this run")
print(f"weights read per token by either: {ours.weight_bytes() / 1e6:.0f} MB")
print(tokenizer.decode(result["token_ids"])[:300])
plots_perf.plot_race(["model.generate", "ours"], [result["generate_tokens_per_s"], result["tokens_per_s"]],
                     runs=[result["generate_tokens_per_s_runs"], result["tokens_per_s_runs"]])
plt.show()

# %% [markdown]
# Both read the same weights per token (the number printed above), and at a short context that read is
# most of the decode step (lesson 08; section 9 splits the step). So if ours is faster here, it is not because of fewer Python calls: the weights
# are being read faster. The next section shows how the same bytes can be read faster.
#
# ## 8. The same bytes, read in another order
#
# One token's product `x @ W.T` (W of shape (out, in)) can read W in either of two orders. Stored **by
# rows** (the usual layout, the library's), each output's weights lie together and the kernel computes one
# dot product per row. Stored **by columns**, each input's weights lie together and the kernel adds up
# columns scaled by x. The numbers are the same; only the order of the reads changes, and so does the
# BLAS routine torch calls. When `Model` is built it times both orders for each shape, with the CPU's
# caches emptied as they are in a decode step, and switches a matrix to columns only where that is at
# least `LAYOUT_GAIN` times faster (a small gain could be noise). On a GPU it keeps rows.

# %%
gains = layout_gains(ours)
for r in gains:
    several = "" if r["several_rows_gain"] is None else f" | 5 rows: oneDNN {r['several_rows_gain']:.2f}x MKL's speed"
    print(f"{r['matrix']:<8} {str(r['shape']):<14} by columns {r['gain']:.2f}x as fast -> kept by {r['layout']}"
          f"{several} -> {r['kernel']}")
plots_perf.plot_layout_gains(gains, LAYOUT_GAIN)
plt.show()

# %% [markdown]
# The last column is about several rows at once (a prompt, a batch, lesson 14's check of drafted tokens):
# that is a different product, and on this machine MKL's kernel for a handful of rows is slow on matrices
# stored by columns, while torch's other CPU library, oneDNN, reads them well. So `Linear` sends 2 to 16
# rows to whichever of the two measured faster for that matrix (`layout.several_rows_kernel`); one row
# always goes to MKL, the fastest here once the layout is right, and so do long prompts, where MKL's
# large products are efficient. (The kernel was chosen when the model was built; the table measures
# again, and on a busy machine the two measurements can disagree.)
#
# To see what the layout is worth, build our model again with every matrix by rows, as the library
# stores them, and time the decode steps of both versions on the same story the same way (the median gap
# between tokens).

# %%
by_rows = m.Model.from_transformers(model, layout="rows")
median_rate = lambda model_: 1 / sorted(our_step_seconds(model_, tokenizer, story, 33))[16]  # noqa: E731
rows_rate, built_rate = median_rate(by_rows), median_rate(ours)
print(f"ours by rows {rows_rate:.1f} tok/s | ours as built {built_rate:.1f} tok/s | "
      f"ratio {built_rate / rows_rate:.2f}")
print("the same greedy tokens by rows:", generate(by_rows, tokenizer, story, 16, stop_ids=()).token_ids
      == result["token_ids"][:16])
del by_rows  # its fused matrices are a copy: about 280 MB

# %% [markdown]
# Read the numbers from your run. On the machine this lesson was written on (an AMD CPU, torch's MKL
# build), q|k|v, gate|up and the head were faster by columns while the down projection was slower, and
# the layout made decode faster as a whole (the committed bench's `engine.layout_speedup` records it); by
# rows, ours was only a little ahead of
# `model.generate` (fused matrices, fewer operators per step). Your CPU and BLAS may differ: if every
# matrix stays by rows, both orders read equally fast there and the two versions tie. Engines do this on
# purpose: llama.cpp and oneDNN repack weights at load time into the order their kernels stream best.
# It sharpens lesson 08: bytes per token set the floor, and how the kernel walks those bytes decides
# how close a step gets to it.
#
# The cache shows its design as the context grows. The library's default cache (`DynamicCache`, what
# `model.generate` uses unless told otherwise) grows by concatenation (a new, longer tensor every step); ours
# was allocated once. transformers also ships a preallocated `StaticCache`, made for compiled decoding; the
# comparison here is with the default. Here is a decode step after a 1,000-token prompt
# (the benchmark measures 4,000: `python -m course_lib bench --only engine`).

# %%
long = long_context(ours, model, tokenizer, filler_ids(tokenizer, 1000), k=8)
print(f"after {long['context']} tokens: ours {long['ms_per_token']:.1f} ms/token, "
      f"model.generate {long['generate_ms_per_token']:.1f} ms/token, ratio {long['ratio']:.2f}")

# %% [markdown]
# ## 9. Where the time goes
#
# `torch.profiler` records every operator a decode step runs. We group their own times: matrix products
# (reading the weights), attention (reading the cache), norms, cache and copies, everything else.

# %%
short_ctx, long_ctx = story, filler_ids(tokenizer, 1000)
profiles = {f"{name}, {len(p)} cached": decode_profile(model_, p, steps=3)
            for name, model_ in [("library", model), ("ours", ours)] for p in (short_ctx, long_ctx)}
for name, prof in profiles.items():
    groups = ", ".join(f"{g} {ms:.1f}" for g, ms in sorted(prof["ms_by_group"].items(), key=lambda kv: -kv[1]))
    print(f"{name:<22} {prof['wall_ms_per_step']:5.1f} ms/step, {prof['aten_calls_per_step']:4.0f} operators: {groups}")
plots_perf.plot_profile({k: v["ms_by_group"] for k, v in profiles.items()},
                        wall_ms={k: v["wall_ms_per_step"] for k, v in profiles.items()})
plt.show()

# %% [markdown]
# Read the table from the run above: matrix products dominate at short context for both (that is the
# weights' read; ours is shorter where its matrices are stored by columns); at long context attention
# and, for the library, the copies of a growing cache take more. Ours launches fewer operators per step
# (fused projections, no per-step cache reallocation). The dashed outline is each run's wall time per step
# under the profiler: the gap between it and the coloured bar is time inside no operator (Python between
# calls, and the profiler's own recording, which is why these wall times are above the unprofiled ones).
#
# How much of our step is *not* reading the weights? Time the step, then time the very same matrix objects
# called alone, one row each, in the step's order: the difference is everything else (attention over the
# cache, norms, rotary, cache writes, and calling each operator from Python).

# %%
anatomy = step_anatomy(ours, story, steps=20)
print(f"decode step {anatomy['step_ms']:.1f} ms = matrix products alone {anatomy['products_ms']:.1f} ms "
      f"+ everything else {anatomy['rest_ms']:.1f} ms ({anatomy['rest_ms'] / anatomy['step_ms']:.0%})")
print(f"operators per step: {anatomy['aten_ops']:.0f} as the profiler counts them, {anatomy['python_calls']:.0f} "
      f"called from Python; calling a tiny operator costs {anatomy['tiny_call_us']:.2f} us here, so calling "
      f"them all is about {anatomy['calling_ms_estimate']:.1f} ms")

# %% [markdown]
# The profiler's count includes operators nested inside others (a `linear` is `t`, `matmul`, `mm`, views...),
# which run in C++ and cost far less than a call from Python. Counting operators is not timing them: below,
# the same product of one row by a weight matrix, once through `F.linear` (one call from Python, several
# operators inside) and once as `view`, `mm`, `view` written out (three calls, the matrix's transposed view
# made beforehand).

# %%
from torch.profiler import profile as _profile, ProfilerActivity as _Activity


def counted_and_timed(fn, repeats=2000):
    """(operators the profiler counts for one call, microseconds per call: best of 3 loops)"""
    fn()
    with _profile(activities=[_Activity.CPU]) as prof:
        fn()
    n = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    return n, min(timeit.timeit(fn, number=repeats) for _ in range(3)) / repeats * 1e6


W = ours.layers[0].o.weight  # (576, 576), as the model holds it
Wt = W.t()  # (in, out): a view, made once
x1 = torch.randn(1, 1, W.shape[1])
by_linear = counted_and_timed(lambda: torch.nn.functional.linear(x1, W))
by_hand = counted_and_timed(lambda: torch.mm(x1.view(1, -1), Wt).view(1, 1, -1))
for name, (n, us) in [("F.linear", by_linear), ("view, mm, view", by_hand)]:
    print(f"{name:<15} {n:2d} operators counted, {us:5.2f} us per call")
(fast_name, fast), (_, slow) = sorted([("F.linear", by_linear), ("view, mm, view", by_hand)], key=lambda r: r[1][1])
print(f"faster here: {fast_name} ({fast[1]:.2f} against {slow[1]:.2f} us), with "
      f"{'more' if fast[0] > slow[0] else 'fewer' if fast[0] < slow[0] else 'as many'} operators counted")

# %% [markdown]
# Where the faster one had more operators counted (it did in the runs made for this lesson, at one thread
# and at two), the count is the wrong thing to shrink: what costs is each call from Python, and the
# products' bytes. The "everything else" above is the share a compiled step or a C++ engine such as
# llama.cpp goes after; the products' share is what no engine avoids, since every token reads the weights
# once. Lesson 12 races this engine's formats against llama.cpp on the same file.
#
# ## 10. A step with static shapes, and compiling it
#
# Every step of ours reads a slice of the cache one column longer than the step before. For `torch.compile`,
# which traces a function for the shapes it sees, that is a new shape at every token. `course_lib/runner/static_step.py`
# writes the same decode step with nothing that depends on the exact context: the cache allocated once at a
# fixed capacity, a mask that hides the columns not written yet, the position given as a tensor, and the new
# key and value written at that position with `index_copy_` (gpt-fast does the same on a GPU, where the fixed
# shapes also let a CUDA graph replay the whole step). Attention reads a span of the cache: the written
# columns rounded up to 256, or twice that, or four times and so on (`span_of`), never more than the capacity.
# So the step's shape changes a handful of times in a long conversation, not at every token, and a cache sized
# for a long conversation makes a short one read no more (llama.cpp rounds its view of the cache up to 256
# cells for the same reason). Here the capacity is below the first span, so the whole cache is read. Run
# eagerly, it is the same arithmetic plus the
# masked columns:

# %%
from course_lib.runner.static_step import StaticStep, compile_available
from course_lib.measure.compiled import timed_static_run

n_static = 24
capacity = len(story) + n_static + 1
static_tokens, static_s = timed_static_run(StaticStep(ours, capacity), story, n_static)
engine_gaps = our_step_seconds(ours, tokenizer, story, n_static + 1)
median_ms = lambda seconds: 1000 * sorted(seconds)[len(seconds) // 2]  # noqa: E731
print(f"same tokens as the race: {static_tokens == result['token_ids'][:n_static]} | a step, median of {n_static}: "
      f"static {median_ms(static_s):.1f} ms, ours {median_ms(engine_gaps):.1f} ms ({capacity} columns read against "
      f"{len(story)} to {len(story) + n_static})")

# %% [markdown]
# Static shapes are what let the next tool in: `torch.compile` traces the step once and generates C++ loops that
# fuse the small operators between the matrix products (norms, rotary, the residual adds, `silu` times `up`),
# section 9's "everything else". The course also asks it for a C++ caller (`cpp_wrapper`): the generated code
# that calls those loops and the library's matrix kernels, a few hundred calls a step, is C++ instead of Python.
# Compiling takes up to a minute on a CPU the first time (torch keeps the result on disk, so a repeat takes
# seconds) and needs a C++ compiler, so this lesson does not wait for it unless you ask (below). The committed benchmark compiled the step for float32
# and for lesson 12's int4 format on the course's machine:

# %%
engine_runs = [r for r in sorted(Path("../data/benchmarks").glob("bench-*engine*.json"))
               if "compiled" in json.loads(r.read_text()).get("engine", {})]
if engine_runs:
    record = json.loads(engine_runs[-1].read_text())
    compiled_run = record["engine"]["compiled"]
    print(f"committed run {engine_runs[-1].name} ({record['threads']} thread(s)): {compiled_run['what']}")
    for fmt, row in compiled_run["formats"].items():
        if not compiled_run["compiled"]:
            print(f"  {fmt}: not compiled ({compiled_run['why_not']})")
            continue
        flipped = row["compiled_first_difference"]
        print(f"  {fmt:<8} ours {row['engine_ms']:5.1f} ms | static, eager {row['static_eager_ms']:5.1f} ms | compiled "
              f"{row['compiled_ms']:5.1f} ms: {row['speedup']:.2f}x ours, after {row['compile_s']:.0f} s of compiling | "
              + ("the same tokens" if flipped is None else f"tokens part from ours at token {flipped}"))
        if "compiled_ops_per_step" in row:
            print(f"           operators per step, as section 9 counts them: {row['static_eager_ops_per_step']:,.0f} "
                  f"eagerly, {row['compiled_ops_per_step']:,.0f} compiled")
else:
    print("no committed run holds engine.compiled yet: python -m course_lib bench --only engine")

# %%
COMPILE = False  # True: compile the step here (up to a minute; needs a C++ compiler)
if COMPILE and compile_available()[0]:
    fast = StaticStep(ours, capacity, compile=True)
    compiled_tokens, compiled_s = timed_static_run(fast, story, n_static)
    print(f"compiled in {fast.compile_seconds:.0f} s; a step {median_ms(compiled_s[1:]):.1f} ms against the static "
          f"step's {median_ms(static_s):.1f} eagerly; same tokens: {compiled_tokens == static_tokens}")
else:
    print("not compiled here:", compile_available()[1] or "COMPILE is False (set it to True to wait for a compile)")
from course_lib.runner.compiled import CAPACITIES
print(f"the engine's cache capacities: {len(CAPACITIES)} buckets {CAPACITIES} (columns), any number of rows")

# %% [markdown]
# Read the committed lines (or yours). The compiled step saves time between the matrix products, not in them:
# the products are the same library kernels, called from the generated code, and the operator counts show how
# much less there is to call (they count what the profiler records: the library kernels the generated C++
# calls, not the fused loops around them). The int4 format's output head (lesson 12) is one the compiler
# cannot take, so it runs just after the compiled step, eagerly. Where the products are short (int4) that saving is a larger share of the step,
# but a gap of a few percent between the two speed-ups is within what a busy machine moves between runs: read
# them as "both gained", not as a ranking. Lesson 12 races the course's fastest step against llama.cpp (its
# record names which, `course_step`: this compiled one in the first sittings, the C++ step described below in
# the later ones).
# In float32 the compiled step should give the very tokens of ours (the line says). In bfloat16 (the int4
# format's activations) it need not: its attention adds up a masked span of the cache, ours the written
# columns only, and rounding in a different order can flip a near-tie (the line says at which token). Where
# no C++ compiler is at hand, ours is what runs.
#
# The engine takes the compiled step in as a runner: `generate(..., compiled=True)` and `stream(...,
# compiled=True)` run ours through `course_lib/runner/compiled.py`, which meets the same runner contract as the
# model. Its caches come in a few fixed capacities (the buckets printed above), and its decode step is compiled
# with the rows and the capacity left as symbols (its steps read their whole bucket: a span that moves would
# compile again mid-traffic): the compiler runs once for a single row and once for a batch, and every bucket
# reuses that code (a GPU engine captures one CUDA graph per batch size at start-up;
# the server here compiles both before it listens: `start_server(..., fmt="int4", compiled=True)`). The prompt and a verify
# pass run the ordinary step. The paged server keeps the ordinary step (its attention walks block tables whose
# shapes change with every batch). For lesson 12's `int4-q8` format the same runner takes another road: the whole
# decode step as one C++ call around the course's own kernel (`runner/fused_step.py`), nothing to compile; lesson
# 12, section 7, times it beside the eager step and races it against llama.cpp. Where the CPU multiplies pairs of
# bfloat16 numbers in one instruction, the `int4` format takes that road too (its products with bfloat16
# activations; `fused_step.why_not_fused` says whether this machine can), so on such a machine
# `compiled=True` on `int4` runs the C++ step, not the compiled one timed above; `CompiledRunner.step_kind` says
# which.
#
# ## Summary
#
# - SmolLM2 is about 300 lines of plain torch: embedding, RMSNorm, rotary, grouped-query attention,
#   SwiGLU and a tied head. In float32 it equals the library's logits to within 1e-4 (here: to the last bit
#   or close), and its greedy tokens are the same.
# - Rotary makes attention scores depend on the distance between tokens, not on where they are.
# - A preallocated cache is sized by lesson 07's formula, is written in place, and rolls back by one
#   assignment (lesson 14 will need that).
# - At short context most of a decode step is the weights' read (section 9 printed the products' share and
#   what the rest costs; the rest grows with calls from Python, not with the profiler's count). The same bytes stored in the order this machine's
#   kernel streams best (by columns for some matrices here) read faster: that, not Python overhead, is
#   what separates the two at short context. A long context is where the cache's design shows.
# - A step with static shapes (a fixed cache read in a few spans, with a mask) can be compiled once: `torch.compile`
#   fuses the small operators between the matrix products. Section 10 printed what it saved per step on the
#   course's machine, and what the compile cost in seconds.
#
# ---
# ## Exercises
#
# **1.** Write `rms_norm(x, weight, eps)` for vectors along the last axis.

# %%
from course_lib.exercises import lesson11 as ex

def rms_norm(x, weight, eps):
    ...  # your code here
    raise NotImplementedError

ex.check_rms_norm(rms_norm, ours)

# %% [markdown]
# **2.** Write `rotate(x, position)`: rotary for one (D,) vector, with theta = 100,000 (this model's),
# pairing dimension i with i + D/2. Which position leaves the vector unchanged?

# %%
def rotate(x, position, theta=100000.0):
    ...  # your code here
    raise NotImplementedError

ex.check_rotate(rotate, ours)

# %% [markdown]
# **3.** Predict, from the config alone, the bytes of `ours.new_cache(batch, tokens)` in float32.

# %%
def cache_bytes(batch, tokens):
    ...  # your code here
    raise NotImplementedError

ex.check_cache_bytes(cache_bytes, ours)

# %% [markdown]
# **Next:** 12 · bytes per token: this model in smaller weight formats, down to the file's own 4 bits.
