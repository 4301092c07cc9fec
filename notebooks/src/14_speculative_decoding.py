# %% [markdown]
# # 14 · Speculative decoding: guess several tokens, check them in one pass, keep the same answer
#
# **Goal.** Lesson 08 showed that a decode step's time goes mostly to reading the weights, and a pass over a
# few tokens reads them only once. Speculative decoding spends that spare arithmetic: a cheap drafter guesses
# k tokens, the model checks them all in one pass, keeps the longest prefix it agrees with plus one token
# of its own, and rolls its cache back past the rest. The answer is exactly plain greedy decoding's.
#
# **You will**
# - measure what checking k tokens costs against one, in three weight formats;
# - run three drafters that need no second download (prompt lookup, the 4-bit model, the first layers)
#   and measure acceptance, tokens per verify step and speed-up on two kinds of task;
# - see when it does not pay, and why the sampling version keeps the model's distribution.

# %% [markdown]
# ## Set-up

# %%
import torch
from IPython.display import HTML, display
import course_lib
from course_lib import formats, html_views
from course_lib.context import chat_ids, edit_ids, story_ids
from course_lib.measure.race import generate_exact
from course_lib.generation import generate, prefill
from course_lib.model import Model
from course_lib.runtime import cpu_lesson
from course_lib.speculative import (ModelDrafter, PromptLookup, early_exit, verify, expected_tokens_per_verify,
                                    accept_or_resample)
from course_lib.measure.speed import verify_cost

torch.set_num_threads(1)  # one thread, set explicitly, as in lesson 12
device = cpu_lesson("it runs lesson 12's int4 format, whose 4-bit kernel is a CPU kernel")
model, tokenizer = course_lib.load_model(device=device, dtype="float32")
ours = Model.from_transformers(model)  # float32, lesson 11
int4 = formats.convert(ours, "int4")  # lesson 12's fastest format
edit, story = edit_ids(tokenizer), story_ids(tokenizer)
print("threads:", torch.get_num_threads(), "| grounded edit:", len(edit), "prompt tokens | story:", len(story))

# %% [markdown]
# ## 1. What does checking k tokens cost?
#
# One pass over k + 1 new positions (the last token and k drafted ones) on a cache, against one position:

# %%
ks = [0, 1, 2, 4, 6, 8]
costs = {name: verify_cost(m, edit, ks, repeats=3) for name, m in
         [("float32", ours), ("bfloat16", formats.convert(ours, "bfloat16")), ("int4", int4)]}
for name, c in costs.items():
    print(f"{name:<9}" + "  ".join(f"k={k}: {ms:5.1f} ms ({ms / c[0]:.2f}x)" for k, ms in c.items()))
growth = {name: c[8] / c[0] for name, c in costs.items()}
print("a pass over 9 positions (k = 8) against one step:", ", ".join(f"{n} {g:.2f}x" for n, g in growth.items()),
      f"| grows fastest here: {max(growth, key=growth.get)}, slowest: {min(growth, key=growth.get)}")

# %% [markdown]
# Read the ratios. The weights are read once per pass whatever k is, so a pass over several positions
# should cost far less than that many steps; but not nothing, and how much more than one step depends on
# each format's kernels, which the line above ranks for this run. A format whose one-row kernel is
# specialised (lesson 11 stored float32's biggest matrices by columns for it; the 4-bit kernel is built for
# one row) leaves that kernel as soon as a second row arrives, so its ratio can jump at k = 1. bfloat16's
# ratio depends on whether this CPU has bfloat16 arithmetic (lesson 12 printed it): without it, every extra
# row is emulated and its ratio grows fast. A loaded machine moves these numbers too. Whatever the order,
# the ratio is what a drafter's accepted tokens must pay back.
#
# ## 2. One verify step, by hand
#
# Prompt lookup looks for the last few generated tokens earlier in the prompt and proposes what followed
# them there. On the grounded edit the answer copies much of the paragraph, so its guesses are often right.

# %%
answer = generate(ours, tokenizer, edit, 20)  # plain greedy: the first 20 tokens of the answer
context = edit + answer.token_ids[:12]
logits, cache = prefill(ours, context[:-1])  # the cache holds everything but the last token
draft = PromptLookup(3).propose(context, 6)
v = verify(ours, cache, context[-1], draft)
print("drafted: ", [tokenizer.decode([t]) for t in draft])
print("accepted:", [tokenizer.decode([t]) for t in v.accepted], "+ the model's own:", repr(tokenizer.decode([v.bonus])))
print("plain greedy continues:", [tokenizer.decode([t]) for t in answer.token_ids[12:12 + len(v.accepted) + 1]])
print("cache rolled back to", cache.length, "tokens: context", len(context), "+", len(v.accepted), "accepted")

# %% [markdown]
# ## 3. Same answer, every drafter
#
# The three drafters, each an object with one method `propose(context, k)`. The loop is the course's
# `generate` with `draft=`: streaming and stop conditions work as everywhere else.

# %%
drafters = {"prompt lookup": lambda: PromptLookup(3), "int4 model": lambda: ModelDrafter(int4),
            "first 8 layers": lambda: early_exit(ours, 8)}
N = 40
plain = {task: generate_exact(ours, tokenizer, p, N) for task, p in [("edit", edit), ("story", story)]}
for name, make in drafters.items():
    same = [generate(ours, tokenizer, p, N, stop_ids=(), draft=make(), k=4).token_ids == plain[t]
            for t, p in [("edit", edit), ("story", story)]]
    print(f"{name:<15} same tokens as plain greedy: edit {same[0]}, story {same[1]}")

# %% [markdown]
# ## 4. Acceptance and speed-up against k
#
# For each drafter and task: how many drafted tokens the model accepted, tokens per verify step, and the
# time against plain greedy decoding, measured now.

# %%
import time
def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start
base = {t: timed(lambda p=p: generate_exact(ours, tokenizer, p, N))[1] for t, p in [("edit", edit), ("story", story)]}
rows = []
for name, make in drafters.items():
    for k in ([2, 6] if name != "first 8 layers" else [4]):
        for t, p in [("edit", edit), ("story", story)]:
            r, secs = timed(lambda: generate(ours, tokenizer, p, N, stop_ids=(), draft=make(), k=k))
            s = r.speculative
            rows.append((name, t, k, s.acceptance_rate, s.tokens_per_verify, base[t] / secs, r))
for name, t, k, acc, tpv, speed, _ in rows:
    print(f"{name:<15} {t:<6} k={k}: accepted {acc:.2f}, {tpv:.2f} tokens per verify, speed-up {speed:.2f}x")
paid = [f"{name} on the {t} (k={k}, {speed:.2f}x)" for name, t, k, _, _, speed, _ in rows if speed > 1.0]
print("faster than plain decoding in this run:", "; ".join(paid) if paid else "none (see section 6 for why)")

# %% [markdown]
# Each line is one run, so a busy machine can move a speed-up by tens of percent. What to expect: prompt
# lookup copies the paragraph on the grounded edit, so it is accepted often and costs almost nothing to
# draft; on the course's machine it was the clear winner there (the committed bench,
# `data/benchmarks/bench-cpu-2026-12-01-engine-speculative-threads1.json`: 1.6x at k = 4, one thread). If no
# line paid here, the verify pass cost more than the accepted tokens saved: section 6 computes that
# break-even from section 1's costs.
#
# Read the first-8-layers lines against lesson 03's logit lens: there the answer only appeared in the last
# layers, so the first eight with the model's head rarely guess the final token, and every guess costs.
#
# ## 5. Which tokens were drafted?
#
# The answer to the grounded edit with prompt lookup (k = 2): tokens the drafter guessed and the model
# accepted are highlighted; the others are the model's own.

# %%
r = next(row[6] for row in rows if row[0] == "prompt lookup" and row[1] == "edit")
drafted = set(r.speculative.accepted_at)
pieces = [tokenizer.decode([t]) for t in r.token_ids]
display(HTML(html_views.highlighted_tokens(pieces, [i in drafted for i in range(len(pieces))], "accepted from the draft")))

# %% [markdown]
# ## 6. When does it not pay?
#
# Per verify step we pay k draft proposals plus one pass over k + 1 positions, and we get the accepted
# tokens plus one. With per-token draft cost d, verify cost v(k) and plain step cost s, the speed-up is
# tokens per verify × s / (k × d + v(k)). A drafter that is wrong too often yields about one token per
# verify step, and then every drafted guess is pure cost. Predicted from the costs of section 1 for the
# int4 drafter (its own decode step is its draft cost), against the measurement of section 4:

# %%
s_ms, d_ms = costs["float32"][0], costs["int4"][0]
for name, t, k, acc, tpv, speed, _ in rows:
    if name == "int4 model":
        predicted = tpv * s_ms / (k * d_ms + costs["float32"].get(k, costs["float32"][8]))
        print(f"int4 drafter, {t:<5} k={k}: predicted {predicted:.2f}x, measured {speed:.2f}x "
              f"(break-even needs {((k * d_ms + costs['float32'].get(k, costs['float32'][8])) / s_ms):.2f} tokens per verify)")

# %% [markdown]
# ## 7. Sampling, and why the answer's distribution does not change
#
# With sampling, a drafted token x is accepted with probability min(1, p(x) / q(x)) (p the model's
# distribution, q the drafter's); if rejected, the token is drawn from what is left of p after q,
# max(0, p - q) renormalized. Then every token comes out distributed exactly as p. We check it on real
# probabilities: 4,000 draws of the rule against p itself.

# %%
from course_lib.forward import forward_logits
p = torch.softmax(forward_logits(ours, edit)[0, -1].topk(8).values, -1)  # the model's top 8, renormalized
q = torch.nn.functional.one_hot(torch.tensor(2), 8).float().to(p.device)  # a drafter that always proposes token 2
g = torch.Generator(device=p.device).manual_seed(0)
draws = torch.bincount(torch.tensor([accept_or_resample(p, q, 2, g) for _ in range(4000)]), minlength=8) / 4000
print("model p:    ", [round(float(x), 3) for x in p])
print("rule draws: ", [round(float(x), 3) for x in draws])

# %% [markdown]
# The test suite does this with a chi-square test over 20,000 draws, and shows a wrong rule (drawing from p
# itself after a rejection) failing it, both for the rule alone and inside a verify step.
#
# The loop runs it: give `generate` a sampler (lesson 05) and a drafter. Our drafters propose one token
# for sure (q is one-hot), so a drafted token is kept with probability p(x), the model's own chance of
# drawing it. The hotter the sampling, the less the answer copies the paragraph and the fewer drafts
# survive (one seed, so the run repeats):

# %%
from course_lib.sampling import SamplingConfig, make_sampler
for t in (0.0, 0.7, 1.0):
    r = generate(ours, tokenizer, edit, N, pick=make_sampler(SamplingConfig(temperature=t), seed=0),
                 draft=PromptLookup(3))
    print(f"temperature {t}: acceptance {r.speculative.acceptance_rate:.2f}, "
          f"{r.speculative.tokens_per_verify:.2f} tokens per verify step | {r.text[:70]!r}")

# %% [markdown]
# ---
# ## Summary
#
# - Checking k drafted tokens costs one pass, far less than k steps but more than one: section 1 measured
#   how much for each format, and which grows fastest depends on its kernels and on this CPU.
# - Greedy speculative decoding gives exactly plain greedy's tokens: the model only keeps what it would
#   have chosen itself, and the cache rolls back past the rest in one assignment.
# - It can pay only when the drafter is cheap and often right, such as prompt lookup on text that copies its
#   input; section 4 printed which drafter, if any, paid in this run, and section 6 why the others did not.
# - The sampling rule accepts with min(1, p/q) and resamples from max(0, p - q): the output keeps p, and
#   `generate(..., pick=make_sampler(...), draft=...)` samples that way in the loop.
#
# ---
# ## Exercises
#
# **1.** Write `speedup(tokens_per_verify, step_ms, draft_ms, k, verify_ms)` from section 6's formula.

# %%
from course_lib.exercises import lesson14 as ex

def speedup(tokens_per_verify, step_ms, draft_ms, k, verify_ms):
    ...  # your code here
    raise NotImplementedError

ex.check_speedup(speedup)

# %% [markdown]
# **2.** Write `lookup(context, k, n=2)`: find the last n tokens earlier in the context and return the k
# tokens that followed their most recent earlier occurrence ([] if none).

# %%
def lookup(context, k, n=2):
    ...  # your code here
    raise NotImplementedError

ex.check_lookup(lookup)

# %% [markdown]
# **3.** Write `tokens_per_verify(a, k)`: the expected tokens a verify step yields if each drafted token is
# accepted with probability a, in order (the first rejection ends the run), plus the model's own token.

# %%
def tokens_per_verify(a, k):
    ...  # your code here
    raise NotImplementedError

ex.check_tokens_per_verify(tokens_per_verify)

# %% [markdown]
# **Next:** 15 · structured output: masking the logits so the answer is valid JSON.
