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
# The snapshot is compared with the counts at most this often (in arrivals), and replaced only
# when some shape's weight moved by DRIFT or more: the extender's kept decisions are keyed on it
# and start over when it changes, and a decision weighed by demand costs about 20 plain ones
# (bench/allocator.py), so a steady cluster must keep its snapshot, and a stream of pods with
# ever new shapes must not replace it at every pod.
REFRESH = 16
# Snapshot weights are integers summing to about this.
SCALE = 1024
DRIFT = SCALE // 50

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
        new_shape = any((unit, count) not in old for unit, count, _ in weights)
        new = {(unit, count): weight for unit, count, weight in weights}
        drift = max(abs(new.get(shape, 0) - old.get(shape, 0)) for shape in old.keys() | new)
        if not old or new_shape or drift >= DRIFT:
            self._weights = weights
            self.version += 1
