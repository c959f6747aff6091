# One entry point for developers and CI: `make demo`, `make test`.
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
PYTEST_ARGS ?=

.PHONY: demo test test-kube test-kube-all kube-minor sync lint typecheck unit property e2e bench clean cluster

# uv itself comes from PyPI; everything else comes from the committed lockfile.
$(UV):
	python3 -m pip install --user --quiet uv

# --all-extras: the tests and `make demo` draw pictures (matplotlib, the `sim` extra).
sync: $(UV)
	$(UV) sync --locked --all-extras --quiet

# Before the rules that name their variables: prerequisites are expanded as they are read.
include tools/kube.mk
include tools/kubeletpeer.mk
include tools/sshd.mk
include tools/helm.mk
include tools/image.mk
include tools/autoscaler.mk
include tools/kueue.mk
include tools/tlsdial.mk

demo: sync
	$(UV) run neuron-scheduler simulate --report report
	@echo "pictures: report/device-maps.png report/utilization.png (one per node in report/nodes/)"

lint: sync
	$(UV) run ruff check src tests bench
	$(UV) run ruff format --check src tests bench
	$(UV) run lint-imports

typecheck: sync
	$(UV) run mypy --strict src

# In a random order (modules shuffled, and the tests within each), so a test that passes only
# after another fails here; the seed is printed first and last. Replay an order with
# PYTEST_ARGS=--random-order-seed=N; RANDOM_ORDER= runs the tests in file order.
RANDOM_ORDER ?= --random-order-bucket=module
test: lint typecheck $(KUBE_BIN) $(KUBELETPEER_BIN) $(SSHD_STAMP) $(HELM_BIN) $(AUTOSCALER_STAMP) $(KUEUE_STAMP) $(TLSDIAL_BIN) image
	$(UV) run pytest $(RANDOM_ORDER) $(PYTEST_ARGS)

# The compatibility run on another Kubernetes minor version, e.g. `make test-kube KUBE_MINOR=1.33`:
# its binaries are built from tools/kube/compat/1.33.mod into the same cache, and the tests marked
# `compat` run on them (tests marked `needs` skip on versions without what they use, saying why).
# Not part of `make test`, which runs everything on the default version (tools/kube/go.mod).
# docs/install.md "Tested on" has each version's result and how long a run takes.
KUBE_MINORS := $(sort $(patsubst %.mod,%,$(notdir $(wildcard tools/kube/compat/*.mod))) $(KUBE_DEFAULT_MINOR))
test-kube: kube-minor sync $(KUBE_BIN) $(KUBELETPEER_BIN) $(HELM_BIN)
	$(UV) run pytest $(RANDOM_ORDER) -m compat tests/e2e $(PYTEST_ARGS)

kube-minor:
	@test -n "$(KUBE_MINOR)" || { echo "usage: make test-kube KUBE_MINOR=1.X, 1.X one of: $(KUBE_MINORS)" >&2; exit 2; }

# Every version in turn, one build at a time (a cold build is minutes of both cores).
test-kube-all:
	@set -e; for minor in $(KUBE_MINORS); do $(MAKE) --no-print-directory test-kube KUBE_MINOR=$$minor; done

# A local control plane with the extender and my-scheduler, for kubectl by hand (Ctrl-C stops it).
# The testbed is test infrastructure (tests/testbed), not part of the installed package.
# CLUSTER_ARGS=--real-node (as root) adds a node with a real kubelet and our device plugin.
cluster: sync $(KUBE_BIN)
	$(UV) run python -m tests.testbed.cluster $(CLUSTER_ARGS)

e2e: sync $(KUBE_BIN) $(KUBELETPEER_BIN) $(SSHD_STAMP) $(HELM_BIN) $(AUTOSCALER_STAMP) $(KUEUE_STAMP) image
	$(UV) run pytest tests/e2e $(PYTEST_ARGS)

unit: sync
	$(UV) run pytest tests/unit $(PYTEST_ARGS)

property: sync
	$(UV) run pytest tests/property $(PYTEST_ARGS)

# The figures go to BENCHMARKS.md by hand, with the machine they ran on; `make test` runs every
# benchmark at its smallest size, as a smoke test (tests/bench).
bench: sync $(KUBE_BIN)
	$(UV) run python bench/allocator.py
	$(UV) run python bench/simulate.py
	$(UV) run python bench/extender.py
	$(UV) run python bench/extender_cpu.py
	$(UV) run python bench/throughput.py
	$(UV) run python bench/throughput.py --full-node-list
	$(UV) run python bench/preemption.py

clean:
	rm -rf report .pytest_cache .mypy_cache .ruff_cache .hypothesis
