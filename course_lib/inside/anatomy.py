"""The model's anatomy as data: where the parameters are, the shape after each stage, the residual
stream after each layer, the logit lens, one decoder block by hand, and the FLOPs per token.

What it does: reads a transformers llama-style model (its modules, parameters and hooks) and returns
plain tensors and lists for lessons 03, 04 and 08. These views look inside one forward pass with hooks;
they are not the inference path (that is generation.run_model).
What it does not do: generate, cache or draw (plots.py).
"""
from __future__ import annotations

import torch

from ..runner.forward import as_batch


def parameter_map(model) -> list[tuple[str, int]]:
    """Parameter count per part of a llama-style model, in forward order; tied weights counted once."""
    inner, cfg = model.model, model.config
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    block = inner.layers[0]
    parts = [("embedding", count(inner.embed_tokens)),
             (f"attention x{cfg.num_hidden_layers}", count(block.self_attn) * cfg.num_hidden_layers),
             (f"feed-forward x{cfg.num_hidden_layers}", count(block.mlp) * cfg.num_hidden_layers),
             (f"norms x{2 * cfg.num_hidden_layers + 1}", (count(block.input_layernorm) + count(block.post_attention_layernorm))
              * cfg.num_hidden_layers + count(inner.norm))]
    tied = model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
    parts.append(("output head (tied to embedding)" if tied else "output head", 0 if tied else count(model.lm_head)))
    return parts


BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "4-bit": 0.5}


def memory_by_dtype(n_params: int) -> dict[str, float]:
    """Bytes the weights take in each format. Example: 1e6 params -> {"float32": 4e6, ...}"""
    return {name: n_params * b for name, b in BYTES_PER_PARAM.items()}


@torch.inference_mode()
def capture_shapes(model, input_ids) -> list[tuple[str, tuple]]:
    """Shape of the output of each stage (embedding, first block's parts, every block, norm, head) via hooks."""
    inner, records, handles = model.model, [], []
    stages = [("embedding", inner.embed_tokens), ("block 0: input norm", inner.layers[0].input_layernorm),
              ("block 0: q projection", inner.layers[0].self_attn.q_proj),
              ("block 0: k projection", inner.layers[0].self_attn.k_proj),
              ("block 0: attention out", inner.layers[0].self_attn.o_proj),
              ("block 0: feed-forward up", inner.layers[0].mlp.up_proj), ("block 0: feed-forward out", inner.layers[0].mlp)]
    stages += [(f"block {i}", layer) for i, layer in enumerate(inner.layers)]
    stages += [("final norm", inner.norm), ("output head (logits)", model.lm_head)]
    for name, module in stages:
        hook = lambda mod, args, out, name=name: records.append((name, tuple((out[0] if isinstance(out, tuple) else out).shape)))  # noqa: E731
        handles.append(module.register_forward_hook(hook))
    try:
        model(input_ids=as_batch(input_ids).to(model.device))
    finally:
        for h in handles:
            h.remove()
    order = {name: i for i, (name, _) in enumerate(stages)}
    return sorted(records, key=lambda r: order[r[0]])


@torch.inference_mode()
def layer_outputs(model, input_ids) -> torch.Tensor:
    """The residual stream after the embedding and after each block, before the final norm. (L+1, T, hidden)"""
    inner, outs = model.model, []
    handles = [layer.register_forward_hook(lambda m, a, out: outs.append(out[0] if isinstance(out, tuple) else out))
               for layer in inner.layers]
    try:
        ids = as_batch(input_ids).to(model.device)
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    embedded = inner.embed_tokens(ids)
    return torch.stack([embedded[0]] + [o[0] for o in outs]).float().cpu()  # (L+1, T, hidden)


@torch.inference_mode()
def logit_lens(model, input_ids, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model would predict after each layer: final norm + output head on every layer's output.
    Returns (top token IDs (L+1, T, k), their probabilities (L+1, T, k)); the last row is the real prediction."""
    hidden = layer_outputs(model, input_ids).to(model.device, model.dtype)  # (L+1, T, hidden)
    probs = torch.softmax(model.lm_head(model.model.norm(hidden)).float(), dim=-1)  # (L+1, T, V)
    values, ids = torch.topk(probs, k, dim=-1)
    return ids.cpu(), values.cpu()


@torch.inference_mode()
def block_by_hand(layer, x: torch.Tensor, config) -> torch.Tensor:
    """One decoder block from its own weights: x + attention(norm(x)), then + SwiGLU feed-forward(norm(.)).
    x: (T, hidden) entering the block. Returns (T, hidden) leaving it."""
    from ..runner.attention import attention_by_hand, rms_norm
    home = x.device
    x = x.to(layer.mlp.up_proj.weight.device, layer.mlp.up_proj.weight.dtype)
    attn_out, _ = attention_by_hand(layer, x, config)
    x = x + attn_out  # residual connection around attention
    h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
    mlp = layer.mlp
    gated = torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h)  # (T, intermediate): SwiGLU
    return (x + mlp.down_proj(gated)).float().to(home)  # residual connection around the feed-forward


def flops_per_token(n_params: int, n_embedding: int, tied: bool = True) -> float:
    """About 2 floating-point operations (a multiply and an add) per weight used in a matrix product, per token.
    The embedding is a lookup (no multiply), but the output head is a full V x hidden product for every
    token; with tied weights it is the embedding matrix again, so it counts although n_params holds it
    once. Attention's own products over the cache (which grow with context) are not included.
    Example: 100 parameters of which 10 embedding, tied -> 2 * (90 + 10) = 200"""
    return 2.0 * (n_params - n_embedding) + (2.0 * n_embedding if tied else 0.0)
