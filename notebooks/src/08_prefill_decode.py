# %% [markdown]
# # 08 · Prefill and decode: two stages, two different limits
#
# **Goal.** Time the two stages of inference separately and find out what limits each: prefill reads
# the whole prompt in one parallel pass; decode produces one token per pass and spends its time
# reading weights from memory.
#
# **You will**
# - measure time to first token against prompt length, and decode time against context length;
# - compute the memory bandwidth decode achieves and compare it with this machine's own;
# - put your numbers beside committed benchmark runs from other machines.

# %% [markdown]
# ## Set-up

# %%
import json
from pathlib import Path
import matplotlib.pyplot as plt
import course_lib
from course_lib import plots
from course_lib.measure.bench import prefill_seconds, decode_seconds, memory_bandwidth, weight_bytes
from course_lib.kv_cache import model_kv_bytes_per_token
from course_lib.context import filler_ids
from course_lib.anatomy import flops_per_token
from course_lib.runtime import describe_device

model, tokenizer = course_lib.load_model()
cfg = model.config
print(describe_device(model.device))

# %% [markdown]
# ## 1. Prefill: the prompt in one pass
#
# The time to first token is mostly prefill. We time it for prompts of growing length:

# %%
lengths = [16, 64, 256, 1024]
prefill_s = prefill_seconds(model, tokenizer, lengths)
for n, s in zip(lengths, prefill_s):
    print(f"{n:>5} prompt tokens: {s * 1000:7.1f} ms  -> {n / s:7.0f} tokens/s")

# %%
ax = plots.plot_xy(lengths, [n / s for n, s in zip(lengths, prefill_s)], "prompt tokens", "prefill tokens per second",
                   title="Prefill: tokens per second against prompt length")
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
contexts = [16, 256, 1024, 2048]
decode_s = decode_seconds(model, tokenizer, contexts)
for c, s in zip(contexts, decode_s):
    print(f"context {c:>5}: {s * 1000:6.1f} ms per token -> {1 / s:5.1f} tokens/s")
print(f"prefill at {lengths[-1]} tokens is {lengths[-1] / prefill_s[-1] / (1 / decode_s[0]):.0f}x more tokens per second "
      f"than decode")

# %% [markdown]
# ## 3. Why decode is bound by memory
#
# Every decode step must read **every weight** once, to produce a single token. If reading were the
# only cost, a step would take (weight bytes) / (memory bandwidth). We compute the bandwidth each
# step achieves, and measure this machine's read bandwidth in the same run the way decode reads: a sum
# over a 1 GB buffer, far larger than the caches, reads each byte once (lesson 12 uses the same ceiling):

# %%
wb = weight_bytes(model)
achieved = wb / decode_s[0]
read_bw = memory_bandwidth(model.device)
print(f"weights: {wb / 1e6:.0f} MB read per decode step")
print(f"decode achieves {achieved / 1e9:.1f} GB/s; streaming reads on this machine reach {read_bw / 1e9:.1f} GB/s "
      f"-> utilisation {achieved / read_bw:.0%}")

# %% [markdown]
# And the arithmetic? About 2 operations per weight per token:

# %%
flops = flops_per_token(sum(p.numel() for p in model.parameters()), cfg.vocab_size * cfg.hidden_size)
print(f"decode: {flops / decode_s[0] / 1e9:.1f} GFLOP/s | prefill at {lengths[-1]} tokens: "
      f"{flops * lengths[-1] / prefill_s[-1] / 1e9:.1f} GFLOP/s")

# %% [markdown]
# The same machine does many times more arithmetic per second in prefill than in decode. Decode is
# starved: it waits for weights to arrive, and uses each one for a single multiply-add. On a CPU with
# a small model, part of each step is also fixed overhead (Python, thirty layers of small operations),
# so the utilisation printed above stays below 100%.
#
# ## 4. Long context: when the cache outweighs the weights
#
# Each decode step also reads the whole KV cache. At some context length the cache read becomes as
# large as the weight read:

# %%
kv_per_token = model_kv_bytes_per_token(cfg, model.dtype)
crossover = int(wb // kv_per_token)
print(f"KV cache: {kv_per_token:,.0f} bytes per token -> equals the weights at {crossover:,} tokens "
      f"(this model's window: {cfg.max_position_embeddings:,})")
ax = plots.plot_xy(contexts, [s * 1000 for s in decode_s], "tokens in the cache", "ms per decode step", fit_line=True,
                   title="Decode: time per token against tokens in the cache")
plt.show()

# %% [markdown]
# Decode time creeps up with context (the fitted slope is the cost per cached token). For this small
# model the weights dominate across its whole window; for large models serving long contexts to many
# users, the cache reads (and the memory to hold them) become the main cost, as lesson 07's what-if
# table suggests.
#
# ## 5. Your machine beside others
#
# `python -m course_lib bench` runs these measurements and more, and writes a JSON file. Runs that the
# course committed (on other machines, each stamped with where and when) are in `data/benchmarks/`:

# %%
runs = [json.loads(p.read_text()) for p in sorted(Path("../data/benchmarks").glob("bench-*.json"))]
runs = [r for r in runs if {"prefill", "decode", "bandwidth"} <= set(r)]  # the runs that measured these sections
print(f"{'machine':<34}{'dtype':<10}{'decode ms/tok':>14}{'prefill tok/s (max)':>21}{'bandwidth used':>16}")
for r in runs:
    print(f"{r['machine']['name'][:33]:<34}{r['dtype']:<10}{r['decode'][0]['seconds_per_token'] * 1000:>14.1f}"
          f"{max(p['tokens_per_s'] for p in r['prefill']):>21.0f}{r['bandwidth']['utilisation']:>16.0%}")
print(f"{'this notebook, now':<34}{str(model.dtype).split('.')[-1]:<10}{decode_s[0] * 1000:>14.1f}"
      f"{max(n / s for n, s in zip(lengths, prefill_s)):>21.0f}{achieved / read_bw:>16.0%}")
print("GPU runs committed:", sum(r["machine"]["device"].startswith("cuda") for r in runs))

# %% [markdown]
# **On a big GPU** (when a GPU run is committed above, compare it): a 135M model's weights are read in
# microseconds by a GPU with terabytes per second of bandwidth, so at batch size 1 the decode step is
# limited by something else: launching its many small operators, one after another, from Python. How
# many? The profiler counts the operators one decode step runs, here:

# %%
from course_lib.measure.race import decode_profile
profile = decode_profile(model, filler_ids(tokenizer, 64), steps=2)
print(f"one decode step runs {profile['aten_calls_per_step']:.0f} torch operator calls (nested ones included)")

# %% [markdown]
# On a GPU most of them launch a kernel of a few microseconds; the GPU sits mostly idle between them. Two remedies exist: batching many requests into each step
# (lesson 09), and capturing the whole step once as a CUDA graph with a static cache (`torch.compile`
# with "reduce-overhead"), which removes the per-kernel launch cost. The course has not yet measured
# the second on a GPU; the committed files say what was measured.

# %% [markdown]
# ---
# ## Summary
#
# - Prefill processes the whole prompt in one pass; its tokens per second grow with prompt length.
# - Decode produces one token per pass and must read every weight each time: it is bound by memory.
# - Achieved bandwidth = weight bytes / time per token; compare it with what the machine can move.
# - Decode slows as the cache grows; for long contexts and big models the cache becomes the main cost.
# - At batch 1 on a big GPU, a small model is limited by kernel launches, not by bandwidth.

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
# **2.** Write `crossover_context(weight_bytes, kv_bytes_per_token)`: the context length (an int,
# rounded down) at which one decode step reads as many cache bytes as weight bytes.

# %%
def crossover_context(weight_bytes, kv_bytes_per_token):
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
# **Next:** 09 · batching, where many requests share each decode step.
