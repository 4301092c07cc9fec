"""One benchmark section: what it measures, the targets it checks and the lines it prints, kept together.

What it does: `Section` names a section of `python -m course_lib bench` (its JSON key), its label, the function
that measures it (model, tokenizer, quick) -> {JSON key: value}, and, reading the whole result, its targets
((what, measured, met) rows) and its report lines. Each measure module declares its own; bench.py runs them.
What it does not do: measure anything itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _none(result: dict) -> list:
    return []


@dataclass(frozen=True)
class Section:
    name: str  # the section's name for --only (and, mostly, its JSON key)
    label: str  # what it measures, for the progress bar
    run: Callable[..., dict]  # (model, tokenizer, quick) -> {JSON key: value}, merged into the result
    targets: Callable[[dict], list] = _none  # result -> [(what, measured, met)] for this section's targets
    report: Callable[[dict], list] = _none  # result -> lines of the printed report
