"""The course's engine against llama.cpp on the very same GGUF file, in one run (issue: the engine as fast as
llama.cpp).

What it does: builds the inputs every path reads (the course's tokenizer's IDs: a chat prompt, a 1,000-token
prompt for prefill, 1,024 tokens of the course's long text for perplexity), measures the course's formats
(decode tokens per second as the median gap between tokens, prefill tokens per second, perplexity), and runs
llama.cpp's side (measure/peers_llama.py) in this environment when llama-cpp-python is installed here, or in
another Python that has it (a scratch environment), on the same IDs and thread counts.
What it does not do: install llama.cpp; draw (lesson 12 does).
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import torch

from .peers_llama import llama_cpp_available, llama_path
from .quality import perplexity
from .race import our_step_seconds
from .compiled import PARTS
from .timers import best_of, greedy_gaps
from ..runtime import median

def peer_inputs(tokenizer, n_new: int = 128, long_tokens: int = 1000, text_tokens: int = 1024) -> dict:
    """The token IDs every path reads: a chat prompt, a long prompt for prefill, a text for perplexity."""
    from ..text.context import chat_ids, filler_ids
    from ..engine.long_context import long_text_ids
    prompt = chat_ids(tokenizer, "Write a short story about a lighthouse keeper.", system="You are a helpful assistant.")
    return {"prompt": prompt, "long": filler_ids(tokenizer, long_tokens), "text": long_text_ids(tokenizer)[:text_tokens],
            "n_new": n_new}


def course_prefill(model, prompt_ids: list[int], repeats: int = 2) -> float:
    """Prefill tokens per second of the course's model: the prompt into a fresh cache, best of `repeats`."""
    from ..engine.stages import prefill
    seconds, _ = best_of(lambda: prefill(model, prompt_ids, capacity=len(prompt_ids) + 1), repeats, model.device, warmup=0)
    return len(prompt_ids) / seconds


@torch.inference_mode()
def bare_decode(model, prompt_ids: list[int], n_new: int) -> dict:
    """The loop llama_decode runs on llama.cpp, on the course's model: prefill, then argmax of the last logits fed
    back, n_new times (no picker, no detokenizer, no records; timers.greedy_gaps). Tokens per second from the median
    gap."""
    from ..engine.stages import decode_step, prefill
    logits, cache = prefill(model, prompt_ids, capacity=len(prompt_ids) + n_new + 1)
    tokens, gaps = greedy_gaps(lambda token: decode_step(model, [token], cache)[0], logits, n_new, model.device)
    return {"tokens": tokens, "tokens_per_s": 1 / median(gaps[1:])}


def course_path(model, tokenizer, inputs: dict) -> dict:
    """decode_tokens_per_s: the same bare loop as llama.cpp's side (bare_decode); generate_tokens_per_s: the
    course's whole loop (generation.generate: picker, streaming detokenizer, records), for the cost of those."""
    bare_decode(model, inputs["prompt"], 4)  # warm-up
    bare = bare_decode(model, inputs["prompt"], inputs["n_new"])
    gaps = our_step_seconds(model, tokenizer, inputs["prompt"], inputs["n_new"] + 1)
    return {"decode_tokens_per_s": bare["tokens_per_s"], "generate_tokens_per_s": 1 / median(gaps),
            "prefill_tokens_per_s": course_prefill(model, inputs["long"]), "perplexity": perplexity(model, inputs["text"])}


def head_options(reference, tokenizer, inputs: dict, fmt: str = "int4",
                 heads=("float", "int8", "int8-dynamic", "int4"), quality: bool = True) -> list[dict]:
    """The output head (a fifth of the weights) in each kind, the layers in `fmt`: bytes per token, decode tokens
    per second, and perplexity on the same text (when `quality`). What the default head of `fmt` is chosen from.
    The int8 x int8 head is left out where its kernel is missing or saturates (formats.int8_dynamic_available)."""
    from ..runner.formats import convert, int8_dynamic_available
    rows = []
    for head in heads:
        if head == "int8-dynamic" and not int8_dynamic_available():
            continue
        model = convert(reference, fmt, head=head)
        bare_decode(model, inputs["prompt"], 4)  # warm-up
        row = {"format": fmt, "head": head, "weight_bytes": model.weight_bytes(),
               "decode_tokens_per_s": bare_decode(model, inputs["prompt"], inputs["n_new"])["tokens_per_s"]}
        if quality:
            row["perplexity"] = perplexity(model, inputs["text"])
        rows.append(row)
    return rows


def llama_side(gguf_path, threads: int, inputs: dict, python: str | None = None) -> dict:
    """llama.cpp's figures at `threads`: in this process when llama_cpp imports here, else with `python`
    (an interpreter whose environment has llama-cpp-python)."""
    if python is None:
        if not llama_cpp_available():
            raise ImportError("llama.cpp is not installed here: pip install llama-cpp-python (it compiles for "
                              "minutes), or pass the Python of a scratch environment that has it")
        return llama_path(gguf_path, threads, inputs["prompt"], inputs["long"], inputs["text"], inputs["n_new"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(inputs, f)
    script = Path(__file__).with_name("peers_llama.py")
    proc = subprocess.run([python, str(script), f.name, str(gguf_path), str(threads)], capture_output=True,
                          text=True, timeout=1800)
    Path(f.name).unlink()
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's side failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peers_run(model, tokenizer, formats: tuple[str, ...] = ("float32", "int8", "int4"), threads=(1, 2),
              llama_python: str | None = None, n_new: int = 128, compiled: tuple[str, ...] = ("int4",)) -> dict:
    """One run: every format of the course and llama.cpp, at each thread count, on the same IDs and file; the
    formats in `compiled` again with their decode step compiled (static_step.StaticStep): decode only, since the
    prompt and the perplexity go through the same ordinary pass as the format's own row; and for those, where the
    compiled step's milliseconds go (`profile`: measure.compiled.step_parts)."""
    from .compiled import compiled_decode, first_difference, step_parts
    from ..runner.formats import convert
    from ..loading import gguf_path
    from ..runner.model import Model
    inputs = peer_inputs(tokenizer, n_new)
    reference = Model.from_transformers(model, dtype=torch.float32)
    built = {name: reference if name == "float32" else convert(reference, name) for name in formats}
    before = torch.get_num_threads()
    rows, heads, profile = [], [], []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for name, fmt in built.items():
                rows.append({"path": f"course {name}", "threads": t, **course_path(fmt, tokenizer, inputs)})
                if name in compiled:
                    eager = bare_decode(fmt, inputs["prompt"], inputs["n_new"])["tokens"]
                    fast = compiled_decode(fmt, inputs["prompt"], inputs["n_new"])
                    rows.append({"path": f"course {name} compiled", "threads": t,
                                 "decode_tokens_per_s": fast["tokens_per_s"], "compile_s": fast["compile_s"],
                                 "first_difference_from_eager": first_difference(fast["tokens"], eager),
                                 **{k: rows[-1][k] for k in ("prefill_tokens_per_s", "perplexity")}})
                    profile.append({"path": f"course {name} compiled", **step_parts(fmt, inputs["prompt"], inputs["n_new"])})
            llama = llama_side(gguf_path(), t, inputs, llama_python)
            rows.append({"path": "llama.cpp", "threads": t, **{k: v for k, v in llama.items() if k != "greedy_tokens"}})
            if "int4" in built:
                heads += [{"threads": t, **h} for h in head_options(reference, tokenizer, inputs, quality=t == threads[0])]
    finally:
        torch.set_num_threads(before)
    return {"head": heads, "profile": profile, "inputs": {"prompt_tokens": len(inputs["prompt"]), "new_tokens": n_new, "prefill_tokens": len(inputs["long"]),
                       "perplexity_tokens": len(inputs["text"]), "text": "data/long (Pride and Prejudice), first tokens"},
            "gguf": gguf_path().name, "rows": rows}


def describe(record: dict) -> list[str]:
    """A committed peers record as lines: each path and thread count, then per thread count the course's fastest
    decode and prefill against llama.cpp's (and the decode path's perplexity against llama.cpp's)."""
    inputs = record["inputs"]
    lines = [f"{inputs['prompt_tokens']}-token prompt, {inputs['new_tokens']} greedy tokens (decode: the same bare loop on "
             "both sides, argmax fed back; whole loop: the course's generate); prefill of "
             f"{inputs['prefill_tokens']}; perplexity on {inputs['perplexity_tokens']} tokens of the course's long text"]
    for row in record["rows"]:
        whole = f" (whole loop {row['generate_tokens_per_s']:5.1f})" if "generate_tokens_per_s" in row else " " * 19
        lines.append(f"  {row['path']:<20} {row['threads']} thread(s): decode {row['decode_tokens_per_s']:6.1f} tok/s{whole}, "
                     f"prefill {row['prefill_tokens_per_s']:7.1f} tok/s, perplexity {row['perplexity']:.3f}")
    for t, llama, ours in by_threads(record):
        if not ours:
            continue
        best = max(ours, key=lambda row: row["decode_tokens_per_s"])
        fill = max(ours, key=lambda row: row["prefill_tokens_per_s"])
        lines.append(f"  {t} thread(s): fastest decode {best['path']} at "
                     f"{best['decode_tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x llama.cpp (perplexity "
                     f"{100 * (best['perplexity'] / llama['perplexity'] - 1):+.1f}%), fastest prefill {fill['path']} at "
                     f"{fill['prefill_tokens_per_s'] / llama['prefill_tokens_per_s']:.1f}x")
    for h in record.get("head", []):
        quality = f", perplexity {h['perplexity']:.3f}" if "perplexity" in h else ""
        lines.append(f"  {h['format']} layers, {h['head']:<12} head, {h['threads']} thread(s): {h['weight_bytes'] / 1e6:5.1f} MB "
                     f"per token, decode {h['decode_tokens_per_s']:5.1f} tok/s{quality}")
    lines += profile_lines(record)
    lines.append(f"  llama.cpp build: {record.get('llama_cpp_build') or 'as pip builds it'}; CPU: {record.get('processor', '?')}")
    return lines


def by_threads(record: dict) -> list[tuple[int, dict, list[dict]]]:
    """(threads, llama.cpp's row, the course's rows, possibly none) for each thread count with a llama.cpp row."""
    out = []
    for t in sorted({row["threads"] for row in record["rows"]}):
        rows = [row for row in record["rows"] if row["threads"] == t]
        llama = next((row for row in rows if row["path"] == "llama.cpp"), None)
        ours = [row for row in rows if row["path"] != "llama.cpp"]
        if llama is not None:
            out.append((t, llama, ours))
    return out


def profile_lines(record: dict) -> list[str]:
    """The record's `profile` as lines: per thread count, the compiled step's milliseconds split into its parts,
    the weights' read floor, and llama.cpp's milliseconds per token (its median gap, and its own timer)."""
    lines = []
    llamas = {t: llama for t, llama, _ in by_threads(record)}
    for p in record.get("profile", []):
        llama = llamas.get(p["threads"])
        ms = p["ms"]
        parts = " + ".join(f"{part.replace('_', ' ')} {ms[part]:.2f}" for part in PARTS)
        lines.append(f"  {p['threads']} thread(s), {p['path']} step {ms['step']:.2f} ms = {parts}; the weights' read "
                     f"floor {p['read_floor_ms']:.2f} ms ({p['bytes']['weights'] / 1e6:.1f} MB at "
                     f"{p['read_bytes_per_s'] / 1e9:.1f} GB/s)")
        if llama is not None:
            own = f" (its own timer: {llama['eval_ms_per_token']:.2f})" if "eval_ms_per_token" in llama else ""
            lines.append(f"      llama.cpp {1000 / llama['decode_tokens_per_s']:.2f} ms a token{own}")
    return lines


def sitting_lines(records: dict[str, dict]) -> list[str]:
    """One line per committed sitting (name -> record, oldest first): the course's fastest decode against
    llama.cpp's at each thread count, so that how much each side moves between sittings can be read."""
    lines = []
    for name, record in records.items():
        cells = []
        for t, llama, ours in by_threads(record):
            if not ours:
                continue
            best = max(ours, key=lambda row: row["decode_tokens_per_s"])
            cells.append(f"{t} thread(s) {best['path']} {best['decode_tokens_per_s']:5.1f} against "
                         f"{llama['decode_tokens_per_s']:5.1f} ({best['decode_tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x)")
        lines.append(f"  {name}: " + "; ".join(cells))
    return lines
