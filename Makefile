# meshscope: the two commands of the README's Quick start, plus the pieces they are made of.
# Everything installs into .venv so a fresh clone on a fresh machine needs nothing installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint typecheck contracts unit bench crds clean venv system-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# Debian packages the tests drive for real: headless Chromium renders the HTML report.
CHROMIUM := $(shell command -v chromium 2>/dev/null)
system-deps:
ifeq ($(CHROMIUM),)
	@echo "installing Debian's chromium for the report browser tests"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
endif

## make demo: train the bundled tiny job on 8 local CPU ranks and show the cost table, findings and report.
## Installs meshscope with its demo extra (torch==2.13.0, CPU) into .venv once; `make demo DEMO_ARGS="--straggler 5:2"`
## injects a fault (see `meshscope demo --help`).
DEMO_ARGS  ?=
DEMO_STAMP := $(VENV)/.demo-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	rm -f $(VENV)/.demo-*
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/meshscope demo $(DEMO_ARGS)

## make test: lint, type-check, architecture contracts, then the whole test suite
test: lint typecheck contracts unit

lint: $(STAMP)
	$(BIN)/ruff check src operator sidecar tests benchmarks
	$(BIN)/ruff format --check src operator sidecar tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

contracts: $(STAMP)
	$(BIN)/lint-imports

# A missing torch is an error here, not 35 tests quietly left out (tests/torch_gate.py).
unit: $(STAMP) system-deps
	MESHSCOPE_REQUIRE_TORCH=1 $(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_planner.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
