# %% [markdown]
# # 13 · A server's memory: a paged KV cache, prefix caching and preemption
#
# **Goal.** Lessons 07 and 09 counted KV-cache tokens against a budget and simulated what a full server
# does. This lesson builds what production servers actually do about it, on the real model: the cache
# becomes a pool of fixed-size blocks, each conversation gets a table of the blocks it uses, prompts
# that start alike share blocks, and a full pool pauses a request instead of failing it. Every request
# still gets exactly the tokens it would get alone.
#
# **You will**
# - measure the memory a contiguous cache reserves against what a paged one holds, on one trace;
# - read a block table, and see a long document's blocks shared by several questions;
# - time the first token with and without a prefix hit, and run a full pool under three policies;
# - watch a long prompt stall the running requests, then read it in chunks within a token budget, and
#   replay a small mixed load against the server both ways;
# - serve several answers to one prompt by forking its blocks (copy-on-write), and see what a vote over
#   the answers buys on sums a program can check.

# %% [markdown]
# ## Set-up
#
# The course's own model (lesson 11) on the library's weights. The paged cache lives in
# `course_lib/runner/blocks.py` (the block manager) and `course_lib/runner/paged.py` (the pool and the paged
# cache), the scheduler in `course_lib/engine/paged_scheduler.py` (`PagedScheduler`), the lesson's experiments in `course_lib/measure/trace.py` and the load generator in
# `course_lib/measure/load.py`: read them beside this notebook.

# %%
import time
import matplotlib.pyplot as plt
import torch
import course_lib
from IPython.display import display
from course_lib.runner import paged
from course_lib.views import plots, plots_perf, widgets
from course_lib.runtime import progress
from course_lib.measure import serving_peers, trace as paged_runs
from course_lib.engine.request import end_of_turn_ids, Job
from course_lib.engine.paged_scheduler import PagedScheduler
from course_lib.engine.generation import run_paged, step
from course_lib.text.context import HANDBOOK_QUESTIONS, chat_ids, handbook_ids, handbook_messages
from course_lib.engine.stages import decode_step, prefill
from course_lib.runner.kv_cache import model_kv_bytes_per_token
from course_lib.runner.model import Model

model, tokenizer = course_lib.load_model()
ours = Model.from_transformers(model)
stop = frozenset(end_of_turn_ids(model, tokenizer))
print("threads:", torch.get_num_threads(), "| KV bytes per token (float32):",
      f"{model_kv_bytes_per_token(ours.config, ours.dtype):,.0f}", "| block size:", paged.BLOCK_SIZE, "tokens")

# %% [markdown]
# ## 1. Why pages: what a contiguous cache reserves
#
# Lesson 11's cache is one tensor per layer sized for the whole request: the prompt plus every token
# the request is allowed to generate, reserved at admission. A server does not know how long an
# answer will be, so it reserves the maximum. A paged cache instead hands out blocks of 16 tokens as
# the sequence grows, and a block that holds a shared prefix is stored once.
#
# The trace: questions about a long handbook (a document of over a thousand tokens given as the
# system prompt: its length is printed below) mixed with short chat questions, arriving two decode steps apart, each allowed the same number
# of new tokens.

# %%
jobs, arrivals = paged_runs.trace_jobs(ours, tokenizer, new_tokens=64)
roomy = paged_runs.run_trace(ours, jobs, arrivals, num_blocks=160)
for j in roomy.jobs:
    print(f"{j.name:<11} prompt {len(j.prompt):>5} tokens -> {len(j.tokens):>3} of {j.new_tokens} new ({j.finish_reason})")
contiguous, paged_peak = max(roomy.contiguous_bytes), max(roomy.paged_bytes)
print(f"peak: contiguous {contiguous / 1e6:.0f} MB, paged {paged_peak / 1e6:.0f} MB "
      f"({paged_peak / contiguous:.2f} of it) | prompt tokens found in the prefix cache: {roomy.pool.hit_rate:.0%}")

# %%
plots_perf.plot_paged_memory(roomy.contiguous_bytes, roomy.paged_bytes)
plt.show()

# %% [markdown]
# Two things shrink the paged line. Blocks are handed out as tokens arrive, so a request that stops
# early never holds its unused allowance; and the handbook's blocks are held once for all the questions
# that start with it. Even the short questions share a little: the chat template adds the same default
# system prompt to each (lesson 02), and its full blocks are found in the cache.
#
# The price is at most one partly filled block per sequence (fewer than 16 slots each) and an indirection:
# at each decode step, attention reads a sequence's keys and values block by block through its table
# (lesson 16 writes that attention and measures it against copying the blocks out first).
#
# A paged server does not use less memory than it owns: it allocates its whole pool at start (vLLM takes a
# share of the GPU's memory the same way). What paging buys is **requests per gigabyte** of that pool: how
# many can run at once in the same bytes. For this trace, with each request held to its last token:

# %%
kv_token = model_kv_bytes_per_token(ours.config, ours.dtype)
reserved = sum((len(j.prompt) + j.new_tokens) * kv_token for j in roomy.jobs)  # contiguous: prompt + allowance each
held = paged.footprint([j.prompt + j.tokens for j in roomy.jobs])["blocks"] * roomy.pool.block_bytes  # shared once
n = len(roomy.jobs)
print(f"{n} requests at once: contiguous reservations {reserved / 1e6:.0f} MB, paged blocks {held / 1e6:.0f} MB "
      f"-> {n / (reserved / 1e9):.0f} against {n / (held / 1e9):.0f} requests per GB of cache "
      f"({reserved / held:.1f}x as many in the same memory)")

# %% [markdown]
# **Try it: the block size.** The trace's final sequences (each prompt with its answer), all held at once,
# for block sizes from 1 to 256 tokens: computed once with the real block manager (`paged.footprint`);
# the slider only picks a row. The figure below is the same table for a page without widgets.

# %%
final = [j.prompt + j.tokens for j in roomy.jobs]
rows = [paged.footprint(final, size) for size in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
per_token = model_kv_bytes_per_token(ours.config, ours.dtype)
display(widgets.block_size_explorer(rows, per_token))
plots_perf.plot_block_sizes(rows, per_token)
plt.show()
least = min(rows, key=lambda r: r["slots"])
print(f"least memory with blocks of {least['block_size']} token(s); blocks of 16 need "
      f"{next(r for r in rows if r['block_size'] == 16)['table_entries']:,} table entries, blocks of 1 "
      f"{rows[0]['table_entries']:,}")

# %% [markdown]
# Small blocks leave almost no slot empty and share every common token, but the tables grow long: one
# entry per block, and decode attention follows every entry (lesson 16 times the step at several block
# sizes). Large blocks keep tables short, but each
# sequence's last block stands partly empty and only whole blocks are shared, so part of a common prefix
# is stored once per sequence. Servers settle in between (vLLM's default is 16 tokens).

# %% [markdown]
# ## 2. A block table
#
# Let four requests run a few steps and look inside: each row is a sequence, each cell a logical block,
# the number in it the physical block of the pool. Blue cells are held by more than one sequence.

# %%
pool = paged.BlockPool.for_model(ours, num_blocks=100)
batch = PagedScheduler(ours, pool)
names = ["handbook-1", "handbook-2", "handbook-3", "short-1"]
batch.add([Job(n, j.prompt, 8, stop) for n in names for j in jobs if j.name == n])
for _ in range(4):
    step(batch)
tables = {n: list(batch.seqs[n].blocks) for n in names}
plots_perf.plot_block_tables(tables, pool.manager.ref)
plt.show()
print("blocks in use:", pool.manager.num_used, "| held by two or more sequences:",
      sum(1 for r in pool.manager.ref if r > 1), "| a table's length:", {n: len(t) for n, t in tables.items()})
step_times = []
for _ in range(3):  # three more decode steps for the four; the median
    start = time.perf_counter()
    step(batch)
    step_times.append(time.perf_counter() - start)
step_s = sorted(step_times)[1]
gather_s = paged_runs.gather_seconds(pool, [batch.seqs[n] for n in names])
print(f"one decode step for the four: {step_s * 1000:.0f} ms (median of 3); copying their pages into one tensor per "
      f"layer, as a paged cache without a paged kernel must, would add about {gather_s * 1000:.0f} ms (section 7)")

# %% [markdown]
# **What the model is handed.** The model never sees blocks: it is given a view of several sequences as one
# batch (`pool.view(seqs)`), and in each step it asks the view where the new tokens' keys go and which slots
# each row reads. Two made-up sequences of 20 and 40 tokens, as if already prefilled, in a small pool of their
# own:

# %%
demo = paged.BlockPool.for_model(ours, num_blocks=8)
short, longer = paged.Sequence(list(range(100, 120))), paged.Sequence(list(range(200, 240)))
for seq in (short, longer):
    demo.admit(seq)
    demo.grow(seq, len(seq.tokens) + 1)  # blocks for what it holds and the token it is about to feed
    demo.commit(seq, len(seq.tokens) - seq.computed)  # as if prefilled
write, read = demo.view([short, longer]).slots(1)  # one new token each
print("block tables:", short.blocks, longer.blocks)
print("where each row's new token goes (pool slots):", write.tolist())
print("read matrix (rows, columns):", tuple(read.shape), "| the short row's first columns:", read[0, :4].tolist(),
      "... its padding repeats its first slot and is masked out; its last columns:", read[0, -3:].tolist())

# %% [markdown]
# Inside the model, each step follows one protocol with whatever cache it is given (lesson 11's `KVCache` or
# this view; `kv_cache.Cache` writes it down): `cache.reserve(end)` once (the view finds blocks for the new
# tokens), `cache.write(layer, keys, values, start)` in every layer (the view stores them at the write slots and
# returns what attention reads; at decode, `attend` reads the blocks in place instead, lesson 16), then
# `cache.length = end`, which commits the tokens and names the blocks they filled. `slots()` builds its lists in Python, token by
# token, at every step: simple to read, and a cost that grows with the context (production engines keep the
# tables as tensors on the device and compute slots there).
#
# **Two answers to one prompt.** Asking for several answers at once (OpenAI's `n`, or beam search) needs no
# second copy of the prompt: `pool.fork(seq)` gives a new sequence the same block table, each block shared by
# reference count. The first time a branch writes into a block the other still holds (their last, partly
# filled one), that block is copied (copy-on-write). One handbook prompt, two branches started from its two
# likeliest first tokens, four steps:

# %%
forks = paged.BlockPool.for_model(ours, num_blocks=100)
first_branch = paged.Sequence(handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0]))
forks.admit(first_branch)
forks.grow(first_branch, len(first_branch.tokens))
logits, _ = prefill(ours, first_branch.tokens, cache=forks.view([first_branch]))
after_prompt = forks.manager.num_used
second_branch = forks.fork(first_branch)
top2 = logits[0].topk(2).indices.tolist()  # the two likeliest first tokens: one per branch
branches = [(first_branch, [top2[0]]), (second_branch, [top2[1]])]  # (sequence, its answer so far)
for _ in range(4):
    for seq, answer in branches:
        forks.grow(seq, seq.computed + 1)
    view = forks.view([seq for seq, _ in branches])
    step_logits, _ = decode_step(ours, [answer[-1] for _, answer in branches], view,
                                 attention_mask=view.attention_mask(1), positions=view.positions())
    for row, (_, answer) in enumerate(branches):
        answer.append(int(step_logits[row].argmax()))
print("the branches:", [tokenizer.decode(answer) for _, answer in branches])
print(f"blocks: {after_prompt} for the prompt; {forks.manager.num_used} in use with both branches "
      f"({forks.copied} copied on write); a second copy of the prompt would have taken {after_prompt} more")

# %% [markdown]
# A block is named by a hash of its tokens chained with its parent's name (`paged.block_hash`), so a
# name stands for the whole prefix up to the block's end, not for the 16 tokens alone: the same 16 tokens
# after a different beginning are a different block (their keys depend on everything before them).
# A newcomer looks its names up from the first block on and stops at the first miss.

# %%
first, second = handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0]), handbook_ids(tokenizer, HANDBOOK_QUESTIONS[1])
a, b = paged.prefix_hashes(first), paged.prefix_hashes(second)
same = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
print(f"{len(a)} full blocks each; the first {same} have the same names: {same * 16} tokens in common "
      f"(the prompts differ from token {next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)})")
short = [paged.prefix_hashes(chat_ids(tokenizer, q))[0] for q in ("Name three colours.", "Why is the sky blue?")]
print("two short questions share their first block (the template's default system prompt):", short[0] == short[1])
for job in list(batch.running):
    job.cancelled = True
step(batch)  # cancelled: their blocks go back to the pool
print("after they leave: blocks in use", pool.manager.num_used, "| still cached for the next prompt:",
      len(pool.manager.by_hash))

# %% [markdown]
# ## 3. Prefix caching: the time to first token
#
# Handbook questions asked one after another, once with prefix caching and once without (every prompt
# prefilled in full). With it, the second question on finds the handbook's blocks and prefills
# only its own few tokens (at least the last one: its logits pick the first answer token).

# %%
paged_runs.prefix_ttft(ours, tokenizer, HANDBOOK_QUESTIONS[:1])  # warm-up: the first prefill of a run pays extra
hit = paged_runs.prefix_ttft(ours, tokenizer, HANDBOOK_QUESTIONS[:3])
miss = paged_runs.prefix_ttft(ours, tokenizer, HANDBOOK_QUESTIONS[:3], prefix_caching=False)
for h, m in zip(hit, miss):
    print(f"{h['question']:<52} {h['prompt_tokens']} tokens: {m['ttft_s']:.3f} s in full, "
          f"{h['ttft_s']:.3f} s with {h['reused_tokens']} from the cache")
ratio = sorted(m["ttft_s"] for m in miss)[len(miss) // 2] / sorted(h["ttft_s"] for h in hit[1:])[len(hit[1:]) // 2]
print(f"median first token {ratio:.1f}x sooner with a prefix hit | same first token both ways:",
      [h["token"] for h in hit] == [m["token"] for m in miss])
reused = sum(h["reused_tokens"] for h in hit)
print(f"prefix hit rate over the {len(hit)} questions: {reused / sum(h['prompt_tokens'] for h in hit):.2f} "
      f"({reused // paged.BLOCK_SIZE} blocks found in the cache, none of them computed again)")

# %%
plots.plot_step_times([f"q{i + 1} {'hit' if h['reused_tokens'] else 'miss'}" for i, h in enumerate(hit)] +
                      [f"q{i + 1} no cache" for i in range(len(miss))],
                      [h["ttft_s"] for h in hit] + [m["ttft_s"] for m in miss],
                      title="Time to first token, with and without prefix caching")
plt.show()

# %% [markdown]
# Read the first bar against the fourth: q1's miss and q1 without the cache do the same work (the miss also
# hashes its blocks into the index, which takes microseconds), so their difference is this run's noise. Without
# the warm-up call above, q1's miss came out clearly the slower in the course's own runs, and not when the
# pair was repeated at once: the first prefill of a run pays for memory and kernels touched for the first time.
#
# **What a shared cache tells strangers.** The same gap is a side channel: on a server shared by many users,
# anyone who times a request whose prompt starts like someone else's can tell whether that prefix was sent
# before (a hit answers many times sooner, as above). Engines let a request carry a **cache salt** (vLLM's
# `cache_salt`; here `Job(..., cache_salt=...)`, and the `cache_salt` field of lesson 10's server): the salt
# starts the chain of block names, so requests share blocks only with the same salt. Three handbook questions,
# the first and third from one user:

# %%
salted = paged.BlockPool.for_model(ours, num_blocks=200)
for i, user in enumerate(["alice", "bob", "alice"]):
    before = salted.hits
    run_paged(ours, [Job(f"{user}-{i}", handbook_ids(tokenizer, HANDBOOK_QUESTIONS[i]), 1, stop, cache_salt=user)],
              salted)
    print(f"{user:<6} question {i + 1}: {salted.hits - before:>5} prompt tokens found in the cache")

# %% [markdown]
# Bob's question finds nothing of Alice's, though the handbook is the same; Alice's second question finds her
# own. The price is memory and time: each salt keeps its own copy of the document.
#
# The model's answers to these questions are another matter: a 135M-parameter model reads the handbook
# and can answer wrongly (section 5's server cell prints its answers: read them against the handbook). Prefix caching changes how
# fast the first token comes, never which token it is.

# %% [markdown]
# ## 4. A full pool: wait, preempt, or turn away
#
# Now the same trace on a pool smaller than its peak (but big enough for its longest request alone).
# Three policies, all in `PagedScheduler`:
#
# - **reserve** (reserve-and-wait, what a server without preemption does): admit a request only once blocks
#   for its prompt and its whole allowance can be reserved; until then it waits in the queue. No running
#   request ever runs short, and nothing is recomputed; the cost is waiting, with reserved blocks idle.
# - **preempt** (what vLLM does): admit when the prompt fits; when a running request needs a block and
#   none is free, pause the most recently admitted one, free its blocks, and recompute it later (its
#   prompt and the tokens it has so far, minus whatever the prefix cache still holds).
# - **reject**: reserve like the first, but turn away what does not fit at once (lesson 07's simulation
#   called it "reject"; no real server does this to a request it could serve a little later; it is here
#   as the floor).

# %%
budget = paged_runs.budget_blocks(roomy)
runs = {p: paged_runs.run_trace(ours, jobs, arrivals, budget, p) for p in progress(("reserve", "preempt", "reject"), "policies")}
print(f"{'policy':<8}{'finished':>9}{'preempted':>10}{'recomputed':>11}{'tokens/s':>9}{'all done':>9}"
      f"{'first token (mean, max)':>25}{'arrival to end (mean)':>23}")
for p, r in runs.items():
    w = r.waits()
    first = [x["first_token"] for x in w.values()]
    print(f"{p:<8}{r.finished:>6}/{len(jobs)}{r.batch.preempted:>10}{r.batch.recomputed_tokens:>11}{r.tokens_per_s:>9.1f}"
          f"{r.seconds:>8.1f}s{sum(first) / len(first):>14.2f}s, {max(first):5.2f}s"
          f"{sum(x['end'] for x in w.values()) / len(w):>22.2f}s")
same = all(j.tokens == k.tokens for p in ("reserve", "preempt") for j, k in zip(runs[p].jobs, roomy.jobs))
print("every request of reserve and preempt gives the same tokens as on the roomy pool:", same)
quicker = min(("reserve", "preempt"), key=lambda p: runs[p].seconds)
print(f"at equal completion ({runs['reserve'].finished} and {runs['preempt'].finished} of {len(jobs)}), "
      f"the trace was done sooner with {quicker} in this run "
      f"({runs['reserve'].seconds:.1f} s reserve, {runs['preempt'].seconds:.1f} s preempt)")

# %%
plots_perf.plot_paged_runs({p: r.timeline() for p, r in runs.items()}, budget, [j.name for j in jobs])
plt.show()

# %% [markdown]
# Read the rows and the pale bars (time spent waiting in the queue). Reserve and preempt finish every request,
# so compare them on time: reserve-and-wait holds blocks for allowances that are not yet used, so fewer
# requests run at once and the later ones wait; preempt runs more at once and pays instead with the
# recomputed tokens and the paused requests' later finish. Which comes out ahead depends on how much of their
# allowance requests really use (section 1 printed it: here most used all of it, so the reservations were not
# wasted, and the paged cache's saving came mostly from the shared handbook) and on what recomputation costs
# against waiting; the verdict line above says which was sooner in this run. Reject is quick only because it
# serves fewer requests. Lesson 07's simulation counted tokens; here the blocks, the waits, the pauses and
# the recomputation are real.

# %% [markdown]
# ## 5. Same tokens, and the server on it
#
# Every optimization in Part II is meant to keep the answer. The paged runs above give each request the
# tokens it gets alone on lesson 11's contiguous cache (`generation.generate`): checked here for one handbook
# question and one short question (the test suite checks them all, the library's `generate` included). In
# exact arithmetic that is guaranteed; in float32 the two paths add in different orders (a batched, padded
# decode step against a single row; a recompute after preemption is a prefill where the original was decode
# steps), so a near-tie between the two best tokens could flip. It did not on these prompts, in float32 on
# this CPU (lesson 09 showed the size of such differences); production engines that must guarantee it use
# batch-invariant kernels.

# %%
check = [j for j in roomy.jobs if j.name in ("handbook-2", "short-1")]
alone = paged_runs.alone_tokens(ours, tokenizer, check)
print({j.name: j.tokens == alone[j.name] for j in check})

# %% [markdown]
# Lesson 10's server runs on this cache with one option: `kv_cache="paged"`. Given our model it serves
# from it as it is (given the library's, it builds ours on the same weights). Its `/health` route then
# reports the pool: blocks in use and the prefix hit rate.

# %%
import httpx
from course_lib.serve.room import lesson_server
from course_lib.serve.serving import free_port, start_server

server = lesson_server(ours, tokenizer, kv_cache="paged", kv_blocks=160, max_tokens_cap=24)  # the room's, if set
for q in HANDBOOK_QUESTIONS[:2]:  # the messages a client sends: the handbook as the system prompt, then the question
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, headers=server.headers,
                       json={"messages": handbook_messages(q), "temperature": 0}).json()
    print(q, "->", reply["choices"][0]["message"]["content"])
print("health:", httpx.get(server.url + "/health").json())
server.stop()

# %% [markdown]
# ## 6. A long prompt arrives: chunked prefill
#
# Until now the scheduler read each new prompt whole, inside one step. While it does, every running
# request waits: no token for anyone until the newcomer's whole prompt has been through the model. Engines
# avoid that with a **token budget** per step: each running request decodes one token, and what is left of
# the budget goes to prompts, in chunks (vLLM turns this on by default). A chunk is prefill on a cache that
# already holds the start of the prompt, so the logits are those of one whole prefill, up to float rounding
# (tests/test_chunked_prefill.py checks it within 1e-4 for chunks of 1, 7, 16 and 33 tokens).
#
# Below, one request is writing a story when the handbook question (its prompt's length is printed in
# section 1) arrives. We measure the longest gap between the story's tokens, and the tokens per second over
# the whole run, for several budgets (`None`: the whole prompt in one step, as before).

# %%
from course_lib.measure.load import decode_gaps, replay, summarize, TraceRequest

story = chat_ids(tokenizer, "Write a short story about a robot who learns to paint.")
document = handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])
budgets = [None, 512, 256, 128, 64]
gap_runs = {b: decode_gaps(ours, story, document, b) for b in budgets}
for b, r in gap_runs.items():
    print(f"budget {str(b):>5}: longest gap {r['max_gap_s']:.2f} s, median gap {r['median_gap_s']:.3f} s, "
          f"{r['tokens_per_s']:.1f} tokens/s")
print("same tokens for every budget:", all(r["tokens"] == gap_runs[None]["tokens"] for r in gap_runs.values()))

# %%
labels = ["whole" if b is None else str(b) for b in budgets]
plots_perf.plot_chunked_prefill(labels, [gap_runs[b]["max_gap_s"] for b in budgets],
                                [gap_runs[b]["tokens_per_s"] for b in budgets])
plt.show()

# %% [markdown]
# Read the bars from left to right. With the whole prompt in one step, the story's longest wait is the
# whole prompt's prefill. A budget caps that wait near one chunk's prefill plus a decode step, so it
# shrinks with the budget. The dots say what that costs in tokens per second: each chunk is one more call
# through the model, and it re-reads the keys and values of the chunks before it (this cache gathers them
# into a copy each call), so the smallest budgets lose some throughput; compare the printed figures, which
# also move a little from run to run on a busy machine. The budget to pick is the largest one whose
# longest wait you can accept; the numbers above are this machine's, in this run.
#
# The same comparison through the server, over HTTP on loopback: three chats start streaming, one second
# later the handbook question arrives, and two more chats follow. Replayed against the paged server with
# whole prefill, then with a budget of 128 tokens and prefix caching. Greedy, so both must give the same
# answers.

# %%

chat = lambda i, at, q: TraceRequest(f"chat-{i}", "chat", at, [{"role": "user", "content": q}], 32)  # noqa: E731
trace = [chat(0, 0.0, "Name three colours."), chat(1, 0.2, "Why is the sky blue?"),
         chat(2, 0.4, "Write a haiku about rain."),
         TraceRequest("document", "long_document", 1.0, handbook_messages(HANDBOOK_QUESTIONS[1]), 32),
         chat(3, 1.5, "What do bees make?"), chat(4, 2.0, "Say hello in Spanish.")]
print("trace:", [(r.name, r.at) for r in trace])
served = {}
for name, options in {"whole prefill": {"prefix_caching": False},
                      "chunked + prefix": {"token_budget": 128}}.items():
    server = start_server(ours, tokenizer, free_port(), kv_cache="paged", max_tokens_cap=32, **options)
    outcomes, wall = replay(server.url, trace)
    server.stop()
    served[name] = (outcomes, summarize(outcomes, wall, ttft_target_s=10, gap_target_s=1))

# %%
for name, (outcomes, s) in served.items():
    print(f"{name:<17} first token p50 {s['ttft_p50_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s | between tokens "
          f"p50 {s['itl_p50_s']:.3f} s p99 {s['itl_p99_s']:.3f} s | {s['tokens_per_s']:.1f} tok/s | "
          f"{s['finished']} of {s['requests']} answered")
texts = [[o.text for o in outcomes] for outcomes, _ in served.values()]
print("same answers both ways:", texts[0] == texts[1])

# %% [markdown]
# Six requests are a small sample: p99 here is close to the worst gap, and a different arrival order
# (the document first, while nothing else runs) would stall nobody. The bench's `serving_load`
# section replays longer traces at several rates, on the contiguous cache too, and reports goodput
# (requests that met a latency target per second): `python -m course_lib bench --only serving_load`.
# The runs the course committed are in `data/benchmarks/` (each names its machine and date); the newest:

# %%
import json
from pathlib import Path

committed = sorted(Path("../data/benchmarks").glob("bench-*serving_load*.json"))
if committed:
    load = json.loads(committed[-1].read_text())
    sl = load["serving_load"]
    print(committed[-1].name, "|", load["machine"]["device"], load["threads"], "threads |", sl["requests_per_rate"],
          "requests per rate")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    plots_perf.plot_serving_load(sl["rates"], sl["itl_p99_s"], ax=axes[0], title="p99 time between tokens")
    plots_perf.plot_serving_load(sl["rates"], sl["ttft_p99_s"], ax=axes[1], ylabel="p99 time to first token (s)",
                                 title="p99 time to first token")
    plt.show()
else:
    print("no committed serving_load run: make one with python -m course_lib bench --only serving_load")

# %% [markdown]
# Read both panels together. Chunking bounds the wait between tokens for everybody else; what it can
# cost is time to first token, since a long prompt is now read over several steps that also serve the
# running requests (the right panel shows how much, in that run). The figures come from one run on one
# machine; yours will differ, and a busy machine can reorder close lines.
#
# How does this server compare with a production one on the same laptop? The course committed
# sittings against llama.cpp's server (`llama-server`, built from the source that ships inside
# llama-cpp-python, on the course's own GGUF file, with continuous batching and a choice of slots),
# both driven by the bench's trace over loopback with the same latency targets. The newer sittings
# run the course three ways. First `compiled=True` on the int4 format with a contiguous cache: the
# record's decode-steps line says what that step was (lesson 12's fused C++ step where the CPU has
# bfloat16 pair products, torch.compile's elsewhere). Then the paged cache of this lesson with
# chunked prefill and prefix caching; its decode runs eagerly, so it takes the 4-bit format whose eager
# products are fastest here (int4-q8, the course's own kernel; the older records ran int4). Last
# `kv_cache="slots"`: llama-server's own design, written with the course's fused step. Each request
# owns one row of a contiguous cache from arrival to end, and every step is one C++ call over all the
# tokens it holds: the running requests' next tokens and a chunk of a prompt being read, within a
# token budget (a chunk's tokens go to consecutive columns of their row, each attending to the columns
# up to its own: causal attention, done by where the tokens are written). A newcomer takes the free
# row whose last request began with the same tokens, and those columns are not read again.
# Each record lists the options every configuration ran with. `scripts/serving_peers_cpu.py` remakes
# a sitting; the next cell prints the newest in full, the earlier ones a line per rate, and last the
# newest sitting on another file (both servers on it): Q4_0, the layout llama.cpp repacks for its fast
# kernels.

# %%
sittings = serving_peers.serving_records(Path("../data/benchmarks"))  # the course's own file, oldest first
if sittings:
    record = json.loads(sittings[-1].read_text())
    print(sittings[-1].name, "|", record["processor"], "|", record["llama_server"]["version"].splitlines()[0])
    for name, options in record.get("course_configs", {}).items():
        print(f"  {name}: {options}")
    print("\n".join(serving_peers.describe(record)))
    for earlier in sittings[:-1]:  # their comparison lines only: a line per rate
        old = json.loads(earlier.read_text())
        print(f"earlier, {earlier.name}:")
        print("\n".join(serving_peers.describe(old)[-len(old["comparison"]):]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for ax, key, label in ((axes[0], "goodput_rps", "goodput (good requests per second)"),
                           (axes[1], "itl_p99_s", "p99 time between tokens (s)")):
        plots_perf.plot_serving_load(record["rates"], {name: [r[key] for r in runs]
                                                       for name, runs in record["runs"].items()},
                                     ax=ax, ylabel=label, title=label.split(" (")[0])
    plt.show()
    for other in serving_peers.serving_records(Path("../data/benchmarks"), other_files=True)[-1:]:
        on_other = json.loads(other.read_text())  # the newest sitting on another file: both servers on it
        print(f"on {on_other['file']} ({other.name}):")
        print("\n".join(serving_peers.describe(on_other)[1:]))
else:
    print("no committed serving-peers record: scripts/serving_peers_cpu.py makes one (it needs llama-server)")

# %% [markdown]
# What one such sitting can settle: which server kept more requests inside the targets at each rate
# on that machine, that hour, with the load generator sharing its cores. What it cannot: a ranking
# that holds on another CPU, under another trace, or between close lines (one run per rate, no
# repeats; llama.cpp's own single-stream speed moved from one sitting to the next in lesson 12's
# paired protocol). Two sittings on one day, llama-server unchanged between them, show how far its
# own lines move: compare its rows in the newest record with the earlier lines of the same date.
# Both servers are greedy on the same file, but their arithmetic differs, so their answers can part
# after a few tokens; the record keeps every text.
#
# Read the course lines against section 6. Where the record says the compiled configuration ran the fused step,
# compare its median gap between tokens with llama-server's. But its contiguous cache reads every prompt whole,
# through the int4 format's prefill (torch's 4-bit kernel, many rows at once), and each handbook-sized prompt
# stalls every running request for as long as that takes: compare its longest gap with its median. At the higher
# rates the stalls set its p99 gap too, and when prompts come faster than it reads them they pile up and time to
# first token runs past its target. The paged configuration reads prompts in chunks and finds the shared
# handbook in its prefix cache, so its worst gaps stay near one chunk's cost, while its median gap is an eager
# step's, up to four times the fused ones'. The slots configuration joins the two: the fused step's speed, and
# chunks small enough that a step holding one costs a few decode steps, not a whole prompt's read. Compare its
# p99 gap with llama-server's, then its longest gap with llama-server's longest.
# llama-server ran with its default settings: a long prompt goes in micro-batches of several hundred
# tokens, and each slot keeps its own last prompt for reuse, as the course's slots now do.
#
# Then read the last lines, on Q4_0, before you conclude anything about llama.cpp: the sittings above
# ran the course's Q4_1 file, which is not llama.cpp's fastest 4-bit layout (lesson 12, section 7).
# Compare each server's p99 gap with its longest gap. A server that reads a long prompt whole freezes
# the requests already answering once, for the whole read; chunking cuts that freeze into one piece
# per chunk. When long prompts are rare, the whole read's single freeze is a handful of gaps, below
# the p99 line, while the chunks' many medium gaps can fill the slowest percent: the p99 favours
# the freeze, and the goodput target (no gap over a second) favours the chunks. Which to prefer
# depends on what your users notice; a fair comparison reports both, as these lines do. Chunks small
# enough to cost little more than a decode step keep both low, if the step is fast: the slots lines
# show how close that came to llama-server's p99, and what it cost in time to first token.
#
# One more condition of those sittings: where the engine's loop runs. llama-server runs its slots in its
# process's main thread and answers HTTP on others; since 2026-12-07 the sittings' course server does the same
# (`EngineThread.run_here`). A server started from a notebook, like the ones above, runs its loop in a
# background thread, because the notebook's main thread is yours. That should not matter, and yet: the fused
# step splits each product over OpenMP's threads, and OpenMP (GCC's libgomp, which torch ships) lets its helper
# threads wait for the next piece of work by spinning only while it manages no more threads than the process may
# use CPUs; past that it puts them to sleep, and each piece of the step's work (every product and every
# attention, in each block) then starts by waking one. A loop in a second thread, with its own helpers, can
# cross that line on a machine with few cores. The next cell times one fused decode step in this notebook's main
# thread, then the same step from a background thread.

# %%
import os
import threading
from course_lib.runner.formats import convert
from course_lib.runner.fused_step import FusedDecode, why_not_fused
from course_lib.runtime import time_it

fast = convert(ours, "int4-q8")
if why_not_fused(fast):
    print("no fused step on this machine:", why_not_fused(fast))
else:
    fused, row, medians = FusedDecode(fast), fast.new_cache(1, 512), {}
    words = tokenizer.encode("A short text that fills the first columns of one cache row. " * 12)[:100]
    fused.tokens_at(words, row, [0] * len(words), list(range(len(words))), [])  # 100 columns written

    def time_steps(where: str) -> None:
        columns = iter(range(100, 150))  # decode steps, each one token at the row's next column
        medians[where] = time_it(lambda: fused.tokens_at([words[-1]], row, [0], [next(columns)], [0]),
                                 repeats=36, warmup=2).median

    time_steps("the main thread")
    background = threading.Thread(target=time_steps, args=("a background thread",))
    background.start()
    background.join()
    for where, seconds in medians.items():
        print(f"one fused decode step from {where}: median {1000 * seconds:.2f} ms "
              f"({torch.get_num_threads()} compute threads, {len(os.sched_getaffinity(0))} CPUs for this process)")

# %% [markdown]
# If the two medians are close, this machine has cores to spare and it makes no difference where the loop
# runs. If the background thread's is the larger, every token a notebook's server sends pays that
# difference, and a server meant to be fast runs its loop in its main thread, as llama-server and the
# sittings do (vLLM goes further: its engine runs in a process of its own).

# %% [markdown]
# ## 7. Several answers to one prompt: fork the blocks, copy on write
#
# A client may ask for several answers to the same prompt (`n` in OpenAI's API), to choose one or to let
# them vote. Sent as n separate requests, the prompt is read n times and held n times. A paged pool can
# share it instead: the first answer reads the prompt, and each of the others **forks** it
# (`BlockPool.fork`): it takes the same block table, every block's reference count goes up by one, and
# nothing is copied. The prompt's full blocks are never written again, so they stay shared to the end.
# Its last block is only partly full, and every answer writes its first new token there, so the first
# write into it copies it (copy-on-write, `BlockPool.writable`). Each answer has its own sampler and seed,
# so the answers may part from their first token on.
#
# `fork.n_fork` runs n sampled answers to the handbook question both ways through the scheduler, with
# the prefix cache off so that nothing but the fork shares a block, and counts the blocks in use at the
# peak. The bound it checks: the prompt's full blocks once, then each answer's own blocks (its copy of
# the partial block included).

# %%
from course_lib.measure import fork
from course_lib.views import plots_fork

forked = fork.n_fork(ours, tokenizer, (1, 4, 8), new_tokens=16)
print(f"prompt: {forked['prompt_tokens']:,} tokens, {forked['new_tokens']} new tokens per answer")
for n, row in forked["rows"].items():
    print(f"n = {n}: forked {row['fork_peak_blocks']} blocks (bound {row['fork_bound_blocks']}), "
          f"{row['fork_prompt_tokens_read']:,} prompt tokens read, {row['fork_seconds']:.1f} s | separate "
          f"{row['separate_peak_blocks']} blocks, {row['separate_prompt_tokens_read']:,} read, "
          f"{row['separate_seconds']:.1f} s | same answers both ways: {row['same_answers']}")
plots_fork.plot_fork_blocks(forked)
plt.show()

# %% [markdown]
# Read the two bars at each n: separate requests grow by a whole prompt per answer, the forked ones by
# an answer's few blocks. The prompt tokens read tell the same story for compute: one prefill instead of
# n. The answers are equal both ways because answer i is drawn with seed i either way, from the same
# logits: the fork changes where keys and values live, not what they are.
#
# Lesson 10's server takes `n` now. It makes n jobs; on the paged cache the first one reads the prompt
# and the others fork it, and answer i uses `seed + i`, so it equals the request sent alone with that
# seed. It also returns `logprobs` and `top_logprobs` in OpenAI's shape: each chosen token's
# log-probability under the model's own distribution (before temperature or top-p), with the likeliest
# alternatives beside it.

# %%
import openai

server = lesson_server(ours, tokenizer, kv_cache="paged", kv_blocks=160, max_tokens_cap=24)  # the room's, if set
client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "local", max_retries=0)
reply = client.chat.completions.create(model="smollm2-135m-instruct", n=3, seed=1, temperature=1.0, max_tokens=12,
                                       messages=[{"role": "user", "content": "Name a colour."}],
                                       logprobs=True, top_logprobs=3)
for choice in reply.choices:
    print(choice.index, repr(choice.message.content))
print("\nanswer 0, token by token: chosen (log-probability) | the three likeliest")
for entry in reply.choices[0].logprobs.content[:6]:
    others = ", ".join(f"{t.token!r} {t.logprob:.2f}" for t in entry.top_logprobs)
    print(f"{entry.token!r:>12} ({entry.logprob:.2f}) | {others}")
print("forked answers so far:", httpx.get(server.url + "/health").json()["forked"])
server.stop()

# %% [markdown]
# Several answers are also the simplest way to spend more compute at answer time: sample N answers and
# take the most common one (self-consistency, Wang et al., 2022). It needs answers a program can check.
# `fork.sums` asks the model to add two one-digit numbers in words; `fork.said_number` reads the number
# an answer gives (the first after "=" or "equals", else its last: the model writes its working first).
# Below: greedy, then eight answers per question at temperature 0.7, forked from one prompt read, and the
# vote of the first N for each N.

# %%
best = fork.self_consistency(ours, tokenizer, fork.sums(8), ns=(1, 2, 4, 8), new_tokens=32, temperature=0.7)
for q in best["per_question"][:4]:
    print(f"{q['question']} = {q['answer']}: greedy said {q['greedy']}, the samples said {q['sampled']}")
print("greedy:", f"{best['greedy_accuracy']:.0%}", "| vote of N:",
      {n: f"{a:.0%}" for n, a in best["accuracy"].items()})
top = str(max(best["ns"]))
verdict = ("beat" if best["accuracy"][top] > best["greedy_accuracy"] else
           "tied" if best["accuracy"][top] == best["greedy_accuracy"] else "fell below")
print(f"in this run the vote of {top} {verdict} greedy, for {best['answer_tokens_per_question'][top] / best['greedy_tokens_per_question']:.1f}x "
      "its answer tokens")
plots_fork.plot_votes(best)
plt.show()

# %% [markdown]
# Read the points from left to right: each doubling of N about doubles the answer tokens. Whether the vote
# climbs above greedy depends on whether the right answer is the model's most common one: a vote can only
# amplify what single samples get right more often than any one wrong answer, and sampling at a
# temperature can also make a single answer worse than greedy's on a small model (compare N = 1 with the
# star). The last printed line says how the vote of eight did here. Eight questions are too few to
# separate close points: the bench's `best_of` section runs forty. Larger models on harder problems are
# where the published gains come from.

# %% [markdown]
# ## 8. What production servers add
#
# The mechanism here is the one vLLM introduced as PagedAttention (Kwon et al., "Efficient Memory
# Management for Large Language Model Serving with PagedAttention", SOSP 2023): blocks, block tables,
# reference counts, preemption with recompute. What they add on top:
#
# - **attention kernels that read the blocks in place.** A decode step here attends through the block
#   tables, a tile of whole blocks at a time, merging partial results (lesson 16 writes it and times it
#   against copying every row's blocks into one tensor per layer, the copy section 2 timed); a prompt's
#   chunks still go through that copy, and a production kernel reads the blocks where they lie for both;
# - **prefix sharing as a tree.** SGLang's RadixAttention keeps cached prefixes in a radix tree
#   (Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024); vLLM's
#   automatic prefix caching uses chained block hashes, as here;
# - prompt chunks and decode rows packed into one call (section 6 runs them as two calls in one step),
#   blocks swapped to CPU memory, beam search on forked sequences, and one pool spread over many GPUs.
#
# Lesson 07's simulation gave a full server three options: turn new requests away, drop older
# conversations, or pause one and recompute it later. Section 4 measured the first, the third (vLLM's
# default) and reserve-and-wait, on real blocks and the real model.
#
# ## Summary
#
# - A contiguous cache reserves each request's maximum; a paged one holds blocks as tokens arrive, and a
#   shared prefix once: section 1 measured the two on the same trace.
# - A block is named by a hash chained over its whole prefix, so equal names mean equal keys and values;
#   a newcomer reuses the cached blocks of its prompt and prefills only the rest.
# - A prefix hit on a long document cuts the time to first token many times over (section 3 measured by
#   how much), and never changes the token.
# - When the pool is full, a server can reserve each request's allowance and make newcomers wait, or admit
#   them and preempt (pause and recompute) when blocks run out: both finish every request with exactly the
#   tokens it gets alone; one pays in waiting, the other in recomputed work (section 4 timed both).
# - A token budget per step reads long prompts in chunks: the running requests keep getting tokens while
#   a long prompt arrives (section 6 measured the longest wait against the budget, and what it costs).
# - Slots (a row of one cache per request, each step one fused C++ call over the decode tokens and a
#   prompt chunk) put the fast step and short chunks together; the committed sittings against
#   llama-server say, per rate, where that met the target and by how much it missed.
# - Where the engine's loop runs is a condition of every serving number: on a machine with few cores a step
#   driven from a background thread can cost more (OpenMP's helpers sleep between pieces of work), so the
#   sittings' server runs its loop in its main thread, as llama-server does (section 6 timed one step both ways).
# - n answers to one prompt share its full blocks by reference count and copy only the partial last block
#   when they first write into it: one prompt read, one prompt held (section 7 counted the blocks). A vote
#   over sampled answers helps only where the right answer is the model's most common one.
#
# ---
# ## Exercises
#
# **1.** Write `blocks_needed(prompt_tokens, new_tokens, block_size=16)`: the blocks one conversation
# holds once it has all its tokens (no sharing).

# %%
from course_lib.exercises import lesson13 as ex

def blocks_needed(prompt_tokens, new_tokens, block_size=16):
    ...  # your code here
    raise NotImplementedError

ex.check_blocks_needed(blocks_needed)

# %% [markdown]
# **2.** Write `shared_blocks(prompts, block_size)`: how many blocks the pool holds once these prompts
# (lists of token IDs) are admitted and prefilled one after another, all still running, with prefix
# caching.

# %%
def shared_blocks(prompts, block_size):
    ...  # your code here
    raise NotImplementedError

ex.check_shared_blocks(shared_blocks)

# %% [markdown]
# **3.** Write `predict_ttft(ttft_no_hit_s, prompt_tokens, cached_tokens)`: the time to first token with
# a prefix hit, if prefill time were proportional to the tokens it computes. Then compare it with
# section 3's measurement (next cell).

# %%
def predict_ttft(ttft_no_hit_s, prompt_tokens, cached_tokens):
    ...  # your code here
    raise NotImplementedError

if ex.check_ttft_prediction(predict_ttft):
    guess = predict_ttft(miss[1]["ttft_s"], hit[1]["prompt_tokens"], hit[1]["reused_tokens"])
    print(f"predicted {guess:.3f} s, measured {hit[1]['ttft_s']:.3f} s")
    if hit[1]["ttft_s"] > guess:
        print("slower than the rule: a pass has a cost of its own (every weight read once, lesson 08), "
              "so a few tokens take longer than their share of a long prompt's time")

# %% [markdown]
# **4.** Write `steps_to_read(prompt_tokens, token_budget, running)`: how many steps the scheduler of
# section 6 takes to read a prompt while `running` other requests decode one token each per step.

# %%
def steps_to_read(prompt_tokens, token_budget, running):
    ...  # your code here
    raise NotImplementedError

ex.check_steps_to_read(steps_to_read)

# %% [markdown]
# **5.** Write `fork_blocks(prompt_tokens, answer_tokens, block_size=16)`: the blocks the pool holds for
# several answers forked from one prompt, answer i having `answer_tokens[i]` tokens (each at least one).

# %%
def fork_blocks(prompt_tokens, answer_tokens, block_size=16):
    ...  # your code here
    raise NotImplementedError

ex.check_fork_blocks(fork_blocks)

# %% [markdown]
# **Next:** 14 · speculative decoding: several tokens checked in one pass, the same answer.
