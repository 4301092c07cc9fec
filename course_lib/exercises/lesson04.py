"""Checks for 04_attention: a causal mask, one head by hand, grouped-query sharing, finding a head."""
from __future__ import annotations

import math

import torch

from ..runner.attention import attention_weights, kv_groups
from . import fresh, safely, verdict

# (text, query word, key word): a pronoun or noun and the word it may point back to (none is the lesson's own)
HEAD_TASKS = [("The trophy did not fit in the suitcase because it was too big.", " it", " trophy"),
              ("Alice gave Bob the book because he asked for it.", " he", " Bob"),
              ("The cat sat on the mat because it was warm.", " it", " mat"),
              ("The bank is closed because they had no money left.", " money", " bank"),
              ("When the dog saw the ball, it ran to fetch it.", " ran", " dog")]


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
    gen = torch.Generator(device="cpu").manual_seed(0)  # note: the check's own tensors, on the CPU on purpose
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


def strongest_task(tokenizer) -> dict:
    """A sentence, a query word and a key word, drawn at random, for exercise 4. Prints the task; pass the returned
    dict to check_strongest_head as **task."""
    text, query, key = fresh().choice(HEAD_TASKS)
    print(f"your sentence: {text!r}; from {query!r} to {key!r}")
    return {"text": text, "query": query, "key": key}


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
                   f"you said {answer!r}. Take weights[:, :, q, k] (an L x H table, q and k the positions of your two "
                   "words) and find its largest entry")


def check_patch_prediction(prediction, model, clean: list[int], corrupt: list[int], good: int, bad: int) -> bool:
    """prediction: the fraction of the clean answer recovered when the LAST block's output at the LAST position is
    copied from the clean run into the corrupted one. Measured here with probes.patch_residual."""
    from ..inside.probes import patch_residual
    if not isinstance(prediction, (int, float)) or isinstance(prediction, bool):
        return verdict(False, "", "give a number between 0 and 1 (or a little outside: patching can overshoot)")
    measured = float(patch_residual(model, clean, corrupt, good, bad, positions=[len(clean) - 1])["recovered"][-1, 0])
    ok = abs(prediction - measured) < 0.05
    return verdict(ok, f"measured {measured:.3f}: after the last block only the final norm and the head remain, and "
                   "they read that one vector", f"you predicted {prediction!r}, the measurement says {measured:.3f}. "
                   "Hint: what is left of the model after the last block, at the last position?")


def check_most_important_head(answer, effects) -> bool:
    """answer: (layer, head) whose ablation lowers the Paris-over-Berlin logit difference the most (effects: (L, H))."""
    from ..inside.probes import top_heads
    layer, head, e = top_heads(effects, 1, largest=False)[0]
    ok = isinstance(answer, tuple) and tuple(int(x) for x in answer) == (layer, head)
    return verdict(ok, f"layer {layer}, head {head}: removing it changes the logit difference by {e:+.2f}",
                   f"you said {answer!r}. The most important head has the most NEGATIVE effect: find the smallest "
                   "entry of the (L, H) table (argmin), and turn the flat index into (layer, head)")


def check_layer_effect(layer_effect, model, ids: list[int], good: int, bad: int, means) -> bool:
    """layer_effect(layer) -> the change in the logit difference when EVERY head of that layer is mean-ablated
    at once (probes.ablated_metric minus the clean metric)."""
    from ..inside.probes import ablated_metric
    heads = model.config.num_attention_heads
    base = ablated_metric(model, ids, good, bad, [])
    for layer in (model.config.num_hidden_layers - 7, 0):
        ok, got = safely(layer_effect, layer)
        if not ok:
            return verdict(False, "", got)
        want = ablated_metric(model, ids, good, bad, [(layer, h) for h in range(heads)], means) - base
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-3 * max(1.0, abs(want)):
            return verdict(False, "", f"for layer {layer} you said {got!r}, expected {want:+.3f}. Hint: ablate all "
                           f"{heads} heads of the layer in ONE run, then subtract the clean metric")
    return verdict(True, "a whole layer at once: compare it with the sum of its heads' single effects", "")
