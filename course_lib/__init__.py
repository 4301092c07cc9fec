"""course_lib: the helpers behind the course's notebooks, one module per stage of the pipeline.

    import course_lib
    model, tokenizer = course_lib.load_model()

Modules, in pipeline order: runtime (device, dtype, timing), loading (model and tokenizer),
tokenization, context, forward (one pass, and run_model: the one call into a model, with the runner
contract) and anatomy (inside it), attention, sampling (pickers, and the acceptance rule for drafted
tokens), request (a request's record, result and stop conditions), generation (the step, its stages and
the one-request scheduler), kv_cache (the cache contract and the contiguous cache), batching (the batch
schedulers), serving with openai_api (the request dialect); Part II: model (SmolLM2 written out),
formats (weight formats), paged (the paged KV cache: blocks, block tables, prefix caching; its scheduler
is batching.PagedBatch), speculative (drafters), structured (grammar masks). Measurements: measure/
(timers; speed: timed runs; race: ours against the library; trace: lesson 13's paged trace; load: the
serving load generator; memory and quality: lesson 12's rates and agreement; bench and bench_part2: the
benchmark's sections). Pictures only: plots, plots_perf, html_views, widgets. Also doctor and exercises. Nothing
heavy is imported until it is used.
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
