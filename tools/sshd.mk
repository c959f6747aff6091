# Make fragment: Debian's OpenSSH server and client, unpacked without root, for the UltraServer
# init tests (a real sshd on 127.0.0.1 stands in for the MPI workers). Include it from the
# top-level Makefile and make the tests depend on $(SSHD_STAMP):
#
#   include tools/sshd.mk
#   test: $(SSHD_STAMP)
#
#   make -f tools/sshd.mk sshd-root     # prints the install root on its last line
#
# `apt-get download` fetches the .debs by name (no root needed while the package lists are
# there; as root, a failed download runs `apt-get update` once and tries again) and `dpkg -x`
# unpacks them; nothing is installed system-wide. libwrap0 is sshd's one library the base image
# lacks (found through LD_LIBRARY_PATH); libnss-wrapper lets the tests give sshd its own passwd
# file (LD_PRELOAD), so it runs unprivileged with several worker accounts.
#
# Same scheme as tools/kube.mk: the install lives outside the repo under a hash of this file and
# the package versions apt would fetch, so checkouts share it and a change yields a new path.

SSHD_MK := $(lastword $(MAKEFILE_LIST))
SSHD_PACKAGES := openssh-server openssh-client openssh-sftp-server libwrap0 libnss-wrapper
SSHD_HASH := $(shell { cat $(SSHD_MK); apt-cache policy $(SSHD_PACKAGES) 2>/dev/null | grep -E '^[a-z]|Candidate'; } | sha256sum | cut -c1-12)
SSHD_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/neuron-scheduler
SSHD_ROOT := $(SSHD_CACHE_DIR)/sshd-$(SSHD_HASH)
SSHD_STAMP := $(SSHD_ROOT)/.installed
# For recipes: the tests read it instead of calling make.
export SSHD_ROOT

$(SSHD_STAMP):
	@echo "unpacking Debian's OpenSSH ($(SSHD_PACKAGES)) into $(SSHD_ROOT)"
	@set -e; tmp=$(SSHD_ROOT).tmp.$$$$; rm -rf $$tmp; mkdir -p $$tmp/debs; \
	if ! (cd $$tmp/debs && apt-get download -q $(SSHD_PACKAGES)); then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && (cd $$tmp/debs && apt-get download -q $(SSHD_PACKAGES)); \
	  else echo "sshd.mk: apt-get download failed: the package lists may be missing; run 'apt-get update' as root once" >&2; exit 1; fi; \
	fi; \
	for deb in $$tmp/debs/*.deb; do dpkg -x $$deb $$tmp; done; rm -rf $$tmp/debs; \
	libs=$$(find $$tmp -name 'libwrap.so.0' -printf '%h'); \
	missing=$$(LD_LIBRARY_PATH=$$libs ldd $$tmp/usr/sbin/sshd | grep 'not found' || true); \
	if [ -n "$$missing" ]; then echo "sshd.mk: sshd still lacks libraries: $$missing" >&2; exit 1; fi; \
	$$tmp/usr/bin/ssh -V; \
	rm -rf $(SSHD_ROOT); mv $$tmp $(SSHD_ROOT); touch $(SSHD_STAMP)

.PHONY: sshd-root sshd-clean
sshd-root: $(SSHD_STAMP)
	@echo $(SSHD_ROOT)

# Removes every cached install, including ones other checkouts may still use.
sshd-clean:
	rm -rf $(SSHD_CACHE_DIR)/sshd-*
