# %% [markdown]
# # 09 · Batching: many requests, one forward pass
#
# **Goal.** Serve several requests with the same forward passes, see what padding costs, measure the
# trade between throughput and latency, and compare static with continuous batching on one trace.
#
# **You will**
# - build a left-padded batch with its attention mask and position IDs, and check it changes no answer;
# - measure throughput and latency as the batch grows;
# - run a real scheduler that refills a finished request's slot at once, and see its timeline.

# %% [markdown]
# ## Set-up

# %%
import statistics
import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots_perf
from course_lib.engine.schedulers import left_pad, padding_waste
from course_lib.engine.generation import generate, generate_static, run_schedule
from course_lib.engine.request import Job
from course_lib.measure.speed import throughput_latency
from course_lib.text.context import chat_ids

model, tokenizer = course_lib.load_model()
questions = ["What is the capital of France?", "Write a short story about a robot who learns to paint.",
             "What is 2 + 2?", "Give me three tips for staying focused while studying at home."]
prompts = [chat_ids(tokenizer, q) for q in questions]
print("prompt lengths:", [len(p) for p in prompts])

# %% [markdown]
# ## 1. Prompts of different lengths in one batch
#
# A batch is a rectangle: B rows of T tokens. Shorter prompts are **padded**, on the left, so that every
# row's last real token sits in the last column (that is where the next token is read). The **attention
# mask** tells the model to ignore the padding, and **position IDs** count only real tokens, so a padded
# row sees exactly what it would see alone.

# %%
batch = left_pad(prompts, tokenizer.pad_token_id)
print("input_ids (B, T):", tuple(batch.input_ids.shape))
print("first row, start:", batch.input_ids[0, :8].tolist(), "| mask:", batch.attention_mask[0, :8].tolist(),
      "| positions:", batch.position_ids[0, :8].tolist())
ax = plots_perf.plot_padding(batch.attention_mask, [q[:30] for q in questions])
plt.show()

# %%
pad, total = padding_waste([len(p) for p in prompts])
print(f"padding: {pad} of {total} token slots ({pad / total:.0%}) are computed and thrown away")

# %% [markdown]
# **Does batching change the answers?** In exact arithmetic it cannot. Each prompt run alone against the same
# prompts run as one batch, greedy, in this notebook's dtype on its device (printed first: the course's runs
# were float32 on the CPU; in bfloat16 a near-tie can flip, as the next cell explains):

# %%
print("dtype and device:", model.dtype, model.device.type)
batched = generate_static(model, tokenizer, prompts, max_new_tokens=40)
alone = [generate(model, tokenizer, p, max_new_tokens=40).token_ids for p in prompts]
for q, b, a in zip(questions, batched, alone):
    print(f"{q[:40]:<42} identical: {b == a}  {tokenizer.decode(b, skip_special_tokens=True)[:50]!r}")

# %% [markdown]
# Identical tokens, but are the numbers identical? The first step's logits of each prompt, alone against in
# the padded batch, and how far apart the two best tokens were (if the gap were smaller than the
# difference, greedy could pick the other one):

# %%
from course_lib.runner.forward import run_model
with torch.inference_mode():
    together, _ = run_model(model, batch.input_ids.to(model.device), None, batch.attention_mask, batch.position_ids, keep=1)
for row, (q, p) in enumerate(zip(questions, prompts)):
    solo, _ = run_model(model, torch.tensor([p], device=model.device), None, keep=1)
    top2 = solo[0, -1].topk(2).values
    print(f"{q[:40]:<42} largest logit difference {(solo[0, -1] - together[row, -1]).abs().max():.2e} | "
          f"gap between the two best tokens {top2[0] - top2[1]:.3f}")

# %% [markdown]
# Where the logits differ, they differ in their last digits (in the runs made for this lesson, the rows that
# needed no padding came out bit for bit equal): a row padded differently makes the kernels add the same
# numbers in another order, and floating-point addition is not associative. The greedy pick only changes
# when the two best tokens are closer than that difference, which did not happen on these prompts (compare
# the two columns). On a long answer, with another batch, in bfloat16 or on a GPU, a near-tie can flip
# one token and the rest of the answer follows it. That is why a server at temperature 0 gives the same
# answer only as long as the batches it forms are the same: the course's tests compare tokens on these
# prompts in float32 and compare logits with a tolerance (1e-4).
#
# ## 2. Throughput against latency
#
# Put B copies of one request in a batch and generate 32 tokens each. **Throughput** is the tokens per
# second of the whole batch; **latency** is how long each request waits for its answer. Every size runs three
# times, round after round; the median is printed with the fastest and slowest run beside it, and the figure's
# bars span them, so a busy moment shows as a long bar rather than as a bend in the curve.

# %%
sizes = [1, 2, 4, 8, 16]
rows = throughput_latency(model, prompts[0], sizes, new_tokens=32, repeats=3)
for r in rows:
    print(f"batch {r['batch']:>2}: {r['tokens_per_s']:6.1f} tokens/s in total, each request waits {r['latency_s']:.2f} s "
          f"(runs {min(r['seconds_runs']):.2f}-{max(r['seconds_runs']):.2f} s)")
ax = plots_perf.plot_throughput_latency(rows)
plt.show()

# %% [markdown]
# Read the two curves. Each decode step reads all the weights once whatever the batch size (lesson 08),
# so extra rows should ride along cheaply at first: throughput climbs while latency grows more slowly (the
# printed rows say what each doubling cost in latency here; on a busy machine the first can cost the most).
# The weights are shared; the KV cache is not: every row reads its own cache at every step. With short prompts
# like these the cache is a small fraction of the bytes; at a longer context per row it takes over, and
# sooner the bigger the batch:

# %%
from course_lib.runner.kv_cache import kv_bytes_per_token
from course_lib.measure.prefill_decode import weight_bytes

cfg = model.config
w_bytes, per_token = weight_bytes(model), kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                             cfg.head_dim, model.dtype.itemsize)
for r in rows:
    context = len(prompts[0]) + 32  # a row's context at the last step measured above
    print(f"batch {r['batch']:>2}: caches {r['batch'] * context * per_token / 1e6:6.1f} MB beside {w_bytes / 1e6:.0f} MB "
          f"of weights per step; the caches would outweigh the weights from {w_bytes // (r['batch'] * per_token):,.0f} "
          "tokens per row")

# %% [markdown]
# So "extra rows ride along cheaply" holds for the weights and for short contexts only: a batch whose rows each
# hold more than the printed number of tokens reads more cache than weights at every step (lesson 08's exercise
# 2 computes the crossover; lesson 17 measures what a long context costs one row).
#
# On a 2-core CPU the arithmetic soon becomes the limit and latency rises with the batch; a GPU, with far more
# arithmetic per byte read, should keep the ride cheap to much larger batches (not measured here: no GPU run is
# committed). What these curves measure is "a bigger batch makes each step slower but produces more per
# second". The seed's "waiting to fill a batch" is something else, a queue: requests arriving one by one and
# held back until a batch forms. Here all B requests start together and nobody waits for a batch to fill; in
# section 3 requests wait for a free slot, and lesson 13's server load measures waiting under a stream of
# arrivals.
#
# **"Batching is how a few GPUs serve millions of users."** Put numbers on it with this machine's rows. A
# person reads about 5 tokens a second (roughly 4 words); a streaming answer that keeps up with them is
# served, so a machine making T tokens per second in total keeps about T / 5 readers busy at once:

# %%
reading_speed = 5.0  # tokens per second a reader consumes (an assumption: about 4 words a second)
for r in (rows[0], max(rows, key=lambda r: r["tokens_per_s"])):
    print(f"batch {r['batch']:>2}: {r['tokens_per_s']:6.1f} tokens/s -> about {r['tokens_per_s'] / reading_speed:4.1f} "
          f"readers served at once on this machine")
best = max(rows, key=lambda r: r["tokens_per_s"])
print(f"batching multiplied the readers served by {best['tokens_per_s'] / rows[0]['tokens_per_s']:.1f}x here")

# %% [markdown]
# So batching multiplies what one machine serves, by the factor printed. Millions of users on a few GPUs
# also needs what this CPU does not show: far more tokens per second per machine (a GPU's; the course has no
# GPU run committed yet), and users who are not all reading an answer at the same moment. The claim's
# direction holds here; its size is not something this notebook measures.
#
# ## 3. Static against continuous batching
#
# Real traffic mixes short and long answers. A **static** scheduler starts a batch and waits for its
# longest request before starting the next: short requests finish early and leave their slots idle.
# A **continuous** scheduler refills a slot as soon as it frees: the finished request's rows are dropped
# from the KV cache and the newcomer's prefilled cache is padded and joined to the batch. Both run the
# real model on one trace: ten requests queued at once, answers of 4 to 60 tokens, at most 4 at a time.

# %%
lengths = [60, 8, 12, 40, 4, 24, 50, 6, 16, 30]
def trace():
    return [Job(f"r{i}", prompts[i % len(prompts)], n) for i, n in enumerate(lengths)]
static = run_schedule(model, trace(), max_batch=4, continuous=False)
continuous = run_schedule(model, trace(), max_batch=4, continuous=True)
print("same tokens either way:", all(a.tokens == b.tokens for a, b in zip(static, continuous)))

# %%
def summary(jobs):
    lat = sorted(j.end for j in jobs)
    makespan = max(j.end for j in jobs)
    return (f"throughput {sum(len(j.tokens) for j in jobs) / makespan:5.1f} tok/s | mean latency "
            f"{statistics.mean(lat):5.2f} s | p90 latency {lat[int(0.9 * (len(lat) - 1))]:5.2f} s | all done at {makespan:5.2f} s")
print("static:    ", summary(static))
print("continuous:", summary(continuous))

# %%
ax = plots_perf.plot_timeline({"static": static, "continuous": continuous})
plt.show()

# %% [markdown]
# In the static run, look at the bars of each group: a short request's slot stays empty until the
# group's longest request ends, and the next group waits. In the continuous run, new requests start
# as soon as any slot frees. Compare the numbers printed above: the same work, finished sooner, with
# lower waiting times. Production servers (vLLM, TGI) schedule this way at every decode step.

# %% [markdown]
# ---
# ## Summary
#
# - A batch is a padded rectangle; the attention mask and position IDs keep padded rows exact.
# - Padding is wasted work: batching prompts of very different lengths wastes the most.
# - Bigger batches raise throughput while latency grows: the trade is measured, not assumed.
# - Static batching waits for the longest request; continuous batching refills slots at once.
# - Batched greedy output was identical to each request run alone here; the logits differ in their last
#   digits (section 1 printed by how much), so a near-tie can flip a token under another batch shape.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `my_left_pad(sequences, pad_id)` returning `(input_ids, attention_mask)` as (B, T) tensors.

# %%
import torch  # for your answer to exercise 1
from course_lib.exercises import lesson09 as ex

def my_left_pad(sequences, pad_id):
    ...  # your code here
    raise NotImplementedError

ex.check_left_pad(my_left_pad)

# %% [markdown]
# **2.** Write `waste_fraction(lengths)`: the share of a padded batch's slots that are padding.

# %%
def waste_fraction(lengths):
    ...  # your code here
    raise NotImplementedError

ex.check_waste(waste_fraction)

# %% [markdown]
# **3.** Write `mean_latency(jobs)`: the mean time until each job's last token (`job.end`; all jobs were
# queued at time 0). Then compare `mean_latency(static)` and `mean_latency(continuous)`.

# %%
def mean_latency(jobs):
    ...  # your code here
    raise NotImplementedError

ex.check_mean_latency(mean_latency)

# %% [markdown]
# **4. Predict, then measure.** Section 2 measured batches of 1, 2, 4, 8 and 16. Predict the total tokens per
# second of a batch of **12** copies of the same prompt (32 new tokens each), write it in `prediction_tps`,
# then run the check: it measures that batch.

# %%
prediction_tps = None  # your prediction, in tokens per second for the whole batch
ex.check_batch_prediction(prediction_tps, model, prompts[0], batch=12)

# %% [markdown]
# **Next:** 10 · serving, where this scheduler sits behind an HTTP API.
