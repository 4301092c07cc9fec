"""Lesson 18's replicas behind sglang-router: the router is found or its absence explained, bad set-ups are refused,
the grouped trace is what it says, and a replica killed mid-trace loses no request."""
import pytest

from course_lib.measure.router import death_run, grouped_trace, policy_run
from course_lib.serve import replicas as rep


def test_a_missing_router_says_how_to_install_it(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name, *a))
    with pytest.raises(rep.RouterMissing, match=r"-m pip install sglang-router==0\.3\.2"):
        rep.router_command()


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        rep.Router([])
    with pytest.raises(ValueError, match="loopback"):
        rep.Router(["http://10.0.0.5:8000"])
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="whole number"):
            rep.start_replicas(n)
    for bad in (dict(groups=0), dict(per_group=2.5), dict(prefix_chars=-3), dict(rate=0)):
        with pytest.raises(ValueError):
            grouped_trace("t", **bad)


def test_the_grouped_trace_shares_prefixes_within_a_group_only():
    trace = grouped_trace("run1", groups=3, per_group=4, prefix_chars=300, seed=5)
    assert trace == grouped_trace("run1", groups=3, per_group=4, prefix_chars=300, seed=5)
    assert len(trace) == 12 and [t.at for t in trace] == sorted(t.at for t in trace)
    systems = {}
    for t in trace:
        systems.setdefault(t.kind, set()).add(t.messages[0]["content"])
    assert sorted(systems) == ["group0", "group1", "group2"] and all(len(v) == 1 for v in systems.values())
    firsts = [next(iter(v))[:14] for v in systems.values()]
    assert len(set(firsts)) == 3  # groups part within the first words, so within the first block
    other = grouped_trace("run2", groups=3, per_group=4, prefix_chars=300, seed=5)
    assert not {t.messages[0]["content"] for t in trace} & {t.messages[0]["content"] for t in other}


@pytest.mark.slow
def test_two_replicas_serve_through_the_router_and_a_death_loses_nothing():
    try:
        rep.router_command()
    except rep.RouterMissing as err:
        pytest.skip(str(err))
    replicas = rep.start_replicas(2, kv_blocks=200, max_tokens_cap=8)
    try:
        run = policy_run(replicas, "round_robin", grouped_trace("t", groups=2, per_group=2, prefix_chars=200, rate=4.0))
        assert run["finished"] == 4 and [r["requests"] for r in run["replicas"]] == [2, 2]  # in turn
        died = death_run(replicas, grouped_trace("d", groups=2, per_group=4, prefix_chars=200, rate=2.0), 1.0)
        assert not replicas[1].alive()
        assert died["lost"] == 0 and died["answered"] + len(died["errors"]) == died["requests"] == 8
        assert died["sent_after_kill"] > 0
    finally:
        for r in replicas:
            r.stop()
