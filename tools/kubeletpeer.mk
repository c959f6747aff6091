# Make fragment: builds the kubelet-side device plugin peer (tools/kubeletpeer) that the device
# plugin tests talk to. Use it on its own or include it:
#
#   make -f tools/kubeletpeer.mk kubeletpeer-bin    # prints the binary's path on its last line
#
# Same scheme as tools/kube.mk: the binary lives outside the repo under a hash of everything that
# affects it, so checkouts on one machine share a build and any change yields a new path, which
# make then sees as missing (hence no file prerequisites).

KUBELETPEER_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/kubeletpeer
KUBELETPEER_HASH := $(shell { go env GOVERSION 2>/dev/null; cat $(KUBELETPEER_DIR)/go.mod $(KUBELETPEER_DIR)/go.sum $(KUBELETPEER_DIR)/*.go; } | sha256sum | cut -c1-12)
KUBELETPEER_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
KUBELETPEER_BIN := $(KUBELETPEER_CACHE_DIR)/kubeletpeer-$(KUBELETPEER_HASH)/kubeletpeer

$(KUBELETPEER_BIN):
	@mkdir -p $(@D)
	@echo "building the kubelet-side device plugin peer into $(@D)"
	cd $(KUBELETPEER_DIR) && CGO_ENABLED=0 go build -o $@.tmp.$$$$ . && mv -f $@.tmp.$$$$ $@

.PHONY: kubeletpeer-bin kubeletpeer-bin-clean
kubeletpeer-bin: $(KUBELETPEER_BIN)
	@echo $(KUBELETPEER_BIN)

# Removes every cached build, including ones other checkouts may still use.
kubeletpeer-bin-clean:
	rm -rf $(KUBELETPEER_CACHE_DIR)/kubeletpeer-*
