"""The course's benchmark command: run the sections, report their targets, save the results.

What it does: `SECTIONS` lists every section of `python -m course_lib bench` in order (each a measure.section.Section
declared beside its own measurements: prefill_decode, loop, engine, formats, speculative, trace, structured,
serving, fork (n > 1 and best-of-N), attention, long_context, fleet, workshop); `run()` measures the chosen ones in one run on one device, `targets()` and
`format_report()` gather what each section says of itself, `save()` writes JSON (and the prefill and decode figure).
What it does not do: measure anything itself, or assert (targets are reported, not tested).
"""
from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..runtime import describe_device
from . import (attention, engine_section, fleet, fork, formats, long_context, loop, prefill_decode, serving,
               speculative, structured, trace, workshop)

# The sections in the order they run; each returns a dict merged into the result, whose keys are the JSON keys the
# issues name.
SECTIONS = {s.name: s for s in [prefill_decode.LOAD, loop.LOOP_VS_GENERATE, loop.CACHE, prefill_decode.PREFILL,
                                prefill_decode.DECODE, loop.WIDGETS, loop.DETOKENIZE, engine_section.SECTION, formats.SECTION,
                                speculative.SECTION, trace.SECTION, structured.SECTION, serving.SECTION,
                                fork.SERVING, fork.BEST_OF, attention.SECTION, long_context.SECTION,
                                fleet.SECTION, workshop.SECTION]}


def parse_only(only: str | None) -> list[str]:
    """'engine,cache' -> ['engine', 'cache']; None -> every section. Unknown names are an error that lists them all."""
    if not only:
        return list(SECTIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"unknown bench section(s) {unknown or only!r}: choose from {', '.join(SECTIONS)}")
    return names


def run(model, tokenizer, quick: bool = False, only: str | None = None, progress: bool | None = None) -> dict:
    """The benchmark's sections (all, or those named in `only`), in one run on one device.
    quick: tiny sizes (for tests). progress: a bar over sections (default: only when stderr is a terminal)."""
    import sys
    from tqdm.auto import tqdm
    names = parse_only(only)
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "machine": describe_device(model.device), "dtype": str(model.dtype).split(".")[-1], "quick": quick,
              "threads": torch.get_num_threads(), "sections": names}
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(names, desc="bench", disable=not show, unit="section")
    for name in bar:
        section = SECTIONS[name]
        bar.set_postfix_str(section.label)
        if not show and progress is None:
            print(f"measuring: {section.label}", flush=True)
        result.update(section.run(model, tokenizer, quick))
    return result


def ran(result: dict) -> list[str]:
    """The sections a result holds: its own list, or (an older file without one) every section whose key is in it."""
    return result.get("sections") or [n for n in SECTIONS if n in result or (n == "load" and "load_seconds" in result)]


def targets(result: dict) -> list[tuple[str, str, bool]]:
    """The course's speed targets for the sections that ran, as (what, measured, met)."""
    return [row for name in ran(result) for row in SECTIONS[name].targets(result)]


def format_report(result: dict) -> str:
    m = result["machine"]
    lines = [f"benchmark on {m['name']} ({m['device']}, {result['dtype']}, {result.get('threads', '?')} threads), "
             f"{result['when']}", ""]
    lines += [line for name in ran(result) for line in SECTIONS[name].report(result)]
    lines += ["", f"{'target':<60} {'measured':<28} met"]
    lines += [f"{what:<60} {measured:<28} {'yes' if met else 'NO'}" for what, measured, met in targets(result)]
    return "\n".join(lines)


def save(result: dict, folder: Path) -> list[Path]:
    """Write the result JSON, and a PNG of the prefill and decode curves when those sections ran, into folder.
    The figure is drawn on its own canvas: the caller's matplotlib backend is left alone."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"bench-{result['machine']['device'].split(':')[0]}-{result['when'][:10]}"
    if result["sections"] != list(SECTIONS):
        name += "-" + "-".join(result["sections"])
    json_path = folder / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2))
    paths = [json_path]
    if "prefill" in result and "decode" in result:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from ..views import plots_perf
        fig = plots_perf.plot_benchmark(result)
        FigureCanvasAgg(fig).print_png(str(folder / f"{name}.png"))
        import matplotlib.pyplot as plt
        plt.close(fig)
        paths.append(folder / f"{name}.png")
    return paths
