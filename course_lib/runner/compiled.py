"""The course's model with its decode steps compiled: what `generate(..., compiled=True)` and the server's
`compiled=True` run.

What it does: `CompiledRunner` wraps the course's own model (any weight format) and meets the same runner contract
(forward.Runner), so the stages and schedulers run it unchanged. Its caches are the course's KVCache with the
capacity rounded up to a bucket (CAPACITIES: 256 to 8,192 columns), so attention never reads many more columns
than the context holds. A decode step (one token per row, any number of rows) goes through a
static_step.StaticDecode over that cache, and every StaticDecode of a runner calls ONE function compiled by
torch.compile with dynamic shapes: the rows and the capacity are symbols in the generated code, so the compiler
runs twice per thread count (torch specializes a single row apart from a batch), not once per (rows, capacity).
That is the idea of a GPU engine's CUDA graphs captured at start-up, on the CPU; `warm()` pays both compiles
before a server listens. For the int4-q8 format, and for int4 on a CPU with AVX-512 BF16, the step is the course's
C++ instead (fused_step: one call a step, nothing to compile), which ran faster than torch.compile's on the course's
CPU (lesson 12 measures both; for int4 torch.compile's step was no faster than the eager one there, 2026-12-07). A
scheduler that joins or drops rows hands the cache to `fit_cache`, which puts it back in a bucket. Everything else
(a prompt, several tokens at once, another runner's cache) runs the model eagerly.
Where torch.compile cannot build kernels (no C++ compiler), or for a transformers model, every step runs eagerly
and `why_eager` says why (printed once).
What it does not do: change the numbers in float32 beyond rounding order (the step attends over its whole bucket
with a mask: the tokens equal the eager path's on the running examples); in bfloat16
(the int4 format's activations) a near-tie between two tokens can flip, and the engine's tests say where (the int4
format's fused step keeps float32 between its products, where the eager model rounds every activation to bfloat16:
tests/test_fused_int4.py). It does
not page: a paged cache runs its decode eagerly through the block tables.
"""
from __future__ import annotations

import functools
import time
import weakref

import torch

from ..runtime import synchronize
from .kv_cache import KVCache
from .model import Output
from .fused_step import why_not_fused
from .static_step import StaticDecode, compile_available, compile_options

CAPACITIES = (256, 512, 1024, 2048, 4096, 8192)  # columns a compiled step's cache holds, smallest that fits wins


def bucket(capacity: int, window: int) -> int:
    """The smallest bucket holding `capacity` columns, never past the window. Example: (300, 8192) -> 512"""
    return min([c for c in CAPACITIES if c >= capacity] + [window])


class CompiledRunner:
    """The course's model, its decode steps compiled per (rows, capacity) bucket. Example:
    runner = CompiledRunner(convert(ours, "int4")); generate(runner, tokenizer, ids, 64)  # same loop, faster steps"""

    def __init__(self, model, compile: bool = True, fused: bool | str = "auto"):
        """compile=False runs the same static steps without compiling them (the tests' way to check the static path
        cheaply); without a C++ compiler every step runs the model eagerly, and why_eager says so. fused: 'auto' (with
        compile) runs each decode step as one C++ call (fused_step) where the model can take it (int4-q8; int4 on a
        CPU with AVX-512 BF16),
        torch.compile's step elsewhere; True insists (an error says why not); False never."""
        self.model, self.config = model, model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.steps: dict[tuple, StaticDecode] = {}  # (rows, capacity, threads) -> its step (sharing one code)
        self.compiled_code: dict[int, object] = {}  # threads -> StaticDecode._decode compiled with dynamic shapes
        self.compile_seconds = 0.0  # the first calls that compiled (a single row, then a batch), per thread count
        if not hasattr(model, "layers") or not hasattr(model, "new_cache"):
            raise TypeError("a compiled step runs the course's own model: build it with Model.from_transformers(model) "
                            "(and formats.convert(ours, 'int4') for the 4-bit format)")
        ok, why = compile_available() if compile else (True, "")
        self.compile, self.why_eager = compile, why  # compile=False: the static steps run eagerly (for tests)
        if not ok:
            print(f"compiled step: running eagerly ({why})")
        reason = why_not_fused(model)
        if fused is True and reason:
            raise ValueError(reason)
        self.fused = reason == "" and (fused is True or (fused == "auto" and compile and ok))
        self.static_calls = self.eager_calls = 0

    @property
    def step_kind(self) -> str:
        """What a decode step of a bucket's shape runs: 'fused' (one C++ call), 'compiled' (torch.compile), 'static'
        (the static step uncompiled) or 'eager' (the model itself: no C++ compiler)."""
        return "fused" if self.fused else "eager" if self.why_eager else "compiled" if self.compile else "static"

    def __getattr__(self, name):  # the model's own parts (device, dtype, layers, weight_bytes...) read through
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KVCache of `batch` rows, its capacity rounded up to a bucket."""
        return self.model.new_cache(batch, bucket(capacity, self.config.max_position_embeddings))

    def fit_cache(self, cache):
        """The same tokens in a cache of a bucket's shape, so the next decode step can run compiled: a scheduler calls
        it after it joined, dropped or trimmed rows (which leave a capacity between buckets). One copy of the
        columns written so far, only when the shape is off; any other cache is returned as it is."""
        if not isinstance(cache, KVCache) or self.why_eager:
            return cache
        window = self.config.max_position_embeddings
        if self.bucketed(cache):
            return cache
        capacity = bucket(cache.length + 1, window)
        if capacity <= cache.length:  # the window is full: nothing fits a bucket
            return cache
        fresh = self.model.new_cache(cache.batch, capacity)
        for new, old in ((fresh.keys, cache.keys), (fresh.values, cache.values)):
            for layer, t in enumerate(old):
                new[layer][:, :, :cache.length] = t[:, :, :cache.length]
        fresh.length = cache.length
        return fresh

    def step_for(self, rows: int, capacity: int) -> StaticDecode:
        """The step of this (rows, capacity), built the first time it is asked for, calling the runner's one compiled
        function. note: torch.compile's CPU kernels are built for the thread count they were compiled at, so the
        thread count is part of the key.
        subtle: the compiled code is StaticDecode._decode compiled once with dynamic=True and handed each step
        object as its first argument: the step's tensors (rotary tables, column numbers) are inputs of symbolic
        size, so a new (rows, capacity) runs the code already built instead of compiling again. Measured on the
        AMD course machine (int4, 1 thread): about 80 s of compiling per (rows, capacity) with static shapes; with
        dynamic shapes about 180 s once for a single row and once for a batch (60-70 s each from torch's
        on-disk cache), and steps as fast (15-19 ms for one row, 43 ms for eight, against 14-15 and 51).
        subtle: these steps read their whole bucket (StaticDecode(whole=True)), not static_step.span_of's span. A
        span passed as a symbol meets torch's duck shaping: at a first step whose span equals its capacity both
        get one symbol, and the first step that reads fewer columns compiles again, mid-traffic; turning duck
        shaping off instead gives each of the 60 cache tensors sizes of their own, and compiling the real model
        did not finish in 10 minutes (2026-12-05, the sympy guard simplifier). The bucket bounds the waste: at
        most twice the columns a request needs."""
        threads = torch.get_num_threads()
        key = (rows, capacity, threads)
        if key not in self.steps:
            step = StaticDecode(self.model, rows, capacity, compile=False, whole=True, fused=self.fused)
            if self.compile and not self.fused:
                if threads not in self.compiled_code:
                    StaticDecode.allow_recompiles()
                    self.compiled_code[threads] = torch.compile(StaticDecode._decode, dynamic=True,
                                                                options=compile_options())
                step._step, step.compiled = functools.partial(self.compiled_code[threads], step), True
            self.steps[key] = step
        return self.steps[key]

    def warm(self, capacity: int = CAPACITIES[0]) -> float:
        """Compile now what the decode steps will need (one row, then two), on scratch caches: what a server does
        before it listens, so no request waits for the compiler. Returns the seconds it took (tens of seconds to
        minutes on a CPU the first time; nothing to do without a compiler)."""
        if self.why_eager or not self.compile or self.fused:  # a fused step has nothing to compile
            return 0.0
        start = time.perf_counter()
        # subtle: the engine calls a step under inference mode (forward.run_model) on a cache made outside it, and
        # torch guards on the dispatch keys that leaves: warming any other way compiled both steps again at the
        # first request (2026-12-05, a server's first minutes)
        for rows in (1, 2):
            cache = self.new_cache(rows, capacity)
            with torch.inference_mode():
                self.step_for(rows, cache.capacity)([0] * rows, cache)
        synchronize(self.model.device)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def runs_compiled(self, input_ids: torch.Tensor, cache) -> bool:
        """Whether this call goes through a compiled step: one token per row, a KVCache of a bucket's shape."""
        if self.why_eager or input_ids.shape[1] != 1:
            return False
        return isinstance(cache, KVCache) and cache.batch == input_ids.shape[0] and self.bucketed(cache)

    def bucketed(self, cache: KVCache) -> bool:
        """Whether a KVCache has a bucket's capacity (or the window's), room for one more column, and buffers a
        step can write in place."""
        return (cache.capacity in CAPACITIES + (self.config.max_position_embeddings,) and cache.length < cache.capacity
                and cache.keys[0].is_contiguous())

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, use_cache: bool = True,
                 logits_to_keep: int = 0):
        """The runner contract (model.Model.__call__'s): a decode step of a bucket's shape runs compiled, the rest
        eagerly."""
        if cache is None or not self.runs_compiled(input_ids, cache):
            self.eager_calls += 1
            return self.model(input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep)
        B, capacity, column = input_ids.shape[0], cache.capacity, cache.length
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):  # left padding: hide each row's
            key_mask = torch.zeros(B, capacity, dtype=torch.bool, device=input_ids.device)
            key_mask[:, :column + 1] = attention_mask[:, -(column + 1):].bool()
        positions = position_ids.reshape(B) if position_ids is not None else None
        self.static_calls += 1
        logits = self.step_for(B, capacity)(input_ids, cache, positions, key_mask)  # (B, 1, V)
        return Output(logits, cache)


_runners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_runner(model) -> CompiledRunner:
    """The one CompiledRunner of this model (made the first time), so every generate(..., compiled=True) on it shares
    the steps already compiled. A CompiledRunner is returned as it is."""
    if isinstance(model, CompiledRunner):
        return model
    if model not in _runners:
        _runners[model] = CompiledRunner(model)
    return _runners[model]
