#!/usr/bin/env bash
# Builds the image from the repository's Dockerfile without pulling from any image registry, and
# prints its name on the last line of stdout (`make image` runs this; the e2e tests call make).
#
#   tools/image/build.sh          build unless an image of the same content exists
#   tools/image/build.sh --name   only print the name the image has or would have
#
# The Dockerfile's defaults pull python:<v>-slim-<suite> and ghcr.io/astral-sh/uv; here its build
# arguments name two local images instead:
#   - localhost/neuron-scheduler-base:<suite>-<hash of base.sh>: Debian with Python (base.sh);
#   - localhost/neuron-scheduler-uv:<version>: the uv binary of the release the Dockerfile names,
#     from that release's wheel on the package index.
# Everything else is the Dockerfile's own steps (uv sync --locked from the package index, apt-get
# from Debian's mirror, the user, the entrypoint). The image is named by a hash of everything that
# goes into it (the build context as .dockerignore selects it, the Dockerfile, these scripts) and
# stays in podman's storage (/var/lib/containers), so an unchanged checkout never rebuilds; a
# changed one reuses podman's cached layers (the dependency layer unless uv.lock changes).
#
# Needs root (rootful podman; mmdebstrap as root) and podman, runc and mmdebstrap from Debian's
# packages (tools/image.mk installs them: `make image-tools`).
set -euo pipefail
cd "$(dirname "$0")/../.."
here=tools/image
repository=localhost/neuron-scheduler

arg() { sed -n "s/^ARG $1=//p" Dockerfile | head -1; }
suite=$(arg DEBIAN)
python=$(arg PYTHON_VERSION)
uv_version=$(arg UV_IMAGE | sed 's/.*://')
base=$repository-base:$suite-$(sha256sum "$here/base.sh" | cut -c1-12)
uv=$repository-uv:$uv_version

# The build context exactly as .dockerignore selects it: pyproject.toml, uv.lock, README.md,
# src/ without bytecode or tool caches (`make lint` writes ruff's after this name is taken).
key=$(
  {
    echo "$base $uv"
    sha256sum Dockerfile .dockerignore "$here/build.sh" "$here/podman.sh"
    sha256sum pyproject.toml uv.lock README.md
    find src -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*/.ruff_cache/*' \
      ! -path '*/.mypy_cache/*' -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16
)
image=$repository:local-$key
if [ "${1:-}" = --name ]; then
  echo "$image"
  exit 0
fi

for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null \
    || { echo "build.sh: $tool missing: run 'make image-tools' (as root) first" >&2; exit 1; }
done

exists() { "$here/podman.sh" image exists "$1"; }
if exists "$image"; then
  echo "$image"
  exit 0
fi

started=$SECONDS
if ! exists "$base"; then
  "$here/base.sh" "$suite" "$python" "$base"
fi
if ! exists "$uv"; then
  echo "build.sh: uv $uv_version from its wheel -> $uv" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # uv installs the wheel (no pip needed: under `uv run`, python3 is the venv's, which has none);
  # the wheel's bin/ holds the uv and uvx binaries the release image has at its root.
  "${UV:-uv}" pip install --quiet --no-deps --only-binary :all: --target "$work/wheel" \
    "uv==$uv_version" >&2
  "$work/wheel/bin/uv" --version | grep -qF "uv $uv_version " \
    || { echo "build.sh: the wheel's uv is not $uv_version" >&2; exit 1; }
  tar -C "$work/wheel/bin" -cf "$work/uv.tar" uv uvx
  "$here/podman.sh" import --quiet "$work/uv.tar" "$uv" >/dev/null
fi

echo "build.sh: building $image from the Dockerfile (base $base)" >&2
# --network host: the RUN steps reach the package index and Debian's mirror as the host does.
"$here/podman.sh" build --network host \
  --build-arg "BASE_IMAGE=$base" --build-arg "UV_IMAGE=$uv" \
  --tag "$image" --file Dockerfile . >&2
echo "build.sh: built $image in $((SECONDS - started)) s" \
  "($("$here/podman.sh" image inspect --format '{{.Size}}' "$image") bytes)" >&2
# Each source change leaves a 90 MB virtualenv layer behind: keep the three newest builds (other
# checkouts on the machine may be testing theirs), untag the rest; podman frees their layers.
"$here/podman.sh" images --sort created --filter "reference=$repository" \
  --format '{{.Repository}}:{{.Tag}}' | grep -vxF "$image" | tail -n +3 \
  | xargs -r "$here/podman.sh" rmi >/dev/null 2>&1 || true
echo "$image"
