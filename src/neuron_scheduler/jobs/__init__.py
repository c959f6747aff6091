"""Training jobs: multi-member jobs placed all or nothing, in whole units, close in the network.

- `members`: which job a pod belongs to, whatever made it (MPIJob, PyTorchJob, JobSet, Kubeflow
  Trainer, LeaderWorkerSet, the Workload API's PodGroup, our annotation), and its size. Pure.
- `units`: how a node's unit is read: UltraServer labels, else the node itself. Pure.
- `claims`: a job's claim on a node, to and from its API object (kind UltraServerClaim, kept for
  existing users: it holds any job's nodes). Pure.
- `placement`: the view the extender's watches feed (`Occupancy`), the plan that picks a job's
  units, and the node filter that keeps members to their claim. Pure.
- `preemption`: whole jobs of lower priority evicted for a job, or nobody. Pure.

Imports kube/ (objects, readers) and core/ only. The extender, the views (live/) and the
UltraServer MPI tooling (ultraserver/) sit above it.
"""
