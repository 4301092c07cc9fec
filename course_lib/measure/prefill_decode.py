"""Lesson 08's measurements (prefill against prompt length, decode against context length, the memory bandwidth
decode reads at) and the bench sections built on them: load, prefill, decode.

What it does: `prefill_timings` / `prefill_seconds` time a prompt's prefill at several lengths; `decode_timings`
/ `decode_seconds` time one decode step once the cache holds a given number of tokens; `memory_bandwidth` is the
streaming read rate decode is measured against (measure.memory.read_bandwidth); `weight_bytes` what a step reads.
The sections `load`, `prefill` and `decode` (with the roofline's two ceilings) report them in the bench.
What it does not do: draw (plots_perf, plots_roofline) or assert (the targets are reported, not tested).
"""
from __future__ import annotations

import torch

from ..text.context import filler_ids
from ..runtime import time_it
from ..engine.stages import decode_step, prefill
from .section import Section
from .timers import TIMING_TOKEN


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.inference_mode()
def prefill_timings(model, tokenizer, lengths: list[int], repeats: int = 3) -> list:
    """Every repeat of a prefill of each length (runtime.Timing: best, median, all the seconds), for plots that
    show the spread."""
    return [time_it(lambda n=n: prefill(model, filler_ids(tokenizer, n)), model.device, repeats=repeats)
            for n in lengths]


def prefill_seconds(model, tokenizer, lengths: list[int], repeats: int = 3) -> list[float]:
    """Best time to prefill a prompt of each length (time to first token, less the pick)."""
    return [t.best for t in prefill_timings(model, tokenizer, lengths, repeats)]


@torch.inference_mode()
def decode_timings(model, tokenizer, contexts: list[int], steps: int = 8) -> list:
    """Every decode step's seconds once the cache holds `context` tokens (runtime.Timing per context), after one
    warm-up step."""
    out = []
    for n in contexts:
        _, cache = prefill(model, filler_ids(tokenizer, n))
        out.append(time_it(lambda cache=cache: decode_step(model, [TIMING_TOKEN], cache), model.device,
                           repeats=steps, warmup=1))
    return out


def decode_seconds(model, tokenizer, contexts: list[int], steps: int = 8) -> list[float]:
    """Mean time of one decode step once the cache holds `context` tokens."""
    return [t.mean for t in decode_timings(model, tokenizer, contexts, steps)]


def memory_bandwidth(device: torch.device | str = "cpu", megabytes: int | None = None, repeats: int = 3) -> float:
    """Bytes per second this machine streams from memory, measured the way decode reads weights: a sum over a
    buffer far larger than the caches (measure.memory.read_bandwidth, sized by roofline.probe_bytes; lessons 08 and
    12 use the same ceiling)."""
    from .memory import read_bandwidth
    return read_bandwidth(megabytes, repeats, device)


def _load_section(model, tokenizer, quick):
    from ..loading import time_cached_load
    return {"load_seconds": time_cached_load(str(model.device), str(model.dtype).split(".")[-1])}


def _decode_section(model, tokenizer, quick):
    contexts = [16, 256] if quick else [16, 256, 1024, 4096]
    step = decode_seconds(model, tokenizer, contexts)
    bandwidth = memory_bandwidth(model.device, 128 if quick else None)
    achieved = weight_bytes(model) / step[0]
    from .roofline import compute_ceiling, probe_bytes
    peak = compute_ceiling(model.dtype, 512 if quick else 2048, device=model.device)
    return {"decode": [{"context": c, "seconds_per_token": s} for c, s in zip(contexts, step)],
            "bandwidth": {"weight_bytes": weight_bytes(model), "measured_read_bytes_per_s": bandwidth,
                          "probe_bytes": 128 * 2**20 if quick else probe_bytes(),
                          "decode_achieved_bytes_per_s": achieved, "utilisation": achieved / bandwidth,
                          "matmul_flops_per_s": peak, "ridge_flops_per_byte": peak / bandwidth}}


def _prefill_section(model, tokenizer, quick):
    lengths = [16, 64] if quick else [16, 64, 256, 1024]
    seconds = prefill_seconds(model, tokenizer, lengths)
    return {"prefill": [{"tokens": n, "seconds": s, "tokens_per_s": n / s} for n, s in zip(lengths, seconds)]}


def _targets(result: dict) -> list:
    if "load_seconds" not in result:
        return []
    return [("cached model load about a second", f"{result['load_seconds']:.2f} s", result["load_seconds"] < 2.0)]


def _prefill_report(result: dict) -> list:
    return ["prefill: " + ", ".join(f"{p['tokens']} tok {p['tokens_per_s']:.0f} tok/s" for p in result["prefill"])]


def _decode_report(result: dict) -> list:
    bw = result["bandwidth"]
    return ["decode:  " + ", ".join(f"ctx {d['context']} {d['seconds_per_token'] * 1000:.1f} ms/tok"
                                    for d in result["decode"]),
            f"bandwidth: streaming read {bw['measured_read_bytes_per_s'] / 1e9:.1f} GB/s, decode reads weights at "
            f"{bw['decode_achieved_bytes_per_s'] / 1e9:.1f} GB/s -> utilisation {bw['utilisation']:.0%}"
            + (f"; matrix product {bw['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, ridge {bw['ridge_flops_per_byte']:.1f} "
               "FLOP/byte" if "matmul_flops_per_s" in bw else "")]


LOAD = Section("load", "cached model load", _load_section, _targets)
PREFILL = Section("prefill", "prefill against prompt length", _prefill_section, report=_prefill_report)
DECODE = Section("decode", "decode against context length, and memory bandwidth", _decode_section,
                 report=_decode_report)
