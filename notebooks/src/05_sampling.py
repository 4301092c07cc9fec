# %% [markdown]
# # 05 · Sampling: choosing the next token on purpose
#
# **Goal.** The model gives a probability to every token in its vocabulary; a sampler picks one.
# Here you reshape the real model's distribution with temperature, top-k, top-p and min-p, and watch
# what each knob does.
#
# **You will**
# - see each setting as a small function of the logits, and check it against the real distribution;
# - move sliders over the model's actual next-token probabilities (the model runs once; the sliders are instant);
# - draw thousands of samples and see them land on the theory, then generate text with a seed you can repeat.

# %% [markdown]
# ## Set-up
#
# We run the model **once** on the capital-of-France prompt and keep the logits of the last position.
# Everything until section 6 reuses them.

# %%
import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots
from course_lib.runner.forward import forward_logits
from course_lib.text.context import context_ids
from course_lib.engine.generation import generate
from course_lib.engine.sampling import (logits_to_probs, make_sampler, repetition_penalty, reshape, sample,
                                        SamplingConfig, top_k_filter)

model, tokenizer = course_lib.load_model()
messages = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]
prompt_ids = context_ids(tokenizer, messages)
logits = forward_logits(model, prompt_ids)[0, -1]  # (V,) the next-token logits, computed once
label = lambda i: tokenizer.decode([i])

# %% [markdown]
# ## 1. The distribution we start from
#
# Softmax turns logits into probabilities. This is the model's own uncertainty about how to begin
# its answer, at temperature 1 with no filter.

# %%
base = reshape(logits, SamplingConfig(), show=12)
ax = plots.plot_reshaped([label(i) for i in base.ids], base.before, base.after, title="Temperature 1, no filter")
plt.show()
print(f"effective number of choices (2^entropy): {base.choices_before:.1f}")

# %% [markdown]
# The **effective number of choices** is 2 to the power of the entropy in bits: a distribution over
# that many equally likely tokens would be as uncertain as this one. 1 means the model is sure.

# %% [markdown]
# ## 2. Temperature
#
# Temperature divides the logits before the softmax: below 1 the gaps between logits grow (sharper),
# above 1 they shrink (flatter). At the limit of 0, all the probability goes to the top token:
# temperature 0 is **greedy** decoding.

# %%
fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), layout="constrained", sharey=True)
for ax, t in zip(axes, [0.0, 0.5, 1.0, 1.5]):
    r = reshape(logits, SamplingConfig(temperature=t), show=8)
    plots.plot_reshaped([label(i) for i in r.ids], r.before, r.after, ax=ax,
                        title=f"T = {t}: {r.choices_after:.1f} choices")
plots.one_legend(fig, axes)
plt.show()

# %% [markdown]
# **"Temperature 0 always picks the top token."** True by construction in `course_lib` (it switches to
# argmax), so sampling at T = 0 could not show anything else. The claim people actually rely on is "a low
# temperature picks it directly". A low temperature is not zero: draw 1,000 tokens at a few of them and count
# how often the top token was *not* drawn:

# %%
top = int(logits.argmax())
for t in (0.0, 0.1, 0.3, 0.7):
    probs_t = logits_to_probs(logits, SamplingConfig(temperature=t))
    draws_t = sample(probs_t, torch.Generator(device=probs_t.device).manual_seed(0), 1000)
    print(f"T={t}: {int((draws_t != top).sum()):>4} of 1000 draws are not the top token {label(top)!r} "
          f"(its probability at this T: {float(probs_t[top]):.3f})")

# %% [markdown]
# ## 3. Cutting the tail: top-k, top-p, min-p
#
# Temperature keeps every token possible. The filters remove unlikely ones entirely:
#
# - **top-k** keeps the k most probable tokens;
# - **top-p** (nucleus) keeps the smallest set of top tokens whose probabilities add up to at least p;
# - **min-p** keeps tokens at least min_p times as probable as the top token (it adapts to how sure the model is).

# %%
settings = {"top-k = 5": SamplingConfig(top_k=5), "top-p = 0.6": SamplingConfig(top_p=0.6),
            "min-p = 0.3": SamplingConfig(min_p=0.3)}
fig, axes = plt.subplots(1, 3, figsize=(14, 3.2), layout="constrained", sharey=True)
for ax, (name, cfg) in zip(axes, settings.items()):
    r = reshape(logits, cfg, show=10)
    plots.plot_reshaped([label(i) for i in r.ids], r.before, r.after, ax=ax, title=f"{name}: keeps {r.kept}")
plots.one_legend(fig, axes)
plt.show()

# %% [markdown]
# Each filter is a few lines in `course_lib/engine/sampling.py`, and the tests check that each gives exactly
# the same result as the matching `transformers` logits processor on the model's logits. Here is
# top-k written out, next to the library version:

# %%
def toy_top_k(v, k):
    kth_largest = torch.topk(v, k).values[-1]
    return v.masked_fill(v < kth_largest, float("-inf"))

print("same as course_lib:", torch.equal(toy_top_k(logits, 5), top_k_filter(logits, 5)))

# %% [markdown]
# ### The repetition penalty
#
# One more knob works on the tokens already written rather than on the tail: the **repetition penalty**
# divides the logit of every token seen so far by a factor if it is positive, and multiplies it if negative
# (1 = off; transformers does the same), so repeating becomes less likely either way. A small model left to
# itself repeats: here is the start of a 100-token greedy poem, then the next-token distribution 40 tokens in,
# before and after a penalty of 1.5:

# %%
poem = context_ids(tokenizer, [{"role": "user", "content": "Write a poem about the sea."}])
plain = generate(model, tokenizer, poem, max_new_tokens=100, stop_ids=())  # greedy, no early stop
print(repr(plain.text[:200]), "...")
history = poem + plain.token_ids[:40]
at = forward_logits(model, history)[0, -1]
penalized = repetition_penalty(at, history, 1.5)
for i in torch.topk(at, 6).indices.tolist():
    print(f"{label(i)!r:>12}: p {float(at.softmax(-1)[i]):.3f} -> {float(penalized.softmax(-1)[i]):.3f}"
          f"{'   already written' if i in history else ''}")

# %% [markdown]
# Over the whole answer: how many 3-token sequences occur more than once, without and with a penalty of 1.3?

# %%
def repeated_trigrams(ids):
    grams = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
    return sum(grams.count(g) > 1 for g in set(grams))
pick = make_sampler(SamplingConfig(temperature=0, repetition_penalty=1.3), history=poem)
less = generate(model, tokenizer, poem, max_new_tokens=100, pick=pick, stop_ids=())
for name, out in [("penalty 1.0", plain), ("penalty 1.3", less)]:
    print(f"{name}: {repeated_trigrams(out.token_ids):>2} repeated 3-grams | {out.text[:100]!r}")

# %% [markdown]
# The explorer below has a `repetition` slider too (it penalizes the prompt's tokens).
#
# ## 4. Try it: the sampling explorer
#
# Move the sliders. The grey bar is the original probability, the blue bar the probability after
# your setting; struck-out tokens are filtered away. The model does not run when you move a slider:
# only the stored logits are re-filtered. "draw samples" draws with the current setting and marks the
# share of each token in orange; "generate" runs the model with your setting and seed.

# %%
from course_lib.views.widgets import SamplingExplorer

def continue_with(config, seed):
    pick = make_sampler(config, seed=seed, history=prompt_ids)
    return generate(model, tokenizer, prompt_ids, max_new_tokens=20, pick=pick).text

top_ids = torch.topk(logits, 60).indices.tolist()
explorer = SamplingExplorer(logits, {i: label(i) for i in top_ids}, generate_fn=continue_with, history=prompt_ids)
explorer.widget()

# %% [markdown]
# How fast does a slider respond? The explorer records the time of its last redraw (filtering all
# vocabulary logits and rebuilding the bars), measured here for a few settings:

# %%
times = []
for t in [0.3, 0.7, 1.2, 1.9]:
    explorer.temperature.value = t
    times.append(explorer.last_update_ms)
explorer.temperature.value = 1.0
print("redraw times (ms):", [round(x, 1) for x in times], "| target: well under 100 ms")

# %% [markdown]
# ## 5. Do the draws match the theory?
#
# If the sampler is right, the share of each token among many draws approaches its probability.
# We draw 5,000 tokens at temperature 0.8 with top-p 0.9 and compare (a chi-square test in the test
# suite checks this formally, so a bug in a filter cannot hide).

# %%
cfg = SamplingConfig(temperature=0.8, top_p=0.9)
probs = logits_to_probs(logits, cfg)
tokens = sample(probs, torch.Generator(device=probs.device).manual_seed(42), 5000)  # a generator lives on one device
share = torch.bincount(tokens, minlength=probs.numel()).float() / 5000
r = reshape(logits, cfg, show=10)
ax = plots.plot_reshaped([label(i) for i in r.ids], r.before, r.after, drawn=share[r.ids].tolist(),
                         title="5,000 draws (orange) against the computed distribution (blue)")
plt.show()
print("largest gap between share drawn and probability:", f"{float((share - probs).abs().max()):.4f}")

# %% [markdown]
# ## 6. Generating with a setting, repeatably
#
# Now the model runs: each new token is sampled with the setting. A **seed** fixes the random draws,
# so the same seed gives the same text, and another seed gives another text.

# %%
cfg = SamplingConfig(temperature=0.9, top_p=0.95)
for seed in [1, 1, 2, 3]:
    print(f"seed {seed}: {continue_with(cfg, seed)!r}")

# %% [markdown]
# ## 7. The classic pitfall: temperature without sampling
#
# In `transformers`, `model.generate(do_sample=False)` is greedy, whatever temperature you pass.
# Many people raise the temperature, see no change, and conclude it does nothing. Measured:

# %%
ids = torch.tensor([prompt_ids])
with torch.inference_mode():
    cold = model.generate(ids, max_new_tokens=15, do_sample=False)
    hot = model.generate(ids, max_new_tokens=15, do_sample=False, temperature=1.8)
print("do_sample=False, T ignored -> identical:", torch.equal(cold, hot))
print(repr(tokenizer.decode(hot[0, len(prompt_ids):])))

# %% [markdown]
# This version of `transformers` does print a one-line warning that the flag may be ignored (see the
# output above, if your run shows it); it is easy to miss in a long log. To sample, pass
# `do_sample=True`, or use a sampler like `make_sampler` above.

# %% [markdown]
# ## 8. Bad settings get clear errors
#
# Temperature 0 is allowed (greedy); the others below are mistakes, each caught with a message:

# %%
for bad in [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-3), dict(min_p=2.0)]:
    try:
        SamplingConfig(**bad)
    except ValueError as err:
        print(f"{str(bad):<22} -> {err}")
try:
    logits_to_probs(torch.tensor([1.0, float("nan")]))
except ValueError as err:
    print("NaN logits           ->", err)

# %% [markdown]
# ---
# ## Summary
#
# - Sampling turns the model's logits into one token; every knob is a small function of the logits.
# - Temperature rescales (sharper below 1, flatter above); temperature 0 is greedy.
# - top-k, top-p and min-p remove the unlikely tail; min-p adapts to how confident the model is.
# - The repetition penalty works on what was already written: it pushes seen tokens down.
# - The model runs once per token; changing a sampling setting needs no new forward pass.
# - With `do_sample=False`, `transformers` ignores temperature entirely.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `temperature_probs(logits, T)`: the probabilities after temperature T (T > 0).

# %%
from course_lib.exercises import lesson05 as ex

def temperature_probs(logits, T):
    ...  # your code here
    raise NotImplementedError

ex.check_temperature_probs(temperature_probs, logits)

# %% [markdown]
# **2.** Write `my_top_k(logits, k)`: keep the k largest logits, set the others to `-inf`.

# %%
def my_top_k(logits, k):
    ...  # your code here
    raise NotImplementedError

ex.check_top_k(my_top_k, logits)

# %% [markdown]
# **3.** Estimate by simulation the probability that the answer starts with `"The"`: draw 5,000
# tokens at temperature 1 with a seeded `torch.Generator` and `sample(...)`, and put the draws
# themselves in `draws` (the share equal to `the_id` is your estimate; print it). The check computes
# that share and the shares of the five likeliest tokens, and accepts them within four standard errors.

# %%
the_id = tokenizer.encode("The", add_special_tokens=False)[0]
draws = None  # your 5,000 sampled token IDs here
ex.check_estimate(draws, the_id, logits)

# %% [markdown]
# **4. Predict, then measure.** The next cell prints how many tokens top-p 0.9 keeps at temperature 1 on
# these logits. Predict how many it keeps at temperature **1.5**, write the number in `prediction`, then run
# the check: it counts them.

# %%
print("top-p 0.9 at temperature 1 keeps", reshape(logits, SamplingConfig(top_p=0.9)).kept, "tokens")

# %%
prediction = None  # your prediction: tokens kept at temperature 1.5
ex.check_nucleus_prediction(prediction, logits, temperature=1.5, top_p=0.9)

# %% [markdown]
# **Next:** 06 · generation and streaming, where the chosen tokens are appended, looped and streamed.
