"""Causal probes (lesson 04): what an answer depends on, measured by changing the model's insides and watching it.

What it does: on the library's model, through forward hooks (anatomy.py's way), never changing its weights.
`answer_ids` builds a running example's prompt up to the answer word; `logit_diff` is the metric: the logit of
the right answer minus the wrong one's at the last position. `ablate_heads` removes one attention head at a
time (its output, before the output projection, replaced by its mean over reference prompts, or by zeros) and
reports how the metric moves, for all heads (L x H); `ablate_mlps` does the same for each layer's feed-forward
block. `patch_residual` runs the corrupted prompt ("...Germany")
with the residual stream at one layer and one position copied from the clean run ("...France") and reports the
fraction of the clean answer that comes back, (L + 1) x T (row l: the input of block l; row L: the output of
the last block). `patch_heads` copies single heads' outputs instead. Patched runs recompute only the positions from the first
difference on (the shared start runs once, on a cache, through forward.run_model like every other pass here). `attention_to` reads how hard each head looks
from one position at others (eager attention). Each experiment runs one batched pass per layer: row r of the
batch carries intervention r.
What it does not do: say what a head "means" (the lesson says what was measured, on one metric and one pair of
prompts), or run on the course's own model (tests/test_probes.py does, as a second implementation of patching).
"""
from __future__ import annotations

import copy

import torch

from ..text.context import context_ids
from ..runner.forward import run_model
from ..runner.kv_cache import new_cache


def answer_ids(tokenizer, question: str, answer_start: str) -> list[int]:
    """The chat prompt for `question` followed by the start of the assistant's answer, so that the next token is
    the answer word. Example: answer_ids(tok, "What is the capital of France?", "The capital of France is")"""
    return context_ids(tokenizer, [{"role": "user", "content": question}]) + \
        tokenizer(answer_start, add_special_tokens=False)["input_ids"]


def token_id(tokenizer, word: str) -> int:
    """The single token of `word` (with its leading space), or a clear error. Example: " Paris" -> 7042"""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{word!r} is {len(ids)} tokens; the metric needs a one-token answer (mind the leading space)")
    return ids[0]


def logit_diff(logits: torch.Tensor, good: int, bad: int) -> torch.Tensor:
    """logits (B, V) at the last position -> (B,): logit of the right token minus the wrong one's."""
    return logits[:, good] - logits[:, bad]


def _blocks(model):
    return model.model.layers


def _shape(model) -> tuple[int, int, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    return cfg.num_hidden_layers, heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


@torch.inference_mode()
def _last_logits(model, ids: torch.Tensor, hooks, cache=None) -> torch.Tensor:
    """(B, V) float32 logits at the last position, with these (module, pre-hook) pairs attached for one pass
    (through forward.run_model; on `cache` when given: the tokens then continue what it holds)."""
    handles = [module.register_forward_pre_hook(fn) for module, fn in hooks]
    try:
        return run_model(model, ids.to(model.device), cache, keep=1)[0][:, -1]
    finally:
        for h in handles:
            h.remove()


def first_difference(clean: list[int], corrupt: list[int]) -> int:
    """The first position where the two prompts differ. Example: [1, 2, 3], [1, 5, 3] -> 1"""
    return next((i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b), len(clean))


class _Prefix:
    """The shared start of both prompts, run once: every patched row continues from a copy of its cache, so only
    the positions from the first difference on are computed again (patches there cannot change what comes
    before: the causal mask)."""

    def __init__(self, model, corrupt: list[int], start: int):
        self.model, self.start = model, start
        self.cache = None
        if start > 0:
            self.cache = new_cache(model, 1, len(corrupt))
            run_model(model, torch.tensor([corrupt[:start]], device=model.device), self.cache, keep=1)

    def rows(self, tokens: list[int], batch: int):
        """(ids (B, T - start), a cache of B rows holding the prefix, or None)."""
        ids = torch.tensor([tokens[self.start:]] * batch)
        if self.cache is None:
            return ids, None
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(batch)
        return ids, cache


def _check_pair(clean: list[int], corrupt: list[int]) -> None:
    if len(clean) != len(corrupt):
        raise ValueError(f"clean and corrupted prompts must have the same length to be patched position by position, "
                         f"got {len(clean)} and {len(corrupt)} tokens: choose words of one token each")


@torch.inference_mode()
def head_outputs(model, ids: list[int]) -> torch.Tensor:
    """Every head's output at every position, before the output projection: (L, T, H, D)."""
    L, H, D = _shape(model)
    seen = []
    hooks = [(block.self_attn.o_proj, lambda mod, args: seen.append(args[0][0].clone())) for block in _blocks(model)]
    _last_logits(model, torch.tensor([ids]), hooks)
    return torch.stack(seen).reshape(L, len(ids), H, D)


def mean_head_outputs(model, prompts: list[list[int]]) -> torch.Tensor:
    """(L, H, D): each head's output averaged over every position of these reference prompts (mean ablation)."""
    return torch.cat([head_outputs(model, p) for p in prompts], dim=1).mean(dim=1)


@torch.inference_mode()
def ablate_heads(model, ids: list[int], good: int, bad: int, means: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(effects (L, H), the clean metric): the change in logit_diff when each head alone is ablated at every
    position: replaced by its mean over a reference set (means, from mean_head_outputs), or by zeros (means=None).
    Negative: the head helped the right answer."""
    L, H, D = _shape(model)
    base = float(logit_diff(_last_logits(model, torch.tensor([ids]), []), good, bad)[0])
    effects = torch.zeros(L, H)
    batch = torch.tensor([ids] * H)  # row h ablates head h

    for layer, block in enumerate(_blocks(model)):
        def hook(mod, args, layer=layer):
            x = args[0].clone().view(H, len(ids), H, D)  # (B=H, T, H, D)
            rows = torch.arange(H)
            x[rows, :, rows] = 0 if means is None else means[layer].to(x.dtype)[:, None, :]
            return (x.view(H, len(ids), H * D),)
        effects[layer] = logit_diff(_last_logits(model, batch, [(block.self_attn.o_proj, hook)]), good, bad).cpu() - base
    return effects, base


@torch.inference_mode()
def ablated_metric(model, ids: list[int], good: int, bad: int, heads: list[tuple[int, int]],
                   means: torch.Tensor | None = None) -> float:
    """logit_diff with every (layer, head) in `heads` ablated at once (by its mean, or zeros): for a whole layer,
    or a group of heads. Example: ablated_metric(model, ids, good, bad, [(23, h) for h in range(9)])"""
    L, H, D = _shape(model)
    by_layer: dict[int, list[int]] = {}
    for layer, h in heads:
        if not (0 <= layer < L and 0 <= h < H):
            raise ValueError(f"no head ({layer}, {h}) in a model of {L} layers x {H} heads")
        by_layer.setdefault(layer, []).append(h)
    hooks = []
    for layer, hs in by_layer.items():
        def hook(mod, args, layer=layer, hs=hs):
            x = args[0].clone().view(1, len(ids), H, D)
            x[0, :, hs] = 0 if means is None else means[layer, hs].to(x.dtype)
            return (x.view(1, len(ids), H * D),)
        hooks.append((_blocks(model)[layer].self_attn.o_proj, hook))
    return float(logit_diff(_last_logits(model, torch.tensor([ids]), hooks), good, bad)[0])


@torch.inference_mode()
def mlp_inputs(model, ids: list[int]) -> torch.Tensor:
    """Every layer's feed-forward activation at every position, the input of its down projection: (L, T, I)."""
    seen = []
    hooks = [(block.mlp.down_proj, lambda mod, args: seen.append(args[0][0].clone())) for block in _blocks(model)]
    _last_logits(model, torch.tensor([ids]), hooks)
    return torch.stack(seen)


def mean_mlp_inputs(model, prompts: list[list[int]]) -> torch.Tensor:
    """(L, I): each layer's feed-forward activation averaged over every position of these reference prompts.
    Replacing the activation by this mean replaces the layer's feed-forward output by its mean (the down
    projection is linear)."""
    return torch.cat([mlp_inputs(model, p) for p in prompts], dim=1).mean(dim=1)


@torch.inference_mode()
def ablate_mlps(model, ids: list[int], good: int, bad: int, means: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(effects (L,), the clean metric): the change in logit_diff when one layer's feed-forward block is ablated
    at every position (its output replaced by the mean over a reference set, from mean_mlp_inputs, or by zeros).
    One batched pass: row l ablates layer l. Negative: that feed-forward block helped the right answer."""
    L = _shape(model)[0]
    base = float(logit_diff(_last_logits(model, torch.tensor([ids]), []), good, bad)[0])
    hooks = []
    for layer, block in enumerate(_blocks(model)):
        def hook(mod, args, layer=layer):
            x = args[0].clone()  # (L rows, T, I)
            x[layer] = 0 if means is None else means[layer].to(x.dtype)
            return (x,)
        hooks.append((block.mlp.down_proj, hook))
    effects = logit_diff(_last_logits(model, torch.tensor([ids] * L), hooks), good, bad).cpu() - base
    return effects, base


@torch.inference_mode()
def residuals(model, ids: list[int]) -> torch.Tensor:
    """The residual stream, (L + 1, T, hidden): row l is the input of block l, row L the last block's output."""
    seen = []
    hooks = [(block, lambda mod, args: seen.append(args[0][0].clone())) for block in _blocks(model)]
    hooks.append((model.model.norm, lambda mod, args: seen.append(args[0][0].clone())))
    _last_logits(model, torch.tensor([ids]), hooks)
    return torch.stack(seen)


def recovered(metric: torch.Tensor, clean: float, corrupt: float) -> torch.Tensor:
    """The fraction of the clean answer a patched run gets back: 0 = as corrupted, 1 = as clean."""
    return (metric - corrupt) / (clean - corrupt)


@torch.inference_mode()
def patch_residual(model, clean: list[int], corrupt: list[int], good: int, bad: int,
                   positions: list[int] | None = None) -> dict:
    """Run `corrupt` with the residual stream at one (layer, position) taken from `clean`, for every layer
    (block inputs, then the last block's output) and each position given (default: from the first position
    where the prompts differ to the end; before it, both runs are the same, so a patch there changes nothing).
    Returns {"recovered": (L + 1, P) fractions, "positions", "clean", "corrupt": the two metrics}."""
    _check_pair(clean, corrupt)
    differ = first_difference(clean, corrupt)
    positions = list(range(differ, len(clean))) if positions is None else list(positions)
    stream = residuals(model, clean)  # (L + 1, T, hidden)
    m_clean = float(logit_diff(_last_logits(model, torch.tensor([clean]), []), good, bad)[0])
    m_corrupt = float(logit_diff(_last_logits(model, torch.tensor([corrupt]), []), good, bad)[0])
    prefix = _Prefix(model, corrupt, min(differ, min(positions)))  # note: rows recompute only what a patch can reach
    at = [p - prefix.start for p in positions]  # the positions within the recomputed part
    sites = list(_blocks(model)) + [model.model.norm]
    out = torch.zeros(len(sites), len(positions))
    for layer, module in enumerate(sites):
        def hook(mod, args, layer=layer):
            x = args[0].clone()
            x[torch.arange(len(at)), at] = stream[layer, positions].to(x.dtype)  # row r patches positions[r]
            return (x,) + tuple(args[1:])
        ids, cache = prefix.rows(corrupt, len(positions))
        metric = logit_diff(_last_logits(model, ids, [(module, hook)], cache), good, bad).cpu()
        out[layer] = recovered(metric, m_clean, m_corrupt)
    return {"recovered": out, "positions": positions, "clean": m_clean, "corrupt": m_corrupt}


@torch.inference_mode()
def patch_heads(model, clean: list[int], corrupt: list[int], good: int, bad: int) -> torch.Tensor:
    """(L, H): the fraction recovered when one head's output, at every position, is taken from the clean run
    (from the first difference on: before it the two runs are the same)."""
    _check_pair(clean, corrupt)
    L, H, D = _shape(model)
    source = head_outputs(model, clean)  # (L, T, H, D)
    m_clean = float(logit_diff(_last_logits(model, torch.tensor([clean]), []), good, bad)[0])
    m_corrupt = float(logit_diff(_last_logits(model, torch.tensor([corrupt]), []), good, bad)[0])
    prefix = _Prefix(model, corrupt, first_difference(clean, corrupt))
    T = len(corrupt) - prefix.start
    out = torch.zeros(L, H)
    for layer, block in enumerate(_blocks(model)):
        def hook(mod, args, layer=layer):
            x = args[0].clone().view(H, T, H, D)
            rows = torch.arange(H)
            x[rows, :, rows] = source[layer, prefix.start:].to(x.dtype).permute(1, 0, 2)  # (H, T, D): row h gets head h
            return (x.view(H, T, H * D),)
        ids, cache = prefix.rows(corrupt, H)
        metric = logit_diff(_last_logits(model, ids, [(block.self_attn.o_proj, hook)], cache), good, bad).cpu()
        out[layer] = recovered(metric, m_clean, m_corrupt)
    return out


def attention_to(weights: torch.Tensor, query: int, keys: list[int]) -> torch.Tensor:
    """(L, H): how much attention each head pays from position `query` to the `keys` positions (summed), from
    attention.attention_weights' (L, H, T, T). Example: query -1 (the last token), keys [the country's positions]"""
    return weights[:, :, query, keys].sum(dim=-1)


def top_heads(scores: torch.Tensor, k: int = 5, largest: bool = True) -> list[tuple[int, int, float]]:
    """The k (layer, head, score) with the largest (or smallest) scores of an (L, H) table."""
    values, flat = scores.flatten().topk(k, largest=largest)
    H = scores.shape[1]
    return [(int(i) // H, int(i) % H, float(v)) for v, i in zip(values, flat)]
