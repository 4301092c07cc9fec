"""Checks for 04_attention: a causal mask, one head by hand, grouped-query sharing, finding a head."""
from __future__ import annotations

import math

import torch

from ..attention import attention_weights, kv_groups
from . import safely, verdict


def check_causal_mask(causal_mask) -> bool:
    """causal_mask(T) -> (T, T) bool tensor, True where a query may NOT look (keys after it)."""
    for T in (1, 4, 9):
        ok, got = safely(causal_mask, T)
        if not ok:
            return verdict(False, "", got)
        want = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        if not torch.is_tensor(got) or got.dtype != torch.bool or not torch.equal(got, want):
            return verdict(False, "", f"for T={T} your mask differs. Hint: torch.triu(torch.ones(T, T, dtype=torch.bool), 1)")
    return verdict(True, "True above the diagonal: nobody sees the future", "")


def check_head_by_hand(head_weights) -> bool:
    """head_weights(q, k) -> (T, T) causal attention weights softmax(q k^T / sqrt(D)) for q, k of shape (T, D)."""
    gen = torch.Generator().manual_seed(0)
    for T, D in [(5, 64), (9, 16)]:
        q, k = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        ok, got = safely(head_weights, q.clone(), k.clone())
        if not ok:
            return verdict(False, "", got)
        scores = (q @ k.T / math.sqrt(D)).masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        want = torch.softmax(scores, dim=-1)
        if not torch.is_tensor(got) or got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
            return verdict(False, "", "your weights differ: scale by 1/sqrt(D), mask the future with -inf, softmax each row")
    return verdict(True, "that is one attention head, the same computation as the model's", "")


def check_kv_head(kv_head_of, config) -> bool:
    """kv_head_of(query_head) -> the key/value head it reads, for this model's grouped-query attention."""
    for group, heads in kv_groups(config).items():
        for h in heads:
            ok, got = safely(kv_head_of, h)
            if not ok:
                return verdict(False, "", got)
            if got != group:
                return verdict(False, "", f"query head {h} reads key/value head {group}, you said {got!r}. Hint: "
                               "consecutive query heads share one: h // (query heads // key/value heads)")
    return verdict(True, "three query heads per key/value head: the cache stores a third of the keys", "")


def check_strongest_head(answer, model, tokenizer, text: str, query: str, key: str) -> bool:
    """answer: (layer, head) where the token `query` gives the most attention to the token `key` in `text`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    weights = attention_weights(model, ids)  # (L, H, T, T)
    scores = weights[:, :, pieces.index(query), pieces.index(key)]
    flat = int(scores.argmax())
    want = (flat // scores.shape[1], flat % scores.shape[1])
    ok = isinstance(answer, tuple) and tuple(answer) == want
    return verdict(ok, f"layer {want[0]}, head {want[1]} puts {float(scores.max()):.2f} of {query!r}'s attention on {key!r}",
                   f"you said {answer!r}. Take weights[:, :, q, k] (an L x H table) and find its largest entry")
