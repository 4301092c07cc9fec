"""Self-checking exercises: each check runs the learner's answer against the real model and says
right or wrong, with a hint. One module per lesson (lesson00.py, ...); every check returns a bool
(so tests can show it accepts a right answer and rejects a wrong one) and prints its verdict.
"""
from __future__ import annotations


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


def check_prediction(prediction, measure, *, unit: str, what: str, tolerance: float, hint: str) -> Verdict:
    """Predict, then measure: `prediction` was written before the cell ran; `measure()` measures the quantity now
    (on the real model, in this run) and the prediction passes within a factor `tolerance` of it. The measured
    value is shown either way: once the learner has committed to a number, seeing the answer is the point."""
    if not isinstance(prediction, (int, float)) or isinstance(prediction, bool) or not prediction > 0:
        return verdict(False, "", f"write your prediction first: a positive number ({unit}), before running the cell")
    measured = float(measure())
    ok = measured / tolerance <= prediction <= measured * tolerance
    said = f"measured {measured:,.3g} {unit} {what}; you predicted {prediction:,.3g}"
    return verdict(ok, f"{said}, within a factor {tolerance}",
                   f"{said}, off by more than a factor {tolerance} ({prediction / measured:.2g}x). {hint}")


def off(got, want) -> str:
    """How a wrong number is wrong, without the right one: 'too large', 'too small', or what it is instead."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"which is a {type(got).__name__}, not a number"
    return "too large" if got > want else "too small" if got < want else "equal in value but of the wrong type"
