"""The bench's `engine` section (lesson 11): the course's model written out against the library's model.generate.

What it does: same tokens and tokens per second at short context and after a long prompt, what storing matrices
by columns is worth, a batch-1 decode step taken apart (`ops_per_step`), and the static step eager and compiled
(`compiled`); with its targets and report lines.
What it does not do: the measurements themselves (measure.race, measure.compiled hold them).
"""
from __future__ import annotations

import torch

from ..text.context import filler_ids, story_ids
from .section import Section
from ..runtime import median


def engine_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 11: our model written out (float32, batch 1) against the library's model.generate."""
    from .race import long_context, our_step_seconds, race, step_anatomy
    from ..runner.model import Model
    ours = Model.from_transformers(model, dtype=torch.float32)
    library = model if model.dtype == torch.float32 else model.float()
    story = story_ids(tokenizer)
    r = race(ours, library, tokenizer, story, 8 if quick else 128, repeats=2 if quick else 3)
    long = long_context(ours, library, tokenizer, filler_ids(tokenizer, 256 if quick else 4000), k=4 if quick else 16)
    weights = ours.weight_bytes()
    # what the layout choice is worth: ours against ours with every matrix by rows (the library's layout),
    # both timed by the median gap between tokens
    by_rows = Model.from_transformers(model, dtype=torch.float32, layout="rows")
    gap = lambda m_: median(our_step_seconds(m_, tokenizer, story, 17 if quick else 49))  # noqa: E731
    rows_gap, built_gap = gap(by_rows), gap(ours)
    del by_rows
    linears = {name: getattr(ours.layers[0], name) for name in ("qkv", "o", "gate_up", "down")} | {"head": ours.lm_head}
    layouts = {name: linear.layout for name, linear in linears.items()}
    kernels = {name: linear.kernel for name, linear in linears.items()}  # for two or more rows at once
    # a decode step at batch 1 taken apart: operators counted, products alone, the rest (the ops_per_step)
    anatomy = {"float32": step_anatomy(ours, story, steps=5 if quick else 40)}
    fast = ours
    if ours.device.type == "cpu":  # the fastest format here; its 4-bit kernel is a CPU kernel
        from ..runner.formats import convert
        fast = convert(ours, "int4")
        anatomy["int4"] = step_anatomy(fast, story, steps=5 if quick else 40)
    # the static-shape step, eager and compiled (the engine.compiled); --quick does not wait for a compile
    from .compiled import compiled_comparison
    compiled = compiled_comparison(ours, tokenizer, story, 6 if quick else 48, compile=not quick)
    # the fast path as the engine runs it (issue: the fast path is the engine): generate compiled against eager,
    # and a decode step of B rows against one row, eager and compiled (--quick: the static steps uncompiled)
    from .fast_path import batch_scaling, compiled_generate
    fast_generate = compiled_generate(fast, tokenizer, story, 8 if quick else 128, repeats=1 if quick else 3,
                                      compile=not quick)
    # and the same with the int8 copy for calls of several rows (formats.Int4Linear's rows_int8), where it runs
    from ..runner.formats import ROWS_INT8, int_mm_available
    from ..engine.long_context import long_text_ids
    rows_model = convert(ours, "int4", rows_int8=ROWS_INT8) if fast is not ours and int_mm_available() else None
    text = long_text_ids(tokenizer, 64 if quick else 512)  # lesson 12's perplexity text
    scaling = batch_scaling(fast, tokenizer, (1, 2) if quick else (1, 2, 4, 8), steps=3 if quick else 9,
                            compile=not quick, rows_model=rows_model, text=text)
    if fast is not ours:  # the course's own kernel (runner/q4_kernel.py): the same two measurements, and perplexity
        fast_generate["int4_q8"], scaling["int4_q8"] = _course_kernel(ours, fast, tokenizer, story, text, quick,
                                                                      scaling.get("rows_int8", {}).get("perplexity_int4"))
    return {"ops_per_step": anatomy, "compiled": compiled, "compiled_generate": fast_generate, "batch_scaling": scaling, "new_tokens": r["new_tokens"], "tokens_per_s": r["tokens_per_s"],
            "generate_tokens_per_s": r["generate_tokens_per_s"], "ratio": r["ratio"], "same_tokens": r["same_tokens"],
            "long_context_tokens": long["context"], "long_context_ms_per_token": long["ms_per_token"],
            "long_context_generate_ms_per_token": long["generate_ms_per_token"], "long_context_ratio": long["ratio"],
            "weight_bytes": weights, "bandwidth_bytes_per_s": weights * r["tokens_per_s"],
            "layouts": layouts, "several_rows_kernels": kernels, "rows_step_ms": rows_gap * 1000, "built_step_ms": built_gap * 1000,
            "layout_speedup": rows_gap / built_gap}


def _course_kernel(ours, int4, tokenizer, story, text, quick: bool, int4_perplexity=None) -> tuple[dict, dict]:
    """The int4-q8 format (the course's kernel where it runs, else torch's with the reason): compiled_generate and
    batch_scaling as for int4, plus the perplexity of `text` through both formats (int4's: the one the int8 copy's
    measurement already took, where it did)."""
    from ..runner.formats import convert
    from .fast_path import batch_scaling, compiled_generate
    from .quality import perplexity
    q8 = convert(ours, "int4-q8")
    from ..runner.q4_kernel import best_variant
    used = q8.layers[0].qkv.q4 is not None
    kernel = {"course_kernel": used, "why_not_kernel": q8.layers[0].qkv.why_not,
              "kernel_variant": best_variant() if used else None}  # avx2 or vnni (AVX-512 VNNI's dpbusd)
    generated = compiled_generate(q8, tokenizer, story, 8 if quick else 128, repeats=1 if quick else 3,
                                  compile=not quick)
    scaling = batch_scaling(q8, tokenizer, (1, 2) if quick else (1, 2, 4, 8), steps=3 if quick else 9,
                            compile=not quick)
    return kernel | generated, kernel | scaling | {"text_tokens": len(text),
                                                   "perplexity_int4": int4_perplexity or perplexity(int4, text),
                                                   "perplexity_int4_q8": perplexity(q8, text)}


def _targets(result: dict) -> list:
    out = []
    e = result["engine"]
    out.append(("engine: same tokens as model.generate, at least as fast",
                f"{e['ratio']:.2f}x (same tokens: {e['same_tokens']})", e["ratio"] >= 1.0 and e["same_tokens"]))
    out.append((f"engine: at least 1.3x faster decode after {e['long_context_tokens']} tokens",
                f"{e['long_context_ratio']:.2f}x", e["long_context_ratio"] >= 1.3))
    g, b = e.get("compiled_generate"), e.get("batch_scaling")
    if g and g["compiled"]:
        out.append((f"engine: generate compiled at least 2x eager ({g['threads']} thread(s), "
                    f"{g.get('step_kind', 'compiled')} step)",
                    f"{g['speedup']:.2f}x (same tokens: {g['same_tokens']})", g["speedup"] >= 2.0))
    if b and b.get("ran_compiled") and "8" in {str(k) for k in b["compiled_scaling"]}:
        eight = {str(k): v for k, v in b["compiled_scaling"].items()}["8"]
        out.append(("engine: 8 rows give at least 4x one row's tokens/s (compiled)", f"{eight:.2f}x", eight >= 4.0))
        rows = b.get("rows_int8")
        if rows:
            eight = {str(k): v for k, v in rows["compiled_scaling"].items()}["8"]
            out.append((f"engine: the same, int8 copy from {rows['rows_from']} rows (compiled)", f"{eight:.2f}x",
                        eight >= 4.0))
    q8 = (b or {}).get("int4_q8")
    if q8 and "8" in {str(k) for k in q8["eager_scaling"]}:
        for side in ("eager", "compiled") if q8["ran_compiled"] else ("eager",):
            eight = {str(k): v for k, v in q8[f"{side}_scaling"].items()}["8"]
            kind = side if side == "eager" else q8.get("step_kind", side)
            out.append((f"engine: 8 rows give at least 4x one row's tokens/s (int4-q8, {kind})", f"{eight:.2f}x",
                        eight >= 4.0))
    return out


def _report(result: dict) -> list:
    lines = []
    e = result["engine"]
    lines.append(f"engine: ours {e['tokens_per_s']:.1f} tok/s vs model.generate {e['generate_tokens_per_s']:.1f} "
                 f"({e['ratio']:.2f}x), reading weights at {e['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; after "
                 f"{e['long_context_tokens']} tokens {e['long_context_ms_per_token']:.1f} vs "
                 f"{e['long_context_generate_ms_per_token']:.1f} ms/token ({e['long_context_ratio']:.2f}x)")
    by_columns = [name for name, layout in e["layouts"].items() if layout == "columns"] or ["none"]
    for fmt, a in e.get("ops_per_step", {}).items():
        lines.append(f"engine step ({fmt}, batch 1): {a['step_ms']:.1f} ms = matrix products alone {a['products_ms']:.1f} "
                     f"+ the rest {a['rest_ms']:.1f}; {a['aten_ops']:.0f} operators counted by the profiler, "
                     f"{a['python_calls']:.0f} called from Python (about {a['calling_ms_estimate']:.1f} ms to call "
                     f"at {a['tiny_call_us']:.2f} us each)")
    c = e.get("compiled")
    for fmt, row in (c or {}).get("formats", {}).items():
        compiled = (f"compiled {row['compiled_ms']:.1f} ms ({row['speedup']:.2f}x the engine's step; "
                    f"{row['compiled_ops_per_step']:.0f} operators against {row['static_eager_ops_per_step']:.0f} "
                    f"eagerly; compiling took {row['compile_s']:.0f} s; same tokens: {row['compiled_same_tokens']})"
                    if c["compiled"]
                    else f"not compiled: {c['why_not']}")
        lines.append(f"engine static step ({fmt}): engine {row['engine_ms']:.1f} ms, static eager "
                     f"{row['static_eager_ms']:.1f} ms, {compiled}")
    lines.append(f"engine layout: by columns {', '.join(by_columns)}; a step {e['built_step_ms']:.1f} ms as built, "
                 f"{e['rows_step_ms']:.1f} ms all by rows ({e['layout_speedup']:.2f}x); several rows through oneDNN: "
                 f"{', '.join(n for n, k in e['several_rows_kernels'].items() if k == 'onednn') or 'none'}")
    g = e.get("compiled_generate")
    if g:
        lines.append(f"engine generate ({g['new_tokens']} tokens, {g['threads']} thread(s)): eager "
                     f"{g['eager_tokens_per_s']:.1f} tok/s, {g.get('step_kind', 'compiled')} "
                     f"{g['compiled_tokens_per_s']:.1f} ({g['speedup']:.2f}x; {g['capacity']}-column bucket compiled "
                     f"in {g['compile_s']:.0f} s; same "
                     f"tokens: {g['same_tokens']})" + ("" if g["compiled"] else f"; not compiled: {g['why_not']}"))
    q8 = (g or {}).get("int4_q8")
    if q8:
        lines.append(f"engine generate, int4-q8 ({'the course' if q8['course_kernel'] else 'torch'}'s kernel): eager "
                     f"{q8['eager_tokens_per_s']:.1f} tok/s ({q8['eager_tokens_per_s'] / g['eager_tokens_per_s']:.2f}x "
                     f"int4's), {q8.get('step_kind', 'compiled')} {q8['compiled_tokens_per_s']:.1f} ({q8['speedup']:.2f}x its "
                     f"eager, {q8['compiled_tokens_per_s'] / g['eager_tokens_per_s']:.2f}x int4's eager; same tokens: "
                     f"{q8['same_tokens']})")
    b = e.get("batch_scaling")
    for name, rows in (("", b), (" int8 copy from {rows_from} rows", (b or {}).get("rows_int8")),
                       (" int4-q8", (b or {}).get("int4_q8"))):
        for side in ("eager", "compiled") if rows else ():
            kind = side if side == "eager" else rows.get("step_kind", side)  # int4-q8's "compiled" side may be fused
            lines.append(f"engine batch scaling{name.format(**rows)}, {kind} ({b['threads']} thread(s), "
                         f"{b['context']}-token cache): "
                         + ", ".join(f"B={r['rows']} {r['step_ms']:.1f} ms {r['tokens_per_s']:.0f} tok/s"
                                     for r in rows[side].values()))
    if b and "perplexity_rows_int8" in b.get("rows_int8", {}):
        r = b["rows_int8"]
        lines.append(f"engine int8 copy: perplexity over {r['text_tokens']} tokens {r['perplexity_rows_int8']:.3f} "
                     f"against the 4-bit kernel's {r['perplexity_int4']:.3f}; {r['int8_bytes'] / 1e6:.0f} MB more")
    if b and "int4_q8" in b:
        r = b["int4_q8"]
        lines.append(f"engine int4-q8: perplexity over {r['text_tokens']} tokens {r['perplexity_int4_q8']:.3f} against "
                     f"int4's {r['perplexity_int4']:.3f}" + ("" if r["course_kernel"] else f"; {r['why_not_kernel']}"))
    return lines


SECTION = Section("engine", "lesson 11: our model against the library",
                  lambda m, t, q: {"engine": engine_section(m, t, q)}, _targets, _report)
