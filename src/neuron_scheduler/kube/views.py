"""What every cache fed by a list-then-watch does on a full re-list: apply each listed object and
forget those the list no longer has (their delete events were missed)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from neuron_scheduler.kube.objects import Node, Pod

T = TypeVar("T")


def replace_all(
    listed: Iterable[T],
    key: Callable[[T], str],
    apply: Callable[[T], None],
    known: Iterable[str],
    remove: Callable[[str], None],
) -> None:
    """`known`: the keys held before the list (read once, before anything is applied)."""
    before = list(known)
    seen = set()
    for item in listed:
        seen.add(key(item))
        apply(item)
    for gone in before:
        if gone not in seen:
            remove(gone)


def node_name(node: Node) -> str:
    return node.metadata.name


def pod_uid(pod: Pod) -> str:
    return pod.metadata.uid
