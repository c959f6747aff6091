"""Trn2 UltraServer MPI tooling: two CLI commands that share the UltraServer label names with the
training-job rule (jobs/, which places any job, UltraServer units included, and sits below).

- `launcher/`: the MPIJob launcher's init step (`ultraserver-init`): gathers the workers' facts
  (sysfs over ssh, or node labels), ranks them, writes their environment and a new hostfile.
- `affinity`: the Worker template's nodeSelector and (anti-)affinity (`ultraserver-affinity`). Pure.
- `labels`: sysfs names, runtime modes. Pure.
- `command`: the two CLI commands.
"""
