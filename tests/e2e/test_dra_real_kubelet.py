"""The DRA driver under the real kubelet: the kubelet of tools/kube (as root in a mount
namespace of its own, against the upstream fake CRI runtime; tests/testbed/kubelet.py) finds the
driver's registration socket, registers it, and calls NodePrepareResources for a pod whose claim
the real kube-scheduler allocated over the driver's slices; the pod starts; deleting it makes the
kubelet call NodeUnprepareResources. The chart's DRA objects are applied strictly first and the
driver runs under its RBAC and admission policies.

The fake runtime does not record CDI device ids (it logs the device plugin's device specs only),
so what the container would get is read from the CDI spec the driver wrote for the claim.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from neuron_scheduler.dra.shapes import shapes_by_name
from tests.e2e.chart import apply, render
from tests.e2e.dra import CATALOG, SYSTEM, DriverProcess, Json, Workloads, wait_for
from tests.testbed import ControlPlane, KubeError
from tests.testbed.kubelet import Kubelet, NodeCA

pytestmark = [pytest.mark.e2e, pytest.mark.needs("dra")]

NODE = "dra-real-node"
INSTANCE = "inf2.48xlarge"


@dataclass
class RealDraNode:
    cp: ControlPlane
    kubelet: Kubelet
    driver: DriverProcess
    work: Workloads

    def pod(self, name: str) -> Json:
        found: Json = self.cp.request(
            "GET", f"/api/v1/namespaces/{self.work.namespace}/pods/{name}"
        )
        return found

    def why(self, name: str) -> str:
        events = [f"{e['reason']}: {e.get('message', '')}" for e in self.work.events(name)]
        return (
            f"pod {name}: {json.dumps(self.pod(name)['status'])[:1200]}\nevents: {events[-6:]}\n"
            f"driver log:\n{self.driver.process.log_tail(30)}\n"
            f"kubelet log:\n{self.kubelet.kubelet.log_tail(40)}"
        )


@pytest.fixture(scope="module")
def real(kubebin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealDraNode]:
    work_dir = tmp_path_factory.mktemp("dra-real-kubelet")
    ca = NodeCA(work_dir / "node-ca")
    with ControlPlane(kubebin, work_dir / "cp", extra_apiserver_args=ca.apiserver_args) as cp:
        cp.client.ensure_namespace(SYSTEM)
        values = {"dra": {"enabled": True}, "scheduler": {"enabled": False}}
        apply(cp, render({**values, "devicePlugin": {"enabled": False}}, namespace=SYSTEM))
        cp.start_scheduler(scheduler_name="default-scheduler")
        kubelet = Kubelet(
            cp, ca, NODE, instance_type=INSTANCE, labels={"neuron-scheduler.io/neuron-path": "dra"}
        )
        driver: DriverProcess | None = None
        try:
            kubelet.start()
            driver = DriverProcess(cp, NODE, INSTANCE, kubelet_root=kubelet.root_dir)
            driver.start()
            # Every test starts once the kubelet has registered the driver: a pod it admits
            # before then fails to prepare ("DRA driver ... is not registered"), and the kubelet
            # tries that pod again only after a back-off longer than a test waits.
            log_path = driver.process.log_path
            wait_for(
                lambda: "kubelet registered DRA driver" in log_path.read_text(),
                "the kubelet to register the driver",
            )
            yield RealDraNode(cp, kubelet, driver, Workloads(cp, "dra-real"))
        finally:
            if driver is not None:
                driver.remove()
            kubelet.close()


@pytest.mark.compat
def test_the_real_kubelet_registers_the_driver_and_prepares_a_wrapping_window(
    real: RealDraNode,
) -> None:
    work, driver = real.work, real.driver
    pods = ("hold-2-8", "hold-9-10", "window")  # each with its claim of the same name
    try:
        # Devices 2-10 held, so the only free 3-window is 11,0,1.
        for name, size, held in (("hold-2-8", 7, "2,3,4,5,6,7,8"), ("hold-9-10", 2, "9,10")):
            work.claim(name, size, members=held)
            work.pod(name, claim=name, node_selector={"kubernetes.io/hostname": NODE})
        work.claim("window", 3)
        work.pod("window", claim="window", node_selector={"kubernetes.io/hostname": NODE})
        for name in pods:
            try:
                wait_for(
                    lambda n=name: real.pod(n)["status"].get("phase") == "Running",
                    f"{name} Running",
                )
            except AssertionError:
                raise AssertionError(real.why(name)) from None
        claim = work.get_claim("window")
        uid = claim["metadata"]["uid"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["pool"], r["device"]) for r in results] == [(NODE, "window-3-at-11")]
        # What the runtime is told to give the container, written when the kubelet prepared it.
        spec = driver.cdi_spec(uid)
        assert spec is not None, driver.process.log_tail(30)
        (device,) = spec["devices"]
        assert device["name"] == f"{uid}-window-3-at-11"
        nodes = [n["path"] for n in device["containerEdits"]["deviceNodes"]]
        assert nodes == ["/dev/neuron0", "/dev/neuron1", "/dev/neuron11"]
        assert "NEURON_RT_VISIBLE_CORES=0,1,2,3,22,23" in device["containerEdits"]["env"]
        assert f"prepared claim dra-real/window ({uid})" in driver.process.log_path.read_text()
        # Deleting the pod through the kubelet unprepares the claim: spec and checkpoint entry go.
        try:
            real.cp.request("DELETE", "/api/v1/namespaces/dra-real/pods/window")
        except KubeError as error:
            assert error.status == 404
        wait_for(lambda: driver.cdi_spec(uid) is None, "the kubelet to unprepare the claim")
        assert uid not in driver.checkpoint.read_text()
        assert "Traceback" not in driver.process.log_path.read_text()
    finally:
        # The node is shared with the module's other tests: what this one held goes, pass or fail.
        for name in pods:
            work.release(name, name)


def test_the_real_kubelet_prepares_a_core_claim(real: RealDraNode) -> None:
    """A 2-core claim (neuroncore-2): the kubelet calls the driver for it, the pod starts, and
    what the container is given is exactly the claim's cores and the devices they are on."""
    work, driver = real.work, real.driver
    try:
        work.claim("two-cores", 2, cores=True)
        work.pod("two-cores", claim="two-cores", node_selector={"kubernetes.io/hostname": NODE})
        try:
            wait_for(lambda: real.pod("two-cores")["status"].get("phase") == "Running", "Running")
        except AssertionError:
            raise AssertionError(real.why("two-cores")) from None
        claim = work.get_claim("two-cores")
        uid = claim["metadata"]["uid"]
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        shape = shapes_by_name(CATALOG.resolve(INSTANCE).topology)[result["device"]]
        assert shape.count == 2 and shape.name.startswith("cores-2-at-")
        spec = driver.cdi_spec(uid)
        assert spec is not None, driver.process.log_tail(30)
        (device,) = spec["devices"]
        edits = device["containerEdits"]
        assert edits["env"] == ["NEURON_RT_VISIBLE_CORES=" + ",".join(map(str, shape.cores))]
        assert [n["path"] for n in edits["deviceNodes"]] == [
            f"/dev/neuron{d}" for d in shape.device_ids
        ]
        work.release("two-cores", "two-cores")
        wait_for(lambda: driver.cdi_spec(uid) is None, "the kubelet to unprepare the claim")
    finally:
        work.release("two-cores", "two-cores")
