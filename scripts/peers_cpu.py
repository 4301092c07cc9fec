"""One run of the course's engine against llama.cpp on the same GGUF file, written to data/benchmarks/.

    .venv/bin/python scripts/peers_cpu.py --llama-python /tmp/llama-venv/bin/python

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


def main() -> int:
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
