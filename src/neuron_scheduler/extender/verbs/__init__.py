"""The verbs kube-scheduler calls, answered from what the extender knows (`state/`). They may
import `state` and the process's `metrics` sink, never the leader's loops (`make lint`).

- `wire`: the extender protocol's structs (k8s.io/kube-scheduler/extender/v1).
- `judging`: filter and prioritize (`Judge`). No I/O.
- `preempting`: preempt (`Preemptor`): victims that free an allowed block. No I/O.
- `binding`: bind (`Binder`): decide again under the node's lock, annotate, bind, roll back.
"""
