# The two commands a newcomer needs; each sets up what it needs on a fresh machine.
#   make demo   run the demo cluster
#   make test   run the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build the project is tested with; it is installed
# first so nothing later resolves a (much larger) CUDA build.
TORCH := torch==2.13.0
# Machines of this project keep the CPU wheel of that torch in /opt/wheels.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

.PHONY: demo test lint bench venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) $(TORCH)
	$(PY) -m pip install -q $(FIND_LINKS) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/zbus demo

test: venv
	$(VENV)/bin/ruff check zbus tests benchmarks examples
	$(PY) -m pytest -q

bench: venv
	$(VENV)/bin/zbus bench

clean:
	rm -rf $(VENV) .pytest_cache
