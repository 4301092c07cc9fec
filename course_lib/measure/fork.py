"""Several answers to one prompt (lesson 13's copy-on-write fork put to use): the memory it saves and what voting
over the answers buys; the bench sections `serving` (key n_fork) and `best_of` (key accuracy).

What it does: `n_fork` serves n sampled answers to one long prompt through the paged scheduler twice, the n jobs
forking the first one's blocks and as n separate requests (no prefix cache, so nothing else shares), and counts the
blocks each run held at its peak, the prompt tokens it read and its seconds, with the bound the fork must meet
(the prompt's full blocks once, then each answer's own blocks, its copy of the prompt's partial last block
included). `sums` is a task with answers a program can check (additions of two small numbers, asked in words),
`said_number` reads the number an answer gives, and `self_consistency` samples N answers per question (forked), votes, and
scores the vote against N and against the tokens it cost, greedy beside it.
What it does not do: serve over HTTP (serving.py's chat route makes the same jobs: serve.serving.chat_jobs) or
judge anything but a number.
"""
from __future__ import annotations

import collections
import random
import re
import time

import torch

from ..runner.blocks import blocks_for
from .section import Section

FORK_NS = (1, 4, 8)
VOTE_NS = (1, 2, 4, 8)


def sampled_jobs(prompt: list[int], n: int, new_tokens: int, stop_ids, temperature: float, fork: bool,
                 name: str = "a", first_seed: int = 0) -> list:
    """n Jobs for one prompt, answer i sampled with seed first_seed + i; with `fork`, answers 1..n-1 fork answer
    0's blocks."""
    from ..engine.request import Job
    from ..engine.sampling import SamplingConfig, make_sampler
    config = SamplingConfig(temperature=temperature)
    jobs = [Job(f"{name}{i}", list(prompt), new_tokens, stop_ids, pick=make_sampler(config, seed=first_seed + i))
            for i in range(n)]
    for job in jobs[1:]:
        job.fork_of = jobs[0].name if fork else ""
    return jobs


def n_fork(model, tokenizer, ns=FORK_NS, new_tokens: int = 32, temperature: float = 1.0) -> dict:
    """For each n: peak blocks, prompt tokens read and seconds with the fork and without, the fork's bound, and
    whether both runs gave every answer the same tokens. The prompt: lesson 13's handbook question (one long
    shared document)."""
    from ..text.context import HANDBOOK_QUESTIONS, handbook_ids
    from ..engine.generation import run_paged
    from ..engine.request import end_of_turn_ids
    from ..runner.paged import BlockPool
    prompt = handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])
    stop = frozenset(end_of_turn_ids(model, tokenizer))
    size = 16
    out = {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "block_size": size, "ns": list(ns), "rows": {}}
    for n in ns:
        row, answers = {"n": n}, {}
        for fork in (True, False):
            pool = BlockPool.for_model(model, n * blocks_for(len(prompt) + new_tokens + 1, size), size,
                                       prefix_caching=False)
            jobs = sampled_jobs(prompt, n, new_tokens, stop, temperature, fork)
            start = time.perf_counter()
            batch = run_paged(model, jobs, pool, max_batch=max(8, n))
            key = "fork" if fork else "separate"
            row[f"{key}_seconds"] = time.perf_counter() - start
            row[f"{key}_peak_blocks"] = max(used for _, used, _ in batch.memory)
            row[f"{key}_prompt_tokens_read"] = len(prompt) * (n - batch.forked)
            answers[key] = [j.tokens for j in jobs]
            if fork:
                row["answer_tokens"] = [len(j.tokens) for j in jobs]
        full, partial = len(prompt) // size, len(prompt) % size
        # note: each answer's own blocks: its copy of the prompt's partial last block and what its tokens fill
        row["fork_bound_blocks"] = full + sum(blocks_for(partial + t, size) for t in row["answer_tokens"])
        row["prompt_blocks"] = blocks_for(len(prompt), size)
        row["fork_blocks_per_answer"] = row["fork_peak_blocks"] / n
        row["separate_blocks_per_answer"] = row["separate_peak_blocks"] / n
        row["same_answers"] = answers["fork"] == answers["separate"]
        out["rows"][str(n)] = row
    return out


def sums(count: int, seed: int = 0, low: int = 2, high: int = 9) -> list[tuple[str, int]]:
    """`count` questions "What is a + b?" with a and b drawn in [low, high] (seeded), each with its answer."""
    draw = random.Random(seed)
    pairs = [(draw.randint(low, high), draw.randint(low, high)) for _ in range(count)]
    return [(f"What is {a} + {b}?", a + b) for a, b in pairs]


def said_number(text: str) -> int | None:
    """The number an answer gives: the first one after "=" or "equals" (the model writes its working first:
    "To add 7 and 5: 7 + 5 = 12, ..." -> 12), else its last number, else None."""
    given = re.search(r"(?:=|\bequals)\s*(-?\d+)", text)
    if given:
        return int(given.group(1))
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def vote(numbers: list) -> int | None:
    """The most common number (the earliest of a tie), None if no answer had one."""
    counts = collections.Counter(x for x in numbers if x is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(x for x in numbers if x is not None and counts[x] == best)


def self_consistency(model, tokenizer, questions: list[tuple[str, int]], ns=VOTE_NS, new_tokens: int = 40,
                     temperature: float = 0.7) -> dict:
    """Greedy, then max(ns) sampled answers per question (forked from one prompt read), and the vote of the first
    N for each N: accuracy against N and the answer tokens each N cost per question. Question q's answers use seeds
    1000 q + i: the same seeds for every question would draw the same random numbers for each (answer 1 would
    then run long on every question, measured)."""
    from ..text.context import chat_ids
    from ..engine.generation import run_paged
    from ..engine.request import Job, end_of_turn_ids
    from ..runner.paged import BlockPool
    stop = frozenset(end_of_turn_ids(model, tokenizer))
    top = max(ns)
    right = collections.Counter()
    greedy_right = greedy_tokens = 0
    tokens = collections.Counter()
    per_question = []
    for q, (question, answer) in enumerate(questions):
        prompt = chat_ids(tokenizer, question)
        pool = BlockPool.for_model(model, (top + 1) * blocks_for(len(prompt) + new_tokens + 1))
        greedy = Job(f"g{q}", list(prompt), new_tokens, stop)
        jobs = sampled_jobs(prompt, top, new_tokens, stop, temperature, fork=True, name=f"s{q}-", first_seed=1000 * q)
        run_paged(model, [greedy] + jobs, pool, max_batch=top + 1)
        said = [said_number(tokenizer.decode(j.tokens, skip_special_tokens=True)) for j in jobs]
        greedy_said = said_number(tokenizer.decode(greedy.tokens, skip_special_tokens=True))
        greedy_right += greedy_said == answer
        greedy_tokens += len(greedy.tokens)
        for n in ns:
            right[n] += vote(said[:n]) == answer
            tokens[n] += sum(len(j.tokens) for j in jobs[:n])
        per_question.append({"question": question, "answer": answer, "greedy": greedy_said, "sampled": said})
    k = len(questions)
    return {"questions": k, "temperature": temperature, "new_tokens": new_tokens, "ns": list(ns),
            "accuracy": {str(n): right[n] / k for n in ns}, "answer_tokens_per_question": {str(n): tokens[n] / k for n in ns},
            "greedy_accuracy": greedy_right / k, "greedy_tokens_per_question": greedy_tokens / k,
            "per_question": per_question}


def _ours(model):
    from ..runner.model import Model
    return Model.from_transformers(model, dtype=torch.float32)  # note: a float32 copy; the caller's model is untouched


def _serving_targets(result: dict) -> list:
    out = []
    for n, row in result["serving"]["n_fork"]["rows"].items():
        if int(n) > 1:
            out.append((f"serving.n_fork: n = {n} forked holds at most the prompt's full blocks once plus each "
                        "answer's own", f"{row['fork_peak_blocks']} blocks (bound {row['fork_bound_blocks']}, separate "
                        f"{row['separate_peak_blocks']})", row["fork_peak_blocks"] <= row["fork_bound_blocks"]))
    return out


def _serving_report(result: dict) -> list:
    f = result["serving"]["n_fork"]
    lines = [f"n answers to one {f['prompt_tokens']}-token prompt, {f['new_tokens']} tokens each (blocks of "
             f"{f['block_size']}):"]
    for n, row in f["rows"].items():
        lines.append(f"  n = {n}: forked {row['fork_peak_blocks']} blocks at peak ({row['fork_blocks_per_answer']:.1f} "
                     f"per answer), {row['fork_prompt_tokens_read']} prompt tokens read, {row['fork_seconds']:.1f} s; "
                     f"separate {row['separate_peak_blocks']} blocks ({row['separate_blocks_per_answer']:.1f} per "
                     f"answer), {row['separate_prompt_tokens_read']} read, {row['separate_seconds']:.1f} s; same "
                     f"answers: {row['same_answers']}")
    return lines


def _best_of_report(result: dict) -> list:
    b = result["best_of"]
    votes = ", ".join(f"N={n} {b['accuracy'][str(n)]:.0%} ({b['answer_tokens_per_question'][str(n)]:.0f} tokens)"
                      for n in b["ns"])
    return [f"best_of: {b['questions']} sums, greedy {b['greedy_accuracy']:.0%}; majority vote of N samples at "
            f"temperature {b['temperature']}: {votes}"]


SERVING = Section("serving", "n > 1: answers forked from one prompt against separate requests",
                  lambda m, t, q: {"serving": {"n_fork": n_fork(_ours(m), t, (1, 4) if q else FORK_NS,
                                                                 8 if q else 32)}},
                  _serving_targets, _serving_report)
BEST_OF = Section("best_of", "self-consistency: the vote of N sampled answers on checkable sums",
                  lambda m, t, q: {"best_of": self_consistency(_ours(m), t, sums(2 if q else 40), (1, 2) if q else VOTE_NS,
                                                               8 if q else 40)},
                  report=_best_of_report)
