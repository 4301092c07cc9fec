# %% [markdown]
# # 08 · Prefill and decode: two stages, two different limits
#
# **Goal.** Time the two stages of inference separately and find out what limits each: prefill reads
# the whole prompt in one parallel pass; decode produces one token per pass and spends its time
# reading weights from memory.
#
# **You will**
# - measure time to first token against prompt length, and decode time against context length;
# - measure this machine's two ceilings (how fast it reads memory, how fast it multiplies) and place every
#   prefill and decode you timed under them: a roofline;
# - find out what makes decode slower as the context grows, and whether it is the bytes;
# - put your numbers beside committed benchmark runs from other machines.

# %% [markdown]
# ## Set-up

# %%
import json
from pathlib import Path
import matplotlib.pyplot as plt
import course_lib
from course_lib.views import plots, plots_roofline
from course_lib.measure.prefill_decode import (decode_timings, memory_bandwidth, prefill_seconds, decode_seconds,
                                               prefill_timings, weight_bytes)
from course_lib.runner.kv_cache import model_kv_bytes_per_token
from course_lib.text.context import filler_ids
from course_lib.inside.anatomy import flops_per_token
from course_lib.runtime import describe_device
import torch
from course_lib.measure.roofline import compute_ceiling, place, probe_bytes, step_work

model, tokenizer = course_lib.load_model()
cfg = model.config
print(describe_device(model.device))

# %% [markdown]
# ## 1. Prefill: the prompt in one pass
#
# The time to first token is mostly prefill. We time it for prompts of growing length:

# %%
lengths = [16, 64, 256, 1024]
prefill_runs = prefill_timings(model, tokenizer, lengths, repeats=3)
prefill_s = [t.best for t in prefill_runs]
for n, t in zip(lengths, prefill_runs):
    print(f"{n:>5} prompt tokens: {t.best * 1000:7.1f} ms (best of 3; slowest {max(t.seconds) * 1000:.1f})  -> "
          f"{n / t.best:7.0f} tokens/s")

# %%
ax = plots.plot_xy(lengths, [n / s for n, s in zip(lengths, prefill_s)], "prompt tokens", "prefill tokens per second",
                   spread=[(n / max(t.seconds), n / min(t.seconds)) for n, t in zip(lengths, prefill_runs)],
                   title="Prefill: tokens per second against prompt length (best of 3; bars: all 3)")
ax.set_xscale("log", base=2)
plt.show()

# %% [markdown]
# A prompt 64 times longer does not take 64 times longer: all its positions go through each weight
# matrix together, as one big matrix multiplication, so each weight fetched from memory is used for
# many tokens. That is what "prefill is parallel" means in practice. (At long lengths attention's
# T-by-T cost starts to show, lesson 04.)
#
# ## 2. Decode: one token per pass
#
# Now the other stage: one new token, with a cache already holding `context` tokens.

# %%
contexts = [16, 256, 1024, 2048, 4096]
decode_runs = decode_timings(model, tokenizer, contexts, steps=8)
decode_s = [t.mean for t in decode_runs]  # the mean of 8 steps at each context
for c, s in zip(contexts, decode_s):
    print(f"context {c:>5}: {s * 1000:6.1f} ms per token -> {1 / s:5.1f} tokens/s")
print(f"prefill at {lengths[-1]} tokens is {lengths[-1] / prefill_s[-1] / (1 / decode_s[0]):.0f}x more tokens per second "
      f"than decode")

# %% [markdown]
# ## 3. Two ceilings, and where each step sits
#
# A step can be held back by two things: how fast the machine moves bytes from memory, and how fast it does
# arithmetic. We measure both in this run, with the threads torch uses now:
# - **reading**: a sum over a buffer far larger than the caches (1 GiB, or twice the largest cache the
#   CPU reports), so nearly every byte comes from memory, as a decode step's weights do;
# - **arithmetic**: one large matrix product (2,048 x 2,048 by 2,048 x 2,048, in the model's dtype), about
#   the best case for the library's kernels.

# %%
wb = weight_bytes(model)
read_bw = memory_bandwidth(model.device)
peak = compute_ceiling(model.dtype, device=model.device)
print(f"threads {torch.get_num_threads()} | probe {probe_bytes() / 2**20:,.0f} MiB | reading {read_bw / 1e9:.1f} GB/s "
      f"| matrix product {peak / 1e9:.0f} GFLOP/s ({str(model.dtype).split('.')[-1]})")
print(f"ridge point: {peak / read_bw:.1f} FLOP per byte; a step doing fewer operations per byte it moves waits for memory")
print(f"weights: {wb / 1e6:.0f} MB read per step; decode at context {contexts[0]} reads them at "
      f"{wb / decode_s[0] / 1e9:.1f} GB/s ({wb / decode_s[0] / read_bw:.0%} of the reading ceiling)")

# %% [markdown]
# Each step's **arithmetic intensity** is its operations divided by the bytes it moves. Operations: about 2 per
# weight per token (a multiply and an add), plus attention's own products over every cached key (4 x layers x
# heads x head size per token and key). Bytes: every weight once, plus the KV cache read at that context and the
# new tokens' keys and values written (activations left out: small here). Decode uses each weight for one
# token, prefill for every prompt token at once:

# %%
per_token = flops_per_token(sum(p.numel() for p in model.parameters()), cfg.vocab_size * cfg.hidden_size)
kv_per_token = model_kv_bytes_per_token(cfg, model.dtype)
steps = [(f"prefill {n}", step_work(cfg, per_token, wb, kv_per_token, n, 0), s) for n, s in zip(lengths, prefill_s)]
steps += [(f"decode @{c}", step_work(cfg, per_token, wb, kv_per_token, 1, c), s) for c, s in zip(contexts, decode_s)]
placed = [(label, place(work, s, peak, read_bw)) for label, work, s in steps]
print(f"{'step':<13}{'FLOP/byte':>10}{'GFLOP/s':>10}{'roof':>9}{'of roof':>9}  bound by")
for label, pt in placed:
    print(f"{label:<13}{pt['intensity']:>10.2f}{pt['flops_per_s'] / 1e9:>10.1f}{pt['roof'] / 1e9:>9.1f}"
          f"{pt['of_roof']:>9.0%}  {pt['bound']}")
plots_roofline.plot_roofline([lbl for lbl, _ in placed], [pt["intensity"] for _, pt in placed],
                             [pt["flops_per_s"] for _, pt in placed], peak, read_bw)
plt.show()

# %% [markdown]
# Read the table against the picture. Every decode point sits far left of the ridge: about half an operation
# per byte in float32, so the roof there is the reading line, and the column "of roof" says how much of the
# memory's speed decode actually used. Prefill points move right as the prompt grows: each weight fetched once
# now serves every prompt token. Once a prefill point is right of the ridge, memory no longer limits it and its
# roof is the matrix product's rate. Points well under their roof are held back by something else:
# kernels slower than the best case on these shapes, and the fixed cost of thirty layers of small operations
# launched from Python (lesson 11 measures it).
#
# **A 70B model on this machine?** The same rule gives a floor for a model this course cannot run here: a
# decode step reads every weight once, so it takes at least the weights' bytes over the reading rate just
# measured (and the weights must fit in memory first):

# %%
import os

ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else float("nan")
for fmt, bytes_per_weight in [("bfloat16", 2.0), ("4-bit, llama.cpp's Q4_K_M (about 4.8 bits)", 4.8 / 8)]:
    b = 70.6e9 * bytes_per_weight
    print(f"Llama 3 70B in {fmt}: {b / 1e9:.0f} GB per token -> at least {b / read_bw:.1f} s per token here "
          f"({'fits' if b < ram else 'does not fit'} in this machine's {ram / 1e9:.0f} GB of memory)")

# %% [markdown]
# Seconds per token, not minutes, if the weights fit: a floor, since the roofline's table shows decode reaching
# only part of the reading ceiling. The same bytes are why a 70B model is served from GPUs, whose memory reads
# terabytes per second, and why quantized formats (lesson 12) matter so much on a CPU.
#
# **Why output tokens are priced higher than input tokens.** Providers bill per token, and most charge
# more for an output token than for an input one (their price lists say by how much). Sections 1 and 2
# measured one reason: a prompt token goes through the model with hundreds of others in one pass, an
# answer token alone.

# %%
input_s = prefill_s[-1] / lengths[-1]  # machine time per prompt token, in the longest prefill
output_s = decode_s[-1]  # per answer token, at the longest context measured
print(f"machine time per input token {input_s * 1000:.2f} ms, per output token {output_s * 1000:.1f} ms: "
      f"{output_s / input_s:.0f}x more per output token, on this machine, at batch 1")

# %% [markdown]
# A server batches many users' answer tokens into each decode step (lesson 09), which narrows the gap; the
# ratio of machine time is one reason for the price gap, not the whole of it.
#
# ## 4. Long context: is it the bytes?
#
# Each decode step also reads the whole KV cache, so a step should cost a little more per cached token: the
# cache's bytes per token divided by the reading rate. Compare that with the slope of your measurements:

# %%
import numpy as np

slope = float(np.polyfit(contexts, decode_s, 1)[0])  # seconds per cached token
bytes_slope = kv_per_token / read_bw
crossover = int(wb // kv_per_token)
print(f"KV cache: {kv_per_token:,.0f} bytes per token -> equals the weights at {crossover:,} tokens "
      f"(this model's window: {cfg.max_position_embeddings:,})")
print(f"measured: +{slope * 1e6:.2f} us per cached token; reading those bytes at {read_bw / 1e9:.1f} GB/s: "
      f"+{bytes_slope * 1e6:.2f} us -> the measured slope is {slope / bytes_slope:.1f}x the bytes model")
ax = plots.plot_xy(contexts, [s * 1000 for s in decode_s], "tokens in the cache", "ms per decode step", fit_line=True,
                   spread=[(min(t.seconds) * 1000, max(t.seconds) * 1000) for t in decode_runs],
                   title="Decode: time per token against tokens in the cache (mean of 8 steps; bars: fastest to slowest)")
plt.show()

# %% [markdown]
# If the last line printed a ratio well above 1, the cache's bytes do not explain the slope. The cause is the
# library's cache itself: transformers' `DynamicCache` grows by concatenation (`torch.cat`), so every decode
# step allocates new key and value tensors for all thirty layers and copies the whole cache into them: the
# cache is read and written again at every token, beside the reading attention needs. Lesson 11 writes a cache
# that is allocated once and filled in place, and measures the difference (its bench: `engine.long_context_ratio`).
# A few thousand tokens with eight steps each also leave room for noise: look at how far the points lie from the line.
#
# ## 5. Your machine beside others
#
# `python -m course_lib bench` runs these measurements and more, and writes a JSON file. The runs the course
# committed are in `data/benchmarks/`, each stamped with its machine, thread count and date; the table lists
# those that measured the reading ceiling as section 3 does (older runs used another probe, and their
# percentages are not comparable). So far they come from the course's own development machines, not from a
# range of learners' computers: add yours.

# %%
runs = [json.loads(p.read_text()) for p in sorted(Path("../data/benchmarks").glob("bench-*.json"))]
# note: only runs whose reading ceiling was measured as here (a probe beyond the caches, beside a matrix product)
runs = [r for r in runs if {"prefill", "decode", "bandwidth"} <= set(r) and "matmul_flops_per_s" in r["bandwidth"]]
print(f"{'machine':<34}{'dtype':<10}{'threads':>8}{'decode ms/tok':>14}{'prefill tok/s (max)':>21}{'of reading ceiling':>20}")
for r in runs:
    print(f"{r['machine']['name'][:33]:<34}{r['dtype']:<10}{r.get('threads', '?'):>8}{r['decode'][0]['seconds_per_token'] * 1000:>14.1f}"
          f"{max(p['tokens_per_s'] for p in r['prefill']):>21.0f}{r['bandwidth']['utilisation']:>20.0%}")
print(f"{'this notebook, now':<34}{str(model.dtype).split('.')[-1]:<10}{torch.get_num_threads():>8}{decode_s[0] * 1000:>14.1f}"
      f"{max(n / s for n, s in zip(lengths, prefill_s)):>21.0f}{wb / decode_s[0] / read_bw:>20.0%}")
print("GPU runs committed:", sum(r["machine"]["device"].startswith("cuda") for r in runs))

# %% [markdown]
# **On a big GPU** (no GPU run is committed yet: the count above says so; this paragraph is arithmetic,
# not a measurement): a GPU reading a few terabytes per second would read this model's float32 weights
# (the megabytes printed in section 3) in a fraction of a millisecond, so at batch size 1 something else
# should set the step's time: launching its many small operators, one after another, from Python. How
# many? The profiler counts the operators one decode step runs, here:

# %%
from course_lib.measure.race import decode_profile
profile = decode_profile(model, filler_ids(tokenizer, 64), steps=2)
print(f"one decode step runs {profile['aten_calls_per_step']:.0f} torch operator calls (nested ones included)")

# %% [markdown]
# On a GPU most of them launch a kernel, and each launch costs microseconds of CPU time whatever the kernel
# does; thousands of them add up to milliseconds, far more than the weights' read. Two remedies exist: batching
# many requests into each step (lesson 09), and capturing the whole step once as a CUDA graph with a static cache (`torch.compile`
# with "reduce-overhead"), which removes the per-kernel launch cost. The course has not yet measured
# the second on a GPU; the committed files say what was measured.

# %% [markdown]
# ---
# ## Summary
#
# - Prefill processes the whole prompt in one pass; its tokens per second grow with prompt length up to a
#   point (section 1 printed where it stopped growing here).
# - Decode produces one token per pass and must read every weight each time: about half an operation per byte
#   in float32, far left of this machine's ridge point, so memory is its ceiling (section 3 printed how much of
#   it decode used).
# - Prefill's intensity grows with the prompt: past the ridge point its ceiling is arithmetic, not memory.
# - Both ceilings are measured in the same run: a sum over a buffer larger than the caches, and a large matrix product.
# - Decode slows as the cache grows; with the library's concatenating cache the slope is more than the cache's
#   bytes explain (section 4 printed by how much), because each step copies the whole cache.
# - At batch 1 on a big GPU, a small model's step should be set by its thousands of kernel launches rather than
#   by its bytes: arithmetic from the operator count above, not yet measured on a GPU by the course.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `achieved_bandwidth(weight_bytes, seconds_per_token)`.

# %%
from course_lib.exercises import lesson08 as ex

def achieved_bandwidth(weight_bytes, seconds_per_token):
    ...  # your code here
    raise NotImplementedError

ex.check_bandwidth(achieved_bandwidth)

# %% [markdown]
# **2.** A server decodes a batch of `batch` rows in each step: it reads the weights once for all of them, and
# each row reads its own cache. Write `crossover_context(weight_bytes, kv_bytes_per_token, batch)`: the context
# per row (an int, rounded down) at which one step reads as many cache bytes as weight bytes. Then try this
# model's numbers at batch 1 and 16.

# %%
def crossover_context(weight_bytes, kv_bytes_per_token, batch):
    ...  # your code here
    raise NotImplementedError

ex.check_crossover(crossover_context)

# %% [markdown]
# **3.** Measure: prefill tokens per second at 256 prompt tokens, divided by decode tokens per second
# with 256 tokens of context (use `prefill_seconds` and `decode_seconds`). Put it in `ratio`; the
# check reruns the measurement and accepts a tolerance.

# %%
ratio = None  # your measurement here
ex.check_phase_ratio(ratio, model, tokenizer)

# %% [markdown]
# **4. Predict, then measure.** A retrieval app pastes 2,000 tokens of documents into the prompt. Before
# running anything, predict from section 1's numbers how many seconds its prefill takes on this machine
# (the time to first token, near enough) and write it in `prediction_s`. The check then measures it and
# accepts a factor of 1.5. Then compare it with decoding a 100-token answer at that context (section 2):
# which part of the wait is larger here?

# %%
prediction_s = None  # your prediction, in seconds, written before you run this cell
ex.check_ttft_prediction(prediction_s, model, tokenizer)

# %% [markdown]
# **Next:** 09 · batching, where many requests share each decode step.
