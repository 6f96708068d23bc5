# The two commands of the README: `make run` and `make test`. Everything they
# need is installed from here, into .venv and ~/.cache/tandem/.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NIXL_VERSION := 1.5.1

.PHONY: run test venv k8s-bins cluster cluster-down lint bench clean

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.3
	$(BIN)/pip install -q -e '.[worker,operator,dev]'
	# NIXL after torch, so its resolver sees the torch already installed.
	$(BIN)/pip install -q nixl-cu12==$(NIXL_VERSION)
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem up $(ARGS)

k8s-bins:
	hack/k8s-bins.sh

test: $(STAMP) k8s-bins
	KUBEBUILDER_ASSETS="$$(hack/k8s-bins.sh --print-dir)" $(BIN)/pytest $(PYTEST_ARGS)

cluster: $(STAMP) k8s-bins
	KUBEBUILDER_ASSETS="$$(hack/k8s-bins.sh --print-dir)" $(BIN)/python -m tandem.testing.cluster up

cluster-down:
	$(BIN)/python -m tandem.testing.cluster down

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .cluster
