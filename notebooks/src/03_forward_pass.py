# %% [markdown]
# # 03 · The forward pass: from token IDs to a next-token distribution
#
# **Goal.** Open the model and follow one prompt through it: the embedding, thirty decoder blocks,
# the final norm and the output head. Every shape, count and picture comes from the real model.
#
# **You will**
# - map the architecture and count where its parameters and memory go;
# - watch the prediction form layer by layer with the logit lens;
# - rebuild one decoder block by hand from the model's own weights and match the library exactly.

# %% [markdown]
# ## Set-up

# %%
import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots
from course_lib.runner.forward import forward_logits, probabilities, top_candidates, entropy_bits
from course_lib.inside.anatomy import (parameter_map, memory_by_dtype, capture_shapes, layer_outputs, logit_lens,
                                       block_by_hand, flops_per_token)
from course_lib.loading import GGUF_BYTES
from course_lib.runtime import time_it

# float32 even on a GPU, so the hand-written block in section 6 can match the library to 1e-4
model, tokenizer = course_lib.load_model(dtype="float32")
cfg = model.config
prompt = "What is the capital of France?"
ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]

# %% [markdown]
# ## 1. The architecture as a map
#
# SmolLM2 is a *llama-style* decoder. Printed from the loaded config:

# %%
print(f"vocabulary V = {cfg.vocab_size:,} | hidden size = {cfg.hidden_size} | layers L = {cfg.num_hidden_layers}")
print(f"query heads H = {cfg.num_attention_heads}, key/value heads = {cfg.num_key_value_heads}, "
      f"head dim D = {cfg.head_dim} | feed-forward size = {cfg.intermediate_size}")
print(f"positions: rotary (theta = {cfg.rope_parameters['rope_theta']:,.0f}) | norm: RMSNorm | "
      f"activation: {cfg.hidden_act} (SwiGLU) | output head tied to embedding: {cfg.tie_word_embeddings}")

# %% [markdown]
# Token IDs → **embedding** (a lookup table, one 576-number vector per token) → 30 × **decoder block**
# (RMSNorm → attention with 9 query heads sharing 3 key/value heads, rotary positions → add back;
# RMSNorm → SwiGLU feed-forward → add back) → final **RMSNorm** → **output head** (a matrix that
# scores every vocabulary entry; here it *is* the embedding matrix, reused).
#
# The weights are the model's quantized release (the GGUF file set-up fetched) expanded to float32: each
# layer matrix holds, per block of 32 values, one of 16 levels; the embedding (which is also the output head)
# one of 255 levels per block of 32 (8 bits); the norms are plain float32. Lesson 12 reads the blocks.
#
# Where are the parameters? Counted from the loaded model:

# %%
parts = parameter_map(model)
total = sum(n for _, n in parts)
ax = plots.plot_parameter_map(parts, title=f"{total / 1e6:.1f} M parameters, counted from the model")
plt.show()

# %% [markdown]
# The feed-forward layers hold most of the weights. The embedding is a large share of this small
# model because the vocabulary is large relative to the hidden size. Compare a big model, using the
# published configuration of Llama 3 70B (vocabulary 128,256, hidden size 8,192, 70.6 B parameters):

# %%
print(f"embedding share here: {parts[0][1] / total:.1%} (also the output head: tied) | in Llama 3 70B: "
      f"{128_256 * 8_192 / 70.6e9:.1%}, and as much again for its separate output head")

# %% [markdown]
#
# **Memory.** The same parameters take different space in each number format. The file we downloaded
# stores 4-bit weights plus a scale and an offset for every block of 32 (and keeps a few tensors at
# higher precision), so it needs more than half a byte per parameter; in memory we dequantized it:

# %%
for fmt, nbytes in memory_by_dtype(total).items():
    print(f"{fmt:>9}: {nbytes / 1e6:7.0f} MB")
in_memory = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"the GGUF file on disk: {GGUF_BYTES / 1e6:.0f} MB ({GGUF_BYTES / total:.2f} bytes per parameter) | "
      f"in memory now ({model.dtype}): {in_memory / 1e6:.0f} MB")

# %% [markdown]
# ## 2. One forward pass, shape by shape
#
# Hooks record the shape of each stage's output as the prompt goes through. B is the batch, T the
# tokens, and the last number is the width of the vector at each position.

# %%
shapes = capture_shapes(model, ids)
for name, shape in shapes[:8] + [("...", "")] + shapes[-4:]:
    print(f"{name:<28} {shape}")

# %% [markdown]
# Every block keeps the shape (B, T, 576): a block *refines* the vector at each position, it does not
# change its size. Only the output head widens it to one score per vocabulary entry. How much does each
# block change the vector? The size (norm) of the residual stream after each layer:

# %%
hidden = layer_outputs(model, ids)  # (L+1, T, hidden)
norms = hidden.norm(dim=-1)  # (L+1, T)
ax = plots.plot_xy(list(range(len(norms))), norms[:, -1].tolist(), "after layer (0 = embedding)",
                   "norm of the hidden state", title="Norm of the last position's hidden state, layer by layer")
plt.show()

# %% [markdown]
# ## 3. From logits to probabilities
#
# The output head gives **logits**, one per vocabulary entry. Softmax turns the last position's logits
# into probabilities; their log is what training optimised; entropy measures the uncertainty.

# %%
all_logits = forward_logits(model, ids)[0]  # (T, V): one pass, every position (section 4 reuses it)
logits = all_logits[-1]  # (V,) the next token after the whole prompt
probs = probabilities(logits)
for c in top_candidates(tokenizer, probs, k=8):
    print(f"{c.text!r:<12} logit {logits[c.token_id]:7.2f}  p {c.prob:.3f}  log p {torch.log(torch.tensor(c.prob)):7.2f}")
print(f"entropy {entropy_bits(probs):.2f} bits")

# %%
top = top_candidates(tokenizer, probs, k=10)
ax = plots.plot_top_candidates([c.text for c in top], [c.prob for c in top],
                               title="Next token after the raw question (no chat template)")
plt.show()

# %% [markdown]
# Without the chat template the model is not answering: it continues the raw text it was given, so it
# predicts what follows a question. Read the top candidates above: a chat-tuned model often closes the
# turn right there, because nothing told it that it is now its turn to speak (lesson 02).
#
# ## 4. Prefill predicts at every position at once
#
# One forward pass computes logits for **every** position, not just the last. Each position's
# prediction only uses the tokens up to it (the causal mask, lesson 04). That is why prefill is one
# call no matter the prompt length, and why training can learn from every position in parallel.

# %%
for t in range(len(ids)):  # all_logits came from the single pass of section 3
    guess = int(all_logits[t].argmax())
    print(f"after {tokenizer.decode(ids[: t + 1])!r:<34} -> {tokenizer.decode([guess])!r}")

# %% [markdown]
# ## 5. The logit lens: watching the answer form
#
# Apply the final norm and the output head to the hidden state after *each* layer, as if the model
# stopped there. We use a sentence the model completes with a fact: "The capital of France is".

# %%
lens_text = "The capital of France is"
lens_ids = tokenizer(lens_text, add_special_tokens=False)["input_ids"]
top_ids, top_probs = logit_lens(model, lens_ids)  # (L+1, T, 1) each
words = [[tokenizer.decode([int(i)]) for i in row[:, 0]] for row in top_ids]
ax = plots.plot_logit_lens(words, top_probs[:, :, 0], [tokenizer.decode([i]) for i in lens_ids])
plt.show()

# %%
paris = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
rows = [r - 1 for r in range(1, top_ids.shape[0]) if int(top_ids[r, -1, 0]) == paris]
print("layers after which ' Paris' is the top guess at the last position:", rows or "none")
print(f"final probability of ' Paris': {float(top_probs[-1, -1, 0]):.2f}")

# %% [markdown]
# The row "emb" is the embedding before any block. Because the output head *is* the embedding matrix,
# an unprocessed embedding tends to point back at its own token. Counted:

# %%
itself = sum(int(top_ids[0, t, 0]) == lens_ids[t] for t in range(len(lens_ids)))
print(f"the embedding row predicts the input token itself at {itself} of {len(lens_ids)} positions")

# %% [markdown]
# What does the lens predict at the last position before the answer appears? Counted over the layers:

# %%
from collections import Counter
first = rows[0] if rows else len(words) - 1  # the first layer whose output predicts ' Paris'
before = [words[r][-1] for r in range(1, first + 1)]  # row r is the output of layer r - 1
print("top guesses at the last position, layer by layer, before ' Paris':", Counter(before).most_common(6))

# %% [markdown]
# In this small model the factual answer appears only near the very top; the counts above say what the
# lens shows for most of the depth before it.
#
# ## 6. One decoder block, by hand
#
# Here is a whole block written with the model's own weights, in a few lines of `course_lib`:
# RMSNorm, attention with rotary positions and shared key/value heads, a residual add, RMSNorm, the
# SwiGLU feed-forward, another residual add. Read `block_by_hand` in `course_lib/inside/anatomy.py` and
# `attention_by_hand` in `course_lib/runner/attention.py`. Does it match the library, block for block?

# %%
for layer in [0, 1, 14, 29]:
    ours = block_by_hand(model.model.layers[layer], hidden[layer], cfg)
    theirs = hidden[layer + 1]
    print(f"block {layer:>2}: allclose = {torch.allclose(ours, theirs, atol=1e-4)}, "
          f"max difference = {float((ours - theirs).abs().max()):.2e}")

# %% [markdown]
# The same arithmetic, the same result. There is nothing else inside a block.
#
# ## 7. What a forward pass costs
#
# Each weight in a matrix product is used once per token, for a multiply and an add: about **2
# floating-point operations per weight per token**. The embedding lookup is free (a row is copied, nothing
# is multiplied); the output head is the same matrix used as a product, a full vocabulary x hidden product for
# every token. So with tied weights the count is simply 2 x all parameters: the matrix is stored once and
# multiplied once. Attention's own products over the earlier tokens (scores and weighted sums) come on top
# and grow with the context; `flops_per_token` leaves them out. Against the measured time:

# %%
flops = flops_per_token(total, cfg.vocab_size * cfg.hidden_size)
one = time_it(lambda: forward_logits(model, ids[:1]), model.device, repeats=5)
many = time_it(lambda: forward_logits(model, ids * 8), model.device, repeats=3)
print(f"about {flops / 1e6:.0f} MFLOP per token")
print(f"1 token: {one.best * 1000:.1f} ms -> {flops / one.best / 1e9:.1f} GFLOP/s")
print(f"{len(ids) * 8} tokens in one pass: {many.best * 1000:.1f} ms -> {flops * len(ids) * 8 / many.best / 1e9:.1f} GFLOP/s")

# %% [markdown]
# One token at a time uses the hardware poorly: on this CPU the time goes into reading the weights, not
# into arithmetic (lesson 08 measures both ceilings); on a GPU at batch 1 it goes mostly into launching
# thousands of small operators. Many tokens in one pass reuse each weight many times and reach a much
# higher rate. This gap is the whole story of prefill against decode (lesson 08).
#
# **How many matrix products, and how big?** "Each layer does millions of matrix multiplications" is a
# common way to put it. Count them in one block of this model, for one token at a context of 100 tokens:

# %%
layer0 = model.model.layers[0]
products = {name: getattr(getattr(layer0, part), name).weight.shape for part, names in
            [("self_attn", ["q_proj", "k_proj", "v_proj", "o_proj"]), ("mlp", ["gate_proj", "up_proj", "down_proj"])]
            for name in names}
for name, (out_f, in_f) in products.items():
    print(f"{name:<10} {in_f:>5} -> {out_f:>5}: {out_f * in_f:>9,} multiply-adds per token")
heads, head_dim, context = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, 100
print(f"attention: 2 products per head (scores, weighted sum) x {heads} heads, "
      f"{2 * head_dim * context:,} multiply-adds each per token at {context} tokens of context")
print(f"-> {len(products) + 2 * heads} matrix products per block per token; "
      f"{sum(o * i for o, i in products.values()) + 2 * heads * head_dim * context:,} multiply-adds in all")

# %% [markdown]
# So a block runs a few dozen matrix products (seven with weights, two per head for attention), each with
# hundreds of thousands to millions of multiply-adds: millions of *operations*, not millions of
# *multiplications of matrices*. The same rule on a much larger published design, Llama 3 70B (70.6 B
# parameters, vocabulary 128,256, hidden 8,192, its output head not tied to the embedding):

# %%
big = flops_per_token(int(70.6e9), 128_256 * 8_192, tied=False)  # the lookup is free, the separate head is counted
print(f"Llama 3 70B: about {big / 1e9:.0f} GFLOP per token ({big / 2e9:.0f} billion multiply-adds); "
      f"a {len(ids)}-token prompt: {big * len(ids) / 1e12:.1f} TFLOP; this model: {flops / 1e6:.0f} MFLOP per token")

# %% [markdown]
# Read the first figure: billions of operations per token for the 70B model (about twice its parameters,
# one multiply and one add per weight); trillions only for a whole prompt or answer.
# Lesson 08 turns the bytes behind it into seconds per token on this machine.

# %% [markdown]
# ---
# ## Summary
#
# - The model is an embedding, a stack of identical decoder blocks, a final norm and an output head.
# - Each block keeps the (B, T, hidden) shape; it refines each position with attention and a feed-forward.
# - One pass yields logits for every position; softmax makes them probabilities.
# - The logit lens shows the prediction forming; here the answer appears only near the top.
# - A block is a dozen lines of arithmetic: our version matches the library to within float rounding
#   (section 6 printed the largest difference).

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `count_params(module)`: the number of parameters of any torch module.

# %%
from course_lib.exercises import lesson03 as ex

def count_params(module):
    ...  # your code here
    raise NotImplementedError

ex.check_count_params(count_params, model)

# %% [markdown]
# **2.** Write `entropy_bits(probs)`: the entropy in bits of a probability vector (zeros allowed).

# %%
def entropy_bits(probs):
    ...  # your code here
    raise NotImplementedError

ex.check_entropy(entropy_bits)

# %% [markdown]
# **3.** The next cell draws a short text and the word that follows it (a new one at each run). Run the
# logit lens on it as above: after which layer (0 to 29) does the word *first* become the top guess at
# the last position? Put the number in `first_layer`.

# %%
task = ex.first_layer_task(model, tokenizer)
first_layer = None  # your answer here
ex.check_first_layer(first_layer, model, tokenizer, **task)

# %% [markdown]
# **4.** Write `project(hidden)`: the logit lens for one vector. Apply the model's final norm and
# output head to a (576,) hidden state and return the top token ID as an `int`.

# %%
def project(hidden):
    ...  # your code here
    raise NotImplementedError

ex.check_project(project, model, tokenizer)

# %% [markdown]
# **5. Predict, then measure.** Section 7 timed one pass over a single token and one pass over many. Before
# running anything, predict how many milliseconds ONE pass over a single 64-token sequence takes on this
# machine, and write it in `prediction_ms`. The check then measures it and shows both numbers: a prediction
# far off teaches more than one that was copied.

# %%
prediction_ms = None  # your prediction, in milliseconds, written before you run this cell
ex.check_pass_prediction(prediction_ms, model, ids)

# %% [markdown]
# **Next:** 04 · attention, where we look inside the attention step of those blocks.
