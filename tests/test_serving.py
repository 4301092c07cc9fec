"""A real server on a free loopback port, real clients (openai and raw HTTP), bounded in count and time."""
import json
import threading
import time

import httpx
import openai
import pytest

from course_lib.serve.serving import free_port, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2-135m-instruct"  # the served name; tests that compare text ask for temperature 0 (repeatable)


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def server(model, tokenizer, request):
    """Every test below runs twice: on continuous batching over the library's model, and on lesson 13's paged
    cache over the course's own model (kv_cache="paged", a pool of 160 blocks: 2,560 tokens)."""
    handle = start_server(model, tokenizer, port=free_port(), max_tokens_cap=64, max_body_bytes=20_000, max_batch=8,
                          kv_cache=request.param, kv_blocks=160 if request.param == "paged" else None)
    yield handle
    handle.stop()
    assert not handle.thread.is_alive() and not handle.app.state.engine.thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="local", timeout=120, max_retries=0)


def test_openai_client_non_streaming(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 8


def test_streamed_text_equals_non_streamed(client):
    for messages in [QUESTION, [{"role": "user", "content": "What is 'hello' in Chinese?"}]]:
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stream=True, temperature=0)]
        assert "".join(pieces) == whole and not any("\ufffd" in p for p in pieces)


def test_raw_sse_format(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"messages": QUESTION, "stream": True, "temperature": 0},
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "The capital of France is Paris."


def test_eight_concurrent_streams_all_complete(client, server):
    results, errors = {}, []

    def one(i):
        try:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=24, messages=[{"role": "user", "content": f"Name a colour number {i}."}]))
            results[i] = text
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors and len(results) == 8 and all(results.values())
    assert server.app.state.engine.error is None


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({}).encode(), 400, "messages"),
    (json.dumps({"messages": []}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "unknown role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "must be text"),
    (json.dumps({"messages": QUESTION, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": QUESTION, "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": QUESTION, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 4500}]}).encode(), 413, "over the limit"),
])
def test_bad_requests(server, body, status, message):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status and message in r.json()["error"]["message"]


def test_prompt_beyond_the_context_window(model, tokenizer):
    handle = start_server(model, tokenizer, port=free_port(), max_body_bytes=200_000)
    try:
        r = httpx.post(handle.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi " * 9000}]})
        assert r.status_code == 400 and "context window" in r.json()["error"]["message"]
    finally:
        handle.stop()


def test_max_tokens_is_clamped(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 5000})
    assert r.status_code == 200 and r.headers["x-max-tokens-clamped"] == "64"
    assert r.json()["usage"]["completion_tokens"] <= 64


def test_client_disconnect_stops_generation_and_others_continue(server, client):
    engine = server.app.state.engine
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}], "stream": True,
            "max_tokens": 64}) as response:
        lines = response.iter_lines()
        next(lines), next(lines)
        name = json.loads(next(line for line in lines if line)[6:])["id"]
    deadline = time.time() + 20
    while name in engine.active() and time.time() < deadline:
        time.sleep(0.05)
    assert name not in engine.active()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    health = httpx.get(server.url + "/health", timeout=10).json()
    if "kv_blocks" in health:  # the paged engine: the cancelled stream gave its blocks back
        assert health["kv_blocks"]["used"] == 0 and health["kv_blocks"]["total"] == 160


def test_only_loopback(model, tokenizer):
    with pytest.raises(ValueError, match="loopback"):
        start_server(model, tokenizer, port=free_port(), host="0.0.0.0")  # no opt-in: refused
    with pytest.raises(ValueError, match="port"):
        start_server(model, tokenizer, port=70000)


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"


def test_stop_strings_reach_the_server_through_the_shared_loop(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, stop=["France"], temperature=0)
    assert reply.choices[0].message.content == "The capital of " and reply.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=QUESTION, stop=["of Fr", "zzz"], temperature=0, stream=True)]
    assert "".join(pieces) == "The capital "  # streamed: never a piece of the stop string, even "of" alone
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_bad_stop_is_refused(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, "stop": ["a", ""]}, timeout=30)
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"]


def test_the_server_runs_on_our_model(model, tokenizer):
    from course_lib.runner.model import Model
    handle = start_server(Model.from_transformers(model), tokenizer, port=free_port(), max_tokens_cap=32)
    try:
        c = openai.OpenAI(base_url=handle.url + "/v1", api_key="local", timeout=120, max_retries=0)
        reply = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
        assert reply.choices[0].message.content == "The capital of France is Paris."
        pieces = [ch.choices[0].delta.content or "" for ch in
                  c.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, temperature=0)]
        assert "".join(pieces) == "The capital of France is Paris."
    finally:
        handle.stop()


@pytest.mark.parametrize("extra, param, code", [
    ({"max_tokens": "12"}, "max_tokens", "invalid_type"), ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 2.5}, "temperature", "invalid_value"), ({"top_p": 0}, "top_p", "invalid_value"),
    ({"n": 9}, "n", "invalid_value"), ({"n": 0}, "n", "invalid_value"), ({"n": 2, "stream": True}, "n", "unsupported_value"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"logprobs": "yes"}, "logprobs", "invalid_type"), ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_value"),
    ({"top_k": 5}, "top_k", "unsupported_parameter"), ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
    ({"stop": [""]}, "stop", None), ({"seed": 1.5}, "seed", "invalid_type"), ({"stream": "yes"}, "stream", "invalid_type"),
    ({"cache_salt": ""}, "cache_salt", "invalid_type"), ({"cache_salt": 7}, "cache_salt", "invalid_type"),
])
def test_errors_name_the_field_in_openai_shape(server, extra, param, code):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, **extra}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"


def test_n_answers_each_equal_their_seed_alone(client, server):
    """n = 3 with seed 5: answer i equals the request sent alone with seed 5 + i (on the paged cache the other two
    forked the first one's prompt blocks instead of reading the prompt again)."""
    batch = server.app.state.engine.batch
    forked = getattr(batch, "forked", 0)
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, seed=5, temperature=1.0, max_tokens=16)
    alone = [client.chat.completions.create(model=MODEL, messages=QUESTION, seed=5 + i, temperature=1.0,
                                            max_tokens=16).choices[0].message.content for i in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2] and [c.message.content for c in reply.choices] == alone
    assert len(set(alone)) > 1 and reply.usage.completion_tokens > 3
    if hasattr(batch, "forked"):
        assert server.app.state.engine.batch.forked - forked == 2


def test_logprobs_in_openai_shape_and_greedy_takes_the_top_one(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert bytes(b for e in content for b in e.bytes).decode() == choice.message.content + "<|im_end|>"
    for entry in content:  # greedy: the chosen token is the likeliest, and the alternatives come in order
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.logprob <= 0
    streamed = [e for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stream=True,
                                                              logprobs=True)
                for e in (chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert plain.choices[0].logprobs is None


def test_unknown_routes_and_methods_and_models_in_openai_shape(server):
    r = httpx.get(server.url + "/v1/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": QUESTION}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and MODEL in r.json()["error"]["message"]


def test_null_means_default_and_text_parts_are_joined(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, top_p=None, max_tokens=None)
    assert "Paris" in reply.choices[0].message.content
    r = httpx.post(client.base_url.join("chat/completions").__str__(), timeout=30, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content"


def test_seed_repeats_a_sampled_answer(client):
    ask = lambda seed: client.chat.completions.create(  # noqa: E731 - temperature 1 is the default: sampled
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], seed=seed, max_tokens=12).choices[0].message.content
    assert ask(7) == ask(7)
    assert len({ask(s) for s in range(4)}) > 1  # different seeds, different samples


def test_include_usage_gives_a_final_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens > 0


def test_non_streamed_disconnect_stops_generation(server):
    engine = server.app.state.engine
    before = engine.served
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=1.0, json={
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 64})
    deadline = time.time() + 20
    while engine.active() and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.active() and engine.served == before + 1
    assert engine.finished[-1][1] == "cancelled"  # stopped early, not run to its 64 tokens


def test_api_key_is_checked_as_the_bearer_token(model, tokenizer):
    handle = start_server(model, tokenizer, port=free_port(), api_key="s3cret", max_tokens_cap=8)
    try:
        r = httpx.post(handle.url + "/v1/chat/completions", json={"messages": QUESTION}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=handle.url + "/v1", api_key="s3cret", timeout=60, max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0).choices[0].message.content
        assert httpx.get(handle.url + "/health", timeout=10).status_code == 200  # the health check stays open
    finally:
        handle.stop()


def test_response_format_json_schema_with_the_openai_client(client):
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string"}}}
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"city"} and reply.choices[0].finish_reason == "stop"
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_bad_schema_is_refused_before_generation(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={"messages": QUESTION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema"


def test_paged_server_refuses_a_prompt_its_pool_cannot_hold_and_a_bad_cache_name(model, tokenizer):
    handle = start_server(model, tokenizer, port=free_port(), kv_cache="paged", kv_blocks=4)  # 64 tokens
    try:
        r = httpx.post(handle.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "word " * 100}]})
        assert r.status_code == 400 and "KV memory holds 64" in r.json()["error"]["message"]
    finally:
        handle.stop()
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        start_server(model, tokenizer, port=free_port(), kv_cache="pages")


def test_a_cache_salt_keeps_users_prefixes_apart_on_the_paged_server(model, tokenizer):
    """The same long prompt under another salt finds nothing cached; under the same salt it finds its blocks."""
    handle = start_server(model, tokenizer, port=free_port(), kv_cache="paged", kv_blocks=64)
    messages = [{"role": "system", "content": "You answer questions about the weather in one short sentence. " * 4},
                {"role": "user", "content": "Is it raining?"}]
    rates = []
    try:
        for salt in ("alice", "bob", "alice"):
            r = httpx.post(handle.url + "/v1/chat/completions", timeout=60,
                           json={"messages": messages, "max_tokens": 1, "cache_salt": salt})
            assert r.status_code == 200
            rates.append(httpx.get(handle.url + "/health", timeout=10).json()["kv_blocks"]["prefix_hit_rate"])
    finally:
        handle.stop()
    assert rates[0] == rates[1] == 0 and rates[2] > 0


def test_an_engine_error_reaches_the_client_as_an_error(tiny, tokenizer):
    """Never as finish_reason "stop": a 500 in OpenAI's shape, or an error event in a stream (no finish chunk)."""
    handle = start_server(tiny, tokenizer, port=free_port(), max_tokens_cap=16)
    engine = handle.app.state.engine

    def break_step(batch):
        def broken():
            if batch.jobs:  # note: break only a step with work in it
                raise RuntimeError("a deliberately broken step")
            return []
        batch.run = broken  # the scheduler's model call, which generation.step makes first

    try:
        for stream in (False, True):
            break_step(engine.batch)  # the engine replaces its scheduler after an error: break the new one
            r = httpx.post(handle.url + "/v1/chat/completions", timeout=60,
                           json={"messages": QUESTION, "stream": stream, "max_tokens": 8})
            if not stream:
                assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
                continue
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert events[-1]["error"]["code"] == "engine_error"
            assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
        assert isinstance(engine.error, RuntimeError)
        ok = httpx.post(handle.url + "/v1/chat/completions", timeout=60, json={"messages": QUESTION, "max_tokens": 4})
        assert ok.status_code == 200  # the next request is served by a fresh scheduler
    finally:
        handle.stop()


def test_paged_server_with_chunked_prefill_clamps_to_its_pool(model, tokenizer):
    handle = start_server(model, tokenizer, port=free_port(), kv_cache="paged", kv_blocks=6, token_budget=24,
                          max_tokens_cap=200)  # 96 token slots, prompts read 24 tokens a step at most
    try:
        r = httpx.post(handle.url + "/v1/chat/completions", timeout=120,
                       json={"messages": QUESTION, "max_tokens": 200, "temperature": 0})
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["message"]["content"] == "The capital of France is Paris."
        assert int(r.headers["x-max-tokens-clamped"]) == 96 - body["usage"]["prompt_tokens"]
    finally:
        handle.stop()
    for options, message in (({"kv_cache": "paged", "token_budget": 4}, "above max_batch"),
                             ({"token_budget": 64}, "options of the paged cache")):
        with pytest.raises(ValueError, match=message):
            start_server(model, tokenizer, port=free_port(), **options)
