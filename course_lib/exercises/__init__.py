"""Self-checking exercises: each check runs the learner's answer against the real model and says
right or wrong, with a hint. One module per lesson (lesson00.py, ...); every check returns a bool
(so tests can show it accepts a right answer and rejects a wrong one) and prints its verdict.
"""
from __future__ import annotations

from ..runtime import median


class Verdict(int):
    """A check's result: true or false like a bool (tests assert it), but shown as nothing when it ends a notebook
    cell, so the printed verdict line is not followed by a bare `False`."""

    def __repr__(self) -> str:
        return repr(bool(self))

    def _ipython_display_(self) -> None:
        pass


def verdict(ok: bool, success: str, hint: str) -> Verdict:
    """Print a one-line verdict for the learner and return ok."""
    print(("✅ Correct: " + success) if ok else ("❌ Not yet: " + hint))
    return Verdict(bool(ok))


def safely(fn, *args):
    """Call the learner's function; an exception becomes (False, message) instead of a traceback."""
    try:
        return True, fn(*args)
    except NotImplementedError:
        return False, "the function still raises NotImplementedError: replace `...` with your code"
    except Exception as err:  # noqa: BLE001 - a learner's bug becomes a hint
        return False, f"your function raised {type(err).__name__}: {err}"


def fresh():
    """A random generator for a check's cases, seeded anew at every call: each run asks new questions, so an
    answer copied from an earlier run, or a value the notebook printed, does not pass. Failure messages show the
    case and the learner's answer, never the expected value."""
    import os
    import random
    return random.Random(os.urandom(8))


def check_prediction(prediction, measure, *, unit: str, what: str, tolerance: float, hint: str,
                     timed: bool = False) -> Verdict:
    """Predict, then measure: `prediction` was written before the cell ran; `measure()` measures the quantity now
    (on the real model, in this run) and the prediction passes within a factor `tolerance` of it. The measured
    value is shown either way: once the learner has committed to a number, seeing the answer is the point.

    timed=True is for a time (or a share of one) on a machine that other work shares: when the first measurement
    misses the prediction by no more than tolerance squared, one slow or fast run may be the cause, so the check
    measures twice more and judges the median of the three (all three are shown). A miss by more than that is
    not noise, and is said at once: that keeps a wrong guess as cheap to check as a right one."""
    if not isinstance(prediction, (int, float)) or isinstance(prediction, bool) or not prediction > 0:
        return verdict(False, "", f"write your prediction first: a positive number ({unit}), before running the cell")
    measured = float(measure())
    runs = [measured]
    if timed and not _within(prediction, measured, tolerance) and _within(prediction, measured, tolerance ** 2):
        runs += [float(measure()), float(measure())]
        measured = median(runs)
    ok = _within(prediction, measured, tolerance)
    shown = f"{measured:,.3g}" if len(runs) == 1 else \
        f"{measured:,.3g} (the median of {', '.join(f'{r:,.3g}' for r in runs)}: the first missed, so it measured again)"
    said = f"measured {shown} {unit} {what}; you predicted {prediction:,.3g}"
    return verdict(ok, f"{said}, within a factor {tolerance}",
                   f"{said}, off by more than a factor {tolerance} ({prediction / measured:.2g}x). {hint}")


def _within(prediction: float, measured: float, tolerance: float) -> bool:
    return measured / tolerance <= prediction <= measured * tolerance


def off(got, want) -> str:
    """How a wrong number is wrong, without the right one: 'too large', 'too small', or what it is instead."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"which is a {type(got).__name__}, not a number"
    return "too large" if got > want else "too small" if got < want else "equal in value but of the wrong type"
