"""The course's server against llama.cpp's server (llama-server) under the same load trace, on the same machine.

What it does: `llama_server_command` builds llama-server's command line (same GGUF file, continuous batching,
a number of slots, a context per slot that holds the trace's longest request, flash attention as asked);
`wait_ready` polls a server's /health until it answers 200 (llama-server answers 503 while it loads) or the
process dies; `drive` replays measure.load's mixed trace at each rate against a server and summarizes each run
with the same latency targets (the bench's serving_load SLOs); `compare` puts each course configuration beside
llama-server's best slot setting at each rate (goodput at least as high, p99 time between tokens no
worse); `describe` prints a record. Every server runs in its own process, pinned with taskset to the same cores;
the load generator runs beside them on the same machine (loopback), for both sides alike.
What it does not do: build llama-server (scripts/serving_peers_cpu.py says how, in a scratch folder) or start the
course's server (serve.serving.start_server does, in the script's child process).
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from .load import mixed_trace, replay, summarize
from .serving import GAP_TARGET_S, TTFT_TARGET_S

RATES = (0.25, 0.5, 1.0)  # requests per second
REQUESTS, MAX_TOKENS = 14, 32  # per rate: the bench's serving_load trace
SLOT_CONTEXT = 2048  # llama-server splits -c across its slots: each must hold a handbook request (about 1,150 tokens)
# name -> start_server options (the course's own model, its 4-bit weights from the file's blocks). The paged cache's
# decode runs eagerly, so it takes the format whose eager products are fastest here: int4-q8 (the course's kernel)
# read a 128-token chunk in 0.14 s against int4's 0.24 (SmolLM2, two threads, 2026-12-07; int4 before that date)
COURSE_CONFIGS = {
    "course compiled": {"fmt": "int4", "compiled": True},
    "course paged chunked": {"fmt": "int4-q8", "kv_cache": "paged", "prefix_caching": True, "token_budget": 128},
    # a row per request, each step one fused call over decode tokens and a prompt chunk (engine.slot_scheduler);
    # 16 tokens a step: a chunk plus decode rows near llama-server's p99 gap on Q4_0 (27-44 ms, 2026-12-07)
    "course slots fused": {"fmt": "int4-q8", "compiled": True, "kv_cache": "slots", "token_budget": 16},
}


def llama_server_command(binary: str, gguf: str, port: int, slots: int, threads: int, flash: bool = True) -> list[str]:
    """llama-server on loopback: `slots` parallel sequences by continuous batching, SLOT_CONTEXT tokens each, the
    GGUF's own chat template (--jinja, as the course applies it), `threads` threads for decode and for batches."""
    if not isinstance(slots, int) or slots < 1 or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"slots and threads must be whole numbers >= 1, got {slots!r}, {threads!r}")
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(SLOT_CONTEXT * slots), "-t", str(threads), "-tb", str(threads), "--cont-batching",
            "-fa", "on" if flash else "off", "--jinja", "--no-webui"]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    """Seconds until GET url/health answers 200; a clear error if the process exits first or time runs out."""
    import httpx
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not ready after {timeout:.0f} s")


def traces(rates=RATES, n: int = REQUESTS, max_tokens: int = MAX_TOKENS) -> dict:
    """The same trace per rate for every server (seed = the rate's index, as the bench's serving_load)."""
    return {rate: mixed_trace(rate, n, seed=i, max_tokens=max_tokens) for i, rate in enumerate(rates)}


def drive(url: str, by_rate: dict, timeout: float = 600) -> list[dict]:
    """Replay each rate's trace against the server at url; one summary per rate (measure.load.summarize with the
    serving_load targets), with the answers' texts kept (every engine is greedy: they can be compared)."""
    out = []
    for rate, trace in by_rate.items():
        outcomes, wall = replay(url, trace, timeout=timeout)
        summary = summarize(outcomes, wall, TTFT_TARGET_S, GAP_TARGET_S)
        summary.update(rate=rate, texts=[o.text for o in outcomes],
                       pieces=sum(len(o.pieces) for o in outcomes), usage_tokens=sum(o.tokens for o in outcomes))
        out.append(summary)
    return out


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """Per rate, each course configuration against llama-server's best slot setting at that rate (by goodput, then
    tokens/s): goodput and p99 time between tokens side by side, and whether that configuration met the target
    (goodput at least llama-server's, p99 gap no worse). One verdict per configuration, not the course's best
    picked per rate: a server runs one configuration at every rate. runs: configuration name -> drive()'s list
    (names starting with 'course' are the course's). Records before 2026-12-07 14:49 kept only the course
    configuration with the best goodput at each rate."""
    if not any(n.startswith("course") for n in runs) or not any(not n.startswith("course") for n in runs):
        raise ValueError(f"need at least one course configuration and one llama-server one, got {sorted(runs)}")
    rows = []
    for i, rate in enumerate(r["rate"] for r in next(iter(runs.values()))):
        theirs = {n: r[i] for n, r in runs.items() if not n.startswith("course")}
        theirs_name = max(theirs, key=lambda n: (theirs[n]["goodput_rps"], theirs[n]["tokens_per_s"]))
        best = theirs[theirs_name]
        for ours_name in [n for n in runs if n.startswith("course")]:
            ours = runs[ours_name][i]
            rows.append({"rate": rate, "course": ours_name, "llama": theirs_name,
                         "goodput_rps": [ours["goodput_rps"], best["goodput_rps"]],
                         "itl_p99_s": [ours["itl_p99_s"], best["itl_p99_s"]],
                         "tokens_per_s": [ours["tokens_per_s"], best["tokens_per_s"]],
                         "met": ours["goodput_rps"] >= best["goodput_rps"] and ours["itl_p99_s"] <= best["itl_p99_s"]})
    return rows


def serving_records(folder: Path, other_files: bool = False) -> list[Path]:
    """The serving-peers records on the course's own file in `folder` (serving-peers-cpu-DATE[-HHMM].json), or with
    other_files=True those on another file (their names carry its format: -Q4_0), oldest sitting first by the time
    each says it ended."""
    files = [p for p in folder.glob("serving-peers-cpu-*.json")
             if bool(re.search(r"-Q\d_\w+$", p.stem)) == other_files]
    return sorted(files, key=lambda p: json.loads(p.read_text())["when"])


def describe(record: dict) -> list[str]:
    """A serving-peers record as lines: each configuration at each rate, then the comparison per rate."""
    lines = [f"serving peers: {record['requests_per_rate']} requests per rate, at most {record['max_tokens']} tokens "
             f"each, {record['threads']} thread(s) per server, first token within {record['ttft_target_s']:.0f} s and "
             f"no gap over {record['gap_target_s']:.0f} s count as good"]
    if record.get("course_steps"):  # newer records: what each course configuration's decode step ran
        lines.append("  the course's decode steps: " + ", ".join(f"{name} {kind}" for name, kind
                                                               in record["course_steps"].items())
                     + f"; its engine loop in the server's {record.get('course_engine_loop', 'background thread')}")
    for name, runs in record["runs"].items():
        for r in runs:
            lines.append(f"  {name:<22} {r['rate']:.2f} req/s: first token p50 {r['ttft_p50_s']:.2f} p99 "
                         f"{r['ttft_p99_s']:.2f} s, between tokens p50 {r['itl_p50_s']:.3f} p99 {r['itl_p99_s']:.3f} "
                         f"max {r['max_gap_s']:.2f} s, {r['tokens_per_s']:.1f} tok/s, goodput {r['goodput_rps']:.3f} "
                         f"req/s, {r['finished']}/{r['requests']} finished")
    for row in record["comparison"]:
        lines.append(f"  {row['rate']:.2f} req/s: {row['course']} goodput {row['goodput_rps'][0]:.3f} vs "
                     f"{row['llama']} {row['goodput_rps'][1]:.3f} req/s, p99 gap {row['itl_p99_s'][0]:.3f} vs "
                     f"{row['itl_p99_s'][1]:.3f} s: target {'met' if row['met'] else 'missed'}")
    return lines
