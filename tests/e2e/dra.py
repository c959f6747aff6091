"""The DRA driver on a testbed control plane, installed the way the Helm chart installs it.

A real kube-apiserver and kube-scheduler (DRA on, partitionable devices on: beta in 1.36 and 1.37,
the testbed turns the gate on in 1.35); the
chart's DeviceClasses, RBAC and ValidatingAdmissionPolicies applied with strict server-side apply;
`neuron-scheduler dra-driver` as its CLI process, one per node, over a fake /dev and /sys tree,
authenticated with a ServiceAccount token bound to a pod on its node (as a DaemonSet pod's is).

What the testbed does not have yet, and what stands in for it here:
- no kubelet in most tests: they call NodePrepareResources / NodeUnprepareResources over the
  driver's real gRPC socket, as kubelet would once the scheduler has allocated a pod's claims
  (test_dra_real_kubelet.py runs the driver under the real kubelet);
- no kube-controller-manager: for ResourceClaimTemplates the test does what its resourceclaim
  controller does (create the pod's claim from the template, owned by the pod, and record it in
  the pod's status), and it removes a deleted claim's finalizer as that controller would.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra.pluginregistration import api_pb2 as registration_pb2
from neuron_scheduler.dra.pluginregistration import api_pb2_grpc as registration_grpc
from neuron_scheduler.dra.publisher import Owner, Publisher
from neuron_scheduler.dra.slices import NodeInventory
from neuron_scheduler.dra.v1 import api_pb2 as v1_pb2
from neuron_scheduler.dra.v1 import api_pb2_grpc as v1_grpc
from neuron_scheduler.dra.v1beta1 import api_pb2 as v1beta1_pb2
from neuron_scheduler.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import load_kubeconfig
from tests.builders import PAUSE_IMAGE, node_json
from tests.e2e import harness
from tests.testbed import (
    ControlPlane,
    KubeError,
    ManagedProcess,
    find_kubebin,
)

DRIVER = "neuron.neuron-scheduler.io"  # the chart's default
SYSTEM = "neuron-system"  # where the chart is installed
SERVICE_ACCOUNT = "neuron-dra-driver"
RESOURCE = "/apis/resource.k8s.io/v1"
# Safety net against a hang, never a performance bound.
PATIENCE = 90.0
CATALOG = Catalog.builtin()

Json = dict[str, Any]
T = TypeVar("T")


def wait_for(check: Callable[[], T | None], what: str, seconds: float = PATIENCE) -> T:
    return harness.wait_for(check, what, seconds)


def physical_cores(instance_type: str) -> int:
    """What sysfs core_count says on this type (Trn2: 8 physical, advertised as 4 at LNC=2)."""
    return {"trn2": 8, "trn2u": 8, "inf1": 4}.get(instance_type.split(".")[0], 2)


class DriverProcess:
    """`neuron-scheduler dra-driver` for one node, as the chart's DaemonSet pod would run it."""

    def __init__(
        self, cp: ControlPlane, node: str, instance_type: str, kubelet_root: Path | None = None
    ) -> None:
        """kubelet_root: a real kubelet's --root-dir, whose plugins and plugins_registry the
        driver then serves in (default: directories of its own, for tests that call it)."""
        self.cp = cp
        self.node = node
        # Unix socket paths must stay under 108 bytes: a short directory of our own.
        self.root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
        self.dev, self.sys = self.root / "dev", self.root / "sys"
        devices = CATALOG.device_count(instance_type) or 16
        self.dev.mkdir()
        for d in range(devices):
            (self.dev / f"neuron{d}").touch()
            folder = self.sys / "class" / "neuron_device" / f"neuron{d}"
            folder.mkdir(parents=True)
            (folder / "core_count").write_text(f"{physical_cores(instance_type)}\n")
        self.plugins = (kubelet_root or self.root) / "plugins"
        self.registry = (kubelet_root or self.root) / "plugins_registry"
        self.cdi = self.root / "cdi"
        self.kubeconfig = self._credentials()
        self.process = ManagedProcess(
            f"dra-driver-{node}",
            [
                sys.executable,
                "-m",
                "neuron_scheduler",
                "dra-driver",
                "--node-name",
                node,
                "--driver-name",
                DRIVER,
                "--kubeconfig",
                str(self.kubeconfig),
                "--dev-root",
                str(self.dev),
                "--sys-root",
                str(self.sys),
                "--logical-nc-config",
                str(self.root / "no-lnc-file"),
                "--plugins-dir",
                str(self.plugins),
                "--registry-dir",
                str(self.registry),
                "--cdi-root",
                str(self.cdi),
                "--health-interval",
                "0.5",
            ],
            cp.log_dir / f"dra-driver-{node}.log",
        )

    @property
    def registration_socket(self) -> Path:
        return self.registry / f"{DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.plugins / DRIVER / "dra.sock"

    @property
    def checkpoint(self) -> Path:
        return self.plugins / DRIVER / "checkpoint.json"

    def _credentials(self) -> Path:
        """A token bound to a pod on this node, like the one kubelet mounts into the DaemonSet's
        pod: it carries the node's name, which the chart's admission policy checks."""
        credentials = self.cp.service_account(
            SYSTEM, SERVICE_ACCOUNT, node=self.node, kubeconfig_path=self.root / "kubeconfig"
        )
        self.token = credentials.token
        return credentials.kubeconfig_path

    def start(self) -> None:
        self.process.start()
        # A killed driver leaves its socket files behind: wait until the new process answers.
        wait_for(
            lambda: self._check_alive() and self._answers(),
            f"the driver on {self.node} to answer on its sockets",
        )
        wait_for(
            lambda: self._check_alive() and pool_complete(self.cp, self.node), f"pool {self.node}"
        )

    def _answers(self) -> bool:
        try:
            self.get_info()
        except grpc.RpcError:
            return False
        return True

    def _check_alive(self) -> bool:
        if not self.process.alive():
            raise AssertionError(f"dra-driver on {self.node} exited:\n{self.process.log_tail()}")
        return True

    def stop(self, *, kill: bool = False) -> None:
        self.process.stop(kill=kill)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- kubelet's calls ---------------------------------------------------------------------

    def get_info(self) -> registration_pb2.PluginInfo:
        with grpc.insecure_channel(f"unix://{self.registration_socket}") as channel:
            return registration_grpc.RegistrationStub(channel).GetInfo(
                registration_pb2.InfoRequest(), timeout=5
            )

    def prepare(self, claims: list[Json], version: str = "v1") -> Any:
        refs = [
            (c["metadata"]["namespace"], c["metadata"]["uid"], c["metadata"]["name"])
            for c in claims
        ]
        with grpc.insecure_channel(f"unix://{self.dra_socket}") as channel:
            if version == "v1":
                return v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    v1_pb2.NodePrepareResourcesRequest(
                        claims=[v1_pb2.Claim(namespace=n, uid=u, name=m) for n, u, m in refs]
                    ),
                    timeout=45,
                )
            return v1beta1_grpc.DRAPluginStub(channel).NodePrepareResources(
                v1beta1_pb2.NodePrepareResourcesRequest(
                    claims=[v1beta1_pb2.Claim(namespace=n, uid=u, name=m) for n, u, m in refs]
                ),
                timeout=45,
            )

    def unprepare(self, claims: list[Json]) -> v1_pb2.NodeUnprepareResourcesResponse:
        with grpc.insecure_channel(f"unix://{self.dra_socket}") as channel:
            return v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                v1_pb2.NodeUnprepareResourcesRequest(
                    claims=[
                        v1_pb2.Claim(
                            namespace=c["metadata"]["namespace"],
                            uid=c["metadata"]["uid"],
                            name=c["metadata"]["name"],
                        )
                        for c in claims
                    ]
                ),
                timeout=45,
            )

    def cdi_spec(self, uid: str) -> Json | None:
        import json

        path = self.cdi / f"{DRIVER}-{uid}.json"
        try:  # not exists() then read: the driver may remove it in between
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None


@contextlib.contextmanager
def dra_control_plane(
    feature_gates: dict[str, bool] | None = None, workdir: Path | None = None
) -> Iterator[ControlPlane]:
    """A control plane with the chart's DRA objects (the whole chart with DRA on: the extender
    and device plugin objects are applied too, nothing runs them) and the default-scheduler;
    `feature_gates` on top of those the version needs."""
    from tests.e2e.chart import apply, render

    kubebin = find_kubebin(harness.ROOT)
    with ControlPlane(kubebin, workdir, feature_gates=feature_gates) as plane:
        plane.client.ensure_namespace(SYSTEM)
        # The chart's DRA objects, strictly: unknown or duplicate fields are errors. Not its
        # policies on every pod write (who writes plans and ids): they would hold a testbed
        # extender started on this control plane (another ServiceAccount) to this release's.
        docs = [
            d
            for d in render({"dra": {"enabled": True}}, namespace=SYSTEM)
            if not d["metadata"]["name"].endswith(("-plans", "-hand-off"))
        ]
        out = apply(plane, docs)
        assert out.count("serverside-applied") == len(docs), out
        plane.start_scheduler(scheduler_name="default-scheduler")
        yield plane


def slices_of(cp: ControlPlane, node: str) -> list[Json]:
    listed = cp.request(
        "GET", f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={node},spec.driver={DRIVER}"
    )
    return list(listed["items"])


def pool_complete(cp: ControlPlane, node: str) -> bool:
    found = slices_of(cp, node)
    return bool(found) and all(s["spec"]["pool"]["resourceSliceCount"] == len(found) for s in found)


def publish(cp: ControlPlane, node: str, instance_type: str, uid: str) -> None:
    """The driver's own publisher, run in this process (for many nodes at once)."""
    topology = CATALOG.resolve(instance_type, CATALOG.device_count(instance_type) or 16).topology

    async def run() -> None:
        async with KubeAPI(load_kubeconfig(cp.kubeconfig_path)) as api:
            await Publisher(api, DRIVER, Owner(node, uid)).publish(NodeInventory(node, topology))

    asyncio.run(run())


class Workloads:
    """Claims, templates and pods in one namespace, and the controller work the testbed lacks."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp = cp
        self.namespace = namespace
        cp.client.ensure_namespace(namespace)

    def add_node(self, instance_type: str, labels: dict[str, str]) -> tuple[str, str]:
        name = f"{instance_type.replace('.', '-')}-{uuid.uuid4().hex[:6]}"
        node = self.cp.request(
            "POST", "/api/v1/nodes", node_json(name, instance_type, labels=labels)
        )
        return name, node["metadata"]["uid"]

    @staticmethod
    def request(size: int, members: str | None = None, *, cores: bool = False) -> Json:
        """`count: 1` of the class for `size` connected devices, or cores (`cores`), pinned to
        one published set by its `members` (devices) when given."""
        exactly: Json = {
            "deviceClassName": f"{'neuroncore' if cores else 'neuron'}-{size}",
            "allocationMode": "ExactCount",
            "count": 1,
        }
        if members is not None:
            exactly["selectors"] = [
                {"cel": {"expression": f"device.attributes['{DRIVER}'].members == '{members}'"}}
            ]
        return {"name": "neurons", "exactly": exactly}

    def claim(
        self, name: str, size: int, members: str | None = None, *, cores: bool = False
    ) -> Json:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [self.request(size, members, cores=cores)]}},
        }
        created: Json = self.cp.request(
            "POST", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims", body
        )
        return created

    def template(self, name: str, size: int) -> Json:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [self.request(size)]}}},
        }
        created: Json = self.cp.request(
            "POST", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaimtemplates", body
        )
        return created

    def pod(
        self,
        name: str,
        *,
        claim: str | None = None,
        template: str | None = None,
        node_selector: dict[str, str],
        scheduler: str = "default-scheduler",
    ) -> Json:
        source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "schedulerName": scheduler,
                "nodeSelector": node_selector,
                "containers": [
                    {
                        "name": "c",
                        "image": PAUSE_IMAGE,
                        "resources": {"claims": [{"name": "neurons"}]},
                    }
                ],
                "resourceClaims": [{"name": "neurons", **source}],
            },
        }
        created: Json = self.cp.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body)
        if template:
            self.claim_from_template(created, template)
        return created

    def claim_from_template(self, pod: Json, template: str) -> Json:
        """What kube-controller-manager's resourceclaim controller does for a new pod."""
        spec = self.cp.request(
            "GET", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaimtemplates/{template}"
        )["spec"]["spec"]
        meta = pod["metadata"]
        claim: Json = self.cp.request(
            "POST",
            f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "generateName": f"{meta['name']}-neurons-",
                    "annotations": {"resource.kubernetes.io/pod-claim-name": "neurons"},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": meta["name"],
                            "uid": meta["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": spec,
            },
        )
        self.cp.request(
            "PATCH",
            f"/api/v1/namespaces/{self.namespace}/pods/{meta['name']}/status",
            {
                "status": {
                    "resourceClaimStatuses": [
                        {"name": "neurons", "resourceClaimName": claim["metadata"]["name"]}
                    ]
                }
            },
            content_type="application/merge-patch+json",
        )
        return claim

    def get_claim(self, name: str) -> Json:
        found: Json = self.cp.request(
            "GET", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims/{name}"
        )
        return found

    def claims(self) -> list[Json]:
        listed = self.cp.request("GET", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims")
        return list(listed["items"])

    def pods(self) -> list[Json]:
        return list(self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")["items"])

    def pod_claim(self, pod: str) -> str:
        """The claim a pod's `neurons` entry resolved to (its own or the generated one)."""
        found = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
        for entry in found["spec"]["resourceClaims"]:
            if entry.get("resourceClaimName"):
                return str(entry["resourceClaimName"])
        (status,) = found["status"]["resourceClaimStatuses"]
        return str(status["resourceClaimName"])

    def wait_allocated(self, claim: str) -> Json:
        def allocated() -> Json | None:
            found = self.get_claim(claim)
            return found if found.get("status", {}).get("allocation") else None

        return wait_for(allocated, f"claim {claim} to be allocated")

    def events(self, name: str) -> list[Json]:
        listed = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/events")
        return [e for e in listed["items"] if e["involvedObject"].get("name") == name]

    def release(self, pod: str, claim: str) -> None:
        """Delete a pod and its claim, removing the claim's finalizer as the resourceclaim
        controller does once no pod uses it (the scheduler then frees its devices)."""
        with contextlib.suppress(KubeError):
            self.cp.request(
                "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{pod}?gracePeriodSeconds=0"
            )
        path = f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims/{claim}"
        with contextlib.suppress(KubeError):
            self.cp.request("DELETE", path)
        with contextlib.suppress(KubeError):
            self.cp.request(
                "PATCH",
                path,
                {"metadata": {"finalizers": None}},
                content_type="application/merge-patch+json",
            )


def allocated_devices(claim: Json) -> list[tuple[str, str]]:
    """(pool, device) of every result of ours in the claim's status."""
    allocation = claim.get("status", {}).get("allocation") or {}
    return [
        (r["pool"], r["device"])
        for r in allocation.get("devices", {}).get("results", [])
        if r["driver"] == DRIVER
    ]
