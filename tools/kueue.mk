# Make fragment: builds Kueue v0.17.0 (tools/kueue: sigs.k8s.io/kueue/cmd/kueue) and JobSet
# v0.11.1's controller (tools/kueue/jobset: sigs.k8s.io/jobset), and renders what installs them
# (`kubectl kustomize config/default` of each module, with the testbed's kubectl), for the Kueue
# tests (tests/e2e/test_kueue.py via tests/testbed/kueue.py). Use it on its own or include it from
# the top-level Makefile after tools/kube.mk:
#
#   make -f tools/kueue.mk kueue-bin    # prints the directory on its last line
#
#   include tools/kueue.mk
#   test: $(KUEUE_STAMP)
#
# JobSet is a module of its own: v0.11.1 does not build against the controller-runtime that
# Kueue's go.mod selects (v0.23.3: "not enough arguments in call to ctrl.NewWebhookManagedBy").
# Both keep the machine's Go (their go lines say 1.25.0).
#
# Same scheme as tools/kube.mk: everything lives outside the repo under a hash of what affects
# it, so checkouts on one machine share a build and any change yields a new path, which make then
# sees as missing (hence no file prerequisites). The manifests are plain kustomize output: the
# kubectl that renders them does not enter the hash.

KUEUE_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/kueue
ifndef KUBE_BIN
include $(KUEUE_DIR)/../kube.mk
endif
KUEUE_GO := CGO_ENABLED=0 go
KUEUE_HASH := $(shell { go env GOVERSION 2>/dev/null; cat $(KUEUE_DIR)/go.mod $(KUEUE_DIR)/go.sum $(KUEUE_DIR)/jobset/go.mod $(KUEUE_DIR)/jobset/go.sum; } | sha256sum | cut -c1-12)
KUEUE_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
KUEUE_BIN_DIR := $(KUEUE_CACHE_DIR)/kueue-$(KUEUE_HASH)
# Written last: its presence means everything above it is there.
KUEUE_STAMP := $(KUEUE_BIN_DIR)/.built
# For recipes: the tests read it instead of calling make.
export KUEUE_BIN_DIR

# kubectl comes from tools/kube.mk's build (order-only: a rebuilt kubectl renders the same files).
$(KUEUE_STAMP): | $(KUBE_BIN)
	@mkdir -p $(@D)
	@echo "building Kueue and JobSet's controller into $(@D) (cold: several minutes)"
	@set -e; tmp=$(@D)/tmp.$$$$; rm -rf $$tmp; mkdir -p $$tmp; \
	kubectl=$(KUBE_BIN_DIR)/kubectl; \
	(cd $(KUEUE_DIR) && $(KUEUE_GO) build -trimpath -ldflags='-s -w' -o $$tmp/kueue sigs.k8s.io/kueue/cmd/kueue); \
	(cd $(KUEUE_DIR)/jobset && $(KUEUE_GO) build -trimpath -ldflags='-s -w' -o $$tmp/jobset sigs.k8s.io/jobset); \
	kueue=$$(cd $(KUEUE_DIR) && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue); \
	jobset=$$(cd $(KUEUE_DIR)/jobset && go list -m -f '{{.Dir}}' sigs.k8s.io/jobset); \
	$$kubectl kustomize $$kueue/config/default > $$tmp/kueue.yaml; \
	$$kubectl kustomize $$jobset/config/default > $$tmp/jobset.yaml; \
	for f in kueue jobset kueue.yaml jobset.yaml; do mv -f $$tmp/$$f $(@D)/$$f; done; rmdir $$tmp; \
	touch $@

.PHONY: kueue-bin kueue-bin-clean
kueue-bin: $(KUEUE_STAMP)
	@echo $(KUEUE_BIN_DIR)

# Removes every cached build, including ones other checkouts may still use.
kueue-bin-clean:
	rm -rf $(KUEUE_CACHE_DIR)/kueue-*
