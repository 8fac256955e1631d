# Two commands on a fresh machine:  make demo  (main job on the embedded store)  and  make test.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test lint bench clean

$(VENV)/.installed: pyproject.toml bed/pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch from local disk first, so no resolver ever pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench]'
	# the test bed (simulated engines, peers, benches, the demo's fleet): a package of its own, not in the product
	$(PIP) install -q -e ./bed
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/triscope demo

# pytest exits 5 when it collects no tests; that is not a failure here.
test: setup lint
	$(PY) -m pytest -q -ra --durations=25; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# ruff (style, stale noqa, line length) and mypy over the one triscope namespace.
lint: setup
	$(VENV)/bin/ruff check .
	$(PY) tools/typecheck.py

bench: setup
	$(PY) bench/trace_ingest.py

clean:
	rm -rf $(VENV) var .pytest_cache
