# %% [markdown]
# # 18 · Beyond one machine: replicas behind a router, prefill and decode apart, one model split over processes
#
# **Goal.** Every lesson so far served the model from one process. Production serving starts there and
# spreads out: copies of the server behind a router, the reading of prompts moved away from the writing of
# answers, and models too big for one accelerator cut across several. This lesson runs each of those
# mechanisms for real at small scale on this machine, with the course's model, and works out on paper,
# from measured and published numbers, what the same ideas take for a 70-billion-parameter model.
#
# **You will**
# - put two course servers, each in its own process on one core, behind sglang-router (SGLang's router,
#   installed from PyPI, not written here), replay a trace through two of its policies, and kill a replica
#   while requests are in flight;
# - read a prompt in one process, ship its KV-cache blocks as bytes over a socket to another, and let that
#   one continue the answer;
# - split the model across three processes by tensor parallelism and time where a step goes;
# - size a fleet for a big model with a calculator whose inputs are printed.

# %% [markdown]
# ## Set-up

# %%
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.views import plots_fleet
from course_lib.measure.fleet import disagg_figures, tp_figures
from course_lib.measure.router import alone_run, death_run, grouped_trace, policy_run
from course_lib.runner.model import Model
from course_lib.serve import fleet_plan
from course_lib.serve.replicas import POLICIES, RouterMissing, router_command, start_replicas

torch.set_num_threads(1)  # one thread, set explicitly: every process below runs one thread too
model, tokenizer = course_lib.load_model()
ours = Model.from_transformers(model)  # lesson 11's model, float32
print(f"this machine: {os.cpu_count()} CPU cores | threads here: {torch.get_num_threads()}")

# %% [markdown]
# ## 1. Replicas behind a router
#
# The simplest way to serve more requests is more copies of the server: each **replica** holds the whole
# model and answers its own requests (data parallelism). Something must then decide which replica gets each
# request: a **router**. It sees every request first and forwards it to one replica, streaming the answer
# back. Two of its policies:
#
# - **round robin**: replicas in turn, whatever the request says;
# - **cache-aware**: the router keeps, per replica, a tree of the prompt text it has sent there, and sends a
#   request to the replica with the longest match, so a prompt that starts like an earlier one lands where
#   that prefix is already in the KV cache (lesson 13's prefix caching). When the replicas' loads drift too
#   far apart it sends to the least busy instead.
#
# The router here is **sglang-router**, SGLang's router, a Rust program installed from PyPI. vllm-router, the
# vLLM project's router of the same design, also installs beside the course's pinned packages and also fronts
# the course's server unchanged; sglang-router was chosen because it has wheels for macOS on Apple silicon and
# for Windows as well as Linux, where vllm-router has Linux wheels only. It routes by model name, so every
# request names the model. Where it has no wheel, this section says so and shows a committed run.
#
# Each replica is `course_lib`'s server (lesson 10, with lesson 13's paged cache) in a process of its own,
# pinned to one CPU core where the system allows it, one torch thread. Starting them loads the model twice:

# %%
try:
    router_command()
    have_router = True
except RouterMissing as err:
    have_router = False
    print(err)
if have_router:
    replicas = start_replicas(2, kv_blocks=400, max_tokens_cap=16, max_concurrent=64)  # queue, do not refuse (429)
    for r in replicas:
        print(f"replica on {r.url}, core {r.core}, process {r.process.pid}")

# %% [markdown]
# The trace: questions in groups, each group sharing one long system prompt (the first part of the
# makerspace handbook behind the group's name), arriving at random and interleaved. Every run gets its own
# tag in front of the prompts, so no run finds an earlier run's prefixes in the replicas' caches. The same
# trace then goes through the router with each policy, and straight to one replica with no router at all:

# %%
shape = dict(groups=3, per_group=3, prefix_chars=1200, rate=1.5, max_tokens=8)
if have_router:
    runs = {policy: policy_run(replicas, policy, grouped_trace(policy, **shape)) for policy in POLICIES}
    runs["one_replica"] = alone_run(replicas[0], grouped_trace("alone", **shape))
    same = runs["round_robin"].pop("texts") == runs["cache_aware"].pop("texts")
    print("greedy answers identical under both policies:", same)
else:  # no router here: the newest committed bench run that has one
    committed = [json.loads(p.read_text())["fleet"].get("router", {})
                 for p in sorted(Path("../data/benchmarks").glob("bench-*fleet*.json"))]
    runs = ([r["policies"] for r in committed if "policies" in r] or [None])[-1]
    print("the committed run:" if runs else "no committed router run in data/benchmarks")
for name, run in (runs or {}).items():
    print(f"{name:>12}: {run['finished']}/{run['requests']} answered | prefix hit rate {run['hit_rate']:.0%} | "
          f"TTFT p50 {run['ttft_p50_s']:.2f} s, p99 {run['ttft_p99_s']:.2f} s | goodput "
          f"{run['goodput_rps']:.2f} req/s | per replica: "
          + ", ".join(f"{r['requests']} requests, {r['hit_rate']:.0%} hit" for r in run["replicas"]))
if runs:
    plots_fleet.plot_policies(runs)
    plt.show()

# %% [markdown]
# Read the hit rates first. Round robin spreads each group's questions over both replicas, so each replica
# computes the group's prompt once before it can reuse it; cache-aware keeps a group together when the loads
# allow. Then the time to first token: a hit skips most of the prompt's prefill. The run with one replica
# serves on one core, but every prefix it computes is reused by every later question of its group. The
# replicas, the router and the load generator share this machine's cores, so the printed figures are what
# this machine did in this run, with this short trace; the bench replays a longer one (`python -m course_lib
# bench --only fleet`).
#
# A replica can die. Below, one is killed while the trace is in flight. Every request must end either
# answered or with an error the client can see; none may hang or vanish:

# %%
if have_router:
    died = death_run(replicas, grouped_trace("death", groups=2, per_group=4, prefix_chars=600, rate=2.0), 1.0)
    print(f"replica 2 killed {died['killed_at_s']} s into the trace (alive now: {replicas[1].alive()})")
    print(f"{died['answered']} answered, {len(died['errors'])} errors, {died['lost']} lost, of {died['requests']}; "
          f"sent after the kill: {died['sent_after_kill']}, of which answered: {died['answered_after_kill']}")
    for error in died["errors"][:3]:
        print("  error:", error)
    for r in replicas:
        r.stop()

# %% [markdown]
# Read the counts printed above. A request sent after the kill whose replica refused the connection is one the
# router can send again (by default it retries failed requests, with backoff). A request that was already
# streaming from the killed replica cannot be moved: its client sees the stream break, and the load generator
# records that as an error, with the reason printed. Nothing counts as lost: a request that ends neither
# answered nor with an error would be a bug, in the router or in the client.
#
# ## 2. Prefill and decode apart
#
# Lesson 08 showed the two halves of a request pulling in different directions: prefill is arithmetic on many
# tokens at once, decode reads every weight for one token per row. In one server they share a batch, so a long
# prompt's prefill delays every running answer's next token (lesson 13's chunked prefill bounds that). Engines
# such as vLLM, SGLang and Dynamo can instead run prefill on one set of processes and decode on another: the
# prefill side reads the prompt, then ships the prompt's keys and values (its KV-cache blocks) to the decode
# side, which continues from them.
#
# Here the prefill side is a process of its own (one thread) that reads the handbook question of lesson 13
# into paged blocks and ships them over a loopback socket: a JSON header (the request's name, its tokens, the
# cache's shape, the wire format, the first token picked) and then every layer's keys and values. The decode
# side, in this notebook, writes them into its own pool and continues greedily. Three wire formats: float32,
# bfloat16, and 8 bits with one scale per token and head (lesson 17's cache):

# %%
shipped = disagg_figures(model, tokenizer, new_tokens=8)
print(f"prompt: {shipped['prompt_tokens']} tokens; answer continued for {shipped['new_tokens']} tokens")
for fmt, row in shipped["formats"].items():
    print(f"{fmt:>8}: {row['bytes'] / 1e6:5.1f} MB shipped, {row['bytes_per_prompt_token']:,.0f} bytes per prompt "
          f"token | prefill {row['prefill_s']:.2f} s, on the wire {1000 * row['wire_s']:.0f} ms | same tokens as one "
          f"process: {row['same_tokens']}" + ("" if row["same_tokens"] else f" (first difference at token "
                                                                              f"{row['first_difference']})"))
plots_fleet.plot_shipped(shipped["formats"])
plt.show()

# %% [markdown]
# The bytes grow with the prompt, never with the weights: the keys and values of every layer and every
# key/value head, for every prompt token. On loopback the transfer is memory copying; between machines it is a
# network link, which is why production systems ship blocks with RDMA (NIXL in vLLM and Dynamo, Mooncake's
# transfer engine) and why the 8-bit format matters there. Whether the 8-bit blocks still give the same
# tokens is printed above: they are not the same numbers, so a different token somewhere is possible.
#
# What disaggregation buys is not throughput. vLLM's own documentation on disaggregated prefill says it does
# not raise throughput; it lets the time to first token and the time between tokens be tuned apart, and
# keeps a long prompt's prefill from stalling running answers. The cell above also measured that last point:
# an answer was decoding here when the handbook prompt was read in the prefill process and its blocks
# accepted between two steps. Beside it, lesson 13's single process reading the same prompt whole, and in
# chunks:

# %%
g = shipped["decode_gaps"]
for name in ("disaggregated", "one_process_whole", "one_process_chunked"):
    print(f"{name:>20}: p99 gap {1000 * g[name]['p99_gap_s']:6.0f} ms, median {1000 * g[name]['median_gap_s']:4.0f} ms")
print(f"(the prompt: {g['prompt_tokens']} tokens; chunks of {g['budget']}; the blocks arrived after "
      f"{g['disaggregated']['arrived_after_tokens']} tokens of the running answer)")
plots_fleet.plot_gaps(g)
plt.show()

# %% [markdown]
# Chunking shortens the longest wait but still puts prompt work into the running answer's steps; a prefill
# process takes it out of them, leaving the cost of accepting the blocks (and, on a machine this small, the
# cores the two processes share). What it costs is the transfer, and a prefill pool and a decode pool that
# must each be sized.
#
# The bench goes one step further: lesson 13's mixed trace (chats, handbook questions, long documents arriving
# at random) through a decode side that batches the shipped requests (`serve/disagg_batch.py`: lesson 13's
# paged scheduler, fed blocks instead of prompts), against one process reading every prompt itself, whole and
# in chunks. Its newest committed run, if the course has one:

# %%
committed = sorted(Path("../data/benchmarks").glob("bench-*fleet*.json"))
traces = [(p.name, json.loads(p.read_text())["fleet"]["disagg"].get("trace")) for p in committed]
traces = [(name, t) for name, t in traces if t]
if traces:
    name, t = traces[-1]
    print(f"{name}: {t['requests']} requests at {t['rate']} per second; same tokens all three ways: {t['same_tokens']}")
    for way in ("disaggregated", "one_process_whole", "one_process_chunked"):
        print(f"{way:>20}: time between tokens p50 {1000 * t[way]['itl_p50_s']:4.0f} ms, p99 "
              f"{1000 * t[way]['itl_p99_s']:5.0f} ms | time to first token p50 {t[way]['ttft_p50_s']:.2f} s, p99 "
              f"{t[way]['ttft_p99_s']:.2f} s")
else:
    print("no committed trace run: make one with python -m course_lib bench --only fleet")

# %% [markdown]
# Read these rows against section 2's diagram. The bench ran both processes on the same
# two cores, and one prefill process reads every prompt in turn: a short chat that arrives behind a long document
# waits for the whole document, and the prefill process's work still takes cores from the decode loop. Where
# that run shows the shipped side's time to first token longest, or its p99 gap above the chunked one's, that is
# the cost of a pool too small and of cores shared: production systems give each pool its own accelerators and
# size the prefill pool to the arrival rate of long prompts.
#
# ## 3. One model over three processes: tensor parallelism
#
# When a model does not fit one accelerator, each layer can be cut across several (Megatron-LM's pattern).
# SmolLM2 has 9 query heads in 3 groups that share a key/value head, so it splits three ways: each process
# keeps one group's query, key and value rows and the matching columns of the output projection, and a third
# of the feed-forward's columns (then the matching rows of its down projection). Each half of a layer ends in
# a partial sum on every process; one **all-reduce** adds them, so every process carries on with the full
# result. The processes talk over `torch.distributed` with the gloo backend on loopback, one thread each:

# %%
tp = tp_figures(model, tokenizer, steps=8)
print(f"largest logit difference against the library: {tp['max_logit_difference']:.1e} "
      f"(one process: {tp['max_logit_difference_one_process']:.1e}); same greedy tokens: {tp['same_tokens']}")
print(f"one process {tp['step_ms_one_process']:.1f} ms per step | {tp['world']} processes {tp['step_ms_tp']:.1f} ms "
      f"({tp['slowdown']:.1f}x), {tp['allreduce_share']:.0%} of it in {tp['allreduces_per_step']} all-reduces "
      f"(waiting for the slowest process included)")
print(f"weights and tables per process: {tp['rank_bytes'] / 1e6:.0f} MB against {tp['one_process_bytes'] / 1e6:.0f} "
      f"MB for one | cores on this machine: {os.cpu_count()}")
plots_fleet.plot_tp_split(tp)
plt.show()

# %% [markdown]
# The logits agree with one process to the printed tolerance (the sums are added in a different order), and the
# step got slower, not faster. Three processes share this machine's cores, each step waits for the slowest of
# them twice per layer, and the all-reduce goes through loopback sockets. Tensor parallelism pays when a model
# does not fit one device, or when each device's share of the weights takes longer to read than the
# all-reduces take: GPUs in one machine joined by NVLink move hundreds of GB per second with microseconds of
# latency, which is why tensor-parallel groups stay inside one machine. What each process holds did shrink:
# that is the reason to do it.
#
# ## 4. A fleet on paper
#
# How many accelerators does a big model need for a given load? The calculator below (`serve/fleet_plan.py`)
# works it out from a roofline: a decode step reads every weight once and each running request's cache, at a
# fraction of the memory bandwidth; a prefill computes two operations per weight per prompt token, at a fraction
# of the peak arithmetic. The first input is measured here: the fraction of this machine's memory bandwidth
# the course's decode step reaches (lessons 08 and 12). The model's shapes come from its config; the device's
# figures from its vendor's sheet; the targets are a service's choice. All are printed:

# %%
from course_lib.measure.prefill_decode import decode_seconds, memory_bandwidth, weight_bytes
step_s = decode_seconds(model, tokenizer, [16])[0]
reached = weight_bytes(model) / step_s / memory_bandwidth(model.device, 128)
print(f"this machine: decode reads {weight_bytes(model) / step_s / 1e9:.1f} GB/s, {reached:.0%} of the "
      f"{memory_bandwidth(model.device, 128) / 1e9:.1f} GB/s it streams")
work = fleet_plan.Workload(rate=10, prompt_tokens=2000, output_tokens=300, ttft_s=2.0, itl_s=0.05,
                           bandwidth_fraction=min(reached, 0.9))
fleet = fleet_plan.plan(fleet_plan.LLAMA_70B, fleet_plan.H100_SXM, work)
for part, values in fleet["inputs"].items():
    print(f"{part}: {values}")
print(f"\nweights {fleet['weights_gb']:.0f} GB; KV cache {fleet['kv_mb_per_token']:.2f} MB per token, "
      f"{fleet['kv_gb_per_request']:.2f} GB per request")
for o in fleet["options"]:
    print(f"  TP={o['tp']}: batch {o['batch']} (memory allows {o['batch_by_memory']}, the {work.itl_s * 1000:.0f} ms "
          f"target {o['batch_by_latency']}; {o['binding']} binds), step {o['decode_step_ms']:.1f} ms, "
          f"{o['tokens_per_s_per_replica']:,.0f} tokens/s per replica -> {o['decode_devices']} decode devices")
print(f"chosen: TP={fleet['tp']}, {fleet['weights_gb_per_device']:.1f} GB of weights per device; prefill of one "
      f"prompt {fleet['prefill_s']:.2f} s (target met: {fleet['ttft_met']}); {fleet['prefill_devices']} prefill "
      f"devices; {fleet['devices']} devices in all; a KV link from prefill to decode carries "
      f"{fleet['kv_link_gbs']:.1f} GB/s")
rates = [1, 2, 5, 10, 20, 50, 100]
plots_fleet.plot_fleet_curve(fleet_plan.curve(fleet_plan.LLAMA_70B, fleet_plan.H100_SXM, work, rates), rates)
plt.show()

# %% [markdown]
# Read which limit binds for each tensor-parallel degree: memory (the cache of the requests a replica must hold)
# or latency (the step must stay under the time-between-tokens target). The calculator leaves out what a real
# plan must add: queueing (a fleet run at full utilisation has no headroom for bursts), prompts of varied
# length, the prefix hits of section 1, and failures. Two more ways to split a model enter when tensor
# parallelism inside one machine is not enough: **pipeline parallelism** puts consecutive layers on different
# machines (only one layer's activations cross between them, so slower links will do, at the cost of
# keeping several batches in flight to fill the pipeline), and **expert parallelism** spreads a
# mixture-of-experts model's experts over devices (a token visits only a few, so the weights read per token
# shrink, and the traffic becomes all-to-all).
#
# ## 5. What production systems add
#
# - **llm-d** (Kubernetes) and **NVIDIA Dynamo** schedule replicas and prefill/decode pools across a
#   cluster, with routers that follow what each replica's cache really holds from the engines' KV events
#   (vllm-router's `kv_aware` policy does too), where the cache-aware policy of section 1 infers it from the
#   text it has sent. The trade: a control plane to run, and events to carry.
# - **Mooncake** (Moonshot AI) stores KV blocks in a pool spread over the cluster's memory and SSDs, so a prefix
#   computed anywhere can be fetched anywhere; it pays with transfer bandwidth for prefill it does not redo.
# - **vLLM's KV connectors** (NIXL, LMCache, Mooncake) are the shipping of section 2 between machines, over
#   RDMA, overlapped with computation layer by layer rather than after the whole prompt.
# - **Tensor, pipeline and expert parallelism** together (vLLM, SGLang, TensorRT-LLM) let the largest models
#   run at all; each adds communication to every step.
#
# ## Summary
#
# - Replicas multiply throughput; the router decides what each replica's cache holds. Section 1 printed the
#   prefix hit rate and the time to first token per policy on one trace, and what happened to every request when
#   a replica died mid-trace.
# - Prefill and decode can run apart: the decode side continues from shipped blocks with one process's tokens.
#   Section 2 printed the bytes per prompt token of each wire format; they grow with the prompt, not the weights.
# - Tensor parallelism splits every layer by heads and columns, joined by two all-reduces per layer. It
#   reproduced one process's logits within the printed tolerance and made each step slower on this machine;
#   it pays when a model does not fit one device and the links are fast.
# - A fleet for a big model follows from the roofline: section 4 printed the devices, the binding limit per
#   tensor-parallel degree and the KV link's load for the stated targets.
#
# ---
# ## Exercises
#
# **1.** Write `wire_bytes(tokens, fmt)`: the payload bytes a prompt of `tokens` tokens ships from the prefill
# process to the decode process for this model, in `fmt` ("float32", "bfloat16" or "int8", the 8-bit rows
# carrying one float16 scale each). `ours.layers`, `ours.kv_heads` and `ours.head_dim` hold the shapes; the
# check packs real blocks.

# %%
from course_lib.exercises import lesson18 as ex

def wire_bytes(tokens, fmt):
    ...  # your code here
    raise NotImplementedError

ex.check_wire_bytes(wire_bytes, ours)

# %% [markdown]
# **2.** Write `tp_sizes(kv_heads, ff)`: every number of processes (ascending) this lesson's tensor parallelism
# can split a model into, given its key/value heads and its feed-forward width. The check asks about models
# of several shapes.

# %%
def tp_sizes(kv_heads, ff):
    ...  # your code here
    raise NotImplementedError

ex.check_tp_sizes(tp_sizes)

# %% [markdown]
# **3.** Write `kv_link_gbs(rate, prompt_tokens, kv_bytes_per_token)`: the GB per second (1e9 bytes) a link
# from the prefill machines to the decode machines carries when `rate` requests per second each ship their
# prompt's cache. The check compares it with the calculator of section 4.

# %%
def kv_link_gbs(rate, prompt_tokens, kv_bytes_per_token):
    ...  # your code here
    raise NotImplementedError

ex.check_kv_link(kv_link_gbs)

# %% [markdown]
# **4. Predict, then measure.** Section 2 printed what the handbook prompt shipped in each format. Predict the
# megabytes (1e6 bytes) a prompt of **2,000** tokens ships in **bfloat16**, write them in `prediction_mb`, then
# run the check: it reads such a prompt into paged blocks and packs them as the prefill process does.

# %%
prediction_mb = None  # your prediction, in MB
ex.check_shipped_prediction(prediction_mb, ours, tokenizer, tokens=2000, fmt="bfloat16")

# %% [markdown]
# **Next:** the course ends here for now. `python -m course_lib bench` measures every lesson's claims on your
# machine, this one's in its `fleet` section.
