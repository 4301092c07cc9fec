"""The paired protocol against llama.cpp (measure/peers_protocol.py): its statistics, its order of trials, its
record of the machine, and a sitting driven by stand-in trials (llama.cpp itself is a scratch install, never CI's)."""
import json
import sys

import pytest

from course_lib.measure import peers_protocol as pp


def test_paired_summary_reads_each_pair_and_bounds_the_median():
    out = pp.paired_summary([60.0, 66.0, 50.0, 70.0], [100.0, 110.0, 100.0, 70.0])
    assert out["ratios"] == pytest.approx([0.6, 0.6, 0.5, 1.0])
    assert out["median"] == pytest.approx(0.6) and out["min"] == 0.5 and out["max"] == 1.0 and out["pairs"] == 4
    lo, hi = out["ci95"]
    assert 0.5 <= lo <= out["median"] <= hi <= 1.0


def test_paired_summary_refuses_unpaired_figures():
    with pytest.raises(ValueError, match="same positive number"):
        pp.paired_summary([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same positive number"):
        pp.paired_summary([], [])


def test_bootstrap_interval_is_seeded_and_collapses_on_equal_values():
    assert pp.bootstrap_median_ci([0.8] * 10) == (0.8, 0.8)
    values = [0.5, 0.7, 0.9, 1.1, 0.6, 0.8]
    assert pp.bootstrap_median_ci(values, seed=3) == pp.bootstrap_median_ci(values, seed=3)
    lo, hi = pp.bootstrap_median_ci(values, resamples=2000)
    assert min(values) <= lo < hi <= max(values)


def test_each_side_goes_first_in_turn():
    sides = ("course", "llama", "llama flash")
    orders = [pp.pair_order(i, sides) for i in range(3)]
    assert [order[0] for order in orders] == list(sides)
    assert all(sorted(order) == sorted(sides) for order in orders)


def test_steal_fraction_from_two_readings():
    before = {"ticks": {"user": 100, "idle": 100, "steal": 0}}
    after = {"ticks": {"user": 180, "idle": 100, "steal": 20}}
    assert pp.steal_fraction(before, after) == pytest.approx(0.2)
    assert pp.steal_fraction({}, after) is None


def test_machine_state_reads_linux():
    state = pp.machine_state()
    if sys.platform != "linux":
        pytest.skip("reads /proc")
    assert len(state["loadavg"]) == 3 and "steal" in state["ticks"] and state["time"] > 0


def test_cores_pins_the_first_ones_and_refuses_too_many():
    assert len(pp.cores(1).split(",")) == 1
    with pytest.raises(ValueError, match="threads must be"):
        pp.cores(0)
    with pytest.raises(ValueError, match="threads must be"):
        pp.cores(10_000)


def test_trial_commands_match_the_file_format():
    assert pp.course_format("Q8_0") == "int8" and pp.course_format("Q4_0") == "int4"
    assert pp.course_format("Q4_1", "int4-q8") == "int4-q8" and pp.course_format("Q8_0", "int4-q8") == "int8"
    with pytest.raises(ValueError, match="int4-q8"):
        pp.course_format("Q4_0", "int3")
    commands = pp.trial_commands("m.gguf", 2, 1024, "ids.json", "/py", fmt="int8")
    assert commands["course int8 compiled"][-4:] == ["--fmt", "int8", "--step", "compiled"]
    fused = pp.trial_commands("m.gguf", 1, 1024, "ids.json", "/py", fmt="int4-q8", step="fused")
    assert fused["course int4-q8 fused"][-2:] == ["--step", "fused"]
    with pytest.raises(ValueError, match="fused"):
        pp.course_step(None, 64, "graph")
    assert pp.step_for("int4-q8", "fused") == "fused" and pp.step_for("int8", "fused") == "compiled"
    assert commands["llama.cpp"][-4:] == ["m.gguf", "2", "1024", "0"] and commands["llama.cpp flash"][-1] == "1"


def test_step_for_gives_int4_the_fused_step_only_where_the_cpu_runs_its_bfloat16_products(monkeypatch):
    from course_lib.runner import q4_kernel
    here = "compiled" if q4_kernel.why_not_bf16() else "fused"
    assert pp.step_for("int4", "fused") == here and pp.step_for("int4", "compiled") == "compiled"
    flags = q4_kernel.cpu_flags() - {"avx512_bf16"}  # a CPU without BF16 (an Ice Lake): torch.compile's step
    monkeypatch.setattr(q4_kernel, "cpu_flags", lambda: flags)
    assert pp.step_for("int4", "fused") == "compiled" and pp.step_for("int4-q8", "fused") == "fused"


@pytest.mark.skipif(sys.platform != "linux", reason="taskset is Linux's")
def test_run_child_pins_a_fresh_process_and_says_why_it_failed():
    out = pp.run_child([sys.executable, "-c", "import json, os; print('noise'); print(json.dumps(sorted(os.sched_getaffinity(0))))"], 1)
    assert len(out) == 1
    with pytest.raises(RuntimeError, match="boom"):
        pp.run_child([sys.executable, "-c", "raise SystemExit('boom')"], 1)


def test_a_sitting_pairs_the_trials_and_counts_the_faster_llama():
    calls = []

    def run(command, threads):
        side = ("course" if "trial" in command else "flash" if command[-1] == "1" else "plain")
        calls.append(side)
        rate = {"course": 60.0, "plain": 80.0, "flash": 100.0}[side] + len(calls) % 3
        return {"tokens": [1, 2, 3], "tokens_per_s": rate, "loop_tokens_per_s": rate, "compile_s": 1.0}

    saved = []
    record = pp.sitting({"Q4_1": "a.gguf", "Q8_0": "b.gguf"}, threads=(1,), pairs=4, ids_file="ids.json", run=run,
                        progress=lambda line: None, save=lambda r: saved.append(len(r["cells"])))
    assert saved == [1, 2] and len(calls) == 2 * 4 * 3
    assert calls[:3] == ["course", "plain", "flash"] and calls[3:6] == ["plain", "flash", "course"]
    cell = record["cells"][0]
    assert cell["llama_counted"] == "llama.cpp flash" and set(cell["rates"]) == {
        "course int4 compiled", "llama.cpp", "llama.cpp flash"}
    assert 0.55 < cell["paired_ratio"]["median"] < 0.65 and cell["paired_ratio"]["pairs"] == 4
    assert all(cell["same_tokens"]) and "course int8 compiled" in record["cells"][1]["rates"]
    record["quality"] = {"Q4_1": {"course_compiled": {"perplexity": 18.2, "kl_to_float32": 0.01, "tokens": 1024},
                                  "llama.cpp": {"perplexity": 18.0}}}
    text = "\n".join(pp.describe(json.loads(json.dumps(record))))
    assert "Q4_1 1 thread(s)" in text and "llama.cpp flash" in text and "+1.1%" in text
    assert text.count("llama.cpp faster") == 2  # every ratio near 0.6: both intervals below 1
    assert [pp.verdict(ci) for ci in ((1.01, 1.2), (0.8, 0.99), (0.9, 1.1), (1.0, 1.1))] == [
        "the course faster", "llama.cpp faster", "settles nothing", "settles nothing"]


def test_llama_bench_lines_sort_each_files_rows_and_name_flash_attention():
    rows = [{"n_threads": 2, "n_depth": 0, "flash_attn": True, "avg_ts": 110.04, "stddev_ts": 2.0},
            {"n_threads": 1, "n_depth": 1024, "flash_attn": False, "avg_ts": 60.0, "stddev_ts": 1.5},
            {"n_threads": 1, "n_depth": 0, "flash_attn": True, "avg_ts": 70.0, "stddev_ts": 0.5}]
    lines = pp.describe_llama_bench({"flags": ["-t", "1,2", "-o", "json"], "rows": {"Q4_0": rows}})
    assert lines[0].startswith("llama-bench (-t 1,2)")
    assert [line.split(":")[1].split("+-")[0].strip() for line in lines[1:]] == ["70.0", "60.0", "110.0"]
    assert "flash attention on " in lines[1] and "flash attention off" in lines[2] and "depth 1024" in lines[2]


def test_paired_records_come_oldest_first_by_when_they_ended(tmp_path):
    import json
    for name, when in (("peers-paired-cpu-2026-12-06-2353.json", "2026-12-06T23:27:09+00:00"),
                       ("peers-paired-cpu-2026-12-06.json", "2026-12-06T16:02:00+00:00"),
                       ("peers-paired-cpu-2026-12-05.json", "2026-12-05T10:00:00+00:00"),
                       ("peers-paired-cpu-2026-12-05-context2048.json", "2026-12-05T11:00:00+00:00")):
        (tmp_path / name).write_text(json.dumps({"when": when}))
    # by name, the second sitting of the sixth would sort before the first ('-' before '.'); the context one is apart
    assert [p.name for p in pp.paired_records(tmp_path)] == [
        "peers-paired-cpu-2026-12-05.json", "peers-paired-cpu-2026-12-06.json", "peers-paired-cpu-2026-12-06-2353.json"]
