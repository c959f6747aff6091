# syntax=docker/dockerfile:1
# One image for the extender, the device plugin and the UltraServer tools:
#   docker build -t neuron-scheduler:0.1.0 .
#   docker run --rm neuron-scheduler:0.1.0 extender --help
# The chart runs it with `extender ...` or `device-plugin ...` as arguments.

ARG PYTHON_VERSION=3.11
ARG DEBIAN=bookworm
# Both stages' base and the image uv is copied from. The published build takes the defaults; a
# build that pulls nothing (tools/image/build.sh, `make image`) passes a local Debian base with
# Python ${PYTHON_VERSION} in it and a local image holding the same uv release.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN}
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# --- build: resolve nothing, install exactly uv.lock into a virtualenv -------------------------
FROM ${BASE_IMAGE} AS build
ARG PYTHON_VERSION
COPY --from=uv /uv /usr/local/bin/uv
# UV_PYTHON by version, not by path: the slim image has it in /usr/local/bin, Debian in /usr/bin.
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=python${PYTHON_VERSION} \
    UV_PROJECT_ENVIRONMENT=/opt/neuron-scheduler
WORKDIR /build
# Dependencies first, in their own layer: source changes do not reinstall them.
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --locked --no-dev --no-install-project
COPY src ./src
# --no-editable: the package is copied into the virtualenv, so /build is not needed at run time.
RUN uv sync --locked --no-dev --no-editable

# --- runtime: the virtualenv on a clean slim Python, as a non-root user -----------------------
FROM ${BASE_IMAGE} AS runtime
# 65532 is the uid the chart's securityContext names (the device plugin overrides it with 0: the
# kubelet's device-plugins directory is root-owned).
RUN groupadd --system --gid 65532 neuron \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin neuron
# ssh: `ultraserver-init` reads each MPI worker's sysfs and writes its /etc/environment over ssh.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-client \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/neuron-scheduler /opt/neuron-scheduler
ENV PATH=/opt/neuron-scheduler/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
USER 65532:65532
EXPOSE 12345
ENTRYPOINT ["neuron-scheduler"]
CMD ["--help"]
