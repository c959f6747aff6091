"""The chart's `dra.*` values: what they render (DeviceClasses, DaemonSet, least-privilege RBAC,
admission policies, the node label that picks DRA or the device plugin) and what they refuse.
Strict server-side apply of a `dra.enabled=true` render is in test_dra.py, whose control plane
then runs the driver under exactly those objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from neuron_scheduler.dra import DEFAULT_DRIVER_NAME
from tests.e2e.chart import ROOT, Doc, find, helm, kinds, refusal, render, run_typed
from tests.testbed import ControlPlane, find_kubebin

pytestmark = pytest.mark.e2e

DRA = {"dra": {"enabled": True}}
DRA_OBJECTS = [
    "ClusterRole/neuron-dra-driver",
    "ClusterRoleBinding/neuron-dra-driver",
    "DaemonSet/neuron-dra-driver",
    "ServiceAccount/neuron-dra-driver",
    "ValidatingAdmissionPolicy/neuron-dra-driver-one-set-per-request",
    "ValidatingAdmissionPolicy/neuron-dra-driver-own-node-slices",
    "ValidatingAdmissionPolicyBinding/neuron-dra-driver-one-set-per-request",
    "ValidatingAdmissionPolicyBinding/neuron-dra-driver-own-node-slices",
    *[f"DeviceClass/neuron-{n}" for n in range(1, 17)],
    *[f"DeviceClass/neuroncore-{n}" for n in (1, 2, 4, 8, 16)],
]


def dra_kinds(docs: list[Doc]) -> list[str]:
    return [k for k in kinds(docs) if "dra" in k or k.startswith("DeviceClass/")]


def device_plugin_affinity(docs: list[Doc]) -> list[Doc]:
    spec = find(docs, "DaemonSet", "neuron-device-plugin")["spec"]["template"]["spec"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    expressions: list[Doc] = term["matchExpressions"]
    return expressions


def test_off_by_default() -> None:
    docs = render()
    assert dra_kinds(docs) == []
    assert not any(
        e["key"].startswith("neuron-scheduler.io/") for e in device_plugin_affinity(docs)
    )


def test_enabled_renders_the_driver_and_keeps_the_device_plugin_off_its_nodes() -> None:
    lint = helm("lint", "--strict", values=DRA)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(DRA)
    assert sorted(dra_kinds(docs)) == sorted(DRA_OBJECTS)
    label = {"key": "neuron-scheduler.io/neuron-path", "operator": "NotIn", "values": ["dra"]}
    assert label in device_plugin_affinity(docs)
    spec = find(docs, "DaemonSet", "neuron-dra-driver")["spec"]["template"]["spec"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert {**label, "operator": "In"} in term["matchExpressions"]
    (container,) = spec["containers"]
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for writable in (
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/plugins_registry",
        "/var/run/cdi",
    ):
        assert not mounts[writable].get("readOnly"), writable
    assert mounts["/host/dev"]["readOnly"] and mounts["/host/sys"]["readOnly"]


def test_a_dra_only_install_is_accepted() -> None:
    docs = render({**DRA, "scheduler": {"enabled": False}, "devicePlugin": {"enabled": False}})
    assert sorted(kinds(docs)) == sorted(DRA_OBJECTS)
    nothing = {"scheduler": {"enabled": False}, "devicePlugin": {"enabled": False}}
    assert "the chart would install nothing" in refusal(nothing)


def test_device_classes_select_one_size_of_our_driver() -> None:
    values = {"maxClassSize": 4, "coreWindows": [1, 2], "driverName": "neuron.example.com"}
    docs = render({"dra": {"enabled": True, **values}})
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    names = ["neuron-1", "neuron-2", "neuron-3", "neuron-4", "neuroncore-1", "neuroncore-2"]
    assert [c["metadata"]["name"] for c in classes] == names
    (selector,) = classes[2]["spec"]["selectors"]
    assert selector["cel"]["expression"] == (
        "device.driver == 'neuron.example.com' && device.attributes['neuron.example.com'].size == 3"
    )
    (selector,) = classes[5]["spec"]["selectors"]
    assert selector["cel"]["expression"] == (
        "device.driver == 'neuron.example.com' && "
        "device.attributes['neuron.example.com'].shape == 'cores' && "
        "device.attributes['neuron.example.com'].cores == 2"
    )
    policy = find(docs, "ValidatingAdmissionPolicy", "neuron-dra-driver-one-set-per-request")
    (classes_variable,) = [v for v in policy["spec"]["variables"] if v["name"] == "classes"]
    assert yaml.safe_load(classes_variable["expression"]) == names
    none = render({"dra": {"enabled": True, "coreWindows": []}})
    assert not [d for d in none if d["metadata"]["name"].startswith("neuroncore-")]


def test_rbac_is_least_privilege() -> None:
    role = find(render(DRA), "ClusterRole", "neuron-dra-driver")
    verbs = {
        (r["apiGroups"][0], res): set(r["verbs"]) for r in role["rules"] for res in r["resources"]
    }
    assert verbs == {
        ("resource.k8s.io", "resourceslices"): {"get", "list", "create", "update", "delete"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("", "nodes"): {"get"},
    }
    slices_policy = find(
        render(DRA), "ValidatingAdmissionPolicy", "neuron-dra-driver-own-node-slices"
    )
    (condition,) = slices_policy["spec"]["matchConditions"]
    assert "system:serviceaccount:kube-system:neuron-dra-driver" in condition["expression"]


def test_rendered_arguments_parse_with_the_cli() -> None:
    import typer.main

    from neuron_scheduler.cli import app

    docs = render({"dra": {"enabled": True, "coresPerDevice": 4, "kubeletDir": "/data/kubelet"}})
    (container,) = find(docs, "DaemonSet", "neuron-dra-driver")["spec"]["template"]["spec"][
        "containers"
    ]
    name, *args = container["args"]
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    params = command.make_context(name, list(args)).params
    assert params["driver_name"] == DEFAULT_DRIVER_NAME
    assert params["cores_per_device"] == 4
    assert str(params["plugins_dir"]) == "/data/kubelet/plugins"
    assert str(params["registry_dir"]) == "/data/kubelet/plugins_registry"
    assert str(params["dev_root"]) == "/host/dev"
    assert params["core_windows"] == "1,2,4,8,16"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dra": {"enabled": True, "driverName": "neuron.aws.com"}}, "/dra/driverName"),
        ({"dra": {"enabled": True, "driverName": "Neuron"}}, "/dra/driverName"),
        ({"dra": {"enabled": True, "maxClassSize": 0}}, "/dra/maxClassSize"),
        ({"dra": {"enabled": True, "coreWindows": [33]}}, "/dra/coreWindows"),
        ({"dra": {"enabled": True, "coreWindows": [2, 2]}}, "/dra/coreWindows"),
        ({"dra": {"enabled": True, "cdiRoot": "relative"}}, "/dra/cdiRoot"),
        ({"dra": {"enable": True}}, "'enable' not allowed"),
    ],
)
def test_refused_values(values: Doc, message: str) -> None:
    assert message in refusal(values)


@pytest.mark.compat
def test_helm_installs_dra_where_the_cluster_has_it_and_refuses_it_by_name_elsewhere(
    tmp_path: Path,
) -> None:
    """`helm upgrade --install --set dra.enabled=true` against the testbed's kube-apiserver, so
    helm reads the version and the API list from the cluster as on a user's: the DRA objects
    from 1.35, a refusal that says why and installs nothing below."""
    with ControlPlane(find_kubebin(ROOT), tmp_path / "cp") as cp:
        result = run_typed(
            "helm upgrade --install neuron oci://public.ecr.aws/neuron/neuron-helm-chart"
            " --namespace kube-system --set dra.enabled=true",
            cp.kubeconfig_path,
        )
        deployments = cp.request("GET", "/apis/apps/v1/namespaces/kube-system/deployments")
        if cp.version.minor < 35:
            assert result.returncode != 0, result.stdout
            assert (
                f"dra.enabled needs Kubernetes 1.35 or newer, and this cluster is {cp.version}"
                in result.stderr
            ), result.stderr
            assert deployments["items"] == []
            return
        assert result.returncode == 0, result.stderr
        classes = cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]
        assert {c["metadata"]["name"] for c in classes} == {
            k.split("/")[1] for k in DRA_OBJECTS if k.startswith("DeviceClass/")
        }
        daemonsets = cp.request("GET", "/apis/apps/v1/namespaces/kube-system/daemonsets")
        assert "neuron-dra-driver" in {d["metadata"]["name"] for d in daemonsets["items"]}
