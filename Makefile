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

# vLLM for `zbus bench --compare`, in a venv of its own: its wheel without its
# dependencies (which name a CUDA torch), plus the few modules its message queue imports.
VLLM_VENV := .venv-vllm
VLLM := vllm==0.34.0 packaging urllib3 regex

.PHONY: demo test lint bench bench-compare venv clean

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

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -e '.[test]'
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(VLLM)
	touch $@

bench-compare: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/zbus bench --compare

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
