"""Checks for 09_batching: left padding by hand, padding waste, and reading a schedule's latency."""
from __future__ import annotations

import torch

from ..batching import Job, left_pad, padding_waste
from . import safely, verdict

CASES = [[[5, 6, 7], [8]], [[1], [2, 3], [4, 5, 6, 7]], [[9, 9]]]


def check_left_pad(my_left_pad) -> bool:
    """my_left_pad(sequences, pad_id) -> (input_ids (B, T), attention_mask (B, T)) padded on the LEFT."""
    for seqs in CASES:
        ok, got = safely(my_left_pad, [list(s) for s in seqs], 0)
        if not ok:
            return verdict(False, "", got)
        want = left_pad(seqs, 0)
        if (not isinstance(got, tuple) or len(got) != 2 or not all(torch.is_tensor(t) for t in got)
                or not torch.equal(got[0].long(), want.input_ids) or not torch.equal(got[1].long(), want.attention_mask)):
            return verdict(False, "", f"for {seqs} expected ids {want.input_ids.tolist()} and mask "
                           f"{want.attention_mask.tolist()}. Hint: the padding goes BEFORE each sequence")
    return verdict(True, "every row now ends in the last column, where the next token is read", "")


def check_waste(waste_fraction) -> bool:
    """waste_fraction(lengths) -> share of a padded batch's slots that are padding."""
    for lengths in [[2, 5], [10, 10, 10], [1, 100], [7]]:
        ok, got = safely(waste_fraction, list(lengths))
        if not ok:
            return verdict(False, "", got)
        pad, total = padding_waste(lengths)
        if not isinstance(got, (int, float)) or abs(got - pad / total) > 1e-9:
            return verdict(False, "", f"for {lengths} you returned {got!r}, expected {pad / total:.4f}")
    return verdict(True, "one long prompt in a batch of short ones wastes most of the batch", "")


def check_mean_latency(mean_latency) -> bool:
    """mean_latency(jobs) -> average of job.end - 0 over the jobs (all were queued at time 0)."""
    jobs = [Job("a", [1], 3, end=1.5), Job("b", [1], 3, end=2.5), Job("c", [1], 3, end=5.0)]
    ok, got = safely(mean_latency, jobs)
    if not ok:
        return verdict(False, "", got)
    return verdict(isinstance(got, (int, float)) and abs(got - 3.0) < 1e-9, "latency is measured from arrival to the last token",
                   f"expected 3.0 for ends 1.5, 2.5, 5.0; got {got!r}")
