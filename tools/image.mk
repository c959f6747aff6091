# Make fragment: the image built from the repository's Dockerfile without pulling from any image
# registry (tools/image/build.sh says how), for tests/e2e/test_image.py. Include it from the
# top-level Makefile and make the tests depend on `image`:
#
#   include tools/image.mk
#   test: image
#
#   make image          # builds it unless an image of the same content exists; prints its name
#
# CI machines start clean, so the Debian tools it needs (podman, runc, mmdebstrap) are installed
# here with apt-get when missing (as root: rootful podman is what runs the image). The image
# lives in podman's storage under a name that hashes everything that goes into it, so a second
# `make image` on an unchanged checkout is a lookup, and a source change rebuilds only the last
# layers.

IMAGE_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/image
IMAGE_TOOLS := podman runc mmdebstrap
# For recipes: tests/e2e/test_image.py reads it instead of calling make.
NEURON_SCHEDULER_IMAGE := $(shell $(IMAGE_DIR)/build.sh --name 2>/dev/null)
export NEURON_SCHEDULER_IMAGE

.PHONY: image image-tools image-clean
image: image-tools
	@$(if $(UV),UV=$(UV)) $(IMAGE_DIR)/build.sh

# A failed install runs `apt-get update` once and tries again (a fresh machine has no lists).
image-tools:
	@missing=; for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "image.mk:$$missing missing; as root: make image-tools" >&2; exit 1; fi; \
	  echo "image.mk: installing$$missing from Debian's packages"; \
	  apt-get install -y -q --no-install-recommends $(IMAGE_TOOLS) \
	    || { apt-get update -q && apt-get install -y -q --no-install-recommends $(IMAGE_TOOLS); }; \
	fi

# Removes every build, including other checkouts', with the base and uv images and the build
# stages' cached layers (podman's untagged images, all of them): the next `make image` is cold.
image-clean: image-tools
	@images=$$($(IMAGE_DIR)/podman.sh images --format '{{.Repository}}:{{.Tag}}' \
	  | grep -E '^localhost/neuron-scheduler(-base|-uv)?:' || true); \
	if [ -n "$$images" ]; then $(IMAGE_DIR)/podman.sh rmi $$images; fi
	$(IMAGE_DIR)/podman.sh image prune --force
