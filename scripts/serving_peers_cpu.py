"""The course's server against llama.cpp's server under the same load trace; writes
data/benchmarks/serving-peers-cpu-DATE.json (measure/serving_peers.py says what is measured).

    .venv/bin/python scripts/serving_peers_cpu.py --llama-server /tmp/llsrc/.../build/bin/llama-server --threads 2

llama-server is built from the llama.cpp source inside llama-cpp-python's sdist, in a scratch folder, never by the
course's set-up (it needs cmake and a C++ compiler, and minutes):
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/llsrc && cd /tmp/llsrc
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-server
(on a CPU whose AMX kernel crashes llama.cpp, add the CMAKE_ARGS the README names).
"""
import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STEP_LINE = "decode step: "  # the child's line that says what its decode step ran (CompiledRunner.step_kind)


def serve(argv: list[str]) -> int:
    """The course's server in this (fresh) process, one configuration of serving_peers.COURSE_CONFIGS, until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("serve",))
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", default="")
    args = parser.parse_args(argv)
    import torch
    import course_lib
    from course_lib.measure.serving_peers import COURSE_CONFIGS, MAX_TOKENS
    from course_lib.serve.serving import start_server
    torch.set_num_threads(args.threads)
    # the bundled file, or another (a Q4_0 made by llama.cpp's quantizer): its weights and its own tokenizer, as
    # llama-server reads them
    model, tokenizer = course_lib.load_model(args.gguf or None, device="cpu", dtype="float32", verbose=False)
    handle = start_server(model, tokenizer, args.port, max_tokens_cap=MAX_TOKENS, max_concurrent=64,
                          **COURSE_CONFIGS[args.config])
    engine = handle.app.state.engine  # a CompiledRunner or the slots' scheduler names its step; the rest run eagerly
    print(f"{STEP_LINE}{getattr(engine.model, 'step_kind', None) or getattr(engine.batch, 'step_kind', 'eager')}",
          flush=True)
    print("serving", flush=True)
    engine.run_here()  # the engine in this process's main thread (EngineThread.run_here says why), as llama-server's
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary (built in a scratch folder)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", default="4,8", help="llama-server's parallel slots to try, comma-separated")
    parser.add_argument("--configs", default="", help="COURSE_CONFIGS names, comma-separated (default: all)")
    parser.add_argument("--gguf", default="bundled", help="the GGUF file both servers run (bundled: the course's Q4_1)")
    parser.add_argument("--out", default=str(ROOT / "data" / "benchmarks"))
    args = parser.parse_args()
    from course_lib.loading import gguf_path, sha256_of
    from course_lib.measure import peers_protocol, serving_peers
    from course_lib.serve.serving import free_port
    from peers_cpu import _cpu_name
    if not Path(args.llama_server).exists():
        raise SystemExit(f"no llama-server at {args.llama_server} (this script's docstring says how to build it)")
    gguf = str(gguf_path() if args.gguf == "bundled" else Path(args.gguf).resolve())
    cores = peers_protocol.cores(args.threads)
    traces = serving_peers.traces()
    names = [f"llama-server {s} slots" for s in args.slots.split(",")]
    course = args.configs.split(",") if args.configs else list(serving_peers.COURSE_CONFIGS)
    order = [x for pair in zip(names, course) for x in pair] + names[len(course):] + course[len(names):]
    record = {"threads": args.threads, "cores": cores, "rates": list(traces), "requests_per_rate":
              serving_peers.REQUESTS, "max_tokens": serving_peers.MAX_TOKENS, "ttft_target_s":
              serving_peers.TTFT_TARGET_S, "gap_target_s": serving_peers.GAP_TARGET_S, "order": order, "runs": {},
              "ready_s": {}, "machine": {}, "commands": {}, "course_engine_loop": "main thread",  # serve(): run_here
              "course_steps": {}, "course_configs": {name: serving_peers.COURSE_CONFIGS[name]
                                                     for name in course}}
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=60)
    record["llama_server"] = {"version": (version.stdout + version.stderr).strip()[-400:],
                              "sha256": sha256_of(Path(args.llama_server))}
    partial = Path(args.out) / ".serving-peers-partial.json"
    for name in order:
        port = free_port()
        if name.startswith("llama-server"):
            command = serving_peers.llama_server_command(args.llama_server, gguf, port, int(name.split()[1]),
                                                         args.threads)
        else:
            command = [sys.executable, __file__, "serve", "--config", name, "--port", str(port),
                       "--threads", str(args.threads), "--gguf", "" if args.gguf == "bundled" else gguf]
        record["commands"][name] = command[1:] if name.startswith("llama") else command[2:]
        print(f"{name}: starting", flush=True)
        log = Path(tempfile.gettempdir()) / f"serving-peers-{name.replace(' ', '-')}.log"  # the server's own output
        print(f"  its output: {log}", flush=True)
        proc = subprocess.Popen(["taskset", "-c", cores, *command], cwd=ROOT, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            record["ready_s"][name] = serving_peers.wait_ready(url, proc, timeout=2400)  # the compiler, cold
            before = peers_protocol.machine_state()
            record["runs"][name] = serving_peers.drive(url, traces)
            if not name.startswith("llama"):  # the child said it once it served (long before the trace ended)
                said = [line for line in log.read_text().splitlines() if line.startswith(STEP_LINE)]
                record["course_steps"][name] = said[-1][len(STEP_LINE):] if said else "unknown"
            after = peers_protocol.machine_state()
            record["machine"][name] = {"before": before, "after": after,
                                       "steal_fraction": peers_protocol.steal_fraction(before, after)}
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        for line in serving_peers.describe({**record, "runs": {name: record["runs"][name]}, "comparison": []})[1:]:
            print(line, flush=True)
        partial.write_text(json.dumps(record, indent=1))  # a later failure keeps the servers already driven
    record["comparison"] = serving_peers.compare(record["runs"])
    record.update(when=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  processor=_cpu_name(), file=Path(gguf).name)
    tag = "" if args.gguf == "bundled" else "-" + Path(gguf).stem.split(".")[-1]  # -Q4_0 beside the course's file
    out = Path(args.out) / f"serving-peers-cpu-{record['when'][:10]}{tag}.json"
    if out.exists():  # the day's first sitting keeps its name: this one gets its hour and minute
        hour = record["when"][11:16].replace(":", "")
        out = out.with_name(f"serving-peers-cpu-{record['when'][:10]}-{hour}{tag}.json")
    out.write_text(json.dumps(record, indent=1))
    partial.unlink()
    print("\n".join(serving_peers.describe(record)))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
