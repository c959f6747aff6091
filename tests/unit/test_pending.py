"""The pending pods bind reads instead of asking the API: only unbound, live pods of the
schedulers the extender binds for, as the watch last showed them."""

from __future__ import annotations

import msgspec

from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.state.pending import PendingPods
from neuron_scheduler.kube.objects import Pod
from tests.builders import pod_json


def pod(name: str, **changes: object) -> Pod:
    body = pod_json(name, {NEURON: 1}, uid=f"uid-{name}")
    body["metadata"]["resourceVersion"] = "1"
    for path, value in changes.items():
        part, key = path.split("__")
        body[part][key] = value
    return msgspec.convert(body, Pod)


def test_pending_pods_of_our_schedulers_are_kept_as_last_seen() -> None:
    pending = PendingPods(["my-scheduler"])
    pending.replace_pods(
        [
            pod("a"),
            pod("bound", spec__nodeName="n1"),
            pod("other", spec__schedulerName="default-scheduler"),
            pod("done", status__phase="Succeeded"),
            pod("going", metadata__deletionTimestamp="2026-11-26T00:00:00Z"),
        ]
    )
    assert [p.metadata.name for p in map(pending.get, ("uid-a",)) if p] == ["a"]
    assert len(pending) == 1
    newer = pod("a")
    newer.metadata.resourceVersion = "2"
    pending.apply_pod(newer)
    assert pending.get("uid-a") is newer
    pending.apply_pod(pod("a", spec__nodeName="n1"))  # bound: bind no longer needs it
    assert pending.get("uid-a") is None
    pending.apply_pod(pod("b"))
    pending.remove_pod("uid-b")
    assert len(pending) == 0


def test_beyond_the_limit_new_pods_are_left_to_the_api() -> None:
    pending = PendingPods(["my-scheduler"], limit=1)
    pending.apply_pod(pod("a"))
    pending.apply_pod(pod("b"))
    assert pending.get("uid-b") is None
    pending.apply_pod(pod("a"))  # one it keeps is still updated
    assert pending.get("uid-a") is not None
