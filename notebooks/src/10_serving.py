# %% [markdown]
# # 10 · Serving: the whole pipeline as a streaming API
#
# **Goal.** Close the loop the course opened in lesson 00: a prompt arrives at an HTTP endpoint, and the
# answer streams back to the client as it is generated. We run a real OpenAI-compatible server on this
# machine and talk to it with the official `openai` client.
#
# **You will**
# - start a local server backed by course_lib's loop and continuous batching scheduler;
# - watch words arrive over server-sent events, and measure time to first token for 1 and 8 clients;
# - see how the server answers bad requests, and what production servers add on top.

# %% [markdown]
# ## Set-up
#
# The server listens on 127.0.0.1 only (nothing outside this machine can reach it), on a free port.
# In a workshop the instructor may run one server for the whole room (`python -m course_lib room`): with
# `COURSE_SERVER_URL` (and `COURSE_SERVER_KEY`) set before JupyterLab starts, `lesson_server` returns that one
# instead and says so, and every cell below talks to it. Your timings then include the room's requests.

# %%
import json
import statistics
import threading
import time
import httpx
import openai
import course_lib
from course_lib.serve.serving import start_server, free_port
from course_lib.serve.room import lesson_server

model, tokenizer = course_lib.load_model()
server = lesson_server(model, tokenizer, max_tokens_cap=256, max_batch=8)
print("serving at", server.url)

# %% [markdown]
# ## 1. A request, the way every chat product sends one
#
# The endpoint is `POST /v1/chat/completions`, with the same JSON shape as OpenAI's API, so the
# official client works unchanged: only the base URL points here. The defaults are OpenAI's too
# (`temperature` 1: sampled), so where we want the repeatable greedy answer we say `temperature=0`.

# %%
client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "not-needed-locally")
reply = client.chat.completions.create(
    model="smollm2-135m-instruct", temperature=0,
    messages=[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "What is the capital of France?"}])
print(repr(reply.choices[0].message.content), "| finish:", reply.choices[0].finish_reason, "|", reply.usage)

# %% [markdown]
# **What the server sees.** The client turned those messages into one HTTP request. Here are the bytes it
# sends, captured by an event hook on the way out:

# %%
sent = []
with httpx.Client(event_hooks={"request": [lambda r: sent.append(r.read())]}) as raw:
    raw.post(server.url + "/v1/chat/completions", headers=server.headers,
             json={"model": "smollm2-135m-instruct", "max_tokens": 1,
                   "messages": [{"role": "user", "content": "My card number is 4111 1111 1111 1111."}]})
print(server.url.split(":")[0], "request body:", sent[0].decode())

# %% [markdown]
# Plain text: this server speaks plain HTTP, and only on 127.0.0.1, so the bytes never leave the machine. A
# provider's API is reached over HTTPS, where TLS encrypts these bytes between your computer and the
# provider's servers, so nobody on the network can read them. It does not hide them from the provider:
# the server decrypts the request and must read the text to tokenize it (lesson 02 built that context from
# the messages). What a provider keeps, logs or trains on is a matter of its policy, not of the protocol.
#
# ## 2. Streaming: words as they are generated
#
# With `stream=True` the server sends **server-sent events**: one small JSON chunk per piece of text,
# as the loop produces it (through the incremental decoder of lesson 06, so no piece breaks a character).

# %%
start, arrivals, text = time.perf_counter(), [], ""
stream = client.chat.completions.create(model="smollm2-135m-instruct", stream=True, max_tokens=80,
                                        messages=[{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
for chunk in stream:
    piece = chunk.choices[0].delta.content
    if piece:
        arrivals.append(time.perf_counter() - start)
        text += piece
        print(piece, end="", flush=True)
print(f"\n\nfirst piece after {arrivals[0] * 1000:.0f} ms, then one every {statistics.median(a - b for a, b in zip(arrivals[1:], arrivals)) * 1000:.0f} ms (median)")

# %% [markdown]
# The same stream without the client library, as raw HTTP: each event is a line starting with `data: `.

# %%
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": True, "temperature": 0}
with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers,
                  timeout=60) as response:
    for line in response.iter_lines():
        if line:
            if line.startswith("data: {"):  # the chunk's text is in choices[0].delta; drop the id and timestamp
                chunk = json.loads(line[len("data: "):])
                print("data:", json.dumps({"choices": chunk["choices"]}, ensure_ascii=False))
            else:
                print(line)

# %% [markdown]
# Streaming here is not a display effect: each event leaves the server one decode step after the
# previous one. The greedy streamed text equals the non-streamed answer (the tests check it).
#
# ## 3. One client, then eight at once
#
# The server's engine batches whatever requests are running (continuous batching, lesson 09). We measure
# time to first token (TTFT) and tokens per second for one client alone, then for eight at the same time.

# %%
def one_client(i, results):
    t0, first, n = time.perf_counter(), None, 0
    for chunk in client.chat.completions.create(model="smollm2-135m-instruct", stream=True, max_tokens=40,
                                                messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}]):
        if chunk.choices[0].delta.content:
            first, n = first or time.perf_counter() - t0, n + 1
    results[i] = {"ttft": first, "total": time.perf_counter() - t0, "pieces": n}

def load_test(clients):
    results = {}
    threads = [threading.Thread(target=one_client, args=(i, results)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "mean_ttft": statistics.mean(r["ttft"] for r in results.values()),
            "pieces_per_s": sum(r["pieces"] for r in results.values()) / wall, "wall": wall}

# %%
measured = [load_test(1), load_test(8)]
for m in measured:
    print(f"{m['clients']} client(s): mean TTFT {m['mean_ttft'] * 1000:6.0f} ms | {m['pieces_per_s']:5.1f} pieces/s "
          f"in total | all done in {m['wall']:.1f} s")

# %% [markdown]
# With eight clients the server delivers far more text per second in total, because eight requests
# share each decode step; each client waits longer for its first piece (the prompts are prefilled
# together and each step carries eight rows). That is lesson 09's trade, now seen from the client side.
#
# ## 4. Bad requests get clear answers
#
# A server meets malformed and hostile input. Each case below gets an HTTP status and a message
# (the test suite checks every one, plus a client that disconnects mid-stream: the server stops
# generating for it and keeps serving others).

# %%
url = server.url + "/v1/chat/completions"
cases = {"malformed JSON": b"{not json", "no messages": json.dumps({"messages": []}).encode(),
         "unknown role": json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
         "max_tokens 0": json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
         "prompt beyond the window": json.dumps({"messages": [{"role": "user", "content": "hi " * 9000}]}).encode(),
         "body over 64 KB": json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode()}
for name, raw in cases.items():
    r = httpx.post(url, content=raw, headers={"content-type": "application/json", **server.headers}, timeout=60)
    print(f"{name:<26} -> {r.status_code}: {r.json()['error']['message'][:80]}")

# %% [markdown]
# And a request for more tokens than the server allows is **clamped**, not refused; the response
# header says to what:

# %%
r = httpx.post(url, json={"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 100000},
               headers=server.headers, timeout=120)
print(r.status_code, "| x-max-tokens-clamped:", r.headers.get("x-max-tokens-clamped"), "|",
      r.json()["usage"]["completion_tokens"], "tokens generated")

# %% [markdown]
# ## 5. What production servers add
#
# This server is the pipeline in a few hundred lines. The feature lists of two production servers, as
# their own documentation names them (vLLM's front page at docs.vllm.ai; Hugging Face's Text Generation
# Inference, TGI, in its README and its "PagedAttention" concept page), map onto what this course measured:
#
# | Feature (named in their docs) | vLLM | TGI | Where the course measured the cost it answers |
# |---|---|---|---|
# | PagedAttention: KV cache in blocks, allocated as needed | yes | yes | 07: the KV budget; 13 builds it |
# | Continuous batching of incoming requests | yes | yes | 09: static against continuous; this server's engine |
# | Quantization (GPTQ, AWQ, bitsandbytes...) | yes | yes | 08: decode reads every weight; 12 builds the formats |
# | CUDA graphs / custom CUDA kernels | yes | yes | 08: kernel-launch overhead at batch 1 |
# | Tensor parallelism across GPUs | yes | yes | 07: weights and caches that outgrow one GPU |
# | Streaming outputs, OpenAI-compatible API | yes | yes | 06 and this lesson |
#
# None of these changes what inference *is*: each makes one of the costs above smaller.
#
# The first row is built in lesson 13 on the course's own model (lesson 11): the KV cache as a pool of
# 16-token blocks, a block table per request, prompts that start alike sharing blocks (prefix caching),
# and a full pool pausing a request instead of refusing it. This server runs on it with one option,
# `kv_cache="paged"`, and gives the same answer:

# %%
paged_server = start_server(model, tokenizer, port=free_port(), kv_cache="paged", kv_blocks=160)
paged_client = openai.OpenAI(base_url=paged_server.url + "/v1", api_key="not-needed-locally")
same = paged_client.chat.completions.create(
    model="smollm2-135m-instruct", temperature=0,
    messages=[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "What is the capital of France?"}])
print(repr(same.choices[0].message.content), "| same as above:", same.choices[0].message.content == reply.choices[0].message.content)
print("pool:", httpx.get(paged_server.url + "/health").json()["kv_blocks"])
paged_server.stop()

# %% [markdown]
# vLLM and SGLang are the production versions of that mechanism. What they add: fused GPU attention
# kernels that read keys and values from the blocks in place (lesson 16 writes that read in plain torch), prefix
# sharing kept as a radix tree of token sequences (SGLang's RadixAttention; vLLM hashes blocks in a chain, as
# lesson 13 does), prefill chunks packed into the same model call as the decode rows (lesson 13 runs them as
# separate calls in one step), and one pool spread across many GPUs.

# %% [markdown]
# ## 6. Stop the server

# %%
server.stop()
if not server.shared:  # the room's server has no engine here: it runs on the instructor's machine
    print("server stopped; engine thread alive:", server.app.state.engine.thread.is_alive())

# %% [markdown]
# ---
# ## Summary
#
# - An OpenAI-compatible endpoint is a thin layer over the pipeline: template, loop, detokenize, stream.
# - Streaming sends each piece over server-sent events as the loop produces it.
# - Batching concurrent clients raises total throughput and lengthens each client's wait for the first token.
# - A server must turn bad input into clear HTTP errors and stop work for clients that leave.
# - Production servers (vLLM, SGLang, TGI) add paged KV memory (lesson 13), continuous batching and quantization on
#   the same foundations; `kv_cache="paged"` runs this server on lesson 13's paged cache.

# %% [markdown]
# ---
# ## Exercises
#
# **1.** Write `make_body(question)`: the JSON body (a dict) for one user message, streaming on, 50 tokens at most.

# %%
from course_lib.exercises import lesson10 as ex

def make_body(question):
    ...  # your code here
    raise NotImplementedError

ex.check_body(make_body)

# %% [markdown]
# **2.** Write `parse_stream(raw)`: given the raw text of a server-sent-events stream, return the
# concatenated content of all chunks.

# %%
def parse_stream(raw):
    ...  # your code here
    raise NotImplementedError

ex.check_parse(parse_stream)

# %% [markdown]
# **3.** Write `ttft(start, arrival_times)`: seconds from the request (`start`) to the first content piece.

# %%
def ttft(start, arrival_times):
    ...  # your code here
    raise NotImplementedError

ex.check_ttft(ttft)

# %% [markdown]
# **4. Predict, then measure.** Section 3 measured the mean time to first token with one client and with
# eight at once. Predict it, in milliseconds, for **four** clients at once and write it in `prediction_ms`;
# the check starts a fresh server on loopback, sends one warm-up request, then the four, and stops it.

# %%
prediction_ms = None  # your prediction: mean time to first token with 4 clients, in ms
ex.check_load_prediction(prediction_ms, model, tokenizer, clients=4)

# %% [markdown]
# **Next:** you have followed one prompt from a keystroke to a streamed answer. Go back to lesson 00:
# every step of the tour is now something you have measured yourself.
