"""The model file itself (lesson 12): its raw blocks, byte by byte, against the course's float32 weights.

What it does: `tensors()` lists the file's tensors with their storage type; `raw_block(name, row, block)`
returns one block's bytes and what they hold (Q4_1: a float16 scale, a float16 minimum, 16 bytes of two
4-bit numbers each; Q8_0: a float16 scale and 32 signed bytes); `file_weights(name)` decodes a whole
tensor as (q, scale, minimum); `check_against_file(hf_model)` checks every 4-bit tensor and the 8-bit
embedding against the weights the course runs: the file's values dequantized must equal them, and
quantizing them again by the file's rule must give the file's own numbers back.
What it does not do: write GGUF, or read other storage types (the file holds Q4_1, Q8_0 and F32 only).
Note: llama.cpp's converter stores the query and key matrices with their rows permuted (the two halves of
each head's rotary pairs interleaved); `to_file_rows` applies the same permutation to the course's weights.
"""
from __future__ import annotations

import numpy as np
import torch

BLOCK = 32  # weights per block, both types
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
# the file's name for each of a layer's matrices -> the transformers name
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def reader(path=None):
    from gguf import GGUFReader
    from ..loading import gguf_path
    return GGUFReader(str(path or gguf_path()))


def tensors(r=None) -> dict:
    """Every tensor of the file: name -> (storage type, shape as rows x columns, bytes)."""
    r = r or reader()
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)), int(t.n_bytes)) for t in r.tensors}


def _blocks(r, name: str) -> tuple[str, np.ndarray]:
    t = next((t for t in r.tensors if t.name == name), None)
    if t is None:
        raise KeyError(f"no tensor {name!r} in the file; tensors() lists them")
    kind = t.tensor_type.name
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{name} is stored as {kind}, not a block type ({', '.join(BLOCK_BYTES)})")
    rows = int(t.shape[1])
    return kind, np.asarray(t.data).reshape(rows, -1, BLOCK_BYTES[kind])  # (rows, blocks per row, bytes)


def _f16(pair: np.ndarray) -> np.ndarray:
    return pair.copy().view(np.float16).astype(np.float32)[..., 0]


def decode(kind: str, blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks (..., nbytes) -> (q int32 (..., 32), scale (...), minimum (...)); weight = q * scale + minimum.
    Q8_0 has no minimum (zeros): weight = q * scale."""
    scale = torch.from_numpy(_f16(blocks[..., 0:2]))
    if kind == "Q4_1":
        low = torch.from_numpy(_f16(blocks[..., 2:4]))
        qs = torch.from_numpy(blocks[..., 4:].astype(np.int32))  # 16 bytes
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # low nibbles are weights 0..15, high nibbles 16..31
        return q, scale, low
    q = torch.from_numpy(blocks[..., 2:].view(np.int8).astype(np.int32))
    return q, scale, torch.zeros_like(scale)


def raw_block(name: str, row: int = 0, block: int = 0, r=None) -> dict:
    """One block as stored: its bytes, and the numbers they hold."""
    kind, blocks = _blocks(r or reader(), name)
    raw = blocks[row, block]
    q, scale, low = decode(kind, raw)
    return {"type": kind, "bytes": bytes(raw), "scale": float(scale), "minimum": float(low), "q": q.tolist(),
            "weights": (q.float() * scale + low).tolist()}


def file_weights(name: str, r=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole tensor as the file stores it: q (rows, cols), scale and minimum (rows, cols / 32), in the file's row order."""
    kind, blocks = _blocks(r or reader(), name)
    q, scale, low = decode(kind, blocks)  # (rows, nb, 32), (rows, nb)
    return q.reshape(q.shape[0], -1), scale, low


def to_file_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives a query or key matrix (w (heads * D, K)): within each head,
    rows 0, D/2, 1, D/2 + 1, ... (the rotary pairs side by side). Other matrices keep their order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def check_against_file(hf_model, r=None) -> list[dict]:
    """Every Q4_1 tensor and the Q8_0 embedding against the course's float32 weights (a transformers model).
    Per tensor: its largest |file value - course weight| and whether quantizing the course weight again by the
    file's rule (formats.quantize_int4 for Q4_1) gives the file's q, scale and minimum."""
    from ..runner.formats import quantize_int4
    r = r or reader()
    cfg = hf_model.config
    state = {k: v.detach().float().cpu() for k, v in hf_model.state_dict().items()}
    report = []
    for t in r.tensors:
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            continue
        if t.name == "token_embd.weight":
            w = state["model.embed_tokens.weight"]
        else:
            _, layer, short, _ = t.name.split(".")
            w = state[f"model.layers.{layer}.{LAYER_NAMES[short]}.weight"]
            if short in ("attn_q", "attn_k"):
                w = to_file_rows(w, cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads)
        q, scale, low = file_weights(t.name, r)
        n, k = q.shape
        from_file = (q.reshape(n, -1, BLOCK).float() * scale[..., None] + low[..., None]).reshape(n, k)
        row = {"name": t.name, "type": kind, "shape": (n, k), "max_diff": float((from_file - w).abs().max())}
        if kind == "Q4_1":
            q2, s2, m2 = quantize_int4(w)
            row["same_blocks"] = bool(torch.equal(q2, q) and torch.allclose(s2, scale, rtol=1e-5, atol=1e-9)
                                      and torch.allclose(m2, low, rtol=1e-5, atol=1e-7))
            row["q_mismatches"] = int((q2 != q).sum())
        report.append(row)
    return report
