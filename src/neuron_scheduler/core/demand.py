"""What the cluster asks for: a decayed histogram of recent request shapes. Pure.

Best-fit alone protects the largest blocks a node could serve; it does not know that this cluster
mostly asks for 9 cores or 3 devices, and so it may keep a block of 12 whole while it cuts the only
run of 3 free devices in two. The allocator weighs what a placement leaves unusable by how often
each shape is asked for (core.allocation), and this is where those weights come from: the extender
records every pod it sees appear, the simulator every arrival, the same way.

Bounded whatever the API holds: at most MAX_SHAPES shapes are kept (the least asked-for one makes
room), and weights are small integers, so a snapshot is a short hashable tuple that the
allocator's caches can key on.
"""

from __future__ import annotations

from neuron_scheduler.core.resources import Unit

MAX_SHAPES = 32
# Arrivals after which a shape's past asks count half: recent asks matter, one burst does not.
HALF_LIFE = 256
# The snapshot is compared with the counts every REFRESH arrivals and at each new shape, and
# replaced only when some shape's weight moved by DRIFT or more (a new shape: when its own weight
# reaches DRIFT). The extender's kept decisions are keyed on the snapshot and start over when it
# changes (the first filter over 500 nodes after a change took 40-85 ms, ~115 steady ones, in
# bench/extender.py), so a steady cluster must keep it, and a stream of pods with ever new shapes
# must not replace it at every pod. DRIFT is about 3 standard deviations of the largest weights'
# sampling noise (the histogram's effective window is about 2.9 x HALF_LIFE arrivals): the
# standard workloads' steady mixes replace it every 1,400-4,500 pods (every 180-200 with a DRIFT
# of a fiftieth).
REFRESH = 16
# Snapshot weights are integers summing to about this.
SCALE = 1024
DRIFT = SCALE // 20

Shape = tuple[Unit, int]  # (unit, count)
# (unit, count, weight) by unit then count; weights sum to about SCALE. Empty: nothing asked yet.
DemandWeights = tuple[tuple[Unit, int, int], ...]

_GROWTH = 2.0 ** (1.0 / HALF_LIFE)
_RESCALE_AT = 1e12


class Demand:
    """Request shapes seen lately, weighted toward the newest."""

    __slots__ = ("_counts", "_increment", "_since", "_weights", "version")

    def __init__(self) -> None:
        self._counts: dict[Shape, float] = {}
        # Growing the increment instead of decaying every count keeps a record O(1).
        self._increment = 1.0
        self._since = 0  # arrivals since the last snapshot
        self._weights: DemandWeights = ()
        self.version = 0  # changes with the snapshot

    def record(self, unit: Unit, count: int) -> None:
        shape = (unit, count)
        new = shape not in self._counts
        if new and len(self._counts) >= MAX_SHAPES:
            del self._counts[min(self._counts, key=self._counts.__getitem__)]
        self._counts[shape] = self._counts.get(shape, 0.0) + self._increment
        self._increment *= _GROWTH
        if self._increment > _RESCALE_AT:
            for key in self._counts:
                self._counts[key] /= self._increment
            self._increment = 1.0
        self._since += 1
        if new or self._since >= REFRESH:
            self._snapshot()

    @property
    def weights(self) -> DemandWeights:
        return self._weights

    def _snapshot(self) -> None:
        self._since = 0
        total = sum(self._counts.values())
        weights = tuple(
            (unit, count, round(SCALE * value / total))
            for (unit, count), value in sorted(self._counts.items())
        )
        weights = tuple(w for w in weights if w[2] > 0)
        old = {(unit, count): weight for unit, count, weight in self._weights}
        new = {(unit, count): weight for unit, count, weight in weights}
        drift = max(abs(new.get(shape, 0) - old.get(shape, 0)) for shape in old.keys() | new)
        if not old or drift >= DRIFT:
            self._weights = weights
            self.version += 1
