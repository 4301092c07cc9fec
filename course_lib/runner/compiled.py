"""The course's model with its decode steps compiled, in buckets: what `generate(..., compiled=True)` runs.

What it does: `CompiledRunner` wraps the course's own model (any weight format) and meets the same runner contract
(forward.Runner), so the stages and schedulers run it unchanged. Its caches are the course's KVCache with the
capacity rounded up to a bucket (CAPACITIES: 256 to 8,192 columns). A decode step (one token per row) on such a
cache, for a batch of BATCHES rows, goes through a static_step.StaticDecode built for that (rows, capacity, thread
count) the first time it is needed and compiled by torch.compile (tens of seconds on the CPU the first time; torch's
on-disk cache shortens later ones): the idea of a GPU engine's CUDA graphs captured per batch size, on the CPU.
Everything else (a prompt, several tokens at once, a cache of another shape, another runner's cache) runs the model
eagerly, as without it. Where torch.compile cannot build kernels (no C++ compiler), or for a transformers model,
every step runs eagerly and `why_eager` says why (printed once).
What it does not do: change the numbers in float32 beyond rounding order (the step attends over the whole bucket
with a mask: the tokens equal the eager path's on the running examples); in bfloat16 (the int4 format's
activations) a near-tie between two tokens can flip, and the engine's tests say where. It does not page: a paged
cache runs its decode eagerly through the block tables.
"""
from __future__ import annotations

import weakref

import torch

from .kv_cache import KVCache
from .model import Output
from .static_step import StaticDecode, compile_available

CAPACITIES = (256, 512, 1024, 2048, 4096, 8192)  # columns a compiled step's cache holds, smallest that fits wins
BATCHES = (1, 2, 4, 8)  # rows a compiled step runs; other counts run eagerly


def bucket(capacity: int, window: int) -> int:
    """The smallest bucket holding `capacity` columns, never past the window. Example: (300, 8192) -> 512"""
    return min([c for c in CAPACITIES if c >= capacity] + [window])


class CompiledRunner:
    """The course's model, its decode steps compiled per (rows, capacity) bucket. Example:
    runner = CompiledRunner(convert(ours, "int4")); generate(runner, tokenizer, ids, 64)  # same loop, faster steps"""

    def __init__(self, model, compile: bool = True):
        """compile=False runs the same static steps without compiling them (the tests' way to check the static path
        cheaply); without a C++ compiler every step runs the model eagerly, and why_eager says so."""
        self.model, self.config = model, model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.steps: dict[tuple, StaticDecode] = {}  # (rows, capacity, threads) -> its step
        if not hasattr(model, "layers") or not hasattr(model, "new_cache"):
            raise TypeError("a compiled step runs the course's own model: build it with Model.from_transformers(model) "
                            "(and formats.convert(ours, 'int4') for the 4-bit format)")
        ok, why = compile_available() if compile else (True, "")
        self.compile, self.why_eager = compile, why  # compile=False: the static steps run eagerly (for tests)
        if not ok:
            print(f"compiled step: running eagerly ({why})")
        self.static_calls = self.eager_calls = 0

    def __getattr__(self, name):  # the model's own parts (device, dtype, layers, weight_bytes...) read through
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KVCache of `batch` rows, its capacity rounded up to a bucket."""
        return self.model.new_cache(batch, bucket(capacity, self.config.max_position_embeddings))

    def step_for(self, rows: int, capacity: int) -> StaticDecode:
        """The compiled step of this bucket, built (and compiled at its first call) the first time it is asked for.
        note: torch.compile's CPU kernels are built for the thread count they were compiled at, so it is part of
        the key."""
        key = (rows, capacity, torch.get_num_threads())
        if key not in self.steps:
            self.steps[key] = StaticDecode(self.model, rows, capacity, compile=self.compile)
        return self.steps[key]

    def runs_compiled(self, input_ids: torch.Tensor, cache) -> bool:
        """Whether this call goes through a compiled step: one token per row, a KVCache of a bucket's shape."""
        if self.why_eager or input_ids.shape[1] != 1 or input_ids.shape[0] not in BATCHES:
            return False
        keys = getattr(cache, "keys", None)
        return (isinstance(cache, KVCache) and keys[0].shape[2] in CAPACITIES and keys[0].shape[0] == input_ids.shape[0]
                and cache.length < keys[0].shape[2])

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
