"""Weight formats (lesson 12): the same model with fewer bytes per weight, as a different linear layer.

What it does: quantizes weight matrices (int8 with one scale per output channel; 4-bit in groups of
32 with a scale and a minimum per group, the GGUF file's own Q4_1 layout) and wraps each format in a
linear layer that `model.Model` calls like its float one: `CastInt8Linear` (int8 weights cast back to
float, then an ordinary product: the trap), `Int8Linear` (torch's fused `_weight_int8pack_mm`),
`Int8DynamicLinear` (int8 weights times activations rounded to 8 bits per row, oneDNN's integer product: the
int4 format's output head) and `Int4Linear` (torch's `_weight_int4pack_mm_for_cpu`; with q8=True the course's own
kernel, runner/q4_kernel.py: the "int4-q8" format, activations rounded to 8 bits per block of 32). `convert(model, name)`
returns the model in one of `FORMATS`, sharing what it can with the float32 one; the loop, batching and the
server run it as any model. (What the formats cost and keep is measured apart: measure/memory.py for bandwidth,
measure/quality.py for agreement and perplexity.)
Note: the course's float32 weights ARE the file's 4-bit values, dequantized; quantizing them again
with min/max per block of 32 gives those very blocks back (tests/test_formats.py checks it against
the file), so the 4-bit formats lose nothing but rounding.
What it does not do: calibrate, quantize activations (except int4-q8's and the int4 format's head) or the KV cache, or run the 4-bit kernel or the int8 x int8 head on a GPU (both are CPU kernels; CUDA gets float32,
bfloat16 and int8-cast).
Note: the fused kernels are torch's private operators (`torch._weight_int8pack_mm`,
`torch._weight_int4pack_mm_for_cpu`, `torch._convert_weight_to_int4pack_for_cpu`, `torch.ops.onednn.qlinear_*`):
they may change between releases, which the pinned torch (2.13.0) guards against; tests/test_formats.py checks
each against its dequantized weights.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from .model import Linear, Model
from . import q4_kernel
from .rows_kernel import ROWS_INT8, int8_rows_product, int_mm_available  # noqa: F401 - part of this API


def int8_dynamic_available() -> bool:
    """Whether oneDNN's int8 x int8 product runs here and is exact. Some torch builds lack it (some ARM builds); and
    on an x86 CPU without VNNI (AVX2 only: measured on an AMD EPYC, 2026-12-03) its u8 x s8 path adds the products
    in pairs into 16-bit sums that saturate, so a row of 255s times weights of 127 comes out at half its value.
    The probe asks for exactly that product and compares it with the integer answer."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(torch.full((2, 64), 127, dtype=torch.int8), [1, 64])
        out = torch.ops.onednn.qlinear_pointwise.tensor(torch.full((1, 64), 255, dtype=torch.uint8), torch.tensor(1.0),
                                                        torch.tensor(0), packed, torch.ones(2),
                                                        torch.zeros(2, dtype=torch.long), None, 1.0, 0, torch.float32,
                                                        "none", [], "")
        return bool((out == 255 * 127 * 64).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


# note: the int4 format's head rounds its input to 8 bits too where oneDNN's integer product runs (lesson 12,
# section 7: faster, for a perplexity within 0.1% of the weight-only int8 head); elsewhere the weight-only one
INT4_HEAD = "int8-dynamic" if int8_dynamic_available() else "int8"
# name -> (activation dtype, layer kind, head kind). The head is the tied embedding as a matrix product.
FORMATS = {
    "float32": (torch.float32, "float", "float"),
    "bfloat16": (torch.bfloat16, "float", "float"),
    "int8-cast": (torch.float32, "int8-cast", "int8-cast"),
    "int8": (torch.bfloat16, "int8", "int8"),
    "int4-float32": (torch.float32, "int4", "float"),
    "int4": (torch.bfloat16, "int4", INT4_HEAD),
    "int4-q8": (torch.float32, "int4-q8", "q8"),  # the course's kernel (q4_kernel), 8-bit activations
}
GROUP = 32  # the file's Q4_1 block: 32 weights share a scale and a minimum


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per output row. w (N, K) -> (int8 (N, K), scale (N,)); w ~ q * scale."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of `group` weights along K: w ~ q * scale + minimum, q in 0..15.
    w (N, K) -> (q int32 (N, K), scale (N, K/group), minimum (N, K/group)). This is Q4_1's rule, with one
    addition: a block whose weights already sit on a grid of at most 16 levels (a Q4_0 file's blocks, d * (k - 8),
    seldom use both ends of -8..7) keeps that grid's step, so loading a 4-bit file does not round it a second time."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"the input size {K} is not a multiple of the group size {group}")
    blocks = w.float().reshape(N, K // group, group)  # (N, K/G, G)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)  # (N, K/G)
    scale = ((high - low) / grid_steps(blocks, low, high)).clamp(min=1e-12)
    q = torch.round((blocks - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), scale, low


def grid_steps(blocks: torch.Tensor, low: torch.Tensor, high: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """Per block (N, K/G, G), how many steps span low..high (N, K/G) when every value lies on a grid of at most
    15 steps (within `tolerance`), else 15 (min/max). Candidate steps: a Q4_0 block's (its largest weight is -8 d
    exactly: blocks whose gaps are all several steps keep it too), then the smallest gap between values."""
    span = high - low
    def on_grid(steps: torch.Tensor) -> torch.Tensor:
        offsets = (blocks - low[..., None]) / (span / steps).clamp(min=1e-30)[..., None]
        return ((offsets - offsets.round()).abs().amax(dim=-1) < tolerance) & (steps <= 15)

    q4_0, gaps = torch.round(span / (blocks.abs().amax(-1) / 8).clamp(min=1e-30)).clamp(min=1), blocks.sort(-1).values.diff(dim=-1)
    gaps = torch.where(gaps > span[..., None] * 1e-4, gaps, torch.full_like(gaps, float("inf")))
    smallest = torch.round(span / gaps.amin(dim=-1)).clamp(min=1)  # (N, K/G); inf gap (a flat block) -> 1
    return torch.where(on_grid(q4_0), q4_0, torch.where(on_grid(smallest), smallest, torch.full_like(span, 15.0)))


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The float weights the 4-bit numbers stand for: q * scale + minimum, per group. (N, K) float32."""
    N, K = q.shape
    blocks = q.reshape(N, K // group, group).float() * scale[..., None] + minimum[..., None]
    return blocks.reshape(N, K)


class CastInt8Linear:
    """int8 weights stored, cast back to float at every call, then an ordinary product (the slow trap:
    the cast writes a full float matrix each time, so more bytes move than with float weights)."""
    format = "int8-cast"

    def __init__(self, weight: torch.Tensor):
        self.q, self.scale = quantize_int8(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.q.to(x.dtype) * self.scale.to(x.dtype)[:, None])

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    @property
    def in_features(self) -> int:
        return self.q.shape[1]


class Int8Linear(CastInt8Linear):
    """int8 weights, one scale per output channel, multiplied by torch's fused weight-only kernel."""
    format = "int8"

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__(weight)
        self.scale = self.scale.to(dtype)  # note: the kernel wants scales in the activations' dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (B*T, K)
        return torch._weight_int8pack_mm(flat, self.q, self.scale).reshape(*x.shape[:-1], self.q.shape[0])


class Int8DynamicLinear:
    """int8 weights (one scale per output channel) times 8-bit activations: each row of x is rounded to 256
    levels between its own minimum and maximum at every call (dynamic quantization: uint8 q = x / s + z), and
    oneDNN's integer product (`torch.ops.onednn.qlinear_pointwise`, the kernel torch's compiler uses for int8
    models on x86) reads the weights with the CPU's integer dot-product instructions (VNNI where there are).
    All rows go in one call: the kernel sees q with no zero point, and each row's s and z are applied after,
    out = s * (q @ W.T - z * W.sum(1)), exact algebra. Unlike Int8Linear it rounds the activations too. CPU
    only; lesson 12 measures it as the output head."""
    format = "int8-dynamic"
    compiles = False  # note: torch.compile's lowering wants the packed weight as a module constant: called eagerly

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        if weight.device.type != "cpu":
            raise ValueError("the int8 x int8 kernel used here (oneDNN's qlinear) runs on the CPU only")
        if not int8_dynamic_available():
            raise RuntimeError("oneDNN's int8 x int8 product is missing here, or saturates (a CPU without VNNI): "
                               "use the weight-only int8 head (kind 'int8'), formats.INT4_HEAD on this machine")
        q, self.scale = quantize_int8(weight)  # (N, K) int8, (N,) float32
        self.dtype, (self.out_features, self._in_features) = dtype, q.shape
        self.packed = torch.ops.onednn.qlinear_prepack(q, [1, q.shape[1]])  # oneDNN's own copy, in its own layout
        self.zeros = torch.zeros(q.shape[0], dtype=torch.long)
        self.row_sums = q.float().sum(dim=1) * self.scale  # (N,): each output's weights summed, dequantized
        self.one, self.none = torch.tensor(1.0), torch.tensor(0)
        # the int4 format's fused step computes this head with the course's kernel (fused_step), in its tiles
        self.tiles = None if q4_kernel.why_not_bf16() or q.shape[0] % 8 or q.shape[1] % 32 else q4_kernel.pack_int8(q)
        # note: q itself is not kept (the packed copy is what the kernel reads): 28 MB less for SmolLM2's head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self._in_features:  # note: oneDNN's own message for this names none of the shapes
            raise ValueError(f"this layer takes vectors of {self._in_features}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, x.shape[-1]).float()  # (R, K)
        low, high = flat.amin(dim=1, keepdim=True).clamp(max=0), flat.amax(dim=1, keepdim=True).clamp(min=0)
        scale = ((high - low) / 255).clamp(min=1e-12)  # (R, 1): one per row
        zero = torch.round(-low / scale)  # (R, 1): the level that stands for 0
        q = (torch.round(flat / scale) + zero).clamp(0, 255).to(torch.uint8)  # (R, K)
        out = torch.ops.onednn.qlinear_pointwise.tensor(q, self.one, self.none, self.packed, self.scale, self.zeros,
                                                        None, 1.0, 0, torch.float32, "none", [], "")  # (R, N)
        out = scale * (out - zero * self.row_sums)
        return out.to(self.dtype).reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """The int8 weights, and two float32 numbers per row (its scale and its sum)."""
        return self.out_features * self._in_features + (self.scale.numel() + self.row_sums.numel()) * 4

    @property
    def in_features(self) -> int:
        return self._in_features


class Int4Linear:
    """4-bit weights in groups of 32 (a scale and a minimum each), packed for torch's CPU kernel, or with q8=True for
    the course's (q4_kernel). The int4 format also keeps them in the course's layout (bf16_blocks) for its fused step
    where the CPU has AVX-512 BF16 (why_not_bf16 says why not elsewhere); eager calls never read that copy.
    rows_int8=R also keeps an int8 copy (one scale per output) for calls of R rows or more: torch's 4-bit kernel
    costs about 3.7 times as much for 8 rows as for one, the integer product 1.4 times (`int8_rows_product`); the
    copy costs a byte per weight more memory and 0.3-0.6% perplexity."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group: int = GROUP, rows_int8: int | None = None,
                 q8: bool = False):
        if weight.device.type != "cpu":
            raise ValueError("the 4-bit kernel used here (torch._weight_int4pack_mm_for_cpu) runs on the CPU only; "
                             "on a GPU use 'bfloat16' or 'int8-cast'")
        q, scale, low = quantize_int4(weight, group)
        self.group, self.out_features, self.in_features = group, weight.shape[0], weight.shape[1]
        # q8: the course's kernel (q4_kernel: activations rounded to 8 bits per block of 32, integer dot products)
        self.q4, self.why_not = None, q4_kernel.why_unusable(self.out_features, self.in_features, group) if q8 else ""
        self.format = "int4-q8" if q8 else "int4"
        if self.why_not:
            q4_kernel.say_once(f"int4-q8 runs torch's 4-bit kernel instead: {self.why_not}")
        elif q8:
            self.q4 = q4_kernel.pack(q, scale, low)  # (N/8, K/32, 160) uint8: the file's 20 bytes per 32 weights
        if self.q4 is None:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)  # (N, K/2) uint8: two weights per byte
            # subtle: the kernel computes (q - 8) * scale + zero, so zero = minimum + 8 * scale
            self.scales_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.blocks, self.rows_int8, self.int8 = None, rows_int8, None
        if rows_int8:
            if not int_mm_available():
                raise RuntimeError("torch's int8 x int8 product (torch._int_mm) is missing or inexact here: build the "
                                   "int4 format without rows_int8")
            w8, scale8 = quantize_int8(dequantize_int4(q, scale, low, group))  # (N, K) int8, (N,) float32
            self.int8 = (w8, scale8, w8.float().sum(dim=1))
        # the int4 format's fused step (fused_step) reads these blocks in the kernel's layout, activations in bfloat16
        # (0.63 bytes a weight more memory; not with the int8 copy, whose rows the fused step would not use)
        self.why_not_bf16 = _why_not_bf16(tuple(weight.shape), dtype, q8, rows_int8, group)
        self.bf16_blocks = None if self.why_not_bf16 else q4_kernel.pack(q, scale, low)
        if dtype == torch.float32 and self.q4 is None:
            # note: with float32 activations the fused kernel costs about 1.5 ms per row for a 1536 x 576 matrix,
            # fine for one decode row, ruinous for a prefill of hundreds. For several rows we dequantize the
            # same 4-bit numbers to a float matrix and use the ordinary product (what engines do for prefill).
            self.blocks = ((q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8), scale, low)  # (N, K/2), (N, K/G) x2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # (B*T, K)
        if self.int8 is not None and flat.shape[0] >= self.rows_int8:
            out = int8_rows_product(flat, *self.int8).to(x.dtype)
        elif self.q4 is not None:
            out = q4_kernel.product(flat, self.q4)
        elif self.blocks is not None and flat.shape[0] > 1:
            nibbles, scale, low = self.blocks
            q = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)  # (N, K)
            out = F.linear(flat, dequantize_int4(q, scale, low, self.group))
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """The 4-bit weights and their scales: what a call of fewer than rows_int8 rows reads (the int8 copy apart,
        in int8_nbytes)."""
        if self.q4 is not None:
            return self.q4.numel()
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    @property
    def int8_nbytes(self) -> int:
        return 0 if self.int8 is None else self.int8[0].numel() + self.int8[1].numel() * 8


def _why_not_bf16(shape: tuple, dtype: torch.dtype, q8: bool, rows_int8: int | None, group: int) -> str:
    """'' when an Int4Linear keeps its blocks for the int4 format's fused step (bfloat16 activations); else why."""
    if q8 or dtype != torch.bfloat16:
        return "not the int4 format"
    if rows_int8:
        return "an int8 copy for several rows is torch's path, which the fused step would not take"
    if group != 32 or shape[1] % 32 or shape[0] % 8:
        return f"not tiles of 8 outputs by blocks of 32 inputs ({shape[0]} x {shape[1]}, groups of {group})"
    return q4_kernel.why_not_bf16()


def int8_copy_bytes(model: Model) -> int:
    """The bytes of the 4-bit layers' int8 copies (Int4Linear's rows_int8): 0 for a model built without them."""
    return sum(getattr(part, "int8_nbytes", 0) for layer in model.layers for part in (layer.qkv, layer.o,
                                                                                       layer.gate_up, layer.down))


def make_linear(weight: torch.Tensor, kind: str, dtype: torch.dtype, rows_int8: int | None = None):
    """One linear layer of the given kind from a float weight (N, K); rows_int8: see Int4Linear (4-bit only)."""
    if kind == "float":
        return Linear(weight.to(dtype))  # stored by rows or columns, whichever reads faster in this dtype
    weight = weight.contiguous()  # note: the quantizers group along rows, (N, K) row-major
    if kind == "int8-cast":
        return CastInt8Linear(weight)
    if kind == "int8":
        return Int8Linear(weight, dtype)
    if kind in ("int4", "int4-q8"):
        return Int4Linear(weight, dtype, rows_int8=rows_int8, q8=kind == "int4-q8")
    if kind == "q8":  # int4-q8's head; where the course's kernel cannot run (its layers say why), int4's head
        return make_linear(weight, INT4_HEAD, dtype) if q4_kernel.why_unusable(*weight.shape) else q4_kernel.Q8Linear(weight)
    if kind == "int8-dynamic":
        return Int8DynamicLinear(weight, dtype)
    raise ValueError(f"unknown linear kind {kind!r}")


def convert(model: Model, name: str, head: str | None = None, rows_int8: int | None = None) -> Model:
    """The model in weight format `name` (one of FORMATS). Built from a float32 model; the embedding
    lookup, norms and rotary tables follow the activations' dtype; every matrix product changes format.
    head: override the output head's kind ("float", "int8", "int4"...), to see what the head costs.
    rows_int8: 4-bit formats only, calls of that many rows or more go through an int8 copy (Int4Linear); None: never."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}: choose one of {', '.join(FORMATS)}")
    if model.dtype != torch.float32:
        raise ValueError("convert() starts from the float32 model (Model.from_transformers(model) in float32)")
    dtype, kind, head_kind = FORMATS[name]
    head_kind = head or head_kind
    if rows_int8 is not None and not kind.startswith("int4"):
        raise ValueError(f"rows_int8 is for the 4-bit formats, not {name!r}")
    weight = lambda linear: linear.weight  # noqa: E731 - every layer of a float32 model is a Linear
    layers = [replace(layer, attn_norm=layer.attn_norm.to(dtype), mlp_norm=layer.mlp_norm.to(dtype),
                      qkv=make_linear(weight(layer.qkv), kind, dtype, rows_int8),
                      o=make_linear(weight(layer.o), kind, dtype, rows_int8),
                      gate_up=make_linear(weight(layer.gate_up), kind, dtype, rows_int8),
                      down=make_linear(weight(layer.down), kind, dtype, rows_int8)) for layer in model.layers]
    return model.with_parts(embedding=model.embedding.to(dtype), final_norm=model.final_norm.to(dtype),
                            lm_head=make_linear(model.embedding, head_kind, dtype), layers=layers, format=name)
