"""What the leader does over time, beside the verbs: each loop reads what the extender knows
(`state/`), writes to the API, and never imports a verb (`make lint`).

- `waking`: pending pods the extender refused, woken when a node they were refused on can take
  them.
- `reserving`: claims for training jobs, all or nothing.
- consolidation (docs/consolidation.md): `movers` (who is stranded by fragmentation, what to move;
  no I/O), `evictionbudget` (evictions of the last hour on a Lease), `consolidating` (the loop:
  plan, hold, evict).
- `devicefailures`: pods running on a device that failed: told, and evicted when asked for.
- `stepping`: how a loop runs its steps (no bug in a step ends it).
"""
