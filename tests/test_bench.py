"""The benchmark command runs end to end (quick sizes) and reports every target; it asserts no timing."""
import json
import subprocess
import sys

from course_lib.bench import format_report, run, targets


def test_quick_benchmark_reports_every_target(model, tokenizer):
    result = run(model, tokenizer, quick=True, progress=lambda _: None)
    assert result["loop_vs_generate"]["same_tokens"]
    assert all(r["same_tokens"] for r in result["cache"])
    names = [what for what, _, _ in targets(result)]
    assert len(names) == 5 and any("model.generate" in n for n in names) and any("5x" in n for n in names)
    report = format_report(result)
    assert "utilisation" in report and "met" in report


def test_bench_command_writes_json_and_png(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "course_lib", "bench", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={"COURSE_DEVICE": "cpu", "PATH": "/usr/bin:/bin",
                                                                              "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".json", ".png"]
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["machine"]["device"] == "cpu" and data["quick"] is True


def test_committed_benchmarks_are_readable():
    from pathlib import Path
    for path in (Path(__file__).resolve().parents[1] / "data" / "benchmarks").glob("bench-*.json"):
        data = json.loads(path.read_text())
        assert {"machine", "prefill", "decode", "bandwidth", "cache", "loop_vs_generate"} <= set(data)
