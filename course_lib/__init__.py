"""course_lib: the helpers behind the course's notebooks, grouped in wings that show the architecture.

    import course_lib
    model, tokenizer = course_lib.load_model()

At the top: runtime (device, dtype, seeds, timing, the one median), loading (model and tokenizer), doctor (the
workshop preflight) and the command line (__main__). The wings, each importing only those below it:
text (tokenization, context) < runner (forward, attention, attention_kernels, layout, model, formats,
static_step, kv_cache, blocks, paged) < inside (anatomy, probes) < engine (request, sampling, stages, schedulers,
paged_scheduler, generation, budget, speculative, structured, long_context) < serve (openai_api, engine_thread,
serving) < views (plots, plots_*, html_views, widgets) < measure (timers, the lessons' measurements and the bench's
sections) < exercises. tests/test_architecture.py checks that order. Nothing heavy is imported until it is used.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "load_model": "loading",
    "resolve_device": "runtime",
    "seed_everything": "runtime",
    "cl100k": "text.tokenization",
}


def __getattr__(name):
    # Lazy, so `python -m course_lib doctor` can report a missing package instead of crashing on import.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'course_lib' has no attribute {name!r}")
