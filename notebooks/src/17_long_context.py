# %% [markdown]
# # 17 · Long context: what a long text costs, the end of the window, and what engines do about it
#
# **Goal.** Every token a conversation keeps costs cache memory, and every decode step reads that cache
# again. A model also has a last position: SmolLM2 was built for 8,192. This lesson measures what a long
# context costs per step on the course's engine, runs a text three times longer than the window through
# the model under three ways of forgetting, stores the cache in 8 and 4 bits, and hides a fact in a long
# text to see whether the 135M model can still find it.
#
# **You will**
# - count the bytes one decode step reads from the weights and from the cache, and find the context where
#   the cache outweighs the weights; then time a step against context;
# - watch the model's loss along a long text when its cache holds only the most recent tokens, when it
#   restarts, and when it also keeps the first four tokens (attention sinks);
# - store keys and values in 8 and 4 bits and measure what that costs in quality and time;
# - plant a number in a long text and ask for it back.

# %% [markdown]
# ## Set-up

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import course_lib
from course_lib.views import plots_long
from course_lib.runner.formats import convert
from course_lib.engine.long_context import (KV_FORMATS, LONG_TEXT, cache_bytes_per_token, crossover_tokens,
                                            dequantize_rows, first_token_share, long_text_ids, quantize_rows,
                                            stream_loss)
from course_lib.measure.long_context import kv_quality, needle_grid, static_step_ms, step_curve, step_ms
from course_lib.runtime import median
from course_lib.runner.fused_step import why_not_fused
from course_lib.runner.model import Model, layer_qkv

torch.set_num_threads(1)  # one thread, set explicitly: the timings below compare within this run
model, tokenizer = course_lib.load_model()
ours = Model.from_transformers(model)  # lesson 11's model, float32
int4 = convert(ours, "int4")  # lesson 12's fastest format: 4-bit layers, an 8-bit head, bfloat16 activations
text = long_text_ids(tokenizer)
print(f"{LONG_TEXT.name}: {len(text):,} tokens, {len(text) / ours.config.max_position_embeddings:.1f} times the "
      f"model's window of {ours.config.max_position_embeddings:,} | threads: {torch.get_num_threads()}")

# %% [markdown]
# The long text is the first fourteen chapters of *Pride and Prejudice* (public domain; where the file comes
# from and what was changed is in `data/long/SOURCE.md`).
#
# ## 1. Where the bytes of a decode step go
#
# A decode step reads every weight once, then each layer's cached keys and values for every token so far.
# Lesson 07 wrote the cache's size per token; here it is for the cache formats of this lesson (the integer
# ones carry one float16 scale per token, head and layer), against the weights of two formats:

# %%
per_token = {f: cache_bytes_per_token(ours, f) for f in KV_FORMATS}
weights = {"float32": ours.weight_bytes(), "int4": int4.weight_bytes()}
for w, b in weights.items():
    cross = ", ".join(f"{f} cache at {crossover_tokens(b, per_token[f]):,}" for f in KV_FORMATS)
    print(f"weights {w}: {b / 1e6:.0f} MB per step; the cache reads as much with the {cross} tokens")
print("cache bytes per token:", {f: f"{b:,.0f}" for f, b in per_token.items()})
plots_long.plot_step_bytes([0, 2048, 4096, 8192], weights, {f: per_token[f] for f in ("float32", "bfloat16", "int8")})
plt.show()

# %% [markdown]
# The cache grows by the same bytes with every token: a straight line, not a curve that bends upward.
# Whether it matters depends on the weights beside it: compare each crossover printed above with the
# window of 8,192. The int4 format computes in bfloat16, so its cache is bfloat16: that is the pair to read
# for the fast format.
#
# Now the time, for both weight formats. Each step below runs against a cache already holding n tokens
# (random numbers: the time of a step does not depend on the values it reads), the median of five steps; the
# figure's bars run from the fastest to the slowest of the five:

# %%
contexts = [256, 1024, 2048, 4096, 8000]
curves = {"float32": step_curve(ours, contexts, repeats=5), "int4": step_curve(int4, contexts, repeats=5)}
for name, curve in curves.items():
    x, y = np.array([c["context"] for c in curve]), np.array([c["ms"] for c in curve])
    slope, intercept = np.polyfit(x, y, 1)
    r2 = 1 - ((y - (intercept + slope * x)) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    print(f"{name} weights ({curve[0]['weight_bytes'] / 1e6:.0f} MB): " + ", ".join(f"{c['ms']:.0f}" for c in curve)
          + f" ms at {contexts} tokens | line: {intercept:.1f} ms + {1000 * slope:.2f} ms per 1,000 tokens, R^2 {r2:.3f}")
    widest = max(curve, key=lambda c: (c["ms_max"] - c["ms_min"]) / c["ms"])
    print(f"   widest spread at {widest['context']:,} tokens: {widest['ms_min']:.1f} to {widest['ms_max']:.1f} ms")
    print(f"   at {contexts[-1]:,} tokens the cache adds {curve[-1]['cache_bytes'] / 1e6:.0f} MB to {curve[-1]['weight_bytes'] / 1e6:.0f} MB "
          f"of weights; time at {contexts[-1]:,} over time at {contexts[0]}: {curve[-1]['ms'] / curve[0]['ms']:.2f}x")
plots_long.plot_step_curve(curves)
plt.show()

# %% [markdown]
# A claim one sometimes reads is that the memory of a long context grows exponentially. It grows linearly:
# each token adds the same 46 KB in float32. The time of a decode step follows the bytes, and the lines
# above say how well (R² near 1 is a straight line; a busy machine adds scatter). Compare the two
# formats' last ratios: the smaller the weights, the larger the share of each step the cache takes. Attention's arithmetic
# over the whole context is quadratic only for a prompt read at once (lesson 16's score matrix); one decode
# step is linear in the context.
#
# ## 2. The end of the window
#
# The model has 8,192 positions. The course's engine refuses a 8,193rd rather than compute something the
# model was never trained on:

# %%
try:
    ours(torch.zeros(1, ours.config.max_position_embeddings + 1, dtype=torch.long))
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# A chat server must then forget something. Three ways, each given the same memory, a **budget** of cache
# tokens (256 here, so the lesson runs in seconds; the bench uses 1,024 and goes past the model's window):
#
# - **restart**: when the cache is full, start a new one from the most recent half of the text, fed again
#   (what dropping old turns of a conversation does; it pays for the tokens fed again);
# - **window**: keep the most recent tokens, drop the oldest one by one;
# - **sinks**: the same, but the first four tokens of the text never leave (StreamingLLM, Xiao et al.
#   2023). Both windows number positions by slot in the cache, as that paper does: when tokens leave, the
#   kept keys move to lower slots and are turned back by as many rotary positions.
#
# And **full**, the whole text in the cache, as the reference. Every token's loss is kept (the text is fed
# 64 tokens at a time, so the cache holds at most 256 tokens including the chunk being read):

# %%
budget, chunk, sample = 256, 64, text[:1024]
runs = {name: stream_loss(ours, sample, name, budget, chunk) for name in ("full", "restart", "window", "sinks")}
for name, r in runs.items():
    print(f"{name:>7}: perplexity past the budget {r.perplexity(budget):6.2f} | {1000 * r.seconds / len(sample):5.1f} "
          f"ms per token | most tokens held {r.max_tokens:>4} | fed again {r.recomputed}")
plots_long.plot_loss_by_position(runs, budget)
plt.show()

# %% [markdown]
# Read the lines after the budget. The two windows differ only in four tokens, the first four of the text.
# StreamingLLM's explanation: models trained with full attention learn to park much of their attention on
# the first tokens, whatever those tokens say (an "attention sink"); take them away and that attention
# lands somewhere it never did in training. The first cell below says which strategy kept the loss lowest
# here; the second measures the sink on this model: the share of attention that late queries give to the
# first four tokens, per layer (lesson 04's eager attention, on the library model's weights).

# %%
past = {name: r.perplexity(budget) for name, r in runs.items() if name != "full"}
best = min(past, key=past.get)
print(f"lowest perplexity past the budget of {budget}: {best} ({past[best]:.2f}); full cache {runs['full'].perplexity(budget):.2f}; "
      f"the window's is {past['window'] / past['sinks']:.2f}x the sinks'")

# %%
share = first_token_share(model, text[:256])
print("share of attention on the first 4 of 256 tokens, last 64 queries, per layer:",
      " ".join(f"{s:.0%}" for s in share.tolist()))
print(f"mean over layers {share.mean():.0%}, against {4 / 256:.1%} for attention spread evenly; "
      f"layers above half: {int((share > 0.5).sum())} of {len(share)}")

# %% [markdown]
# ## 3. A cache in 8 and 4 bits
#
# The same trick as lesson 12's weights, applied to what the cache stores: each token's keys (and values)
# of one head, 64 numbers, become 64 small integers and one float16 scale (the largest magnitude over 127,
# or over 7 for 4 bits). One scale per token and head because the cache only grows by appending: a row's
# scale is fixed when it is written and never revisited. Attention still reads float numbers: the cache
# turns the integers back into floats in one layer's buffer, reused by every layer.
#
# One real key from layer 10, its 8-bit and 4-bit versions:

# %%
_, k, _ = layer_qkv(ours, text[:64], 10)
row = k[0, 0, 40]  # head 0, token 40: 64 numbers
for bits in (8, 4):
    q, scale = quantize_rows(row, bits)
    back = dequantize_rows(q, scale, bits, torch.float32)
    print(f"{bits} bits: {q.numel()} bytes + a 2-byte scale; largest error {(back - row).abs().max():.4f} "
          f"on numbers up to {row.abs().max():.2f}")

# %% [markdown]
# Quality is measured against the text, the float cache as the reference (the weights are the same float32
# model in all three runs: only the cache changes):

# %%
quality = kv_quality(ours, text[:1024], chunk=256)
for name, qd in quality.items():
    ratio = f" | perplexity {qd['ppl_ratio']:.4f}x the float cache's" if "ppl_ratio" in qd else ""
    print(f"{name:>5} cache: perplexity {qd['ppl']:.3f} | {qd['bytes'] / 1e6:5.1f} MB for 1,024 tokens{ratio}")
print(f"tokens in the same memory as the float32 cache: int8 {quality['float']['bytes'] / quality['int8']['bytes']:.2f}x, "
      f"int4 {quality['float']['bytes'] / quality['int4']['bytes']:.2f}x (the read buffer counted)")

# %% [markdown]
# And the time of a decode step at 2,048 tokens of context with each cache, alternated five times so a busy
# moment hits all three:

# %%
times = {"float": [], "int8": [], "int4": []}
for _ in range(5):
    for name, bits in (("float", None), ("int8", 8), ("int4", 4)):
        times[name].append(step_ms(ours, 2048, bits, repeats=1))
ms = {name: median(t) for name, t in times.items()}
for name in ("int8", "int4"):
    verdict = "slower" if ms[name] > ms["float"] else "faster"
    print(f"{name} cache: {ms[name]:.1f} ms per step against {ms['float']:.1f} ms: {abs(ms[name] / ms['float'] - 1):.0%} {verdict}")

# %% [markdown]
# The cell printed what the quantized caches cost per step on this machine. This cache turns the integers
# back into a float copy before attention reads it: the step reads fewer bytes from the cache but writes
# and reads that copy, work a float cache never does. A fused kernel (vLLM's FP8 KV cache, llama.cpp's `q8_0` cache with its flash attention) turns the integers
# into floats inside the attention kernel, where the copy never reaches memory.
#
# The course's compiled decode step (lesson 11's static step, the one the engine runs) reads the 8-bit cache
# that way: it stores the new key and value by the same rule, multiplies each score by its key's scale and each
# attention weight by its value's scale, and lets the compiler turn the integers into floats just before each
# product, so no float copy of the whole cache is written. Compiling takes minutes on a laptop's CPU, so this
# lesson does not do it; the bench does (`python -m course_lib bench --only long_context`), with the float and the
# 8-bit cache alternated, and the last cell of section 4 prints its committed run.
#
# Lesson 12's fused step (the int4-q8 format's whole decode step as one C++ call) needs no compiling, so it can
# be timed here. It reads the 8-bit cache in place too: each key's integers become floats in a register, the
# score is multiplied by that column's scale, and the value's scale goes into its attention weight. The cell
# builds the int4-q8 model and times one step at 512 and at 2,048 tokens of context on each cache, alternated (the
# caches hold random numbers: the time does not depend on them). Where the course's kernel cannot be built, it
# says why.

# %%
q8 = convert(ours, "int4-q8")
reason = why_not_fused(q8)
if reason:
    print("the fused step does not run here:", reason)
else:
    for context in (512, 2048):
        fused_ms = static_step_ms(q8, context - 1, rounds=5, fused=True)
        print(f"fused step (int4-q8 weights), {context:,} tokens: float cache {fused_ms['float']:.1f} ms, "
              f"8-bit cache {fused_ms['int8']:.1f} ms ({fused_ms['int8'] / fused_ms['float']:.2f}x)")
    print(f"the eager step above at 2,048 (float32 weights): float cache {ms['float']:.1f} ms, 8-bit {ms['int8']:.1f} ms")

# %% [markdown]
# Read each fused line as a pair: the weights are the same for both caches, so the difference is the cache's
# bytes and the work of reading them. A float32 key or value is 4 bytes a number and an 8-bit one is 1 byte plus
# a scale per 64 numbers, so the cache's share of a step grows with the context, and so should what the integers
# save: compare the two lines' ratios. One machine, one row, one thread (set at the top); the bench's
# section repeats it at 4,096 tokens.
#
# ## 4. What the model can still find
#
# A number is planted as its own paragraph at several depths of the long text, then the model is asked for
# it (16 greedy tokens; "found" when the answer contains the number). Lengths are kept short here for time:

# %%
cells = needle_grid(ours, tokenizer, [256, 1024], [0.0, 0.5, 1.0])
for c in cells:
    print(f"{c['length']:>5} tokens, depth {c['depth']:.0%}: secret {c['secret']} -> {c['answer']!r}")
plots_long.plot_needle(cells)
plt.show()

# %% [markdown]
# A found number at some depth and length says only that: one fact, one phrasing, one greedy answer. The
# bench runs lengths up to 8,000 tokens at five depths; its newest committed run, if the course has one:

# %%
committed = sorted(Path("../data/benchmarks").glob("bench-*long_context*.json"))
if committed:
    run = json.loads(committed[-1].read_text())
    lc = run["long_context"]
    print(committed[-1].name, "|", run["machine"]["device"], run["threads"], "thread(s)")
    print(f"  budget {lc['budget']}: perplexity past it, restart {lc['ppl_restart']:.2f}, window {lc['ppl_window']:.2f}, "
          f"sinks {lc['ppl_sinks']:.2f}, full {lc['ppl_full']:.2f}; past the model's window: "
          + ", ".join(f"{n} {p:.2f}" for n, p in lc["ppl_past_model_window"].items()))
    print(f"  8-bit cache: perplexity x{lc['kv8_ppl_ratio']:.4f}, {lc['kv8_capacity_ratio']:.2f}x the tokens")
    if lc.get("kv_step_ms_fused"):  # runs from after the fused step read the 8-bit cache
        print(f"  through the fused step (int4-q8) at {lc['kv_step_context']} tokens: "
              + ", ".join(f"{n} {v:.1f} ms" for n, v in lc["kv_step_ms_fused"].items())
              + f" (x{lc['kv8_step_ratio_fused']:.2f})")
    if "kv_step_compiled" in lc:  # runs from before the compiled step read the 8-bit cache timed the eager step only
        print(f"  step with the 8-bit cache against the float one: x{lc['kv8_step_ratio_eager']:.2f} eager at "
              f"{lc['kv_step_context_eager']} tokens; x{lc['kv8_step_ratio']:.2f} through the "
              f"{'compiled' if lc['kv_step_compiled'] else 'uncompiled'} static step at {lc['kv_step_context']} "
              f"tokens ({lc['kv_step_format']}: "
              + ", ".join(f"{n} {v:.1f} ms" for n, v in lc["kv_step_ms"].items()) + ")")
    else:
        print(f"  step with the 8-bit cache against the float one: x{lc['kv8_step_ratio']:.2f} (eager)")
    print("  needle found:", sum(lc["needle"].values()), "of", len(lc["needle"]), lc["needle"])
else:
    print("no committed long-context run: make one with python -m course_lib bench --only long_context")

# %% [markdown]
# ## 5. What production systems offer
#
# - **Sliding-window models** (Mistral 7B's first release, Gemma 2 and 3 on alternate layers) are trained
#   with a window, so dropping old keys is what they expect; a model trained on full attention, like this
#   one, is not, which is why sinks matter for it. The trade: nothing outside the window is read at all.
# - **A quantized KV cache**: vLLM offers an FP8 cache (`kv_cache_dtype="fp8"`), llama.cpp 8-bit and 4-bit
#   caches (`--cache-type-k q8_0`). Twice the tokens in the same memory against a 16-bit cache, for a small
#   change in quality that each model must be measured for (section 3 measured it for this one).
# - **Context extension by RoPE scaling** (position interpolation, NTK-aware scaling, YaRN) stretches the
#   rotary angles so positions past the trained window look like ones inside it; it usually needs some
#   fine-tuning at the new length, and it makes the cache longer, not cheaper.
# - **Prefix caching** (lesson 13) does not shorten a context; it only avoids computing a shared one again.
#
# ## Summary
#
# - A decode step reads every weight and every cached key and value: the cache's bytes grow linearly with the
#   context, and section 1 printed where they pass the weights' (within the window for the 4-bit weights and
#   their bfloat16 cache, not for float32 weights) and how closely the time per step follows a straight line.
# - Past the window the model cannot go on: something must be forgotten. Section 2 measured three ways at one
#   budget on a real text and printed which kept the loss lowest; keeping the first tokens is the change that
#   separates the two windows.
# - An 8-bit cache with one scale per token and head stores the same context in about a quarter of the float32
#   bytes; section 3 printed its perplexity change (and the 4-bit cache's) and what it cost per step here, where
#   the integers become a float copy first; the compiled step reads them without that copy (the bench's figure),
#   and so does lesson 12's fused step, timed here against the float cache at the same context.
# - A fact planted in a long text: section 4 printed what the 135M model answered, cell by cell.
#
# ---
# ## Exercises
#
# **1.** Write `kv8_bytes(tokens)`: the bytes a conversation of `tokens` tokens takes in this model's 8-bit
# cache (every layer, keys and values, 64 one-byte numbers and a 2-byte scale per token and head).

# %%
from course_lib.exercises import lesson17 as ex

def kv8_bytes(tokens):
    ...  # your code here
    raise NotImplementedError

ex.check_kv8_bytes(kv8_bytes)

# %% [markdown]
# **2.** Write `outweighs_at(weight_bytes, per_token)`: the smallest context (tokens of one row) at which a
# decode step reads at least as many bytes from the cache as from the weights.

# %%
def outweighs_at(weight_bytes, per_token):
    ...  # your code here
    raise NotImplementedError

ex.check_outweighs(outweighs_at)

# %% [markdown]
# **3.** Write `kept(n, budget, sinks)`: the text positions (0-based, in order) a sink window of `budget`
# tokens with `sinks` sinks holds after n tokens were fed one at a time (the check runs `WindowCache`).

# %%
def kept(n, budget, sinks):
    ...  # your code here
    raise NotImplementedError

ex.check_kept(kept)

# %% [markdown]
# **4. Predict, then measure.** Section 1 measured the int4 model's decode step at five contexts and fitted a
# line. Predict the milliseconds of one step at **6,000** tokens and write them in `prediction_ms`; the check
# measures it (the median of 5 steps; a near miss is measured twice more and judged by the median of the three).

# %%
prediction_ms = None  # your prediction: ms per decode step of the int4 model at 6,000 tokens
ex.check_step_prediction(prediction_ms, int4, context=6000)

# %% [markdown]
# **Next:** 18 · beyond one machine: replicas behind a router, prefill and decode in separate processes, and
# the model split over several.
