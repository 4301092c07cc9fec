"""Attention as engines compute it (lesson 16): online softmax, tiled attention, paged decode attention.

What it does: computes softmax over a row in pieces with a running maximum and a running sum
(`online_softmax`); merges partial attention results by the log-sum-exp rule (`Partial`, `merge`);
computes causal attention tile by tile without ever holding the T x S score matrix (`tiled_attention`:
FlashAttention's forward, in plain torch, grouped-query heads folded into the query axis); and
attends one new token per row to keys and values that stay in the blocks of a paged pool, walking each
row's block table (`paged_decode_by_hand`: one block at a time, the algorithm; `paged_decode`: tiles of
blocks for every row at once, what the paged cache runs), with split-K (several partial results per row,
merged) as a parameter. `gather_decode` is the reference they are tested against: it copies every row's
keys and values into one padded tensor first, then runs torch's attention on the copy.
What it does not do: run a custom kernel (everything is torch operators, on the CPU as on CUDA), train,
or attend with a padding mask other than each row's length (rows of a paged batch need no other).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def _exp_minus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a - b), with exp(-inf - -inf) taken as 0: a piece where everything is masked weighs nothing."""
    return torch.where(b == NEG_INF, torch.zeros_like(a), torch.exp(a - b))


def online_softmax(row: torch.Tensor, piece: int) -> tuple[torch.Tensor, list[tuple[float, float]]]:
    """softmax(row) computed from pieces of `piece` entries: a running maximum m and a running sum l of
    exp(x - m), rescaled by exp(m_old - m_new) whenever the maximum grows. Returns (probabilities, the
    (m, l) after each piece). A row of only -inf gives NaN, as torch.softmax does.
    Example: online_softmax(torch.tensor([1., 3., 2.]), 2)[0] equals torch.softmax of the same row"""
    if row.dim() != 1 or not row.numel():
        raise ValueError(f"online_softmax takes one non-empty row, got shape {tuple(row.shape)}")
    if not isinstance(piece, int) or piece < 1:
        raise ValueError(f"a piece holds a whole number of entries >= 1, got {piece!r}")
    m, l, trace = torch.tensor(NEG_INF, dtype=row.dtype), torch.tensor(0.0, dtype=row.dtype), []
    for s in range(0, row.numel(), piece):
        x = row[s:s + piece]
        m_new = torch.maximum(m, x.max())
        l = l * _exp_minus(m, m_new) + _exp_minus(x, m_new).sum()  # old sum rescaled to the new maximum
        m = m_new
        trace.append((float(m), float(l)))
    return torch.exp(row - m) / l, trace  # the second pass: every entry against the final m and l


@dataclass
class Partial:
    """Attention over some of the keys: the output normalised over those keys (..., D) and the log of its
    softmax denominator, lse = m + log(l) (...). Two partials over disjoint keys merge into the attention
    over both (`merge`); an empty one has lse = -inf."""
    out: torch.Tensor
    lse: torch.Tensor


def merge(a: Partial, b: Partial) -> Partial:
    """The log-sum-exp rule: lse = log(e^lse_a + e^lse_b); out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse).
    Each side's weight is the share of the total softmax mass its keys hold."""
    lse = torch.logaddexp(a.lse, b.lse)
    wa, wb = _exp_minus(a.lse, lse), _exp_minus(b.lse, lse)
    return Partial(a.out * wa.unsqueeze(-1) + b.out * wb.unsqueeze(-1), lse)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None) -> Partial:
    """Attention of queries q (..., Q, D) over keys/values (..., S, D), as a Partial. valid (..., Q, S) or
    broadcastable, True = may look; a query with no valid key gets lse = -inf and out 0."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (..., Q, S)
    if valid is not None:
        scores = scores.masked_fill(~valid, NEG_INF)
    m = scores.amax(-1)  # (..., Q)
    p = _exp_minus(scores, m.unsqueeze(-1))
    l = p.sum(-1)
    out = (p @ v) / l.clamp_min(1e-30).unsqueeze(-1)
    return Partial(out, torch.where(l > 0, m + torch.log(l), torch.full_like(l, NEG_INF)))


def score_matrix_bytes(tokens: int, heads: int, element_bytes: int = 4, layers: int = 1) -> int:
    """Bytes of the T x T attention scores of `heads` heads (what plain attention holds at once, per layer).
    Example: 8,192 tokens, 9 heads, float32 -> 2,415,919,104 bytes (2.4 GB)"""
    return tokens * tokens * heads * element_bytes * layers


def attention_traffic(tokens: int, heads: int, kv_heads: int, head_dim: int, tile: int | None = None,
                      element_bytes: int = 4) -> dict:
    """Bytes one layer's causal prefill reads from and writes to memory, counted from the shapes (not measured).
    Written out (tile None): q, k, v read; the scores written, read and written again by softmax, read again by the
    product with the values; the output written. Tiled (square tiles of `tile`): q read once, each query tile reads
    the key and value tiles up to the diagonal, the output written once; scores never leave the tile.
    Example: attention_traffic(4096, 9, 3, 64)["written"] is about 1.2 GB (two T x T matrices per head)"""
    e, T = element_bytes, tokens
    q = o = heads * T * head_dim * e
    kv = 2 * kv_heads * T * head_dim * e
    if tile is None:
        scores = heads * T * T * e
        return {"read": q + kv + 2 * scores, "written": 2 * scores + o}
    n = -(-T // tile)
    kv_reads = n * (n + 1) // 2 * 2 * kv_heads * min(tile, T) * head_dim * e  # query tile i reads key tiles 0..i
    return {"read": q + kv_reads, "written": o}


def written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as a textbook writes it: the whole (B, H, T, T) score matrix, softmax, then the values.
    q (B, H, T, D), k and v (B, KV, T, D). The reference the tiled version saves memory against."""
    H, KV, T = q.shape[1], k.shape[1], q.shape[2]
    scores = q @ k.repeat_interleave(H // KV, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), NEG_INF)
    return torch.softmax(scores, -1) @ v.repeat_interleave(H // KV, 1)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0, tile_q: int = 64,
                    tile_k: int = 64, trace: list | None = None) -> torch.Tensor:
    """Causal attention computed in tiles (FlashAttention's forward). q (B, H, T, D) at columns [start, start + T);
    k, v (B, KV, S, D), S = start + T, with H = G x KV (each key/value head serves G query heads, folded into
    the query axis so keys are read once). Per query tile: a running max m, sum l and output acc over key
    tiles; a key tile wholly after the tile's last query is skipped; the score matrix is never whole.
    trace: if a list, gets (query tile start, key tile start, running max (B, H, tile) after it) per tile.
    Returns (B, H, T, D) in q's dtype."""
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    if S != start + T or H % KV:
        raise ValueError(f"keys cover {S} columns for {T} queries starting at {start}, heads {H} over {KV} groups")
    G, scale = H // KV, 1 / math.sqrt(D)
    qg = q.reshape(B, KV, G, T, D)
    out = torch.empty_like(qg)
    for qs in range(0, T, tile_q):
        qt = qg[:, :, :, qs:qs + tile_q]  # (B, KV, G, tq, D)
        tq = qt.shape[3]
        rows = torch.arange(qs, qs + tq, device=q.device)[:, None] + start  # each query's own column
        m = torch.full((B, KV, G, tq), NEG_INF, dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, KV, G, tq, D, dtype=torch.float32, device=q.device)
        for ks in range(0, S, tile_k):
            if ks > start + qs + tq - 1:
                break  # every key of this tile comes after every query of this tile: causal, skipped
            kt, vt = k[:, :, None, ks:ks + tile_k], v[:, :, None, ks:ks + tile_k]  # (B, KV, 1, tk, D)
            s = (qt @ kt.transpose(-1, -2)).float() * scale  # (B, KV, G, tq, tk): one tile of scores
            if ks + kt.shape[3] - 1 > start + qs:  # the tile crosses the diagonal: mask the future
                cols = torch.arange(ks, ks + kt.shape[3], device=q.device)[None, :]
                s = s.masked_fill(cols > rows, NEG_INF)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new.unsqueeze(-1))  # note: every row has seen column 0, so m_new is finite
            alpha = torch.exp(m - m_new)  # how much the old sum and output shrink under the new maximum
            l = l * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + p.to(vt.dtype) @ vt
            m = m_new
            if trace is not None:
                trace.append((qs, ks, m.reshape(B, H, tq).clone()))
        out[:, :, :, qs:qs + tq] = (acc / l.unsqueeze(-1)).to(q.dtype)
    return out.reshape(B, H, T, D)


def gather_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: torch.Tensor,
                  lengths: torch.Tensor) -> torch.Tensor:
    """The reference: copy every row's keys and values through its slots into one padded tensor, then torch's
    attention with a padding mask. q (B, H, D); keys/values: the pool (slots, KV, D); read (B, S) slots, rows
    right-aligned (row r's tokens in its last lengths[r] columns). Returns (B, H, D)."""
    B, H, D = q.shape
    KV, S = keys.shape[1], read.shape[1]
    k, v = keys[read].transpose(1, 2), values[read].transpose(1, 2)  # (B, KV, S, D): the copy
    valid = torch.arange(S, device=q.device)[None, :] >= (S - lengths.to(q.device))[:, None]  # (B, S)
    out = F.scaled_dot_product_attention(q.reshape(B, KV, H // KV, D), k, v, attn_mask=valid[:, None, None, :])
    return out.reshape(B, H, D)


def paged_decode_by_hand(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: list[int], length: int,
                         block_size: int, steps: list | None = None) -> torch.Tensor:
    """One row's decode attention, block by block where the blocks lie: keys[b * bs:(b + 1) * bs] is a view of
    the pool, not a copy. q (H, D); keys/values the pool (slots, KV, D). Each block gives a Partial; they are
    merged as they come. steps: if a list, gets (block, its share of the softmax mass so far) per block.
    Returns (H, D). Slow (a Python loop over blocks): the algorithm, not the fast path."""
    H, D = q.shape
    KV = keys.shape[1]
    qg = q.reshape(KV, H // KV, D)
    total = None
    for i, b in enumerate(table[:-(-length // block_size)]):
        n = min(block_size, length - i * block_size)  # the last block may be part-full
        k = keys[b * block_size:b * block_size + n].transpose(0, 1)  # (KV, n, D): a view of the pool
        v = values[b * block_size:b * block_size + n].transpose(0, 1)
        part = partial_attention(qg, k, v)  # out (KV, G, D), lse (KV, G)
        total = part if total is None else merge(total, part)
        if steps is not None:
            steps.append((b, part.lse.reshape(H)))
    if steps is not None:  # each block's share of the final softmax mass, per head
        steps[:] = [(b, torch.exp(lse - total.lse.reshape(H))) for b, lse in steps]
    return total.out.reshape(H, D)


TILE_TOKENS = 1024  # tokens (all rows together) staged per tile: about 1.5 MB of float32 keys and values, cache-sized


@dataclass
class Tile:
    """One step of the paged decode: a run of logical blocks of every row, read together. blocks (B * n,): the
    physical blocks, row after row; tokens: n x block_size columns per row; bias (B, 1, 1, tokens): 0 where the
    row has a token there, -1e30 where it does not (added to the scores); split: which split-K range it is in."""
    blocks: torch.Tensor
    tokens: int
    bias: torch.Tensor
    split: int


def decode_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, tile_tokens: int = TILE_TOKENS,
                splits: int = 1, dtype: torch.dtype = torch.float32) -> list[Tile]:
    """Cut every row's block table into tiles, once per step (every layer reuses the plan). tables (B, N):
    physical block of each logical block, rows padded with any block (the bias masks it); lengths (B,): tokens
    each row attends to. A tile holds max(1, tile_tokens // (B x block_size)) blocks per row, so the staged
    keys and values stay about tile_tokens tokens whatever the batch. splits: split-K ranges (>= 1)."""
    if tables.dim() != 2 or lengths.shape != tables.shape[:1]:
        raise ValueError(f"tables (B, N) and lengths (B,) expected, got {tuple(tables.shape)} and {tuple(lengths.shape)}")
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"split-K needs a whole number of ranges >= 1, got {splits!r}")
    B, N = tables.shape
    if int(lengths.max()) > N * block_size or int(lengths.min()) < 1:
        raise ValueError(f"row lengths {lengths.tolist()} do not fit {N} blocks of {block_size} (each row needs >= 1)")
    per_tile = max(1, tile_tokens // (B * block_size))
    per_split = -(-N // splits)
    plan = []
    for split, first in enumerate(range(0, N, per_split)):
        for j in range(first, min(first + per_split, N), per_tile):
            n = min(per_tile, first + per_split - j, N - j)
            cols = torch.arange(j * block_size, (j + n) * block_size, device=tables.device)
            valid = cols[None, :] < lengths[:, None].to(tables.device)  # (B, tokens)
            bias = torch.zeros(valid.shape, dtype=dtype, device=tables.device).masked_fill(~valid, -1e30)
            plan.append(Tile(tables[:, j:j + n].reshape(-1), n * block_size, bias[:, None, None, :], split))
    return plan


def tile_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> Partial:
    """Partial attention of q (B, KV, G, D) over one tile k, v (B, KV, n, D) with an additive bias (None: every key
    counts). On the CPU,
    torch's fused flash kernel, which returns the log-sum-exp beside the output; elsewhere the same in operators."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
        return Partial(out, lse.float())
    return partial_attention(q, k, v, None if bias is None else bias == 0)


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: list[Tile],
                 block_size: int) -> torch.Tensor:
    """Decode attention of every row at once, through the block tables (`decode_plan`). q (B, H, D); keys/values:
    the pool (slots, KV, D). Per tile, whole blocks are read from the pool (the only copy: one tile's worth,
    cache-sized and used at once; never the whole context), attended with a fused kernel that also returns the
    log-sum-exp, and merged into the running result of its split; the splits' results are merged last. Returns (B, H, D)."""
    B, H, D = q.shape
    KV = keys.shape[1]
    blocks_k = keys.view(-1, block_size * KV * D)  # (num_blocks, bs x KV x D): a view of the pool, one block per row
    blocks_v = values.view(-1, block_size * KV * D)
    qg = q.reshape(B, KV, H // KV, D)
    done: dict[int, Partial] = {}
    for tile in plan:
        k = blocks_k.index_select(0, tile.blocks).view(B, tile.tokens, KV, D).transpose(1, 2)  # (B, KV, n, D)
        v = blocks_v.index_select(0, tile.blocks).view(B, tile.tokens, KV, D).transpose(1, 2)
        part = tile_partial(qg, k, v, tile.bias)  # out (B, KV, G, D), lse (B, KV, G)
        done[tile.split] = merge(done[tile.split], part) if tile.split in done else part
    splits = [done[s] for s in sorted(done)]
    total = splits[0]
    for part in splits[1:]:  # split-K: the ranges' partial results, merged by the same rule
        total = merge(total, part)
    return total.out.to(q.dtype).reshape(B, H, D)
