# Make fragment: builds Karpenter's kwok cloud provider (tools/autoscaler/karpenter-kwok: its main
# plus the ResourceSliceTemplates step the DRA test needs) and kwok, which keeps the provider's
# fake Nodes Ready, for the autoscaler tests (tests/e2e/test_autoscaling.py). Use it on its own or
# include it from the top-level Makefile:
#
#   make -f tools/autoscaler.mk autoscaler-bin    # prints the directory on its last line
#
#   include tools/autoscaler.mk
#   test: $(AUTOSCALER_STAMP)
#
# Its own Go module: Karpenter v1.15.0 declares go 1.26.9, newer than the machine's Go, so its
# builds run with GOTOOLCHAIN=go1.27.3 (the go command fetches that toolchain from the Go module
# proxy, as a module). tools/kube keeps the machine's Go: a module's go line forces its toolchain
# on everything the module builds.
#
# Next to the binaries: the CRDs Karpenter needs (NodePool, NodeClaim, KWOKNodeClass) and kwok's
# "fast" stages, copied from the same module versions (kwok exits without stages).
#
# Same scheme as tools/kube.mk: everything lives outside the repo under a hash of what affects
# it, so checkouts on one machine share a build and any change yields a new path, which make then
# sees as missing (hence no file prerequisites).

AUTOSCALER_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/autoscaler
AUTOSCALER_GOTOOLCHAIN := go1.27.3
AUTOSCALER_GO := GOTOOLCHAIN=$(AUTOSCALER_GOTOOLCHAIN) CGO_ENABLED=0 go
AUTOSCALER_HASH := $(shell { echo $(AUTOSCALER_GOTOOLCHAIN); cat $(AUTOSCALER_DIR)/go.mod $(AUTOSCALER_DIR)/go.sum $(AUTOSCALER_DIR)/*/*.go; } | sha256sum | cut -c1-12)
AUTOSCALER_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
AUTOSCALER_BIN_DIR := $(AUTOSCALER_CACHE_DIR)/autoscaler-$(AUTOSCALER_HASH)
# Written last: its presence means everything above it is there.
AUTOSCALER_STAMP := $(AUTOSCALER_BIN_DIR)/.built
# For recipes: the tests read it instead of calling make.
export AUTOSCALER_BIN_DIR

$(AUTOSCALER_STAMP):
	@mkdir -p $(@D)
	@echo "building Karpenter's kwok provider and kwok into $(@D) (cold: several minutes)"
	@set -e; cd $(AUTOSCALER_DIR); tmp=$(@D)/tmp.$$$$; rm -rf $$tmp; mkdir -p $$tmp/crds $$tmp/stages; \
	$(AUTOSCALER_GO) build -trimpath -o $$tmp/karpenter-kwok ./karpenter-kwok; \
	$(AUTOSCALER_GO) build -trimpath -o $$tmp/kwok sigs.k8s.io/kwok/cmd/kwok; \
	karpenter=$$($(AUTOSCALER_GO) list -m -f '{{.Dir}}' sigs.k8s.io/karpenter); \
	kwok=$$($(AUTOSCALER_GO) list -m -f '{{.Dir}}' sigs.k8s.io/kwok); \
	cp $$karpenter/kwok/charts/crds/*.yaml $$karpenter/kwok/apis/crds/karpenter.kwok.sh_kwoknodeclasses.yaml $$tmp/crds/; \
	for stage in node/fast node/heartbeat-with-lease pod/fast; do cp $$kwok/kustomize/stage/$$stage/*.yaml $$tmp/stages/; done; \
	rm -f $$tmp/stages/kustomization.yaml; chmod -R u+w $$tmp; \
	for f in karpenter-kwok kwok crds stages; do rm -rf $(@D)/$$f; mv $$tmp/$$f $(@D)/$$f; done; rmdir $$tmp; \
	touch $@

.PHONY: autoscaler-bin autoscaler-bin-clean
autoscaler-bin: $(AUTOSCALER_STAMP)
	@echo $(AUTOSCALER_BIN_DIR)

# Removes every cached build, including ones other checkouts may still use.
autoscaler-bin-clean:
	rm -rf $(AUTOSCALER_CACHE_DIR)/autoscaler-*
