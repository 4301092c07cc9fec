"""Prefill and decode apart (lesson 18): one process reads prompts into paged blocks and ships them, with their
block table's tokens and positions, over a local socket to another process that continues each request.

What it does: `pack` turns a prefilled sequence's blocks into one frame (a JSON header, then every layer's keys
and values of its slots, in float32, bfloat16 or 8 bits with a scale per token and head); `read_frame` reads one
frame from a socket and refuses a truncated one; `DecodeSide` expects requests by name, refuses blocks for a
request it does not expect or blocks made for another cache, writes accepted blocks into its own pool
(`unpack`) and decodes greedily from them; `serve_prefill` is the prefill process's loop (127.0.0.1 only) and
`PrefillProcess` starts and stops it.
What it does not do: schedule (the decode side runs one request at a time), retry, or move blocks between
machines (NIXL and Mooncake do that over RDMA).
"""
from __future__ import annotations

import json
import multiprocessing
import socket
import struct
import time

import torch

from ..runner.blocks import Sequence

MAGIC = b"KVX1"
WIRE_FORMATS = ("float32", "bfloat16", "int8")


class TransferError(ValueError):
    """A transfer the decode side refuses: truncated, for an unknown request, or for a different cache."""


def _slots(seq: Sequence, block_size: int, tokens: int) -> torch.Tensor:
    return torch.tensor([seq.slot(p, block_size) for p in range(tokens)], dtype=torch.long)


def _encode(t: torch.Tensor, fmt: str) -> list[bytes]:
    """(N, KV, D) keys or values as bytes in the wire format (int8: the numbers, then a float16 scale per row and head)."""
    if fmt == "int8":
        scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # (N, KV, 1)
        q = (t / scale).round().clamp(-127, 127).to(torch.int8)
        return [q.contiguous().cpu().numpy().tobytes(), scale.to(torch.float16).contiguous().cpu().numpy().tobytes()]
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    return [t.to(dtype).contiguous().view(torch.uint8).cpu().numpy().tobytes()]


def _decode(data: memoryview, n: int, kv: int, d: int, fmt: str) -> tuple[torch.Tensor, int]:
    """The inverse of _encode: ((n, kv, d) float32, bytes used)."""
    if fmt == "int8":
        size = n * kv * d
        q = torch.frombuffer(bytearray(data[:size]), dtype=torch.int8).view(n, kv, d).float()
        scale = torch.frombuffer(bytearray(data[size:size + 2 * n * kv]), dtype=torch.float16).view(n, kv, 1).float()
        return q * scale, size + 2 * n * kv
    width = 4 if fmt == "float32" else 2
    size = n * kv * d * width
    raw = torch.frombuffer(bytearray(data[:size]), dtype=torch.uint8)
    return raw.view(torch.float32 if fmt == "float32" else torch.bfloat16).view(n, kv, d).float(), size


def pack(pool, seq: Sequence, name: str, first_token: int, fmt: str = "float32", **extra) -> bytes:
    """One frame: MAGIC, the header's length (8 bytes), the header (JSON: the request's name, its tokens, how many
    are computed, the cache's shape, the wire format, the first token picked, the payload's length), then every
    layer's keys and values of the computed tokens' slots."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"the wire format is one of {WIRE_FORMATS}, got {fmt!r}")
    slots = _slots(seq, pool.block_size, seq.computed)
    parts = []
    for keys, values in zip(pool.keys, pool.values):
        parts += _encode(keys[slots].cpu(), fmt) + _encode(values[slots].cpu(), fmt)
    payload = b"".join(parts)
    header = {"request": name, "tokens": list(seq.tokens), "computed": seq.computed, "first_token": first_token,
              "layers": len(pool.keys), "kv_heads": pool.keys[0].shape[1], "head_dim": pool.keys[0].shape[2],
              "format": fmt, "payload_bytes": len(payload), **extra}
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + payload


def _read_exactly(sock: socket.socket, n: int, what: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise TransferError(f"truncated transfer: the {what} should be {n:,} bytes, the connection closed after "
                                f"{got:,}")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> tuple[dict, bytes]:
    """(header, payload) of the next frame; TransferError if it is not one or is cut short."""
    start = _read_exactly(sock, len(MAGIC) + 8, "frame's start")
    if start[:len(MAGIC)] != MAGIC:
        raise TransferError(f"not a KV transfer frame (it starts with {start[:len(MAGIC)]!r}, expected {MAGIC!r})")
    (length,) = struct.unpack("<Q", start[len(MAGIC):])
    header = json.loads(_read_exactly(sock, length, "header"))
    return header, _read_exactly(sock, header["payload_bytes"], "payload")


def unpack(pool, header: dict, payload: bytes) -> Sequence:
    """Write a frame's keys and values into fresh blocks of this pool; the sequence that owns them."""
    shape = (len(pool.keys), pool.keys[0].shape[1], pool.keys[0].shape[2])
    sent = (header["layers"], header["kv_heads"], header["head_dim"])
    if shape != sent:
        raise TransferError(f"the blocks were made for a cache of (layers, KV heads, head size) {sent}, this decode "
                            f"side holds {shape}")
    seq = Sequence(list(header["tokens"]))
    n = header["computed"]
    pool.grow(seq, n + 1)  # note: raises OutOfBlocks (keeping what it got) when the pool is full: freed below
    try:
        slots, view, at = _slots(seq, pool.block_size, n), memoryview(payload), 0
        kv, d = shape[1], shape[2]
        for keys, values in zip(pool.keys, pool.values):
            for target in (keys, values):
                block, used = _decode(view[at:], n, kv, d, header["format"])
                target[slots.to(target.device)] = block.to(target.dtype).to(target.device)
                at += used
        if at != len(payload):
            raise TransferError(f"the payload holds {len(payload):,} bytes, the header's shape accounts for {at:,}")
    except Exception:
        pool.free(seq)
        raise
    seq.computed = n
    return seq


class DecodeSide:
    """The decode process's end: it is told which requests to expect (and how many tokens each may have), accepts
    their blocks into its own pool and continues each one greedily."""

    def __init__(self, model, num_blocks: int):
        from ..runner.paged import BlockPool
        self.model, self.pool = model, BlockPool.for_model(model, num_blocks, prefix_caching=False)
        self.expected: dict[str, int] = {}

    def expect(self, name: str, new_tokens: int) -> None:
        self.expected[name] = new_tokens

    def accept(self, header: dict, payload: bytes) -> tuple[Sequence, int]:
        """The request's sequence, in this pool, and its allowance. Refuses a request nobody announced."""
        name = header.get("request")
        if name not in self.expected:
            raise TransferError(f"blocks arrived for request {name!r}, which this decode side does not expect "
                                f"(expecting {sorted(self.expected) or 'none'})")
        return unpack(self.pool, header, payload), self.expected.pop(name)

    @torch.inference_mode()
    def step(self, seq: Sequence, token: int) -> int:
        """One decode step of one sequence through its block table: feed `token`, return the next, greedily."""
        from ..engine.stages import decode_step
        seq.tokens.append(token)
        self.pool.grow(seq, seq.computed + 1)
        view = self.pool.view([seq])
        logits, _ = decode_step(self.model, [token], view, attention_mask=view.attention_mask(1),
                                positions=view.positions())
        return int(logits[0].argmax())

    def decode(self, seq: Sequence, first_token: int, new_tokens: int, stop_ids=()) -> list[int]:
        """Greedy tokens from the shipped blocks: the first token (picked by the prefill side), then one decode step
        per token through the block table, as the paged scheduler runs them. The blocks are freed at the end."""
        tokens = [first_token]
        try:
            while len(tokens) < new_tokens and tokens[-1] not in stop_ids:
                tokens.append(self.step(seq, tokens[-1]))
        finally:
            self.pool.free(seq)
        return tokens


@torch.inference_mode()
def prefill_blocks(model, pool, prompt: list[int]) -> tuple[Sequence, int, float]:
    """Read a prompt into fresh blocks of this pool: (its sequence, the first token picked greedily, seconds)."""
    from ..engine.stages import prefill
    seq = Sequence(list(prompt))
    pool.grow(seq, len(seq.tokens))
    began = time.perf_counter()
    logits, _ = prefill(model, seq.tokens, cache=pool.view([seq]))
    first = int(logits[0].argmax())
    return seq, first, time.perf_counter() - began


def serve_prefill(port: int, ready, num_blocks: int = 600, fmt: str = "float32", threads: int = 1) -> None:
    """The prefill process: loads the course's model, listens on 127.0.0.1:port, and for each request (a JSON line:
    {"request": name, "prompt": [ids]}) reads the prompt into its own pool, picks the first token greedily, and
    sends the blocks back as one frame (its prefill seconds in the header). An empty line ends it."""
    from ..loading import load_model
    from ..runner.model import Model
    from ..runner.paged import BlockPool
    torch.set_num_threads(threads)
    library, _ = load_model(device="cpu", verbose=False)
    model = Model.from_transformers(library)
    pool = BlockPool.for_model(model, num_blocks, prefix_caching=False)
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                if not line.strip():
                    break
                ask = json.loads(line)
                seq, first, seconds = prefill_blocks(model, pool, ask["prompt"])
                conn.sendall(pack(pool, seq, ask["request"], first, ask.get("format", fmt), prefill_s=seconds))
                pool.free(seq)


class PrefillProcess:
    """A prefill process on loopback: start() (loads the model: seconds), ask(name, prompt, fmt) -> (header,
    payload, seconds on the wire and waiting), stop()."""

    def __init__(self, port: int | None = None, threads: int = 1):
        from ..runtime import free_port
        self.port = port or free_port()
        context = multiprocessing.get_context("spawn")
        self.ready = context.Event()
        self.process = context.Process(target=serve_prefill, args=(self.port, self.ready), kwargs={"threads": threads},
                                       daemon=True)
        self.sock: socket.socket | None = None

    def start(self, timeout: float = 120) -> "PrefillProcess":
        self.process.start()
        if not self.ready.wait(timeout):
            self.process.terminate()
            raise RuntimeError(f"the prefill process did not start within {timeout:.0f} s "
                               f"(exit code {self.process.exitcode})")
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return self

    def ask(self, name: str, prompt: list[int], fmt: str = "float32") -> tuple[dict, bytes, float]:
        began = time.perf_counter()
        self.send(name, prompt, fmt)
        header, payload = read_frame(self.sock)
        return header, payload, time.perf_counter() - began

    def send(self, name: str, prompt: list[int], fmt: str = "float32") -> None:
        """Ask for a prompt's blocks without waiting: answered() says when they are here, read_frame(.sock) reads them."""
        self.sock.sendall(json.dumps({"request": name, "prompt": list(prompt), "format": fmt}).encode() + b"\n")

    def answered(self) -> bool:
        """Whether the answer to a send() has begun to arrive (the decode side checks between its steps)."""
        import select
        return bool(select.select([self.sock], [], [], 0)[0])

    def stop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.sendall(b"\n")
            except OSError:
                pass
            self.sock.close()
        self.process.join(timeout=15)
        if self.process.is_alive():
            self.process.terminate()
