# %% [markdown]
# # 04 · Attention: what each token looks at, and what that does and does not tell us
#
# **Goal.** Read the real model's attention weights for any layer and head, rebuild one head from
# scratch, and test two famous claims about attention on a real 135M model.
#
# **You will**
# - explore heatmaps of every layer and head, with the causal mask in plain sight;
# - compute one head by hand and match the model's own weights;
# - see why grouped-query attention shrinks the KV cache, and how attention's cost grows with length.

# %% [markdown]
# ## Set-up
#
# Attention weights come back only with the "eager" attention implementation (the faster SDPA kernel
# never materialises them), so we ask `load_model` for it. Weights are computed **once** per sentence;
# every picture and slider below reuses them.

# %%
import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots
from course_lib.runner.attention import attention_weights, attention_by_hand, kv_groups, top_attended, score_times
from course_lib.runner.forward import forward_logits, probabilities, top_candidates
from course_lib.inside.anatomy import layer_outputs

model, tokenizer = course_lib.load_model(attn_implementation="eager", dtype="float32")  # float32: exact comparisons
cfg = model.config
def pieces(text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids, [tokenizer.decode([i]) for i in ids]

# %%
question = "What is the capital of France?"
q_ids, q_tokens = pieces(question)
weights = attention_weights(model, q_ids)  # (L, H, T, T), computed once
print("attention weights (L, H, T, T):", tuple(weights.shape), "| every row sums to 1:",
      bool(torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-4)))

# %% [markdown]
# ## 1. Reading one heatmap
#
# Row = the token that is looking (the query); column = the token it looks at (the key); the colour is
# the share of that row's attention. The grey upper triangle is the **causal mask**: a token may only
# look at itself and earlier tokens, never ahead.

# %%
ax = plots.plot_attention(weights[13, 8], q_tokens, title="layer 13, head 8")
plt.show()

# %% [markdown]
# ## 2. Try it: every layer and head
#
# Slide through the layers and heads. The numbers are percentages of attention (shown from 10%).

# %%
from course_lib.views.widgets import AttentionExplorer
explorer = AttentionExplorer(weights, q_tokens, kv_groups(cfg))
explorer.widget()

# %%
times = []
for layer, head in [(0, 0), (7, 3), (15, 8), (29, 4)]:
    explorer.layer.value, explorer.head.value = layer, head
    times.append(explorer.last_update_ms)
print("redraw times (ms):", [round(t, 1) for t in times], "| no model call: the weights were computed once")

# %% [markdown]
# The static view of a whole layer (the rendered edition shows this instead of the sliders). Heads
# whose titles share a colour share one key/value head (section 5):

# %%
axes = plots.plot_head_grid(weights[13], q_tokens, layer=13, groups=kv_groups(cfg))
plt.show()

# %% [markdown]
# ## 3. Where does attention go, on average?
#
# Averaged over all layers and heads, how much attention does each position receive from the last token?

# %%
avg = weights[:, :, -1, :].mean(dim=(0, 1))  # (T,)
for token, share in zip(q_tokens, avg.tolist()):
    print(f"{token!r:>12} {share:6.1%} {'#' * int(share * 60)}")

# %% [markdown]
# A large share lands on the **first token**, whatever it is. This "attention sink" is well documented:
# softmax must put its weight somewhere, and many heads park it on the first position when they have
# nothing useful to do. It is one reason a single heatmap is weak evidence of "meaning".
#
# ## 4. The two examples people quote
#
# **"capital" attends strongly to "France".** Look at the mask: in "What is the capital of France?",
# *capital* comes **before** *France*, so in a decoder like this one it cannot attend to it at all. The
# information flows the other way: *France* (and every later token) can look back at *capital*.

# %%
cap, fr = q_tokens.index(" capital"), q_tokens.index(" France")
print(f"attention from ' capital' to ' France', all layers and heads: max {float(weights[:, :, cap, fr].max()):.3f}")
for layer, head, w in top_attended(weights, fr, cap, k=5):
    print(f"' France' -> ' capital': layer {layer:>2}, head {head}: {w:.2f}")

# %% [markdown]
# **City or money?** Compare the twin question. Where does *France* look now, and what does the model
# predict after each phrasing? The distributions are where the difference really shows:

# %%
twin = "What is the capital gains tax in France?"
t_ids, t_tokens = pieces(twin)
t_weights = attention_weights(model, t_ids)
for layer, head, w in top_attended(t_weights, t_tokens.index(" France"), t_tokens.index(" capital"), k=3):
    print(f"twin: ' France' -> ' capital': layer {layer:>2}, head {head}: {w:.2f}")
numeric = lambda t: t.strip()[:1].isdigit() or t.strip()[:1] in "€$£%"  # noqa: E731 - a number or an amount
for text in ["The capital of France is", "The capital gains tax in France is"]:
    probs = probabilities(forward_logits(model, pieces(text)[0])[0, -1])
    top = top_candidates(tokenizer, probs, 50)
    print(f"{text!r:<38} ->", [(c.text, round(c.prob, 3)) for c in top[:6]],
          f"| mass on numbers/amounts in the top 50: {sum(c.prob for c in top if numeric(c.text)):.2f}")

# %% [markdown]
# Compare the two lines: the candidates and the probability mass on numbers and amounts differ between
# the city sense and the tax sense. Where the meaning of *capital* is resolved, the evidence is in the
# output distribution and in many heads at once, not in one arrow from *capital* to *France*.
#
# **"They" refers to the bank.** In "The bank is closed because they had no money left", where does
# *they* look?

# %%
b_ids, b_tokens = pieces("The bank is closed because they had no money left.")
b_weights = attention_weights(model, b_ids)
they, bank = b_tokens.index(" they"), b_tokens.index(" bank")
for layer, head, w in top_attended(b_weights, they, bank, k=5):
    print(f"' they' -> ' bank': layer {layer:>2}, head {head}: {w:.2f}")
row = b_weights[:, :, they, 1: they + 1]  # ignore the first token (the sink)
favourite = row.argmax(-1) + 1  # (L, H): the position each head attends most, after the first token
print(f"heads whose favourite earlier word (after the first token) is ' bank': "
      f"{int((favourite == bank).sum())} of {cfg.num_hidden_layers * cfg.num_attention_heads}")

# %%
layer, head, _ = top_attended(b_weights, they, bank, k=1)[0]
ax = plots.plot_attention(b_weights[layer, head], b_tokens, title=f"layer {layer}, head {head}: the strongest ' they' -> ' bank'")
plt.show()

# %% [markdown]
# Some heads do link *they* to *bank*, and strongly. Honest limits: *money* comes after *they*, so no
# head can use it at that position; most heads do something else; and a weight shows where information
# is *read from*, not what the model concludes. Attention maps are a clue, not an explanation.
#
# ## 5. One head from scratch
#
# Queries times keys, divided by the square root of the head dimension, the future masked, a softmax
# per row. Here it is for one head, from the model's own weights, in a toy cell:

# %%
hidden = layer_outputs(model, q_ids)  # (L+1, T, hidden): what enters each layer
layer, head, D = 13, 8, cfg.head_dim
_, by_hand = attention_by_hand(model.model.layers[layer], hidden[layer], cfg)  # (H, T, T)
print("matches the model's own weights:", torch.allclose(by_hand[head], weights[layer, head], atol=1e-5),
      f"(max difference {float((by_hand[head] - weights[layer, head]).abs().max()):.1e})")

# %% [markdown]
# `attention_by_hand` (in `course_lib/runner/attention.py`) does, for all heads at once: RMSNorm, the query, key
# and value projections, rotary positions on queries and keys, sharing each key/value head among three
# query heads, the scaled scores, the causal mask, the softmax. The toy version of the last steps, on
# random vectors, fits in three lines:

# %%
T = 5
q, k = torch.randn(T, D), torch.randn(T, D)
scores = (q @ k.T / D ** 0.5).masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
print(torch.softmax(scores, dim=-1).round(decimals=2))

# %% [markdown]
# ## 6. Grouped-query attention
#
# This model has 9 query heads but only 3 key/value heads: each key/value head is shared by three query
# heads. The groups:

# %%
groups = kv_groups(cfg)
print(groups)
bytes_per_token = lambda kv_heads: 2 * cfg.num_hidden_layers * kv_heads * D * 2  # keys+values, bfloat16
print(f"KV cache per token in bfloat16: {bytes_per_token(cfg.num_key_value_heads):,} bytes with 3 key/value heads, "
      f"{bytes_per_token(cfg.num_attention_heads):,} if every query head had its own")

# %% [markdown]
# Heads in one group read the same keys and values but ask different questions (their queries
# differ), so their heatmaps can still look different. The saving is in memory and in reading: the KV cache
# (lesson 07) stores keys and values per key/value head, so it is three times smaller here, and every decode
# step reads three times fewer cache bytes (lesson 08 counts those bytes per step).

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 4), layout="constrained")
for ax, h in zip(axes, groups[2]):
    plots.plot_attention(weights[13, h], q_tokens, ax=ax, title=f"layer 13, head {h} (key/value head 2)", colorbar=False)
plt.show()

# %% [markdown]
# ## 7. Attention gets more expensive with length
#
# The score matrix is T by T: double the tokens, four times the scores. We time the score computation
# (9 heads of dimension 64, causal softmax, times values) as T grows:

# %%
lengths = [128, 256, 512, 1024, 2048]
runs = score_times(lengths, cfg.num_attention_heads, D, repeats=5)
secs = [min(r) for r in runs]  # the best of five: what the computation costs when nothing else gets in the way
ax = plots.plot_xy(lengths, [s * 1000 for s in secs], "sequence length T", "ms for one layer's attention",
                   title="Attention score time against sequence length (best of 5; bars: fastest to slowest)",
                   spread=[(1000 * min(r), 1000 * max(r)) for r in runs])
plt.show()
print("time ratio per doubling of T:", [round(b / a, 1) for a, b in zip(secs, secs[1:])])

# %% [markdown]
# Read the ratios: a cost linear in T would give 2 per doubling; the T by T score matrix should give about
# 4. Measured ratios scatter around it (caches, a busy machine): read the trend over several doublings,
# not one ratio. This quadratic term is why very long contexts are expensive.
#
# Does the KV cache (lesson 07) remove it? No. The cache saves recomputing the past tokens' projections
# and feed-forward; but each new token still attends over every cached key and value, so one decode step's
# attention grows linearly with the context, and a whole answer's attention quadratically. Measured: one
# decode step with a short and a long cache.

# %%
from course_lib.measure.prefill_decode import decode_seconds
short, long = decode_seconds(model, tokenizer, [64, 1024], steps=4)
print(f"decode step: {short * 1000:.1f} ms with 64 cached tokens, {long * 1000:.1f} ms with 1,024; "
      f"the longer cache costs {(long - short) * 1000:+.1f} ms per step "
      f"({'more' if long > short else 'no more, within this run noise'})")

# %% [markdown]
# ## 8. Where it looks is not what it uses
#
# A weight says where a head reads from. Whether the answer **depends** on that head is another
# question, and it has an experimental answer: change the model's insides and watch the output. Two
# tools from interpretability research do it (TransformerLens and ARENA teach them): **ablation**
# (remove one head's output and measure what the answer loses) and **activation patching** (run a
# corrupted prompt, copy one piece of the clean run into it, and measure how much of the clean answer
# comes back). Both run here on the library's model through forward hooks (`course_lib/inside/probes.py`); the
# weights never change.
#
# The question needs a number. The prompt stops right before the answer word, and the metric is the logit
# of " Paris" minus the logit of " Berlin" at the last position: large and positive means Paris.

# %%
from course_lib.inside import probes

clean = probes.answer_ids(tokenizer, "What is the capital of France?", "The capital of France is")
corrupt = probes.answer_ids(tokenizer, "What is the capital of Germany?", "The capital of Germany is")
paris, berlin = probes.token_id(tokenizer, " Paris"), probes.token_id(tokenizer, " Berlin")
differ = [i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b]
print(len(clean), "tokens each; they differ only at positions", differ,
      [tokenizer.decode([clean[i]]) + "/" + tokenizer.decode([corrupt[i]]) for i in differ])

# %% [markdown]
# **Ablation.** Each head in turn is replaced by its **mean** output over the same prompt with other
# countries (Italy, Spain, Japan, Egypt, Canada, Brazil), at every position. Why the mean and not zeros: a
# zero output is something the model never saw, so zeroing measures the damage of a strange input as well
# as the loss of the head; the mean keeps the activations typical and removes only what depends on the
# country. Negative cells: the head helped " Paris" over " Berlin".

# %%
countries = ["Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil"]
reference = [probes.answer_ids(tokenizer, f"What is the capital of {c}?", f"The capital of {c} is") for c in countries]
means = probes.mean_head_outputs(model, reference)  # (L, H, D)
effects, base = probes.ablate_heads(model, clean, paris, berlin, means)  # (L, H)
print(f"clean metric {base:.2f}; the heads whose removal costs the most:")
for layer, head, e in probes.top_heads(effects, 5, largest=False):
    print(f"  layer {layer:>2}, head {head}: {e:+.2f}")

# %% [markdown]
# Beside it, the view of the earlier sections: how much attention each head pays, from the last position,
# to the two "France" tokens.

# %%
c_weights = attention_weights(model, clean)  # (L, H, T, T)
looks = probes.attention_to(c_weights, -1, differ)  # (L, H)
fig, axes = plt.subplots(1, 2, figsize=(9, 6), layout="constrained")
plots.plot_layer_head_map(effects, ax=axes[0], title="ablation: change in Paris - Berlin", label="logit difference")
plots.plot_layer_head_map(looks, ax=axes[1], title="attention from the last token to France", diverging=False,
                          label="attention weight")
plt.show()
top_look = probes.top_heads(looks, 5)
top_use = probes.top_heads(effects, 5, largest=False)
print("heads that look hardest at France:", [(l, h, round(w, 2)) for l, h, w in top_look])
print("   their ablation effects:       ", [round(float(effects[l, h]), 2) for l, h, _ in top_look])
print("heads whose removal costs most:  ", [(l, h, round(e, 2)) for l, h, e in top_use])
print("   their attention to France:    ", [round(float(looks[l, h]), 2) for l, h, _ in top_use])
shared = {(l, h) for l, h, _ in top_look} & {(l, h) for l, h, _ in top_use}
print(f"heads in both top fives: {sorted(shared)}")

# %% [markdown]
# Read the two maps, and the four printed lines, against each other. Where a head is in both top fives,
# looking and using agree for it; a head that looks hard at France with an effect near zero (or of the
# wrong sign) is read from and then not relied on for this answer; a head that matters while it barely
# looks at France gets the country some other way (from earlier layers' work at the last position). Only
# the left map is about what the answer depends on, and only for this metric.
#
# **And the feed-forward blocks?** A common explanation says attention moves information between
# positions while the feed-forward blocks "retrieve facts". Test it on this fact the same way: replace one
# layer's feed-forward output by its mean over the same reference prompts, layer by layer, and beside it a
# second fact (the capital of Japan, Tokyo against Berlin), so that a block every answer needs is not
# mistaken for one that holds this fact.

# %%
mlp_means = probes.mean_mlp_inputs(model, reference)  # (L, intermediate)
mlp_effects, _ = probes.ablate_mlps(model, clean, paris, berlin, mlp_means)  # (L,)
japan = probes.answer_ids(tokenizer, "What is the capital of Japan?", "The capital of Japan is")
tokyo = probes.token_id(tokenizer, " Tokyo")
japan_effects, japan_base = probes.ablate_mlps(model, japan, tokyo, berlin, mlp_means)
print(f"Paris - Berlin, clean: {base:.2f} | Tokyo - Berlin on the Japan prompt, clean: {japan_base:.2f}")
for layer in sorted(range(len(mlp_effects)), key=lambda i: float(mlp_effects[i]))[:5]:
    fr, jp = float(mlp_effects[layer]), float(japan_effects[layer])
    kind = "needed by both facts" if jp < 0 and min(fr, jp) / max(fr, jp) < 2 else "mostly this fact's"
    print(f"feed-forward of layer {layer:>2}: France fact {fr:+6.2f}, Japan fact {jp:+6.2f} -> {kind}")
print(f"largest single-head effect on the France fact: {float(effects.min()):+.2f}")

# %% [markdown]
# Read the lines: a block whose removal costs both facts about as much (within a factor of two) is needed
# by both, and may hold nothing about France in particular: the first layer's feed-forward block, for one,
# is known to act as part of the embedding. A block whose removal costs one fact far more than the other is
# a better candidate for where that fact is stored. Compare the sizes too: a feed-forward block can weigh
# far more than any single head (last line). So this test does not settle "the feed-forward blocks retrieve
# facts": it says which blocks this answer needs and which of them are shared with another answer, for one
# metric and one kind of ablation. (Lesson 12 finds one layer far more sensitive to rounding than the
# others; compare its number with these.)
#
# **Patching.** Now run the Germany prompt, and at one layer and one position replace the residual stream
# (the vector the blocks add to) with the France run's. 0 means nothing came back, 1 means the whole clean
# answer did. Positions before the first "Germany" are the same in both runs, so a patch there cannot
# change anything (tests/test_probes.py checks it); the map starts at the first difference.

# %%
patched = probes.patch_residual(model, clean, corrupt, paris, berlin)
print(f"metric: clean {patched['clean']:.2f}, corrupted {patched['corrupt']:.2f}")
labels = [tokenizer.decode([clean[i]]) for i in patched["positions"]]
plots.plot_patching(patched["recovered"], labels)
plt.show()
r = patched["recovered"]
for name, col in (("question's France", 0), ("answer's France", len(labels) - 2), ("last token", len(labels) - 1)):
    best = int(r[:, col].argmax())
    print(f"{name:<18}: most recovered {float(r[best, col]):.2f} at row {best}; at the last row {float(r[-1, col]):.2f}")
half = int((r[:, -1] > 0.5).nonzero()[0]) if (r[:, -1] > 0.5).any() else None
print("the last position carries more than half of the answer from row", half, "on")

# %% [markdown]
# Read the map from the top: rows are layers, columns positions. Where a cell is near 1, the France run's
# vector at that place carries (almost) everything the answer needs; the printed lines say where that
# happens for the two country tokens and the last position, and the row at which the last position takes
# over tells in which layers the country has travelled to where the answer is read. Then single heads:
# copy one head's output (at every position) from the France run into the Germany run.

# %%
head_patch = probes.patch_heads(model, clean, corrupt, paris, berlin)  # (L, H)
for layer, head, f in probes.top_heads(head_patch, 5):
    print(f"layer {layer:>2}, head {head}: recovers {f:.2f} of the answer alone "
          f"(ablation effect {float(effects[layer, head]):+.2f}, attention to France {float(looks[layer, head]):.2f})")

# %% [markdown]
# Limits, before any conclusion: this is one 135M model, one pair of prompts and one metric (a logit
# difference, not the answer's text). Ablating one head at a time misses heads that back each other up
# (remove either and the other compensates; remove both and the answer goes), and mean ablation depends on
# the reference prompts chosen. What these maps show is what this model's answer to this question
# depends on, measured; it is not a general account of how the model knows capitals.

# %% [markdown]
# ---
# ## Summary
#
# - Each head gives every token a probability distribution over the tokens before it (the causal mask).
# - Much attention lands on the first token (an "attention sink"); one heatmap is weak evidence of meaning.
# - "capital" cannot attend to "France" in this model: it comes first. The meaning shows in later tokens and in the output.
# - One head is queries times keys, scaled, masked, softmaxed: our version matches the model's weights.
# - Three query heads share each key/value head here, which makes the KV cache three times smaller.
# - Where a head looks is not what the answer uses: ablation and patching (section 8) measure what the
#   France answer depends on, on one metric; compare their ranking of heads with the attention maps'.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `causal_mask(T)`: a (T, T) bool tensor, `True` where a query may **not** look.

# %%
from course_lib.exercises import lesson04 as ex

def causal_mask(T):
    ...  # your code here
    raise NotImplementedError

ex.check_causal_mask(causal_mask)

# %% [markdown]
# **2.** Write `head_weights(q, k)`: the causal attention weights of one head for q and k of shape (T, D).

# %%
def head_weights(q, k):
    ...  # your code here
    raise NotImplementedError

ex.check_head_by_hand(head_weights)

# %% [markdown]
# **3.** Write `kv_head_of(query_head)`: which key/value head a query head reads in this model.

# %%
def kv_head_of(query_head):
    ...  # your code here
    raise NotImplementedError

ex.check_kv_head(kv_head_of, cfg)

# %% [markdown]
# **4.** The next cell draws a sentence and two of its words (a new pair at each run). Which (layer, head)
# puts the most attention from the first word on the second? Compute it from the weights, as section 5 did
# for `" they"` and `" bank"`, and put a tuple in `strongest`. (Then think: why can no head link a word to
# one that comes after it?)

# %%
task = ex.strongest_task(tokenizer)
strongest = None  # e.g. (13, 8)
ex.check_strongest_head(strongest, model, tokenizer, **task)

# %% [markdown]
# **5.** Before running anything: what fraction of the clean answer comes back if you patch the output of
# the **last** block at the **last** position (the bottom-right cell of section 8's map)? Put a number in
# `patch_prediction`; the check measures it.

# %%
patch_prediction = None  # a number
ex.check_patch_prediction(patch_prediction, model, clean, corrupt, paris, berlin)

# %% [markdown]
# **6.** From section 8's `effects` (an L x H table), which (layer, head) matters most for " Paris" over
# " Berlin"? Compute it; put a tuple in `most_important`.

# %%
most_important = None  # e.g. (3, 1)
ex.check_most_important_head(most_important, effects)

# %% [markdown]
# **7.** Write `layer_effect(layer)`: the change in the logit difference when **every** head of one layer
# is mean-ablated at once (`probes.ablated_metric` with the section's `means`, minus the clean metric).
# Then compare a layer's whole effect with the sum of its heads' single effects: heads can add up, or
# stand in for each other.

# %%
def layer_effect(layer):
    ...  # your code here
    raise NotImplementedError

ex.check_layer_effect(layer_effect, model, clean, paris, berlin, means)

# %% [markdown]
# **Next:** 05 · sampling, where the model's next-token distribution becomes one chosen token.
