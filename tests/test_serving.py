"""A real server on a free loopback port, real clients (openai and raw HTTP), bounded in count and time."""
import json
import threading
import time

import httpx
import openai
import pytest

from course_lib.serving import free_port, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(model, tokenizer):
    handle = start_server(model, tokenizer, port=free_port(), max_tokens_cap=64, max_body_bytes=20_000, max_batch=8)
    yield handle
    handle.stop()
    assert not handle.thread.is_alive() and not handle.app.state.engine.thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="local", timeout=120, max_retries=0)


def test_openai_client_non_streaming(client):
    reply = client.chat.completions.create(model="m", messages=QUESTION)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 8


def test_streamed_text_equals_non_streamed(client):
    for messages in [QUESTION, [{"role": "user", "content": "What is 'hello' in Chinese?"}]]:
        whole = client.chat.completions.create(model="m", messages=messages, max_tokens=40).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(model="m", messages=messages, max_tokens=40, stream=True)]
        assert "".join(pieces) == whole and not any("\ufffd" in p for p in pieces)


def test_raw_sse_format(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"messages": QUESTION, "stream": True},
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
                model="m", stream=True, max_tokens=24, messages=[{"role": "user", "content": f"Name a colour number {i}."}]))
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
    (json.dumps({"messages": QUESTION, "max_tokens": 0}).encode(), 422, "max_tokens"),
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
    reply = client.chat.completions.create(model="m", messages=QUESTION)
    assert reply.choices[0].message.content == "The capital of France is Paris."


def test_only_loopback(model, tokenizer):
    with pytest.raises(ValueError, match="loopback"):
        start_server(model, tokenizer, port=free_port(), host="0.0.0.0")
    with pytest.raises(ValueError, match="port"):
        start_server(model, tokenizer, port=70000)


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"
