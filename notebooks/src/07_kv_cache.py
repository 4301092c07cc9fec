# %% [markdown]
# # 07 · The KV cache: time saved, memory spent
#
# **Goal.** Measure what the KV cache buys and what it costs, on the real model: time per token with
# and without it, the bytes it holds, and what a server must do when those bytes run out.
#
# **You will**
# - generate the same text with and without the cache, and time every token both ways;
# - compute the cache's size from a formula and check it against the real cache object;
# - test the claim that inference gets "exponentially heavier" with context (it does not).

# %% [markdown]
# ## Set-up

# %%
import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots, plots_perf
from course_lib.text.context import story_ids, filler_ids
from course_lib.engine.stages import prefill, decode_step
from course_lib.runner.kv_cache import positions_processed, kv_bytes_per_token, model_kv_bytes_per_token, cache_bytes
from course_lib.engine.budget import Request, simulate_budget
from course_lib.measure.speed import cached_run, uncached_run

model, tokenizer = course_lib.load_model()
cfg = model.config
prompt = story_ids(tokenizer)  # the course's long answer: a short story
print("prompt tokens:", len(prompt))

# %% [markdown]
# ## 1. What is cached, and why it is allowed
#
# In each layer, attention turns every token into a **key** and a **value** vector. A token's key and
# value depend only on that token and the ones before it (the causal mask), so once computed they
# never change. The cache keeps them; each new token then needs only its own keys and values, plus
# attention over the stored ones. Our loop names the two stages: `prefill` fills the cache from the
# prompt, `decode_step` adds one token.

# %%
logits, cache = prefill(model, prompt)
print("after prefill the cache holds", cache.get_seq_length(), "positions")
logits, cache = decode_step(model, [int(logits[0].argmax())], cache)
print("after one decode step:", cache.get_seq_length(), "| keys of layer 0 (B, KV heads, T, D):",
      tuple(cache.layers[0].keys.shape))

# %% [markdown]
# ## 2. Same tokens, different cost
#
# We generate 96 tokens greedily twice: with the cache, and by re-running the whole sequence at every
# step. First, the equivalence: in exact arithmetic the tokens are identical. The line below says whether they
# were in this run, with its dtype and device: in float32 on the CPU they were in every run of the course;
# in bfloat16 (a GPU's default) a near-tie can flip, and section 3 measures how often.

# %%
N = 96
cached = cached_run(model, tokenizer, prompt, N)  # generation.generate, the loop, with no stop token
uncached = uncached_run(model, prompt, N, show_progress=True)  # every step re-runs the whole sequence: no cache, on purpose
print("identical tokens:", cached.token_ids == uncached.token_ids, f"({model.dtype}, {model.device.type})")
print(f"total: {cached.total:.1f} s with the cache, {uncached.total:.1f} s without -> {uncached.total / cached.total:.1f}x")

# %%
ax = plots_perf.plot_cache_timing(cached.seconds, uncached.seconds)
plt.show()

# %% [markdown]
# With the cache each step costs about the same (one new position, plus a little attention over a
# longer cache). Without it each step re-processes every position so far, so its cost climbs with
# every token. The work, counted in token positions pushed through the model:

# %%
print(f"positions processed: {cached.positions_processed:,} with the cache, {uncached.positions_processed:,} without")
print("formula:", positions_processed(len(prompt), N, True), "and", positions_processed(len(prompt), N, False))

# %% [markdown]
# **"Exponentially heavier with each new word."** A popular explanation says so. The count above is
# a sum of prompt + 0, prompt + 1, ... prompt + N - 1: it grows with the **square** of N (quadratic),
# not exponentially; and with a cache it grows linearly. Look at the measured curves: the uncached
# one climbs in a straight line per token (so its running total is quadratic), nothing like an
# exponential. And the time ratio grows with N: here it is for the first N tokens of the two runs above.

# %%
for n in [8, 16, 32, 64, N]:
    print(f"first {n:>3} tokens: {sum(uncached.seconds[:n]) / sum(cached.seconds[:n]):4.1f}x faster with the cache")

# %% [markdown]
# That is why the cache matters most for long answers. The counts, for more N than we have time to run:

# %%
ns = [8, 16, 32, 64, 128, 256, 512]
ax = plots.plot_xy(ns, [positions_processed(len(prompt), n, False) for n in ns], "new tokens",
                   "token positions processed", label="no cache (quadratic)")
plots.plot_xy(ns, [positions_processed(len(prompt), n, True) for n in ns], "new tokens", "token positions processed",
              ax=ax, label="KV cache: positions through the weights (linear)", title="Work to generate N tokens (counted, not timed)")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. Half precision: same tokens, slightly different numbers
#
# In half precision (bfloat16, the GPU default) the cached and uncached computations add numbers in
# different orders and round differently. Measured on this CPU with the model converted to bfloat16, at every
# one of section 2's 96 positions: the whole sequence in one pass (no cache) against the prompt's prefill and
# then one cached step per token, both fed the same tokens:

# %%
half, _ = course_lib.load_model(dtype="bfloat16", device="cpu", verbose=False)
seq = prompt + cached.token_ids  # section 2's tokens
with torch.inference_mode():
    whole = half(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1:-1].float()  # (N, V): no cache
    first, c = prefill(half, prompt)
    rows = [first.reshape(-1).float()]
    for t in cached.token_ids[:-1]:
        step, c = decode_step(half, [t], c)  # the cache: one token at a time
        rows.append(step.reshape(-1).float())
stepwise = torch.stack(rows)  # (N, V)
gap = (whole - stepwise).abs().amax(dim=-1)  # per position
flips = int((whole.argmax(-1) != stepwise.argmax(-1)).sum())
print(f"bfloat16, cached against uncached over {N} positions: largest |logit difference| {float(gap.max()):.3f} "
      f"(median {float(gap.median()):.3f}); top token differs at {flips} of {N}")

# %% [markdown]
# Read the last number. Where it is 0, differences of this size changed no top token on this text; where it
# is not, those positions were near-ties, and a greedy generation that met one would diverge from there. That
# is expected, not a bug: the two paths compute the same function in a different order. (We free the bfloat16
# copy now.)

# %%
del half, c

# %% [markdown]
# ## 4. How big is the cache?
#
# Per token, the cache stores a key and a value vector for every layer and every **key/value** head:
#
# bytes per token = 2 × layers × key/value heads × head dimension × bytes per number

# %%
for dtype in (torch.bfloat16, torch.float32):
    print(f"{str(dtype):>15}: {model_kv_bytes_per_token(cfg, dtype):,.0f} bytes per token")
_, cache = prefill(model, filler_ids(tokenizer, 500))
print(f"measured on a real cache of 500 tokens ({model.dtype}): {cache_bytes(cache):,} bytes = "
      f"{cache_bytes(cache) / 500:,.0f} per token")

# %%
measured = {}
for n in [64, 256, 1024, 2048]:
    _, cache = prefill(model, filler_ids(tokenizer, n))
    measured[n] = cache_bytes(cache)
tokens = list(range(0, cfg.max_position_embeddings + 1, 512))
per = model_kv_bytes_per_token(cfg, model.dtype)
ax = plots_perf.plot_kv_memory(tokens, [t * per for t in tokens], measured,
                               title=f"KV cache of this model ({str(model.dtype).split('.')[-1]}): linear in tokens")
plt.show()

# %% [markdown]
# The cache grows **linearly** with the context: every token adds the same number of bytes. Another
# popular text says memory "increases exponentially" with long contexts; the dots above are measured,
# and they sit on a straight line.
#
# ## 5. What if the model were bigger?
#
# The same formula for a larger design: 80 layers, 8 key/value heads of dimension 128 (a 70B-class
# model with grouped-query attention), against the same model with full multi-head attention (64
# key/value heads), at 128k tokens, in bfloat16.

# %%
L, KV, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
designs = {f"this model ({L} L, {KV} KV heads, D {D})": (L, KV, D), "70B-class, GQA (80 L, 8 KV, D 128)": (80, 8, 128),
           "70B-class, full MHA (80 L, 64 KV, D 128)": (80, 64, 128)}
for name, (layers, kv, d) in designs.items():
    per_token = kv_bytes_per_token(layers, kv, d, 2)
    print(f"{name:<42} {per_token / 1e3:8.1f} kB/token   {per_token * 128_000 / 2**30:7.1f} GiB at 128k tokens")

# %% [markdown]
# At 128k tokens a single conversation's cache is tens of GiB with grouped-query attention and eight
# times more without it. The window itself is set by training (lesson 02: 8,192 positions here); what memory
# limits is how many long conversations a server can hold at once, since every request's cache competes with
# the weights for the same GPU memory.
#
# ## 6. A fixed KV budget: reject, evict, or preempt?
#
# A server has room for a fixed number of cached tokens. Requests arrive with different prompt and
# answer lengths; the server knows each prompt but not how long the answer will be, only its `max_tokens`
# (128 for every request here). Three policies: **reject** admits a request only if its prompt plus its
# `max_tokens` can be reserved, and turns it away otherwise; **evict** admits whenever the prompt fits and, when memory runs out,
# drops the oldest conversations (the ones with the most finished work); **preempt**, what production
# servers such as vLLM do, also admits whenever the prompt fits but, when memory runs out, pauses the
# most recently admitted request, frees its memory and recomputes its cache when room returns. One
# trace, three policies, simulated step by step, with the work each throws away (tokens computed, then lost):

# %%
trace = [Request(name, arrival, prompt, answer, max_tokens=128) for name, arrival, prompt, answer in
         [("A", 0, 60, 80), ("B", 5, 40, 120), ("C", 12, 120, 40), ("D", 20, 30, 60), ("E", 30, 90, 50),
          ("F", 45, 50, 40), ("G", 60, 20, 30)]]
BUDGET = 450  # tokens
outcomes = {policy: simulate_budget(trace, BUDGET, policy) for policy in ("reject", "evict", "preempt")}
for policy, out in outcomes.items():
    print(f"{policy:>7}: {out.finished} of {len(trace)} finished, {out.lost:4d} tokens of work lost, "
          f"{len(out.usage)} steps | " + ", ".join(f"{r.name} {out.status.get(r.name, '?')}" for r in trace))
knew = simulate_budget([Request(r.name, r.arrival, r.prompt, r.answer) for r in trace], BUDGET, "reject")
print(f"reject, had it known each answer's true length (no server does): {knew.finished} of {len(trace)} finished")

# %%
fig = plots_perf.plot_budget_runs(outcomes, BUDGET, [r.name for r in trace])
plt.show()

# %% [markdown]
# Read the lines above. Reserving each request's allowance never loses work but leaves memory idle (the
# reserved space is not yet used, and most of it never will be: answers are shorter than their `max_tokens`)
# and turns requests away; the last line shows how much of that comes from not knowing the answers' lengths. Evicting the oldest keeps memory full but
# throws away the conversations that had the most finished work. Preempting the newest also
# recomputes tokens, but every request finishes: the lost work is a delay, not a lost answer. Lesson 13
# builds this for real, with the cache allocated in small blocks on demand.

# %% [markdown]
# ---
# ## Summary
#
# - The cache stores each token's keys and values per layer; they never change, so they need computing once.
# - With the cache each step processes one position; without it every step re-processes everything: quadratic work.
# - Cache memory is 2 × layers × KV heads × head dim × bytes per token: linear in context, never exponential.
# - Grouped-query attention divides that memory by the number of query heads per key/value head.
# - A full KV budget forces a choice: reject new requests, evict running ones (their work is lost), or
#   preempt and recompute later (every request finishes; the simulation counts the tokens recomputed).

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `kv_bytes(tokens, layers, kv_heads, head_dim, bytes_per_number)`: the cache size.

# %%
from course_lib.exercises import lesson07 as ex

def kv_bytes(tokens, layers, kv_heads, head_dim, bytes_per_number):
    ...  # your code here
    raise NotImplementedError

ex.check_kv_bytes(kv_bytes, model)

# %% [markdown]
# **2.** Write `positions_without_cache(prompt_len, n_new)`: the token positions pushed through the model
# to generate `n_new` tokens when every step re-runs the whole sequence.

# %%
def positions_without_cache(prompt_len, n_new):
    ...  # your code here
    raise NotImplementedError

ex.check_positions(positions_without_cache)

# %% [markdown]
# **3.** Measure it yourself: generate 48 tokens with and without the cache (`cached_run`,
# `uncached_run`) from `prompt`, and put the time ratio (uncached / cached) in `ratio`. The check
# reruns the measurement and accepts your ratio within a tolerance (timings vary).

# %%
ratio = None  # your measurement here
ex.check_ratio(ratio, model, tokenizer, prompt)

# %% [markdown]
# **4. Predict, then measure.** Section 2's plot shows what a cached decode step costs with a few hundred
# tokens in the cache. Predict the milliseconds of one cached step once the cache holds **3,000** tokens (ten
# times more), write it in `prediction_ms`, then run the check: it prefills 3,000 tokens and times the steps.

# %%
prediction_ms = None  # your prediction, in milliseconds per decode step
ex.check_long_step_prediction(prediction_ms, model, tokenizer, context=3000)

# %% [markdown]
# **Next:** 08 · prefill and decode, where the two stages are timed separately.
