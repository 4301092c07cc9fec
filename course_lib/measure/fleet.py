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
What it does not do: measure the decode side's gaps under a load (not built yet).
"""
from __future__ import annotations

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
    return [(f"fleet.router {policy}: every request of the trace answered, none lost",
             f"{run['finished']} of {run['requests']} finished, errors {run['errors'][:2]}",
             run["finished"] == run["requests"] and not run["errors"])
            for policy, run in router["policies"].items()]


def _targets(result: dict) -> list:
    t, d = result["fleet"]["tp"], result["fleet"]["disagg"]["formats"]["float32"]
    return _router_rows(result["fleet"]["router"]) + [(f"fleet.tp: {t['world']} processes give one process's logits (within 1e-3) and tokens",
             f"max |difference| {t['max_logit_difference']:.2e}, same tokens {t['same_tokens']}",
             t["max_logit_difference"] < 1e-3 and t["same_tokens"]),
            ("fleet.disagg: blocks shipped in float32 continue with one process's tokens", str(d["same_tokens"]),
             d["same_tokens"])]


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
        for fmt, row in result["fleet"]["disagg"]["formats"].items()]


SECTION = Section("fleet", "lesson 18: replicas behind a router, prefill and decode apart, the model split over processes",
                  lambda m, t, q: {"fleet": {"router": router_figures(q), "tp": tp_figures(m, t, 4 if q else 32),
                                             "disagg": disagg_figures(m, t, 4 if q else 16, short=q)}}, _targets, _report)


def disagg_figures(model, tokenizer, new_tokens: int = 16, short: bool = False) -> dict:
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
    finally:
        worker.stop()
    return {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "formats": rows}
