"""Device, dtype, seeds and honest timing, chosen in one place.

What it does: turns a device request ("auto", "cpu", "cuda", "cuda:1", "mps") into a checked
`torch.device`, picks the dtype that device runs best (bfloat16 on CUDA, float32 elsewhere), seeds
every random generator, times work the way gpt-fast does (synchronize, perf_counter, warm-up), and finds a
free loopback port (`free_port`: the server, the tensor-parallel group and the prefill process listen there).
Overrides: COURSE_DEVICE and COURSE_DTYPE environment variables, read when a function is called.
What it does not do: move models or pick a GPU among several for you (ask for "cuda:N").
"""
from __future__ import annotations

import os
import random
import re
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """A device request that is malformed or names hardware this machine does not have."""


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def cpu_lesson(reason: str, request: str | None = None) -> str:
    """The CPU, for a lesson whose kernels exist only there, with a printed line when the device the course would
    pick (COURSE_DEVICE, else auto) is another one: the lesson says why it does not use the GPU, instead of failing
    on it. Returns the device name for load_model. Example: cpu_lesson("torch's 4-bit kernel is a CPU kernel") -> "cpu" """
    wanted = resolve_device(request)
    if wanted.type != "cpu":
        print(f"this lesson runs on the CPU, not on {wanted}: {reason}")
    return "cpu"


def resolve_device(request: str | None = None) -> torch.device:
    """Checked device for a request; None reads COURSE_DEVICE, then "auto" (CUDA, then MPS, then CPU).
    Example: resolve_device("cpu") -> device(type='cpu')"""
    if request is None:
        request = os.environ.get("COURSE_DEVICE", "auto")
    if not isinstance(request, str):
        raise DeviceError(f"device must be a string such as 'auto', 'cpu' or 'cuda', not {request!r}")
    text = request.strip().lower()
    if not _DEVICE_PATTERN.match(text):
        raise DeviceError(
            f"unknown device {request!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps' "
            "(argument `device=` or environment variable COURSE_DEVICE)")
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {request!r} was requested but this machine has no CUDA GPU that torch can use "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
                "Use device='auto' or 'cpu', or unset COURSE_DEVICE.")
        index = int(text.split(":")[1]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device {request!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device(text)
    if text == "mps" and not _mps_available():
        raise DeviceError("device 'mps' was requested but Apple's MPS backend is not available here; use 'auto'")
    return torch.device(text)


def default_dtype(device: torch.device, request: str | torch.dtype | None = None) -> torch.dtype:
    """bfloat16 on CUDA, float32 on CPU and MPS; `request` or COURSE_DTYPE override it.
    Example: default_dtype(torch.device("cpu")) -> torch.float32"""
    if isinstance(request, torch.dtype):
        return request
    request = request or os.environ.get("COURSE_DTYPE")
    if request:
        if request not in DTYPES:
            raise ValueError(f"unknown dtype {request!r}: use one of {sorted(DTYPES)}")
        return DTYPES[request]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch on every device, so a run can be repeated."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for this helper
        pass


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work; without it a GPU timing measures only the kernel launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def describe_device(device: torch.device) -> dict:
    """Name and memory of a device, as plain data (for the doctor and the benchmark files)."""
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1))
    elif device.type == "cpu":
        info.update(name=f"CPU ({os.cpu_count()} logical cores)", model=_cpu_model(),
                    vector_unit=torch.backends.cpu.get_cpu_capability(), bfloat16=cpu_bfloat16())
    else:
        info.update(name=device.type.upper())
    return info


def _cpu_model() -> str:
    """The CPU's model name as the system reports it (Linux: /proc/cpuinfo), or platform.processor()."""
    import platform
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def cpu_bfloat16() -> str:
    """Whether this CPU reports bfloat16 arithmetic instructions: "yes (avx512_bf16, amx_bf16...)", "no" or
    "unknown" (read from /proc/cpuinfo's flags on Linux, `sysctl` on an Apple Silicon Mac; elsewhere unknown)."""
    import platform
    try:
        if platform.system() == "Linux":
            flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
            found = [f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx_ne_convert")]
            return f"yes ({', '.join(found)})" if found else "no (no avx512_bf16 or amx_bf16 flag)"
        if platform.system() == "Darwin" and platform.machine() == "arm64":
            import subprocess
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True).stdout
            return "yes (FEAT_BF16)" if out.strip() == "1" else "no (no FEAT_BF16)"
    except (OSError, StopIteration):
        pass
    return "unknown"


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(values) -> float:
    """The course's one median: the middle value, the mean of the two middle ones for an even count.
    Example: [3, 1, 2] -> 2; [1, 2, 3, 4] -> 2.5"""
    values = sorted(values)
    if not values:
        raise ValueError("median of no values")
    return (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2


@dataclass
class Timing:
    """Seconds measured for one piece of work; `seconds` holds every repeat, `best` the fastest."""
    label: str
    seconds: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def mean(self) -> float:
        return sum(self.seconds) / len(self.seconds)

    @property
    def median(self) -> float:
        """The middle repeat: one slow repeat does not move it (runtime.median)."""
        return median(self.seconds)


def time_it(fn: Callable[[], object], device: torch.device | str = "cpu", *, label: str = "",
            repeats: int = 3, warmup: int = 1) -> Timing:
    """Time fn() honestly: warm up, synchronize before and after each run, keep every repeat."""
    for _ in range(warmup):
        fn()
    timing = Timing(label)
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        timing.seconds.append(time.perf_counter() - start)
    return timing


@contextmanager
def stopwatch(device: torch.device | str = "cpu") -> Iterator[dict]:
    """`with stopwatch(dev) as t: ...` then t["seconds"]: one synchronized wall-clock measurement."""
    record = {"seconds": float("nan")}
    synchronize(device)
    start = time.perf_counter()
    try:
        yield record
    finally:
        synchronize(device)
        record["seconds"] = time.perf_counter() - start


def progress(items, desc: str, total: int | None = None):
    """A progress bar over a lesson's long loop, so that a cell of half a minute does not look frozen: tqdm's (a
    widget in Jupyter, a text line elsewhere), gone when the loop ends so the cell keeps only its results.
    COURSE_PROGRESS=0 turns it off: the suite and the site run lessons unattended and keep their outputs, where a
    finished bar would be left as a stale line."""
    if os.environ.get("COURSE_PROGRESS") == "0":
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, total=total, leave=False)
