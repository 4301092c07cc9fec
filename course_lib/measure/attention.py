"""Lesson 16's measurements: the memory attention holds, and the paged cache's decode step read in place or gathered.

What it does: counts the bytes of every tensor torch hands back while a function runs and keeps the peak
(`peak_bytes`: a dispatch mode that sees each operator's outputs and notices when they are freed); builds a
pool of the course's model in which every row's blocks are scattered (`scattered_rows`: blocks handed out in a
shuffled order, as after a server's churn, with random keys and values: the time of a step does not depend on
them); times one decode step of the model on it, through the block tables or through the gather, and counts
what the gather copies; and the bench section `attention`.
What it does not do: see a kernel's private scratch space (the CPU flash kernel's is a tile per thread), or
measure equality on random tensors only: `attention_section` checks the kernels on the model's real queries,
keys and values and on a real prefilled pool.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runner.attention_kernels import tiled_attention, written_out_attention
from ..runner.forward import run_model
from ..runner.paged import BlockPool
from ..runner.blocks import Sequence
from .timers import best_of
from ..runtime import median
from .section import Section


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators returned that are still alive; the peak of that sum."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.users: dict[int, int] = {}  # storage address -> live tensors that view it

    def _drop(self, key: int, n: int) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if key in inputs and key not in self.users:
                    continue  # a view of (or an in-place write to) a tensor that existed before: nothing allocated
                if key not in self.users:
                    self.users[key] = 0
                    self.now += n
                    self.peak = max(self.peak, self.now)
                self.users[key] += 1
                weakref.finalize(t, self._drop, key, n)
        return out


def peak_bytes(fn) -> tuple[int, object]:
    """(the most bytes of tensors created by fn alive at once, fn's result). Inputs that existed before are not
    counted; an operator's private scratch space is not seen. Example: peak_bytes(lambda: torch.ones(256)) -> (1024, ...)"""
    live = _LiveBytes()
    with live:
        out = fn()
    return live.peak, out


def scattered_rows(model, rows: int, tokens: int, block_size: int = 16, attention: str = "paged", seed: int = 0):
    """A pool for `rows` sequences of `tokens` computed tokens each plus one new one, with their blocks handed out
    in a shuffled order (no row's blocks lie side by side) and random keys and values. Returns (pool, sequences)."""
    per_row = -(-(tokens + 1) // block_size)
    pool = BlockPool.for_model(model, rows * per_row, block_size, prefix_caching=False, attention=attention)
    pool.manager.shuffle(seed)  # a served pool's free list after churn
    g = torch.Generator(device="cpu").manual_seed(seed)
    for store in pool.keys + pool.values:
        store.copy_(torch.randn(store.shape, generator=g).to(store.dtype))
    seqs = []
    for _ in range(rows):
        seq = Sequence([0] * tokens)
        pool.grow(seq, tokens + 1)
        seq.computed = tokens
        seqs.append(seq)
    return pool, seqs


def decode_step(model, pool, seqs) -> torch.Tensor:
    """One decode step of every row on the pool (token 0 fed), then rolled back so it can run again. Returns the
    logits (B, V)."""
    view = pool.view(seqs)
    ids = torch.zeros(len(seqs), 1, dtype=torch.long, device=model.device)
    logits, _ = run_model(model, ids, view, view.attention_mask(1), view.positions()[:, None])
    view.rollback(view.length - 1)
    return logits[:, -1]


def gather_bytes(pool, seqs) -> int:
    """Bytes the gather writes in one decode step: every row's keys and values, padded to the longest row, per layer."""
    k = pool.keys[0]
    columns = max(s.computed for s in seqs) + 1
    return 2 * len(pool.keys) * len(seqs) * columns * k.shape[1] * k.shape[2] * k.element_size()


def step_times(model, rows: int, tokens: int, block_size: int = 16, repeats: int = 5) -> dict:
    """One decode step at `rows` x `tokens`, through the tables and through the gather, timed alternately (the
    median of `repeats` each, after a warm-up), with the peak bytes of tensors each step creates."""
    runs = {name: scattered_rows(model, rows, tokens, block_size, name) for name in ("paged", "gather")}
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (pool, seqs) in runs.items():
            times[name].append(best_of(lambda: decode_step(model, pool, seqs), 1, model.device)[0])
    peaks = {name: peak_bytes(lambda: decode_step(model, pool, seqs))[0] for name, (pool, seqs) in runs.items()}
    paged, gather = 1000 * median(times["paged"]), 1000 * median(times["gather"])
    spread = {f"{name}_range_ms": (1000 * min(t), 1000 * max(t)) for name, t in times.items()}
    return {"rows": rows, "tokens": tokens, "block_size": block_size, "paged_ms": paged, "gather_ms": gather, **spread,
            "speedup": gather / paged, "gather_bytes": gather_bytes(*runs["gather"]),
            "paged_peak_bytes": peaks["paged"], "gather_peak_bytes": peaks["gather"]}


def same_output(model, tokenizer, tolerance: float = 1e-5) -> dict:
    """The kernels against their references on the model's real tensors: tiled attention against torch's SDPA on
    layer 10's queries, keys and values of a 300-token prompt (as a prefill, and as a decode of its last token);
    the paged decode step against the gather on a really prefilled pool of 3 rows (logits)."""
    from ..text.context import handbook_ids
    from ..runner.model import layer_qkv
    ids = handbook_ids(tokenizer, "What is the refund window?")[:300]
    q, k, v = layer_qkv(model, ids, 10)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    prefill_err = float((tiled_attention(q, k, v, tile_q=64, tile_k=64) - ref).abs().max())
    decode_err = float((tiled_attention(q[:, :, -1:], k, v, start=len(ids) - 1) - ref[:, :, -1:]).abs().max())
    logits = {}
    for name in ("paged", "gather"):
        pool = BlockPool.for_model(model, 64, prefix_caching=False, attention=name)
        seqs = [Sequence(list(ids[:n])) for n in (300, 211, 97)]
        for seq in seqs:  # each prompt prefilled alone (the gather reads it), then one decode step of all three
            pool.grow(seq, len(seq.tokens) + 1)
            view = pool.view([seq])
            run_model(model, torch.tensor([seq.tokens], device=model.device), view)
        logits[name] = decode_step(model, pool, seqs)
    paged_err = float((logits["paged"] - logits["gather"]).abs().max())
    return {"tiled_prefill_max_diff": prefill_err, "tiled_decode_max_diff": decode_err,
            "paged_logits_max_diff": paged_err,
            "same": prefill_err <= tolerance and decode_err <= tolerance and paged_err <= 1e-4}


def layer_shaped(model, tokens: int, seed: int = 0):
    """Random q (1, H, T, D), k and v (1, KV, T, D) with the model's head shapes, dtype and device: for measuring
    memory and time, where the values do not matter."""
    H, KV, D = model.heads, model.kv_heads, model.head_dim
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(1, h, tokens, D, generator=g).to(model.device, model.dtype) for h in (H, KV, KV))


def prefill_peaks(model, tokens: int) -> dict:
    """Peak bytes of one layer's causal attention over `tokens` positions with the model's head shapes (random
    values): written out (the whole score matrix), tiled (256 x 256 tiles), and torch's SDPA."""
    q, k, v = layer_shaped(model, tokens)
    return {"tokens": tokens, "naive_peak_bytes": peak_bytes(lambda: written_out_attention(q, k, v))[0],
            "tiled_peak_bytes": peak_bytes(lambda: tiled_attention(q, k, v, tile_q=256, tile_k=256))[0],
            "sdpa_peak_bytes": peak_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                 enable_gqa=True))[0]}


def trace_runs(model, tokenizer, new_tokens: int = 96) -> dict:
    """Lesson 13's trace (three handbook questions sharing 1,100 tokens, five short chats, arriving 2 steps apart)
    served twice on the course's model, decode through the tables and gathered: seconds, tokens per second, and
    whether every request got the same tokens both ways."""
    from .trace import run_trace, trace_jobs
    jobs, arrivals = trace_jobs(model, tokenizer, new_tokens)
    runs = {name: run_trace(model, jobs, arrivals, 400, attention=name) for name in ("paged", "gather")}
    return {"seconds": {n: r.seconds for n, r in runs.items()}, "tokens_per_s": {n: r.tokens_per_s for n, r in runs.items()},
            "same_tokens": [j.tokens for j in runs["paged"].jobs] == [j.tokens for j in runs["gather"].jobs]}


def attention_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 16 on the course's model (float32, its own model on the library's weights): equality on real tensors,
    the decode step through the tables against the gather (4 rows of about 1,000 tokens, 1 row of 4,000; block sizes
    at 4 x 1,000), lesson 13's whole trace served both ways, and prefill peak memory at 4,096 tokens."""
    from ..runner.model import Model
    ours = Model.from_transformers(model if model.dtype == torch.float32 else model.float(), dtype=torch.float32)
    shapes = {"4x1000": (4, 1000), "1x4000": (1, 4000)} if not quick else {"2x40": (2, 40), "1x80": (1, 80)}
    steps = {name: step_times(ours, rows, tokens, repeats=2 if quick else 7) for name, (rows, tokens) in shapes.items()}
    first = next(iter(shapes.values()))
    blocks = [step_times(ours, *first, block_size=bs, repeats=2 if quick else 5) for bs in ((8, 32) if quick else (8, 32, 64))]
    peaks = prefill_peaks(ours, 1024 if quick else 4096)
    equality = same_output(ours, tokenizer)
    trace = trace_runs(ours, tokenizer, 4 if quick else 96)
    return {"same_output": equality["same"] and trace["same_tokens"], "equality": equality, "lesson13_trace": trace,
            "gather_bytes_per_step": {n: s["gather_bytes"] for n, s in steps.items()},
            "paged_step_ms": {n: s["paged_ms"] for n, s in steps.items()},
            "gather_step_ms": {n: s["gather_ms"] for n, s in steps.items()},
            "paged_speedup": {n: s["speedup"] for n, s in steps.items()},
            "step_peak_bytes": {n: {"paged": s["paged_peak_bytes"], "gather": s["gather_peak_bytes"]} for n, s in steps.items()},
            "block_sizes": [steps[next(iter(steps))]] + blocks,
            "prefill_tokens": peaks["tokens"], "tiled_peak_bytes": peaks["tiled_peak_bytes"],
            "sdpa_peak_bytes": peaks["sdpa_peak_bytes"], "naive_peak_bytes": peaks["naive_peak_bytes"]}


def _targets(result: dict) -> list:
    out = []
    a = result["attention"]
    small, large = list(a["paged_speedup"])
    out.append(("attention: tiled and paged equal to SDPA and the gather on real tensors", str(a["same_output"]),
                a["same_output"]))
    out.append((f"attention: paged decode no slower than the gather at {small}", f"{a['paged_speedup'][small]:.2f}x",
                a["paged_speedup"][small] >= 1.0))
    out.append((f"attention: paged decode faster than the gather at {large}", f"{a['paged_speedup'][large]:.2f}x",
                a["paged_speedup"][large] > 1.0))
    out.append((f"attention: paged step allocates less than the gather writes ({small})",
                f"{a['step_peak_bytes'][small]['paged'] / 1e6:.1f} vs {a['gather_bytes_per_step'][small] / 1e6:.0f} MB",
                a["step_peak_bytes"][small]["paged"] < a["gather_bytes_per_step"][small] / 10))
    return out


def _report(result: dict) -> list:
    lines = []
    a = result["attention"]
    for name in a["paged_step_ms"]:
        lines.append(f"attention {name}: decode step {a['paged_step_ms'][name]:.1f} ms through the tables, "
                     f"{a['gather_step_ms'][name]:.1f} ms gathered ({a['paged_speedup'][name]:.2f}x); the gather writes "
                     f"{a['gather_bytes_per_step'][name] / 1e6:.0f} MB per step; peak allocated "
                     f"{a['step_peak_bytes'][name]['paged'] / 1e6:.1f} vs {a['step_peak_bytes'][name]['gather'] / 1e6:.1f} MB")
    lines.append("attention block sizes: " + ", ".join(f"{b['block_size']}: {b['paged_ms']:.1f} vs {b['gather_ms']:.1f} ms"
                                                       for b in a["block_sizes"]))
    t = a["lesson13_trace"]
    lines.append(f"attention on lesson 13's trace: {t['tokens_per_s']['paged']:.1f} tok/s through the tables, "
                 f"{t['tokens_per_s']['gather']:.1f} gathered (same tokens: {t['same_tokens']})")
    lines.append(f"attention prefill of {a['prefill_tokens']} tokens, one layer, peak allocated: written out "
                 f"{a['naive_peak_bytes'] / 1e6:.0f} MB, tiled {a['tiled_peak_bytes'] / 1e6:.1f} MB, SDPA "
                 f"{a['sdpa_peak_bytes'] / 1e6:.1f} MB")
    return lines


SECTION = Section("attention", "lesson 16: tiled attention, paged decode attention against the gather",
                  lambda m, t, q: {"attention": attention_section(m, t, q)}, _targets, _report)
