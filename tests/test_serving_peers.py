"""The serving-peers protocol's pieces: llama-server's command line, readiness, the drive over a real course server
(the tiny model, the paged configuration the record runs), and the comparison that decides the target."""
import subprocess
import sys

import pytest

from course_lib.measure import serving_peers
from course_lib.measure.load import mixed_trace
from course_lib.serve.serving import free_port, start_server


def test_llama_server_command_gives_every_slot_a_context_and_stays_on_loopback():
    command = serving_peers.llama_server_command("llama-server", "m.gguf", 8080, 8, 2, flash=False)
    flags = {flag: command[i + 1] for i, flag in enumerate(command[:-1]) if flag.startswith("-")}
    assert flags["--host"] == "127.0.0.1" and flags["-np"] == "8" and flags["-t"] == flags["-tb"] == "2"
    assert int(flags["-c"]) == 8 * serving_peers.SLOT_CONTEXT and flags["-fa"] == "off"
    assert "--cont-batching" in command and "--jinja" in command
    with pytest.raises(ValueError, match="slots and threads"):
        serving_peers.llama_server_command("llama-server", "m.gguf", 8080, 0, 2)


def test_wait_ready_says_when_the_server_died():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        serving_peers.wait_ready(f"http://127.0.0.1:{free_port()}", proc, timeout=10)


def test_drive_replays_a_trace_against_the_course_configuration_it_records(tiny, tokenizer):
    options = serving_peers.COURSE_CONFIGS["course paged chunked"]
    handle = start_server(tiny, tokenizer, free_port(), max_tokens_cap=8, max_concurrent=8, **options)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert serving_peers.wait_ready(handle.url, proc, timeout=30) < 30
        finally:
            proc.kill()
        trace = mixed_trace(4.0, 3, seed=1, max_tokens=4, shares=(1.0, 0.0, 0.0))
        (run,) = serving_peers.drive(handle.url, {4.0: trace}, timeout=120)
    finally:
        handle.stop()
    assert run["rate"] == 4.0 and run["finished"] == 3 and not run["errors"]
    assert run["usage_tokens"] == 12 and len(run["texts"]) == 3 and run["pieces"] >= 3


def _run(rate, goodput, p99, tps=10.0):
    return {"rate": rate, "goodput_rps": goodput, "itl_p99_s": p99, "tokens_per_s": tps}


def test_compare_judges_each_course_configuration_against_llamas_best_on_goodput_and_gaps():
    runs = {"course compiled": [_run(0.5, 0.4, 0.10), _run(1.0, 0.5, 0.30)],
            "course paged chunked": [_run(0.5, 0.45, 0.12), _run(1.0, 0.2, 0.20)],
            "llama-server 4 slots": [_run(0.5, 0.45, 0.15), _run(1.0, 0.6, 0.10)],
            "llama-server 8 slots": [_run(0.5, 0.40, 0.05), _run(1.0, 0.3, 0.05)]}
    rows = serving_peers.compare(runs)
    verdicts = {(r["rate"], r["course"]): (r["llama"], r["met"]) for r in rows}
    assert len(rows) == 4 and all(llama == "llama-server 4 slots" for llama, _ in verdicts.values())
    assert verdicts[0.5, "course paged chunked"][1] and not verdicts[0.5, "course compiled"][1]  # goodput 0.4
    assert not verdicts[1.0, "course compiled"][1] and not verdicts[1.0, "course paged chunked"][1]
    runs["course compiled"][1] = _run(1.0, 0.6, 0.11)
    assert not serving_peers.compare(runs)[2]["met"]  # goodput matched, p99 gap 10 ms worse: missed
    runs["course compiled"][1] = _run(1.0, 0.6, 0.10)
    assert serving_peers.compare(runs)[2]["met"]  # both matched: met
    with pytest.raises(ValueError, match="llama-server"):
        serving_peers.compare({"course compiled": runs["course compiled"]})


def test_describe_names_each_course_configurations_decode_step_when_the_record_has_them():
    runs = {"course compiled": [_run(0.5, 0.4, 0.10)], "llama-server 4 slots": [_run(0.5, 0.45, 0.15)]}
    for run in (*runs["course compiled"], *runs["llama-server 4 slots"]):
        run.update(ttft_p50_s=0.1, ttft_p99_s=0.2, itl_p50_s=0.01, max_gap_s=0.5, finished=1, requests=1)
    record = {"requests_per_rate": 1, "max_tokens": 4, "threads": 1, "ttft_target_s": 10.0, "gap_target_s": 1.0,
              "runs": runs, "comparison": serving_peers.compare(runs)}
    assert not any("decode steps" in line for line in serving_peers.describe(record))  # older records: no line
    lines = serving_peers.describe({**record, "course_steps": {"course compiled": "fused"}})
    assert lines[1] == ("  the course's decode steps: course compiled fused; its engine loop in the server's "
                        "background thread")
    lines = serving_peers.describe({**record, "course_steps": {"course compiled": "fused"},
                                    "course_engine_loop": "main thread"})
    assert lines[1].endswith("its engine loop in the server's main thread")  # records since run_here say where it ran
    assert lines[-1].endswith("target missed")  # goodput 0.4 < 0.45


def test_serving_records_orders_sittings_by_their_end_and_leaves_other_files_out(tmp_path):
    import json
    for name, when in (("serving-peers-cpu-2026-12-07.json", "2026-12-07T09:00:00+00:00"),
                       ("serving-peers-cpu-2026-12-07-1130.json", "2026-12-07T11:30:00+00:00"),
                       ("serving-peers-cpu-2026-12-05.json", "2026-12-05T12:30:00+00:00"),
                       ("serving-peers-cpu-2026-12-08-Q4_0.json", "2026-12-08T10:00:00+00:00")):
        (tmp_path / name).write_text(json.dumps({"when": when}))
    names = [p.name for p in serving_peers.serving_records(tmp_path)]
    assert names == ["serving-peers-cpu-2026-12-05.json", "serving-peers-cpu-2026-12-07.json",
                     "serving-peers-cpu-2026-12-07-1130.json"]  # by name the 11:30 sitting would sort first
    others = serving_peers.serving_records(tmp_path, other_files=True)
    assert [p.name for p in others] == ["serving-peers-cpu-2026-12-08-Q4_0.json"]
