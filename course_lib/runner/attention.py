"""Attention: the weights the real model computes, and the same computation written by hand.

What it does: collects the attention weights of every layer and head (needs a model loaded with
attn_implementation="eager"; SDPA returns none), re-implements one layer's attention from its own
weights (RMSNorm, projections, rotary positions, grouped-query key/value sharing, causal mask,
softmax, values) so it can be checked against the library, maps query heads to their shared
key/value heads, and times the attention score computation as the sequence grows.
What it does not do: draw (plots.py) or claim what a head "means": lessons measure that.
"""
from __future__ import annotations

import math
import time

import torch


@torch.inference_mode()
def attention_weights(model, input_ids) -> torch.Tensor:
    """Attention of every layer and head on one prompt. Returns (L, H, T, T) float32 on CPU; rows sum to 1."""
    if model.config._attn_implementation != "eager":
        raise ValueError("attention weights need load_model(attn_implementation='eager'); SDPA does not return them")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(model.device)  # (B=1, T)
    out = model(input_ids=ids, output_attentions=True)
    return torch.stack([a[0] for a in out.attentions]).float().cpu()  # (L, H, T, T)


def kv_groups(config) -> dict[int, list[int]]:
    """Which query heads share each key/value head (grouped-query attention). Example: 9 q, 3 kv -> {0: [0, 1, 2], ...}"""
    per_group = config.num_attention_heads // config.num_key_value_heads
    return {g: list(range(g * per_group, (g + 1) * per_group)) for g in range(config.num_key_value_heads)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector to unit root-mean-square, then by a learned weight (no mean subtraction, no bias).
    Computed in float32 and returned in x's dtype, as the library does (it matters in bfloat16)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position tables: each pair of dimensions turns by an angle that grows with the position. (T, D) each"""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)  # (D/2,)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D): llama pairs dimension i with i + D/2
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + D/2) pair of x (..., T, D) by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def attention_by_hand(layer, x: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention sub-block from its own weights. x: (T, hidden) residual stream entering the layer.
    Returns (attention output before the residual add (T, hidden), weights (H, T, T)), on x's device."""
    attn, T = layer.self_attn, x.shape[0]
    weight = attn.q_proj.weight
    x = x.to(weight.device, weight.dtype)  # note: the residual stream may come from the CPU (layer_outputs)
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    D = getattr(config, "head_dim", None) or D
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)  # (T, hidden)
    q = attn.q_proj(h).view(T, H, D).transpose(0, 1)  # (H, T, D)
    k = attn.k_proj(h).view(T, KV, D).transpose(0, 1)  # (KV, T, D)
    v = attn.v_proj(h).view(T, KV, D).transpose(0, 1)  # (KV, T, D)
    cos, sin = rotary_cos_sin(torch.arange(T, device=x.device), D, config.rope_parameters["rope_theta"])
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k = k.repeat_interleave(H // KV, dim=0)  # (H, T, D): each key/value head serves H/KV query heads
    v = v.repeat_interleave(H // KV, dim=0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (H, T, T)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
    scores = scores.masked_fill(causal, float("-inf"))  # a token may not look at later tokens
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (H, T, T)
    out = (weights @ v).transpose(0, 1).reshape(T, H * D)  # (T, hidden)
    return attn.o_proj(out), weights.float().cpu()


def top_attended(weights: torch.Tensor, query: int, key: int, k: int = 5) -> list[tuple[int, int, float]]:
    """The k (layer, head) pairs where position `query` gives the most attention to position `key`.
    weights: (L, H, T, T)."""
    scores = weights[:, :, query, key]  # (L, H)
    values, flat = torch.topk(scores.flatten(), k)
    H = weights.shape[1]
    return [(int(i) // H, int(i) % H, float(v)) for v, i in zip(values, flat)]


def score_times(lengths: list[int], heads: int, head_dim: int, repeats: int = 5) -> list[list[float]]:
    """Seconds of every one of `repeats` computations of causal softmax(QK^T / sqrt(D)) V for random inputs of
    each length (one list per length, in the order run), after one untimed warm-up per length: the first
    computation at a new size also asks the system for its memory (page faults), which is not attention's cost."""
    out = []
    for T in lengths:
        q, k, v = (torch.randn(heads, T, head_dim) for _ in range(3))  # (H, T, D)
        runs = []
        for _ in range(repeats + 1):  # the first run is the untimed warm-up, dropped below
            start = time.perf_counter()
            s = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(
                torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            torch.softmax(s, dim=-1) @ v
            runs.append(time.perf_counter() - start)
        out.append(runs[1:])
    return out
