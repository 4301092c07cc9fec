"""Serving: the whole pipeline behind an OpenAI-compatible HTTP endpoint, streaming as it generates.

What it does: the engine thread (engine_thread.EngineThread) runs the loop in the background and hands each
request its tokens as they are produced; `create_app` builds a FastAPI app with
POST /v1/chat/completions (JSON or, with "stream": true, server-sent events), GET /v1/models and
GET /health; `start_server` runs it with uvicorn on 127.0.0.1 only, on the port you choose, and
returns a handle whose stop() shuts everything down. Requests are read by openai_api (OpenAI's
dialect and defaults; every error, unknown routes included, in OpenAI's error shape); stop strings
go through the same request.Stopper as in a notebook; response_format (json_schema, json_object)
puts lesson 15's grammar mask in front of the picker; n > 1 makes n jobs (answer i seeded with seed + i; on the paged
cache they fork the first one's prompt blocks) and logprobs / top_logprobs come back in OpenAI's shape
(`chat_jobs`, `choice_body`). max_tokens above the cap is clamped to it
(the header x-max-tokens-clamped says so); a client that disconnects, streaming or not, is dropped
from the batch at the next step. Loopback only by default; allow_network=True opts in to a local
network, with a generated API key and a concurrency cap. fmt="int4", compiled=True: the course's model in that
format, decode steps compiled. With kv_cache="paged": the course's own model on lesson 13's paged cache (prefix
caching, preemption instead of failure when the pool is full, chunked prefill within a per-step token budget with
token_budget=N); /health then reports the pool. With kv_cache="slots" (compiled=True): a row per request and each
step one fused C++ call over decode tokens and prompt chunks (engine.slot_scheduler). A request the engine could
not serve (an engine error, or a scheduler's refusal) reaches the client as an error (HTTP 500/503, or an error
event in a stream), never as finish_reason "stop".
What it does not do: TLS or user accounts.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
import json
import secrets
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime import free_port  # noqa: F401 - lessons and tests import it from here, beside start_server
from ..text.context import context_ids
from .engine_thread import KV_CACHES, EngineThread, fast_model, paged_engine, slot_engine
from .openai_api import (ApiError, ChatRequest, bearer_headers, chunk_events, error_body, failure_response,
                         logprobs_body, parse_chat_request, usage)
from ..engine.request import FAILURES, FINISH_REASON, Job, Stopper, end_of_turn_ids
from ..engine.text_out import cut_at_stop
from ..engine.sampling import SamplingConfig, greedy, make_sampler
from ..engine.structured import SchemaError, SchemaMask, masked_pick

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def create_app(model, tokenizer, *, model_name: str = "smollm2-135m-instruct", max_tokens_cap: int = 256,
               max_body_bytes: int = 65_536, max_batch: int = 8, api_key: str | None = None,
               max_concurrent: int | None = None, kv_cache: str = "contiguous", kv_blocks: int | None = None,
               token_budget: int | None = None, prefix_caching: bool = True, fmt: str | None = None,
               compiled: bool = False, rows_int8: int | None = None, slot_capacity: int = 2048) -> FastAPI:
    """The FastAPI app; app.state.engine is its EngineThread, started and stopped with the app (its lifespan).
    api_key: if given, every /v1 request needs "Authorization: Bearer <api_key>" (401 otherwise).
    max_concurrent: requests in flight at once; more get 429 (None: no cap).
    kv_cache: "contiguous" (continuous batching on the model as given) or "paged" (lesson 13: the course's
    own model on a paged pool of kv_blocks blocks, with prefix caching and preemption; token_budget=N reads
    prompts in chunks so that at most N tokens run per step, and prefix_caching=False turns prefix reuse off).
    "slots" (with compiled=True on a format the fused step takes): max_batch rows of slot_capacity columns, each
    step one fused call over the running requests' tokens and prompt chunks within token_budget (engine.slot_scheduler;
    no prefix caching).
    fmt, compiled: the course's own model in that weight format, decode steps compiled (engine_thread.fast_model);
    rows_int8: with fmt="int4", the int8 copy for calls of that many rows or more (runner.formats.Int4Linear)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    model = fast_model(model, fmt, compiled, kv_cache, rows_int8)
    make_batch = None
    if kv_cache == "paged":
        model, make_batch = paged_engine(model, max_batch, kv_blocks, token_budget, prefix_caching)
    elif kv_cache == "slots":
        if not prefix_caching or kv_blocks is not None:
            raise ValueError("kv_blocks and prefix_caching are options of the paged cache; slots have slot_capacity")
        model, make_batch = slot_engine(model, max_batch, token_budget, slot_capacity)
    elif token_budget is not None or not prefix_caching:
        raise ValueError("token_budget and prefix_caching are options of the paged cache: pass kv_cache='paged'")
    engine = EngineThread(model, max_batch=max_batch, make_batch=make_batch)

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
        return engine.health()

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
            req = parse_chat_request(payload, model_name=model_name, max_n=max_batch)
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
        try:
            jobs = chat_jobs(req, sampling, tokenizer, prompt, allowed, stop_ids, window)
        except SchemaError as err:
            return _error(400, str(err), param="response_format", code="invalid_schema")
        headers = {"x-max-tokens-clamped": str(allowed)} if allowed < req.max_tokens else {}
        loop, tokens = asyncio.get_running_loop(), asyncio.Queue()  # (choice, token), None at each end; a stream: tokens
        in_flight[0] += 1
        left = [len(jobs)]

        def listener(index):
            def on_token(token):
                if token is None:
                    left[0] -= 1
                    if left[0] == 0:
                        in_flight[0] -= 1
                loop.call_soon_threadsafe(tokens.put_nowait, token if token is None or req.stream else (index, token))
            return on_token

        engine.submit_all([(job, listener(i)) for i, job in enumerate(jobs)])
        created = int(time.time())
        if req.stream:
            return StreamingResponse(chunk_events(jobs[0], tokens, tokenizer, model_name, created, len(prompt),
                                                  req.include_usage),
                                     headers=headers, media_type="text/event-stream")
        ids, ended, checked = [[] for _ in jobs], 0, loop.time()
        while ended < len(jobs):
            try:
                item = await asyncio.wait_for(tokens.get(), timeout=0.25)
            except asyncio.TimeoutError:
                item = ...  # nothing yet
            if loop.time() - checked > 0.25:  # note: look for a vanished client a few times a second
                checked = loop.time()
                if await request.is_disconnected():  # it went away: stop generating for it
                    for job in jobs:
                        job.cancelled = True
                    return JSONResponse(error_body("client disconnected"), status_code=499)
            if item is None:
                ended += 1
            elif item is not ...:
                ids[item[0]].append(item[1])
        failed = [job for job in jobs if job.finish_reason in FAILURES]
        if failed:
            return failure_response(failed[0])
        return JSONResponse({
            "id": jobs[0].name, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [choice_body(i, job, answer, tokenizer) for i, (job, answer) in enumerate(zip(jobs, ids))],
            "usage": usage(len(prompt), sum(len(a) for a in ids))}, headers=headers)

    return app


def choice_body(index: int, job: Job, ids: list[int], tokenizer) -> dict:
    """One choice of a chat.completion: the answer's text (cut at a stop string, which is not part of it), its
    finish_reason and, when asked for, its logprobs (every generated token, the end-of-turn one included)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if job.finish_reason == "stop_string":  # the stop string ends the answer and is not part of it
        text = cut_at_stop(text, job.stopper.stop_strings)
    body = {"index": index, "message": {"role": "assistant", "content": text},
            "finish_reason": FINISH_REASON.get(job.finish_reason, "stop")}
    if job.logprobs is not None:
        body["logprobs"] = logprobs_body(tokenizer, ids, job.logprob_trace)
    return body


def chat_job(req: ChatRequest, sampling: SamplingConfig, tokenizer, prompt: list[int], allowed: int, stop_ids,
             window: int, index: int = 0, name: str | None = None) -> Job:
    """The engine's Job for a checked chat request (its answer number `index`): its picker (greedy at temperature 0,
    else a sampler seeded with seed + index), with lesson 15's grammar mask in front when the request asks for a
    JSON schema (SchemaError if the schema is not one the mask handles), and its Stopper (end of turn, the
    request's stop strings, the allowance)."""
    seed = None if req.seed is None else req.seed + index
    pick = None if sampling.temperature == 0 else make_sampler(sampling, seed=seed)
    if req.schema is not None:  # structured output: a grammar mask in front of the picker (lesson 15)
        pick = masked_pick(SchemaMask(tokenizer, req.schema), pick or greedy)
    return Job(name or f"chatcmpl-{uuid.uuid4().hex[:12]}", prompt, allowed, stop_ids, pick,
               stopper=Stopper(tokenizer, stop_ids, allowed, window - len(prompt), req.stop), cache_salt=req.cache_salt,
               logprobs=req.keep_logprobs)


def chat_jobs(req: ChatRequest, sampling: SamplingConfig, tokenizer, prompt: list[int], allowed: int, stop_ids,
              window: int) -> list[Job]:
    """The request's n Jobs: the first reads the prompt, the others fork it (`fork_of`: on the paged cache they
    share its blocks, copy-on-write; a contiguous batch prefills each). Answer i is sampled with seed + i, so it
    equals the same request sent alone with n = 1 and that seed."""
    first = chat_job(req, sampling, tokenizer, prompt, allowed, stop_ids, window)
    rest = [chat_job(req, sampling, tokenizer, prompt, allowed, stop_ids, window, i, f"{first.name}-{i}")
            for i in range(1, req.n)]
    for job in rest:
        job.fork_of = first.name
    return [first, *rest]


class ServerHandle:
    """A running server: .url for clients, .stop() to shut down uvicorn and the engine."""

    shared = False  # serve/room.RoomServer is the room's server, which a learner's stop() leaves running

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

    @property
    def headers(self) -> dict:
        """The HTTP headers a raw client sends: the bearer token when the server has a key."""
        return bearer_headers(self.api_key)

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
