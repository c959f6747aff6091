# Make fragment: builds tlsdial (tools/tlsdial: Go's standard library only), kube-scheduler's side
# of a connection to the extender for bench/tls_handshake.py. Use it on its own or include it:
#
#   make -f tools/tlsdial.mk tlsdial-bin    # prints the binary's path on its last line
#
# Same scheme as tools/kube.mk: the binary lives outside the repo under a hash of everything that
# affects it, so checkouts on one machine share a build and any change yields a new path, which
# make then sees as missing (hence no file prerequisites).

TLSDIAL_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/tlsdial
TLSDIAL_HASH := $(shell { go env GOVERSION 2>/dev/null; cat $(TLSDIAL_DIR)/go.mod $(TLSDIAL_DIR)/*.go; } | sha256sum | cut -c1-12)
TLSDIAL_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
TLSDIAL_BIN := $(TLSDIAL_CACHE_DIR)/tlsdial-$(TLSDIAL_HASH)/tlsdial
# For recipes: bench/tls_handshake.py reads it instead of calling make.
export TLSDIAL_BIN

$(TLSDIAL_BIN):
	@mkdir -p $(@D)
	@echo "building tlsdial into $(@D)"
	cd $(TLSDIAL_DIR) && CGO_ENABLED=0 go build -o $@.tmp.$$$$ . && mv -f $@.tmp.$$$$ $@

.PHONY: tlsdial-bin tlsdial-bin-clean
tlsdial-bin: $(TLSDIAL_BIN)
	@echo $(TLSDIAL_BIN)

# Removes every cached build, including ones other checkouts may still use.
tlsdial-bin-clean:
	rm -rf $(TLSDIAL_CACHE_DIR)/tlsdial-*
