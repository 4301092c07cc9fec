"""Shared fixtures. The suite is offline: any attempt to reach a non-loopback address fails loudly."""
import ipaddress
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: transformers must never try the hub
_real_connect = socket.socket.connect


def _loopback_only(self, address):
    host = address[0] if isinstance(address, tuple) else None
    if host is not None:
        try:
            ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
        if not ok:
            raise RuntimeError(f"test tried to reach the network ({host}); the course must work offline")
    return _real_connect(self, address)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _loopback_only)


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M-Instruct on the CPU, float32 (loaded once for the whole session)."""
    import course_lib
    return course_lib.load_model(device="cpu", verbose=False)


@pytest.fixture(scope="session")
def model(smol):
    return smol.model


@pytest.fixture(scope="session")
def tokenizer(smol):
    return smol.tokenizer


def chat_ids(tokenizer, question, system="You are a helpful assistant."):
    """The tests' default: the question with the course's short system prompt (context.chat_ids)."""
    from course_lib.context import chat_ids as build
    return build(tokenizer, question, system)
