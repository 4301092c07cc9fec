"""The course's engine against llama.cpp on the same GGUF file, written to data/benchmarks/.

    .venv/bin/python scripts/peers_cpu.py --llama-python /tmp/llama-venv/bin/python      (one run, every format)
    .venv/bin/python scripts/peers_cpu.py paired --llama-python /tmp/llama-venv/bin/python \
        --files Q4_1=bundled,Q4_0=/tmp/peers/SmolLM2-135M-Instruct.Q4_0.gguf --threads 1,2 --context 1024 --pairs 10
        (the paired protocol of measure/peers_protocol.py: a fresh, pinned process per trial; takes about an hour)
    .venv/bin/python scripts/peers_cpu.py llama-bench --binary PATH/llama-bench --files Q4_1=bundled,Q4_0=PATH
        (llama.cpp's own benchmark beside it; build llama-bench as scripts/serving_peers_cpu.py builds llama-server,
        with --target llama-bench)

A Q4_0 or Q8_0 file is made from the bundled one with llama.cpp's own quantizer, in the scratch environment:
    /tmp/llama-venv/bin/python scripts/peers_cpu.py quantize Q4_0 .course_cache/downloads/SmolLM2-135M-Instruct.Q4_1.gguf \
        /tmp/peers/SmolLM2-135M-Instruct.Q4_0.gguf   (the source: python -m course_lib doctor says where the file is)

llama.cpp comes from llama-cpp-python, which compiles for minutes: install it once in a scratch environment
(python3 -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install llama-cpp-python), never in the
course's .venv; or install it where this script runs and leave --llama-python out.
"""
import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cpu_name() -> str:
    """The CPU's name and the vector and matrix instruction sets that matter here (Linux), else platform's guess."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    wanted = [f for f in flags if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") or f.startswith("amx")]
    return f"{name} (flags: {' '.join(wanted) or 'none of avx2, avx512, amx'})"


def quantize(kind: str, source: str, out: str) -> int:
    """llama.cpp's quantizer (llama_model_quantize, what llama-quantize calls) from a GGUF file to `kind`; runs in
    the scratch environment that has llama-cpp-python and no torch (requantizing is allowed: the file is 4-bit)."""
    import ctypes
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}"), True
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))


def child(argv: list[str]) -> int:
    """A trial's process (peers_protocol.course_trial) or the compiled step's quality on a file; prints one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("trial", "quality"))
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--fmt", default="int4")
    parser.add_argument("--step", default="compiled", choices=("compiled", "fused"))
    args = parser.parse_args(argv)
    from course_lib.measure import peers_protocol
    ids = json.loads(Path(args.ids).read_text())
    if args.what == "trial":
        print(json.dumps(peers_protocol.course_trial(args.gguf, args.threads, args.context, ids, args.fmt, args.step)))
    else:
        print(json.dumps(peers_protocol.course_quality(args.gguf, ids["text"], args.threads, args.fmt, args.step)))
    return 0


def paired(argv: list[str]) -> int:
    """The paired protocol over every file and thread count, then each file's perplexity on both sides; one record."""
    parser = argparse.ArgumentParser(description="the paired protocol (measure/peers_protocol.py)")
    parser.add_argument("what", choices=("paired",))
    parser.add_argument("--llama-python", required=True, help="a Python whose environment has llama-cpp-python")
    parser.add_argument("--files", default="Q4_1=bundled", help="NAME=PATH,... (bundled: the course's Q4_1 file)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "data" / "benchmarks"))
    parser.add_argument("--course-fmt", default="int4", choices=("int4", "int4-q8"),
                        help="the course's format on the 4-bit files (int4-q8: the course's own kernel)")
    parser.add_argument("--course-step", default="compiled", choices=("compiled", "fused"),
                        help="the course's decode step on int4-q8 files: torch.compile's, or the fused C++ call")
    parser.add_argument("--no-quality", action="store_true", help="skip the perplexities (they do not depend on "
                        "the context: a second sitting at another context can leave them to the first)")
    args = parser.parse_args(argv)
    import course_lib
    from course_lib.loading import gguf_path
    from course_lib.measure import peers_protocol
    from course_lib.measure.peers import peer_inputs
    _, tokenizer = course_lib.load_model(device="cpu", dtype="float32", verbose=False)
    files = {}
    for item in args.files.split(","):
        name, _, path = item.partition("=")
        files[name] = str(gguf_path() if path == "bundled" else Path(path).resolve())
        if not Path(files[name]).exists():
            raise SystemExit(f"no file {files[name]} (make it with: scripts/peers_cpu.py quantize {name} PATH)")
    inputs = peer_inputs(tokenizer, args.new_tokens)
    ids_file = Path(args.out) / ".peers-ids.json"
    ids_file.write_text(json.dumps(inputs))
    partial = Path(args.out) / ".peers-paired-partial.json"
    try:
        record = peers_protocol.sitting(files, tuple(int(t) for t in args.threads.split(",")), args.context,
                                        args.pairs, str(ids_file), args.llama_python,
                                        save=lambda r: partial.write_text(json.dumps(r, indent=1)),
                                        four_bit=args.course_fmt, step=args.course_step)
        script = str(ROOT / "course_lib" / "measure" / "peers_llama.py")
        fmt = {name: peers_protocol.course_format(name, args.course_fmt) for name in files}
        record["quality"] = {} if args.no_quality else {name: {
            "course_compiled": peers_protocol.run_child([sys.executable, __file__, "quality", "--gguf", path, "--threads",
                                                         "2", "--ids", str(ids_file), "--fmt", fmt[name], "--step",
                                                         peers_protocol.step_for(fmt[name], args.course_step)], 2,
                                                        timeout=1800),
            "llama.cpp": peers_protocol.run_child([args.llama_python, script, "perplexity", str(ids_file), path, "2"], 2)}
            for name, path in files.items()}
    finally:
        ids_file.unlink()
    record.update(when=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  processor=_cpu_name(), files={name: Path(path).name for name, path in files.items()},
                  course_fmt=args.course_fmt, course_step=args.course_step, inputs={"prompt_tokens": len(inputs["prompt"]), "new_tokens": args.new_tokens,
                          "perplexity_tokens": len(inputs["text"])})
    tag = "" if args.context == 1024 else f"-context{args.context}"  # the lesson reads the 1,024 record by its name
    out = Path(args.out) / f"peers-paired-cpu-{record['when'][:10]}{tag}.json"
    if out.exists():  # a second sitting the same day keeps the first: its hour goes into the name
        out = out.with_name(f"{out.stem}-{record['when'][11:16].replace(':', '')}.json")
    out.write_text(json.dumps(record, indent=1))
    print("\n".join(peers_protocol.describe(record)))
    print(f"written: {out}")
    return 0


def llama_bench(argv: list[str]) -> int:
    """llama.cpp's own benchmark beside the paired record: llama-bench (built from the same source, scratch folder)
    on each file, generation only, 1 and 2 threads, flash attention off and on, at depth 0 and 1,024 (-d), ten
    repetitions; its JSON rows kept whole in data/benchmarks/llama-bench-cpu-DATE.json."""
    import subprocess
    parser = argparse.ArgumentParser(description="llama-bench beside the paired record")
    parser.add_argument("what", choices=("llama-bench",))
    parser.add_argument("--binary", required=True, help="llama-bench, built with cmake from the sdist's llama.cpp")
    parser.add_argument("--files", default="Q4_1=bundled", help="NAME=PATH,... (bundled: the course's Q4_1 file)")
    parser.add_argument("--out", default=str(ROOT / "data" / "benchmarks"))
    args = parser.parse_args(argv)
    from course_lib.loading import gguf_path
    flags = ["-t", "1,2", "-p", "0", "-n", "128", "-r", "10", "-fa", "0,1", "-d", "0,1024", "-o", "json"]
    record = {"flags": flags, "rows": {}}
    for item in args.files.split(","):
        name, _, path = item.partition("=")
        path = str(gguf_path() if path == "bundled" else Path(path).resolve())
        done = subprocess.run([args.binary, "-m", path, *flags], capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"llama-bench failed on {name}: {done.stderr.strip()[-600:]}")
        record["rows"][name] = json.loads(done.stdout)
        print(f"{name}: {len(record['rows'][name])} rows", flush=True)
    record.update(when=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  processor=_cpu_name())
    from course_lib.measure.peers_protocol import describe_llama_bench
    out = Path(args.out) / f"llama-bench-cpu-{record['when'][:10]}.json"
    out.write_text(json.dumps(record, indent=1))
    print("\n".join(describe_llama_bench(record)))
    print(f"written: {out}")
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "llama-bench":
        return llama_bench(sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] in ("trial", "quality"):
        return child(sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] == "paired":
        return paired(sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] == "quantize":
        return quantize(*sys.argv[2:5])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-python", help="a Python whose environment has llama-cpp-python")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--formats", default="float32,int8,int4", help="the course's formats to run")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "data" / "benchmarks"))
    parser.add_argument("--llama-build", default="", help="how llama.cpp was built (CMAKE_ARGS), kept in the record")
    args = parser.parse_args()
    import torch
    import course_lib
    from course_lib.measure.peers import peers_run
    from course_lib.runtime import describe_device
    model, tokenizer = course_lib.load_model(device="cpu", dtype="float32")
    result = peers_run(model, tokenizer, tuple(args.formats.split(",")), tuple(int(t) for t in args.threads.split(",")),
                       args.llama_python, args.new_tokens)
    result.update(when=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  machine=describe_device(torch.device("cpu")), processor=_cpu_name(), llama_cpp_build=args.llama_build)
    out = Path(args.out) / f"peers-cpu-{result['when'][:10]}.json"
    out.write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        print(f"{row['path']:<20} {row['threads']} thread(s): decode {row['decode_tokens_per_s']:6.1f} tok/s, "
              f"prefill {row['prefill_tokens_per_s']:7.1f} tok/s, perplexity {row['perplexity']:.3f}")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
