"""The workshop preflight (`python -m course_lib doctor`): is this machine ready for the course?

What it does: checks Python and the key packages, the device, the model file and its checksum,
the weight cache, a short greedy generation (timed), tiktoken offline, the Jupyter kernel, the
JupyterLab widgets extension and lesson 18's router. Prints one table, a fix for each failure, and returns 1 if any failed.
What it does not do: repair anything (the fixes are commands for you to run).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGES = ["torch", "transformers", "tiktoken", "ipywidgets", "jupyterlab"]
SETUP = "make setup"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _guard(name: str, fix: str, fn) -> Check:
    """Run one check; an exception becomes a failed row instead of a crash."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the doctor must report, not crash
        return Check(name, False, f"{type(err).__name__}: {err}"[:160], fix)


def check_python() -> Check:
    ok = sys.version_info >= (3, 10)
    return Check("python", ok, platform.python_version(), "" if ok else "install Python 3.10 or newer")


def check_package(name: str) -> Check:
    try:
        return Check(name, True, md.version(name))
    except md.PackageNotFoundError:
        return Check(name, False, "not installed", SETUP)


def check_device() -> Check:
    from .runtime import describe_device, resolve_device
    info = describe_device(resolve_device())
    memory = f", {info['memory_gib']} GiB" if "memory_gib" in info else ""
    return Check("device", True, f"{info['device']}: {info['name']}{memory}")


def check_model_file() -> Check:
    from .loading import GGUF_SHA256, gguf_path, sha256_of
    path = gguf_path()
    if not path.exists():
        return Check("model file", False, f"missing: {path}", SETUP)
    ok = sha256_of(path) == GGUF_SHA256
    return Check("model file", ok, f"{path.name}, checksum {'good' if ok else 'WRONG'}",
                 "" if ok else f"delete {path} and run `{SETUP}`")


def check_cache() -> Check:
    from .loading import cache_is_built, weights_cache_dir
    ok = cache_is_built()
    return Check("weight cache", ok, str(weights_cache_dir()) if ok else "not built", "" if ok else SETUP)


def check_generation() -> Check:
    from .text.context import context_ids
    from .engine.generation import generate
    from .loading import load_model
    start = time.perf_counter()
    import transformers  # noqa: F401 - timed apart from the load itself
    imported = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = load_model(verbose=False)
    loaded = time.perf_counter() - start
    ids = context_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    result = generate(model, tokenizer, ids, max_new_tokens=16)
    seconds = result.steps[-1].at
    ok = "Paris" in result.text
    return Check("generation", ok, f"import {imported:.1f} s, load {loaded:.2f} s; {len(result.token_ids)} tokens in {seconds:.2f} s: "
                 f"{result.text!r}", "" if ok else "the model answered wrongly: rebuild with `make clean-cache setup`")


def check_tiktoken() -> Check:
    from .text.tokenization import cl100k
    n = len(cl100k().encode("What is the capital of France?"))
    return Check("tiktoken offline", True, f"cl100k_base ready ({n} tokens for the question)")


def check_kernel() -> Check:
    from jupyter_client.kernelspec import KernelSpecManager
    specs = KernelSpecManager().find_kernel_specs()
    ok = "llm-course" in specs
    return Check("jupyter kernel", ok, "llm-course" if ok else "kernel 'llm-course' not installed", "" if ok else SETUP)


def check_widgets_extension() -> Check:
    from jupyter_core.paths import jupyter_path
    for root in jupyter_path("labextensions"):
        if (Path(root) / "@jupyter-widgets" / "jupyterlab-manager" / "package.json").exists():
            return Check("widgets extension", True, f"@jupyter-widgets/jupyterlab-manager in {root}")
    return Check("widgets extension", False, "JupyterLab will show widgets as text",
                 "pip install jupyterlab_widgets (part of `make setup`), then restart JupyterLab")


def check_router() -> Check:
    """sglang-router (lesson 18): required where it has a wheel, which set-up installs; elsewhere the lesson shows a
    committed run instead, so its absence is not a failure there."""
    from .serve.replicas import ROUTER_PIN, RouterMissing, router_command
    wheel = (sys.platform, platform.machine().lower()) in {("linux", "x86_64"), ("linux", "aarch64"),
                                                           ("darwin", "arm64"), ("win32", "amd64")}
    try:
        router_command()
        return Check("router (lesson 18)", True, f"{ROUTER_PIN.replace('==', ' ')} installed")
    except RouterMissing:
        if not wheel:
            return Check("router (lesson 18)", True, "no sglang-router wheel for this platform: lesson 18 shows a "
                                                     "committed run in its place")
        return Check("router (lesson 18)", False, "sglang-router is not installed", SETUP)


def run_checks() -> list[Check]:
    checks = [check_python()] + [check_package(p) for p in PACKAGES]
    for name, fix, fn in [("device", "unset COURSE_DEVICE or set it to 'cpu'", check_device),
                          ("model file", SETUP, check_model_file), ("weight cache", SETUP, check_cache),
                          ("generation", SETUP, check_generation), ("tiktoken offline", SETUP, check_tiktoken),
                          ("jupyter kernel", SETUP, check_kernel), ("widgets extension", SETUP, check_widgets_extension),
                          ("router (lesson 18)", SETUP, check_router)]:
        checks.append(_guard(name, fix, fn))
    return checks


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  status  detail", "-" * (width + 60)]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {c.fix}")
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks) - failed}/{len(checks)} checks passed" + ("" if not failed else "; see the fixes above"))
    return "\n".join(lines)


def main(json_path: str | None = None) -> int:
    checks = run_checks()
    print(format_table(checks))
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(c) for c in checks], indent=2))
    return 0 if all(c.ok for c in checks) else 1
