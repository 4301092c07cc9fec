"""Check the whole course on this machine's GPU and write one report (for anyone with an NVIDIA GPU).

    .venv/bin/python scripts/gpu_check.py            # every lesson on CUDA, then the bench sections that mean
                                                     # something there; JSON under data/benchmarks/
    .venv/bin/python scripts/gpu_check.py --lessons 00,11   # a few lessons only, no bench

Each lesson runs top to bottom with COURSE_DEVICE=cuda (lessons whose kernels exist only on the CPU say so and
run there); the report records, per lesson, whether it ran, its seconds and its first error. Then the bench
sections engine, formats, paged, speculative and attention run on the GPU and write their own JSON beside the
report. Nothing is sent anywhere: send the files, or commit them.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_SECTIONS = "engine,formats,paged,speculative,attention"


def run_notebook(path: Path, env: dict, timeout: int = 1800) -> dict:
    """One lesson executed in its own kernel with `env`: ok, seconds, and the first error (name: message)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    nb = nbformat.read(path, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="llm-course",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        error = None
    except CellExecutionError as err:
        error = str(err).strip().splitlines()[-1][:500]
    except Exception as err:  # a kernel that died, a timeout: recorded, and the next lesson still runs
        error = f"{type(err).__name__}: {str(err)[:500]}"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"ok": error is None, "seconds": round(time.perf_counter() - start, 1), "error": error}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lessons", help="lesson numbers, comma-separated (default: all, then the bench)")
    parser.add_argument("--out", default=str(ROOT / "data" / "benchmarks"))
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU that torch can use here (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'no'}). On an NVIDIA machine, set up with the default index's torch "
              "(COURSE_TORCH_INDEX=default make setup), then run this again.", file=sys.stderr)
        return 2
    from course_lib.runtime import describe_device
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.lessons:
        wanted = {n.strip().zfill(2) for n in args.lessons.split(",")}
        notebooks = [p for p in notebooks if p.name[:2] in wanted]
    env = {"COURSE_DEVICE": "cuda", "MPLBACKEND": "Agg"}
    report = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "machine": describe_device(torch.device("cuda")), "lessons": {}}
    for path in notebooks:
        result = run_notebook(path, env)
        report["lessons"][path.stem] = result
        print(f"{path.stem:<28} {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.0f} s"
              + (f": {result['error']}" if result["error"] else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.lessons:
        bench = subprocess.run([sys.executable, "-m", "course_lib", "bench", "--only", BENCH_SECTIONS, "--out", str(out)],
                               env=dict(os.environ, COURSE_DEVICE="cuda"), capture_output=True, text=True)
        report["bench"] = {"sections": BENCH_SECTIONS, "ok": bench.returncode == 0,
                           "report": bench.stdout.strip().splitlines()[-40:], "error": bench.stderr.strip()[-1500:] or None}
    name = out / f"gpu-check-{report['when'][:10]}.json"
    name.write_text(json.dumps(report, indent=1))
    failed = [k for k, v in report["lessons"].items() if not v["ok"]]
    print(f"gpu_check: {len(notebooks) - len(failed)}/{len(notebooks)} lessons ran on {report['machine'].get('name', 'cuda')}; "
          f"report: {name}")
    return 1 if failed or not report.get("bench", {"ok": True})["ok"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
