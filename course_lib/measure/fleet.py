"""The bench's `fleet` section (lesson 18, beyond one machine): what this machine can run of it. The keys
`router` (replicas behind sglang-router, measure/router.py), `tp` (SmolLM2 split over three processes by tensor
parallelism, runner/tensor_parallel.py, against one process) and `disagg` (a prompt's blocks shipped from a
prefill process to this one, serve/disagg.py).

What it does: `tp_figures` runs the same greedy decode in one process and in three over gloo on loopback, one
thread each, and reports the largest logit difference against the library, whether the tokens agree, the median
step in each, the share of the split step spent in all-reduce (waiting for the slowest rank included), and the
bytes each rank holds. `disagg_figures` starts a prefill process, has it read the handbook prompt and ship its
blocks in each wire format, and reports the bytes per prompt token, the seconds on the wire (the round trip less
the prefill process's own prefill time), and whether the decode side continues with the tokens of one process.
`router_figures` puts two replicas behind sglang-router, round robin against cache-aware, and one replica alone,
on a trace of questions in groups that share a long system prompt.
`gap_figures` times a running answer's tokens while a long prompt is read in the prefill process and shipped in,
against one process reading it whole and in chunks; `trace_figures` replays lesson 13's mixed trace the same three
ways (`trace_gaps`: the decode side batches shipped requests, serve/disagg_batch.py).
What it does not do: run the trace over HTTP (the requests arrive inside this process, on the trace's clock), or
use more than one prefill process.
"""
from __future__ import annotations

import json

import torch

from ..runtime import median
from .router import router_figures
from .section import Section

TP_WORLD = 3  # SmolLM2 has 3 key/value heads: the only split besides 1


def tp_figures(model, tokenizer, steps: int = 32, world: int = TP_WORLD) -> dict:
    from ..text.context import chat_ids
    from ..runner import tensor_parallel as tp
    prompt = chat_ids(tokenizer, "Write a short story about a robot who learns to paint.")
    one = tp.run(1, prompt, steps, threads=1)
    split = tp.run(world, prompt, steps, threads=1)
    with torch.inference_mode():
        library = model(torch.tensor([prompt], device=model.device)).logits[0, -1].float().cpu()
    step_one, step_split = 1000 * median(one["step_s"]), 1000 * median(split["step_s"])
    return {"world": world, "threads_per_rank": 1, "prompt_tokens": len(prompt), "steps": steps,
            "max_logit_difference": float((split["logits"] - library).abs().max()),
            "max_logit_difference_one_process": float((one["logits"] - library).abs().max()),
            "same_tokens": split["tokens"] == one["tokens"],
            "step_ms_one_process": step_one, "step_ms_tp": step_split, "slowdown": step_split / step_one,
            "allreduce_share": sum(split["reduce_s"]) / sum(split["step_s"]),
            "allreduces_per_step": 2 * model.config.num_hidden_layers,
            "rank_bytes": split["shard_bytes"], "one_process_bytes": one["shard_bytes"],
            "cores": torch.get_num_threads()}


def _router_rows(router: dict) -> list:
    if "skipped" in router:
        return []
    return [(f"fleet.router {policy}: no request lost (each answered, or refused with an error its client sees)",
             f"{run['finished']} of {run['requests']} answered, {len(run['errors'])} errors, {run['lost']} lost",
             run["lost"] == 0) for policy, run in router["policies"].items()]


def _targets(result: dict) -> list:
    t, d = result["fleet"]["tp"], result["fleet"]["disagg"]["formats"]["float32"]
    return _router_rows(result["fleet"]["router"]) + [(f"fleet.tp: {t['world']} processes give one process's logits (within 1e-3) and tokens",
             f"max |difference| {t['max_logit_difference']:.2e}, same tokens {t['same_tokens']}",
             t["max_logit_difference"] < 1e-3 and t["same_tokens"]),
            ("fleet.disagg: blocks shipped in float32 continue with one process's tokens", str(d["same_tokens"]),
             d["same_tokens"])] + _gap_rows(result["fleet"]["disagg"].get("decode_gaps")) + \
        _trace_rows(result["fleet"]["disagg"].get("trace"))


def _trace_rows(t: dict | None) -> list:
    if not t:
        return []
    return [("fleet.disagg trace: the decode side fed by the prefill process gives every request one process's tokens",
             str(t["same_tokens"]), t["same_tokens"])]


def _gap_rows(g: dict | None) -> list:
    if not g:
        return []
    apart, whole = g["disaggregated"]["p99_gap_s"], g["one_process_whole"]["p99_gap_s"]
    return [(f"fleet.disagg: a running answer's p99 gap while a {g['prompt_tokens']}-token prompt is read in another "
             "process is shorter than while one process reads it whole",
             f"{apart * 1000:.0f} ms against {whole * 1000:.0f} ms", apart < whole)]


def _report(result: dict) -> list:
    t, router = result["fleet"]["tp"], result["fleet"]["router"]
    lines = [f"fleet.router: skipped: {router['skipped']}"] if "skipped" in router else [
        f"fleet.router {policy:<12}: prefix hit rate {run['hit_rate']:.0%}, TTFT p50 {run['ttft_p50_s']:.2f} s, p99 "
        f"{run['ttft_p99_s']:.2f} s, goodput {run['goodput_rps']:.2f} req/s, requests per replica "
        f"{[r['requests'] for r in run['replicas']]}" for policy, run in router["policies"].items()]
    return lines + [f"fleet.tp: one process {t['step_ms_one_process']:.1f} ms per step, {t['world']} processes "
            f"{t['step_ms_tp']:.1f} ms ({t['slowdown']:.2f}x), {t['allreduce_share']:.0%} of it in "
            f"{t['allreduces_per_step']} all-reduces; each rank holds {t['rank_bytes'] / 1e6:.0f} MB of "
            f"{t['one_process_bytes'] / 1e6:.0f}"] + [
        f"fleet.disagg {fmt:<8}: {row['bytes_per_prompt_token']:,.0f} bytes per prompt token, {row['wire_s'] * 1000:.0f} ms "
        f"on the wire ({row['prefill_s'] * 1000:.0f} ms prefill), same tokens {row['same_tokens']}"
        for fmt, row in result["fleet"]["disagg"]["formats"].items()] + \
        _gap_report(result["fleet"]["disagg"].get("decode_gaps")) + _trace_report(result["fleet"]["disagg"].get("trace"))


def _trace_report(t: dict | None) -> list:
    if not t:
        return []
    names = ("disaggregated", "one_process_whole", "one_process_chunked")
    return [f"fleet.disagg trace ({t['requests']} requests at {t['rate']}/s): " + "; ".join(
        f"{n.replace('_', ' ')} ITL p99 {1000 * t[n]['itl_p99_s']:.0f} ms, TTFT p50 {t[n]['ttft_p50_s']:.2f} s"
        for n in names)]


def _gap_report(g: dict | None) -> list:
    if not g:
        return []
    return [f"fleet.disagg gaps: a running answer's p99 gap while {g['prompt_tokens']} prompt tokens are read: "
            + ", ".join(f"{name.replace('_', ' ')} {1000 * g[name]['p99_gap_s']:.0f} ms"
                        for name in ("disaggregated", "one_process_whole", "one_process_chunked"))
            + f" (chunks of {g['budget']} tokens)"]


SECTION = Section("fleet", "lesson 18: replicas behind a router, prefill and decode apart, the model split over processes",
                  lambda m, t, q: {"fleet": {"router": router_figures(q), "tp": tp_figures(m, t, 4 if q else 32),
                                             "disagg": disagg_figures(m, t, 4 if q else 16, short=q)}}, _targets, _report)


def shipped_gaps(ours, worker, prompt: list[int], long_prompt: list[int], new_tokens: int = 48, warmup: int = 3,
                 after: int = 3, fmt: str = "float32") -> dict:
    """The decode side's running request while a long prompt is read elsewhere: the running request decodes one token
    per step; after `warmup` tokens the prefill process is asked for the long prompt; its blocks are accepted into
    the decode side's pool between two steps, when they arrive. Runs for `new_tokens` tokens and at least `after`
    more once the blocks are in. The gaps between the running request's tokens: longest, p99, median."""
    import time

    from ..runner.blocks import blocks_for
    from ..serve import disagg
    from .load import percentile
    side = disagg.DecodeSide(ours, blocks_for(len(prompt) + 4 * new_tokens) + blocks_for(len(long_prompt) + 2))
    seq, token, _ = disagg.prefill_blocks(ours, side.pool, prompt)  # the running request, read before the clock
    side.expect("arriving", 1)
    stamps, asked, arrived, arrived_at = [], False, None, None
    try:
        while len(stamps) < new_tokens or arrived is None or len(stamps) < arrived_at + after:
            if len(stamps) >= 4 * new_tokens:
                raise RuntimeError("the prefill process's blocks did not arrive while the running request decoded")
            if len(stamps) >= warmup and not asked:
                worker.send("arriving", long_prompt, fmt)
                asked = True
            if asked and arrived is None and worker.answered():
                arrived, arrived_at = side.accept(*disagg.read_frame(worker.sock))[0], len(stamps)
            token = side.step(seq, token)
            stamps.append(time.perf_counter())
    finally:
        side.pool.free(seq)
        if arrived is not None:
            side.pool.free(arrived)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"max_gap_s": max(gaps), "p99_gap_s": percentile(gaps, 99), "median_gap_s": median(gaps),
            "gaps": len(gaps), "arrived_after_tokens": arrived_at}


def trace_gaps(ours, requests: list[tuple], worker=None, budget: int | None = None, pool_blocks: int = 600) -> dict:
    """A trace through one decode loop. requests: (arrival seconds, name, prompt ids, new tokens), in arrival order.
    worker None: one process reads the prompts itself (lesson 13's PagedScheduler; budget None whole, else chunked);
    a PrefillProcess: it reads them and ships their blocks, which this side adopts between steps
    (serve/disagg_batch.ShippedScheduler). Greedy. The gaps between each request's tokens, pooled (p50, p99, the
    longest), time to first token from arrival (p50, p99), and every request's tokens."""
    import time

    from ..engine.generation import step
    from ..engine.paged_scheduler import PagedScheduler
    from ..engine.request import Job
    from ..runner.paged import BlockPool
    from ..serve.disagg import read_frame
    from ..serve.disagg_batch import ShippedScheduler
    from .load import percentile
    pool = BlockPool.for_model(ours, pool_blocks)
    batch = ShippedScheduler(ours, pool) if worker else PagedScheduler(ours, pool, token_budget=budget)
    pending, jobs, stamps, arrived_at = list(requests), {}, {}, {}
    asked = got = 0
    start = time.perf_counter()
    while True:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, name, prompt, new_tokens = pending.pop(0)
            jobs[name], arrived_at[name] = Job(name, list(prompt), new_tokens), at
            if worker is None:
                batch.add([jobs[name]])
            else:
                batch.expect(jobs[name])
                worker.send(name, prompt)
                asked += 1
        while worker is not None and got < asked and worker.answered():
            batch.adopt(*read_frame(worker.sock))
            got += 1
        if not batch.jobs:
            if not pending and got == asked:
                break
            time.sleep(0.002)  # nothing to decode: wait for an arrival or a frame
            continue
        for job, _, _, _ in step(batch):
            stamps.setdefault(job.name, []).append(time.perf_counter() - start)
    gaps = [b - a for times in stamps.values() for a, b in zip(times, times[1:])]
    ttfts = [stamps[n][0] - arrived_at[n] for n in jobs if n in stamps]
    return {"itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "max_gap_s": max(gaps),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "wall_s": time.perf_counter() - start, "tokens": {n: j.tokens for n, j in jobs.items()}}


def trace_figures(model, tokenizer, worker, quick: bool = False) -> dict:
    """Lesson 13's mixed trace (measure/load.mixed_trace: chats, handbook questions, long documents) through the
    decode side fed by the prefill process, against one process reading the prompts whole and in chunks."""
    from ..text.context import context_ids
    from ..runner.model import Model
    from .load import mixed_trace
    from .serving import SERVING_CONFIGS
    ours = Model.from_transformers(model, dtype=torch.float32)
    rate, n = (2.0, 4) if quick else (0.5, 12)
    trace = mixed_trace(rate, n, seed=7, max_tokens=8 if quick else 32)
    requests = [(r.at, r.name, context_ids(tokenizer, r.messages)[:200 if quick else None], r.max_tokens) for r in trace]
    budget = SERVING_CONFIGS["paged_chunked"]["token_budget"]
    runs = {"disaggregated": trace_gaps(ours, requests, worker=worker),
            "one_process_whole": trace_gaps(ours, requests),
            "one_process_chunked": trace_gaps(ours, requests, budget=budget)}
    same = len({json.dumps(r.pop("tokens"), sort_keys=True) for r in runs.values()}) == 1
    return {"requests": n, "rate": rate, "kinds": [r.kind for r in trace], "prompt_tokens": [len(r[2]) for r in requests],
            "budget": budget, "same_tokens": same, **runs}


def gap_figures(model, tokenizer, worker, quick: bool = False) -> dict:
    """The running request's gaps while a long prompt arrives: prefill in another process (its blocks shipped in
    float32), against one process reading it whole and in chunks of lesson 13's budget (measure/load.decode_gaps)."""
    from ..text.context import chat_ids, handbook_ids
    from ..runner.model import Model
    from .load import decode_gaps
    from .serving import SERVING_CONFIGS
    ours = Model.from_transformers(model, dtype=torch.float32)
    chat, long = chat_ids(tokenizer, "Write a short story about a robot who learns to paint."), handbook_ids(tokenizer, "Hi")
    long = long[:300] if quick else long
    out = {"prompt_tokens": len(long), "budget": SERVING_CONFIGS["paged_chunked"]["token_budget"],
           "disaggregated": shipped_gaps(ours, worker, chat, long)}
    for name, budget in (("one_process_whole", None), ("one_process_chunked", out["budget"])):
        run = decode_gaps(ours, chat, long, budget, pool_blocks=200)
        out[name] = {k: run[k] for k in ("max_gap_s", "p99_gap_s", "median_gap_s")}
    return out


def disagg_figures(model, tokenizer, new_tokens: int = 16, short: bool = False, gaps: bool = True) -> dict:
    """short: a one-line question instead of the 1,127-token handbook prompt (the bench's --quick)."""
    from ..text.context import HANDBOOK_QUESTIONS, chat_ids, handbook_ids
    from ..engine.generation import generate
    from ..runner.blocks import blocks_for
    from ..runner.model import Model
    from ..serve import disagg
    ours = Model.from_transformers(model, dtype=torch.float32)
    prompt = chat_ids(tokenizer, HANDBOOK_QUESTIONS[0]) if short else handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])
    alone = generate(ours, tokenizer, prompt, new_tokens, stop_ids=()).token_ids
    worker = disagg.PrefillProcess().start()
    rows = {}
    try:
        for fmt in disagg.WIRE_FORMATS:
            header, payload, seconds = worker.ask(f"r-{fmt}", prompt, fmt)
            side = disagg.DecodeSide(ours, blocks_for(len(prompt) + new_tokens + 1))
            side.expect(header["request"], new_tokens)
            seq, allowance = side.accept(header, payload)
            tokens = side.decode(seq, header["first_token"], allowance)
            rows[fmt] = {"bytes": len(payload), "bytes_per_prompt_token": len(payload) / len(prompt),
                         "round_trip_s": seconds, "prefill_s": header["prefill_s"],
                         "wire_s": seconds - header["prefill_s"], "same_tokens": tokens == alone,
                         "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, alone)) if a != b), None)}
        gap_rows = gap_figures(model, tokenizer, worker, quick=short) if gaps else None
        trace_rows = trace_figures(model, tokenizer, worker, quick=short) if gaps else None
    finally:
        worker.stop()
    return {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "formats": rows, "decode_gaps": gap_rows,
            "trace": trace_rows}
