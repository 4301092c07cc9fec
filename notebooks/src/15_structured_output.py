# %% [markdown]
# # 15 · Structured output: a mask on the logits, so the answer is valid JSON every time
#
# **Goal.** Applications ask models for JSON far more often than for prose, and a small model left alone
# breaks the format. Servers fix it at the sampling step: before each pick, every token that would make
# the output impossible gets logit minus infinity. We build such a mask by hand, then use a real grammar
# engine for JSON Schema, on the same loop as every lesson.
#
# **You will**
# - ask the same extraction question free and constrained, and count how often each answer is valid;
# - see the mask: how many of the 49,152 tokens it allows at a few steps, and the probability it removed;
# - measure what the mask costs against a decode step.

# %% [markdown]
# ## Set-up
#
# The grammar engine is **llguidance** (a Rust library on PyPI, CPU only, offline; one of the engines behind
# the JSON modes of llama.cpp and vLLM). We measured three on this lesson's schema
# (`data/benchmarks/grammar-engines-cpu-2026-12-01.json`): all three compile it in about a third of a
# second and compute a mask in well under a millisecond (this lesson prints ours, unpacking included), far below
# a decode step; xgrammar adds about 1 GB to the
# environment (it requires triton), outlines-core 5 MB, llguidance 7 MB. We chose llguidance for its small
# install and its JSON Schema coverage: it enforced every schema of the tests (string lengths, patterns,
# number bounds, enums, nested objects, arrays); the other two were not run on those.

# %%
import json
import jsonschema
import torch
from IPython.display import HTML, display
import course_lib
from course_lib.text.context import chat_ids
from course_lib.engine.generation import generate
from course_lib.runtime import progress
from course_lib.engine.structured import (ChoiceMask, PatternMask, SchemaMask, MaskLog, masked_pick, generate_json,
                                          token_texts, RECEIPT_SCHEMA, receipts, receipt_request, SchemaError)

model, tokenizer = course_lib.load_model()
texts = token_texts(tokenizer)  # the decoded text of every token, computed once
END = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the end-of-turn token: allowed once an answer is complete
print("vocabulary:", len(texts), "tokens | the receipts:", len(receipts()))
print(json.dumps(RECEIPT_SCHEMA))

# %% [markdown]
# ## 1. Free: does the small model write valid JSON?
#
# Each receipt is asked with the same request; we check whether the answer parses, and whether it follows
# the schema (a name, a YYYY-MM-DD date, a non-negative number), with the `jsonschema` validator. To be
# generous to the free answers we judge the part from the first "{" to the last "}" (any prose around it
# is cut off), and say when that was needed.

# %%
def verdict(text):
    inner = text[text.find("{"):text.rfind("}") + 1] if "{" in text else text
    try:
        jsonschema.validate(json.loads(inner), RECEIPT_SCHEMA)
        return "valid" if inner == text else "valid once trimmed"
    except json.JSONDecodeError:
        return "does not parse"
    except jsonschema.ValidationError as err:
        return f"parses, breaks the schema ({err.message[:40]})"

free = {r["text"]: generate(model, tokenizer, chat_ids(tokenizer, receipt_request(r["text"])[0]["content"]), 80).text
        for r in progress(receipts(), "receipts")}
for text, answer in free.items():
    print(f"{verdict(answer):<52} {answer[:70]!r}")

# %% [markdown]
# ## 2. A mask by hand
#
# For a tiny language we can compute the mask ourselves: a token is allowed if the text so far plus the
# token's text is still a valid prefix; the end-of-turn token only where the language may end. The course's
# masks compare bytes, not decoded text: a token may carry part of a character (a CJK character or an emoji
# often comes as several tokens), and its text alone is then U+FFFD, which no answer starts with. Yes or no:

# %%
log = MaskLog()
q = chat_ids(tokenizer, "Is Paris the capital of France? Answer yes or no.")
out = generate(model, tokenizer, q, 5, pick=masked_pick(ChoiceMask(tokenizer, END, ["yes", "no"]), log=log))
print(repr(out.text), "| allowed tokens per step:", log.allowed, "| probability removed:", [round(m, 3) for m in log.removed_mass])
log = MaskLog()
q = chat_ids(tokenizer, "When did the Berlin Wall fall? Answer as YYYY-MM-DD.")
out = generate(model, tokenizer, q, 12, pick=masked_pick(PatternMask(tokenizer, END, "9999-99-99"), log=log))
print(repr(out.text), "| allowed tokens per step:", log.allowed)

# %% [markdown]
# The mask makes the *form* certain, not the *facts*: the date above has the right shape, and whether it
# is right is the model's business (compare it with what you know).
#
# ## 3. JSON Schema, with the grammar engine

# %%
constrained = {r["text"]: generate_json(model, tokenizer, receipt_request(r["text"]), RECEIPT_SCHEMA, 96) for r in receipts()}
for r in receipts():
    c = constrained[r["text"]]
    right = c.complete and (c.value["name"], c.value["date"], c.value["amount"]) == (r["name"], r["date"], r["amount"])
    print(f"{verdict(c.text):<8} {'all three right' if right else 'not all right':<15} {c.text[:80]}")
n_free = sum(verdict(a).startswith("valid") for a in free.values())
n_con = sum(verdict(c.text) == "valid" for c in constrained.values())
print(f"valid: free {n_free} of {len(free)}, constrained {n_con} of {len(constrained)}")

# %% [markdown]
# Every constrained answer parses and validates; whether its values match the receipt is a separate count
# (the model's reading of the text), and the printed lines show what it got right. Look at the dates in
# particular: the schema's pattern makes the year come first, so a receipt that says "3 March" can lead the
# model to write a "3" where the year begins, and the mask then only asks for three more digits. The form is
# enforced; the facts are the model's.
#
# ## 4. The mask made visible
#
# At a few steps of the first receipt's constrained answer: how many tokens the mask allowed, and how much
# probability the model had put on tokens the mask forbade.

# %%
c = constrained[receipts()[0]["text"]]
for step in [0, 1, 2, 5, 10, len(c.mask.allowed) - 1]:
    print(f"step {step:>2}: {c.mask.allowed[step]:>6,} of {len(texts):,} tokens allowed, "
          f"{c.mask.removed_mass[step]:.1%} of the model's probability removed")

# %% [markdown]
# ## 5. What it costs
#
# Milliseconds per token of the engine's mask and of the hand-written one (a Python loop over 49,152
# strings), against a decode step of the model itself. "Engine mask" is what the course's `masked_pick` spends
# per token around llguidance: the engine's own call plus unpacking its bit mask into a tensor and applying it
# (the committed engine comparison, `data/benchmarks/grammar-engines-cpu-2026-12-01.json`, times the engine's
# call alone, which is a small part of it):

# %%
median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
engine_ms = 1000 * median([s for c in constrained.values() for s in c.mask.seconds[1:]])  # the first compiles
hand_ms = 1000 * median(log.seconds)
decode_ms = 1000 * median(generate(model, tokenizer, chat_ids(tokenizer, "Hi"), 24).inter_token_seconds)
print(f"engine mask {engine_ms:.2f} ms | hand mask {hand_ms:.1f} ms | decode step {decode_ms:.1f} ms")

# %% [markdown]
# ## 6. Bad schemas, and the small-model traps
#
# A schema the engine cannot compile is refused before any token is generated. And two traps: runs of
# whitespace (the masks here allow none: compact JSON) and a string that never ends. A token limit reached
# inside the value is reported as incomplete, never returned as if it were JSON:

# %%
try:
    SchemaMask(tokenizer, {"type": "nope"})
except SchemaError as err:
    print("refused:", err)
short = generate_json(model, tokenizer, receipt_request(receipts()[0]["text"]), RECEIPT_SCHEMA, 6)
print("6 tokens:", repr(short.text), "| complete:", short.complete, "| value:", short.value, "| stop:", short.stop_reason)

# %% [markdown]
# That is why the course's schemas give every string a `maxLength` (and numbers bounds: exercise 3). The
# API's plain JSON mode, `response_format={"type": "json_object"}`, has no schema to carry such bounds: the
# course's server turns it into `{"type": "object"}`, any object, so a string in it may run to the token limit,
# and the answer comes back marked incomplete (`finish_reason` "length"). Bounds need `json_schema`.
#
# ## 7. Through the API, as an application asks
#
# Applications do not call `generate_json`: they send `response_format` to an OpenAI-compatible server.
# Lesson 10's server takes it and runs the same mask; here with the official `openai` client, on loopback:

# %%
import openai
from course_lib.serve.room import lesson_server

server = lesson_server(model, tokenizer, max_tokens_cap=96)  # the room's, if COURSE_SERVER_URL is set
client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "local", timeout=120, max_retries=0)
first = receipts()[0]
reply = client.chat.completions.create(
    model="smollm2-135m-instruct", messages=receipt_request(first["text"]), temperature=0, max_tokens=96,
    response_format={"type": "json_schema", "json_schema": {"name": "receipt", "schema": RECEIPT_SCHEMA}})
answer = reply.choices[0].message.content
print(answer, "|", verdict(answer), "| finish:", reply.choices[0].finish_reason)
server.stop()

# %% [markdown]
# The same request without `response_format` is section 1's free answer. A server that cannot compile the
# schema answers 400 before generating anything (section 6's refusal, in the API's error shape).
#
# **What this lesson does not build.** The hand masks of section 2 test every token of the vocabulary at every
# step. Grammar engines avoid that: they keep the vocabulary in a *trie* (tokens sharing a prefix are tested
# together, and a failing prefix rules out every token below it), follow the grammar with a *pushdown*
# automaton (a stack for nested objects and arrays, where a fixed pattern has none), and precompute what they
# can per grammar state (XGrammar splits tokens into those decided by the state alone and those that need the
# stack). Where the grammar leaves only one way on (a key's name, a closing quote and colon), they can *jump
# forward*: append those tokens without asking the model, several per step. llguidance, used here, walks a
# token trie with an Earley parser (a more general cousin of the pushdown automaton); `generate_json` still
# asks the model for every token, so nothing here jumps forward.
#
# ## Summary
#
# - A grammar mask sets the logit of every token that would break the format to minus infinity; the
#   picker (greedy or sampling) then chooses among the rest, so the output is valid by construction.
# - By hand it is a prefix test over every token's text; for JSON Schema a grammar engine does it in a
#   fraction of a decode step (section 5's measurement).
# - The mask fixes the form, not the content: values can still be wrong, and a string can run to the token
#   limit unless the schema bounds it.
#
# ---
# ## Exercises
#
# **1.** Write `yes_no_allowed(text_so_far)`: the list of token IDs allowed next for the language {"yes", "no"}
# (the end-of-turn token `END`, only when the text is complete). Use `texts`.

# %%
from course_lib.exercises import lesson15 as ex

def yes_no_allowed(text_so_far):
    ...  # your code here
    raise NotImplementedError

ex.check_yes_no(yes_no_allowed, tokenizer)

# %% [markdown]
# **2.** After `{"age":` under the schema {"type": "object", "properties": {"age": {"type": "integer"}}},
# which of these may come next: `" 4"`, `"4"`, `"-"`, `"\"4\""`, `"}"`? Return the list of those allowed.
# Remember section 6: the course's masks allow compact JSON only, no whitespace between tokens of the grammar
# (JSON itself would allow it; an engine may be configured either way).

# %%
def allowed_after_age():
    ...  # your answer here
    raise NotImplementedError

ex.check_after_age(allowed_after_age, tokenizer)

# %% [markdown]
# **3.** Write a schema for `{"city": <string of at most 20 characters>, "population": <integer from 0 to
# 100,000,000>}` with no other keys; the check asks the model for Paris with it and validates the answer.
# Then it sends the same request with your schema less its maximum and prints what the model wrote: an
# unbounded number can be a trap too.

# %%
def city_schema():
    ...  # your schema here
    raise NotImplementedError

ex.check_city_schema(city_schema, model, tokenizer)

# %% [markdown]
# **4. Predict, then measure.** Under the receipt schema, after the answer so far is `{"name":"`, how many of
# the vocabulary's 49,152 tokens does the mask allow? Write your number in `prediction`; the check feeds that
# prefix to the grammar engine and counts.

# %%
prediction = None  # your prediction: tokens allowed inside the name's string
ex.check_inside_string_prediction(prediction, tokenizer, RECEIPT_SCHEMA)

# %% [markdown]
# **End of Part II.** From lesson 11's model written out to here, each part of the engine was measured
# against the plain path, and each one meant to keep the answer (paged memory, drafters) was shown to
# keep it token for token; the formats (12) and the grammar masks (15) change it, by a measured amount
# or on purpose.
