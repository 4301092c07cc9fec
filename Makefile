# The course's commands. `make course` sets up and opens the course; `make test` sets up and runs every test.
.PHONY: setup course test doctor bench clean-cache

setup:
	bash scripts/setup.sh

course: setup
	.venv/bin/jupyter lab notebooks/00_pipeline_tour.ipynb

test: setup
	.venv/bin/python -m pytest

doctor: setup
	.venv/bin/python -m course_lib doctor

bench: setup
	.venv/bin/python -m course_lib bench

clean-cache:
	rm -rf .course_cache
