"""How a weight matrix lies in memory, chosen by measurement (Part II, lesson 11).

What it does: one token's product x @ W.T can read a (out, in) matrix stored by rows (the usual layout)
or by columns. The numbers are the same; the order of the reads, and the BLAS routine torch calls, are
not. `layout_gain` times both with the CPU's caches emptied (as in a decode step), `fastest_layout`
remembers the answer per shape, dtype and thread count, `arrange` stores a matrix in a layout and
`layout_of` says which one a tensor has. `model.Linear` uses them when it is built.
What it does not do: change any number a product computes beyond float rounding order, or repack for
quantized kernels (formats.py packs its own).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..runtime import synchronize

LAYOUTS = ("auto", "rows", "columns")
LAYOUT_GAIN = 1.25  # note: by columns only when clearly faster (measured here: o 1.1-1.2, q|k|v 1.3-1.8)
_layout_seen: dict[tuple, str] = {}


def cold_seconds(fn, repeats: int = 5, device="cpu") -> float:
    """Best time of `fn()` with the CPU's caches emptied before each call (64 MB written), as in a decode
    step, where each weight matrix comes from memory. On a GPU the device is synchronized around each call
    (its kernels run asynchronously: without it the clock would time only their launch)."""
    flush = torch.ones(64 * 2**20 // 4)
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        flush.add_(1.0)
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def copies_of(weight: torch.Tensor, layout: str, megabytes: int = 16) -> list[torch.Tensor]:
    """Enough copies of W stored in `layout` ("rows" or "columns") to make `megabytes`, at most 64: one small
    matrix alone is too quick to time steadily."""
    n = min(64, max(1, megabytes * 2**20 // (weight.numel() * weight.element_size())))
    stored = weight.contiguous() if layout == "rows" else weight.T.contiguous().T
    return [stored.clone() for _ in range(n)]  # note: clone keeps the layout (strides)


@torch.inference_mode()
def layout_gain(weight: torch.Tensor, megabytes: int = 16) -> float:
    """How many times faster one token's product x @ W.T reads W stored by columns than by rows, caches
    emptied, over copies_of(W)."""
    rows, columns = copies_of(weight, "rows", megabytes), copies_of(weight, "columns", megabytes)
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)  # (1, in): one token
    return (cold_seconds(lambda: [F.linear(x, w) for w in rows], device=weight.device)
            / cold_seconds(lambda: [F.linear(x, w) for w in columns], device=weight.device))


def fastest_layout(weight: torch.Tensor) -> str:
    """How to store a (out, in) matrix so that one token's product x @ W.T reads it fastest on this machine:
    "rows" (each output's weights together, the usual layout) or "columns" (each input's weights together).
    Same numbers either way, read in another order: measured once per shape, dtype and thread count
    (layout_gain), on the CPU only; elsewhere "rows". Measured here (MKL on an AMD CPU, float32): by columns
    the q|k|v, gate|up and head products read at about 20 GB/s against 11 by rows."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return "rows"
    key = (tuple(weight.shape), weight.dtype, torch.get_num_threads())
    if key not in _layout_seen:
        _layout_seen[key] = "columns" if layout_gain(weight) >= LAYOUT_GAIN else "rows"
    return _layout_seen[key]


def arrange(weight: torch.Tensor, layout: str = "auto") -> torch.Tensor:
    """The same (out, in) matrix stored in `layout` (see fastest_layout); "rows" keeps a row-major tensor as is."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = fastest_layout(weight)
    return weight.contiguous() if layout == "rows" else weight.T.contiguous().T  # (out, in) either way


def layout_of(weight: torch.Tensor) -> str:
    """"rows" or "columns": how a (out, in) matrix lies in memory."""
    return "columns" if weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[1] > 1 else "rows"


# ----- several rows at once: speculative checks, batched decode, prompts -----
KERNELS = ("auto", "mkl", "onednn")
SEVERAL_ROWS = 16  # note: up to here (verify passes, batched decode); a prompt's hundreds of rows stay with MKL,
# whose large products are efficient, and whose numbers keep long prompts within 1e-4 of the library's
KERNEL_GAIN = 1.15  # note: measured here at 5 rows, by columns: q|k|v 1.2-1.7, gate|up 1.4-2.0, head 2.0; by rows about 1.0
_kernel_seen: dict[tuple, str] = {}


def onednn_available() -> bool:
    """Whether torch's oneDNN linear kernel is built in (x86 CPU builds; the one Inductor uses)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T through oneDNN instead of MKL, reading W (out, in) as it lies (rows or columns). x: (M, in)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@torch.inference_mode()
def several_rows_gain(weight: torch.Tensor, rows: int = 5, megabytes: int = 16) -> float:
    """How many times faster oneDNN's kernel is than MKL's (F.linear) for `rows` tokens at once (a verify
    pass of four drafted tokens, a small batch), on W as stored, caches emptied."""
    ws = copies_of(weight, layout_of(weight), megabytes)
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)  # (rows, in)
    return (cold_seconds(lambda: [F.linear(x, w) for w in ws], 7, weight.device)
            / cold_seconds(lambda: [onednn_linear(x, w) for w in ws], 7, weight.device))


def several_rows_kernel(weight: torch.Tensor, kernel: str = "auto") -> str:
    """Which kernel multiplies 2 to SEVERAL_ROWS rows by this stored matrix: "mkl" (torch's usual F.linear)
    or "onednn", measured once per shape, layout and thread count. One row always goes to MKL: with the
    layout chosen above that is the fastest there is here; so do longer prompts. Measured here (float32, 5 rows): oneDNN 1.5-2x
    faster on q|k|v, gate|up and the head by columns, where MKL's small-batch path is slow."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel != "auto":
        if kernel == "onednn" and not onednn_available():
            raise ValueError("this torch build has no oneDNN linear kernel: use kernel='mkl'")
        return kernel
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_available():
        return "mkl"
    key = (tuple(weight.shape), layout_of(weight), torch.get_num_threads())
    if key not in _kernel_seen:
        _kernel_seen[key] = "onednn" if several_rows_gain(weight) >= KERNEL_GAIN else "mkl"
    return _kernel_seen[key]
