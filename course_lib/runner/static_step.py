"""A decode step with static shapes, the form torch.compile (and a GPU's CUDA graphs) can capture once (lesson 11;
issue: the compiled step).

What it does: `StaticDecode` runs the course's own model (any weight format) one token per row for B rows, with
nothing that depends on how long the context is: the cache is preallocated at a fixed capacity, the column and the
positions arrive as tensors, the new keys and values are written at that column with `index_copy_`, and attention
reads the cache's first `span` columns (`span_of`: the written ones rounded up to 256, 512, 1,024... columns, as
llama.cpp rounds its view of the cache up to 256 cells) with a mask that hides the ones not written yet (and each
row's padding), so a cache sized for a long conversation costs a short one nothing. It also runs on lesson 17's
8-bit cache (engine.long_context.QuantizedKVCache(bits=8)), reading the integers and their scales directly.
`StaticStep` is one row with its own cache: the prompt goes through the model's ordinary prefill
(`forward.run_model`) into it, then each token through a StaticDecode. `compile=True` hands the step to `torch.compile`,
which needs a C++ compiler on the CPU (`compile_available` says whether there is one) and takes tens of seconds
the first time: `compile_seconds` records the warm-up that paid for it.
`fused=True` (the int4-q8 format, and int4 on a CPU with AVX-512 BF16) runs the same step as one C++ call instead
(fused_step.FusedDecode), with nothing to compile.
What it does not do: prefill, sample, or schedule (the engine does; engine/compiled.py runs these steps for
it); time itself (measure.compiled does).
"""
from __future__ import annotations

import shutil
import time

import torch

from .forward import run_model
from .fused_step import FusedDecode
from .kv_cache import quantize_rows
from .model import block, embed, head
from ..runtime import synchronize


def compile_available() -> tuple[bool, str]:
    """(True, "") when torch.compile can build CPU kernels here; else (False, why, with what fixes it)."""
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return False, "torch.compile builds C++ kernels on the CPU and finds no C++ compiler (install g++ or clang)"
    return True, ""


COMPILE_OPTIONS = {"freezing": True, "cpp_wrapper": True}  # what torch.compile is given (see StaticStep)


def compile_options() -> dict:
    """COMPILE_OPTIONS with this thread count written in (inductor's `cpp.threads`), so torch's on-disk cache of
    compiled kernels keeps one entry per thread count.
    subtle: without it, a 2-thread process on the course's 2-core machine found the kernels a 1-thread process had
    compiled minutes before (10 s instead of 105 s of compiling) and its int4 step ran at 23.5 ms instead of 11.2
    at 1,024 columns (2026-12-05, median of 40 steps each): the cached code was built for another thread count."""
    return {**COMPILE_OPTIONS, "cpp.threads": torch.get_num_threads()}
READ_STEP = 256  # attention reads the cache in 256, 512, 1,024... columns (span_of)


def span_of(column: int, capacity: int) -> int:
    """How many of the cache's columns a step at `column` reads: the written ones (column + 1) rounded up to
    READ_STEP times a power of two, at most the capacity. Few distinct spans, so a step compiled with static shapes
    compiles once per span it meets (one for a conversation under 256 tokens). Example: (30, 1024) -> 256"""
    span = READ_STEP
    while span < column + 1:
        span *= 2
    return min(span, capacity)


class StaticDecode:
    """B rows' decode step at fixed shapes over a KVCache of a fixed capacity: what torch.compile captures once per
    (rows, capacity) bucket. Rows share the cache's column (left-padded, as the batch schedulers keep them); each
    has its own position; `key_mask` (B, capacity) marks the columns that hold a row's tokens (None: all written
    ones). Example: run = StaticDecode(ours, 1, 512); logits = run(tokens, cache)  # (B, 1, V)"""

    def __init__(self, model, batch: int, capacity: int, compile: bool = False, whole: bool = False,
                 fused: bool = False):
        """whole=True: attention reads every column of the capacity (the mask hides the unwritten ones), the span
        never changes: what the engine's runner (runner.compiled) asks for, see CompiledRunner.step_for.
        fused=True: the step is one C++ call (fused_step.FusedDecode: int4-q8, or int4 where fused_step.why_not_fused
        says so; nothing to compile)."""
        if compile and fused:
            raise ValueError("a step is either compiled by torch.compile or fused in C++, not both")
        if capacity < 2 or capacity > model.config.max_position_embeddings:
            raise ValueError(f"capacity must be between 2 and the window of {model.config.max_position_embeddings}, "
                             f"got {capacity}")
        if compile:
            ok, why = compile_available()
            if not ok:
                raise RuntimeError(why)
            self.allow_recompiles()
        self.model, self.batch, self.capacity, self.compiled, self.whole = model, batch, capacity, compile, whole
        self.cos = model.cos.to(model.dtype).clone()  # (window, D): read at positions given as a tensor
        self.sin = model.sin.to(model.dtype).clone()
        self.columns = torch.arange(capacity, device=model.device)
        self.compile_seconds = 0.0
        self.head_apart = not getattr(model.lm_head, "compiles", True)
        self.fused = FusedDecode(model) if fused else None
        # note: freezing lets the compiler treat the weights as constants (and prepack them for its kernels): a
        # compiled step is for inference only. Measured on the course's CPU, int4 at 2 threads: 142.6 tokens per
        # second with it, 131.0 without, 121.8 eager (one run each). cpp_wrapper calls the step's kernels from
        # generated C++ instead of generated Python (about 300 calls a step): int4, 1 thread, 11.0 -> 10.0 ms a
        # step; 2 threads 7.0 -> 6.3 (two runs each); the first compile takes about 60 s instead of 20.
        self._step = torch.compile(self._decode, dynamic=False, options=compile_options()) if compile else self._decode

    @staticmethod
    def allow_recompiles() -> None:
        """note: each (rows, capacity) is a new specialization of the same code: let dynamo keep them all."""
        from torch._dynamo import config as dynamo_config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)

    def fits(self, cache) -> bool:
        """Whether this step runs on `cache`: the course's KVCache, of this step's rows and capacity, with room."""
        keys = getattr(cache, "keys", None)
        return (isinstance(keys, list) and keys and tuple(keys[0].shape[::2]) == (self.batch, self.capacity)
                and cache.length < self.capacity and getattr(cache, "bits", 8) == 8)

    def __call__(self, tokens, cache, positions: torch.Tensor | None = None,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per row at the cache's next column; (B, 1, V) logits. positions (B,): each row's position
        (default: the column); key_mask (B, capacity) bool, True where a row holds a token (default: every column).
        The first call of a compiled step compiles it."""
        device, column = self.model.device, cache.length
        if not self.fits(cache):
            raise ValueError(f"this static step runs {self.batch} row(s) on a KVCache (float, or 8-bit) of capacity "
                             f"{self.capacity} with room left; got {type(cache).__name__} at length "
                             f"{getattr(cache, 'length', '?')}"
                             + (f" in {cache.bits} bits" if hasattr(cache, "bits") else ""))
        if self.fused is not None:
            return self.fused(tokens, cache, positions, key_mask)
        # subtle: torch.compile guards on each input's dispatch keys, which differ between a tensor made inside
        # inference mode and one made outside: the small inputs are made afresh inside it, whatever the caller
        # passed, so a step warmed with a list compiles nothing again when the engine passes a tensor
        with torch.inference_mode():
            tokens = torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(self.batch, 1).clone()  # (B, 1)
            column_t = torch.tensor([column], device=device)
            positions = (column_t.expand(self.batch) if positions is None else positions.reshape(self.batch)).to(
                device).clone()
            key_mask = (torch.ones(self.batch, self.capacity, dtype=torch.bool, device=device) if key_mask is None
                        else key_mask.clone())
        synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            quantized = getattr(cache, "bits", None) == 8
            out = self._step(tokens, column_t, positions, key_mask, cache.stored if quantized else cache.keys,
                             cache.scales if quantized else cache.values,
                             self.capacity if self.whole else span_of(column, self.capacity), quantized)
            # a head the compiler cannot take (formats.Int8DynamicLinear) runs after the step
            logits = head(self.model, out) if self.head_apart else out
        if self.compiled and self.compile_seconds == 0.0:  # (a runner's shared code: only its first call compiles)
            synchronize(device)
            self.compile_seconds = time.perf_counter() - start
        cache.length = column + 1
        return logits

    def _decode(self, tokens: torch.Tensor, column: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
                keys: list, values: list, span: int, quantized: bool = False) -> torch.Tensor:
        """tokens (B, 1), column (1,), positions (B,), key_mask (B, capacity), span (columns read, span_of) -> logits
        (B, 1, V) (or the last block's output (B, 1, hidden) when the head runs apart, after the compiled step). The
        model's own blocks, with a cache that writes at the column tensor and hands attention its first `span`
        columns, and a mask over the columns written so far that hold each row's tokens: no shape depends on the
        position, only on the span (a symbol where the code is compiled with dynamic shapes). quantized: `keys` and
        `values` are an 8-bit cache's stored integers and scales (_Int8Columns)."""
        model = self.model
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # (B, 1, 1, D)
        seen = ((self.columns[:span] <= column)[None] & key_mask[:, :span])[:, None, None]  # (B, 1, 1, span)
        cache = (_Int8Columns if quantized else _Columns)(keys, values, span, column, seen)
        x = embed(model, tokens)  # (B, 1, hidden)
        for index in range(len(model.layers)):
            x = block(model, index, x, cos, sin, cache, column, seen)
        return x if self.head_apart else head(model, x)


class StaticStep:
    """One row's decode steps at fixed shapes, with its own cache (a StaticDecode over it). Example:
    step = StaticStep(ours, capacity=256); logits = step.prefill(prompt_ids); logits = step(int(logits.argmax()))"""

    def __init__(self, model, capacity: int, compile: bool = False, fused: bool = False):
        self.decode = StaticDecode(model, 1, capacity, compile, fused=fused)
        self.model, self.capacity, self.compiled, self.fused = model, capacity, compile, fused
        self.cache = model.new_cache(1, capacity)
        self.position = 0

    @property
    def compile_seconds(self) -> float:
        return self.decode.compile_seconds

    @property
    def head_apart(self) -> bool:
        return self.decode.head_apart

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """The prompt in one ordinary pass into this step's cache; the last position's logits (V,)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: a decode step needs at least one token before it")
        if len(prompt_ids) >= self.capacity:
            raise ValueError(f"a {len(prompt_ids)}-token prompt leaves no room in a capacity of {self.capacity}")
        self.cache.length = 0
        ids = torch.tensor([prompt_ids], device=self.model.device)
        logits, self.cache = run_model(self.model, ids, self.cache, keep=1)
        self.position = len(prompt_ids)
        return logits[0, -1]

    def __call__(self, token: int) -> torch.Tensor:
        """Feed one token at the next position; its logits (V,). The first call of a compiled step compiles it."""
        if self.position == 0:
            raise ValueError("call prefill(prompt_ids) first")
        if self.position >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} tokens): make a StaticStep with more capacity")
        logits = self.decode([[token]], self.cache)
        self.position = self.cache.length
        return logits[0, -1]


class _Columns:
    """The cache as the static step's blocks see it: it attends itself (`reads_in_place`, the hook the paged cache
    uses): `attend` puts this token's key and value at the column the column tensor names (index_copy_), then
    attends over the layer's first `span` columns, written or not, with `seen` hiding the rest.
    subtle: two matrix products and a softmax, not scaled_dot_product_attention: with a mask and a single query
    per row, the compiled step's SDPA cost twice as much on the course's CPU (30 layers, 3 key/value heads of 64,
    bfloat16, one thread, compiled: 6.6 against 4.0 ms at 1,024 columns, 25.0 against 12.8 at 4,096;
    2026-12-05). The scores are rounded to bfloat16 by the product, as the library's eager attention rounds them."""
    reads_in_place = True

    def __init__(self, keys: list, values: list, span: int, column: torch.Tensor, seen: torch.Tensor):
        self.keys, self.values, self.span, self.column, self.seen = keys, values, span, column, seen

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, 1, D), k and v (B, KV, 1, D) -> (B, H, 1, D)."""
        self.keys[layer].index_copy_(2, self.column, k)  # (B, KV, capacity, D): this token's column
        self.values[layer].index_copy_(2, self.column, v)
        keys, values = self.keys[layer][:, :, :self.span], self.values[layer][:, :, :self.span]  # (B, KV, span, D)
        return _attend(q, keys, values, self.seen, None, None)


class _Int8Columns(_Columns):
    """An 8-bit cache (engine.long_context.QuantizedKVCache(bits=8)) as the static step sees it: `keys` is each
    layer's stored integers (2, B, KV, capacity, D) and `values` their float16 scales (2, B, KV, capacity, 1). The
    new key and value are quantized by quantize_rows, the eager cache's rule; attention reads the integers and
    applies each column's scale to its score (keys) and to its weight (values), so no dequantized copy of the
    cache is written: what the compiler fuses is the int8-to-bfloat16 conversion before each product."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ints, scale = quantize_rows(torch.stack((k, v)), 8)  # (2, B, KV, 1, D) int8, (2, B, KV, 1, 1) float16
        self.keys[layer].index_copy_(3, self.column, ints)
        self.values[layer].index_copy_(3, self.column, scale)
        stored, scales = self.keys[layer][:, :, :, :self.span], self.values[layer][:, :, :, :self.span, 0].float()
        return _attend(q, stored[0].to(q.dtype), stored[1].to(q.dtype), self.seen, scales[0], scales[1])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor,
            key_scale: torch.Tensor | None, value_scale: torch.Tensor | None) -> torch.Tensor:
    """One query per row against S columns: the G query heads that share a key/value head are folded into one
    (B, KV, G, D) product. keys, values (B, KV, S, D); seen (B, 1, 1, S) bool; the scales (B, KV, S) or None."""
    B, H, _, D = q.shape
    KV = keys.shape[1]
    scores = torch.matmul(q.reshape(B, KV, H // KV, D), keys.transpose(-1, -2)).float() * D ** -0.5  # (B, KV, G, S)
    if key_scale is not None:
        scores = scores * key_scale[:, :, None]
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    if value_scale is not None:
        weights = weights * value_scale[:, :, None]
    return torch.matmul(weights.to(q.dtype), values).reshape(B, H, 1, D)
