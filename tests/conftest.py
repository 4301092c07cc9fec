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
    from course_lib.text.context import chat_ids as build
    return build(tokenizer, question, system)


@pytest.fixture(scope="session")
def tiny(tokenizer):
    """A tiny random llama built from a config (2 layers, hidden size 64, 4 query and 2 key/value heads) with
    the real tokenizer's vocabulary and end-of-turn token: for tests of mechanics that hold for any model
    (cache operations, paging, batching, speculative identity), about a hundred times cheaper per token
    than the real one. Its weights are drawn wide (std 0.5) so greedy choices are not near-ties."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=100_000.0, tie_word_embeddings=True, initializer_range=0.5,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=2)
    return model
