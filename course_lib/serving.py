"""Serving: the whole pipeline behind an OpenAI-compatible HTTP endpoint, streaming as it generates.

What it does: `Engine` runs course_lib's continuous batching loop in a background thread and hands
each request its tokens as they are produced; `create_app` builds a FastAPI app with
POST /v1/chat/completions (JSON or, with "stream": true, server-sent events), GET /v1/models and
GET /health; `start_server` runs it with uvicorn on 127.0.0.1 only, on the port you choose, and
returns a handle whose stop() shuts everything down. Bad requests get 400/413/422 with a message;
max_tokens above the cap is clamped to it (the response says so in the header x-max-tokens-clamped);
a client that disconnects mid-stream is dropped from the batch at the next step.
What it does not do: authentication, paged KV memory, or listening on any non-loopback address.
"""
from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .batching import ContinuousBatch, Job
from .context import context_ids, validate_messages
from .generation import IncrementalDecoder, end_of_turn_ids
from .sampling import SamplingConfig, make_sampler

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Engine:
    """A background thread that owns the model and serves jobs by continuous batching."""

    def __init__(self, model, max_batch: int = 8):
        self.model, self.max_batch = model, max_batch
        self.pending: queue.Queue = queue.Queue()
        self.listeners: dict[str, callable] = {}
        self.batch = ContinuousBatch(model)
        self.served, self.error = 0, None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="course-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job, on_token) -> None:
        """Queue a job; on_token(token_id) is called from the engine thread, then on_token(None) at the end."""
        self.listeners[job.name] = on_token
        self.pending.put(job)

    def active(self) -> list[str]:
        return [j.name for j in self.batch.jobs]

    def _run(self) -> None:
        while not self._stop.is_set():
            newcomers = []
            while len(self.batch.jobs) + len(newcomers) < self.max_batch:
                try:
                    newcomers.append(self.pending.get(timeout=0.05 if not (self.batch.jobs or newcomers) else 0))
                except queue.Empty:
                    break
            for job in [j for j in newcomers if j.cancelled]:  # left before it was even admitted
                newcomers.remove(job)
                self._finish(job, "cancelled")
            try:
                if newcomers:
                    self.batch.add(newcomers)
                before = list(self.batch.jobs)
                for job, token in self.batch.step():
                    self.listeners[job.name](token)
                for job in before:
                    if job not in self.batch.jobs:
                        self._finish(job, job.finish_reason)
            except Exception as err:  # noqa: BLE001 - one bad step must not kill the server
                self.error = err
                for job in self.batch.jobs + newcomers:
                    self._finish(job, "error")
                self.batch = ContinuousBatch(self.model)

    def _finish(self, job: Job, reason: str) -> None:
        job.finish_reason = job.finish_reason or reason
        listener = self.listeners.pop(job.name, None)
        if listener:
            self.served += 1
            listener(None)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def create_app(model, tokenizer, *, model_name: str = "smollm2-135m-instruct", max_tokens_cap: int = 256,
               max_body_bytes: int = 65_536, max_batch: int = 8) -> FastAPI:
    """The FastAPI app; app.state.engine is the running Engine (stop it with app.state.engine.stop())."""
    app = FastAPI(title="course_lib chat server")
    engine = Engine(model, max_batch=max_batch)
    app.state.engine = engine
    stop_ids = frozenset(end_of_turn_ids(model, tokenizer))
    window = model.config.max_position_embeddings

    @app.get("/health")
    def health():
        return {"status": "ok", "active": engine.active(), "served": engine.served}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "course"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            return _error(413, f"request body of {declared} bytes is over the limit of {max_body_bytes}")
        body = await request.body()
        if len(body) > max_body_bytes:
            return _error(413, f"request body is over the limit of {max_body_bytes} bytes")
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"malformed JSON: {err}")
        if not isinstance(payload, dict):
            return _error(400, "the body must be a JSON object")
        messages = payload.get("messages")
        if not messages:
            return _error(400, "'messages' is missing or empty: send at least one message")
        try:
            validate_messages(messages)
            sampling = SamplingConfig(temperature=float(payload.get("temperature", 0.0)),
                                      top_p=float(payload.get("top_p", 1.0)))
        except (ValueError, TypeError) as err:
            return _error(400, str(err))
        asked = payload.get("max_tokens", payload.get("max_completion_tokens", 128))
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            return _error(422, f"max_tokens must be a positive integer, got {asked!r}")
        prompt = context_ids(tokenizer, messages)
        if len(prompt) >= window:
            return _error(400, f"the prompt has {len(prompt)} tokens but the context window holds {window}; "
                          "shorten the conversation")
        allowed = min(asked, max_tokens_cap, window - len(prompt))
        job = Job(f"chatcmpl-{uuid.uuid4().hex[:12]}", prompt, allowed, stop_ids,
                  None if sampling.temperature == 0 else make_sampler(sampling, seed=payload.get("seed")))
        headers = {"x-max-tokens-clamped": str(allowed)} if allowed < asked else {}
        loop, tokens = asyncio.get_running_loop(), asyncio.Queue()
        engine.submit(job, lambda token: loop.call_soon_threadsafe(tokens.put_nowait, token))
        created = int(time.time())
        if payload.get("stream"):
            return StreamingResponse(_events(job, tokens, tokenizer, model_name, created), headers=headers,
                                     media_type="text/event-stream")
        ids = []
        while (token := await tokens.get()) is not None:
            ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return JSONResponse({
            "id": job.name, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": job.finish_reason}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)}}, headers=headers)

    return app


async def _events(job: Job, tokens: asyncio.Queue, tokenizer, model_name: str, created: int):
    """Server-sent events in OpenAI's chunk format; a disconnect marks the job cancelled."""
    def chunk(delta: dict, finish=None) -> str:
        return "data: " + json.dumps({"id": job.name, "object": "chat.completion.chunk", "created": created,
                                      "model": model_name, "choices": [{"index": 0, "delta": delta,
                                                                        "finish_reason": finish}]}) + "\n\n"
    decoder = IncrementalDecoder(tokenizer)
    try:
        yield chunk({"role": "assistant", "content": ""})
        while (token := await tokens.get()) is not None:
            piece = decoder.push(token)
            if piece:
                yield chunk({"content": piece})
        rest = decoder.flush()
        if rest:
            yield chunk({"content": rest})
        yield chunk({}, job.finish_reason)
        yield "data: [DONE]\n\n"
    finally:
        if job.finish_reason == "":  # the client went away before the end: stop generating for it
            job.cancelled = True


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerHandle:
    """A running server: .url for clients, .stop() to shut down uvicorn and the engine."""

    def __init__(self, app, host: str, port: int):
        import uvicorn
        self.app, self.url = app, f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="course-uvicorn", daemon=True)

    def start(self, timeout: float = 30) -> "ServerHandle":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url} (is the port free?)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.app.state.engine.stop()


def start_server(model, tokenizer, port: int, host: str = "127.0.0.1", **options) -> ServerHandle:
    """Serve on host:port in a background thread. Only loopback addresses are allowed."""
    if host not in LOOPBACK:
        raise ValueError(f"this teaching server listens on loopback only ({', '.join(LOOPBACK)}), not {host!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer between 1 and 65535, got {port!r}")
    return ServerHandle(create_app(model, tokenizer, **options), host, port).start()
