"""Replicas behind a router that is not ours (lesson 18): course servers, each in its own process on one core,
and sglang-router (SGLang's router, written in Rust, installed from PyPI) in front of them.

What it does: `Replica` starts one course server (serving.start_server, the paged cache with prefix caching) in a
process of its own, pinned to one CPU core where the system allows it and limited to one torch thread, and stops
or kills it; `Router` starts sglang-router on loopback in front of replica URLs with one of its routing policies
and waits until it answers; `health` reads a server's /health; `router_command` is the command that starts the
router, and `RouterMissing` says how to install it where it is missing.
What it does not do: route (the router does, in its own process), replay a trace (measure/load.py does) or judge
the figures (measure/router.py does). Everything listens on 127.0.0.1 only.
"""
from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROUTER_PIN = "sglang-router==0.3.2"
POLICIES = ("round_robin", "cache_aware")  # two of the router's policies: in turn, and by shared prompt prefix


class RouterMissing(RuntimeError):
    """sglang-router is not installed (it ships wheels for Linux on x86_64 and aarch64, macOS on Apple silicon and
    Windows on x86_64)."""


def router_command() -> list[str]:
    """The command that starts sglang-router with this Python, or RouterMissing with the fix."""
    import importlib.util
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterMissing(f"sglang-router is not installed in this environment (this is {sys.platform} on "
                            f"{platform.machine()}; it has wheels for Linux x86_64 and aarch64, macOS arm64 and "
                            f"Windows x86_64). Run: {Path(sys.executable)} -m pip install {ROUTER_PIN}")
    return [sys.executable, "-m", "sglang_router.launch_router"]


def health(url: str, timeout: float = 5) -> dict:
    """GET url/health of a course server as a dict: its requests served, and its pool and prefix hits."""
    import httpx
    response = httpx.get(url + "/health", timeout=timeout)
    response.raise_for_status()
    return response.json() if response.content.strip() else {}


def _pin(core: int | None) -> bool:
    if core is None or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, {core % os.cpu_count()})
        return True
    except OSError:
        return False


def serve_replica(port: int, ready, core: int | None, threads: int, options: dict) -> None:
    """The replica process: one core (where the system allows it), `threads` torch threads, one course server."""
    import threading

    import torch
    _pin(core)
    torch.set_num_threads(threads)
    from ..loading import load_model
    from .serving import start_server
    model, tokenizer = load_model(verbose=False)
    start_server(model, tokenizer, port, kv_cache="paged", **options)
    ready.set()
    threading.Event().wait()  # serve until the parent terminates this process


class Replica:
    """One course server in its own process: start() (loads the model: seconds), .url, stop(), kill() (no goodbye,
    as a crash would). options go to start_server, e.g. kv_blocks=300, max_tokens_cap=32."""

    def __init__(self, core: int | None = None, threads: int = 1, **options):
        from ..runtime import free_port
        self.port, self.core = free_port(), core
        self.url = f"http://127.0.0.1:{self.port}"
        context = multiprocessing.get_context("spawn")
        self.ready = context.Event()
        self.process = context.Process(target=serve_replica, args=(self.port, self.ready, core, threads, options),
                                       daemon=True, name=f"course-replica-{self.port}")

    def start(self) -> "Replica":
        """Start the process and return at once; wait() blocks until it serves."""
        self.process.start()
        return self

    def wait(self, timeout: float = 120) -> "Replica":
        deadline = time.time() + timeout
        while not self.ready.wait(0.25):
            if not self.process.is_alive() or time.time() > deadline:
                self.process.terminate()
                raise RuntimeError(f"the replica on {self.url} did not start within {timeout:.0f} s "
                                   f"(exit code {self.process.exitcode}; its error is printed above)")
        return self

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(timeout=15)
        if self.process.is_alive():
            self.kill()


def start_replicas(n: int, **options) -> list[Replica]:
    """n replicas started together (each on its own core, in turn), returned once all answer."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"need a whole number of replicas >= 1, got {n!r}")
    replicas = [Replica(core=i, **options).start() for i in range(n)]
    try:
        return [r.wait() for r in replicas]
    except Exception:
        for r in replicas:
            r.stop()
        raise


class Router:
    """sglang-router on 127.0.0.1 in front of `workers` (URLs), with `policy` (one of POLICIES, or any other it
    accepts): start() waits until it answers; stop(). Its log goes to .log (a file), for when it fails. Requests
    through it must name the model ("model" in the body): it routes by model, as a gateway for several would."""

    def __init__(self, workers: list[str], policy: str = "round_robin", *, retries: int | None = None):
        from ..runtime import free_port
        if not workers:
            raise ValueError("a router needs at least one worker URL")
        for url in workers:
            if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
                raise ValueError(f"the course's router fronts loopback workers only, not {url!r}")
        self.workers, self.policy, self.port = list(workers), policy, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*router_command(), "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                        "--worker-urls", *self.workers, "--log-level", "warn"]
        if retries is not None:
            self.command += ["--retry-max-retries", str(retries)] if retries else ["--disable-retries"]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"course-router-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "Router":
        import httpx
        self.process = subprocess.Popen(self.command, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.process.returncode}: "
                                   f"{self.log.read_text()[-600:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sglang-router did not answer on {self.url} within {timeout:.0f} s: "
                           f"{self.log.read_text()[-600:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
