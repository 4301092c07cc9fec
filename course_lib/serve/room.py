"""The room's server (a workshop): the instructor starts one server, the learners' lessons use it.

What it does: `lesson_server` is what lessons 10, 13 and 15 call for their server. With COURSE_SERVER_URL unset it
starts the learner's own server on loopback, as before; with it set (and COURSE_SERVER_KEY, the key the room's
server printed) it checks that the room's server answers and accepts the key, and returns a handle to it whose
`stop()` leaves it running for the others. `room_server` is what `python -m course_lib room` runs on the
instructor's machine: the paged cache (lesson 13, prefix caching: the room's shared system prompts are read
once), a cap on requests in flight, an API key, in float32 (the lessons' tokens), int4 or int4-q8 (lesson 12: fewer bytes
per token, other tokens; int4-q8 through the course's own kernel).
What it does not do: run the compiled step (the server's engine is eager), share one learner's kernel with
another (each notebook still loads its own model for its other sections), or reach beyond loopback unless the
instructor asks for it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

from .openai_api import bearer_headers

ROOM_URL, ROOM_KEY = "COURSE_SERVER_URL", "COURSE_SERVER_KEY"
ROOM_FORMATS = ("float32", "int4", "int4-q8")
ROOM_DEFAULTS = {"kv_cache": "paged", "max_batch": 16, "max_tokens_cap": 256, "token_budget": 256}


class RoomUnreachable(RuntimeError):
    """COURSE_SERVER_URL is set but the server there does not answer, or refuses the key."""


@dataclass
class RoomServer:
    """The room's shared server, seen from a learner's notebook: .url and .api_key for clients, .headers for raw
    HTTP; .stop() leaves it running (it is the instructor's)."""
    url: str
    api_key: str | None = None
    shared: bool = True

    @property
    def headers(self) -> dict:
        return bearer_headers(self.api_key)

    def stop(self) -> None:
        print(f"the room's server at {self.url} keeps running for the others: the instructor stops it")


def room_url(environ=None) -> str | None:
    """COURSE_SERVER_URL, checked (http or https, a host, no path), without a trailing slash; None when unset or empty."""
    value = (os.environ if environ is None else environ).get(ROOM_URL, "").strip()
    if not value:
        return None
    parts = urlparse(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"{ROOM_URL}={value!r} is not a server address such as http://192.168.1.20:8000 (scheme, "
                         f"host and port, no path): fix it, or unset it to start your own server (unset {ROOM_URL})")
    return value.rstrip("/")


def connect(url: str, api_key: str | None, timeout: float = 5.0) -> RoomServer:
    """A handle to the server at url, once it has answered /v1/models with this key. Raises RoomUnreachable."""
    import httpx
    fix = f"ask the instructor whether the room's server runs, or unset {ROOM_URL} to start your own server"
    try:
        reply = httpx.get(url + "/v1/models", headers=bearer_headers(api_key), timeout=timeout)
    except httpx.HTTPError as err:
        raise RoomUnreachable(f"the room's server at {url} ({ROOM_URL}) does not answer "
                              f"({type(err).__name__}): {fix}") from None
    if reply.status_code == 401:
        raise RoomUnreachable(f"the room's server at {url} refuses the key in {ROOM_KEY} "
                              f"({'none was set' if not api_key else 'it is not the one it printed'}): set {ROOM_KEY} "
                              "to the key the instructor gives")
    if reply.status_code != 200 or "data" not in reply.json():
        raise RoomUnreachable(f"{url} answered /v1/models with HTTP {reply.status_code}: it is not a chat server of "
                              f"this course; {fix}")
    return RoomServer(url, api_key)


def lesson_server(model, tokenizer, environ=None, **options):
    """The lesson's server: the room's when COURSE_SERVER_URL is set (options are then the room's to choose: the ones
    given are printed as not applied), else one of the learner's own on loopback (start_server with options)."""
    from .serving import free_port, start_server
    environ = os.environ if environ is None else environ
    url = room_url(environ)
    if url is None:
        return start_server(model, tokenizer, free_port(), **options)
    room = connect(url, environ.get(ROOM_KEY) or None)
    print(f"using the room's server at {url} ({ROOM_URL}): its answers are computed on the instructor's machine, "
          "for the whole room at once" + (f"; its settings apply, not {options}" if options else ""))
    return room


def room_server(model, tokenizer, port: int, host: str = "127.0.0.1", fmt: str = "float32", max_concurrent: int = 32,
                api_key: str | None = None, **options):
    """The room's server: the course's model in fmt on the paged cache (ROOM_DEFAULTS, overridden by options).
    host other than loopback opens it to the network (start_server's allow_network: a key, a warning)."""
    import torch
    from ..runner.formats import convert
    from ..runner.model import Model
    from .serving import LOOPBACK, start_server
    if fmt not in ROOM_FORMATS:
        raise ValueError(f"the room's server runs in one of {ROOM_FORMATS}, not {fmt!r}")
    ours = model if isinstance(model, Model) else Model.from_transformers(model, dtype=torch.float32)
    if fmt != "float32":
        ours = convert(ours, fmt)
    return start_server(ours, tokenizer, port, host, allow_network=host not in LOOPBACK, api_key=api_key,
                        max_concurrent=max_concurrent, **{**ROOM_DEFAULTS, **options})
