"""kube-scheduler's extender wire types (k8s.io/kube-scheduler/extender/v1).

The Go types have no json tags, so the JSON keys are the Go field names: `Pod`, `Nodes`,
`NodeNames`, `FailedNodes`, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from neuron_scheduler.kube.objects import Node, Pod


class BadRequest(ValueError):
    """A request kube-scheduler would never send; answered with HTTP 400."""


# What decoding untrusted JSON can raise besides a value: msgspec's errors (ValidationError
# included), strings that are not UTF-8, and nesting past its recursion limit.
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class NodeName(msgspec.Struct, gc=False):
    name: str = ""


class NodeRef(msgspec.Struct, gc=False):
    """A node as kube-scheduler sends it to an extender without nodeCacheCapable, read for its
    name only: nodes in our cache are judged from the cache (as bind will be), and the rare node
    the cache has not seen is read again in full (`sent_nodes`); skipping the rest of each object
    is most of what makes a full NodeList cheap to decode (BENCHMARKS.md). Not tracked by the
    garbage collector (a name cannot form a cycle): hundreds of tracked objects a request would
    set off a young collection nearly every time."""

    metadata: NodeName = msgspec.field(default_factory=NodeName)


class NodeRefList(msgspec.Struct):
    items: list[NodeRef] = []


class ExtenderArgs(msgspec.Struct):
    """filter and prioritize: `NodeNames` with nodeCacheCapable, else `Nodes`."""

    Pod: Pod | None = None
    Nodes: NodeRefList | None = None
    NodeNames: list[str] | None = None


# kube-scheduler's request with nodeCacheCapable as its json.Marshal writes ExtenderArgs (its
# fields in order, no spaces; every version of its extender client since 1.30 sends this).
_POD_FIRST = b'{"Pod":'
_NAMES_LAST = b',"Nodes":null,"NodeNames":'


def next_request(body: bytes, names: list[str], passed: list[str]) -> bytes | None:
    """The request, byte for byte, that asks about `passed` for the pod of the request `body`
    asked about `names` with: kube-scheduler's prioritize after a filter. When every node
    passed, `body` itself (whatever its form: the same bytes decode the same); else `body` with
    the names replaced, which only kube-scheduler's form allows (None otherwise), and which
    decodes as `body` does but for them."""
    if passed == names:
        return body
    tail = _NAMES_LAST + msgspec.json.encode(names) + b"}"
    if not (body.startswith(_POD_FIRST) and body.endswith(tail)):
        return None
    return body[: len(body) - len(tail)] + _NAMES_LAST + msgspec.json.encode(passed) + b"}"


class HostPriority(msgspec.Struct, gc=False):
    """One node's score in prioritize's answer (a Struct: hundreds encode faster than dicts; not
    tracked by the garbage collector, for the same reason as NodeRef)."""

    Host: str
    Score: int


class ExtenderBindingArgs(msgspec.Struct):
    PodName: str = ""
    PodNamespace: str = ""
    PodUID: str = ""
    Node: str = ""


@dataclass(slots=True)
class FilterResult:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]

    def wire(self, as_nodes: bool) -> dict[str, Any]:
        """The answer in the form the request came in: kube-scheduler with nodeCacheCapable
        sends NodeNames and reads NodeNames back; without it, sends Nodes and reads Nodes (and
        a null Nodes would then mean that no node fits). NodeNames is always explicit."""
        return {
            "Nodes": (
                {"metadata": {}, "items": list(map(NodeRef, map(NodeName, self.passed)))}
                if as_nodes
                else None
            ),
            "NodeNames": self.passed,
            "FailedNodes": self.failed,
            "FailedAndUnresolvableNodes": self.unresolvable,
            "Error": "",
        }


class _RawNodeList(msgspec.Struct):
    items: list[msgspec.Raw] = []


class _NodesOnly(msgspec.Struct):
    Nodes: _RawNodeList | None = None


def node_names(args: ExtenderArgs, body: bytes | None) -> list[str]:
    """The nodes a filter or prioritize request asks about."""
    if args.NodeNames is not None:
        return args.NodeNames
    if args.Nodes is not None:
        if body is None:  # a caller's mistake, not the client's: nodes would go unread
            raise TypeError("a request with a NodeList needs its JSON body as well")
        return [node.metadata.name for node in args.Nodes.items]
    raise BadRequest("request has neither NodeNames nor Nodes")


def sent_nodes(body: bytes) -> dict[str, Node | str]:
    """The whole node objects of an extender request (JSON), by name; a node whose labels or
    capacity cannot be read maps to the reason, so it fails alone."""
    try:
        listed = msgspec.json.decode(body, type=_NodesOnly).Nodes
    except UNREADABLE:  # the caller has read the request already
        return {}
    nodes: dict[str, Node | str] = {}
    for raw in listed.items if listed else []:
        try:
            name = msgspec.json.decode(raw, type=NodeRef).metadata.name
        except UNREADABLE:
            continue
        try:
            nodes[name] = msgspec.json.decode(raw, type=Node)
        except UNREADABLE as error:
            nodes[name] = f"cannot read the node's labels or capacity: {str(error)[:200]}"
    return nodes


class MetaPod(msgspec.Struct, gc=False):
    UID: str = ""


class MetaVictims(msgspec.Struct):
    Pods: list[MetaPod] = []
    NumPDBViolations: int = 0


class Victims(msgspec.Struct):
    """kube-scheduler's victims on one node, as whole pods (without nodeCacheCapable)."""

    Pods: list[Pod] = []
    NumPDBViolations: int = 0


class ExtenderPreemptionArgs(msgspec.Struct):
    """preempt: the preemptor, and per candidate node the victims kube-scheduler's own dry run
    chose: as whole pods without nodeCacheCapable, as UIDs with it."""

    Pod: Pod | None = None
    NodeNameToVictims: dict[str, Victims] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims] | None = None


class ExtenderPreemptionResult(msgspec.Struct):
    NodeNameToMetaVictims: dict[str, MetaVictims] = {}


def candidate_victims(args: ExtenderPreemptionArgs) -> dict[str, tuple[list[str], int]]:
    """Per candidate node, kube-scheduler's victims (UIDs) and their PDB violations."""
    if args.NodeNameToMetaVictims is not None:
        return {
            node: ([p.UID for p in victims.Pods], victims.NumPDBViolations)
            for node, victims in args.NodeNameToMetaVictims.items()
        }
    if args.NodeNameToVictims is not None:
        return {
            node: ([p.metadata.uid for p in victims.Pods], victims.NumPDBViolations)
            for node, victims in args.NodeNameToVictims.items()
        }
    raise BadRequest("preempt request has neither NodeNameToVictims nor NodeNameToMetaVictims")
