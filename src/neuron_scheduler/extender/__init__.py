"""The scheduler extender kube-scheduler calls: `filter`, `prioritize`, `bind`.

- `wire`: the extender protocol's structs (k8s.io/kube-scheduler/extender/v1).
- `ledger`: who holds which cores on which node, rebuilt from pods; decisions kept per request
  shape. No I/O.
- `plugins`: the extension points (a cluster view, a node filter, a reserver).
- `judging`: filter and prioritize (`Judge`). No I/O.
- `binding`: bind (`Binder`): decide again under the node's lock, annotate, bind, roll back.
- `wiring`: which views, filters and reservers the judge and binder get.
- consolidation (docs/consolidation.md): `movers` (who is stranded by fragmentation, what may
  move; no I/O), `plans` (plans read back from pods, and their holds; no I/O), `evictionbudget`
  (evictions of the last hour on a Lease), `consolidating` (the leader's loop: plan, hold, evict).
- `metrics`, `http` (the verbs as small ASGI endpoints), `serve` (the process), `command` (CLI).
"""
