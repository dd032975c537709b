# The README's two commands: `make demo` and `make test` (and `make docs`). Each builds .venv/ from nothing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

# Triton reads this when a kernel is defined, so it is set for the whole run;
# which code path runs is chosen per call, never by this variable.
export TRITON_INTERPRET := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test lint types docs unit venv clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	@# torch first, from the CPU wheel that lies on these machines; then the rest.
	$(BIN)/pip install --quiet torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(BIN)/pip install --quiet -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import ipnext, torch, triton, ray, temporalio, ortools" 
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/ipnext demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy -p ipnext

docs: $(STAMP)
	@# The site (mkdocs.yml, docs/) into site/; `make test` builds it too, with --strict, in
	@# tests/unit/test_docs.py.
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: lint types
	@# Two workers; tests/conftest.py hands them work units (each half of the drills on a stack of its own).
	@# Short tracebacks: a failed drill's stack report (its own section) then shows in a log's first screens.
	$(BIN)/pytest -n 2 -ra --tb=short --durations=25 $(ARGS)

clean:
	rm -rf $(VENV) .ipnext .pytest_cache .mypy_cache .ruff_cache site
