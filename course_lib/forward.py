"""One forward pass: token IDs in, next-token logits and probabilities out.

What it does: runs the model on a prompt without gradients (through generation.run_model, the one
inference call), turns logits into probabilities, and reports the top candidates for the next token
as plain data.
What it does not do: sample (sampling.py, whose `logits_to_probs` is the whole filter chain), loop
over new tokens (generation.py), or look inside the layers (anatomy.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
def forward_logits(model, input_ids) -> torch.Tensor:
    """Logits for every position of the prompt in one pass, no cache. Returns (B, T, V) float32 on the model's device."""
    from .generation import run_model
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
