"""Command line: `python -m course_lib setup | doctor | bench | room`.

setup  fetch and check the model file, build the weight cache (idempotent)
doctor the workshop preflight: one table of checks, each with its fix; exits 1 if any fails
bench  measure the speed targets in one run; prints a table, writes JSON and PNG (--out, --quick,
       --only SECTION[,SECTION], --threads N)
room   a workshop's shared server, until Ctrl-C (--host, --port, --fmt, --max-concurrent): learners set
       COURSE_SERVER_URL and COURSE_SERVER_KEY, and lessons 10, 13 and 15 use it
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "doctor", "bench", "room"])
    parser.add_argument("--json", help="doctor: also write the results to this JSON file")
    parser.add_argument("--out", default="build/bench", help="bench: folder for the JSON and PNG results")
    parser.add_argument("--quick", action="store_true", help="bench: tiny sizes, to check that it runs")
    parser.add_argument("--only", help="bench: run only these sections (comma-separated); see the list in bench.SECTIONS")
    parser.add_argument("--threads", type=int, help="bench: torch CPU threads (default: torch's own choice, recorded)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="room: the address to listen on (0.0.0.0: every network of this machine; a key is made)")
    parser.add_argument("--port", type=int, default=8000, help="room: the port (default 8000)")
    parser.add_argument("--fmt", choices=["float32", "int4", "int4-q8"], default="float32",
                        help="room: float32 gives the lessons' own tokens; int4 reads fewer bytes per token; int4-q8 "
                             "the same bytes through the course's own kernel (C++, built on first use)")
    parser.add_argument("--max-concurrent", type=int, default=32, help="room: requests in flight at once (more get 429)")
    args = parser.parse_args(argv)
    if args.command == "room":
        return _room(args)
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


def _room(args) -> int:
    import time
    from .loading import load_model
    from .serve.room import ROOM_KEY, ROOM_URL, room_server
    if not 0 < args.port < 65536 or args.max_concurrent < 1:
        print(f"room: --port must be 1-65535 and --max-concurrent at least 1, got {args.port}, {args.max_concurrent}",
              file=sys.stderr)
        return 2
    model, tokenizer = load_model()
    try:
        server = room_server(model, tokenizer, args.port, args.host, fmt=args.fmt, max_concurrent=args.max_concurrent)
    except (ValueError, RuntimeError) as err:
        print(f"room: {err}", file=sys.stderr)
        return 2
    address = "<this machine's address>" if args.host in ("0.0.0.0", "::") else args.host
    print(f"room: serving at {server.url} ({args.fmt}, paged cache, at most {args.max_concurrent} requests at once). "
          f"Learners set, before starting JupyterLab:\n  export {ROOM_URL}=http://{address}:{args.port}" +
          (f"\n  export {ROOM_KEY}={server.api_key}" if server.api_key else "") + "\nCtrl-C stops it.", flush=True)
    try:
        while server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    server.stop()
    print("room: stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
