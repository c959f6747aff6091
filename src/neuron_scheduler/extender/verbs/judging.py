"""filter and prioritize: which nodes can take a pod's Neuron request, and how well. No I/O.

Decisions come from the ledger (kept per request shape until their node changes); nodes the cache
has not seen are judged from kube-scheduler's own copy when it sent one. Node filters (the
training-job unit rule) narrow what passed the device check.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import NamedTuple, cast

import msgspec

from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    fullness_score,
)
from neuron_scheduler.core.catalog import CapacityError
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.quantity import QuantityError
from neuron_scheduler.core.resources import NeuronRequest, RequestError
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.scoring import scored_decision
from neuron_scheduler.dra.shapes import EVERY_CORE_WINDOW
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.dranodes import DraNodes
from neuron_scheduler.extender.state.ledger import (
    REFUSED,
    UNDECIDED,
    Claimant,
    Ledger,
    Verdicts,
)
from neuron_scheduler.extender.state.plugins import NodeFilter, RefusalListener
from neuron_scheduler.extender.verbs.wire import (
    BadRequest,
    ExtenderArgs,
    FilterResult,
    HostPriority,
    next_request,
    node_names,
    sent_nodes,
)
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.reading import neuron_request, node_topology

log = logging.getLogger("neuron_scheduler.extender")

NOT_CACHED = "node is not in neuron-scheduler's cache yet"
NOT_NEURON = "node advertises no Neuron resources"
UNUSABLE = "node is unusable for Neuron pods"


class FilterAnswer(NamedTuple):
    """prioritize's answer for the nodes a filter passed, made while filter had their verdicts
    in the CPU's caches: kube-scheduler asks prioritize about those nodes next, for the same
    pod, by when the caches hold the control plane's data (issue 50: decoding the pod again and
    looking the names up again, cold, was most of prioritize's cost). It answers exactly the
    request kube-scheduler sends then, while the verdicts it was read from are still the ledger's
    for that request and have dropped no decision."""

    request_text: bytes  # prioritize's request, byte for byte (wire.next_request)
    request: NeuronRequest
    claimant: Claimant
    verdicts: Verdicts
    forgotten: int  # verdicts.forgotten when it was made
    answer: bytes  # prioritize's answer, encoded


class Judge:
    def __init__(
        self,
        ledger: Ledger,
        metrics: Metrics,
        policy: Policy = Policy.BEST_FIT,
        filters: Sequence[NodeFilter] = (),
        listener: RefusalListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        dra: DraNodes | None = None,
    ) -> None:
        """`filters` narrow what passed the device check, given `clock()`'s time; `listener`
        hears which pods got no node; `dra`: what is known of our DRA driver's nodes (None:
        pods with DRA claims are not scored)."""
        self.clock = clock
        self.dra = dra
        self.ledger = ledger
        self.metrics = metrics
        self.policy = policy
        self.filters = tuple(filters)
        self.listener = listener
        self._kept: FilterAnswer | None = None  # for prioritize, from the last filter

    def _strangers(
        self, args: ExtenderArgs, request: NeuronRequest, body: bytes | None
    ) -> Callable[[str], tuple[Decision, str]]:
        """Judges nodes the cache does not know: from the request's own copy of the node when
        kube-scheduler sent one, else a refusal to try again later. Each answer comes with its
        metric outcome when it is not the decision's own. `body` is the request's JSON, read
        again in full only when such a node turns up."""
        nodes: dict[str, Node | str] | None = None

        def judge(name: str) -> tuple[Decision, str]:
            nonlocal nodes
            unusable = self.ledger.unusable.get(name)
            if unusable is not None:
                return Refusal(f"{UNUSABLE}: {unusable.reason}", True), "unusable_node"
            if nodes is None:
                nodes = sent_nodes(body) if args.Nodes is not None and body else {}
            node = nodes.get(name)
            if node is None:
                return Refusal(NOT_CACHED), "not_in_cache"
            if isinstance(node, str):
                return Refusal(node, True), ""
            try:
                resolved = node_topology(node, self.ledger.catalog)
            except CapacityError as error:
                return Refusal(f"{UNUSABLE}: {error}", True), "unusable_node"
            if resolved is None:
                return Refusal(NOT_NEURON, True), "no_neuron_node"
            claimant = Claimant.of(args.Pod, request) if args.Pod is not None else Claimant()
            state = self.ledger.state_for(claimant, name)
            decision = allocate(
                resolved.topology, state, request, self.policy, self.ledger.demand.weights
            )
            return decision, ""

        return judge

    @staticmethod
    def _request(args: ExtenderArgs) -> tuple[Pod, NeuronRequest | None]:
        """The pod and its Neuron request. A quantity the API server would never have admitted
        is a bad request (400); a pod that no node can serve (RequestError) is the caller's to
        answer."""
        if args.Pod is None:
            raise BadRequest("request has no Pod")
        try:
            return args.Pod, neuron_request(args.Pod)
        except QuantityError as error:
            raise BadRequest(str(error)) from error

    def filter(self, args: ExtenderArgs, body: bytes | None = None) -> FilterResult:
        """`body`: the request's JSON, needed when it sends a NodeList (`args.Nodes` holds only
        names; a node the cache has not seen is read from the body)."""
        self._kept = None
        names = node_names(args, body)
        try:
            pod, request = self._request(args)
        except RequestError as error:
            self.metrics.filter_outcomes.labels("invalid_request").inc(len(names))
            reason = str(error)
            key = args.Pod.key if args.Pod else "?"
            log.info("POD %s cannot be placed: %s", loggable(key), loggable(reason))
            return FilterResult([], {}, dict.fromkeys(names, reason))
        if request is None:
            self.metrics.filter_outcomes.labels("no_neuron_request").inc(len(names))
            return FilterResult(list(names), {}, {})
        claimant = Claimant.of(pod, request)
        verdicts = self.ledger.verdicts(request, self.policy, claimant)
        marks = verdicts.marks
        outcomes: defaultdict[str, int] = defaultdict(int)
        # One pass in C reads each node's mark: its score where it fits, REFUSED where it does
        # not, UNDECIDED where nothing is kept (a pod landed there since, or never asked about).
        # Those are decided, and only nodes that still do not fit are looked at one by one
        # (deciding node by node in Python took several times as long; issue 50: reading fits
        # and scores in separate passes cost a cold pass over the kept table).
        seen = list(map(marks.get, names, repeat(UNDECIDED)))
        lowest = min(seen, default=0)
        if lowest == UNDECIDED:
            forgotten = verdicts.forgotten
            undecided = _positions(seen, UNDECIDED)
            filled = self.ledger.fill_verdicts(
                [names[i] for i in undecided], request, self.policy, claimant
            )
            if filled is verdicts and filled.forgotten == forgotten:
                for i in undecided:
                    seen[i] = marks.get(names[i], UNDECIDED)
            else:  # held ids ran out meanwhile and dropped marks read above: read all again
                verdicts = self.ledger.fill_verdicts(names, request, self.policy, claimant)
                marks = verdicts.marks
                seen = list(map(marks.get, names, repeat(UNDECIDED)))
            lowest = min(seen)
        scores: list[int] | None = seen  # for the nodes that passed, in their order
        read_at = verdicts.forgotten  # (what follows may drop decisions: held ids running out)
        if lowest >= 0:
            result = FilterResult(list(names), {}, {})
            outcomes["fits"] = len(names)
        else:
            unfit_at = sorted(_positions(seen, REFUSED) + _positions(seen, UNDECIDED))
            unfit = [names[i] for i in unfit_at]
            passed = list(names)
            for i in reversed(unfit_at):  # (a few, usually: each a short move in C)
                del passed[i], seen[i]
            result = FilterResult(passed, {}, {})
            outcomes["fits"] = len(passed)
            # The slow path, only for nodes that do not fit (or that the cache does not know).
            late_fits = set()
            decisions = verdicts.decisions
            strangers = self._strangers(args, request, body)
            for name in unfit:
                kept = decisions.get(name)
                decision, outcome = (kept, "") if kept is not None else strangers(name)
                if isinstance(decision, Placement):
                    late_fits.add(name)
                    outcome = outcome or "fits"
                elif decision.unresolvable:
                    result.unresolvable[name] = decision.reason
                    outcome = outcome or "unresolvable"
                else:
                    held = self.ledger.hold_reason(claimant, name, request, self.policy)
                    result.failed[name] = held or decision.reason
                    outcome = outcome or ("held" if held else "no_fit")
                outcomes[outcome] += 1
            if late_fits:  # judged from the request's own copy: no kept score
                kept_marks = verdicts.marks
                result.passed = [
                    name
                    for name in names
                    if kept_marks.get(name, REFUSED) >= 0 or name in late_fits
                ]
                scores = None
        now = self.clock()
        for node_filter in self.filters:
            before = result.passed
            result.passed, narrowed = node_filter.filter(pod, before, now)
            if result.passed is not before:
                scores = None  # (no longer in step with the nodes that passed)
            if narrowed:
                result.failed.update(narrowed)
                outcomes["fits"] -= len(narrowed)
                outcomes[node_filter.outcome] += len(narrowed)
        if args.NodeNames is not None and body is not None and result.passed:
            self._kept = self._answer_next(
                body, names, result.passed, scores, read_at, request, claimant, verdicts
            )
        for outcome, count in outcomes.items():
            self.metrics.filter_outcomes.labels(outcome).inc(count)
        if self.listener is not None:
            if result.passed:
                self.listener.placed(pod.metadata.uid)
            elif result.failed:  # (refusals for good, unresolvable, wait for nothing)
                self.listener.refused(pod, request)
        self._log_filter(pod, request, result)
        return result

    @staticmethod
    def _answer_next(
        body: bytes,
        names: list[str],
        passed: list[str],
        scores: list[int] | None,
        read_at: int,
        request: NeuronRequest,
        claimant: Claimant,
        verdicts: Verdicts,
    ) -> FilterAnswer | None:
        """prioritize's answer for the nodes that passed, made now (None: a node that passed
        has no kept score, having been judged from the request's own copy of it; or some failed
        and the request is not in kube-scheduler's form). `scores`: theirs, in order, when filter
        read them already, at `read_at` decisions dropped (the answer stands while no more are)."""
        if scores is None:
            found = list(map(verdicts.score, passed))
            if None in found:
                return None
            scores, read_at = cast(list[int], found), verdicts.forgotten
        text = next_request(body, names, passed)
        if text is None:
            return None
        answer = msgspec.json.encode(list(map(HostPriority, passed, scores)))
        return FilterAnswer(text, request, claimant, verdicts, read_at, answer)

    def answer_as_filtered(self, body: bytes) -> bytes | None:
        """prioritize's answer, encoded, when `body` is the request the last filter expected
        next and none of its decisions has changed since; else None (the request is then
        decoded and judged)."""
        kept = self._kept
        if kept is None or body != kept.request_text:
            return None
        verdicts = self.ledger.verdicts(kept.request, self.policy, kept.claimant)
        if verdicts is not kept.verdicts or verdicts.forgotten != kept.forgotten:
            return None
        self.metrics.prioritize_from_filter.inc()
        return kept.answer

    @staticmethod
    def _log_filter(pod: Pod, request: NeuronRequest, result: FilterResult) -> None:
        """At INFO only when no node passed: the pod waits, and these lines say why, node by
        node. When some passed, these lines are DEBUG: the pod's bind logs where it went and what
        it got (should kube-scheduler's own plugins refuse every node that passed, its event on
        the pod says so, and `neuron-scheduler why` tells the rest). At INFO they were most of
        the extender's log and an eighth of a filter's CPU live (a fifth in process with the
        CPU's caches cold; issue 50). A line per node that fits only at DEBUG (issue 36)."""
        level = logging.DEBUG if result.passed else logging.INFO
        if not log.isEnabledFor(level):
            return
        key = loggable(pod.key)
        for name in result.passed[:5]:
            log.debug("POD %s fits in Node:%s", key, loggable(name))
        shown = result.passed[:20]
        more = f" ... and {len(result.passed) - 20} more" if len(result.passed) > 20 else ""
        log.log(
            level,
            "Filtered nodes for POD %s (%s): [%s]%s",
            key,
            request.describe(),
            " ".join(map(loggable, shown)),
            more,
        )
        failed = {**result.failed, **result.unresolvable}
        if failed:
            items = list(failed.items())[:10]
            text = " ".join(f"{loggable(name)}:{loggable(reason)}" for name, reason in items)
            more = f" ... and {len(failed) - 10} more" if len(failed) > 10 else ""
            log.log(level, "Failed nodes for POD %s: map[%s]%s", key, text, more)

    def prioritize(self, args: ExtenderArgs, body: bytes | None = None) -> list[HostPriority]:
        names = node_names(args, body)
        try:
            pod, request = self._request(args)
        except RequestError:
            return list(map(HostPriority, names, repeat(0)))
        if request is None:
            return list(map(HostPriority, names, repeat(0)))
        claimant = Claimant.of(pod, request)
        marks = self.ledger.verdicts(request, self.policy, claimant).marks
        # Usually every node has a kept mark (filter just asked about the same nodes).
        seen = list(map(marks.get, names, repeat(UNDECIDED)))
        if UNDECIDED in seen:
            marks = self.ledger.fill_verdicts(names, request, self.policy, claimant).marks
            seen = list(map(marks.get, names, repeat(UNDECIDED)))
        if UNDECIDED not in seen:
            return list(map(HostPriority, names, map(max, seen, repeat(0))))
        strangers = self._strangers(args, request, body)  # nodes the cache has not seen
        answer = []
        for name, mark in zip(names, seen, strict=True):
            if mark == UNDECIDED:
                decision, _ = strangers(name)
                mark = decision.score if isinstance(decision, Placement) else 0
            answer.append(HostPriority(name, max(mark, 0)))
        return answer

    def prioritize_claims(
        self, args: ExtenderArgs, body: bytes | None = None
    ) -> list[HostPriority]:
        """Scores for a pod with a claim of our DRA classes: on each node, the device the
        scheduler's DRA allocator will pick there (first fit in our order), scored by the same
        best-fit measure as our own placements (`dra.scoring`). Every other pod, and nodes that
        are not our DRA nodes or cannot give the claim a device, score 0: kube-scheduler's DRA
        plugin has already filtered the nodes, and this verb never refuses one."""
        return self._claim_scores(args, body, lambda _, __, placement: placement.score)

    def prioritize_claims_packing(
        self, args: ExtenderArgs, body: bytes | None = None
    ) -> list[HostPriority]:
        """prioritize-claims' tie-break, served as an entry of its own at a low weight: how full
        each node is once the scheduler's pick is made there (`fullness_score`), as
        NodeResourcesFit's MostAllocated packs the pods it can count, which DRA claims are not."""

        def fullness(topology: Topology, state: NodeState, placement: Placement) -> int:
            return fullness_score(topology, state.used_cores | placement.core_mask)

        return self._claim_scores(args, body, fullness)

    def _claim_scores(
        self,
        args: ExtenderArgs,
        body: bytes | None,
        score: Callable[[Topology, NodeState, Placement], int],
    ) -> list[HostPriority]:
        names = node_names(args, body)
        dra = self.dra
        request = dra.request_of(args.Pod) if dra is not None and args.Pod is not None else None
        if dra is None or request is None:
            return list(map(HostPriority, names, repeat(0)))
        weights = dra.demand.weights
        answer = []
        for name in names:
            known = dra.node(name)
            value = 0
            if known is not None:
                topology, state = known
                # Every count: a window of the claim's count is the same whichever others the
                # node publishes, and kube-scheduler filtered out nodes without one.
                decision = scored_decision(topology, state, request, EVERY_CORE_WINDOW, weights)
                if isinstance(decision, Placement):
                    value = score(topology, state, decision)
            answer.append(HostPriority(name, value))
        return answer


def _positions(values: list[int], value: int) -> list[int]:
    """Where `value` is in `values`, ascending: scans in C (a filter's few refused or new nodes
    among hundreds)."""
    found: list[int] = []
    at = -1
    for _ in range(values.count(value)):
        at = values.index(value, at + 1)
        found.append(at)
    return found
