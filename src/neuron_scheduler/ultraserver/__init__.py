"""Trn2 UltraServer MPI jobs: the launcher's init step, worker affinity, and unit placement.

Pure modules (no I/O): `config`, `topology`, `hostfile`, `environment`, `affinity`, `placement`.
I/O: `ssh` (sysfs and /etc/environment on the workers), `kube` (node labels), `init` (the step).
"""
