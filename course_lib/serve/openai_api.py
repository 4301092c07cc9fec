"""OpenAI's chat-completions dialect: read a request body into checked settings, or refuse it in OpenAI's
error shape; and write the answers back in OpenAI's shapes.

What it does: `parse_chat_request` turns a JSON body into a `ChatRequest` (messages with text parts
joined, max_tokens, temperature, top_p, seed, stop, stream, include_usage, n, logprobs, top_logprobs), applying
OpenAI's defaults (temperature 1, top_p 1, n 1; null means the default) and refusing, with the field's name in
`param`, a value of the wrong type or range, a model name that is not the served one (404 model_not_found),
`n` above the server's limit or with stream, top_logprobs without logprobs or above 20, and every parameter that
would change the answer but is not implemented here (top_k, tools, ...). `error_body` is the one error shape:
{"error": {message, type, param, code}}.
Back out: `usage` (token counts), `logprobs_body` (OpenAI's logprobs object for a choice), `failure_body` /
`failure_response` (a request the engine could not serve, as an error, never as finish_reason "stop") and
`chunk_events` (server-sent events in OpenAI's chunk format, the text through engine.text_out.TextOut: never half
a character, never a stop string; with logprobs, each chunk carries the log-probabilities of the tokens it
completes).
What it does not do: run the model or listen for HTTP (engine_thread.py and serving.py do).
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from ..text.context import validate_messages
from ..engine.request import FAILURES, FINISH_REASON, Job, check_stop_strings
from ..engine.text_out import TextOut


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, the field at fault, and a short code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def bearer_headers(api_key: str | None) -> dict:
    """The HTTP headers an OpenAI client sends for this key ("Authorization: Bearer <key>"); none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object. Example: error_body("bad", param="top_p") -> {"error": {"message": "bad", ...}}"""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    schema: dict | None = None  # response_format json_schema / json_object: the schema the answer must follow
    cache_salt: str = ""  # vLLM's extension: prefix-cache blocks are shared only between requests with the same salt
    n: int = 1  # answers to sample for this prompt (choice i uses seed + i when a seed is given)
    logprobs: bool = False  # return each chosen token's log-probability
    top_logprobs: int = 0  # and the likeliest alternatives at each position (0 to 20)

    @property
    def keep_logprobs(self) -> int | None:
        """What a Job's `logprobs` field takes: None (none kept) or how many alternatives to keep."""
        return self.top_logprobs if self.logprobs else None


# Parameters that would change the answer and that this server does not implement: refused, never ignored.
UNSUPPORTED = {"top_k": None, "tools": None, "tool_choice": None,
               "functions": None, "function_call": None, "logit_bias": None, "presence_penalty": 0,
               "frequency_penalty": 0, "audio": None, "modalities": None,
               "prediction": None, "reasoning_effort": None, "web_search_options": None}


def _number(payload: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = payload.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ApiError(400, f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value!r}", name, "invalid_value")
    return float(value)


def _integer(payload: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    value = payload.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if low is not None and value < low:
        raise ApiError(400, f"'{name}' must be at least {low}, got {value}", name, "invalid_value")
    return value


def _content(message: dict, i: int) -> dict:
    """A message whose content may be a list of text parts, as the text those parts join to."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"message {i}: only text parts are supported, got a {kind!r} part",
                               f"messages[{i}].content", "unsupported_content")
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}
    return message


TOP_LOGPROBS_MAX = 20  # OpenAI's own limit


def parse_chat_request(payload, *, model_name: str, default_max_tokens: int = 128, max_n: int = 8) -> ChatRequest:
    """Check a chat completion body; returns the settings, or raises ApiError naming the field.
    max_n: the most answers one request may ask for (the server's batch size: they run side by side)."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = payload.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist here: this server serves {model_name!r}",
                       "model", "model_not_found")
    for name, neutral in UNSUPPORTED.items():
        value = payload.get(name)
        if value is not None and value != neutral:
            raise ApiError(400, f"'{name}' is not supported by this server (it would change the answer, so it is "
                           "refused rather than ignored)", name, "unsupported_parameter")
    n = _integer(payload, "n", 1, 1)
    if n > max_n:
        raise ApiError(400, f"'n' must be at most {max_n} on this server (its answers run side by side in one "
                       f"batch of {max_n} rows), got {n}", "n", "invalid_value")
    logprobs = payload.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, f"'logprobs' must be true or false, got {logprobs!r}", "logprobs", "invalid_type")
    top = _integer(payload, "top_logprobs", 0, 0)
    if top > TOP_LOGPROBS_MAX:
        raise ApiError(400, f"'top_logprobs' must be between 0 and {TOP_LOGPROBS_MAX}, got {top}", "top_logprobs",
                       "invalid_value")
    if top and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    messages = payload.get("messages")
    if not messages:
        raise ApiError(400, "'messages' is missing or empty: send at least one message", "messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list of messages", "messages", "invalid_type")
    messages = [_content(m, i) for i, m in enumerate(messages)]
    try:
        validate_messages(messages)
    except (ValueError, TypeError) as err:
        raise ApiError(400, str(err), "messages") from None
    asked = payload.get("max_completion_tokens", payload.get("max_tokens"))
    field = "max_completion_tokens" if payload.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer({field: asked}, field, default_max_tokens, 1)
    stop = payload.get("stop")
    try:
        stop = check_stop_strings([stop] if isinstance(stop, str) else stop)
    except (TypeError, ValueError) as err:
        raise ApiError(400, f"'stop' must be a string or a list of up to 4 strings: {err}", "stop") from None
    if len(stop) > 4:
        raise ApiError(400, "'stop' takes at most 4 strings", "stop")
    stream = payload.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", "stream", "invalid_type")
    if stream and n > 1:
        raise ApiError(400, "'n' above 1 is not supported with 'stream' here: ask without streaming, or send n "
                       "requests", "n", "unsupported_value")
    options = payload.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    salt = payload.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "'cache_salt' must be a non-empty string (requests share cached prefixes only with the "
                       "same salt)", "cache_salt", "invalid_type")
    return ChatRequest(messages, max_tokens, schema=_response_format(payload.get("response_format")),
                       cache_salt=salt or "",
                       temperature=_number(payload, "temperature", 1.0, 0.0, 2.0),
                       top_p=_number(payload, "top_p", 1.0, 0.0, 1.0, low_open=True),
                       seed=_integer(payload, "seed", None), stop=stop, stream=stream,
                       include_usage=bool(options.get("include_usage")) and stream,
                       n=n, logprobs=bool(logprobs), top_logprobs=top)


def _response_format(fmt) -> dict | None:
    """OpenAI's response_format: {"type": "text"} (or absent), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}. Returns the schema to enforce."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format", "invalid_value")
    if fmt["type"] == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                       "response_format", "invalid_value")
    return spec["schema"]


def failure_body(job: Job) -> tuple[int, dict]:
    """(HTTP status, OpenAI-shaped error) for a request the engine could not serve."""
    if job.finish_reason == "rejected":
        return 503, error_body("the server's KV memory cannot hold this request now; retry later or ask for fewer "
                               "tokens", "server_error", code="kv_cache_full")
    return 500, error_body("the engine failed while generating this answer; the server log has the error",
                           "server_error", code="engine_error")


def failure_response(job: Job) -> JSONResponse:
    status, body = failure_body(job)
    return JSONResponse(body, status_code=status)


def _entry(token, logprob: float) -> dict:
    return {"token": token.text, "logprob": logprob, "bytes": list(token.raw)}


def logprobs_body(tokenizer, ids: list[int], trace: list) -> dict:
    """OpenAI's logprobs object for these generated tokens: {"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}. `trace` is the Job's logprob_trace, one (logprob, [(id, logprob), ...]) per token."""
    from ..text.tokenization import tokens_of
    content = []
    for token, (logprob, top) in zip(tokens_of(tokenizer, ids), trace):
        others = tokens_of(tokenizer, [i for i, _ in top])
        content.append({**_entry(token, logprob), "top_logprobs": [_entry(t, lp) for t, (_, lp) in zip(others, top)]})
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def chunk_events(job: Job, tokens: asyncio.Queue, tokenizer, model_name: str, created: int, prompt_tokens: int = 0,
                  include_usage: bool = False):
    """Server-sent events in OpenAI's chunk format; a disconnect marks the job cancelled. With include_usage,
    a last chunk with no choices carries the token counts (stream_options: {"include_usage": true})."""
    ids, sent = [], 0  # the tokens so far; how many of them a chunk's logprobs have covered

    def chunk(delta: dict, finish=None, **extra) -> str:
        nonlocal sent
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if job.logprobs is not None and delta is not None:
            choice["logprobs"] = logprobs_body(tokenizer, ids[sent:], job.logprob_trace[sent:len(ids)])
            sent = len(ids)
        body = {"id": job.name, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [choice] if delta is not None else []}
        if include_usage:
            body["usage"] = extra.get("usage")
        return "data: " + json.dumps(body) + "\n\n"
    out = TextOut(tokenizer, getattr(job.stopper, "stop_strings", ()))  # a stop string is never sent
    try:
        yield chunk({"role": "assistant", "content": ""})
        while (token := await tokens.get()) is not None:
            ids.append(token)
            piece = out.push(token)
            if piece:
                yield chunk({"content": piece})
        rest = out.flush()
        if rest:
            yield chunk({"content": rest})
        if job.finish_reason in FAILURES:  # the headers are sent: the error goes in the stream, as OpenAI's does
            yield "data: " + json.dumps(failure_body(job)[1]) + "\n\n"
            return
        yield chunk({}, FINISH_REASON.get(job.finish_reason, "stop"))
        if include_usage:
            yield chunk(None, usage=usage(prompt_tokens, len(ids)))
        yield "data: [DONE]\n\n"
    finally:
        if job.finish_reason == "":  # the client went away before the end: stop generating for it
            job.cancelled = True
