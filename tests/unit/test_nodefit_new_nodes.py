"""kube/nodefit.admits_label: whether a pod may go to a node that does not exist yet, knowing
only one of its labels (a capacity request's instance type)."""

from __future__ import annotations

from typing import Any

import msgspec

from neuron_scheduler.kube.nodefit import admits_label
from neuron_scheduler.kube.objects import Pod
from tests.builders import pod_json

TYPE = "node.kubernetes.io/instance-type"


def with_terms(*terms: dict[str, Any]) -> Pod:
    body = pod_json("p", {})
    body["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }
    return msgspec.convert(body, Pod)


def names(operator: str) -> dict[str, Any]:
    return {"key": "metadata.name", "operator": operator, "values": ["ring-1"]}


def test_a_term_naming_existing_nodes_admits_no_new_one() -> None:
    assert not admits_label(with_terms({"matchFields": [names("In")]}), TYPE, "inf2.48xlarge")
    assert admits_label(with_terms({"matchFields": [names("NotIn")]}), TYPE, "inf2.48xlarge")
    # Another term may still admit it.
    either = with_terms(
        {"matchFields": [names("In")]},
        {"matchExpressions": [{"key": TYPE, "operator": "In", "values": ["inf2.48xlarge"]}]},
    )
    assert admits_label(either, TYPE, "inf2.48xlarge")
    assert not admits_label(either, TYPE, "trn1.32xlarge")


def test_the_label_decides_where_the_pod_names_it() -> None:
    pinned = msgspec.convert(
        {**pod_json("p", {}), "spec": {**pod_json("p", {})["spec"], "nodeSelector": {TYPE: "x"}}},
        Pod,
    )
    assert admits_label(pinned, TYPE, "x")
    assert not admits_label(pinned, TYPE, "y")
    assert admits_label(msgspec.convert(pod_json("p", {}), Pod), TYPE, "y")
