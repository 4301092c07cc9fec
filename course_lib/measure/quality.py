"""Quality of a model against a reference or against text (lesson 12): teacher-forced agreement, KL, perplexity.

What it does: `log_probs` (every position's next-token log-probabilities, one pass through forward.run_model,
no cache), `agreement` (top-1 agreement and mean KL of one model against another on the same tokens) and
`perplexity` (of a model on a text).
What it does not do: choose a reference (the lesson says which one it uses and why).
"""
from __future__ import annotations

import torch

from ..forward import run_model
from ..model import Model


@torch.inference_mode()
def log_probs(model, ids: list[int]) -> torch.Tensor:
    """Next-token log-probabilities at every position of one sequence, one pass, no cache. (T, V) float32."""
    x = torch.tensor([ids], device=model.device)  # (1, T)
    logits, _ = run_model(model, x, None, keep=0)  # (1, T, V)
    return torch.log_softmax(logits[0], dim=-1)


def agreement(reference: Model, model: Model, sequences: list[list[int]], starts: list[int] | None = None) -> dict:
    """How close `model` is to `reference` on the same token sequences (teacher forcing: both read the same
    tokens): the fraction of positions whose top token agrees, and the mean KL(reference || model) in nats,
    over each sequence's positions from its start on (for example: the answer only, not the prompt)."""
    agree = total = 0
    kl = 0.0
    for ids, start in zip(sequences, starts or [0] * len(sequences)):
        p, q = log_probs(reference, ids)[start:], log_probs(model, ids)[start:]  # (T', V)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - q)).sum())
        total += p.shape[0]
    return {"top1_agreement": agree / total, "kl": kl / total, "positions": total}


def perplexity(model: Model, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each next token of a text): lower is better. Example: uniform over V -> V"""
    lp = log_probs(model, ids)[:-1]  # (T-1, V): predictions for tokens 1..T-1
    nll = -lp.gather(1, torch.tensor(ids[1:], device=lp.device)[:, None]).mean()
    return float(torch.exp(nll))
