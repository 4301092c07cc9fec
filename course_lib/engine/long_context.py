"""Long context (lesson 17): what a long text costs, what happens at the end of the window, and two things engines
do about it.

What it does: counts the bytes per token of a cache in each format (`cache_bytes_per_token` over `KV_FORMATS`:
float32, bfloat16, int8 and int4 with one float16 scale per token and head) and the context at which the cache
outweighs the weights (`crossover_tokens`); holds two caches that meet the course's cache contract: `WindowCache` (at most `budget`
tokens: the first `sinks` and the most recent, StreamingLLM's attention sinks, Xiao et al. 2023; positions are
slots in the cache, so kept keys are turned back when older ones leave) and `QuantizedKVCache` (keys and values
stored in 8 or 4 bits, dequantized when attention reads them); runs a long text through the model under one of
`STRATEGIES` and returns each token's loss (`stream_loss`); measures how much attention the first tokens get
(`first_token_share`); loads the course's long text (`long_text_ids`) and
builds the needle prompt (`needle_ids`, `found`).
What it does not do: time anything or choose sizes for a machine (measure/long_context.py), draw (plots_long.py),
or quantize the paged pool (paged.py keeps its blocks in the model's dtype).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runner.attention import apply_rotary
from ..runner.attention_kernels import tile_partial, merge
from ..runner.forward import run_model
from ..runner.kv_cache import KVCache, dequantize_rows, kv_bytes_per_token, quantize_rows

LONG_TEXT = Path(__file__).resolve().parents[2] / "data" / "long" / "pride_and_prejudice_ch1-14.txt"
KV_FORMATS = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}  # bytes per stored number
SCALE_BYTES = 2  # one float16 scale per token and head, for the integer formats
STRATEGIES = ("full", "restart", "window", "sinks")
KV_TILE = 4096  # tokens a quantized cache's decode step dequantizes at a time (QuantizedKVCache.attend says why)


def cache_bytes_per_token(model, fmt: str) -> float:
    """Bytes one token's keys and values take in every layer in cache format `fmt`: lesson 07's formula
    (kv_cache.kv_bytes_per_token), plus one float16 scale per layer, head and key or value for the integer
    formats. Example: SmolLM2 in float32 -> 2 x 30 x 3 x 64 x 4 = 46,080; in int8 -> 2 x 30 x 3 x (64 + 2) = 11,880"""
    if fmt not in KV_FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}: choose one of {', '.join(KV_FORMATS)}")
    layers, KV = len(model.layers), model.kv_heads
    scales = 2 * layers * KV * SCALE_BYTES if fmt.startswith("int") else 0
    return kv_bytes_per_token(layers, KV, model.head_dim, KV_FORMATS[fmt]) + scales


def crossover_tokens(weight_bytes: int, per_token: float) -> int:
    """Context (tokens of one row) at which a decode step reads as many cache bytes as weight bytes."""
    return math.ceil(weight_bytes / per_token)


class WindowCache(KVCache):
    """A cache of at most `budget` tokens for one row: the first `sinks` tokens stay, the oldest of the others
    leave when room is needed (`make_room`). Positions are slots in the cache, as StreamingLLM does: when d
    tokens leave, every kept key after the sinks moves d slots left and is turned back by d rotary positions
    (a rotation by -d; keys are stored already turned). sinks=0 is a plain sliding window."""

    def __init__(self, model, budget: int, sinks: int = 4):
        if not 0 <= sinks < budget:
            raise ValueError(f"sinks must be in [0, budget), got sinks={sinks}, budget={budget}")
        super().__init__(len(model.layers), 1, model.kv_heads, model.head_dim, budget, model.dtype, model.device)
        self.budget, self.sinks, self.evicted = budget, sinks, 0
        self.cos, self.sin = model.cos, model.sin  # (window, D) rotary tables

    def reserve(self, n: int) -> None:
        if n > self.budget:
            raise ValueError(f"{n} tokens do not fit a window cache of {self.budget}: call make_room first")

    def make_room(self, n: int) -> int:
        """Drop the oldest tokens after the sinks so that n more fit; returns how many left."""
        if n > self.budget - self.sinks:
            raise ValueError(f"{n} new tokens cannot fit a budget of {self.budget} with {self.sinks} sinks")
        drop = self.length + n - self.budget
        if drop <= 0:
            return 0
        s, end = self.sinks, self.length
        cos, sin = self.cos[drop].to(self.keys[0].dtype), -self.sin[drop].to(self.keys[0].dtype)  # turn back by drop
        for k, v in zip(self.keys, self.values):
            k[:, :, s:end - drop] = apply_rotary(k[:, :, s + drop:end], cos, sin)  # note: a new tensor, then copied
            v[:, :, s:end - drop] = v[:, :, s + drop:end].clone()  # subtle: the ranges overlap, so copy first
        self.length, self.evicted = end - drop, self.evicted + drop
        return drop


class QuantizedKVCache(KVCache):
    """The course's cache with keys and values stored in `bits` (8 or 4) and one float16 scale per token and head:
    a row's scale is fixed when it is written, so old rows never change. Why per token and head: the cache only
    grows by appending, and a scale over D=64 numbers costs 2 bytes (3% at 8 bits). `write` quantizes the new
    rows and returns every row dequantized to the model's dtype, in one layer's buffer that every layer reuses:
    attention reads ordinary numbers. A decode step of one row goes through `attend` instead, a tile at a time.
    The buffer is counted in `nbytes` (1/layers of a float cache).
    A layer's keys and values lie in one tensor (2, B, KV, capacity, D), and so do their scales, so that storing a
    token and reading a tile are one operation each for both (`keys`, `values`, `key_scales`, `value_scales` are
    views of them): a decode step runs a few small operators per layer, and each costs microseconds."""

    def __init__(self, model, batch: int, capacity: int, bits: int = 8, tile: int = KV_TILE):
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        layers, KV, D = len(model.layers), model.kv_heads, model.head_dim
        self.bits, self.dtype, self.length, self.tile, self.reads_in_place = bits, model.dtype, 0, tile, False
        shape = (2, batch, KV, capacity, D if bits == 8 else D // 2)  # [0] keys, [1] values
        store = torch.int8 if bits == 8 else torch.uint8
        self.stored = [torch.zeros(shape, dtype=store, device=model.device) for _ in range(layers)]
        self.scales = [torch.ones(*shape[:-1], 1, dtype=torch.float16, device=model.device) for _ in range(layers)]
        self.keys, self.values = [t[0] for t in self.stored], [t[1] for t in self.stored]
        self.key_scales, self.value_scales = [t[0] for t in self.scales], [t[1] for t in self.scales]
        self.buffer = torch.empty(2, batch, KV, capacity, D, dtype=model.dtype, device=model.device)  # what attention reads
        self.read_k, self.read_v = self.buffer[0], self.buffer[1]

    def reserve(self, n: int) -> None:
        if n > self.capacity:
            raise ValueError(f"{n} tokens do not fit this quantized cache of {self.capacity}")
        self.reads_in_place = n == self.length + 1 and self.batch == 1  # a decode step of one row: `attend`

    def scale_of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale) for new rows x (2, B, KV, T, D). A separate method so a test can break the scale on purpose."""
        return quantize_rows(x, self.bits)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> int:
        end = start + k.shape[2]
        q, scale = self.scale_of(torch.stack((k, v)))
        self.stored[layer][:, :, :, start:end], self.scales[layer][:, :, :, start:end] = q, scale
        return end

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Store the new rows; return every row [0, start + T) dequantized, in the buffers every layer reuses."""
        end = self._store(layer, k, v, start)
        both = self._read(layer, 0, end)
        return both[0], both[1]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A decode step (one row, one new token): store the new key and value, then read the context `tile` tokens
        at a time, dequantized into the start of the buffers and attended with lesson 16's kernel; the partial
        results are merged by the log-sum-exp rule. q (1, H, 1, D) -> (1, H, 1, D).
        Note: small tiles (512 tokens, a float tile that stays in the processor's cache) measured no faster on the
        course's CPU than one tile of the whole context (best of 7 steps at 2,048 tokens, one thread, a quiet
        machine: 67.7 ms with tiles of 512, 68.5 with 1,024, 67.1 with one tile; the float cache 58-60): the merges
        cost what the cache misses saved. Hence the default of 4,096. What the 8-bit step pays beyond the float
        one is the dequantizing pass (int8 to float, times the scale) before the fused kernel: torch has no
        attention kernel that reads int8 keys and values itself."""
        end = self._store(layer, k, v, self.length)
        B, H, _, D = q.shape
        qg = q.reshape(B, k.shape[1], H // k.shape[1], D)  # the G query heads of each key/value head, folded
        total = None
        for a in range(0, end, self.tile):
            both = self._read(layer, a, min(a + self.tile, end))
            part = tile_partial(qg, both[0], both[1], None)
            total = part if total is None else merge(total, part)
        return total.out.to(q.dtype).reshape(B, H, 1, D)

    def _read(self, layer: int, a: int, b: int) -> torch.Tensor:
        """Keys and values of columns [a, b), dequantized into the start of the buffer: (2, B, KV, b - a, D), each
        half contiguous (a fresh tensor per read would cost more than the arithmetic: new memory is faulted in page
        by page). Valid until the next read."""
        _, B, KV, _, D = self.buffer.shape
        out = self.buffer.view(-1)[:2 * B * KV * (b - a) * D].view(2, B, KV, b - a, D)
        stored, scales = self.stored[layer][:, :, :, a:b], self.scales[layer][:, :, :, a:b]
        if self.bits == 8:
            return out.copy_(stored).mul_(scales.to(self.dtype))
        return out.copy_(dequantize_rows(stored, scales, 4, self.dtype))

    def nbytes(self) -> int:
        """Every buffer, the dequantized one included."""
        return sum(t.numel() * t.element_size() for t in self.stored + self.scales + [self.buffer])


@dataclass
class StreamRun:
    """One pass over a text: nll[i] is the loss of token i + 1 given what the cache kept; seconds of the whole pass;
    `recomputed`: tokens fed again after a restart; `max_tokens`: the most tokens the cache held."""
    strategy: str
    nll: torch.Tensor  # (N - 1,) float32
    seconds: float
    recomputed: int
    max_tokens: int

    def perplexity(self, start: int = 0) -> float:
        """exp(mean loss) of the tokens from position `start` + 1 on."""
        return float(torch.exp(self.nll[start:].mean()))


@torch.inference_mode()
def stream_loss(model, ids: list[int], strategy: str, budget: int, chunk: int = 64, sinks: int = 4,
                cache=None) -> StreamRun:
    """Feed a long text `chunk` tokens at a time and keep each token's loss. Strategies at one memory budget:
    "full" (every token kept: only while the text fits the window), "restart" (when full, start a new cache
    from the last budget/2 tokens, fed again: what dropping old turns does), "window" (the most recent tokens),
    "sinks" (the first `sinks` tokens and the most recent). The cache holds at most budget tokens, this chunk
    included. cache: "full" may be given another cache (a QuantizedKVCache, say)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if not 0 < chunk <= budget // 2:
        raise ValueError(f"chunk must be in (0, budget/2], got chunk={chunk}, budget={budget}")
    if len(ids) < 2:
        raise ValueError(f"a text of {len(ids)} token(s) has no next token to score: give at least 2")
    if cache is not None and strategy != "full":
        raise ValueError(f"cache= is for the 'full' strategy; {strategy!r} builds its own")
    x = torch.tensor(ids, device=model.device)
    if strategy == "full":
        cache = cache or model.new_cache(1, len(ids))
    elif strategy in ("window", "sinks"):
        cache = WindowCache(model, budget, sinks if strategy == "sinks" else 0)
    else:
        cache = model.new_cache(1, budget)
    nll, recomputed, most = [], 0, 0
    start = time.perf_counter()
    for pos in range(0, len(ids) - 1, chunk):
        piece = x[pos:pos + chunk]
        if strategy == "restart" and cache.length + len(piece) > budget:
            keep = budget // 2
            cache.length = 0
            run_model(model, x[None, pos - keep:pos], cache)  # the recent past, fed again
            recomputed += keep
        elif isinstance(cache, WindowCache):
            cache.make_room(len(piece))
        logits = run_model(model, piece[None], cache, keep=0)[0][0]  # (T, V) float32
        most = max(most, cache.length)
        targets = x[pos + 1:pos + 1 + len(piece)]
        lp = torch.log_softmax(logits[:len(targets)], dim=-1)
        nll.append(-lp.gather(1, targets[:, None])[:, 0])
    return StreamRun(strategy, torch.cat(nll).cpu(), time.perf_counter() - start, recomputed, most)


@torch.inference_mode()
def first_token_share(hf_model, ids: list[int], sinks: int = 4, queries: int = 64) -> torch.Tensor:
    """Per layer, the share of attention the last `queries` positions give to the first `sinks` tokens, averaged
    over heads and those queries (what StreamingLLM calls attention sinks), from the library model's own weights
    (eager attention for the time of the call). (layers,) float32."""
    from ..runner.attention import attention_weights
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("eager")
    try:
        weights = attention_weights(hf_model, ids)  # (L, H, T, T)
    finally:
        hf_model.set_attn_implementation(before)
    return weights[:, :, -queries:, :sinks].sum(-1).mean(dim=(1, 2))


def long_text_ids(tokenizer, n: int | None = None) -> list[int]:
    """The course's long text (data/long/: Pride and Prejudice, chapters 1-14, public domain) as token IDs, the
    first n of them. About 27,000 in all."""
    if not LONG_TEXT.exists():
        raise FileNotFoundError(f"{LONG_TEXT} is missing: it ships with the course (git checkout -- data/long)")
    ids = tokenizer(LONG_TEXT.read_text(), add_special_tokens=False, verbose=False)["input_ids"]
    if n is not None and n > len(ids):
        raise ValueError(f"the long text has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


NEEDLE = "The secret number of the Netherfield library is {}."
QUESTION = "What is the secret number of the Netherfield library? Answer with the number only."


def needle_ids(tokenizer, filler: list[int], length: int, depth: float, secret: int) -> list[int]:
    """A chat prompt of about `length` tokens: the long text's first tokens with the needle sentence put as its
    own paragraph at `depth` (0 = start, 1 = end) of the text, then the question. Through the chat template."""
    from ..text.context import context_ids
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    text = tokenizer.decode(filler[:max(length - 60, 1)])
    at = int(depth * len(text))
    cut = text.rfind("\n\n", 0, at) if depth < 1 else len(text)
    cut = 0 if cut < 0 else cut
    document = text[:cut] + "\n\n" + NEEDLE.format(secret) + "\n\n" + text[cut:].lstrip("\n")
    return context_ids(tokenizer, [{"role": "user", "content": document + "\n\n" + QUESTION}])


def found(answer: str, secret: int) -> bool:
    """Did the answer give the secret number (as digits)?"""
    return str(secret) in answer.replace(",", "")
