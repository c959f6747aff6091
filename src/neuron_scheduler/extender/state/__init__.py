"""What the extender knows: views rebuilt from the watches, read by the verbs and the loops. No I/O
(no API client, no asyncio, no metrics: `make lint`); imports only core, kube's objects and
readers, and ultraserver's pure rules. Nothing here imports the verbs, the loops or the process.

- `plugins`: the extension points (a cluster view fed by the watches, a node filter, a hold
  keeper, a reserver, a refusal listener), shaped like kube-scheduler's informer handlers and
  framework plugins.
- `ledger`: who holds which cores on which node, rebuilt from pods; holds for pods not bound yet;
  decisions kept per request shape.
- `pending`: pending pods of the schedulers the extender binds for, as the watch last showed them.
- `budgets`: PodDisruptionBudgets, counted as kube-scheduler counts them.
- `movability`: what may move of each Neuron pod, and where its replacement may go.
- `plans`: consolidation plans read back from their pods' annotations, and their holds.
"""
