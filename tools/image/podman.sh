#!/usr/bin/env bash
# podman as our machines need it; build.sh and tests/e2e/test_image.py call podman only through
# this. By hand: tools/image/podman.sh run --rm --network host IMAGE extender --help
#
# Why not plain podman (each measured on the CI machine kind: rootful, cgroup v1 with a v2
# hierarchy beside it, no CAP_SYS_RESOURCE):
#   - crun, podman's default runtime, refuses that cgroup layout for every container:
#       "crun: cgroups in hybrid mode not supported, drop all controllers from cgroupv2"
#     (the v2 hierarchy holds the hugetlb controller), even with --cgroups=disabled; runc runs.
#   - podman asks for nofile=1048576 (and nproc above 32768 if given) while the hard limits here
#     are lower, and raising them takes CAP_SYS_RESOURCE:
#       "crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted: OCI permission denied"
#     so containers get limits at or below ours: nofile is our own hard limit, nproc 16384.
set -euo pipefail
command=${1:?usage: tools/image/podman.sh COMMAND [ARGS...]}
shift
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
case $command in
  run | create | build)
    # Never from a registry: every image these scripts use is built here.
    set -- "$command" --pull=never --ulimit "nofile=$nofile:$nofile" --ulimit nproc=16384:16384 "$@"
    ;;
  *) set -- "$command" "$@" ;;
esac
exec podman --runtime runc "$@"
