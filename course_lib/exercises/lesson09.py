"""Checks for 09_batching: left padding by hand, padding waste, and reading a schedule's latency, and
a batch's throughput predicted before it is measured."""
from __future__ import annotations

import torch

from ..engine.request import Job
from ..engine.schedulers import left_pad, padding_waste
from ..measure.speed import throughput_latency
from . import check_prediction, fresh, safely, verdict

CASES = [[[5, 6, 7], [8]], [[1], [2, 3], [4, 5, 6, 7]], [[9, 9]]]


def check_left_pad(my_left_pad) -> bool:
    """my_left_pad(sequences, pad_id) -> (input_ids (B, T), attention_mask (B, T)) padded on the LEFT."""
    rng = fresh()
    randoms = [[[rng.randint(3, 999) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(2, 5))] for _ in range(3)]
    for seqs in CASES + randoms:
        ok, got = safely(my_left_pad, [list(s) for s in seqs], 0)
        if not ok:
            return verdict(False, "", got)
        want = left_pad(seqs, 0)
        if (not isinstance(got, tuple) or len(got) != 2 or not all(torch.is_tensor(t) for t in got)
                or not torch.equal(got[0].long(), want.input_ids) or not torch.equal(got[1].long(), want.attention_mask)):
            return verdict(False, "", f"for {seqs} your ids or mask are not the left-padded batch. Hint: the padding "
                           "goes BEFORE each sequence, and the mask is 0 exactly where the padding is")
    return verdict(True, "every row now ends in the last column, where the next token is read", "")


def check_waste(waste_fraction) -> bool:
    """waste_fraction(lengths) -> share of a padded batch's slots that are padding."""
    rng = fresh()
    for lengths in [[2, 5], [10, 10, 10], [1, 100], [7]] + [[rng.randint(1, 200) for _ in range(rng.randint(2, 6))]
                                                            for _ in range(3)]:
        ok, got = safely(waste_fraction, list(lengths))
        if not ok:
            return verdict(False, "", got)
        pad, total = padding_waste(lengths)
        if not isinstance(got, (int, float)) or abs(got - pad / total) > 1e-9:
            return verdict(False, "", f"for {lengths} you returned {got!r}. Hint: padding slots over all slots of a "
                           "batch padded to the longest prompt")
    return verdict(True, "one long prompt in a batch of short ones wastes most of the batch", "")


def check_mean_latency(mean_latency) -> bool:
    """mean_latency(jobs) -> average of job.end - 0 over the jobs (all were queued at time 0). Random job sets."""
    rng = fresh()
    for _ in range(3):
        ends = [round(rng.uniform(0.1, 9.9), 2) for _ in range(rng.randint(2, 6))]
        jobs = [Job(f"r{i}", [1], 3, end=e) for i, e in enumerate(ends)]
        ok, got = safely(mean_latency, jobs)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, (int, float)) or abs(got - sum(ends) / len(ends)) > 1e-9:
            return verdict(False, "", f"for jobs ending at {ends} you returned {got!r}. Hint: each job's latency runs "
                           "from its arrival (time 0 here) to its end; average them")
    return verdict(True, "latency is measured from arrival to the last token", "")


def check_batch_prediction(prediction_tps, model, prompt_ids: list[int], batch: int = 12, new_tokens: int = 32,
                           tolerance: float = 1.5) -> bool:
    """prediction_tps: your prediction, written BEFORE this runs, of the total tokens per second of a batch of
    `batch` copies of the prompt, new_tokens each, as in section 2 (which measured other batch sizes)."""
    return check_prediction(prediction_tps,
                            lambda: throughput_latency(model, list(prompt_ids), [batch], new_tokens)[0]["tokens_per_s"],
                            unit="tokens/s", what=f"at batch {batch}", tolerance=tolerance,
                            timed=True, hint="Read the printed rows on both sides of that batch size: once arithmetic is the "
                                 "limit, throughput stops growing in proportion to the batch")
