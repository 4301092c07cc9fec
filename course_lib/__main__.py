"""Command line: `python -m course_lib setup | doctor`.

setup  fetch and check the model file, build the weight cache (idempotent)
doctor the workshop preflight: one table of checks, each with its fix; exits 1 if any fails
bench  measure the speed targets in one run; prints a table, writes JSON and PNG (--out, --quick,
       --only SECTION[,SECTION], --threads N)
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "doctor", "bench"])
    parser.add_argument("--json", help="doctor: also write the results to this JSON file")
    parser.add_argument("--out", default="build/bench", help="bench: folder for the JSON and PNG results")
    parser.add_argument("--quick", action="store_true", help="bench: tiny sizes, to check that it runs")
    parser.add_argument("--only", help="bench: run only these sections (comma-separated); see the list in bench.SECTIONS")
    parser.add_argument("--threads", type=int, help="bench: torch CPU threads (default: torch's own choice, recorded)")
    args = parser.parse_args(argv)
    if args.command == "setup":
        from .loading import (CacheNotWritableError, ChecksumError, ModelNotFoundError, cache_is_built, ensure_ready,
                              weights_cache_dir)
        if cache_is_built():
            print(f"setup: model cache already built in {weights_cache_dir()}")
            return 0
        try:
            ensure_ready(progress=True)
        except (ModelNotFoundError, ChecksumError, CacheNotWritableError) as err:
            print(f"setup failed: {err}", file=sys.stderr)
            return 1
        print(f"setup: model cache built in {weights_cache_dir()}")
        return 0
    if args.command == "bench":
        from pathlib import Path
        import torch
        from .measure import bench
        from .loading import load_model
        try:
            bench.parse_only(args.only)
        except ValueError as err:
            print(f"bench: {err}", file=sys.stderr)
            return 2
        if args.threads is not None:
            if args.threads < 1:
                print("bench: --threads must be at least 1", file=sys.stderr)
                return 2
            torch.set_num_threads(args.threads)
        model, tokenizer = load_model()
        result = bench.run(model, tokenizer, quick=args.quick, only=args.only)
        print(bench.format_report(result))
        for path in bench.save(result, Path(args.out)):
            print(f"wrote {path}")
        return 0
    from .doctor import main as doctor_main
    return doctor_main(json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
