"""course_lib: the helpers behind the course's notebooks, one module per stage of the pipeline.

    import course_lib
    model, tokenizer = course_lib.load_model()

Modules, in pipeline order: runtime (device, dtype, timing), loading (model and tokenizer),
tokenization, context, forward (one pass) and anatomy (inside it), attention, sampling, generation
(the one inference core), kv_cache, batching, serving with openai_api (the request dialect); Part II:
model (SmolLM2 written out), formats (weight formats), paged (the paged KV cache: blocks, block tables,
prefix caching; its scheduler is batching.PagedBatch), speculative (drafters, verify), structured
(grammar masks). Measurements: bench (with bench_part2, its Part II sections), engine_speed, paged_runs. Pictures only: plots, plots_perf, html_views,
widgets. Also doctor and exercises. Nothing heavy is imported until it is used.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "load_model": "loading",
    "resolve_device": "runtime",
    "seed_everything": "runtime",
    "cl100k": "tokenization",
}


def __getattr__(name):
    # Lazy, so `python -m course_lib doctor` can report a missing package instead of crashing on import.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'course_lib' has no attribute {name!r}")
