# %% [markdown]
# # 02 · Context assembly: what the model actually reads
#
# **Goal.** See the exact tokens that reach the model when you chat: system prompt, history, your
# message and the template around them; then watch what happens when a conversation no longer fits.
#
# **You will**
# - render a conversation through the real chat template and count the tokens of each part;
# - fit an overlong conversation into a budget with three strategies, and see what each one drops;
# - test, on the real model, the claim that "the model doesn't know what it can't see".

# %% [markdown]
# ## Set-up

# %%
import json
from pathlib import Path
import matplotlib.pyplot as plt
from IPython.display import HTML, display
import course_lib
from course_lib.views import plots, html_views
from course_lib.text.context import (render, context_ids, segments, budget_report, fit_to_budget, validate_messages,
                                     ContextOverflowError, STRATEGIES, admits_not_knowing)
from course_lib.engine.generation import generate

model, tokenizer = course_lib.load_model()
CONVERSATION = json.loads(Path("../data/conversation.json").read_text())

# %% [markdown]
# A small helper we use throughout: ask the model (greedy, so the result is repeatable).

# %%
def ask(messages, max_new_tokens=40):
    return generate(model, tokenizer, context_ids(tokenizer, messages), max_new_tokens=max_new_tokens).text

# %% [markdown]
# ## 1. The chat template made visible
#
# A chat is a list of messages with roles. The model, however, reads one flat sequence of tokens.
# The **chat template** (shipped with the model, written in Jinja) turns the list into that sequence.
# Each coloured block below is one part; special tokens are in red.

# %%
messages = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hi! Where is the Eiffel Tower?"},
            {"role": "assistant", "content": "It is in Paris, on the Champ de Mars."},
            {"role": "user", "content": "What is the capital of France?"}]
segs = segments(tokenizer, messages)
display(HTML(html_views.context_view(segs)))

# %%
report = budget_report(tokenizer, messages, budget=256)
ax = plots.plot_context_parts(report.parts, title="Tokens per part of this conversation")
plt.show()
print("total tokens the model reads:", report.used)

# %% [markdown]
# **What does the generation prompt add?** Only the opening of the assistant's turn. It is the cue
# that says "now you speak, as the assistant".

# %%
gen = segs[-1]
print(gen.label, repr(gen.text), gen.ids, tokenizer.convert_ids_to_tokens(gen.ids))

# %% [markdown]
# **A hidden default.** This model's template adds a system prompt of its own when you give none:

# %%
no_system = [{"role": "user", "content": "What is the capital of France?"}]
for s in segments(tokenizer, no_system):
    print(f"{s.label:>22}: {len(s.ids):>3} tokens  {s.text!r}")

# %% [markdown]
# ## 2. The context window and a budget meter
#
# The **context window** is the most tokens the model can attend to at once. It is a property of
# the model, read here from its config. Everything (system prompt, history, documents, the answer
# being written) shares it.

# %%
window = model.config.max_position_embeddings
conv = CONVERSATION["messages"]
print(f"context window: {window} tokens; the course's running conversation has {len(conv)} messages")
full = budget_report(tokenizer, conv, budget=window)
print(f"it uses {full.used} tokens: {full.used / window:.1%} of the window, {full.remaining} remain")

# %% [markdown]
# A real window of this size takes a while to fill on a CPU, so for the rest of this lesson we use a
# **teaching budget of 256 tokens**: the same mechanics, at a size that runs in seconds.

# %%
BUDGET = 256
report = budget_report(tokenizer, conv, BUDGET)
ax = plots.plot_context_parts(report.parts, budget=BUDGET, title=f"The conversation against a {BUDGET}-token budget")
plt.show()
print(f"needs {report.used} tokens; over budget by {-report.remaining}" if not report.fits else "fits")

# %% [markdown]
# ## 3. Overflow: three strategies
#
# When a conversation is too long, something must go, and who decides matters: the model drops nothing. It
# reads the tokens it is given, and a prompt longer than its window is an error before any work starts (lesson
# 06's `generate` refuses it; lesson 10's server answers 400 with `context_length_exceeded`, as OpenAI's API
# does). Dropping is the **application's** policy, applied before the request is sent. `fit_to_budget`
# implements three common ones:
#
# - **drop_oldest**: keep the system prompt and the newest messages; drop whole turns from the oldest.
# - **truncate_middle**: keep the system prompt, the *first* turn and the newest messages; drop the middle.
# - **refuse**: raise an error and let the caller decide.

# %%
fits = {}
for strategy in STRATEGIES:
    try:
        fits[strategy] = fit_to_budget(tokenizer, conv, BUDGET, strategy)
        print(f"{strategy:>16}: dropped messages {fits[strategy].dropped}, now {fits[strategy].tokens} tokens")
    except ContextOverflowError as err:
        print(f"{strategy:>16}: refused -> {err}")

# %%
roles = [m["role"] for m in conv]
kept = {s: [i for i in range(len(conv)) if i not in f.dropped] for s, f in fits.items()}
kept["no limit"] = list(range(len(conv)))
ax = plots.plot_kept_messages(roles, kept)
plt.show()

# %% [markdown]
# ## 4. "The model doesn't know what it can't see", tested
#
# The first user message says the dog is called Biscuit. The last message asks for its name. We ask
# the real model three times: with the whole conversation, after **drop_oldest**, and after
# **truncate_middle**.

# %%
print("fact in the conversation:", CONVERSATION["fact"], "| question:", conv[-1]["content"])
answers = {"no limit": ask(conv)}
for strategy, fit in fits.items():
    answers[strategy] = ask(fit.messages)
for name, reply in answers.items():
    print(f"{name:>16}: {reply!r}  -> mentions the fact: {CONVERSATION['fact'].lower() in reply.lower()}, "
          f"says it does not know: {admits_not_knowing(reply)}")

# %% [markdown]
# Read the answers above. Where the turn with the fact survived, the model can use it (the first column says
# whether it did). Where it was dropped, the model has no way to know the name. The second column says whether
# the reply admits that, by a plain phrase search ("I don't know", "not sure", "you haven't told me", and a
# few more, listed in `context.NOT_KNOWING`). A model that answers anyway, with something generic or invented,
# shows the practical meaning of the claim: nothing outside the window exists for the model, and it may not
# tell you so.
#
# With no conversation at all, the question alone shows what the model falls back on:

# %%
print(repr(ask([conv[0], conv[-1]])))

# %% [markdown]
# ## 5. Documents in the context
#
# Retrieval-augmented generation pastes documents into the context before the question. They are
# tokens like any other, so they spend the same budget. Here are three short documents from `data/docs/`.

# %%
SHORT_DOCS = ["bike_shop_returns", "greenhouse_manual", "library_opening_hours"]  # lesson 13's long handbook stays out
docs = {name: Path(f"../data/docs/{name}.txt").read_text() for name in SHORT_DOCS}
system = {"role": "system", "content": "Answer from the documents. Be brief."}
for name, text in docs.items():
    print(f"{name:<24} {len(text.split()):>4} words  {len(tokenizer(text)['input_ids']):>4} tokens")
rag = [system, {"role": "user", "content": "\n\n".join(docs.values()) + "\n\nQuestion: When does the library close on Saturday?"}]
used = len(context_ids(tokenizer, rag))
print(f"with all three documents the prompt takes {used} tokens: {used / window:.1%} of the window, "
      f"{window - used} left for history and answer; {used / BUDGET:.1f}x our teaching budget of {BUDGET}")

# %% [markdown]
# Compare the last number with 1: above it, three short documents alone would not fit our teaching budget.
# Does the model use them? Compare
# its answer with the sentence of the document that holds the fact:

# %%
reply = ask(rag)
source = next(line for line in docs["library_opening_hours"].split(". ") if "Saturday" in line)
print("model:   ", repr(reply))
print("document:", repr(source))

# %% [markdown]
# Judge it yourself against the document. A model of this size tends to copy nearby phrases from the
# documents, and it can stitch the wrong ones together; answering reliably from retrieved text is a
# skill that grows with model size. The token cost, though, is the same for any model.

# %% [markdown]
# ## 6. What goes wrong without the template
#
# The template is not decoration: the model was fine-tuned on exactly this format. Four ways to get
# it wrong, each run on the real model beside the correct run:

# %%
question = "What is the capital of France?"
msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
runs = {"0. correct (template, generation prompt)": generate(model, tokenizer, context_ids(tokenizer, msgs), 40),
        "1. raw text, no template": generate(model, tokenizer, tokenizer(question)["input_ids"], 40),
        "2. no generation prompt": generate(model, tokenizer, context_ids(tokenizer, msgs, add_generation_prompt=False), 40)}
broken = render(tokenizer, msgs).replace(question + "<|im_end|>", question)
runs["3. missing end-of-turn token"] = generate(model, tokenizer, tokenizer(broken)["input_ids"], 40)
runs["4. end-of-turn not in the stop set"] = generate(model, tokenizer, context_ids(tokenizer, msgs), 40, stop_ids=())
for name, r in runs.items():
    print(f"{name:<42} stop: {r.stop_reason:<15} {len(r.token_ids):>2} tokens  {tokenizer.decode(r.token_ids)[:90]!r}")
ends = [i for i, t in enumerate(runs["4. end-of-turn not in the stop set"].token_ids) if t == tokenizer.eos_token_id]
print(f"case 4 wrote {tokenizer.eos_token!r} {len(ends)} time(s), first at new token {ends[0] if ends else '-'}, and "
      f"made {len(runs['4. end-of-turn not in the stop set'].token_ids)} tokens in all")

# %% [markdown]
# What the model does here is what this run shows (special tokens kept, so you can see them): with raw
# text, a chat-tuned model may end its turn at once or ramble; without the generation prompt it has to
# guess who speaks next, and may write the missing role header itself; a missing `<|im_end|>` can be
# forgiven by a tolerant model on a short question, but it blurs where the user's turn ends. Case 4 is the
# loop's side of the contract: the last line says whether the model wrote `<|im_end|>` and how many tokens came
# after it. Where it wrote one early and the count reached the limit of 40, the loop went on past the model's
# own answer, because nothing told it to stop: the stop set is part of the template's contract.

# %% [markdown]
# ## 7. Bad input gets a clear error
#
# `course_lib.text.context` checks messages before the template sees them:

# %%
for bad in [[], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 42}], "hello"]:
    try:
        validate_messages(bad)
    except (ValueError, TypeError) as err:
        print(f"{str(bad)[:40]:<42} -> {type(err).__name__}: {err}")
try:
    fit_to_budget(tokenizer, conv, budget=10)
except ContextOverflowError as err:
    print("budget 10 ->", err)

# %% [markdown]
# ---
# ## Summary
#
# - The model reads one token sequence: the chat template wraps every message in role markers and ends with a generation prompt.
# - The system prompt, the history, documents and the answer all share one context window.
# - When a conversation overflows, a strategy decides what the model loses; the system prompt is usually kept.
# - A fact that falls out of the window is gone: the model answers anyway, without it.
# - The template must be applied exactly; raw text or a missing generation prompt changes what the model does.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `count_context(messages)`: the number of tokens the model reads, generation prompt included.

# %%
from course_lib.exercises import lesson02 as ex

def count_context(messages):
    ...  # your code here
    raise NotImplementedError

ex.check_count_context(count_context, tokenizer)

# %% [markdown]
# **2.** With the system prompt `"Be brief."` and the user message `"Hi"`, how many tokens does the
# template add (everything except the tokens of the two texts), generation prompt included?
# Compute it with code, then put the number in `overhead`.

# %%
overhead = None  # your answer here
ex.check_overhead(overhead, tokenizer)

# %% [markdown]
# **3.** Write `keep_recent(messages, budget)`: return the system message, then the most recent **whole
# turns** that fit in `budget` tokens (a turn is a user message and the reply to it: what is kept must not
# open with a reply whose question was dropped), then the last message. The check tries the course's
# conversation and conversations it draws anew at each run.

# %%
def keep_recent(messages, budget):
    ...  # your code here
    raise NotImplementedError

ex.check_keep_recent(keep_recent, tokenizer)

# %% [markdown]
# **4.** The system prompt survives every strategy, so it can carry what the others drop. Write
# `rescue(messages, budget)`: like `keep_recent`, but the text of every dropped user message is written
# into the system prompt, after its own text (carrying more can crowd out another turn: make the two agree).
# The check grades exactly that, on conversations it draws. Then it asks the model three questions whose
# answer was in a first turn (the dog's name and two more), with the whole conversation, after
# `drop_oldest` at 200 tokens, and after your rescue, and prints whether each reply used the fact. That
# part is reported, not graded: whether a 135M model uses a fact it can see is what the table shows.

# %%
def rescue(messages, budget):
    ...  # your code here
    raise NotImplementedError

ex.check_rescue(rescue, model, tokenizer)

# %% [markdown]
# **5. Predict, then measure.** The next cell prints a short conversation and each message's text in tokens.
# Predict how many tokens the model reads for the whole conversation, generation prompt included, and write it
# in `prediction` before running the check (exercise 2's measurement helps).

# %%
for m, n in zip(ex.PREDICT_CHAT, ex.text_tokens(tokenizer)):
    print(f"{m['role']:<10} {n:>3} tokens  {m['content']!r}")
prediction = None  # your prediction: tokens the model reads
ex.check_context_prediction(prediction, tokenizer)

# %% [markdown]
# **Next:** 03 · the forward pass, where these tokens go through the model's layers.
