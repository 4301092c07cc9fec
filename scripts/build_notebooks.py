"""Build notebooks/NN_name.ipynb from notebooks/src/NN_name.py (the reviewable source), without outputs.

Source format: cells start with `# %% [markdown]` (each following line begins with "# ") or `# %%`.
Usage: python scripts/build_notebooks.py          write every notebook
       python scripts/build_notebooks.py --check  exit 1 if a notebook differs from its source
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = {"name": "llm-course", "display_name": "LLM course (.venv)", "language": "python"}


def parse(source: str) -> list[dict]:
    cells, kind, lines = [], None, []

    def flush():
        while lines and not lines[-1].strip():
            lines.pop()
        if kind is not None and lines:
            text = "\n".join(lines) + ("\n" if kind == "markdown" else "")
            cell = {"cell_type": kind, "metadata": {}, "source": text}
            if kind == "code":
                cell.update(execution_count=None, outputs=[])
            cells.append(cell)

    for line in source.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        elif kind is not None:
            lines.append(line)
    flush()
    for i, cell in enumerate(cells):
        cell["id"] = f"c{i:03d}"
    return cells


def build(src: Path) -> str:
    nb = {"cells": parse(src.read_text()), "metadata": {"kernelspec": KERNEL,
          "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(check: bool) -> int:
    stale = []
    for src in sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")):
        target = ROOT / "notebooks" / (src.stem + ".ipynb")
        text = build(src)
        if check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
    if stale:
        print("out of date with notebooks/src (run python scripts/build_notebooks.py):", ", ".join(stale))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))
