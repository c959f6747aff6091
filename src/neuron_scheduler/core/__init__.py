"""The pure core: topology and allocation, shared by the extender, the device plugin, the
simulator and the views. No I/O and nothing else of ours is imported here.

- `ids`: id masks, the id-list text formats, and which cores a device owns (the one place).
- `topology`: instance-type topologies (chain, ring, 2D torus, switch) and their allowed sets.
- `catalog` (+ `catalog.yaml`): the built-in instance types, overridable by a user's file.
- `resources`: Neuron resource names and a pod's request built from its containers.
- `allocation`: the allocator: a placement on one node, or why not (`Decision`); what a node can
  still give (`free_devices`, `largest_free_block`), which the metrics and `status` report.
- `handoff`: the pod annotations that hand the scheduler's choice to the device plugin.
- `logtext`: text from requests and API objects made fit for one log line (escaped, bounded).
- `eviction`: which pods to evict so a pod gets an allowed block (the preempt verb's choice).
- `consolidation`: which pods of one node may move for a stranded pod, and where each goes again.
- `planrecord`: a consolidation plan and the eviction budget as they are persisted.
"""
