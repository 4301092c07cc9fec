"""An int8 product for calls of several rows (issue: the fast path is the engine, batches that scale): what the
4-bit format's layers use from ROWS_INT8 rows when built with formats.convert(..., rows_int8=ROWS_INT8).

What it does: `int8_rows_product` rounds each row of activations to 8 bits with its own minimum and maximum and
multiplies it by an int8 copy of the weights with torch's integer product (`torch._int_mm`), whose cost hardly
grows from 1 to 16 rows; `int_mm_available` says whether that product runs here and is exact.
Measured on the course's AMD CPU, one thread, int4 format, real model (2026-12-05): the 4-bit kernel's time for
a decode step's products grows 2.9x from 1 to 8 rows (8.0 -> 23.4 ms, torch profiler); the int8 copy's is
19.4 ms at 8 rows, bound by its bytes (106 MB of weights, twice the 4-bit ones) more than by arithmetic; a
prefill of 512 tokens 1,469 -> 469 ms (two threads: 751 -> 242).
What it does not do: run on a GPU, or keep the 4-bit numbers: see int8_rows_product's note for what it costs.
"""
from __future__ import annotations

import torch


def int_mm_available() -> bool:
    """Whether torch's int8 x int8 product (`torch._int_mm`) runs here and is exact (the probe multiplies rows of
    127s, the largest products, and compares with the integer answer)."""
    try:
        ones = torch.full((8, 64), 127, dtype=torch.int8)
        return bool((torch._int_mm(ones, ones.t()) == 127 * 127 * 64).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


ROWS_INT8 = 6  # Int4Linear(rows_int8=ROWS_INT8): from this many rows a call goes through the int8 copy


def int8_rows_product(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, q_sums: torch.Tensor) -> torch.Tensor:
    """Rows x int8 weights by integer dot products: each row of flat (R, K) rounded to 256 levels between its own
    minimum and maximum (u = x / s + z, as Int8DynamicLinear's rows), shifted by 128 into int8, times q (N, K) int8
    by torch._int_mm (int32 sums); then out = s * scale * (sums - (z - 128) * q_sums), q_sums (N,) each output's
    integers summed: exact algebra. (R, N) float32.
    note: symmetric rows (the largest magnitude becomes 127) cost 3.5% perplexity over 1,024 tokens of the README
    against the 4-bit kernel (36.43 against 35.20), these 0.6% (35.39); the int8 copy of the weights alone 0.0%
    (35.18): what rounds badly is the inputs of qkv and gate_up, not centred on zero (2026-12-05)."""
    x = flat.float()
    low, high = x.amin(dim=1, keepdim=True).clamp(max=0), x.amax(dim=1, keepdim=True).clamp(min=0)  # (R, 1)
    step = ((high - low) / 255).clamp(min=1e-12)
    zero = torch.round(-low / step)  # the level that stands for 0
    shifted = ((torch.round(x / step) + zero).clamp(0, 255) - 128).to(torch.int8)  # (R, K)
    sums = torch._int_mm(shifted, q.t()).float()  # (R, N): q.t() is the layout _int_mm reads fastest
    return (sums - (zero - 128) * q_sums) * (step * scale)
