# %% [markdown]
# # 00 · The pipeline tour: one question, eight steps, a real model
#
# **Goal.** Follow the question *"What is the capital of France?"* through every step a language
# model takes to answer it, on a real pretrained model (SmolLM2-135M-Instruct) running on this machine.
# Every number and picture below is measured in this run.
#
# **You will**
# - name the eight steps of inference and see the real data that passes between them;
# - read the model's top-10 guesses for the next token, and find out whether "Paris" really comes first;
# - see where the time goes, measured step by step.

# %% [markdown]
# ## Set-up
#
# `load_model()` reads the model from the local cache that `make setup` built (no network), picks
# the device (a CUDA GPU if there is one, else Apple's MPS, else the CPU) and prints what it chose.
#
# Where the weights come from: the course ships SmolLM2-135M-Instruct as a 4-bit GGUF file (the form
# llama.cpp runs), and set-up expands those 4-bit values to float32 once. So every number in the course
# is the 4-bit model's, computed in float32: close to the original release but not identical to it
# (lesson 12 measures what the 4 bits cost).

# %%
import torch
import matplotlib.pyplot as plt
import course_lib
from course_lib.runtime import stopwatch
from course_lib.runner.forward import probabilities, top_candidates, entropy_bits
from course_lib.engine.generation import generate
from course_lib.engine.request import end_of_turn_ids
from course_lib.views import plots

model, tokenizer = course_lib.load_model()
device = model.device
times = {}  # step name -> seconds, filled as we go

# %% [markdown]
# A first call through a model pays one-time costs (memory allocation, kernel selection). We make
# one throw-away call now, so the timings below show the steady state a server would see.

# %%
_ = generate(model, tokenizer, tokenizer("Hello")["input_ids"], max_new_tokens=2)

# %% [markdown]
# ## 1. The prompt is received
#
# In a chat product the question arrives at a server as an HTTP request. Here it is simply a Python
# string, so this step costs nothing we can measure; lesson 10 puts a real HTTP server in front.

# %%
prompt = "What is the capital of France?"
print(repr(prompt), f"({len(prompt)} characters)")

# %% [markdown]
# ## 2. Tokenization: text becomes integers
#
# The model never sees letters. Its tokenizer cuts the text into pieces from a fixed vocabulary and
# replaces each piece by its ID. A `Ġ` in a piece marks a leading space.

# %%
with stopwatch(device) as t:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
times["2 tokenize"] = t["seconds"]
print(len(prompt_ids), "tokens:", prompt_ids)
print(tokenizer.convert_ids_to_tokens(prompt_ids))

# %% [markdown]
# The IDs that popular explainers print for this sentence come from OpenAI's tokenizer, not this one:
# every model family has its own vocabulary. Lesson 01 compares the two side by side.

# %% [markdown]
# ## 3. Context assembly: what the model actually reads
#
# A chat model does not receive your question alone. The **chat template** wraps a system prompt and
# each message in role markers (`<|im_start|>`, `<|im_end|>`), then adds the start of the
# assistant's turn so the model knows it is its turn to speak.

# %%
messages = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": prompt}]
with stopwatch(device) as t:
    context_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
times["3 assemble context"] = t["seconds"]
print(tokenizer.decode(context_ids))

# %% [markdown]
# How many tokens does each part cost? We render the template part by part and count.

# %%
def n_tokens(msgs, gen=False):
    return len(tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, return_dict=True)["input_ids"]) if msgs else 0

parts = {"system prompt": n_tokens(messages[:1]),
         "user question": n_tokens(messages) - n_tokens(messages[:1]),
         "generation prompt": n_tokens(messages, True) - n_tokens(messages)}
print(parts, "total:", sum(parts.values()), "=", len(context_ids))
texts = {m["role"]: len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages}
print(f"the texts alone: {texts} -> {sum(texts.values())} tokens; the template adds "
      f"{len(context_ids) - sum(texts.values())} around them")
print("context window of this model:", model.config.max_position_embeddings, "tokens")

# %% [markdown]
# The question is a small part of what the model reads: most of the context here is template and
# system prompt. A count of the texts alone (a system prompt of so many tokens, a question of so many) misses
# the template's role markers and the generation prompt: the second line says how many tokens those add.
#
# The window is a property of each model, set by how it was trained: this one's is printed last. The
# windows of hundreds of thousands of tokens often quoted belong to larger models trained for them. Lesson
# 02 shows what happens when a conversation fills the window, and lesson 17 what happens at its end.

# %% [markdown]
# ## 4. The forward pass: every layer, every position, once
#
# The whole context goes through the model in one call (this first call is named **prefill**). Each
# of the decoder layers mixes information between positions (attention) and transforms each position
# (feed-forward). Out of the top come **logits**: one score per vocabulary entry, for every position.

# %%
ids = torch.tensor([context_ids], device=device)  # (B=1, T)
with stopwatch(device) as t:
    with torch.inference_mode():
        out = model(input_ids=ids)
times["4 forward pass (prefill)"] = t["seconds"]
logits = out.logits  # (B, T, V)
print("layers:", model.config.num_hidden_layers, "| logits shape (B, T, V):", tuple(logits.shape))

# %% [markdown]
# Popular explainers speak of "80+ layers": that is a 70-billion-parameter model. This one has the
# number printed above. Same design, far smaller, which is why it runs on a laptop.

# %% [markdown]
# ## 5. Sampling: from scores to one token
#
# Only the last position's logits matter for the next token. Softmax turns them into probabilities
# that sum to one. Greedy decoding (what a temperature of 0 means) takes the most probable token.

# %%
with stopwatch(device) as t:
    probs = probabilities(logits[0, -1])  # (V,)
    first = int(probs.argmax())
times["5 sample first token"] = t["seconds"]
top10 = top_candidates(tokenizer, probs.cpu(), k=10)
for c in top10:
    print(f"{c.rank:>2}. {c.text!r:<12} {c.prob:6.3f}")
print(f"entropy: {entropy_bits(probs.cpu()):.2f} bits over {probs.numel()} tokens")
print(f"the top token holds {top10[0].prob:.0%} of the probability; the ten shown hold "
      f"{sum(c.prob for c in top10):.0%} together, the other {probs.numel() - 10:,} tokens the rest")

# %%
ax = plots.plot_top_candidates([c.text for c in top10], [c.prob for c in top10], highlight="Paris",
                               title="The model's top-10 first tokens of its answer")
plt.show()

# %% [markdown]
# Explainers often draw this step as one word with most of the probability and an absurd one with almost
# none. The line above the chart says how concentrated this model's first choice really is: it is not yet
# answering, it is choosing how to begin a sentence.
#
# **Is "Paris" first?** The cell below answers from the numbers above. Popular accounts say Paris
# wins "by a wide margin" at this point; a chat model usually starts with a sentence instead.

# %%
paris_rank = next((c.rank for c in top10 if c.text.strip() == "Paris"), None)
print("most probable first token:", repr(tokenizer.decode([first])), f"with p = {probs[first]:.3f}")
print("rank of 'Paris' among the first tokens:", paris_rank if paris_rank else "not in the top 10")

# %% [markdown]
# ## 6. Append and repeat: the loop
#
# The chosen token is appended and the model runs again. Thanks to the **KV cache** (lesson 07) the
# next pass only processes the one new token. `course_lib.engine.generation.generate` is this loop, written
# out: `prefill` once, then `decode_step` per token. It records every step.

# %%
result = generate(model, tokenizer, context_ids, max_new_tokens=48)
# generate() runs its own prefill; count only the decode steps after the first token, not it twice
times["6-7 decode loop"] = result.steps[-1].at - result.steps[0].at
for s in result.steps:
    print(f"step {s.index:>2}: {s.text!r:<14} p={s.prob:.3f}  at {s.at * 1000:7.1f} ms")

# %%
ax = plots.plot_token_probs([s.text for s in result.steps], [s.prob for s in result.steps],
                            title="How sure the model was of each token it chose")
plt.show()

# %% [markdown]
# Look at where "Paris" appears and with what probability: once the model has written the start of
# its sentence, the city is the near-certain continuation. The uncertainty was about *how* to start.

# %% [markdown]
# ## 7. The stop condition
#
# The loop stops when the model emits an **end-of-turn token**, or when it reaches the maximum number
# of new tokens. Which tokens end a turn is read from the model's own generation config.

# %%
stops = end_of_turn_ids(model, tokenizer)
print("end-of-turn token(s):", {i: tokenizer.decode([i]) for i in stops})
print("stop reason:", result.stop_reason, "| last token:", repr(result.steps[-1].text))
print("new tokens generated:", len(result.token_ids))

# %% [markdown]
# `<|im_end|>` is the same marker the chat template puts after every message. The model learned in
# training to write it when its answer is complete, so stopping is a prediction like any other token.

# %% [markdown]
# ## 8. Detokenization: integers back to text
#
# The new token IDs are turned back into text, dropping special tokens. A server streams these pieces
# as they are produced (lesson 06 shows why decoding piece by piece needs care).

# %%
with stopwatch(device) as t:
    answer = tokenizer.decode(result.token_ids, skip_special_tokens=True)
times["8 detokenize"] = t["seconds"]
print(repr(answer))

# %% [markdown]
# ## Where did the time go?
#
# Every bar below was measured in this run, on this device.

# %%
ax = plots.plot_step_times(list(times), list(times.values()),
                           title=f"The eight steps on {device}, measured (6 and 7 share a bar; step 1, receiving the prompt, is not timed)")
plt.show()
total = sum(times.values())
first_token = sum(s for name, s in times.items() if name[0] in "2345")  # tokenize .. first token picked
print(f"time to first token: {first_token * 1000:.0f} ms (steps 2-5) | end to end: {total * 1000:.0f} ms for "
      f"{len(result.token_ids)} new tokens ({'under' if total < 1 else 'over'} one second)")

# %% [markdown]
# Two numbers, not one. The time to first token is what a user waits before anything appears; the end-to-end
# time grows with the answer's length, by one decode step per token. When a service is said to answer "in
# well under a second", that is usually its time to first token, on a GPU server, for a model far larger than
# this one; on this machine both numbers are printed above. The loop of decode steps dominates: each new token costs a full pass through every layer, one
# token at a time. That is why longer answers take longer, and why lessons 07 to 09 are all about
# making the loop cheaper. The tokenizer and template are tiny by comparison.
#
# ## The map of the course
#
# | Step | Where it is opened up |
# |---|---|
# | 2 Tokenization | 01 tokenization |
# | 3 Context assembly | 02 context assembly |
# | 4 Forward pass | 03 forward pass, 04 attention |
# | 5 Sampling | 05 sampling |
# | 6-8 Loop, stop, detokenize, stream | 06 generation and streaming |
# | The loop made fast | 07 KV cache, 08 prefill and decode, 09 batching |
# | 1 and 8 over the network | 10 serving |
# | Part II: the engine, built | 11 the model written out, with its own KV cache; 12 bytes per token (weight formats); 13 a server's memory (paged KV cache); 14 speculative decoding; 15 structured output; 16 attention kernels; 17 long context; 18 beyond one machine (replicas and a router, prefill and decode apart, tensor parallelism) |

# %% [markdown]
# ---
# ## Summary
#
# - A prompt becomes token IDs, is wrapped by the chat template, and goes through the model once (prefill).
# - The model outputs a probability for every vocabulary entry; greedy decoding takes the most likely one.
# - The answer is built one token at a time; each token costs another pass through all the layers.
# - It stops when the model predicts its end-of-turn token (or a length limit is hit).
# - On this model the first token of the answer is not "Paris": the city comes later, with high confidence.

# %% [markdown]
# ---
# ## Exercises
#
# Each exercise has a check that runs your code against the real model and tells you if it is right.
#
# **1.** Write `count_tokens(text)` that returns how many token IDs the tokenizer gives for `text`
# (without special tokens).

# %%
from course_lib.exercises import lesson00 as ex

def count_tokens(text):
    ...  # your code here
    raise NotImplementedError

ex.check_count_tokens(count_tokens, tokenizer)

# %% [markdown]
# **2.** Write `next_token(ids)` that runs one forward pass on a list of token IDs and returns the
# greedy next token ID as a Python `int`.

# %%
def next_token(ids):
    ...  # your code here
    raise NotImplementedError

ex.check_next_token(next_token, model, tokenizer)

# %% [markdown]
# **3.** Write `answer(question)` that runs the whole pipeline: a chat template with only the user's
# question (no system message of yours: the template adds its own default one, lesson 02 shows it), the
# generation prompt, `generate(...)` with `max_new_tokens=48`, and returns the decoded text.

# %%
def answer(question):
    ...  # your code here
    raise NotImplementedError

ex.check_answer(answer, model, tokenizer)

# %% [markdown]
# **4. Predict, then measure.** The chart above split 8 new tokens' time into steps. For an answer of **100**
# tokens to the same context, what share of the end-to-end time will the decode loop (everything after the
# first token) take? Write a number between 0 and 1 in `prediction` before running the check: it generates
# exactly 100 tokens and measures.

# %%
prediction = None  # your prediction: the decode loop's share of the time, 0 to 1
ex.check_loop_share_prediction(prediction, model, tokenizer, context_ids, n=100)

# %% [markdown]
# **Next:** 01 · tokenization, where we look closely at how text becomes tokens and what they cost.
