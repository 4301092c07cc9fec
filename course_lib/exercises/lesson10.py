"""Checks for 10_serving: build a request body, parse a stream of server-sent events, time to first token."""
from __future__ import annotations

from . import safely, verdict

STREAM = ('data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'
          'data: {"choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": null}]}\n\n'
          'data: {"choices": [{"index": 0, "delta": {"content": "is."}, "finish_reason": null}]}\n\n'
          'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')


def check_body(make_body) -> bool:
    """make_body(question) -> dict for POST /v1/chat/completions: one user message, streaming on, max_tokens 50."""
    ok, got = safely(make_body, "What is the capital of France?")
    if not ok:
        return verdict(False, "", got)
    good = (isinstance(got, dict) and got.get("stream") is True and got.get("max_tokens") == 50
            and got.get("messages") == [{"role": "user", "content": "What is the capital of France?"}])
    return verdict(good, "that body works with any OpenAI-compatible server",
                   f"got {got!r}; expected messages=[{{'role': 'user', 'content': question}}], stream=True, max_tokens=50")


def check_parse(parse_stream) -> bool:
    """parse_stream(raw_text) -> the concatenated content of every chunk of a server-sent-events stream."""
    ok, got = safely(parse_stream, STREAM)
    if not ok:
        return verdict(False, "", got)
    return verdict(got == "Paris.", "you read the stream the way the openai client does",
                   f"got {got!r}, expected 'Paris.'. Hint: lines starting with 'data: ', skip '[DONE]', "
                   "json.loads, then choices[0]['delta'].get('content', '')")


def check_ttft(ttft, arrivals: list[float] | None = None) -> bool:
    """ttft(start, arrival_times) -> seconds from the request (start) to the first piece of content."""
    arrivals = arrivals or [10.4, 10.45, 10.5]
    ok, got = safely(ttft, 10.0, list(arrivals))
    if not ok:
        return verdict(False, "", got)
    want = min(arrivals) - 10.0
    return verdict(isinstance(got, float) and abs(got - want) < 1e-9, "time to first token, as a user feels it",
                   f"expected {want:.2f}, got {got!r}")
