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
from course_lib.runner import formats
from course_lib.views import html_views
from course_lib.text.context import chat_ids, edit_ids, story_ids
from course_lib.measure.race import generate_exact
from course_lib.engine.generation import generate
from course_lib.engine.stages import prefill, verify
from course_lib.runner.model import Model
from course_lib.runtime import cpu_lesson, progress, time_it
from course_lib.engine.speculative import (acceptance, early_exit, expected_tokens_per_verify, ModelDrafter,
                                           PromptLookup)
from course_lib.engine.sampling import accept_or_resample, logits_to_probs, make_sampler, SamplingConfig
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
# `generate` with `draft=`: streaming and stop conditions work as everywhere else. "Same tokens" is exact in
# exact arithmetic; in float32 the verify pass (k + 1 rows, another matrix kernel) and a decode step (one row)
# add in different orders, so a near-tie could flip. The check below is what was measured, on these prompts.

# %%
drafters = {"prompt lookup": lambda: PromptLookup(3), "int4 model": lambda: ModelDrafter(int4),
            "first 8 layers": lambda: early_exit(ours, 8)}
N = 40
plain = {task: generate_exact(ours, tokenizer, p, N) for task, p in [("edit", edit), ("story", story)]}
for name, make in progress(drafters.items(), "drafters", total=len(drafters)):
    same = [generate(ours, tokenizer, p, N, stop_ids=(), draft=make(), k=4).token_ids == plain[t]
            for t, p in [("edit", edit), ("story", story)]]
    print(f"{name:<15} same tokens as plain greedy: edit {same[0]}, story {same[1]}")

# %% [markdown]
# ## 4. Acceptance and speed-up against k
#
# For each drafter and task: the share of drafted tokens the model accepted, tokens per verify step, what
# that acceptance would give if each drafted token were accepted independently with the same probability
# (1 + a + a^2 + ... + a^k, exercise 3), and the time against plain greedy decoding: one warm-up, then the
# median of three runs of each.

# %%

def median_run(fn):
    """One warm-up, then the median of three runs: (seconds, the last run's result)."""
    out = []
    t = time_it(lambda: out.append(fn()), repeats=3, warmup=1)
    return t.median, out[-1]

tasks = [("edit", edit), ("story", story)]
base = {t: median_run(lambda p=p: generate_exact(ours, tokenizer, p, N))[0] for t, p in tasks}
rows = []
runs = [(name, make, k, t, p) for name, make in drafters.items() for k in ([2, 6] if name == "prompt lookup" else [4])
        for t, p in tasks]
for name, make, k, t, p in progress(runs, "drafter, k and task (4 runs each)"):
    secs, r = median_run(lambda: generate(ours, tokenizer, p, N, stop_ids=(), draft=make(), k=k))
    s = r.speculative
    rows.append((name, t, k, s.acceptance_rate, s.tokens_per_verify, base[t] / secs, r))
print(f"{'drafter':<15}{'task':<7}{'k':>2}{'accepted':>10}{'tokens/verify':>15}{'if independent':>16}{'speed-up':>10}")
for name, t, k, acc, tpv, speed, _ in rows:
    print(f"{name:<15}{t:<7}{k:>2}{acc:>10.2f}{tpv:>15.2f}{expected_tokens_per_verify(acc, k):>16.2f}{speed:>9.2f}x")
paid = [f"{name} on the {t} (k={k}, {speed:.2f}x)" for name, t, k, _, _, speed, _ in rows if speed > 1.0]
print("faster than plain decoding in this run (median of 3 after a warm-up):", "; ".join(paid) if paid else
      "none (see section 6 for why)")

# %% [markdown]
# Compare the two middle columns: acceptance is not independent from token to token. A drafter that copies
# a passage is right for a whole run of tokens and then wrong for a while, so the measured tokens per verify
# can differ from the formula in either direction. Each speed-up is a median of three runs; a busy machine can
# still move it by tens of percent. What to expect: prompt
# lookup copies the paragraph on the grounded edit, so it is accepted often and costs almost nothing to
# draft; on the course's machine it was the clear winner there (the committed bench,
# `data/benchmarks/bench-cpu-2026-12-01-engine-speculative-threads1.json`: 1.6x at k = 4, one thread). If no
# line paid here, the verify pass cost more than the accepted tokens saved: section 6 computes that
# break-even from section 1's costs.
#
# Read the first-8-layers lines against lesson 03's logit lens: there the answer only appeared in the last
# layers, so the first eight with the model's head rarely guess the final token, and every guess costs.
#
# **A minimum match for prompt lookup.** The drafter above falls back to a one-token match: on free text, where
# little of the prompt is copied, a single matching token is mostly chance, and each wrong guess is a row of
# the verify pass paid for nothing. Engines can require a longer match and draft nothing otherwise (vLLM's
# `prompt_lookup_min`; here `PromptLookup(3, min_ngram=2)`). Counted, not timed, at k = 4:

# %%
print(f"{'task':<7}{'min match':>10}{'drafted':>9}{'accepted':>10}{'rejected rows':>15}{'tokens/verify':>15}")
for t, p in tasks:
    for least in (1, 2):
        s = generate(ours, tokenizer, p, N, stop_ids=(), draft=PromptLookup(3, min_ngram=least), k=4).speculative
        print(f"{t:<7}{least:>10}{s.drafted:>9}{s.accepted:>10}{s.drafted - s.accepted:>15}{s.tokens_per_verify:>15.2f}")

# %% [markdown]
# Compare the rejected rows of each task at the two settings: on the story most one-token matches were wrong,
# and requiring two removes them; on the edit, which copies its paragraph, the longer matches keep most of what
# was accepted. The setting trades the drafter's reach against its waste, and the right value depends on how
# much of the output copies the prompt.
#
# **The model drafter's first step.** A model drafter keeps its own cache, empty at the start, so its first
# proposal prefills the whole prompt through the drafter: that lands between the answer's first token and its
# second. From the int4 drafter's run on the edit above (tokens accepted in one verify step arrive together):

# %%
r = next(row[6] for row in rows if row[0] == "int4 model" and row[1] == "edit")
arrivals = [st.at for i, st in enumerate(r.steps) if i == 0 or st.at - r.steps[i - 1].at > 0.005]  # one per step
gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
print(f"first token after {arrivals[0] * 1000:.0f} ms | the next step (the drafter's prefill included) "
      f"{gaps[0] * 1000:.0f} ms | the median later step {sorted(gaps[1:])[len(gaps[1:]) // 2] * 1000:.0f} ms")
print("the longest wait in this run was for the", "second token" if gaps[0] > arrivals[0] else "first token")

# %% [markdown]
# Where the last line says the second token, the time to first token hid the longest wait of the answer. A
# server can hide
# the spike by prefilling the drafter beside the model, or by drafting with the model's own first layers on
# the model's cache (self-speculation, as LayerSkip does; this course's `early_exit` keeps a cache of its own).
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
# And the plain alternative: run the int4 model alone. It reads a sixth of float32's bytes per token, but its
# answer is its own (bfloat16 activations, rounded weights for the head), not float32's. Speculation with the
# int4 drafter keeps float32's exact tokens and pays for every rejected guess. Both on the grounded edit,
# timed the same way:

# %%
alone_s, alone = median_run(lambda: generate_exact(int4, tokenizer, edit, N))
spec_s = next(base["edit"] / speed for name, t, k, _, _, speed, _ in rows if name == "int4 model" and t == "edit")
print(f"float32 alone {N / base['edit']:.1f} tok/s | float32 checking int4 drafts (k=4) {N / spec_s:.1f} tok/s | "
      f"int4 alone {N / alone_s:.1f} tok/s")
same = sum(a == b for a, b in zip(alone, plain["edit"]))
print(f"int4 alone gives the same tokens as float32 for {same} of {N} positions "
      f"({'all' if alone == plain['edit'] else 'the answers differ'}); speculation gives float32's {N} by construction")
print("fastest in this run:", max([("float32 alone", base["edit"]), ("float32 + int4 drafts", spec_s),
                                   ("int4 alone", alone_s)], key=lambda x: -x[1])[0])

# %% [markdown]
# What speculation buys here is float32's exact answer at a cost between float32's and int4's, when the
# drafts are accepted often enough. If the quality of the int4 answer is enough (lesson 12 measured its
# perplexity within a percent of float32's on text), running int4 alone is simpler and, on this machine, usually
# faster (the line above says which was fastest in this run): the drafter reads the int4 weights for every
# guess, accepted or not, and the verify pass reads float32's on top. Speculation pays more where the drafter is far cheaper than the model, as a 1B drafter for
# a 70B model is.

# %% [markdown]
# ## 7. Sampling, and why the answer's distribution does not change
#
# With sampling, speculative sampling (Leviathan, Kalman and Matias, *Fast Inference from Transformers via
# Speculative Decoding*, ICML 2023; Chen et al., *Accelerating Large Language Model Decoding with Speculative
# Sampling*, 2023) accepts a drafted token x with probability min(1, p(x) / q(x)), p the model's distribution
# and q the one the drafter drew x from; if rejected, the token is drawn from what is left of p after q,
# max(0, p - q) renormalized. Then every token comes out distributed exactly as p. We check it on real
# probabilities: 4,000 draws of the rule against p itself, for a drafter that always proposes token 2.

# %%
from course_lib.runner.forward import forward_logits
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
# **How often is a draft accepted?** Averaged over the drafter's draws, the chance of acceptance is the sum
# over tokens of q(x) min(1, p(x)/q(x)) = the sum of min(p, q): one minus the total variation distance between
# the two distributions. A drafter that samples from its own q (the int4 model, when the model samples) is
# accepted that often. A drafter that proposes its most likely token instead (q one-hot) is accepted with p of
# that token. Both keep p exactly; they differ in how much they keep. Measured on the real distributions of
# both models at every position of the story's answer, at two temperatures:

# %%
from course_lib.measure.quality import log_probs

sequence = story + plain["story"]
p_logits, q_logits = log_probs(ours, sequence)[len(story) - 1:-1], log_probs(int4, sequence)[len(story) - 1:-1]
expected = {}
for t in (0.7, 1.0):
    config = SamplingConfig(temperature=t)
    pairs = [(logits_to_probs(pl, config), logits_to_probs(ql.float(), config)) for pl, ql in zip(p_logits, q_logits)]
    sampled = sum(acceptance(p, q) for p, q in pairs) / len(pairs)
    one_hot = sum(float(p[q.argmax()]) for p, q in pairs) / len(pairs)
    expected[t] = (sampled, one_hot)
    print(f"temperature {t}: over {len(pairs)} positions, mean 1 - TV(p, q) = {sampled:.3f} (drafts sampled from q); "
          f"mean p(argmax q) = {one_hot:.3f} (greedy drafts)")

# %% [markdown]
# Now the loop itself: the float32 model sampling, the int4 model drafting both ways, same seed. The
# measured acceptance is over the positions that run visits: its own sampled answer, not the story's greedy
# one, and a hot sampler wanders into text where both models are less sure, where greedy drafts fare worst.
# So the measured and predicted figures can differ, the more so at temperature 1 and over only 40 tokens;
# compare the two ways of drafting at each temperature:

# %%
for t in (0.7, 1.0):
    for how, drafter in [("sampled from q", ModelDrafter(int4)), ("greedy, q one-hot", ModelDrafter(int4, sample=False))]:
        r = generate(ours, tokenizer, story, N, stop_ids=(), pick=make_sampler(SamplingConfig(temperature=t), seed=0),
                     draft=drafter, k=4)
        predicted = expected[t][0 if drafter.sample else 1]
        print(f"temperature {t}, drafts {how:<18} accepted {r.speculative.acceptance_rate:.2f} "
              f"(predicted {predicted:.2f}), {r.speculative.tokens_per_verify:.2f} tokens per verify")

# %% [markdown]
# Prompt lookup has no distribution: it proposes one token for sure, so q is one-hot and a drafted token is
# kept with probability p(x), the model's own chance of drawing it. The hotter the sampling, the less the
# answer copies the paragraph and the fewer drafts survive (one seed, so the run repeats):

# %%
for t in (0.0, 0.7, 1.0):
    r = generate(ours, tokenizer, edit, N, pick=make_sampler(SamplingConfig(temperature=t), seed=0),
                 draft=PromptLookup(3))
    print(f"temperature {t}: acceptance {r.speculative.acceptance_rate:.2f}, "
          f"{r.speculative.tokens_per_verify:.2f} tokens per verify step | {r.text[:70]!r}")

# %% [markdown]
# **What this lesson does not build.** Production engines go further, and each step trades something. *Trees*
# of drafts (SpecInfer, Medusa, EAGLE): several candidate continuations checked in one pass with an attention
# mask shaped like the tree, so one rejected guess does not end the step; more rows per pass. *Batches*: here
# one request drafts alone; in a server every row of a batch drafts and verifies, the verify pass grows by k
# rows per request, and once the batch makes the step arithmetic-bound (lesson 09) the spare bandwidth that
# speculation spends is gone: engines lower k or turn it off as the batch grows. *Composition*: drafts must be
# checked against the grammar mask of lesson 15 (a drafted token the mask forbids can be rejected before
# the verify pass) and written into the paged cache of lesson 13 (rolled back block by block). *Choosing k*:
# the best k depends on the acceptance rate and on the costs of section 1; exercise 1's formula, evaluated
# over k with this run's costs, finds it for one drafter and one task, and engines adapt it as they go.
#
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
# - A draft sampled from the drafter's own q is accepted with probability 1 - TV(p, q); a greedy draft with p
#   of the drafted token. Section 7 printed both for the int4 drafter, predicted and measured in the loop.
# - Running the int4 model alone is the plain alternative to speculation with an int4 drafter: faster or not
#   (section 6 printed it), its answer is its own, while speculation keeps float32's tokens exactly.
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
# **4. Predict, then measure.** Section 4 printed prompt lookup's tokens per verify step on the edit at k = 2
# and k = 6. Predict it at **k = 4** and write it in `prediction`; the check runs the same 40 greedy tokens.

# %%
prediction = None  # your prediction: tokens per verify step at k = 4
ex.check_verify_prediction(prediction, ours, tokenizer, edit, k=4)

# %% [markdown]
# **Next:** 15 · structured output: masking the logits so the answer is valid JSON.
