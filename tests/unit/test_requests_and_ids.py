from __future__ import annotations

import pytest

from neuron_scheduler.core.ids import format_ids, parse_id_ranges
from neuron_scheduler.core.resources import (
    NEURON,
    NEURONCORE,
    NEURONDEVICE,
    NeuronRequest,
    RequestError,
    Unit,
    pod_request,
    resource_name,
)


def test_pod_request_sums_containers_in_order() -> None:
    r = pod_request([{NEURONCORE: 2}, {"cpu": 1}, {NEURONCORE: 3}])
    assert r == NeuronRequest(NEURONCORE, 5, (2, 0, 3))
    assert r is not None and r.unit is Unit.CORE


def test_pod_without_neuron_is_none() -> None:
    assert pod_request([{"cpu": 2}, {}]) is None


def test_pod_mixing_kinds_is_refused() -> None:
    with pytest.raises(RequestError, match="more than one Neuron resource kind"):
        pod_request([{NEURON: 1}, {NEURONCORE: 2}])
    with pytest.raises(RequestError, match="more than one"):
        pod_request([{NEURON: 1, NEURONDEVICE: 1}])


def test_init_container_larger_than_app_containers() -> None:
    r = pod_request([{NEURON: 1}], init_containers=[{NEURON: 4}])
    assert r is not None and r.count == 4 and r.per_container == (1, 3)
    r = pod_request([{NEURON: 2}], init_containers=[{NEURON: 1}])
    assert r == NeuronRequest(NEURON, 2)


def test_negative_and_zero_counts() -> None:
    with pytest.raises(RequestError):
        NeuronRequest(NEURON, 0)
    with pytest.raises(RequestError, match="negative"):
        pod_request([{NEURON: -1}, {NEURON: 2}])


def test_resource_names() -> None:
    assert resource_name("neuroncore") == NEURONCORE
    assert resource_name(NEURONDEVICE) == NEURONDEVICE
    with pytest.raises(RequestError, match="unknown Neuron resource"):
        resource_name("gpu")


@pytest.mark.parametrize(
    ("ids", "text"),
    [([], "none"), ([0, 1, 5], "0,1,5"), ([0, 1, 2, 3, 4, 5, 10], "0-5,10"), ([7], "7")],
)
def test_format_and_parse_ids(ids: list[int], text: str) -> None:
    assert format_ids(ids) == text
    assert parse_id_ranges(text) == ids


@pytest.mark.parametrize("text", ["a", "1-", "3-1", "-1", "1,,2"])
def test_parse_ids_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_id_ranges(text)
