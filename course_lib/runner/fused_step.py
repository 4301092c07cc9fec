"""The decode step as one C++ call (issue: the fast path is the engine): every layer of the int4-q8 or int4 model for
B rows, one token each, in the course's kernel's C++ (q4_kernel.cpp, `decode_layers`).

What it does: `why_not_fused(model)` says whether a model can take it ('' for int4-q8 whose layers run on the
course's 4-bit kernel, and for int4 where the CPU has AVX-512 BF16: its layers keep their blocks in the kernel's
layout too, formats.Int4Linear.bf16_blocks). For int4 each product's activations are rounded to bfloat16, not to 8
bits (block_product_bf16: `dpbf16ps`, two bfloat16 products a lane), the cache is the model's bfloat16 KVCache, and
the head (formats.Int8DynamicLinear, oneDNN's when eager) runs on the course's kernel with the layer's own rounding
(dynamic_int8_product; its logits equal oneDNN's to a bfloat16 step). Between the products the C++ keeps float32
where the eager int4 model rounds every activation to bfloat16: its logits are a little nearer float32 activations'
(tests/test_fused_int4.py), and a near-tie can part the two.
`FusedDecode` holds the layers' weights in the order the C++ reads them and runs a step with StaticDecode's contract
(tokens, cache, positions, key_mask -> (B, 1, V) logits): the embedding lookup in Python, then one C++ call for the 30
blocks (norms, the four products of each block, rotary, this token's key and value written at the cache's column,
attention over the columns written so far, SwiGLU, the residual adds), then the final norm and the head. Attention
reads only the columns up to this step's, whatever the cache's capacity, and takes the query heads that share a
key/value head together (on a float cache one after the other, the head's keys and values read again from the
processor's cache; on an 8-bit cache a tile of columns for all of them). The exponentials (softmax, SiLU) are computed
8 at a time by a polynomial within 2 units in the last place. On an 8-bit cache (engine.long_context.QuantizedKVCache
with bits=8) it stores the new key and value by quantize_rows' rule and reads the integers in place: each is turned
into a float in a register, the score multiplied by its key's scale and the attention weight by its value's (the
static step's _Int8Columns does the same in torch), so no float copy of the cache is written.
Why: at one row a step's products are about half its time; the other half was calling (about 4,000 operators from
Python, or a compiled graph's guards and extern calls), not arithmetic. torch.compile did not remove it on the course's
CPU; writing the glue as loops did. Measured on the AMD course machine (AVX-512 VNNI), one thread, int4-q8, a short
context, 2026-12-06: on the Q4_0 file a step took 8.75 ms compiled by torch.compile (under the profiler: the course's
kernel 4.7 ms of it, the graph's own code 2.7, dynamo's guard checks 0.66), 6.0 ms fused with scalar attention; on
the bundled Q4_1 file 4.6-5.2 ms fused as written now, the products and the head alone 3.9.
Measured 2026-12-07, same machine, one row, random caches (data/benchmarks/fused-kv8-cpu-2026-12-07.json, two fresh
processes at one thread): the 8-bit cache's step against the float cache's 0.78-0.82x at 1,024 tokens, 0.68-0.71x at
2,048, 0.56-0.58x at 4,096 (12.1-13.0 ms against 21.0-23.2); at two threads 0.78x / 0.69x / 0.61x.
Measured 2026-12-07, same machine, int4 (data/benchmarks/fused-int4-cpu-2026-12-07.json, two fresh processes at one
thread): a step of one row 5.2 ms fused against 14.8-15.8 eagerly (torch's 4-bit kernel and oneDNN's head), the head
alone 0.7 ms against 2.0-2.6; generate(..., compiled=True) 2.32-2.41x the eager loop (2.39x at two threads).
`tokens_at` runs the same C++ over tokens of several requests at once (q4_kernel.cpp's step_tokens: each token at
its own cache row and column): decode tokens and prompt chunks in one call, the engine step of slots
(engine.slot_scheduler). A chunk's tokens are written first and each attends to its row's columns up to its own, so
a chunk gives, bit for bit, what its tokens give one at a time. The attention takes a chunk's tokens in runs of up to
4, 64 columns at a time: a tile of keys and values is read from memory once for the run (a 16-token chunk at 1,000
columns, one thread: 39-40 ms a step against 44-45 token after token; a 128-token chunk 272-285 against 323-330).
What it does not do: run the float formats, the int4 format with an int8 copy for several rows (torch's path), a 4-bit
cache, a paged cache or a GPU; `tokens_at` takes no 8-bit cache. Its numbers equal the eager step's
up to float rounding, and a rounding difference can move one activation across an 8-bit step: the logits then differ
by up to a few tenths on the real model (tests/test_fused_step.py bounds one block; a near-tie between two tokens can
flip, as with the compiled step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import q4_kernel
from .model import head, norm


def why_not_fused(model) -> str:
    """'' when `model` can run the fused step here; else why not (the format, the device, or the kernel's reason)."""
    if not hasattr(model, "layers"):
        return "the fused step runs the course's own model (Model.from_transformers, then formats.convert)"
    parts = [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if model.device.type != "cpu":
        return f"the fused step is the course's CPU kernel, not for {model.device.type}"
    if all(getattr(p, "q4", None) is not None for p in parts):  # int4-q8: activations to 8 bits per block
        return "" if model.dtype == torch.float32 else f"int4-q8's fused step takes float32, not {model.dtype}"
    if all(getattr(p, "bf16_blocks", None) is not None for p in parts):  # int4: activations in bfloat16
        return q4_kernel.available()[1]
    reasons = {getattr(p, "why_not_bf16" if getattr(p, "format", "") == "int4" else "why_not", "")
               for p in parts} - {""}
    return ("the fused step needs every layer on the course's 4-bit kernel (the 'int4-q8' format, or 'int4' on a CPU "
            "with AVX-512 BF16)" + (f": {reasons.pop()}" if reasons else ""))


class FusedDecode:
    """B rows' decode step in one C++ call, over a float32 or bfloat16 KVCache or an 8-bit QuantizedKVCache. Example:
    step = FusedDecode(convert(ours, "int4-q8")); logits = step([[token]], cache)  # (1, 1, V)
    The int4 format (bfloat16 model) runs the same C++ with each product's activations rounded to bfloat16 instead of
    to 8 bits; its residual stream, norms and attention are float32 in the C++ (bfloat16 in the eager model)."""

    def __init__(self, model):
        reason = why_not_fused(model)
        if reason:
            raise ValueError(reason)
        self.model, self.code = model, q4_kernel.extension()
        self.bf16 = model.layers[0].qkv.q4 is None  # the int4 format: its products take bfloat16 activations
        blocks = lambda p: p.bf16_blocks if self.bf16 else p.q4  # noqa: E731
        self.parts = [t for layer in model.layers for t in (layer.attn_norm.float().contiguous(), blocks(layer.qkv),
                                                              blocks(layer.o), layer.mlp_norm.float().contiguous(),
                                                              blocks(layer.gate_up), blocks(layer.down))]
        self.cos, self.sin = model.cos.float().contiguous(), model.sin.float().contiguous()  # (window, D)
        # the int4 format's head (formats.Int8DynamicLinear, oneDNN's eagerly) by the course's kernel, same rounding
        self.head_tiles = getattr(model.lm_head, "tiles", None) if self.bf16 else None

    @staticmethod
    def fits(cache) -> bool:
        """Whether the step runs on `cache`: the course's float32 or bfloat16 KVCache or an 8-bit QuantizedKVCache of
        a float32 model, contiguous, with room for one column."""
        keys = getattr(cache, "keys", None)
        if not (isinstance(keys, list) and bool(keys) and keys[0].is_contiguous() and cache.length < keys[0].shape[2]):
            return False
        if hasattr(cache, "bits"):
            return cache.bits == 8 and cache.dtype == torch.float32 and keys[0].dtype == torch.int8
        return keys[0].dtype in (torch.float32, torch.bfloat16)

    def __call__(self, tokens, cache, positions: torch.Tensor | None = None,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row at the cache's next column; (B, 1, V) logits. positions (B,) (default: the column);
        key_mask (B, capacity) bool, True where a row holds a token (default: every column)."""
        if not self.fits(cache):
            raise ValueError(f"the fused step runs on the course's float32 or bfloat16 KVCache (or an 8-bit "
                             f"QuantizedKVCache) "
                             f"with room left; got {type(cache).__name__} at length {getattr(cache, 'length', '?')}"
                             + (f" in {cache.bits} bits" if hasattr(cache, "bits") else ""))
        column, capacity = cache.length, cache.keys[0].shape[2]
        with torch.inference_mode():
            tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)  # (B,)
            rows = tokens.shape[0]
            if rows != cache.keys[0].shape[0]:
                raise ValueError(f"{rows} token(s) for a cache of {cache.keys[0].shape[0]} row(s): one token per row")
            if positions is None:
                cos, sin = self.cos[column].expand(rows, -1), self.sin[column].expand(rows, -1)
            else:
                positions = positions.reshape(rows)
                cos, sin = self.cos[positions], self.sin[positions]  # (B, D)
            if key_mask is None:
                key_mask = torch.ones(rows, capacity, dtype=torch.bool)
            x = F.embedding(tokens, self.model.embedding).float()  # (B, hidden)
            scales = (cache.key_scales, cache.value_scales) if hasattr(cache, "bits") else ([], [])
            out = self.code.decode_layers(x, self.parts, cache.keys, cache.values, *scales, cos.contiguous(),
                                          sin.contiguous(), key_mask.contiguous(), column, self.model.heads,
                                          self.model.kv_heads, self.model.eps, self.bf16)
            logits = self._head(out)[:, None]  # (B, 1, V)
        cache.length = column + 1
        return logits

    def _head(self, out: torch.Tensor) -> torch.Tensor:
        """The last block's output (N, hidden) -> (N, V) logits: the final norm and the head."""
        if self.head_tiles is None:
            return head(self.model, out.to(self.model.dtype)[:, None])[:, 0]
        model, lm_head = self.model, self.model.lm_head
        normed = norm(out.to(model.dtype), model.final_norm, model.eps).float()  # (N, hidden), as head()
        return self.code.dynamic_int8_product(normed, self.head_tiles, lm_head.scale, lm_head.row_sums).to(model.dtype)

    def tokens_at(self, tokens, cache, rows, columns, wanted) -> torch.Tensor:
        """Tokens of several requests in one call (an engine step: decode rows and prompt chunks together): token i
        is written at cache row rows[i], column columns[i] (its position), and attends to that row's columns up to
        its own; a prompt chunk is several tokens of one row at consecutive columns. Returns (len(wanted), V) logits
        of the tokens at those indices (only the tokens a request picks after). The cache's `length` is untouched:
        each row's length is the caller's (engine.slot_scheduler)."""
        keys = getattr(cache, "keys", None)
        if not (isinstance(keys, list) and keys and keys[0].is_contiguous() and not hasattr(cache, "bits")
                and keys[0].dtype in (torch.float32, torch.bfloat16)):
            raise ValueError("tokens_at runs on the course's float32 or bfloat16 KVCache, contiguous")
        with torch.inference_mode():
            tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)  # (N,)
            rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
            columns = torch.as_tensor(columns, dtype=torch.long).reshape(-1)
            if not tokens.numel() == rows.numel() == columns.numel():
                raise ValueError(f"{tokens.numel()} tokens, {rows.numel()} rows, {columns.numel()} columns: one each")
            if tokens.numel() == 0 or int(columns.max()) >= self.cos.shape[0] or int(columns.min()) < 0:
                raise ValueError("at least one token, each column inside the context window")
            seen = self._seen(keys[0].shape[0], keys[0].shape[2])
            x = F.embedding(tokens, self.model.embedding).float()  # (N, hidden)
            out = self.code.step_tokens(x, self.parts, cache.keys, cache.values, [], [],
                                        self.cos[columns].contiguous(), self.sin[columns].contiguous(), seen,
                                        rows.contiguous(), columns.contiguous(), self.model.heads, self.model.kv_heads,
                                        self.model.eps, self.bf16)
            wanted = torch.as_tensor(wanted, dtype=torch.long).reshape(-1)
            if wanted.numel() == 0:  # a step that only read part of a prompt: no token to pick after
                return torch.empty(0, self.model.config.vocab_size, dtype=self.model.dtype)
            return self._head(out[wanted])

    def _seen(self, rows: int, capacity: int) -> torch.Tensor:
        """Every column visible (a slot's columns are all its own request's): made once per cache shape."""
        if getattr(self, "_seen_all", None) is None or self._seen_all.shape != (rows, capacity):
            self._seen_all = torch.ones(rows, capacity, dtype=torch.bool)
        return self._seen_all
