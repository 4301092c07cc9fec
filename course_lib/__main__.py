"""Command line: `python -m course_lib setup | doctor`.

setup  fetch and check the model file, build the weight cache (idempotent)
doctor the workshop preflight: one table of checks, each with its fix; exits 1 if any fails
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "doctor"])
    parser.add_argument("--json", help="doctor: also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "setup":
        from .loading import (CacheNotWritableError, ChecksumError, ModelNotFoundError, cache_is_built,
                              ensure_ready, weights_cache_dir)
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
    from .doctor import main as doctor_main
    return doctor_main(json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
