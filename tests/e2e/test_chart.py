"""The Helm chart: lint and render every mode combination, refuse the invalid ones, apply every
rendered manifest to a real kube-apiserver (server-side apply, strict field validation), and run
the rendered my-scheduler KubeSchedulerConfiguration in a real kube-scheduler that schedules a
Neuron pod through our extender, both running with the chart's ServiceAccounts and RBAC.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from neuron_scheduler.core import capacity
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest, Unit
from neuron_scheduler.extender.loops.consolidating import ConsolidationMetrics
from neuron_scheduler.extender.loops.requesting import (
    CapacityLimits,
    CapacityMode,
    placeholder_body,
)
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.kube.kueue import CONTROLLER_NAME
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.sim.kubescheduler import CHART, DEFAULT_WITH_PRIORITIZE, scheduler_profile
from tests.builders import node as node_object
from tests.builders import node_json, pod_json
from tests.e2e.chart import (
    RULES,
    SEED_COMMANDS,
    UPSTREAM_NAMESPACES,
    UPSTREAM_VALUES,
    Doc,
    apply,
    chart_extender_process,
    device_plugin_credentials,
    extender_args,
    extender_credentials,
    find,
    helm,
    kinds,
    kube_version_of_testbed,
    localize,
    refusal,
    render,
    render_typed,
    scheduler_config,
    upstream_release_values,
)
from tests.e2e.harness import wait_for
from tests.testbed import (
    ControlPlane,
    ExtenderProcess,
    KubeError,
    find_kubebin,
    manifests,
)
from tests.testbed.pki import openssl

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PATIENCE = 60.0  # a safety net against hangs, never a performance bound

DEFAULT_MODE = {
    "scheduler": {"customScheduler": {"enabled": False}, "defaultScheduler": {"enabled": True}}
}
CERT_MANAGER = {"enabled": True, "issuerRef": {"name": "ca-issuer", "kind": "ClusterIssuer"}}
OWN_SECRETS = {"existingSecret": "mine", "existingClientSecret": "mine-client"}
COMBOS: dict[str, Doc] = {
    "custom": {},
    "custom-ha": {"scheduler": {"replicas": 3}},
    "custom-full-nodes-cert-manager": {
        "scheduler": {"nodeCacheCapable": False, "tls": {"certManager": CERT_MANAGER}}
    },
    "custom-own-secrets": {"scheduler": {"tls": OWN_SECRETS}},
    "custom-plain-http": {"scheduler": {"tls": {"enabled": False}}},
    "custom-no-preemption": {"scheduler": {"preemption": False}},
    # (the AdmissionCheck object itself needs Kueue's CRDs: test_kueue_admission_check_...)
    "custom-kueue-check": {"scheduler": {"kueue": {"admissionCheck": {"enabled": True}}}},
    "custom-autoscaling": {
        "scheduler": {
            "capacityRequests": {"mode": "on", "instanceTypes": ["inf2.48xlarge"]},
            "autoscaling": {"doNotDisrupt": True},
        }
    },
    "custom-monitored": {
        "scheduler": {
            "replicas": 2,
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "grafanaDashboard": {"enabled": True},
        }
    },
    "default": DEFAULT_MODE,
    "default-own-secrets-cidrs": {
        "scheduler": {
            **DEFAULT_MODE["scheduler"],
            "tls": OWN_SECRETS,
            "networkPolicy": {"controlPlaneCIDRs": ["10.0.0.0/24"]},
        }
    },
    "scheduler-only": {"devicePlugin": {"enabled": False}},
    "device-plugin-only": {"scheduler": {"enabled": False}},
}
REFUSED: dict[str, tuple[Doc, str]] = {
    "both-modes": (
        {"scheduler": {"defaultScheduler": {"enabled": True}}},
        "scheduler.customScheduler.enabled and scheduler.defaultScheduler.enabled are both true",
    ),
    "no-mode": (
        {"scheduler": {"customScheduler": {"enabled": False}}},
        "neither scheduler.customScheduler.enabled nor scheduler.defaultScheduler.enabled",
    ),
    "nothing": (
        {"scheduler": {"enabled": False}, "devicePlugin": {"enabled": False}},
        "the chart would install nothing",
    ),
    "bad-log-level": ({"logLevel": "loud"}, "/logLevel"),
    "misspelt-value": ({"scheduler": {"replica": 2}}, "'replica' not allowed"),
    "no-instance-types": ({"devicePlugin": {"instanceTypes": []}}, "/devicePlugin/instanceTypes"),
    "server-secret-alone": (
        {"scheduler": {"tls": {"existingSecret": "mine"}}},
        "scheduler.tls.existingSecret is set but scheduler.tls.existingClientSecret is not",
    ),
    "cert-manager-without-issuer": (
        {"scheduler": {"tls": {"certManager": {"enabled": True}}}},
        "scheduler.tls.certManager.enabled needs scheduler.tls.certManager.issuerRef.name",
    ),
    "tls-misspelt": ({"scheduler": {"tls": {"enable": False}}}, "'enable' not allowed"),
    # Accepting the upstream chart's keys leaves our own blocks closed to typos.
    "top-level-misspelt": ({"npdd": {"enabled": False}}, "'npdd' not allowed"),
    "custom-scheduler-misspelt": (
        {"scheduler": {"customScheduler": {"extraArg": ["--v=4"]}}},
        "'extraArg' not allowed",
    ),
    "device-plugin-misspelt": (
        {"devicePlugin": {"instanceType": ["inf2.48xlarge"]}},
        "'instanceType' not allowed",
    ),
    "service-monitor-misspelt": (
        {"scheduler": {"serviceMonitor": {"enable": True}}},
        "'enable' not allowed",
    ),
    "upstream-image-misspelt": (
        {"scheduler": {"image": {"repo": "example.com/neuron-scheduler"}}},
        "'repo' not allowed",
    ),
    "replica-count-not-a-number": (
        {"scheduler": {"replicaCount": "two"}},
        "/scheduler/replicaCount",
    ),
    "no-instances": ({"neuronInstances": []}, "/neuronInstances"),
    "npd-enabled-not-boolean": ({"npd": {"enabled": "no"}}, "/npd/enabled"),
    "rolling-update": (
        {"scheduler": {"strategy": {"type": "RollingUpdate"}}},
        "scheduler.strategy.type is RollingUpdate: the extender only upgrades with Recreate",
    ),
    "existing-account-unnamed": (
        {"devicePlugin": {"serviceAccount": {"create": False}}},
        "devicePlugin.serviceAccount.create is false but devicePlugin.serviceAccount.name is empty",
    ),
}
EXTENDER = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Deployment",
    "Service",
    "NetworkPolicy",
]
ELECTION = [
    "Role/k8s-neuron-scheduler-leader-election",
    "RoleBinding/k8s-neuron-scheduler-leader-election",
]
MY_SCHEDULER = [
    "ClusterRoleBinding/my-scheduler-as-kube-scheduler",
    "ClusterRoleBinding/my-scheduler-as-volume-scheduler",
    "ConfigMap/my-scheduler-config",
    "Deployment/my-scheduler",
    "Role/my-scheduler-leader-election",
    "RoleBinding/my-scheduler-extension-apiserver-authentication-reader",
    "RoleBinding/my-scheduler-leader-election",
    "ServiceAccount/my-scheduler",
]
DEVICE_PLUGIN = ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]
POLICY_KINDS = ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]


def expected_kinds(combo: str) -> list[str]:
    values = COMBOS[combo]
    scheduler = values.get("scheduler", {})
    names: list[str] = []
    if scheduler.get("enabled", True):
        names += [f"{k}/k8s-neuron-scheduler" for k in EXTENDER]
        names += [f"{k}/k8s-neuron-scheduler-pod-writes" for k in POLICY_KINDS]
        names += [f"{k}/k8s-neuron-scheduler-plans" for k in POLICY_KINDS]
        names += [f"{k}/k8s-neuron-scheduler-hand-off" for k in POLICY_KINDS]
        names.append("CustomResourceDefinition/ultraserverclaims.neuron-scheduler.io")
        tls = scheduler.get("tls", {})
        if tls.get("enabled", True) and not tls.get("existingSecret"):
            kind = "Certificate" if tls.get("certManager", {}).get("enabled") else "Secret"
            names += [f"{kind}/k8s-neuron-scheduler-tls", f"{kind}/k8s-neuron-scheduler-client-tls"]
        if scheduler.get("replicas", 1) > 1:
            names += ELECTION
            names.append("PodDisruptionBudget/k8s-neuron-scheduler")
        if scheduler.get("capacityRequests", {}).get("mode") == "on":
            names += [
                "PriorityClass/neuron-scheduler-capacity-request",
                "Role/k8s-neuron-scheduler-capacity-requests",
                "RoleBinding/k8s-neuron-scheduler-capacity-requests",
                "ValidatingAdmissionPolicy/k8s-neuron-scheduler-placeholders-only",
                "ValidatingAdmissionPolicyBinding/k8s-neuron-scheduler-placeholders-only",
            ]
        if scheduler.get("serviceMonitor", {}).get("enabled"):
            names.append("ServiceMonitor/k8s-neuron-scheduler")
        if scheduler.get("grafanaDashboard", {}).get("enabled"):
            names.append("ConfigMap/k8s-neuron-scheduler-dashboard")
        if scheduler.get("defaultScheduler", {}).get("enabled"):
            names.append("ConfigMap/k8s-neuron-scheduler-extender")
        else:
            names += MY_SCHEDULER
    if values.get("devicePlugin", {}).get("enabled", True):
        names += [f"{k}/neuron-device-plugin" for k in DEVICE_PLUGIN]
        names += [f"{k}/neuron-device-plugin-own-node-health" for k in POLICY_KINDS]
        names += [f"{k}/neuron-device-plugin-own-node-pods" for k in POLICY_KINDS]
    return sorted(names)


def extender_entry(docs: list[Doc], combo_values: Doc) -> Doc:
    if combo_values.get("scheduler", {}).get("defaultScheduler", {}).get("enabled"):
        snippet = find(docs, "ConfigMap", "k8s-neuron-scheduler-extender")["data"]["extenders.yaml"]
        (entry,) = yaml.safe_load(snippet)["extenders"]
    else:
        (entry,) = scheduler_config(docs)["extenders"]
    result: Doc = entry
    return result


# --- rendering, no API server ----------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_lint_and_render(combo: str) -> None:
    values = COMBOS[combo]
    lint = helm("lint", "--strict", values=values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values)
    assert kinds(docs) == expected_kinds(combo)
    for doc in docs:
        namespaced = doc["kind"] not in (
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "PriorityClass",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        )
        ns = doc["metadata"].get("namespace")
        # The one exception: reading kube-system's client-CA ConfigMap.
        if doc["metadata"]["name"].endswith("extension-apiserver-authentication-reader"):
            assert ns == "kube-system"
        else:
            assert ns == ("kube-system" if namespaced else None), doc["metadata"]


@pytest.mark.parametrize("combo", REFUSED)
def test_refused_combinations(combo: str) -> None:
    values, message = REFUSED[combo]
    assert message in refusal(values)
    lint = helm("lint", "--strict", values=values)
    assert message in lint.stdout + lint.stderr
    if message.startswith(("/", "'")):  # schema violations fail lint too
        assert lint.returncode != 0
    # else: helm lint runs templates in lint mode, where `fail` is reported, not fatal; install
    # and template (above) refuse.


TESTED = ">=1.32.0-0 <1.38.0-0"  # docs/install.md "Tested on"


@pytest.mark.parametrize("version", ["v1.29.9", "v1.31.14", "v1.38.0", "v1.40.1-eks-abc"])
def test_versions_not_tested_are_refused_with_the_reason(version: str) -> None:
    """The chart accepts the minor versions the compatibility runs passed and no other
    (docs/install.md "Tested on"): helm says so before anything is applied, rather than an
    install failing half way (admission policies v1 and node-named tokens below 1.32) or running
    on a version nothing here ran on."""
    result = helm("template", "neuron-scheduler", "--kube-version", version)
    assert result.returncode != 0
    assert f"requires kubeVersion: {TESTED}" in result.stderr, result.stderr


@pytest.mark.parametrize("version", ["v1.32.0", "v1.33.13", "v1.35.4-eks-4096722", "v1.37.2"])
def test_tested_versions_render(version: str) -> None:
    assert render(kube_version=version)


@pytest.mark.parametrize("version", ["v1.32.13", "v1.34.4-eks-3025e55"])
def test_dra_is_refused_by_name_below_1_35(version: str) -> None:
    """DRA, its core windows and device taints need 1.35's partitionable devices: refused with
    what to do, instead of a driver that publishes nothing usable (docs/dra.md)."""
    result = helm(
        "template", "neuron-scheduler", "--kube-version", version, values={"dra": {"enabled": True}}
    )
    assert result.returncode != 0
    shown = version.split("-")[0]  # helm's .Capabilities.KubeVersion.Version
    assert f"dra.enabled needs Kubernetes 1.35 or newer, and this cluster is {shown}" in (
        result.stderr
    ), result.stderr
    assert "DRAPartitionableDevices and DRADeviceTaints" in result.stderr
    # The device plugin path installs there.
    assert render(kube_version=version)
    dra = render({"dra": {"enabled": True}}, kube_version="v1.35.0")
    assert {"DeviceClass", "DaemonSet"} <= {d["kind"] for d in dra}


def test_extender_cluster_role_is_the_rules_file() -> None:
    """The e2e Stack runs the extender with files/extender-rules.yaml (and preemption's rules,
    on by default); the chart renders it, without preemption's when preemption is off."""
    preemption = yaml.safe_load(RULES.with_name("preemption-rules.yaml").read_text())
    rendered = find(render(), "ClusterRole", "k8s-neuron-scheduler")
    assert rendered["rules"] == yaml.safe_load(RULES.read_text()) + preemption
    off = find(render({"scheduler": {"preemption": False}}), "ClusterRole", "k8s-neuron-scheduler")
    assert off["rules"] == yaml.safe_load(RULES.read_text())
    verbs: dict[tuple[str, str], set[str]] = {}
    for rule in rendered["rules"]:
        for resource in rule["resources"]:
            verbs.setdefault((rule["apiGroups"][0], resource), set()).update(rule["verbs"])
    # delete and the status patch: preemption of training jobs, whole (preemption-rules.yaml)
    assert verbs[("", "pods")] == {"get", "list", "watch", "patch", "delete"}
    assert verbs[("", "pods/status")] == {"patch"}
    assert verbs[("", "pods/binding")] == {"create"}
    assert verbs[("", "nodes")] == {"get", "list", "watch"}
    assert ("", "nodes/status") not in verbs
    assert ("", "pods/eviction") not in verbs  # consolidation's default, dry-run, evicts nothing
    assert all("*" not in v for v in verbs.values())


def test_consolidation_on_adds_eviction_status_and_its_lease() -> None:
    """Mode on: the ClusterRole is both rules files (what the e2e Stack runs with), and a Role
    on the one Lease that keeps the eviction budget; the extender is told its name."""
    docs = render({"scheduler": {"consolidation": {"mode": "on", "evictionsPerHour": 7}}})
    rendered = find(docs, "ClusterRole", "k8s-neuron-scheduler")
    both = [
        *yaml.safe_load(RULES.read_text()),
        *yaml.safe_load(RULES.with_name("preemption-rules.yaml").read_text()),
        *yaml.safe_load(RULES.with_name("consolidation-rules.yaml").read_text()),
    ]
    assert rendered["rules"] == both
    role = find(docs, "Role", "k8s-neuron-scheduler-consolidation")
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["k8s-neuron-scheduler-consolidation"],
            "verbs": ["get", "update"],
        }
    ]
    args = extender_args(docs)
    assert "--consolidation=on" in args
    assert "--consolidation-evictions-per-hour=7" in args
    assert "--consolidation-lease=k8s-neuron-scheduler-consolidation" in args


def test_kueue_admission_check_adds_its_rules_its_arguments_and_the_check() -> None:
    """On: the ClusterRole gains files/kueue-rules.yaml (which the e2e Stack runs with), the
    extender answers the check for its hold time, and with `create` the chart makes the
    AdmissionCheck of the extender's controllerName (docs/kueue.md). Off (the default): none."""
    check = {"enabled": True, "create": True, "name": "placement", "holdSeconds": 90}
    docs = render({"scheduler": {"kueue": {"admissionCheck": check}}})
    rendered = find(docs, "ClusterRole", "k8s-neuron-scheduler")
    assert rendered["rules"] == [
        *yaml.safe_load(RULES.read_text()),
        *yaml.safe_load(RULES.with_name("preemption-rules.yaml").read_text()),
        *yaml.safe_load(RULES.with_name("kueue-rules.yaml").read_text()),
    ]
    args = extender_args(docs)
    assert "--kueue-admission-check" in args and "--kueue-hold-seconds=90" in args
    made = find(docs, "AdmissionCheck", "placement")
    assert made["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert made["spec"] == {"controllerName": CONTROLLER_NAME}
    uncreated = render({"scheduler": {"kueue": {"admissionCheck": {"enabled": True}}}})
    assert not [k for k in kinds(uncreated) if k.startswith("AdmissionCheck/")]
    default = render()
    assert not [k for k in kinds(default) if k.startswith("AdmissionCheck/")]
    assert not [a for a in extender_args(default) if a.startswith("--kueue")]
    role = find(default, "ClusterRole", "k8s-neuron-scheduler")
    assert all("kueue.x-k8s.io" not in r["apiGroups"] for r in role["rules"])


def test_capacity_requests_on_add_the_placeholders_role_and_their_priority_class() -> None:
    """Mode on: the ClusterRole is the rules file plus capacity-rules.yaml (what the e2e Stack
    runs with), a Role in the extender's namespace for the placeholders, and the PriorityClass
    of value -10; the extender is told all of it. Off (the default): none of it."""
    docs = render(COMBOS["custom-autoscaling"])
    rendered = find(docs, "ClusterRole", "k8s-neuron-scheduler")
    assert rendered["rules"] == [
        *yaml.safe_load(RULES.read_text()),
        *yaml.safe_load(RULES.with_name("preemption-rules.yaml").read_text()),
        *yaml.safe_load(RULES.with_name("capacity-rules.yaml").read_text()),
    ]
    role = find(docs, "Role", "k8s-neuron-scheduler-capacity-requests")
    assert role["metadata"]["namespace"] == "kube-system"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    ]
    priority = find(docs, "PriorityClass", "neuron-scheduler-capacity-request")
    assert (priority["value"], priority["preemptionPolicy"]) == (-10, "Never")
    args = extender_args(docs)
    for arg in (
        "--capacity-requests=on",
        "--capacity-instance-type=inf2.48xlarge",
        "--capacity-priority-class=neuron-scheduler-capacity-request",
        "--capacity-owner=k8s-neuron-scheduler",
        "--autoscaler-do-not-disrupt",
    ):
        assert arg in args, args
    off = render()
    assert "--capacity-requests=off" in extender_args(off)
    assert "--autoscaler-do-not-disrupt" not in extender_args(off)
    assert not [k for k in kinds(off) if "capacity" in k or k.startswith("PriorityClass")]


@pytest.mark.parametrize(
    "combo", ["custom", "custom-full-nodes-cert-manager", "custom-plain-http", "default"]
)
def test_extender_entry_matches_the_testbed(combo: str) -> None:
    """The chart's extender entry is the one the e2e kube-scheduler runs with, apart from the URL
    and the client-certificate paths."""
    values = COMBOS[combo]
    scheduler = values.get("scheduler", {})
    docs = render(values)
    entry = extender_entry(docs, values)
    tls = scheduler.get("tls", {}).get("enabled", True)
    scheme = "https" if tls else "http"
    default_mode = scheduler.get("defaultScheduler", {}).get("enabled")
    if default_mode:
        url = f"{scheme}://127.0.0.1:32700"
    else:
        url = f"{scheme}://k8s-neuron-scheduler.kube-system.svc.cluster.local:12345"
    expected = manifests.scheduler_config(
        extender_url=url,
        node_cache_capable=scheduler.get("nodeCacheCapable", True),
        preemption=scheduler.get("preemption", True),
    )["extenders"][0]
    if tls:
        assert entry.pop("enableHTTPS") is True
        tls_config = entry.pop("tlsConfig")
        assert tls_config.pop("serverName") == "k8s-neuron-scheduler.kube-system.svc"
        directory = (
            "/etc/kubernetes/neuron-scheduler" if default_mode else "/etc/neuron-scheduler/client"
        )
        names = (
            ("client.crt", "client.key", "ca.crt")
            if default_mode
            else ("tls.crt", "tls.key", "ca.crt")
        )
        assert tls_config == {
            key: f"{directory}/{name}"
            for key, name in zip(("certFile", "keyFile", "caFile"), names, strict=True)
        }
    assert entry == expected


@pytest.mark.parametrize("mode", ["custom", "default"])
def test_the_dra_driver_adds_a_scoring_entry_and_its_read_rules(mode: str) -> None:
    """With dra.enabled: prioritize-only entries for pods with the chart's DRA claims (the ones
    the e2e kube-scheduler runs with `dra_prioritize`: the best-fit measure, and the packing
    tie-break where the profile packs), the extender told the driver and class names, and the
    DRA scoring rules added to its ClusterRole."""
    values: Doc = {"dra": {"enabled": True}}
    if mode == "default":
        values = {**values, **DEFAULT_MODE}
    docs = render(values)
    if mode == "default":
        snippet = find(docs, "ConfigMap", "k8s-neuron-scheduler-extender")["data"]["extenders.yaml"]
        entries = yaml.safe_load(snippet)["extenders"]
    else:
        entries = scheduler_config(docs)["extenders"]
    first, *dra_entries = entries
    expected = manifests.scheduler_config(
        extender_url=first["urlPrefix"], node_cache_capable=True, dra_prioritize=True
    )["extenders"][1:]
    for entry in dra_entries:
        assert entry.pop("tlsConfig") == first["tlsConfig"]
        assert entry.pop("enableHTTPS") is True
    assert dra_entries == expected
    assert [e["prioritizeVerb"] for e in dra_entries] == [
        "prioritize-claims",
        "prioritize-claims-packing",
    ]
    spreading = render({"dra": {"enabled": True}, "scheduler": {"scoring": {"packNeuron": False}}})
    assert [e["prioritizeVerb"] for e in scheduler_config(spreading)["extenders"][1:]] == [
        "prioritize-claims"
    ]
    args = extender_args(docs)
    assert "--dra-driver=neuron.neuron-scheduler.io" in args
    assert "--dra-core-class-prefix=neuroncore" in args
    rendered = find(docs, "ClusterRole", "k8s-neuron-scheduler")
    assert rendered["rules"] == [
        *yaml.safe_load(RULES.read_text()),
        *yaml.safe_load(RULES.with_name("preemption-rules.yaml").read_text()),
        *yaml.safe_load(RULES.with_name("dra-scoring-rules.yaml").read_text()),
    ]
    without = render({"dra": {"enabled": False}})
    assert len(scheduler_config(without)["extenders"]) == 1
    assert not [a for a in extender_args(without) if a.startswith("--dra")]


def test_my_scheduler_configuration() -> None:
    docs = render()
    config = scheduler_config(docs)
    # The profile the simulator models and the e2e suite runs (sim/kubescheduler.py CHART).
    assert config["profiles"] == [scheduler_profile(CHART, "my-scheduler")]
    assert config["extenders"][0]["weight"] == CHART.extender_weight == 20
    spreading = scheduler_config(render({"scheduler": {"scoring": {"packNeuron": False}}}))
    assert spreading["profiles"] == [scheduler_profile(DEFAULT_WITH_PRIORITIZE, "my-scheduler")]
    assert config["leaderElection"] == {
        "leaderElect": True,
        "resourceNamespace": "kube-system",
        "resourceName": "my-scheduler",
    }
    deployment = find(docs, "Deployment", "my-scheduler")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The upstream image at the cluster's own version.
    assert container["image"] == f"registry.k8s.io/kube-scheduler:{kube_version_of_testbed()}"
    assert "--config=/etc/kubernetes/my-scheduler/my-scheduler-config.yaml" in container["command"]
    eks = render(kube_version="v1.33.5-eks-a737599")
    (eks_container,) = find(eks, "Deployment", "my-scheduler")["spec"]["template"]["spec"][
        "containers"
    ]
    assert eks_container["image"] == "registry.k8s.io/kube-scheduler:v1.33.5"


def test_extender_pod_hardening_and_probes() -> None:
    docs = render({"scheduler": {"replicas": 2}, "logLevel": "debug"})
    spec = find(docs, "Deployment", "k8s-neuron-scheduler")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    # Probes need no client certificate: the metrics port, plain HTTP.
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"extender": 12345, "metrics": 12346}
    assert set(container["resources"]) == {"requests", "limits"}
    args = container["args"]
    assert "--leader-elect" in args and "--lease-name=k8s-neuron-scheduler" in args
    assert "--log-level=debug" in args
    assert "--tls-cert=/etc/neuron-scheduler/tls/tls.crt" in args
    assert "--client-ca=/etc/neuron-scheduler/tls/ca.crt" in args
    assert "--scheduler-name=my-scheduler" in args and "--insecure" not in args
    plain = render({"scheduler": {"tls": {"enabled": False}}})
    (open_container,) = find(plain, "Deployment", "k8s-neuron-scheduler")["spec"]["template"][
        "spec"
    ]["containers"]
    assert "--insecure" in open_container["args"]
    default = render(DEFAULT_MODE)
    (default_container,) = find(default, "Deployment", "k8s-neuron-scheduler")["spec"]["template"][
        "spec"
    ]["containers"]
    assert "--scheduler-name=default-scheduler" in default_container["args"]
    service = find(docs, "Service", "k8s-neuron-scheduler")
    assert [p["port"] for p in service["spec"]["ports"]] == [12345, 12346]
    assert "type" not in service["spec"]  # ClusterIP in custom mode
    single = render()
    (one,) = find(single, "Deployment", "k8s-neuron-scheduler")["spec"]["template"]["spec"][
        "containers"
    ]
    assert not any(a.startswith("--leader-elect") for a in one["args"])
    # Never two binding extenders side by side, and no rollout waiting on a standby's readiness.
    for docs_of_mode in (docs, single):
        deployment = find(docs_of_mode, "Deployment", "k8s-neuron-scheduler")
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_device_plugin_daemonset() -> None:
    docs = render({"devicePlugin": {"coresPerDevice": 2}})
    spec = find(docs, "DaemonSet", "neuron-device-plugin")["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    instance = next(
        e for e in term["matchExpressions"] if e["key"] == "node.kubernetes.io/instance-type"
    )
    assert instance["operator"] == "In"
    assert {"inf1.6xlarge", "inf2.48xlarge", "trn1.32xlarge", "trn2.48xlarge"} <= set(
        instance["values"]
    )
    assert not any(v.startswith(("m5", "c5")) for v in instance["values"])
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    (container,) = spec["containers"]
    assert container["args"][0] == "device-plugin"
    assert "--cores-per-device=2" in container["args"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/host/dev"]["readOnly"] and mounts["/host/sys"]["readOnly"]
    assert not mounts["/var/lib/kubelet/device-plugins"].get("readOnly")
    paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert paths["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert container["securityContext"]["privileged"] is False


# --- the real API server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubebin() -> Path:
    return find_kubebin(ROOT)


@pytest.fixture(scope="class")
def apply_cp(kubebin: Path) -> Iterator[ControlPlane]:
    """A control plane of its own: each combination is applied in its own namespace, and the
    cluster-scoped objects (same names in every combination) are applied over each other."""
    with ControlPlane(kubebin) as cp:
        # cert-manager's Certificate and the Prometheus Operator's ServiceMonitor, so the chart's
        # objects of those kinds are checked field by field.
        crds = [
            yaml.safe_load((ROOT / "tests" / "e2e" / "crds" / name).read_text())
            for name in ("cert-manager-certificate.yaml", "prometheus-operator-servicemonitor.yaml")
        ]
        apply(cp, crds)
        for crd in crds:
            cp.kubectl(
                "wait",
                "--for=condition=Established",
                f"crd/{crd['metadata']['name']}",
                "--timeout=60s",
            )
        yield cp


def capacity_requests_on(cp: ControlPlane, namespace: str) -> str:
    """The chart with capacity requests on, applied in `namespace`; kubectl's option acting as
    the extender's account. Preemption off: it deletes pods cluster-wide itself
    (preemption-rules.yaml); this is what capacity requests add."""
    cp.client.ensure_namespace(namespace)
    values = copy.deepcopy(COMBOS["custom-autoscaling"])
    values["scheduler"]["preemption"] = False
    apply(cp, render(values, namespace=namespace))
    return f"--as=system:serviceaccount:{namespace}:k8s-neuron-scheduler"


class TestApply:
    @pytest.mark.parametrize("combo", COMBOS)
    @pytest.mark.compat
    def test_every_manifest_applies_strictly(self, apply_cp: ControlPlane, combo: str) -> None:
        namespace = f"chart-{combo}"
        apply_cp.client.ensure_namespace(namespace)
        docs = render(COMBOS[combo], namespace=namespace)
        out = apply(apply_cp, docs)
        assert out.count("serverside-applied") == len(docs), out
        for doc in docs:
            path = api_path(doc)
            stored = apply_cp.request("GET", path)
            assert stored["metadata"]["labels"]["app.kubernetes.io/part-of"] == "neuron-scheduler"
        if COMBOS[combo].get("scheduler", {}).get("defaultScheduler", {}).get("enabled"):
            service = apply_cp.request(
                "GET", f"/api/v1/namespaces/{namespace}/services/k8s-neuron-scheduler"
            )
            assert service["spec"]["type"] == "NodePort"
            assert service["spec"]["ports"][0]["nodePort"] == 32700
            apply_cp.request(
                "DELETE", f"/api/v1/namespaces/{namespace}/services/k8s-neuron-scheduler"
            )

    @pytest.mark.parametrize("seed", SEED_COMMANDS)
    def test_seed_commands_apply_strictly(self, apply_cp: ControlPlane, seed: str) -> None:
        """The seeds' AWS install commands, exactly as typed with our chart in place of AWS's:
        what they install applies strictly, in the namespace they install into (the current
        one, `default`)."""
        docs = render_typed(SEED_COMMANDS[seed])
        assert {d["metadata"].get("namespace") for d in docs} <= {"default", "kube-system", None}
        assert "Deployment/k8s-neuron-scheduler" in kinds(docs)
        assert "DaemonSet/neuron-device-plugin" in kinds(docs)
        default_mode = "defaultScheduler.enabled=true" in SEED_COMMANDS[seed]
        assert ("Deployment/my-scheduler" in kinds(docs)) is not default_mode
        out = apply(apply_cp, docs)
        assert out.count("serverside-applied") == len(docs), out
        for doc in docs:
            assert apply_cp.request("GET", api_path(doc))["metadata"]["uid"]
        if default_mode:  # frees node port 32700 for the other default-mode combinations
            apply_cp.request("DELETE", "/api/v1/namespaces/default/services/k8s-neuron-scheduler")

    def test_upstream_values_apply_strictly(self, apply_cp: ControlPlane) -> None:
        """A values file naming every upstream key, components in three namespaces of their own."""
        for namespace in UPSTREAM_NAMESPACES.values():
            apply_cp.client.ensure_namespace(namespace)
        docs = render(UPSTREAM_VALUES, namespace="chart-upstream")
        assert {d["metadata"].get("namespace") for d in docs} - {None} == {
            *UPSTREAM_NAMESPACES.values(),
            "kube-system",  # my-scheduler's authentication-reader RoleBinding
        }
        out = apply(apply_cp, docs)
        assert out.count("serverside-applied") == len(docs), out
        # The upstream chart's own values file, as a user copied it: its namespaceOverride puts
        # everything in kube-system.
        docs = render(upstream_release_values(), namespace="chart-upstream")
        assert {d["metadata"].get("namespace") for d in docs} - {None} == {"kube-system"}
        out = apply(apply_cp, docs)
        assert out.count("serverside-applied") == len(docs), out

    def test_strict_validation_rejects_an_unknown_field(self, apply_cp: ControlPlane) -> None:
        """The check above can fail: a field the API does not know is refused, not dropped."""
        apply_cp.client.ensure_namespace("chart-strict")
        docs = render(namespace="chart-strict")
        deployment = copy.deepcopy(find(docs, "Deployment", "k8s-neuron-scheduler"))
        deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesystem"] = True
        result = apply_cp.kubectl(
            "apply",
            "--server-side",
            "--validate=strict",
            "-f",
            "-",
            input=yaml.safe_dump(deployment),
            check=False,
        )
        assert result.returncode != 0
        assert (
            'containers[name="extender"].readOnlyRootFilesystem: field not declared in schema'
            in result.stderr
        )

    def test_capacity_requests_create_and_delete_pods_in_the_extenders_namespace_only(
        self, apply_cp: ControlPlane
    ) -> None:
        namespace = "chart-rbac-capacity"
        account = capacity_requests_on(apply_cp, namespace)

        def can(verb: str, resource: str, ns: str, subresource: str = "") -> bool:
            args = ["auth", "can-i", verb, resource, account, f"--namespace={ns}"]
            if subresource:
                args.append(f"--subresource={subresource}")
            result = apply_cp.kubectl(*args, check=False)
            assert result.stdout.strip() in ("yes", "no"), result.stderr
            return result.stdout.strip() == "yes"

        assert can("create", "pods", namespace) and can("delete", "pods", namespace)
        assert not can("create", "pods", "t") and not can("delete", "pods", "t")
        assert can("patch", "pods", "t", "status")  # nominating the pending pod, anywhere
        assert not can("update", "pods", namespace) and not can("create", "pods/eviction", "t")

    @pytest.mark.compat
    def test_the_extender_may_create_placeholders_and_no_other_pod(
        self, apply_cp: ControlPlane
    ) -> None:
        """RBAC cannot say which pods: the chart's admission policy admits the extender's pods
        only in the placeholders' shape, and the placeholder the code builds is one."""
        namespace = "chart-placeholders-only"
        account = capacity_requests_on(apply_cp, namespace)
        topology = Catalog.builtin().resolve("inf2.48xlarge").topology
        waiting = msgspec.convert(pod_json("big", {NEURON: 4}, uid="u-big"), Pod)
        asked = capacity.Asked(
            "default/big", "u-big", "inf2.48xlarge", NeuronRequest(NEURON, 4), 1.0, 2.0
        )
        limits = CapacityLimits(CapacityMode.ON, namespace=namespace)

        def create(body: Doc) -> str:
            result = apply_cp.kubectl(
                "create", "-o", "name", "-f", "-", account, input=json.dumps(body), check=False
            )
            if result.returncode == 0:
                apply_cp.kubectl("delete", "-n", namespace, result.stdout.strip(), "--wait=false")
                return ""
            return result.stderr

        def placeholder(**spec: Any) -> Doc:
            body = placeholder_body(waiting, asked, topology, limits)
            body["spec"].update(spec)
            return body

        # The policy is enforced from its binding's first reconcile on: wait for a refusal.
        deadline = time.monotonic() + 30
        while not create(placeholder(nodeName="r1")):
            assert time.monotonic() < deadline, "the policy refuses nothing"
            time.sleep(0.5)
        assert create(placeholder()) == ""
        container = placeholder()["spec"]["containers"][0]
        for spec in (
            {"serviceAccountName": "clusterrole-aggregation-controller"},
            {"automountServiceAccountToken": True},
            {"schedulerName": "my-scheduler"},
            {"priorityClassName": "system-node-critical"},
            {"hostNetwork": True},
            {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
            {"containers": [{**container, "image": "busybox"}]},
            {"containers": [{**container, "command": ["sh"]}]},
            {"containers": [{**container, "securityContext": {"privileged": True}}]},
            {"initContainers": [{**container, "name": "init"}]},
        ):
            refused = create(placeholder(**spec))
            assert "ValidatingAdmissionPolicy" in refused and "placeholders-only" in refused, (
                spec,
                refused,
            )

    def test_rbac_grants_what_the_code_calls_and_no_more(self, apply_cp: ControlPlane) -> None:
        namespace = "chart-rbac"
        apply_cp.client.ensure_namespace(namespace)
        apply(apply_cp, render({"scheduler": {"replicas": 2}}, namespace=namespace))

        def can(sa: str, verb: str, resource: str, ns: str = "t", name: str = "") -> bool:
            resource, _, subresource = resource.partition("/")
            target = f"{resource}/{name}" if name else resource
            args = ["auth", "can-i", verb, target, f"--as=system:serviceaccount:{namespace}:{sa}"]
            args.append(f"--namespace={ns}")
            if subresource:
                args.append(f"--subresource={subresource}")
            result = apply_cp.kubectl(*args, check=False)
            assert result.stdout.strip() in ("yes", "no"), result.stderr
            return result.stdout.strip() == "yes"

        extender = "k8s-neuron-scheduler"
        for verb in ("get", "list", "watch", "patch"):
            assert can(extender, verb, "pods")
        assert can(extender, "create", "pods/binding")
        assert can(extender, "list", "nodes") and can(extender, "create", "events")
        assert can(extender, "update", "leases", namespace, "k8s-neuron-scheduler")
        assert not can(extender, "update", "leases", namespace, "someone-else")
        assert not can(extender, "update", "leases", "t", "k8s-neuron-scheduler")
        assert not can(extender, "update", "pods")
        # Preemption on (the default): training jobs' victims, evicted whole by the extender.
        assert can(extender, "delete", "pods") and can(extender, "patch", "pods/status")
        assert not can(extender, "create", "pods/eviction")  # (consolidation's, mode on only)
        assert not can(extender, "update", "nodes/status") and not can(extender, "patch", "nodes")
        assert not can(extender, "get", "secrets") and not can(extender, "get", "configmaps")

        plugin = "neuron-device-plugin"
        for verb in ("get", "list", "patch"):
            assert can(plugin, verb, "pods")
        # patch: its own Node's health annotation, which the admission policy narrows to that
        # (tests/e2e/test_device_failure.py runs the policy).
        assert can(plugin, "get", "nodes") and can(plugin, "patch", "nodes")
        assert not can(plugin, "update", "nodes") and not can(plugin, "delete", "nodes")
        assert not can(plugin, "update", "nodes/status") and not can(plugin, "list", "nodes")
        assert not can(plugin, "create", "pods/binding") and not can(plugin, "get", "secrets")

        scheduler = "my-scheduler"
        assert can(scheduler, "create", "pods/binding") and can(scheduler, "watch", "nodes")
        assert can(scheduler, "update", "leases", namespace, "my-scheduler")
        assert not can(scheduler, "update", "leases", namespace, "k8s-neuron-scheduler")


def api_path(doc: Doc) -> str:
    group_version = doc["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    plural = {
        "ServiceAccount": "serviceaccounts",
        "ClusterRole": "clusterroles",
        "ClusterRoleBinding": "clusterrolebindings",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ConfigMap": "configmaps",
        "Deployment": "deployments",
        "DaemonSet": "daemonsets",
        "Service": "services",
        "Secret": "secrets",
        "NetworkPolicy": "networkpolicies",
        "Certificate": "certificates",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "ServiceMonitor": "servicemonitors",
        "CustomResourceDefinition": "customresourcedefinitions",
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
        "PriorityClass": "priorityclasses",
    }[doc["kind"]]
    ns = doc["metadata"].get("namespace")
    scope = f"/namespaces/{ns}" if ns else ""
    return f"{base}{scope}/{plural}/{doc['metadata']['name']}"


# --- the rendered scheduler configuration in a real kube-scheduler -----------------------------


@pytest.fixture(scope="module")
def chart_cp(kubebin: Path) -> Iterator[ControlPlane]:
    with ControlPlane(kubebin) as cp:
        yield cp


@pytest.fixture(scope="module")
def installed(chart_cp: ControlPlane) -> list[Doc]:
    """The chart with its defaults (custom scheduler mode) in kube-system, as on EKS."""
    docs = render()
    apply(chart_cp, docs)
    return docs


def start_chart_extender(
    cp: ControlPlane, docs: list[Doc], directory: Path, name: str
) -> ExtenderProcess:
    """The extender as the chart runs it, authenticated as the rendered ServiceAccount with the
    rendered RBAC applied (a test may start it before, or without, installing the chart), so
    what that rendering grants is all it may do."""
    credentials = extender_credentials(cp, docs)
    extender = chart_extender_process(cp, docs, directory, name, credentials.kubeconfig_path)
    extender.start()
    return extender


@pytest.fixture(scope="module")
def chart_extender(
    chart_cp: ControlPlane, installed: list[Doc], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExtenderProcess]:
    extender = start_chart_extender(
        chart_cp, installed, tmp_path_factory.mktemp("chart-certificates"), "chart-extender"
    )
    yield extender
    extender.process.stop()


def create_pod(
    cp: ControlPlane, namespace: str, name: str, scheduler: str | None, limits: dict[str, str]
) -> None:
    spec: Doc = {
        "containers": [
            {"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}}
        ]
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    cp.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec},
    )


def wait_bound(cp: ControlPlane, namespace: str, name: str, logs: list[Path]) -> Doc:
    deadline = time.monotonic() + PATIENCE
    while True:
        pod: Doc = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if pod["spec"].get("nodeName"):
            return pod
        if time.monotonic() > deadline:
            events = cp.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
            tails = {p.name: p.read_text(errors="replace").splitlines()[-30:] for p in logs}
            raise AssertionError(
                f"pod {name} not bound; events: {[e.get('message') for e in events]}\n"
                + json.dumps(tails, indent=1)
            )
        time.sleep(0.1)


def neuron_ids(pod: Doc) -> list[int]:
    return [int(x) for x in pod["metadata"]["annotations"]["AWS_NEURON_IDS"].split(",")]


def add_node(cp: ControlPlane, instance_type: str = "inf1.6xlarge") -> str:
    name = f"{instance_type.replace('.', '-')}-{uuid.uuid4().hex[:6]}"
    cp.request("POST", "/api/v1/nodes", node_json(name, instance_type))
    return name


@pytest.mark.compat
def test_rendered_my_scheduler_schedules_through_the_extender(
    chart_cp: ControlPlane, installed: list[Doc], chart_extender: ExtenderProcess, tmp_path: Path
) -> None:
    config = localize(scheduler_config(installed), installed, tmp_path)
    (entry,) = config["extenders"]
    assert entry["urlPrefix"] == "https://k8s-neuron-scheduler.kube-system.svc.cluster.local:12345"
    entry["urlPrefix"] = chart_extender.url  # the Service, as seen from this machine
    # my-scheduler presents the chart's client certificate; the extender accepts nothing else.
    assert entry["tlsConfig"]["certFile"].startswith(str(tmp_path))
    # my-scheduler also runs as its rendered ServiceAccount: the chart's bindings to the
    # built-in scheduler roles, its Lease Role and the authentication-reader RoleBinding.
    credentials = chart_cp.service_account("kube-system", "my-scheduler")
    scheduler = chart_cp.start_scheduler(config=config, kubeconfig=credentials.kubeconfig_path)
    node = add_node(chart_cp)
    chart_cp.client.ensure_namespace("workloads")
    create_pod(
        chart_cp, "workloads", "nine-cores", "my-scheduler", {"aws.amazon.com/neuroncore": "9"}
    )
    logs = [scheduler.log_path, chart_extender.process.log_path]
    pod = wait_bound(chart_cp, "workloads", "nine-cores", logs)
    assert pod["spec"]["nodeName"] == node
    assert neuron_ids(pod) == list(range(9))
    assert pod["metadata"]["annotations"]["NEURON_ALLOCATED"] == "false"
    extender_log = chart_extender.process.log_path.read_text()
    assert "Allocated ids for POD workloads/nine-cores are: 0,1,2,3,4,5,6,7,8" in extender_log
    # Leader election on, under the rendered Role: my-scheduler holds its Lease.
    lease = chart_cp.request(
        "GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/my-scheduler"
    )
    assert lease["spec"]["holderIdentity"]
    # A pod the extender refuses stays pending with the extender's reason.
    create_pod(chart_cp, "workloads", "too-many", "my-scheduler", {"aws.amazon.com/neuron": "3"})
    deadline = time.monotonic() + PATIENCE
    while True:
        events = chart_cp.request("GET", "/api/v1/namespaces/workloads/events")["items"]
        messages = [
            e.get("message", "")
            for e in events
            if e["involvedObject"].get("name") == "too-many" and e["reason"] == "FailedScheduling"
        ]
        if any("1 needs 3 devices; only 1 device free" in m for m in messages):
            break
        assert time.monotonic() < deadline, f"no FailedScheduling from the extender: {messages}"
        time.sleep(0.1)
    scheduler.stop()


@pytest.mark.compat
def test_default_scheduler_snippet_extends_a_plain_kube_scheduler(
    chart_cp: ControlPlane, tmp_path: Path
) -> None:
    """The rendered `extenders:` entry, added to a default-scheduler profile as a self-managed
    control plane would (with the client certificate files the notes copy to the host),
    schedules a pod that names no scheduler, through an extender rendered for that mode."""
    docs = render(DEFAULT_MODE)
    extender = start_chart_extender(chart_cp, docs, tmp_path, "chart-extender-default")
    snippet = localize(
        yaml.safe_load(
            find(docs, "ConfigMap", "k8s-neuron-scheduler-extender")["data"]["extenders.yaml"]
        ),
        docs,
        tmp_path,
    )
    (entry,) = snippet["extenders"]
    assert entry["urlPrefix"] == "https://127.0.0.1:32700"
    entry["urlPrefix"] = extender.url
    config: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": "default-scheduler"}],
        **snippet,
    }
    scheduler = chart_cp.start_scheduler(config=config)
    try:
        node = add_node(chart_cp)
        chart_cp.client.ensure_namespace("plain")
        # A node another test of this module added has pods on some of its devices (whichever
        # ran first): only the new node fits four.
        create_pod(chart_cp, "plain", "four-devices", None, {"aws.amazon.com/neuron": "4"})
        pod = wait_bound(
            chart_cp, "plain", "four-devices", [scheduler.log_path, extender.process.log_path]
        )
        assert pod["spec"]["schedulerName"] == "default-scheduler"
        assert neuron_ids(pod) == [0, 1, 2, 3]
        assert pod["spec"]["nodeName"] == node
    finally:
        scheduler.stop()
        extender.process.stop()


HAND_OFF_POLICY = "k8s-neuron-scheduler-hand-off"
CHART_FILES = ROOT / "charts" / "neuron-scheduler" / "files"


def hand_off_writers(values: Doc) -> str:
    """The match condition of the rendered policy on who writes the hand-off annotations."""
    policy = find(render(values), "ValidatingAdmissionPolicy", HAND_OFF_POLICY)
    (condition,) = policy["spec"]["matchConditions"]
    expression: str = condition["expression"]
    return expression


def test_hand_off_policy_exempts_the_accounts_the_chart_runs() -> None:
    """`<extender>-hand-off` lets the extender's account and the release's device plugin's write
    the ids, by the names and namespaces the values give them, and the accounts and groups of
    scheduler.handOffWriters (cluster admins by default). Not the plugin's account when the
    release does not run it: that name is often AWS's plugin's, which is not held to its node.
    Its rules are the file the testbed runs every end-to-end test under."""
    extender = "system:serviceaccount:kube-system:k8s-neuron-scheduler"
    plugin = "system:serviceaccount:kube-system:neuron-device-plugin"
    default = hand_off_writers({})
    assert json.dumps([extender, plugin], separators=(",", ":")) in default, default
    assert '.exists(g, g in ["system:masters"])' in default, default
    alone = hand_off_writers({"devicePlugin": {"enabled": False}})
    assert json.dumps([extender]) in alone and plugin not in alone, alone
    renamed = hand_off_writers(
        {
            "scheduler": {
                "serviceAccount": {"name": "sched"},
                "handOffWriters": {"users": ["system:serviceaccount:ops:fixer"], "groups": []},
            },
            "devicePlugin": {"serviceAccount": {"name": "plug"}, "namespaceOverride": "neuron"},
        }
    )
    writers = [
        "system:serviceaccount:kube-system:sched",
        "system:serviceaccount:neuron:plug",
        "system:serviceaccount:ops:fixer",
    ]
    assert json.dumps(writers, separators=(",", ":")) in renamed, renamed
    assert ".exists(g, g in [])" in renamed, renamed
    policy = find(render(), "ValidatingAdmissionPolicy", HAND_OFF_POLICY)["spec"]
    rules = yaml.safe_load((CHART_FILES / "hand-off-writes.yaml").read_text())
    assert {k: policy[k] for k in rules} == rules
    assert policy["failurePolicy"] == "Ignore"  # it sees every pod write in the cluster


@pytest.mark.compat
def test_rendered_hand_off_policy_refuses_a_tenants_ids(
    chart_cp: ControlPlane, installed: list[Doc]
) -> None:
    """The rendered policy on a real API server: a tenant who may create pods is refused one
    carrying ids; a cluster admin is not, nor are the rendered extender's and device plugin's
    accounts writing ids on a pod (the plugin's on its own node's, as its own policy wants)."""
    namespace = f"tenant-{uuid.uuid4().hex[:6]}"
    tenant = chart_cp.pod_user(namespace, "tenant", ["create"])
    pods = f"/api/v1/namespaces/{namespace}/pods"
    body = pod_json("held", {}, namespace=namespace, annotations={"NEURON_DEVS": "0"})

    def refused() -> KubeError | None:
        try:
            tenant.create(pods + "?dryRun=All", body)
        except KubeError as error:
            return error
        return None

    error = wait_for(refused, "the rendered policy to refuse a tenant's ids", PATIENCE)
    assert error.status == 403 and "not NEURON_DEVS" in str(error), error
    chart_cp.request("POST", pods + "?dryRun=All", body)  # an admin's
    # A node of its own, gone afterwards: the other tests of this module place pods on the
    # nodes they find free.
    node = add_node(chart_cp)
    try:
        chart_cp.request("POST", pods, pod_json("bound", {}, namespace=namespace, node=node))
        ids = {"metadata": {"annotations": {"AWS_NEURON_IDS": "1", "NEURON_DEVS": "1"}}}
        plugin = device_plugin_credentials(chart_cp, node=node)
        for account in (extender_credentials(chart_cp, installed), plugin):
            chart_cp.client_for(account.token).request(
                "PATCH",
                f"{pods}/bound?dryRun=All",
                ids,
                content_type="application/merge-patch+json",
            )
        # (The plugin's own policy is in force: NEURON_NODE is not one of the keys it writes.)
        with pytest.raises(KubeError) as caught:
            chart_cp.client_for(plugin.token).request(
                "PATCH",
                f"{pods}/bound?dryRun=All",
                {"metadata": {"annotations": {"NEURON_NODE": "elsewhere"}}},
                content_type="application/merge-patch+json",
            )
        refusal = str(caught.value)
        assert caught.value.status == 403 and "the device plugin may change only" in refusal
    finally:
        chart_cp.request("DELETE", f"/api/v1/nodes/{node}")


def test_network_policy_admits_only_the_scheduler_and_scrapers() -> None:
    (custom,) = [d for d in render() if d["kind"] == "NetworkPolicy"]
    to_verbs, to_metrics = custom["spec"]["ingress"]
    assert to_verbs["ports"] == [{"port": 12345, "protocol": "TCP"}]
    assert to_verbs["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "my-scheduler",
                    "app.kubernetes.io/instance": "neuron-scheduler",
                }
            }
        }
    ]
    assert to_metrics == {
        "ports": [{"port": 12346, "protocol": "TCP"}],
        "from": [{"namespaceSelector": {}}],
    }
    values = COMBOS["default-own-secrets-cidrs"]
    (default,) = [d for d in render(values) if d["kind"] == "NetworkPolicy"]
    assert default["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}}]
    off = render({"scheduler": {"networkPolicy": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]


# --- monitoring: ServiceMonitor, PodDisruptionBudget, Grafana dashboard ------------------------

# PromQL's own words in the dashboard's queries; every other identifier left once label
# matchers, ranges and grouping labels are removed is a metric name.
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile"}
PROMQL_WORDS |= {"vector", "by", "without", "or", "and", "unless", "on", "ignoring"}


def metric_names(expr: str) -> set[str]:
    text = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without)\s*\([^)]*\)", "", text)  # grouping labels
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text)) - PROMQL_WORDS


def label_names(expr: str) -> set[str]:
    """The labels a query matches on or groups by."""
    names = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        names |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        names |= {label.strip() for label in grouping.split(",") if label.strip()}
    return names


def exported_series() -> dict[str, set[str]]:
    """Every series the extender's /metrics carries, with its label names, read from the running
    code: the registry's samples once each labelled family has a child, the ledger a node, an
    unusable node, a rejected annotation and a pod asking for Neuron devices."""
    ledger = Ledger(Catalog.builtin())
    ledger.demand.record(Unit.DEVICE, 1)
    ledger.apply_node(node_object("n1", "inf2.48xlarge"))
    ledger.apply_node(node_object("n2", "inf2.48xlarge", devices=5))  # unusable: not 12 devices
    ledger.rejected_assignments["example"] += 1
    metrics = Metrics(ledger)
    for labelled in (
        metrics.latency,
        metrics.filter_outcomes,
        metrics.binds,
        metrics.preempt_nodes,
        metrics.watch_seconds,
        metrics.job_preemptions,
        metrics.kueue_checks,
    ):
        labelled.labels("example")
    metrics.wakes.labels("example", "example")
    metrics.failed_device_evictions.labels("example")
    consolidation = ConsolidationMetrics(metrics.registry)
    for labelled in (consolidation.plans, consolidation.evictions, consolidation.blocked):
        labelled.labels("example")
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        assert family.samples, f"{family.name}: no samples; give it a child above"
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_monitoring_objects_are_optional() -> None:
    assert not {k for k in kinds(render()) if k.startswith(("PodDisruptionBudget", "ServiceM"))}
    assert "ConfigMap/k8s-neuron-scheduler-dashboard" not in kinds(render())
    # The budget comes with more than one replica, however the count is given.
    for values in ({"scheduler": {"replicas": 2}}, {"scheduler": {"replicaCount": 3}}):
        assert "PodDisruptionBudget/k8s-neuron-scheduler" in kinds(render(values))
    one = {"scheduler": {"leaderElection": {"enabled": True}}}
    assert "PodDisruptionBudget/k8s-neuron-scheduler" not in kinds(render(one))
    off = {"scheduler": {"replicas": 2, "podDisruptionBudget": {"enabled": False}}}
    assert "PodDisruptionBudget/k8s-neuron-scheduler" not in kinds(render(off))


def test_disruption_budget_protects_the_leader_only() -> None:
    docs = render(COMBOS["custom-monitored"])
    budget = find(docs, "PodDisruptionBudget", "k8s-neuron-scheduler")["spec"]
    deployment = find(docs, "Deployment", "k8s-neuron-scheduler")["spec"]
    assert budget["selector"] == deployment["selector"]
    # Only the leader is ready: it stays; the never-ready standbys may always be evicted.
    assert budget["minAvailable"] == 1
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_service_monitor_scrapes_the_metrics_port() -> None:
    docs = render(COMBOS["custom-monitored"])
    monitor = find(docs, "ServiceMonitor", "k8s-neuron-scheduler")
    service = find(docs, "Service", "k8s-neuron-scheduler")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kube-system"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    assert port["port"] == 12346
    assert (endpoint["path"], endpoint["scheme"], endpoint["interval"]) == (
        "/metrics",
        "http",
        "30s",
    )


def test_dashboard_queries_name_metrics_the_extender_exports() -> None:
    values = {"scheduler": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}}
    configmap = find(render(values), "ConfigMap", "k8s-neuron-scheduler-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(configmap["data"]["neuron-scheduler.json"])
    series = exported_series()
    exported = set(series)
    # The check can fail: a misspelt metric or label is caught.
    assert metric_names("sum(rate(neuron_scheduler_bindz_total[5m]))") - exported == {
        "neuron_scheduler_bindz_total"
    }
    assert label_names('sum by (reslt) (x{node=~"$node"})') == {"reslt", "node"}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= exported, (panel["title"], names - exported)
            labels = set().union(*(series[name] for name in names))
            assert label_names(target["expr"]) <= labels, (panel["title"], target["expr"])
            used |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
            assert match and match.group(2) in series.get(match.group(1), set()), variable
    # Binds and failures, latency per verb, free devices and largest free block per node, filter
    # outcomes, preemption outcomes.
    assert {
        "neuron_scheduler_binds_total",
        "neuron_scheduler_rollbacks_total",
        "neuron_scheduler_request_seconds_bucket",
        "neuron_scheduler_node_free_devices",
        "neuron_scheduler_node_largest_free_block",
        "neuron_scheduler_filter_nodes_total",
        "neuron_scheduler_preempt_nodes_total",
    } <= used


def test_generated_certificates_are_kept_across_upgrades(kubebin: Path, tmp_path: Path) -> None:
    """helm install makes the CA and both certificates; helm upgrade keeps them (lookup), so
    my-scheduler's client certificate stays valid. The notes say which files go on the host."""
    with ControlPlane(kubebin, tmp_path / "cp") as cp:
        namespace = "neuron"
        cp.client.ensure_namespace(namespace)

        def helm_release(action: str) -> str:
            result = helm(
                action,
                "neuron-scheduler",
                "--namespace",
                namespace,
                "--kubeconfig",
                str(cp.kubeconfig_path),
                values=DEFAULT_MODE,
            )
            assert result.returncode == 0, result.stderr
            return result.stdout

        notes = helm_release("install")
        assert "get secret k8s-neuron-scheduler-client-tls" in notes
        path = f"/api/v1/namespaces/{namespace}/secrets/"
        first = {
            n: cp.request("GET", path + n)["data"]
            for n in ("k8s-neuron-scheduler-tls", "k8s-neuron-scheduler-client-tls")
        }
        assert (
            first["k8s-neuron-scheduler-tls"]["ca.crt"]
            == first["k8s-neuron-scheduler-client-tls"]["ca.crt"]
        )
        helm_release("upgrade")
        for name, data in first.items():
            assert cp.request("GET", path + name)["data"] == data, name


@pytest.mark.parametrize(
    ("algorithm", "shown"),
    [(None, ("id-ecPublicKey", "NIST CURVE: P-256")), ("rsa", ("rsaEncryption", "(2048 bit)"))],
)
def test_certificates_are_of_the_key_type_asked_for(
    algorithm: str | None, shown: tuple[str, str], tmp_path: Path
) -> None:
    """The certificates the chart makes have ECDSA P-256 keys unless scheduler.tls.keyAlgorithm
    says rsa (each new connection from kube-scheduler is a full handshake, which signs with both
    keys: BENCHMARKS.md), and each is signed by the one CA; cert-manager is asked for the same."""
    tls: Doc = {} if algorithm is None else {"keyAlgorithm": algorithm}
    docs = render({"scheduler": {"tls": tls}})
    for name in ("k8s-neuron-scheduler-tls", "k8s-neuron-scheduler-client-tls"):
        data = find(docs, "Secret", name)["data"]
        for key in ("tls.crt", "ca.crt", "tls.key"):
            (tmp_path / f"{name}-{key}").write_bytes(base64.b64decode(data[key]))
        for key in ("tls.crt", "ca.crt"):
            text = openssl("x509", "-noout", "-text", "-in", str(tmp_path / f"{name}-{key}"))
            assert all(part in text for part in shown), (name, key, text)
        ca, cert = (str(tmp_path / f"{name}-{k}") for k in ("ca.crt", "tls.crt"))
        assert openssl("verify", "-CAfile", ca, cert).strip().endswith(": OK")
        key_file = str(tmp_path / f"{name}-tls.key")
        key_of_cert = openssl("x509", "-noout", "-pubkey", "-in", cert)
        assert openssl("pkey", "-pubout", "-in", key_file) == key_of_cert
    key = {"algorithm": "RSA", "size": 2048} if algorithm else {"algorithm": "ECDSA", "size": 256}
    # (a new key at each issuance: so a key type that changes on upgrade is issued, not stuck)
    expected = {**key, "rotationPolicy": "Always"}
    managed = render({"scheduler": {"tls": {**tls, "certManager": CERT_MANAGER}}})
    for name in ("k8s-neuron-scheduler-tls", "k8s-neuron-scheduler-client-tls"):
        assert find(managed, "Certificate", name)["spec"]["privateKey"] == expected


@pytest.mark.parametrize(
    "combo", ["custom-ha", "custom-plain-http", "default", "custom-autoscaling"]
)
def test_rendered_arguments_parse_with_the_cli(combo: str) -> None:
    """Every flag the chart passes exists on the command it runs (parsed, not executed)."""
    import typer.main

    from neuron_scheduler.cli import app

    command = typer.main.get_command(app)
    values = {**COMBOS[combo], "devicePlugin": {"coresPerDevice": 2}}
    docs = render(values)
    workloads = [
        find(docs, "Deployment", "k8s-neuron-scheduler"),
        find(docs, "DaemonSet", "neuron-device-plugin"),
    ]
    for workload in workloads:
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        name, *args = container["args"]
        subcommand = command.commands[name]  # type: ignore[attr-defined]
        context = subcommand.make_context(name, list(args))
        assert context.params["log_level"] == "info"
        if name == "extender":
            assert context.params["port"] == 12345
            leader = combo == "custom-ha"
            assert context.params["leader_elect"] is leader
        else:
            assert context.params["cores_per_device"] == 2
            assert str(context.params["dev_root"]) == "/host/dev"
