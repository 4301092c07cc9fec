"""Build the rendered edition of the course: every lesson executed, as static HTML that works offline.

    .venv/bin/python scripts/build_site.py [--out build/site] [--only 00 05]

Each notebook runs top to bottom on this machine (so every number is from this run), its live widgets
are replaced by a note (every interactive view has a static figure beside it), and it is exported to
HTML with images embedded and no script or style fetched from the network. An index page lists the
lessons in order with the time each took to run.
"""
import argparse
import html
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
NOTE = ('<div style="border:1px dashed #999;padding:6px 10px;color:#555;font-style:italic">Interactive view: run '
        'this notebook in JupyterLab (<code>make course</code>) to use it. The static figures around it show the '
        'same data.</div>')
REMOTE = re.compile(r'<script[^>]*\ssrc="https?://[^"]*"[^>]*>\s*</script>|<link[^>]*\shref="https?://[^"]*"[^>]*>', re.I)


def execute(path: Path, timeout: int = 900) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    os.environ["COURSE_PROGRESS"] = "0"  # the kernel inherits it: no progress bars left in the pages
    NotebookClient(nb, timeout=timeout, kernel_name="llm-course",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def strip_widgets(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Replace live widget outputs by a note, and drop saved widget state (it would need JavaScript)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for i, out in enumerate(cell.get("outputs", [])):
            if WIDGET_MIME in out.get("data", {}):
                cell.outputs[i] = nbformat.v4.new_output("display_data", data={"text/html": NOTE})
    nb.metadata.pop("widgets", None)
    return nb


def to_html(nb: nbformat.NotebookNode) -> str:
    """Static HTML (lab template, images embedded) with every remote script and stylesheet removed."""
    body, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(nb)
    return REMOTE.sub("", body)


def title_of(nb: nbformat.NotebookNode, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^# (.+)$", cell.source, re.M)
            if match:
                return match.group(1).strip()
    return fallback


def index_page(pages: list[tuple[str, str, float]]) -> str:
    rows = "".join(f'<li><a href="{html.escape(href)}">{html.escape(title)}</a> <small>(ran in {seconds:.0f} s)</small></li>'
                   for href, title, seconds in pages)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>How a language model answers a prompt</title>"
            "</head><body style='font-family:sans-serif;max-width:46em;margin:2em auto'>"
            "<h1>How a language model answers a prompt</h1><p>The rendered edition: every lesson executed on a real "
            f"model, {time.strftime('%Y-%m-%d')}. Open the notebooks in JupyterLab for the interactive views.</p>"
            f"<ol start='0'>{rows}</ol></body></html>")


def build(out: Path, only: list[str] | None = None) -> list[tuple[str, str, float]]:
    out.mkdir(parents=True, exist_ok=True)
    pages = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if only and path.name[:2] not in only:
            continue
        start = time.perf_counter()
        nb = strip_widgets(execute(path))
        seconds = time.perf_counter() - start
        href = path.stem + ".html"
        (out / href).write_text(to_html(nb), encoding="utf-8")
        pages.append((href, title_of(nb, path.stem), seconds))
        print(f"{path.name}: {seconds:.0f} s -> {out / href}", flush=True)
    (out / "index.html").write_text(index_page(pages), encoding="utf-8")
    return pages


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "build" / "site"))
    parser.add_argument("--only", nargs="*", help="lesson numbers to build, e.g. 00 05 (default: all)")
    args = parser.parse_args()
    build(Path(args.out), args.only)
    print(f"open {Path(args.out) / 'index.html'}")
    sys.exit(0)
