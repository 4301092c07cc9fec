# %% [markdown]
# # 06 · Generation and streaming: the loop, its stop conditions, and text that arrives piece by piece
#
# **Goal.** Write the autoregressive loop yourself, see why and when it stops, then stream its output
# the way a chat interface does, without ever showing a broken character.
#
# **You will**
# - run the loop step by step on the real model and read it as a table;
# - see the naive streamer print replacement characters, and fix it with an incremental decoder;
# - measure time to first token and the gaps between tokens, and how total time grows with length.

# %% [markdown]
# ## Set-up

# %%
import matplotlib.pyplot as plt
import torch
from IPython.display import display, Markdown
import course_lib
from course_lib.views import plots
from course_lib.text.context import chat_ids
from course_lib.engine.generation import generate, stream
from course_lib.engine.text_out import naive_pieces, IncrementalDecoder
from course_lib.engine.request import end_of_turn_ids

model, tokenizer = course_lib.load_model()
question_ids = chat_ids(tokenizer, "What is the capital of France?", system="You are a helpful assistant.")

# %% [markdown]
# ## 1. The loop, written out
#
# Generation repeats three moves: run the model, pick a token, append it. Here it is in its simplest
# form: no cache, greedy, a fixed number of steps. Each step runs the model on the *whole* sequence.

# %%
ids = list(question_ids)
for _ in range(8):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits  # (B=1, T, V)
    ids.append(int(logits[0, -1].argmax()))
print(repr(tokenizer.decode(ids[len(question_ids):])))

# %% [markdown]
# `course_lib.engine.generation.generate` is the same loop with three additions: a KV cache (`prefill`
# once, then `decode_step` with one token at a time; lesson 07 times it), a pluggable `pick` function
# (lesson 05's samplers), and stop conditions. It records each step:

# %%
result = generate(model, tokenizer, question_ids, max_new_tokens=30)
text_so_far = ""
print(f"{'step':>4}  {'token':<14}{'p':>7}  text so far")
for s in result.steps:
    text_so_far = tokenizer.decode(result.token_ids[: s.index + 1], skip_special_tokens=True)
    print(f"{s.index:>4}  {s.text!r:<14}{s.prob:>7.3f}  {text_so_far!r}")

# %% [markdown]
# The loop and `transformers`' own `model.generate` agree token for token in greedy mode (the test
# suite checks this on several prompts); here once more:

# %%
with torch.inference_mode():
    theirs = model.generate(torch.tensor([question_ids]), max_new_tokens=30, do_sample=False)
print("identical tokens:", result.token_ids == theirs[0, len(question_ids):].tolist())

# %% [markdown]
# ## 2. Stop conditions
#
# Three things end the loop, and the result says which one fired:
#
# - the model emits an **end-of-turn token** (read from its generation config);
# - the **maximum number of new tokens** is reached;
# - a **stop string** appears in the text (useful to cut at a delimiter); the answer ends just before it: the
#   stop string itself is never part of the text, streamed or not (OpenAI's API behaves the same).

# %%
print("end-of-turn IDs:", {i: tokenizer.decode([i]) for i in end_of_turn_ids(model, tokenizer)})
for kwargs in [dict(max_new_tokens=30), dict(max_new_tokens=4), dict(max_new_tokens=30, stop_strings=("France",))]:
    r = generate(model, tokenizer, question_ids, **kwargs)
    print(f"{str(kwargs):<52} -> {r.stop_reason:<15} {r.text!r}")

# %% [markdown]
# A fourth guard stops the loop when the context window is full, and a prompt that is already too
# long is refused before any work is done (section 6).
#
# ## 3. Streaming, the naive way
#
# Streaming sends each piece of text as soon as its token is chosen. The obvious way is to decode
# each new token on its own. Watch what that does when the answer contains characters that the
# tokenizer splits into several byte-level tokens:

# %%
hello_ids = chat_ids(tokenizer, "What is 'hello' in Chinese?", system="You are a helpful assistant.")
answer = generate(model, tokenizer, hello_ids, max_new_tokens=40)
pieces = naive_pieces(tokenizer, answer.token_ids)
print("naive stream:", "|".join(pieces))
print("pieces with a replacement character �:", sum("\ufffd" in p for p in pieces), "of", len(pieces))
# the model may answer without Chinese characters; a fixed line shows the same thing whatever it wrote
line = "Crème brûlée à Paris, 東京タワー 👨‍👩‍👧!"
line_ids = tokenizer(line, add_special_tokens=False)["input_ids"]
line_pieces = naive_pieces(tokenizer, line_ids)
print("a fixed line, naively:", "|".join(line_pieces), "->", sum("\ufffd" in p for p in line_pieces), "broken pieces")

# %% [markdown]
# Every `�` is a piece that held only part of a character's bytes (if the model's answer has none, it wrote no
# character that the tokenizer splits; the fixed line's kanji and emoji do split, its accents here do not). Sent to a client, those become
# garbage that no later piece can repair. (What the model says about Chinese is a separate question:
# judge the translation yourself; a 135M model is often wrong.)
#
# ## 4. Streaming that never breaks a character
#
# The fix: keep the token IDs, decode what has arrived, and only send text once its last character is
# complete. `IncrementalDecoder` (in `course_lib/engine/text_out.py`, about twenty lines) does it in constant time per
# token: it decodes only a short window of recent tokens, with two offsets (where the window starts, and how
# much of it was already sent):

# %%
decoder = IncrementalDecoder(tokenizer)
fixed = [decoder.push(t) for t in answer.token_ids] + [decoder.flush()]
fixed = [p for p in fixed if p]
print("fixed stream:", "|".join(fixed))
print("broken pieces:", sum("\ufffd" in p for p in fixed), "| joins to the full text:", "".join(fixed) == answer.text)

# %% [markdown]
# The same check on the fixed multilingual line (accents, CJK, a family emoji made of five code points):

# %%
decoder = IncrementalDecoder(tokenizer)
print("fixed:", "|".join(p for p in (decoder.push(t) for t in line_ids) if p))

# %% [markdown]
# Every fixed piece is valid text. Piece boundaries may still fall *between* the code points of one
# emoji: the family is a man, a woman and a girl joined by invisible zero-width joiners, so a client
# may briefly draw three people before the last piece merges them into one family.

# %% [markdown]
# Now stream live: `stream()` yields text while the model generates, and the answer appears piece
# by piece below (in a rendered page you see the final text).

# %%
story_ids = chat_ids(tokenizer, "Write a short story about a robot who learns to paint.", system="You are a helpful assistant.")
handle = display(Markdown("…"), display_id=True)
shown = ""
for piece in stream(model, tokenizer, story_ids, max_new_tokens=120):
    shown += piece
    handle.update(Markdown(shown + " ▌"))
handle.update(Markdown(shown))

# %% [markdown]
# Streaming is not a display trick: the pieces are sent as the loop produces them, one decode step
# apart. The next section measures that rhythm. (If the story starts repeating a sentence, that is greedy
# decoding on a small model: lesson 05's repetition penalty and sampling are the usual remedies.)
#
# ## 5. Time to first token, and the gaps between tokens
#
# Two numbers describe how an answer *feels*: the **time to first token** (TTFT: the prompt's prefill
# plus one pick) and the **inter-token latency** (one decode step each).

# %%
story = generate(model, tokenizer, story_ids, max_new_tokens=160)
gaps = story.inter_token_seconds
print(f"{len(story.token_ids)} tokens, stop: {story.stop_reason}")
print(f"TTFT {story.time_to_first_token * 1000:.0f} ms | median gap {sorted(gaps)[len(gaps) // 2] * 1000:.1f} ms "
      f"| {len(gaps) / (story.steps[-1].at - story.steps[0].at):.1f} tokens/s after the first")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.5), layout="constrained")
plots.plot_token_timeline([s.at for s in story.steps], ax=axes[0])
plots.plot_gaps(gaps, ax=axes[1])
plt.show()

# %% [markdown]
# **"Longer answers take longer."** The timeline above is that claim measured: the time at which token
# n arrives grows in a nearly straight line with n, because each token costs one decode step. We fit a
# line to it:

# %%
xs = list(range(len(story.steps)))
ax = plots.plot_xy(xs, [s.at * 1000 for s in story.steps], "new tokens generated", "ms since the request",
                   fit_line=True, title="Total time against answer length (one run)")
plt.show()

# %% [markdown]
# The slope of the line is the cost of one decode step. With a KV cache it grows only slowly as the
# context lengthens; without one, each step would re-read the whole sequence (lesson 07 measures both).
#
# ## 6. Bad requests get clear errors

# %%
for args in [([], 10), (question_ids, 0), (question_ids, -5),
             ([1780] * (model.config.max_position_embeddings + 1), 10)]:
    try:
        generate(model, tokenizer, args[0], max_new_tokens=args[1])
    except ValueError as err:
        print(f"prompt of {len(args[0])} tokens, max_new_tokens={args[1]:<3} -> {err}")

# %% [markdown]
# ---
# ## Summary
#
# - Generation is a loop: run the model, pick a token, append it, until a stop condition fires.
# - The stop conditions are the end-of-turn token, a token limit, a stop string, or a full context window.
# - Decoding tokens one by one breaks characters that span several tokens; an incremental decoder holds them back.
# - Time to first token is the prefill; after that, tokens arrive at the pace of one decode step each.
# - Total time grows about linearly with the number of new tokens: longer answers take longer.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `greedy_loop(ids, n)`: the simple loop of section 1 as a function returning the `n`
# new token IDs (no cache, no stop condition).

# %%
from course_lib.exercises import lesson06 as ex

def greedy_loop(ids, n):
    ...  # your code here
    raise NotImplementedError

ex.check_greedy_loop(greedy_loop, model, tokenizer, question_ids)

# %% [markdown]
# **2.** Write `pieces_for(token_ids)`: the pieces a correct streamer sends, one per token as it arrives
# (without using `IncrementalDecoder`): an empty string while text is held back, otherwise everything that
# became complete with this token. No piece may contain `"\ufffd"`, the pieces must join to the decoded
# text, and no character may be sent later than the token that completed it. The check also draws new
# texts at every run.

# %%
def pieces_for(token_ids):
    ...  # your code here
    raise NotImplementedError

ex.check_streamer(pieces_for, tokenizer)

# %% [markdown]
# **3.** Write `ttft_share(result)`: the share of the total time (until the last token) spent waiting
# for the first token, as a float.

# %%
def ttft_share(result):
    ...  # your code here
    raise NotImplementedError

ex.check_ttft_share(ttft_share, model, tokenizer, question_ids)

# %% [markdown]
# **4. Predict, then measure.** Section 5 printed the story's time to first token and its median gap. For the
# same prompt, predict the seconds from the request until the **80th** new token arrives (the check turns the
# end-of-turn stop off, so exactly 80 are made) and write it in `prediction_s` before running the check.

# %%
prediction_s = None  # your prediction, in seconds
ex.check_arrival_prediction(prediction_s, model, tokenizer, story_ids, n=80)

# %% [markdown]
# **Next:** 07 · the KV cache, where we time the loop with and without it.
