"""The placement code on paper: `explain` (one node) and `simulate` (an in-memory fleet).

- `simulation`: a fleet and a pod stream through the same allocator as the extender. Pure.
- `consolidation`: the extender's consolidation on the model (bench/quality.py --consolidation).
- `scenario`: fleet and workload files; `report`: pictures and summaries (matplotlib, the
  package's `sim` extra); `commands`: the two CLI commands.
"""
