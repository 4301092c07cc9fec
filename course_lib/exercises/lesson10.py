"""Checks for 10_serving: build a request body, parse a stream of server-sent events, time to first token."""
from __future__ import annotations

import json

from . import check_prediction, fresh, safely, verdict

PIECES = ["Par", "is", ".", " The", " capital", " é", "té", " 東京", "👋", " naïve", " 42", "\n", " \"quoted\""]
QUESTIONS = ["Name three colours.", "Why is the sky blue?", "Qu'est-ce que c'est ?", "How far is the Moon?"]  # not the lesson's

STREAM = ('data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'
          'data: {"choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": null}]}\n\n'
          'data: {"choices": [{"index": 0, "delta": {"content": "is."}, "finish_reason": null}]}\n\n'
          'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')


def sse_stream(pieces: list[str], finish: str = "stop") -> str:
    """A server-sent-events body as the course's server writes it: a role chunk, one chunk per piece, a chunk with
    the finish reason, then [DONE]."""
    def chunk(delta, reason=None):
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]},
                                     ensure_ascii=False) + "\n\n"
    return (chunk({"role": "assistant", "content": ""}) + "".join(chunk({"content": p}) for p in pieces)
            + chunk({}, finish) + "data: [DONE]\n\n")


def check_body(make_body) -> bool:
    """make_body(question) -> dict for POST /v1/chat/completions: one user message, streaming on, max_tokens 50."""
    question = fresh().choice(QUESTIONS)
    ok, got = safely(make_body, question)
    if not ok:
        return verdict(False, "", got)
    good = (isinstance(got, dict) and got.get("stream") is True and got.get("max_tokens") == 50
            and got.get("messages") == [{"role": "user", "content": question}])
    return verdict(good, "that body works with any OpenAI-compatible server",
                   f"for the question {question!r} got {got!r}. Hint: messages=[{{'role': 'user', 'content': question}}], "
                   "stream=True, max_tokens=50")


def check_parse(parse_stream) -> bool:
    """parse_stream(raw_text) -> the concatenated content of every chunk of a server-sent-events stream.
    Three random streams (multi-byte pieces, a length or stop finish chunk) besides the fixed one."""
    rng = fresh()
    streams = [(STREAM, "Paris.")]
    for _ in range(3):
        pieces = [rng.choice(PIECES) for _ in range(rng.randint(1, 8))]
        streams.append((sse_stream(pieces, rng.choice(["stop", "length"])), "".join(pieces)))
    for raw, want in streams:
        ok, got = safely(parse_stream, raw)
        if not ok:
            return verdict(False, "", got)
        if got != want:
            return verdict(False, "", f"on the stream {raw[:160]!r}... you returned {got!r}. Hint: lines starting with "
                           "'data: ', skip '[DONE]', json.loads, then choices[0]['delta'].get('content', '')")
    return verdict(True, "you read the stream the way the openai client does", "")


def check_ttft(ttft, arrivals: list[float] | None = None) -> bool:
    """ttft(start, arrival_times) -> seconds from the request (start) to the first piece of content."""
    rng = fresh()
    cases = [(10.0, list(arrivals))] if arrivals else []
    for _ in range(3):
        start = round(rng.uniform(0, 100), 3)
        cases.append((start, sorted(round(start + rng.uniform(0.01, 3.0), 3) for _ in range(rng.randint(2, 6)))))
    for start, times in cases:
        ok, got = safely(ttft, start, list(times))
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, float) or abs(got - (min(times) - start)) > 1e-9:
            return verdict(False, "", f"for start {start} and pieces arriving at {times} you returned {got!r}. "
                           "Hint: the user waits from the request until the first piece arrives")
    return verdict(True, "time to first token, as a user feels it", "")


def mean_ttft(url: str, clients: int, max_tokens: int = 40) -> float:
    """Seconds to the first content piece, averaged over `clients` streaming requests sent at once: section 3's load
    test, through measure.load.replay (so the check can run after the lesson's server is stopped)."""
    from ..measure.load import TraceRequest, replay
    trace = [TraceRequest(f"c{i}", "chat", 0.0, [{"role": "user", "content": f"Tell me about the number {i}."}],
                          max_tokens) for i in range(clients)]
    outcomes, _ = replay(url, trace, timeout=120)
    missing = [o.error or "no text" for o in outcomes if o.ttft is None]
    if missing:
        raise RuntimeError(f"{len(missing)} of {clients} streams sent no text: {missing[0]}")
    return sum(o.ttft for o in outcomes) / clients


def check_load_prediction(prediction_ms, model, tokenizer, clients: int = 4, tolerance: float = 1.6) -> bool:
    """prediction_ms: your prediction, written BEFORE this runs, of the mean time to first token when `clients`
    requests arrive at once (section 3 measured 1 and 8). The check starts a server on loopback, measures, stops it."""
    def measure():
        from ..serve.serving import free_port, start_server
        server = start_server(model, tokenizer, port=free_port())
        try:
            mean_ttft(server.url, 1)  # warm-up: the first request of a server pays extra
            return 1000 * mean_ttft(server.url, clients)
        finally:
            server.stop()
    return check_prediction(prediction_ms, measure, unit="ms", what=f"mean time to first token, {clients} clients",
                            tolerance=tolerance, timed=True, hint="Section 3's two rows bracket it: the prompts arriving together "
                                                      "are prefilled together, and each client waits for that")
