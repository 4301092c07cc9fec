"""The KV cache: the cache contract, the cache objects and what they cost in memory.

What it does: writes down the cache contract once (`Cache`: `length`, `reserve`, `write`, `rollback`; the
course's model calls the first three, the loop calls `rollback` after a verify pass); holds the course's
own cache (`KVCache`: preallocated per layer, written in place, rolled back by one assignment), which meets
it, as does paged.PagedCache; and the operations a scheduler needs on any cache, ours or transformers'
`DynamicCache` (`new_cache`, `length_of`, `rollback`, `select_rows`, `join`, `trim`); counts the token
positions a run with and without a cache pushes through the model; computes cache memory from the formula
2 x layers x key/value heads x head dimension x bytes x tokens and measures it on the real cache objects;
quantizes a cache's rows to 8 or 4 bits with one scale per token and head (`quantize_rows`, `dequantize_rows`:
lesson 17's quantized cache and the static step's 8-bit columns use the same rule).
What it does not do: simulate a memory budget (budget.py, lesson 07), page or share cache blocks between
requests (paged.py, lesson 13), call the model
(forward.run_model does), or time anything (measure/ does).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


def head_dim_of(config) -> int:
    """The head dimension D: the config's head_dim, else hidden size / query heads. Example: SmolLM2 -> 64"""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integers with one scale per row of D numbers (per token and head): x ~ q * scale.
    x (..., D) -> (q (..., D) int8 for 8 bits, (..., D/2) uint8 with two numbers per byte for 4; scale (..., 1) fp16)."""
    top = 2 ** (bits - 1) - 1  # 127 or 7
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).div_(top).clamp_(min=1e-8).half()
    q = torch.div(x, scale.float()).round_().clamp_(-top, top).to(torch.int8)
    if bits == 4:
        q = ((q[..., 0::2] + 8) | ((q[..., 1::2] + 8) << 4)).to(torch.uint8)  # note: even dims low, odd dims high
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The numbers quantize_rows stands for, in `dtype`. (..., D)."""
    if bits == 4:
        q = torch.stack([(q & 15).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8], dim=-1).flatten(-2)
    return q.to(dtype) * scale.to(dtype)


@runtime_checkable
class Cache(Protocol):
    """The cache contract. `length`: columns (tokens) already written; the model sets it after its last layer.
    `reserve(end)`: called by the model before its first layer, to make room for columns [0, end).
    `write(layer, k, v, start)`: store (B, KV, T, D) keys and values at columns [start, start + T) and return the
    keys and values attention reads, (B, KV, S, D). `rollback(n)`: forget every column from n on.
    kv_cache.KVCache and paged.PagedCache meet it; transformers' DynamicCache has its own API, which
    `length_of` and `rollback` below translate. A cache may also attend itself: when its `reads_in_place` is
    true for a step, the course's model calls its `attend(layer, q, k, v)` instead of `write` (the paged cache's
    decode through its block tables, lesson 16)."""
    length: int

    def reserve(self, end: int) -> None: ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int): ...

    def rollback(self, length: int) -> None: ...


class KVCache:
    """The course's cache: per layer, keys and values preallocated as (B, KV heads, capacity, D) and
    written in place. `length` is how many columns are filled (rows are left-padded to share columns;
    the attention mask marks the padding). Rolling back is one assignment: cache.length = n.
    If a write would pass the capacity, the buffers grow to twice the size once (never per step)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if capacity < 1 or batch < 1:
            raise ValueError(f"a cache needs at least one row and one column, got batch={batch}, capacity={capacity}")
        shape = (batch, kv_heads, capacity, head_dim)  # (B, KV, T_max, D)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def reserve(self, n: int) -> None:
        """Make room for n columns (growing to max(n, 2 x capacity) if needed: an amortized, rare copy)."""
        if n <= self.capacity:
            return
        new = max(n, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                grown = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])  # (B, KV, new, D)
                grown[:, :, :self.length] = t[:, :, :self.length]
                store[i] = grown

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write (B, KV, T, D) keys and values at columns [start, start + T); return the views of columns
        [0, start + T), the past and the new, for attention. The caller sets `length` after the last layer."""
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def rollback(self, length: int) -> None:
        """Forget every column from `length` on (speculative decoding's rejected tokens). One assignment."""
        if not 0 <= length <= self.length:
            raise ValueError(f"can only roll back to a length in [0, {self.length}], got {length}")
        self.length = length

    def nbytes(self) -> int:
        """Bytes the buffers hold (the whole capacity, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def formula_bytes(self) -> float:
        """The lesson 07 formula for these buffers: kv_bytes_per_token x rows x capacity."""
        k = self.keys[0]
        return kv_bytes_per_token(len(self.keys), k.shape[1], k.shape[3], k.element_size()) * k.shape[0] * k.shape[2]


def new_cache(model, batch: int, capacity: int):
    """An empty cache for this model: ours preallocates `capacity` tokens; transformers' grows as it goes."""
    if hasattr(model, "new_cache"):
        return model.new_cache(batch, capacity)
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def length_of(cache) -> int:
    """Tokens a cache holds, ours (`.length`) or transformers' (`get_seq_length()`)."""
    return cache.length if hasattr(cache, "length") else int(cache.get_seq_length())


def rollback(cache, length: int) -> None:
    """Forget every token from `length` on, on any cache: ours by one assignment, transformers' DynamicCache by
    `crop` (which slices every layer). Example: a cache of 12 tokens, rollback(cache, 10) -> it holds 10."""
    if hasattr(cache, "rollback"):
        cache.rollback(length)
        return
    held = length_of(cache)
    if not 0 <= length <= held:
        raise ValueError(f"can only roll back to a length in [0, {held}], got {length}")
    if length < held:
        cache.crop(length - held)  # note: transformers' crop takes a negative count of tokens to remove


def _tensors(cache):
    """(keys list, values list) of any cache, for operations that rewrite every layer."""
    if isinstance(cache, KVCache):
        return cache.keys, cache.values
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _set(cache, keys, values) -> None:
    if isinstance(cache, KVCache):
        cache.keys, cache.values = keys, values
    else:
        for layer, k, v in zip(cache.layers, keys, values):
            layer.keys, layer.values = k, v


def select_rows(cache, index: torch.Tensor):
    """Keep only these batch rows (a request left the batch). Works on ours and on DynamicCache."""
    keys, values = _tensors(cache)
    _set(cache, [k[index] for k in keys], [v[index] for v in values])
    return cache


def join(cache_a, mask_a: torch.Tensor, cache_b, mask_b: torch.Tensor):
    """Stack two batched caches along the batch, left-padding the shorter in time. Returns (cache, mask (B, T))."""
    Ta, Tb = mask_a.shape[1], mask_b.shape[1]
    T = max(Ta, Tb)
    (ka, va), (kb, vb) = _tensors(cache_a), _tensors(cache_b)

    def stack(a, b):  # a: (Ba, KV, >=Ta, D), b: (Bb, KV, >=Tb, D) -> (Ba + Bb, KV, T + room, D)
        room = max(a.shape[2] - Ta, b.shape[2] - Tb, 1) if isinstance(cache_a, KVCache) else 0
        out = a.new_zeros(a.shape[0] + b.shape[0], a.shape[1], T + room, a.shape[3])
        out[:a.shape[0], :, T - Ta:T] = a[:, :, :Ta]
        out[a.shape[0]:, :, T - Tb:T] = b[:, :, :Tb]
        return out

    _set(cache_a, [stack(a, b) for a, b in zip(ka, kb)], [stack(a, b) for a, b in zip(va, vb)])
    if isinstance(cache_a, KVCache):
        cache_a.length = T
    pad = torch.nn.functional.pad
    mask = torch.cat([pad(mask_a, (T - Ta, 0)), pad(mask_b, (T - Tb, 0))])
    return cache_a, mask


def trim(cache, mask: torch.Tensor):
    """Drop leading columns that are padding in every row (left behind when a long request leaves)."""
    first = int(mask.any(dim=0).nonzero()[0])
    if first:
        keys, values = _tensors(cache)
        _set(cache, [k[:, :, first:] for k in keys], [v[:, :, first:] for v in values])
        if isinstance(cache, KVCache):
            cache.length -= first
        mask = mask[:, first:]
    return cache, mask


def positions_processed(prompt_len: int, n_new: int, cached: bool) -> int:
    """Token positions pushed through the model to produce n_new tokens.
    Example: prompt 10, 3 new -> cached 10 + 2 = 12; uncached 10 + 11 + 12 = 33"""
    if cached:
        return prompt_len + n_new - 1
    return sum(prompt_len + i for i in range(n_new))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int | float) -> float:
    """2 (keys and values) x layers x key/value heads x head dimension x bytes.
    Example: SmolLM2-135M in bfloat16: 2 * 30 * 3 * 64 * 2 = 23,040"""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def model_kv_bytes_per_token(config, dtype: torch.dtype) -> float:
    return kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config),
                              torch.empty((), dtype=dtype).element_size())


def cache_bytes(cache) -> int:
    """Bytes actually held by a cache object (every layer's key and value tensors), ours or transformers'."""
    if isinstance(cache, KVCache):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if torch.is_tensor(tensor):
                total += tensor.numel() * tensor.element_size()
    return total
