# meshscope: the two commands of the README's Quick start, plus the pieces they are made of.
# Everything installs into .venv so a fresh clone on a fresh machine needs nothing installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint typecheck contracts unit bench mutate crds chart-files clean venv system-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# Debian packages the tests drive for real, each installed only when its binaries are missing: headless Chromium
# renders the HTML report; Prometheus (`prometheus`, `promtool`) runs and unit-tests the sidecar's recording rules
# and the dashboard's queries; VictoriaMetrics (`victoria-metrics`, `vmalert`, both in Debian's victoria-metrics
# package) evaluates the same rules on a store that scales out (tests/sidecar/promstack.py starts them on loopback).
# --no-install-recommends keeps prometheus-node-exporter out; where systemd runs, the packages' own services start
# on their default ports (9090, 8428), which the tests never use. g++: torch.compile's inductor backend compiles C++
# on CPU (tests/sdk/test_capture.py compiles a block with it).
have = $(shell command -v $(1) 2>/dev/null)
SYSTEM_PKGS := $(strip \
  $(if $(call have,g++),,g++) \
  $(if $(call have,chromium),,chromium fonts-liberation) \
  $(if $(and $(call have,prometheus),$(call have,promtool)),,prometheus) \
  $(if $(and $(call have,victoria-metrics),$(call have,vmalert)),,victoria-metrics))
system-deps:
ifneq ($(SYSTEM_PKGS),)
	@echo "installing Debian's $(SYSTEM_PKGS) for the tests that drive them for real"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PKGS) >/dev/null
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
	$(BIN)/ruff check src operator sidecar tests benchmarks tools
	$(BIN)/ruff format --check src operator sidecar tests benchmarks tools

typecheck: $(STAMP)
	$(BIN)/mypy

contracts: $(STAMP)
	$(BIN)/lint-imports

# A missing torch is an error here, not 35 tests quietly left out (tests/torch_gate.py).
# Two workers (tests/conftest.py): the tests that run training ranks one after another on one of them, every other
# file, whole, on whichever is free.
unit: $(STAMP) system-deps
	MESHSCOPE_REQUIRE_TORCH=1 $(BIN)/pytest -q -n 2 --dist loadscope

## make mutate: mutation testing of the core's critical modules, a group at a time within a budget (docs/testing.md);
## `make mutate MUTATE_ARGS="diagnosis --budget-seconds 1800 --survivors"`. Not part of `make test`.
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py $(MUTATE_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_planner.py

## make chart-files (or make crds): copy the CRD, the recording rules and the dashboard into the Helm chart, which
## can read only its own folder; tests/chart fails while a copy differs from its source.
CHART_FILES := charts/meshscope/files
chart-files:
	cp crds/trainingjobs.meshscope.io.yaml $(CHART_FILES)/crds/
	cp sidecar/monitoring/recording-rules.yaml sidecar/monitoring/dashboard.json $(CHART_FILES)/monitoring/

crds: chart-files

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .mutate
