"""Serving: the whole pipeline behind an OpenAI-compatible HTTP endpoint, streaming as it generates.

What it does: `Engine` runs course_lib's continuous batching loop in a background thread and hands
each request its tokens as they are produced; `create_app` builds a FastAPI app with
POST /v1/chat/completions (JSON or, with "stream": true, server-sent events), GET /v1/models and
GET /health; `start_server` runs it with uvicorn on 127.0.0.1 only, on the port you choose, and
returns a handle whose stop() shuts everything down. Requests are read by openai_api (OpenAI's
dialect and defaults; every error, unknown routes included, in OpenAI's error shape); stop strings
go through the same generation.Stopper as in a notebook; response_format (json_schema, json_object)
puts lesson 15's grammar mask in front of the picker. max_tokens above the cap is clamped to it
(the header x-max-tokens-clamped says so); a client that disconnects, streaming or not, is dropped
from the batch at the next step. Loopback only by default; allow_network=True opts in to a local
network, with a generated API key and a concurrency cap.
With kv_cache="paged" the engine serves from the course's own model on lesson 13's paged cache
(prefix caching, preemption instead of failure when the pool is full, chunked prefill within a per-step
token budget with token_budget=N); /health then reports the pool. A request the engine could not serve
(an engine error, or a scheduler's refusal) reaches the client as an error (HTTP 500/503, or an error
event in a stream), never as finish_reason "stop".
What it does not do: TLS or user accounts.
"""
from __future__ import annotations

import asyncio
import collections
from contextlib import asynccontextmanager
import json
import queue
import secrets
import socket
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batching import ContinuousBatch, Job
from .context import context_ids
from .generation import FAILURES, FINISH_REASON, IncrementalDecoder, Stopper, end_of_turn_ids
from .request import HoldBack, cut_at_stop
from .openai_api import ApiError, error_body, parse_chat_request
from .paged import blocks_for
from .sampling import SamplingConfig, make_sampler

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Engine:
    """A background thread that owns the model and serves jobs by continuous batching.
    start() launches the thread (the app's lifespan does it when the server starts); stop() ends it."""

    def __init__(self, model, max_batch: int = 8, make_batch=None):
        self.model, self.max_batch = model, max_batch
        self.make_batch = make_batch or (lambda: ContinuousBatch(model))  # a fresh scheduler (after an error too)
        self.pending: queue.Queue = queue.Queue()
        self.listeners: dict[str, callable] = {}
        self.batch = self.make_batch()
        self.served, self.error = 0, None
        self.finished: collections.deque = collections.deque(maxlen=64)  # (job name, stop reason), newest last
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="course-engine", daemon=True)

    def start(self) -> "Engine":
        if not self.thread.is_alive() and not self._stop.is_set():
            self.thread.start()
        return self

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
                    self.batch.add(newcomers)  # note: a scheduler may refuse a job here (finish reason "rejected")
                before = list(self.batch.jobs)
                for job, token in self.batch.step():
                    self.listeners[job.name](token)
                for job in newcomers + before:
                    if job not in self.batch.jobs:
                        self._finish(job, job.finish_reason)
            except Exception as err:  # noqa: BLE001 - one bad step must not kill the server
                self.error = err
                for job in self.batch.jobs + newcomers:
                    job.finish_reason = "error"  # note: overrides any stop: the client must not read it as done
                    self._finish(job, "error")
                self.batch = self.make_batch()

    def _finish(self, job: Job, reason: str) -> None:
        listener = self.listeners.pop(job.name, None)
        if listener is None:  # already finished (or never submitted here)
            return
        job.finish_reason = job.finish_reason or reason
        self.finished.append((job.name, job.finish_reason))
        self.served += 1
        listener(None)

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


KV_CACHES = ("contiguous", "paged")


def paged_engine(model, max_batch: int, kv_blocks: int | None = None, token_budget: int | None = None,
                 prefix_caching: bool = True):
    """(the course's model, a factory of PagedBatch schedulers on a fresh pool) for Engine: lesson 13's paged
    cache with preemption. A transformers model is rewritten as model.Model on its weights.
    kv_blocks: the pool's size (default: one whole context window's worth); token_budget: tokens per step
    (chunked prefill; None = each prompt whole); prefix_caching: reuse the blocks of shared prompt prefixes."""
    from .batching import PagedBatch, check_budget
    from .model import Model
    from .paged import PagedKVCache
    check_budget(token_budget, max_batch)  # note: now, not in the engine thread
    ours = model if isinstance(model, Model) else Model.from_transformers(model)
    blocks = kv_blocks if kv_blocks is not None else blocks_for(ours.config.max_position_embeddings + 1)
    return ours, lambda: PagedBatch(ours, PagedKVCache.for_model(ours, blocks, prefix_caching=prefix_caching),
                                    "preempt", max_batch, token_budget=token_budget)


def create_app(model, tokenizer, *, model_name: str = "smollm2-135m-instruct", max_tokens_cap: int = 256,
               max_body_bytes: int = 65_536, max_batch: int = 8, api_key: str | None = None,
               max_concurrent: int | None = None, kv_cache: str = "contiguous", kv_blocks: int | None = None,
               token_budget: int | None = None, prefix_caching: bool = True) -> FastAPI:
    """The FastAPI app; app.state.engine is its Engine, started and stopped with the app (its lifespan).
    api_key: if given, every /v1 request needs "Authorization: Bearer <api_key>" (401 otherwise).
    max_concurrent: requests in flight at once; more get 429 (None: no cap).
    kv_cache: "contiguous" (continuous batching on the model as given) or "paged" (lesson 13: the course's
    own model on a paged pool of kv_blocks blocks, with prefix caching and preemption; token_budget=N reads
    prompts in chunks so that at most N tokens run per step, and prefix_caching=False turns prefix reuse off)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    make_batch = None
    if kv_cache == "paged":
        model, make_batch = paged_engine(model, max_batch, kv_blocks, token_budget, prefix_caching)
    elif token_budget is not None or not prefix_caching:
        raise ValueError("token_budget and prefix_caching are options of the paged cache: pass kv_cache='paged'")
    engine = Engine(model, max_batch=max_batch, make_batch=make_batch)

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="course_lib chat server", lifespan=lifespan)
    app.state.engine = engine
    stop_ids = frozenset(end_of_turn_ids(model, tokenizer))
    window = model.config.max_position_embeddings
    in_flight = [0]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, err: StarletteHTTPException):  # unknown routes, wrong methods: OpenAI's shape
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return _error(err.status_code, str(err.detail), code=code)

    def refused(request: Request) -> JSONResponse | None:
        """401 unless the request carries the key (when there is one). note: checked in each /v1 route, not in
        an HTTP middleware: Starlette's middleware wrapper hides client disconnects from the route."""
        if api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return _error(401, "a valid API key is required: send 'Authorization: Bearer <key>' "
                      "(the key was printed when the server started)", code="invalid_api_key")

    @app.get("/health")
    def health():
        body = {"status": "ok", "active": engine.active(), "served": engine.served}
        pool = getattr(engine.batch, "pool", None)
        if pool is not None:  # the paged cache: how full the pool is
            body["kv_blocks"] = {"used": pool.manager.num_used, "total": pool.manager.num_blocks,
                                 "prefix_hit_rate": round(pool.hit_rate, 4)}
        return body

    @app.get("/v1/models")
    def models(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "course"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (denied := refused(request)) is not None:
            return denied
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
        try:
            req = parse_chat_request(payload, model_name=model_name)
            sampling = SamplingConfig(temperature=req.temperature, top_p=req.top_p)
        except ApiError as err:
            return _error(err.status, err.message, err.kind, err.param, err.code)
        prompt = context_ids(tokenizer, req.messages)
        if len(prompt) >= window:
            return _error(400, f"the prompt has {len(prompt)} tokens but the context window holds {window}; "
                          "shorten the conversation", param="messages", code="context_length_exceeded")
        if max_concurrent is not None and in_flight[0] >= max_concurrent:
            return _error(429, f"the server is busy ({max_concurrent} requests in flight); retry shortly",
                          "rate_limit_error", code="too_many_requests")
        fits = getattr(engine.batch, "fits", None)  # the paged scheduler: what its pool can ever hold
        if fits is not None and not fits(len(prompt) + 1):
            return _error(400, f"the prompt has {len(prompt)} tokens but this server's KV memory holds "
                          f"{engine.batch.capacity}; shorten the conversation",
                          param="messages", code="context_length_exceeded")
        allowed = min(req.max_tokens, max_tokens_cap, window - len(prompt))
        if fits is not None:  # note: what the whole pool can hold, so a request is never cut short after it began
            allowed = min(allowed, engine.batch.capacity - len(prompt))
        pick = None if sampling.temperature == 0 else make_sampler(sampling, seed=req.seed)
        if req.schema is not None:  # structured output: a grammar mask in front of the picker (lesson 15)
            from .sampling import greedy
            from .structured import SchemaError, SchemaMask, masked_pick
            try:
                pick = masked_pick(SchemaMask(tokenizer, req.schema), pick or greedy)
            except SchemaError as err:
                return _error(400, str(err), param="response_format", code="invalid_schema")
        job = Job(f"chatcmpl-{uuid.uuid4().hex[:12]}", prompt, allowed, stop_ids, pick,
                  stopper=Stopper(tokenizer, stop_ids, allowed, window - len(prompt), req.stop), cache_salt=req.cache_salt)
        headers = {"x-max-tokens-clamped": str(allowed)} if allowed < req.max_tokens else {}
        loop, tokens = asyncio.get_running_loop(), asyncio.Queue()
        in_flight[0] += 1

        def on_token(token):
            if token is None:
                in_flight[0] -= 1
            loop.call_soon_threadsafe(tokens.put_nowait, token)

        engine.submit(job, on_token)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_events(job, tokens, tokenizer, model_name, created, len(prompt), req.include_usage),
                                     headers=headers, media_type="text/event-stream")
        ids, checked = [], loop.time()
        while True:
            try:
                token = await asyncio.wait_for(tokens.get(), timeout=0.25)
            except asyncio.TimeoutError:
                token = ...  # nothing yet
            if loop.time() - checked > 0.25:  # note: look for a vanished client a few times a second
                checked = loop.time()
                if await request.is_disconnected():  # it went away: stop generating for it
                    job.cancelled = True
                    return JSONResponse(error_body("client disconnected"), status_code=499)
            if token is None:
                break
            if token is not ...:
                ids.append(token)
        if job.finish_reason in FAILURES:
            return _failure(job)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if job.finish_reason == "stop_string":  # the stop string ends the answer and is not part of it
            text = cut_at_stop(text, job.stopper.stop_strings)
        return JSONResponse({
            "id": job.name, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": FINISH_REASON.get(job.finish_reason, "stop")}],
            "usage": _usage(len(prompt), len(ids))}, headers=headers)

    return app


def _failure_body(job: Job) -> tuple[int, dict]:
    """(HTTP status, OpenAI-shaped error) for a request the engine could not serve."""
    if job.finish_reason == "rejected":
        return 503, error_body("the server's KV memory cannot hold this request now; retry later or ask for fewer "
                               "tokens", "server_error", code="kv_cache_full")
    return 500, error_body("the engine failed while generating this answer; the server log has the error",
                           "server_error", code="engine_error")


def _failure(job: Job) -> JSONResponse:
    status, body = _failure_body(job)
    return JSONResponse(body, status_code=status)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _events(job: Job, tokens: asyncio.Queue, tokenizer, model_name: str, created: int, prompt_tokens: int = 0,
                  include_usage: bool = False):
    """Server-sent events in OpenAI's chunk format; a disconnect marks the job cancelled. With include_usage,
    a last chunk with no choices carries the token counts (stream_options: {"include_usage": true})."""
    def chunk(delta: dict, finish=None, **extra) -> str:
        body = {"id": job.name, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else []}
        if include_usage:
            body["usage"] = extra.get("usage")
        return "data: " + json.dumps(body) + "\n\n"
    decoder, count = IncrementalDecoder(tokenizer), 0
    hold = HoldBack(getattr(job.stopper, "stop_strings", ()))  # a stop string is never sent, even in part
    try:
        yield chunk({"role": "assistant", "content": ""})
        while (token := await tokens.get()) is not None:
            count += 1
            piece = hold.push(decoder.push(token))
            if piece:
                yield chunk({"content": piece})
        rest = hold.push(decoder.flush()) + hold.flush()
        if rest:
            yield chunk({"content": rest})
        if job.finish_reason in FAILURES:  # the headers are sent: the error goes in the stream, as OpenAI's does
            yield "data: " + json.dumps(_failure_body(job)[1]) + "\n\n"
            return
        yield chunk({}, FINISH_REASON.get(job.finish_reason, "stop"))
        if include_usage:
            yield chunk(None, usage=_usage(prompt_tokens, count))
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

    def __init__(self, app, host: str, port: int, api_key: str | None = None):
        import uvicorn
        self.app, self.url, self.api_key = app, f"http://{host}:{port}", api_key
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


def start_server(model, tokenizer, port: int, host: str = "127.0.0.1", *, allow_network: bool = False,
                 api_key: str | None = None, max_concurrent: int = 8, **options) -> ServerHandle:
    """Serve on host:port in a background thread. Loopback only, unless allow_network=True: then the server
    may listen on a local-network address (for a workshop room), with a warning, an API key generated
    now and printed (clients send it as their bearer token; 401 without it) and at most max_concurrent
    requests in flight. api_key may also be set on loopback. options go to create_app, for example
    kv_cache="paged" (lesson 13). Example: start_server(model, tokenizer, free_port(), kv_cache="paged")"""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer between 1 and 65535, got {port!r}")
    if host not in LOOPBACK:
        if not allow_network:
            raise ValueError(f"this teaching server listens on loopback only ({', '.join(LOOPBACK)}), not {host!r}; "
                             "to let other machines of your network in, pass allow_network=True")
        api_key = api_key or secrets.token_urlsafe(18)
        print(f"WARNING: serving on {host}:{port}, reachable from your local network. Anyone who can reach it "
              f"and holds the key can use this machine's model.\n  API key (give it to your learners): {api_key}\n"
              f"  at most {max_concurrent} requests at once; stop the server when the session ends.")
    app = create_app(model, tokenizer, api_key=api_key, max_concurrent=max_concurrent, **options)
    return ServerHandle(app, host, port, api_key).start()
