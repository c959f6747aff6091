"""Views of the live cluster for the people who run it: `status` (which devices are free where)
and `why` (why is this pod pending), also installed as the kubectl plugin `kubectl neuron`.

Read-only. Nodes and pods are listed with the kube client and fed to the extender's own ledger,
so every answer comes from the code that schedules: the same holdings, the same allocator, the
same eviction choice as the preempt verb.

- `snapshot`: lists nodes and pods (paged, bounded) into a Ledger; reads the one pod `why` asks
  about.
- `fleet`: per node, who holds which ids and what is free; per request size, how many nodes could
  take one now. Pure.
- `diagnosis`: for a pending pod, each Neuron node's answer and what would have to be freed,
  and whether it is stranded by fragmentation (what consolidation does for it). Pure.
- `consolidation`: plans in flight and the eviction budget left, for `status`. Pure.
- `devicemap`: a node's devices as text (a ring as a ring, a torus as its grid), one colour per
  pod. Pure.
- `terminal`: what a person reads (rich); `pictures`: `--report` through the simulator's
  pictures (matplotlib, the `sim` extra, imported only there).
- `commands`: the typer commands; `register(app)` adds them (the project CLI and the kubectl
  plugin do).
"""
