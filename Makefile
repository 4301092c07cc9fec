# The course's commands. `make course` sets up and opens the course; `make test` sets up and runs every test.
.PHONY: setup course test doctor bench site clean-cache

# Set-up itself is plain Python (scripts/setup.py), so it also runs without make: `python scripts/setup.py`.
PYTHON ?= python3

setup:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "setup: no '$(PYTHON)' found. Install Python 3.10 or newer, or run: make setup PYTHON=/path/to/python3" >&2; exit 1; }
	@$(PYTHON) scripts/setup.py --route make

# JupyterLab refuses to run as root unless told; containers and workshop VMs often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

course: setup
	.venv/bin/jupyter lab $(ROOT_FLAG) notebooks/00_pipeline_tour.ipynb

test: setup
	.venv/bin/python -m pytest

doctor: setup
	.venv/bin/python -m course_lib doctor

bench: setup
	.venv/bin/python -m course_lib bench --out build/bench
	@if [ -x /usr/bin/chromium ]; then .venv/bin/python scripts/browser_check.py --out build/bench/browser; \
	else echo "bench: no /usr/bin/chromium, so no browser timings (apt-get install chromium)"; fi

site: setup
	.venv/bin/python scripts/build_site.py --out build/site

clean-cache:
	rm -rf .course_cache
