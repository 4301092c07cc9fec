"""Quality of a model against a reference or against text (lesson 12): teacher-forced agreement, KL, perplexity.

What it does: `log_probs` (every position's next-token log-probabilities, one pass through forward.run_model,
no cache), `agreement` (top-1 agreement and mean KL of one model against another on the same tokens) and
`perplexity` (of a model on a text).
What it does not do: choose a reference (the lesson says which one it uses and why).
"""
from __future__ import annotations

import torch

from ..runner.forward import run_model
from ..runner.model import Model


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


# --- Layer sensitivity (lesson 12): round further than the file did, one part of the model at a time ---

# name -> (bits, group, symmetric). The file's own rule comes first: applied to the file's values it changes nothing.
SCHEMES = {
    "4-bit min/max, 32 (the file's Q4_1)": (4, 32, False),
    "4-bit symmetric, 32": (4, 32, True),
    "4-bit min/max, 64": (4, 64, False),
    "3-bit min/max, 32": (3, 32, False),
    "2-bit min/max, 32": (2, 32, False),
}


def bits_per_weight(bits: int, group: int, symmetric: bool) -> float:
    """Stored bits per weight: the number itself plus each group's float16 scale (and minimum, if not symmetric)."""
    return bits + (16 if symmetric else 32) / group


def round_trip(w: torch.Tensor, bits: int, group: int, symmetric: bool = False) -> torch.Tensor:
    """w (N, K) rounded to 2**bits levels per group of `group` weights along K, and back to float32.
    min/max: levels spread from each group's minimum to its maximum (the file's rule at bits=4, group=32);
    symmetric: levels -(2**(bits-1) - 1)..2**(bits-1) - 1 times one scale, zero kept exact."""
    if not 1 < bits <= 8:
        raise ValueError(f"bits must be 2..8, got {bits}")
    N, K = w.shape
    if K % group:
        raise ValueError(f"the input size {K} is not a multiple of the group size {group}")
    blocks = w.float().reshape(N, K // group, group)  # (N, K/G, G)
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
        return (torch.round(blocks / scale).clamp(-top, top) * scale).reshape(N, K)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    scale = ((high - low) / (2 ** bits - 1)).clamp(min=1e-12)
    return (torch.round((blocks - low) / scale).clamp(0, 2 ** bits - 1) * scale + low).reshape(N, K)


def requantized(model: Model, scheme: tuple[int, int, bool], part) -> Model:
    """A float32 copy of `model` with one part's weights rounded by `scheme` (bits, group, symmetric):
    part "layers" (every layer's four matrices), "attention" (q|k|v and o), "feed-forward" (gate|up and down),
    "head" (the output head only: the embedding lookup keeps the file's values) or a layer index."""
    from dataclasses import replace
    from ..runner.model import Linear
    if model.dtype != torch.float32:
        raise ValueError("requantized() starts from the float32 model")
    names = {"attention": ("qkv", "o"), "feed-forward": ("gate_up", "down")}
    names["layers"] = names["attention"] + names["feed-forward"]
    if not (part in names or part == "head" or (isinstance(part, int) and 0 <= part < len(model.layers))):
        raise ValueError(f"unknown part {part!r}: 'layers', 'attention', 'feed-forward', 'head' or a layer index")
    out = Model.__new__(Model)
    out.__dict__.update(model.__dict__)
    rounded = lambda linear: Linear(round_trip(linear.weight, *scheme))  # noqa: E731 - (N, K) view, any layout
    if part == "head":
        out.lm_head = rounded(model.lm_head)
        return out
    chosen = names["layers"] if isinstance(part, int) else names[part]
    out.layers = [replace(layer, **{n: rounded(getattr(layer, n)) for n in chosen})
                  if part in names or i == part else layer for i, layer in enumerate(model.layers)]
    return out
