"""The bench's `speculative` section (lesson 14): each drafter on a grounded edit and on free writing.

What it does: acceptance, tokens per verify step and tokens per second against plain greedy decoding of the same
model in the same run, and whether the tokens stay the same; with its targets and report lines.
What it does not do: draft or verify (speculative.py and the stages do).
"""
from __future__ import annotations

import time

import torch

from ..text.context import story_ids
from .section import Section


def speculative_section(model, tokenizer, quick: bool = False, k: int = 4) -> list[dict]:
    """Lesson 14: each drafter on two tasks (a grounded edit, where the answer copies the prompt, and free
    writing), float32, greedy, exactly n tokens: acceptance, tokens per verify step, tokens per second
    against plain greedy decoding of the same model in the same run (best of two each), same tokens."""
    from ..text.context import edit_ids
    from .race import generate_exact
    from ..runner.formats import convert
    from ..engine.generation import generate
    from ..runner.model import Model
    from ..engine.speculative import ModelDrafter, PromptLookup, early_exit
    ours = Model.from_transformers(model, dtype=torch.float32)
    int4 = convert(ours, "int4")
    drafters = {"prompt_lookup": lambda: PromptLookup(3), "int4_model": lambda: ModelDrafter(int4, "int4 model"),
                "early_exit_8": lambda: early_exit(ours, 8)}
    n, rows = 8 if quick else 64, []
    for task, prompt in {"grounded_edit": edit_ids(tokenizer), "story": story_ids(tokenizer)}.items():
        generate_exact(ours, tokenizer, prompt, 2)  # warm-up
        plain, base = None, float("inf")
        for _ in range(2):
            start = time.perf_counter()
            plain = generate_exact(ours, tokenizer, prompt, n)
            base = min(base, time.perf_counter() - start)
        for name, make in drafters.items():
            best, spec = float("inf"), None
            for _ in range(2):
                start = time.perf_counter()
                spec = generate(ours, tokenizer, prompt, n, stop_ids=(), draft=make(), k=k)
                best = min(best, time.perf_counter() - start)
            st = spec.speculative
            rows.append({"drafter": name, "task": task, "k": k, "acceptance_rate": st.acceptance_rate,
                         "tokens_per_verify": st.tokens_per_verify, "tokens_per_s": n / best,
                         "baseline_tokens_per_s": n / base, "speedup": base / best,
                         "same_tokens": spec.token_ids == plain})
    return rows


def _targets(result: dict) -> list:
    out = []
    rows = result["speculative"]
    out.append(("speculative: same tokens as plain greedy everywhere", f"{sum(r['same_tokens'] for r in rows)} of {len(rows)}",
                all(r["same_tokens"] for r in rows)))
    lookup = next(r for r in rows if r["drafter"] == "prompt_lookup" and r["task"] == "grounded_edit")
    out.append(("speculative: prompt lookup at least 1.5x on the grounded edit", f"{lookup['speedup']:.2f}x",
                lookup["speedup"] >= 1.5))
    story = max((r for r in rows if r["task"] == "story"), key=lambda r: r["speedup"])
    out.append((f"speculative: best drafter on free writing ({story['drafter']}) faster than none",
                f"{story['speedup']:.2f}x", story["speedup"] > 1.0))
    return out


def _report(result: dict) -> list:
    return [f"speculative {r['drafter']:<14} {r['task']:<14} k={r['k']} accepted {r['acceptance_rate']:.2f} "
            f"{r['tokens_per_verify']:.2f} tok/verify {r['tokens_per_s']:5.1f} vs {r['baseline_tokens_per_s']:5.1f} "
            f"tok/s -> {r['speedup']:.2f}x same={r['same_tokens']}" for r in result.get("speculative", [])]


SECTION = Section("speculative", "lesson 14: speculative decoding",
                  lambda m, t, q: {"speculative": speculative_section(m, t, q)}, _targets, _report)
