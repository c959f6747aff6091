"""The MPIJob launcher's init step for Trn2 UltraServers (`neuron-scheduler ultraserver-init`).

`init` runs the step: `hostfile` reads and rewrites the MPI hostfile, `ssh` gathers sysfs facts
and writes /etc/environment on the workers, `nodes` gathers the same facts from node labels through
the API, `ranking` validates the units and orders the workers (NEURON_GLOBAL_TOPOID), and
`environment` edits /etc/environment text. Pure: `hostfile`, `ranking`, `environment`.
"""
