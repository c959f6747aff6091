"""The scheduler extender kube-scheduler calls: `filter`, `prioritize`, `preempt`, `bind`.

The process is here, where a reader looks for the entry point; its three roles are sub-packages:

- `command` (the CLI), `serve` (the process: watches, Lease, HTTP server), `http` (the verbs as
  small ASGI endpoints, health, metrics), `wiring` (which views, filters, reservers and loops
  each part gets), `metrics` (the sink every role is handed), `memory` (heap trimming).
- `verbs/`: what kube-scheduler calls, and its wire types. Answers now, from what the extender
  knows.
- `state/`: what the extender knows, rebuilt from the watches, and the extension points. No I/O.
- `loops/`: what the leader does over time: waking pods, training jobs' claims, consolidation.

Imports run one way (`make lint`, pyproject.toml): the process > `verbs` | `loops` > `metrics` >
`state`. The verbs and the loops never import each other; what one needs of the other it is
handed through a Protocol of `state/plugins` (filter is handed the training-job rule as a
`NodeFilter`). A new verb goes in `verbs/`, a new background loop in `loops/`, a new fact about
the cluster (a view fed by a watch) in `state/`.
"""
