"""The ledger's kept decisions never go stale: after any sequence of pod, reservation and node
changes, what `judge` answers equals a fresh decision on the node's current state (two nodes of
one type: the allocator's caches answer for both)."""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import Decision, Placement, Policy, Refusal, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import Demand
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.judging import Judge
from neuron_scheduler.extender.verbs.wire import ExtenderArgs
from neuron_scheduler.kube.objects import Pod
from tests.builders import node, pod, pod_json

NODES = {
    "inf2": "inf2.48xlarge",
    "inf2b": "inf2.48xlarge",
    "trn1": "trn1.32xlarge",
    "inf1": "inf1.6xlarge",
}
NOW = 1_800_000_000.0  # the ledger's wall clock: ids announced "now" are held for 90 s from it
REQUESTS = [NeuronRequest(NEURON, n) for n in (1, 2, 4)] + [
    NeuronRequest(NEURONCORE, n) for n in (1, 2, 3, 8)
]


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(Catalog.builtin(), wall_clock=lambda: NOW)
        self.ledger.replace_nodes([node(name, kind) for name, kind in NODES.items()])
        self.next_uid = 0
        self.bound: list[str] = []
        self.reserved: list[tuple[str, str]] = []

    def _fresh(self, name: str, request: NeuronRequest) -> Decision | None:
        """A decision made now, from nothing kept (None: the node is not in the cache)."""
        entry = self.ledger.nodes.get(name)
        if entry is None:
            return None
        state = self.ledger.state(name)
        return allocate(entry.topology, state, request, Policy.BEST_FIT, self.ledger.demand.weights)

    def _uid(self, prefix: str) -> str:
        self.next_uid += 1
        return f"{prefix}{self.next_uid}"

    def _place(self, name: str, request: NeuronRequest) -> Placement | None:
        decision = self._fresh(name, request)
        return decision if isinstance(decision, Placement) else None

    @rule(name=st.sampled_from(sorted(NODES)), request=st.sampled_from(REQUESTS))
    def ask(self, name: str, request: NeuronRequest) -> None:
        # Fills the kept decisions that later changes must drop.
        self.ledger.fill_verdicts(list(NODES), request, Policy.BEST_FIT)

    @rule(name=st.sampled_from(sorted(NODES)), request=st.sampled_from(REQUESTS))
    def bind(self, name: str, request: NeuronRequest) -> None:
        placement = self._place(name, request)
        if placement is None:
            return
        uid = self._uid("u")
        ids = ",".join(map(str, placement.cores))
        annotations = {"AWS_NEURON_IDS": ids, "NEURON_RESOURCE_TYPE": NEURONCORE}
        limits = {NEURONCORE: len(placement.cores)}
        self.ledger.apply_pod(pod(uid, limits, node=name, uid=uid, annotations=annotations))
        self.bound.append(uid)

    @rule(name=st.sampled_from(sorted(NODES)), request=st.sampled_from(REQUESTS))
    def reserve(self, name: str, request: NeuronRequest) -> None:
        placement = self._place(name, request)
        if placement is None:
            return
        uid = self._uid("r")
        self.ledger.reserve(pod(uid, {NEURONCORE: 1}, uid=uid), name, placement)
        self.reserved.append((uid, name))

    @rule(name=st.sampled_from(sorted(NODES)), count=st.integers(1, 4))
    def foreign(self, name: str, count: int) -> None:
        """A pod placed by another scheduler: counted by size, ids unknown."""
        uid = self._uid("f")
        self.ledger.apply_pod(pod(uid, {NEURON: count}, node=name, uid=uid))
        self.bound.append(uid)

    @rule(name=st.sampled_from(sorted(NODES)), request=st.sampled_from(REQUESTS))
    def announce(self, name: str, request: NeuronRequest) -> None:
        """A pending pod with the ids a bind wrote for the node: held until bound or gone."""
        placement = self._place(name, request)
        if placement is None:
            return
        uid = self._uid("a")
        cores = NeuronRequest(NEURONCORE, len(placement.cores))
        written = handoff.encode(name, cores, placement, ["c0"], int(NOW * 1e9))
        self.ledger.apply_pod(pod(uid, {NEURONCORE: cores.count}, uid=uid, annotations=written))
        self.bound.append(uid)

    @rule(name=st.sampled_from(sorted(NODES)), request=st.sampled_from(REQUESTS))
    def nominate(self, name: str, request: NeuronRequest) -> None:
        """A pending pod preemption nominated to the node: its block is held there."""
        uid = self._uid("n")
        limits = {NEURON if request.unit is Unit.DEVICE else NEURONCORE: request.count}
        body = pod_json(uid, limits, uid=uid)
        body["status"]["nominatedNodeName"] = name
        self.ledger.apply_pod(msgspec.convert(body, Pod))
        self.bound.append(uid)

    @rule(name=st.sampled_from(sorted(NODES)), failed=st.booleans())
    def health(self, name: str, failed: bool) -> None:
        """Its device 0 fails, or it offers less than it has (both undone when the nodes are
        listed again: `node_comes_and_goes`)."""
        if failed:
            self.ledger.apply_node(node(name, NODES[name], failed=[0]))
        else:
            self.ledger.apply_node(node(name, NODES[name], allocatable_cores=2))

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        if self.bound:
            uid = self.bound.pop(data.draw(st.integers(0, len(self.bound) - 1)))
            self.ledger.remove_pod(uid)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.reserved:
            uid, name = self.reserved.pop(data.draw(st.integers(0, len(self.reserved) - 1)))
            self.ledger.unreserve(pod(uid, {NEURONCORE: 1}, uid=uid), name)

    @rule(name=st.sampled_from(sorted(NODES)), present=st.booleans())
    def node_comes_and_goes(self, name: str, present: bool) -> None:
        kept = [node(n, k) for n, k in NODES.items() if n != name or present]
        self.ledger.replace_nodes(kept)

    @invariant()
    def kept_decisions_are_fresh(self) -> None:
        for request in REQUESTS:
            verdicts = self.ledger.fill_verdicts(list(NODES), request, Policy.BEST_FIT)
            for name in NODES:
                fresh = self._fresh(name, request)
                if fresh is None:
                    assert name not in verdicts.decisions
                    continue
                if isinstance(fresh, Refusal):  # (named as judging names it: its own words)
                    fresh = self.ledger.failed_devices_refusal(name, request, fresh)
                assert verdicts.decisions[name] == fresh, (name, request)
                assert (name in verdicts.fitting()) == isinstance(fresh, Placement)
                score = fresh.score if isinstance(fresh, Placement) else 0
                assert verdicts.score(name) == score


TestLedgerVerdicts = LedgerMachine.TestCase
TestLedgerVerdicts.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class _SettledDemand(Demand):
    """What the cluster asks for, no longer moving: each pod the machine adds would otherwise
    change the snapshot now and then, and every change drops all kept decisions, which would
    hide one that a pod, reservation or node change failed to drop."""

    settled = False

    def record(self, unit: Unit, count: int) -> None:
        if not self.settled:
            super().record(unit, count)


class SettledDemandMachine(LedgerMachine):
    def __init__(self) -> None:
        super().__init__()
        demand = _SettledDemand()
        for request in REQUESTS:
            demand.record(request.unit, request.count)
        demand.settled = True
        self.ledger.demand = demand
        self.version = demand.version

    @invariant()
    def demand_stays_settled(self) -> None:
        assert self.ledger.demand.version == self.version


TestLedgerVerdictsSettledDemand = SettledDemandMachine.TestCase
TestLedgerVerdictsSettledDemand.settings = TestLedgerVerdicts.settings


class _FilterThenPrioritize(LedgerMachine):
    """prioritize asked about the nodes a filter passed, for the same pod, answers what judging
    the request now would, whatever changed in between: the answer kept from the filter is
    given only while its verdicts are still the ledger's and have dropped no decision."""

    def __init__(self) -> None:
        super().__init__()
        self.judge = Judge(self.ledger, Metrics(self.ledger))
        self.next_ask: bytes = b""

    @rule(
        request=st.sampled_from(REQUESTS),
        # Any order, repeats, and a node the cache does not know: filter reads each name's kept
        # mark by its position (Verdicts.marks).
        names=st.lists(st.sampled_from([*NODES, "unknown"]), max_size=8) | st.just(list(NODES)),
    )
    def filter(self, request: NeuronRequest, names: list[str]) -> None:
        limits = {NEURON if request.unit is Unit.DEVICE else NEURONCORE: request.count}
        asker = pod_json("asker", limits)
        body = msgspec.json.encode({"Pod": asker, "Nodes": None, "NodeNames": names})
        result = self.judge.filter(msgspec.json.decode(body, type=ExtenderArgs), body)
        passed = result.passed
        fitting = [n for n in names if isinstance(self._fresh(n, request), Placement)]
        assert passed == fitting, (names, request)
        assert set(result.failed) | set(result.unresolvable) == set(names) - set(fitting)
        self.next_ask = msgspec.json.encode({"Pod": asker, "Nodes": None, "NodeNames": passed})
        if passed:  # nothing changed since: kept (else this machine tests nothing)
            assert self.judge.answer_as_filtered(self.next_ask) is not None

    @invariant()
    def prioritize_answers_as_judging_does(self) -> None:
        if not self.next_ask:
            return
        answer = self.judge.answer_as_filtered(self.next_ask)
        if answer is not None:
            args = msgspec.json.decode(self.next_ask, type=ExtenderArgs)
            assert answer == msgspec.json.encode(self.judge.prioritize(args, self.next_ask))


class FilterThenPrioritizeMachine(_FilterThenPrioritize, SettledDemandMachine):
    """Decisions dropped one node at a time (Verdicts.forgotten)."""


class FilterThenPrioritizeMovingDemandMachine(_FilterThenPrioritize):
    """And with the demand moving, every kept verdict replaced at once (other objects)."""


TestFilterThenPrioritize = FilterThenPrioritizeMachine.TestCase
TestFilterThenPrioritize.settings = TestLedgerVerdicts.settings
TestFilterThenPrioritizeMovingDemand = FilterThenPrioritizeMovingDemandMachine.TestCase
TestFilterThenPrioritizeMovingDemand.settings = TestLedgerVerdicts.settings
