"""Trn2 UltraServer MPI jobs: two deployables that share the UltraServer label names.

- `placement`: a plugin the extender is given (a cluster view, a node filter and a reserver) that
  keeps each MPI job's workers in whole UltraServer units. Pure.
- `launcher/`: the MPIJob launcher's init step (`ultraserver-init`): gathers the workers' facts
  (sysfs over ssh, or node labels), ranks them, writes their environment and a new hostfile.
- `affinity`: the Worker template's nodeSelector and (anti-)affinity (`ultraserver-affinity`). Pure.
- `labels`: node configs, label and sysfs names, runtime modes. Pure.
- `command`: the two CLI commands.
"""
