# Make fragment: builds the Kubernetes multi-call binary (tools/kube) used by the
# integration tests, and next to it `fakecri` (tools/kube/fakecri), the fake
# container runtime the real kubelet runs against. Include it from the top-level
# Makefile:
#
#   include tools/kube.mk
#   test-integration: $(KUBE_BIN)
#
# The binary lives outside the repo, keyed by a hash of everything that affects
# it, so fresh clones on the same machine reuse a previous build (a cold build
# takes several minutes) and any change to tools/kube yields a new path, which
# make then sees as missing. That is also why the target has no file
# prerequisites: a new checkout's mtimes would otherwise force a rebuild.

KUBE_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/kube
# The default version is go.mod's (what `make test` runs on). KUBE_MINOR=1.X builds another
# minor version from compat/1.X.mod and compat/1.X.sum instead (`make test-kube KUBE_MINOR=1.X`;
# gen-replaces.sh writes them), with the same main.go and fakecri, into the same cache.
KUBE_DEFAULT_VERSION := $(shell awk '$$1 == "k8s.io/kubernetes" {print $$2; exit}' $(KUBE_DIR)/go.mod)
KUBE_DEFAULT_MINOR := $(patsubst v%,%,$(basename $(KUBE_DEFAULT_VERSION)))
KUBE_MINOR ?=
KUBE_MODFILE := $(if $(filter-out $(KUBE_DEFAULT_MINOR),$(KUBE_MINOR)),compat/$(KUBE_MINOR).mod,go.mod)
KUBE_SUMFILE := $(KUBE_MODFILE:.mod=.sum)
KUBE_VERSION := $(shell awk '$$1 == "k8s.io/kubernetes" {print $$2; exit}' $(KUBE_DIR)/$(KUBE_MODFILE) 2>/dev/null)
KUBE_VERSION_MAJOR := $(word 1,$(subst ., ,$(patsubst v%,%,$(KUBE_VERSION))))
KUBE_VERSION_MINOR := $(word 2,$(subst ., ,$(patsubst v%,%,$(KUBE_VERSION))))
KUBE_HASH := $(shell { go env GOVERSION 2>/dev/null; cat $(KUBE_DIR)/$(KUBE_MODFILE) $(KUBE_DIR)/$(KUBE_SUMFILE) $(KUBE_DIR)/*.go $(KUBE_DIR)/fakecri/*.go; } 2>/dev/null | sha256sum | cut -c1-12)
KUBE_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
KUBE_BIN_DIR := $(KUBE_CACHE_DIR)/kube-$(KUBE_HASH)
KUBE_BIN := $(KUBE_BIN_DIR)/kubebin
# Built in the same recipe, before kubebin: KUBE_BIN existing means both do.
FAKECRI_BIN := $(KUBE_BIN_DIR)/fakecri
# For recipes: the testbed's find_kubebin() reads it instead of calling make.
export KUBE_BIN
# Symlinks named after each component, so KUBE_BIN_DIR can go on PATH.
KUBE_COMPONENTS := kube-apiserver kube-controller-manager kube-scheduler etcd kubectl kubelet

# Without these the servers report v0.0.0-master, which kubectl and helm reject
# as skewed. client-go's copy is what `kubectl version --client` prints.
KUBE_LDFLAGS := $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
  -X $(p).gitVersion=$(KUBE_VERSION) -X $(p).gitMajor=$(KUBE_VERSION_MAJOR) \
  -X $(p).gitMinor=$(KUBE_VERSION_MINOR) -X $(p).gitTreeState=clean)

$(KUBE_BIN):
	@test -f $(KUBE_DIR)/$(KUBE_MODFILE) || { echo "no $(KUBE_DIR)/$(KUBE_MODFILE) for KUBE_MINOR=$(KUBE_MINOR): tools/kube/gen-replaces.sh v$(KUBE_MINOR).<patch> $(KUBE_MODFILE) pins one" >&2; exit 1; }
	@mkdir -p $(@D)
	@echo "building Kubernetes $(KUBE_VERSION) multi-call binary and fakecri into $(@D) (cold: several minutes)"
	cd $(KUBE_DIR) && CGO_ENABLED=0 go build -modfile=$(KUBE_MODFILE) -o $(FAKECRI_BIN).tmp.$$$$ ./fakecri && mv -f $(FAKECRI_BIN).tmp.$$$$ $(FAKECRI_BIN)
	cd $(KUBE_DIR) && CGO_ENABLED=0 go build -modfile=$(KUBE_MODFILE) -ldflags '$(KUBE_LDFLAGS)' -o $@.tmp.$$$$ . && mv -f $@.tmp.$$$$ $@
	@for c in $(KUBE_COMPONENTS); do ln -sfn kubebin $(@D)/$$c; done

.PHONY: kube-bin kube-bin-clean
kube-bin: $(KUBE_BIN)
	@echo $(KUBE_BIN)

# Removes every cached build, including ones other checkouts may still use.
kube-bin-clean:
	rm -rf $(KUBE_CACHE_DIR)/kube-*
