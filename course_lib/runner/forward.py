"""One forward pass: token IDs in, next-token logits and probabilities out.

What it does: holds `run_model`, THE call into a model for inference (every forward pass of the
engine, with a cache or without, goes through it), and writes down the runner contract it relies on
(`Runner`: what a model must accept and return; transformers' model and the course's `model.Model`
both meet it). Runs the model on a prompt without gradients, turns logits into probabilities, and
reports the top candidates for the next token as plain data.
What it does not do: sample (sampling.py, whose `logits_to_probs` is the whole filter chain), loop
over new tokens (generation.py), or look inside the layers (anatomy.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Runner(Protocol):
    """The runner contract: the one thing that touches weights. Called as
    `model(input_ids=(B, T), attention_mask=(B, S) | None, position_ids=(B, T) | None, cache=a Cache | None,
    use_cache=bool, logits_to_keep=int)`, it returns an object whose `.logits` is (B, keep or T, V).
    It also carries `.device`, `.config` (vocab_size, max_position_embeddings) and, optionally,
    `.generation_config.eos_token_id` and `.new_cache(batch, capacity)` (a preallocated cache of its own)."""
    device: torch.device
    config: Any

    def __call__(self, *, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                 logits_to_keep=0) -> Any: ...


def as_batch(input_ids) -> torch.Tensor:
    """A list of IDs or a (T,) / (B, T) tensor as a (B, T) long tensor. Example: [5, 6] -> tensor([[5, 6]])"""
    if isinstance(input_ids, (str, bytes)):
        raise TypeError("the prompt is text, not token IDs: tokenize it first, for example "
                        "context.context_ids(tokenizer, messages) or tokenizer(text)['input_ids']")
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (T,) or (B, T) sequence, got shape {tuple(ids.shape)}")
    return ids


@torch.inference_mode()
def run_model(model, ids: torch.Tensor, cache, attention_mask=None, position_ids=None, keep: int = 1):
    """THE call into a model for inference. ids (B, T) on the model's device; cache None = no cache (one
    plain forward pass). keep: how many last positions get logits (0 = all). Returns (logits (B, keep, V) in
    float32 on the model's device, the cache)."""
    device = ids.device
    mask = attention_mask.to(device) if attention_mask is not None else None
    positions = position_ids.to(device) if position_ids is not None else None
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                logits_to_keep=keep)
    return out.logits[:, out.logits.shape[1] - (keep or out.logits.shape[1]):, :].float(), cache  # (B, keep, V)


@torch.inference_mode()
def forward_logits(model, input_ids) -> torch.Tensor:
    """Logits for every position of the prompt in one pass, no cache. Returns (B, T, V) float32 on the model's device."""
    ids = as_batch(input_ids).to(model.device)  # (B, T)
    logits, _ = run_model(model, ids, None, keep=0)  # (B, T, V)
    return logits


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the vocabulary (last dimension), in float32, no filter. Example: [0., 0.] -> [0.5, 0.5]"""
    return torch.softmax(logits.float(), dim=-1)


def entropy_bits(probs: torch.Tensor) -> float:
    """Shannon entropy of one distribution, in bits (0 for a certain choice)."""
    p = probs[probs > 0]
    return float(-(p * p.log2()).sum())


@dataclass(frozen=True)
class Candidate:
    rank: int
    token_id: int
    text: str
    prob: float


def top_candidates(tokenizer, probs: torch.Tensor, k: int = 10) -> list[Candidate]:
    """The k most probable next tokens of one (V,) distribution, best first."""
    values, ids = torch.topk(probs, k)
    return [Candidate(r + 1, int(i), tokenizer.decode([int(i)]), float(v))
            for r, (v, i) in enumerate(zip(values, ids))]
