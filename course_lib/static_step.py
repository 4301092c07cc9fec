"""A decode step with static shapes, the form torch.compile (and a GPU's CUDA graphs) can capture once (lesson 11;
issue: the compiled step).

What it does: `StaticStep` runs the course's own model (any weight format) one token at a time for one row, with
nothing that depends on how long the context is: the cache is preallocated at a fixed capacity, the position
arrives as a tensor, the new key and value are written at that position with `index_copy_`, and attention reads
every column of the cache with a mask that hides the ones not written yet. The prompt goes through the model's
ordinary prefill (`forward.run_model`) into the same cache. `compile=True` hands the step to `torch.compile`,
which needs a C++ compiler on the CPU (`compile_available` says whether there is one) and takes tens of seconds
the first time: `compile_seconds` records the warm-up that paid for it.
What it does not do: batch, sample, or serve (the one-step engine does); time itself (measure.compiled does).
"""
from __future__ import annotations

import shutil
import time

import torch

from .forward import run_model
from .model import block, embed, head
from .runtime import synchronize


def compile_available() -> tuple[bool, str]:
    """(True, "") when torch.compile can build CPU kernels here; else (False, why, with what fixes it)."""
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return False, "torch.compile builds C++ kernels on the CPU and finds no C++ compiler (install g++ or clang)"
    return True, ""


COMPILE_OPTIONS = {"freezing": True, "cpp_wrapper": True}  # what torch.compile is given (see StaticStep)


class StaticStep:
    """One row's decode steps at fixed shapes. Example:
    step = StaticStep(ours, capacity=256); logits = step.prefill(prompt_ids); logits = step(int(logits.argmax()))"""

    def __init__(self, model, capacity: int, compile: bool = False):
        if capacity < 2 or capacity > model.config.max_position_embeddings:
            raise ValueError(f"capacity must be between 2 and the window of {model.config.max_position_embeddings}, "
                             f"got {capacity}")
        if compile:
            ok, why = compile_available()
            if not ok:
                raise RuntimeError(why)
        self.model, self.capacity, self.compiled = model, capacity, compile
        self.cache = model.new_cache(1, capacity)
        self.cos = model.cos.to(model.dtype).clone()  # (window, D): read at a position given as a tensor
        self.sin = model.sin.to(model.dtype).clone()
        self.columns = torch.arange(capacity, device=model.device)
        self.position = 0
        self.compile_seconds = 0.0
        self.head_apart = not getattr(model.lm_head, "compiles", True)
        # note: freezing lets the compiler treat the weights as constants (and prepack them for its kernels): a
        # compiled step is for inference only. Measured on the course's CPU, int4 at 2 threads: 142.6 tokens per
        # second with it, 131.0 without, 121.8 eager (one run each). cpp_wrapper calls the step's kernels from
        # generated C++ instead of generated Python (about 300 calls a step): int4, 1 thread, 11.0 -> 10.0 ms a
        # step; 2 threads 7.0 -> 6.3 (two runs each); the first compile takes about 60 s instead of 20.
        self._step = torch.compile(self._decode, dynamic=False, options=COMPILE_OPTIONS) if compile else self._decode

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """The prompt in one ordinary pass into this step's cache; the last position's logits (V,)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: a decode step needs at least one token before it")
        if len(prompt_ids) >= self.capacity:
            raise ValueError(f"a {len(prompt_ids)}-token prompt leaves no room in a capacity of {self.capacity}")
        self.cache.length = 0
        ids = torch.tensor([prompt_ids], device=self.model.device)
        logits, self.cache = run_model(self.model, ids, self.cache, keep=1)
        self.position = len(prompt_ids)
        return logits[0, -1]

    def __call__(self, token: int) -> torch.Tensor:
        """Feed one token at the next position; its logits (V,). The first call of a compiled step compiles it."""
        if self.position == 0:
            raise ValueError("call prefill(prompt_ids) first")
        if self.position >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} tokens): make a StaticStep with more capacity")
        token_t = torch.tensor([[token]], device=self.model.device)
        position = torch.tensor([self.position], device=self.model.device)
        synchronize(self.model.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self._step(token_t, position, self.cache.keys, self.cache.values)
            # a head the compiler cannot take (formats.Int8DynamicLinear) runs after the step
            logits = head(self.model, out) if self.head_apart else out
        if self.compiled and self.compile_seconds == 0.0:
            synchronize(self.model.device)
            self.compile_seconds = time.perf_counter() - start
        self.position += 1
        self.cache.length = self.position
        return logits[0, -1]

    def _decode(self, token: torch.Tensor, position: torch.Tensor, keys: list, values: list) -> torch.Tensor:
        """token (1, 1), position (1,) -> logits (1, 1, V) (or the last block's output (1, 1, hidden) when the head
        runs apart, after the compiled step). The model's own blocks, with a cache that writes at the
        position tensor and hands attention every column, and a mask over the columns written so far: no shape
        depends on the position."""
        model = self.model
        cos, sin = self.cos[position][None, None], self.sin[position][None, None]  # (1, 1, 1, D)
        seen = (self.columns <= position)[None, None, None]  # (1, 1, 1, capacity): the columns written so far
        cache = _Columns(keys, values)
        x = embed(model, token)  # (1, 1, hidden)
        for index in range(len(model.layers)):
            x = block(model, index, x, cos, sin, cache, position, seen)
        return x if self.head_apart else head(model, x)


class _Columns:
    """The cache as the static step's blocks see it: `write` puts this token's key and value at the column the
    position tensor names (index_copy_) and returns every column of the layer, written or not (the mask hides
    the rest)."""

    def __init__(self, keys: list, values: list):
        self.keys, self.values = keys, values

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor):
        self.keys[layer].index_copy_(2, position, k)  # (1, KV, capacity, D): this token's column
        self.values[layer].index_copy_(2, position, v)
        return self.keys[layer], self.values[layer]
