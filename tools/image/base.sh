#!/usr/bin/env bash
# A Debian base with Python, made with mmdebstrap from Debian's package mirror and imported into
# podman's storage: the stand-in for python:<version>-slim-<suite> when nothing may be pulled
# from an image registry. Called by build.sh, which keys TAG by this file.
#
#   tools/image/base.sh SUITE PYTHON_VERSION TAG
#
# Like the slim images: minbase (essential packages and apt), no recommends, no manuals, docs or
# translations; plus python3, ca-certificates. usr-is-merged by name: left to apt, python3's
# dependencies on "usrmerge | usr-is-merged" install usrmerge, and with it perl (50 MB). The certificates the host added to its own store
# (a proxy's or a company's CA in /usr/local/share/ca-certificates) are added here too, and
# SSL_CERT_FILE names the bundle, so uv reaches the package index from inside the build as it
# does from the host.
set -euo pipefail
suite=${1:?suite} python=${2:?python version} tag=${3:?tag}
here=$(cd "$(dirname "$0")" && pwd)
tar=$(mktemp --tmpdir neuron-scheduler-base.XXXXXX.tar)
trap 'rm -f "$tar"' EXIT
echo "base.sh: Debian $suite with Python $python -> $tag" >&2
extra_cas=/usr/local/share/ca-certificates
clean='rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true'
# --aptopt and --dpkgopt stay in the image (/etc/apt/apt.conf.d, /etc/dpkg/dpkg.cfg.d), as in
# Debian's own images: later apt-get runs keep no package cache and install no documentation.
mmdebstrap --quiet --variant=minbase --include=python3,ca-certificates,usr-is-merged \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --hook-dir=/usr/share/mmdebstrap/hooks/eatmydata \
  --aptopt='APT::Install-Recommends "false"' \
  --aptopt='Acquire::Languages "none"' \
  --aptopt='Acquire::GzipIndexes "true"' \
  --aptopt='Dir::Cache::pkgcache ""' \
  --aptopt='Dir::Cache::srcpkgcache ""' \
  --aptopt="DPkg::Post-Invoke { \"$clean\"; }" \
  --aptopt="APT::Update::Post-Invoke { \"$clean\"; }" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook="if [ -d $extra_cas ]; then cp -r $extra_cas/. \"\$1\"$extra_cas/; fi" \
  --customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1' \
  --customize-hook="test -x \"\$1/usr/bin/python$python\" || { echo \"base.sh: $suite has no python$python\" >&2; exit 1; }" \
  "$suite" "$tar"
"$here/podman.sh" import --quiet \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' \
  "$tar" "$tag" >/dev/null
