"""Issue 41, the DRA route: with our DRA driver's slices, Karpenter sees contiguity itself. Its own
allocator handles partitionable devices with shared counters (`IGNORE_DRA_REQUESTS=false`); what
it lacks is the slices a node that does not exist yet would publish, which its cloud provider
gives as ResourceSliceTemplates. `neuron-scheduler dra-slice-templates` writes them from the
catalog through the driver's own slice code, and the kwok provider's wrapper (test tooling:
tools/autoscaler/karpenter-kwok) hands them to Karpenter.

The world: the chart's DRA objects and the default-scheduler (tests/e2e/dra.py); an
inf2.48xlarge not managed by Karpenter whose devices are allocated one by one to pods' claims but
2, 5, 8 and 11; a pod whose claim asks for a window of 3. The scheduler's DRA allocator finds no
window on it; Karpenter adds an inf2.48xlarge, the driver's publisher publishes that node's
slices (here in this process, as test_dra.py's many-node tests do: no driver process per node),
and the pod is allocated a window there.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_scheduler.core.catalog import Catalog
from tests.e2e.dra import (
    DRIVER,
    Json,
    Workloads,
    allocated_devices,
    dra_control_plane,
    publish,
    wait_for,
)
from tests.testbed import ControlPlane
from tests.testbed.autoscaler import Karpenter, find_autoscaler_bin

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TYPE = "inf2.48xlarge"
HOLES = [2, 5, 8, 11]
PATIENCE = 120.0


class Publishing:
    """Publishes our slices for every Node of a NodePool as it appears (what the driver's
    DaemonSet pod would do on it), in a thread."""

    def __init__(self, cp: ControlPlane, pool: str) -> None:
        self.cp = cp
        self.pool = pool
        self.published: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="publishing", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.2):
                path = f"/api/v1/nodes?labelSelector=karpenter.sh/nodepool={self.pool}"
                for node in self.cp.request("GET", path)["items"]:
                    name = node["metadata"]["name"]
                    if name not in self.published:
                        publish(self.cp, name, TYPE, node["metadata"]["uid"])
                        self.published.append(name)
        except BaseException as error:  # reported by stop(), in the test's thread
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise RuntimeError(f"publishing failed: {self.error!r}") from self.error


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with dra_control_plane() as plane:
        yield plane


@pytest.fixture(scope="module")
def karpenter(cp: ControlPlane) -> Iterator[Karpenter]:
    templates = cp.workdir / "slice-templates.json"
    # As a user (or a provider's build) would make them: the shipped command.
    written = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_scheduler",
            "dra-slice-templates",
            "--instance-type",
            TYPE,
            "--driver-name",
            DRIVER,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    templates.write_text(written.stdout)
    running = Karpenter(
        cp,
        find_autoscaler_bin(ROOT),
        [TYPE],
        Catalog.builtin(),
        templates=templates,
        env={"IGNORE_DRA_REQUESTS": "false"},
    )
    running.start()
    try:
        yield running
    finally:
        running.stop()


def test_a_stranded_claim_gets_a_new_node_from_karpenter(
    cp: ControlPlane, karpenter: Karpenter
) -> None:
    label = {"neuron-test": f"dra-{uuid.uuid4().hex[:6]}"}
    work = Workloads(cp, f"autoscaling-{label['neuron-test']}")
    existing, uid = work.add_node(TYPE, label)
    publish(cp, existing, TYPE, uid)
    for device in range(12):
        if device not in HOLES:
            work.claim(f"one-{device}", 1, members=str(device))
            work.pod(f"fill-{device}", claim=f"one-{device}", node_selector=label)
    for device in range(12):
        if device not in HOLES:
            work.wait_allocated(f"one-{device}")
    pool = f"dra-{label['neuron-test']}"
    karpenter.node_pool(pool, [TYPE], labels=label, policy="WhenEmpty", consolidate_after="30s")
    publishing = Publishing(cp, pool)
    try:
        work.claim("three", 3)
        created = time.monotonic()
        work.pod("big", claim="three", node_selector=label)
        # kube-scheduler's own allocator finds no window of 3 on the fragmented node.
        wait_for(
            lambda: any(
                e["reason"] == "FailedScheduling" and "cannot allocate all claims" in e["message"]
                for e in work.events("big")
            ),
            "the claim refused on the fragmented node",
        )
        pod = wait_for(
            lambda: p if (p := _pod(work, "big"))["spec"].get("nodeName") else None,
            "the pod bound",
            PATIENCE,
        )
        took = time.monotonic() - created
        node = pod["spec"]["nodeName"]
        assert node != existing
        assert node in publishing.published
        (nodeclaim,) = karpenter.node_claims(pool)
        assert nodeclaim["metadata"]["labels"]["node.kubernetes.io/instance-type"] == TYPE
        claim = work.get_claim("three")
        ((slice_pool, device),) = allocated_devices(claim)
        assert slice_pool == node and device.startswith("window-3-at-"), device
        print(f"\nthe pod was bound on {node} ({device}) {took:.1f}s after it was created")
    finally:
        publishing.stop()
        karpenter.delete_node_pool(pool)


def _pod(work: Workloads, name: str) -> Json:
    found: Json = work.cp.request("GET", f"/api/v1/namespaces/{work.namespace}/pods/{name}")
    return found
