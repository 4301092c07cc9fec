"""The bench's `formats` section (lesson 12): every weight format's bytes per token, decode speed and quality.

What it does: each format of the course's model at batch 1: bytes per token, tokens per second (median gap),
the bandwidth that reads at, top-1 agreement and KL against float32; the fastest against model.generate; with its
target and report lines.
What it does not do: the rates and the agreement themselves (measure.memory and measure.quality hold them).
"""
from __future__ import annotations

import torch

from ..text.context import story_ids
from .section import Section
from ..runtime import median


def formats_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 12: every weight format of our model, batch 1: bytes per token, decode tokens per second (the
    median gap between tokens, prefill excluded, as for model.generate beside it), and quality against
    float32 on the bench's prompts (teacher-forced top-1 agreement and mean KL over the answers)."""
    from ..text.context import chat_ids
    from .race import generate_exact, library_step_seconds, our_step_seconds
    from ..runner.formats import FORMATS, convert
    from .memory import read_bandwidth
    from .quality import agreement
    from ..runner.model import Model
    reference = Model.from_transformers(model, dtype=torch.float32)
    library = model if model.dtype == torch.float32 else model.float()
    prompt, n = story_ids(tokenizer), 6 if quick else 48
    questions = ["What is the capital of France?", "What is the capital gains tax in France?",
                 "The bank is closed because they had no money left."]
    prompts = [chat_ids(tokenizer, q, system="You are a helpful assistant.") for q in questions] + [prompt]
    sequences = [p + generate_exact(reference, tokenizer, p, 8 if quick else 32) for p in prompts]
    library_step_seconds(library, prompt, 3)  # warm-up
    generate_tps = 1 / median(library_step_seconds(library, prompt, n + 1))
    rows, greedy32 = [], generate_exact(reference, tokenizer, prompt, n)
    for name in FORMATS:
        fmt = reference if name == "float32" else convert(reference, name)
        our_step_seconds(fmt, tokenizer, prompt, 3)  # warm-up
        gaps = our_step_seconds(fmt, tokenizer, prompt, n + 1)
        quality = {"top1_agreement": 1.0, "kl": 0.0} if name == "float32" else \
            agreement(reference, fmt, sequences, [len(p) - 1 for p in prompts])
        tps = 1 / median(gaps)
        rows.append({"name": name, "weight_bytes": fmt.weight_bytes(), "tokens_per_s": tps,
                     "top1_agreement": quality["top1_agreement"], "kl": quality["kl"],
                     "bandwidth_bytes_per_s": fmt.weight_bytes() * tps,
                     "same_greedy_tokens": generate_exact(fmt, tokenizer, prompt, n) == greedy32})
    fastest = max(rows, key=lambda r: r["tokens_per_s"])
    return {"formats": rows, "threads": torch.get_num_threads(), "new_tokens": n,
            "generate_tokens_per_s": generate_tps, "read_bandwidth_bytes_per_s": read_bandwidth(256 if quick else 1024),
            "fastest": {"name": fastest["name"], "tokens_per_s": fastest["tokens_per_s"],
                        "ratio_to_generate": fastest["tokens_per_s"] / generate_tps,
                        "top1_agreement": fastest["top1_agreement"]}}


def _targets(result: dict) -> list:
    out = []
    f = result["formats"]["fastest"]
    out.append((f"formats: fastest ({f['name']}) at least 3.5x model.generate, top-1 agreement >= 0.9",
                f"{f['ratio_to_generate']:.2f}x, agreement {f['top1_agreement']:.2f}",
                f["ratio_to_generate"] >= 3.5 and f["top1_agreement"] >= 0.9))
    return out


def _report(result: dict) -> list:
    lines = []
    f = result["formats"]
    lines.append(f"formats (decode, median gap; model.generate {f['generate_tokens_per_s']:.1f} tok/s; "
                 f"read ceiling {f['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s):")
    lines += [f"  {r['name']:<13} {r['weight_bytes'] / 1e6:6.1f} MB/token {r['tokens_per_s']:6.1f} tok/s "
              f"{r['bandwidth_bytes_per_s'] / 1e9:5.1f} GB/s  top-1 {r['top1_agreement']:.3f}  KL {r['kl']:.4f}"
              for r in f["formats"]]
    return lines


SECTION = Section("formats", "lesson 12: weight formats, speed and quality",
                  lambda m, t, q: {"formats": formats_section(m, t, q)}, _targets, _report)
