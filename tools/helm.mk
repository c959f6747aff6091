# Make fragment: builds helm (tools/helm: a Go module that pins helm.sh/helm/v3 as a `tool`) for
# the chart tests. Use it on its own or include it from the top-level Makefile:
#
#   make -f tools/helm.mk helm-bin    # prints the binary's path on its last line
#
#   include tools/helm.mk
#   test: $(HELM_BIN)
#
# Same scheme as tools/kube.mk: the binary lives outside the repo under a hash of everything that
# affects it, so checkouts on one machine share a build and any change yields a new path, which
# make then sees as missing (hence no file prerequisites).

HELM_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/helm
HELM_VERSION := $(shell awk '$$1 == "helm.sh/helm/v3" {print $$2; exit}' $(HELM_DIR)/go.mod)
# helm's own Makefile derives the Kubernetes version it assumes offline (`helm template` without
# --kube-version: .Capabilities.KubeVersion, and lint's deprecation checks) from client-go:
# v0.X.Y -> 1.X. Without it the binary claims Kubernetes 1.20.
HELM_CLIENT_GO := $(shell awk '$$1 == "k8s.io/client-go" {print $$2; exit}' $(HELM_DIR)/go.mod)
HELM_K8S_MINOR := $(word 2,$(subst ., ,$(HELM_CLIENT_GO)))
HELM_HASH := $(shell { go env GOVERSION 2>/dev/null; cat $(HELM_DIR)/go.mod $(HELM_DIR)/go.sum; } | sha256sum | cut -c1-12)
HELM_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
HELM_BIN := $(HELM_CACHE_DIR)/helm-$(HELM_HASH)/helm
# For recipes: the chart tests read it instead of calling make.
export HELM_BIN

HELM_LDFLAGS := -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
  -X helm.sh/helm/v3/internal/version.gitTreeState=clean \
  $(foreach p,helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules,\
    -X $(p).k8sVersionMajor=1 -X $(p).k8sVersionMinor=$(HELM_K8S_MINOR))

$(HELM_BIN):
	@mkdir -p $(@D)
	@echo "building helm $(HELM_VERSION) into $(@D)"
	cd $(HELM_DIR) && CGO_ENABLED=0 go build -trimpath -ldflags '$(HELM_LDFLAGS)' -o $@.tmp.$$$$ helm.sh/helm/v3/cmd/helm && mv -f $@.tmp.$$$$ $@

.PHONY: helm-bin helm-bin-clean
helm-bin: $(HELM_BIN)
	@echo $(HELM_BIN)

# Removes every cached build, including ones other checkouts may still use.
helm-bin-clean:
	rm -rf $(HELM_CACHE_DIR)/helm-*
