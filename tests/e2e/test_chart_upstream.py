"""The chart as a drop-in for AWS's neuron-helm-chart: every upstream values key is accepted, the
ones we implement keep their meaning (and win over the keys of ours they overlap), the components
we do not ship install nothing and the install notes say so, and the seeds' install commands run
as typed against a real API server. Strict server-side apply of the same renders is in
test_chart.py (TestApply)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.chart import (
    SEED_COMMANDS,
    UPSTREAM_NAMESPACES,
    UPSTREAM_VALUES,
    Doc,
    find,
    helm,
    kinds,
    render,
    run_typed,
    scheduler_config,
    upstream_release_values,
)
from tests.testbed import ControlPlane, find_kubebin

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
OUR_IMAGE = "ghcr.io/neuron-scheduler/neuron-scheduler:0.1.0"


def pod_spec(docs: list[Doc], kind: str, name: str) -> Doc:
    spec: Doc = find(docs, kind, name)["spec"]["template"]["spec"]
    return spec


def container(docs: list[Doc], kind: str, name: str) -> Doc:
    (only,) = pod_spec(docs, kind, name)["containers"]
    result: Doc = only
    return result


def with_values(base: Doc, **paths: Any) -> Doc:
    """`base` with dotted paths set (scheduler__replicas=2 sets scheduler.replicas)."""
    values = copy.deepcopy(base)
    for path, value in paths.items():
        *parents, leaf = path.split("__")
        node = values
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return values


@pytest.fixture(scope="module")
def upstream() -> list[Doc]:
    lint = helm("lint", "--strict", values=UPSTREAM_VALUES)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    return render(UPSTREAM_VALUES)


def test_device_plugin_keys(upstream: list[Doc]) -> None:
    plugin = "aws-neuron-device-plugin"  # devicePlugin.fullnameOverride
    daemonset = find(upstream, "DaemonSet", plugin)
    assert daemonset["metadata"]["namespace"] == UPSTREAM_NAMESPACES["plugin"]
    # selectorLabelsOverride: the selector, and carried by the pods.
    assert daemonset["spec"]["selector"]["matchLabels"] == {"name": "neuron-device-plugin-ds"}
    template = daemonset["spec"]["template"]
    assert template["metadata"]["labels"]["name"] == "neuron-device-plugin-ds"
    assert template["metadata"]["annotations"] == {"team": "ml"}
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 2},
    }
    spec = template["spec"]
    # serviceAccount: its name and annotations, bound to the plugin's ClusterRole.
    assert spec["serviceAccountName"] == "plugin-account"
    account = find(upstream, "ServiceAccount", "plugin-account")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/plugin")
    (subject,) = find(upstream, "ClusterRoleBinding", plugin)["subjects"]
    assert subject == {
        "kind": "ServiceAccount",
        "name": "plugin-account",
        "namespace": UPSTREAM_NAMESPACES["plugin"],
    }
    assert spec["imagePullSecrets"] == [{"name": "plugin-pull"}]
    assert "runtimeClassName" not in spec  # null upstream
    # affinity: upstream's placeholders filled, the instance types from neuronInstances.
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"][0] == {
        "key": "node.kubernetes.io/instance-type",
        "operator": "In",
        "values": UPSTREAM_VALUES["neuronInstances"],
    }
    main = container(upstream, "DaemonSet", plugin)
    # AWS's device plugin image cannot run our commands: ours runs (the notes say so).
    assert main["image"] == OUR_IMAGE
    assert main["imagePullPolicy"] == "IfNotPresent"
    # env: the user's variables, NODE_NAME once (theirs, the same field).
    assert [e["name"] for e in main["env"]] == ["KUBECONFIG", "NODE_NAME"]
    # volumes and mounts: added; the same mount path or volume name replaces ours.
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    assert mounts["/var/lib/kubelet/device-plugins"] == "device-plugin"
    assert mounts["/run"] == "infa-map" and mounts["/opt/aws"] == "aws-config"
    assert mounts["/host/opt/aws"] == "aws-config"  # ours stays: the LNC setting is read there
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["aws-config"] == {"name": "aws-config", "hostPath": {"path": "/opt/aws"}}
    assert len(spec["volumes"]) == len(volumes)
    # securityContext {} (upstream's default) keeps the chart's hardening.
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_extender_keys(upstream: list[Doc]) -> None:
    extender = "neuron-extender"  # scheduler.fullnameOverride
    namespace = UPSTREAM_NAMESPACES["scheduler"]
    deployment = find(upstream, "Deployment", extender)
    assert deployment["metadata"]["namespace"] == namespace
    assert deployment["spec"]["replicas"] == 2  # scheduler.replicaCount
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["selector"]["matchLabels"] == {"app": "neuron-extender"}
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == extender  # serviceAccount.name "" -> the fullname
    assert spec["imagePullSecrets"] == [{"name": "extender-pull"}]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "tolerations" not in spec  # [] given: none, as upstream
    # podSecurityContext and securityContext: over the chart's settings, key by key.
    assert spec["securityContext"]["fsGroup"] == 65532
    assert spec["securityContext"]["runAsUser"] == 65532
    main = container(upstream, "Deployment", extender)
    assert main["securityContext"]["runAsNonRoot"] is True
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["image"] == OUR_IMAGE  # AWS's extender image set aside
    assert [e["name"] for e in main["env"]] == ["POD_NAME", "POD_NAMESPACE", "PORT"]
    # Two replicas: leader election, its Role, and the disruption budget.
    assert "--lease-name=neuron-extender" in main["args"]
    assert f"Role/{extender}-leader-election" in kinds(upstream)
    assert find(upstream, "PodDisruptionBudget", extender)["spec"]["selector"] == {
        "matchLabels": {"app": "neuron-extender"}
    }
    service = find(upstream, "Service", extender)
    assert service["spec"]["selector"] == {"app": "neuron-extender"}
    # The serving certificate names the Service where it is; the client one lives with
    # my-scheduler, which mounts it.
    assert find(upstream, "Secret", f"{extender}-tls")["metadata"]["namespace"] == namespace
    client = find(upstream, "Secret", f"{extender}-client-tls")
    assert client["metadata"]["namespace"] == UPSTREAM_NAMESPACES["custom"]
    (rule, _) = find(upstream, "NetworkPolicy", extender)["spec"]["ingress"]
    assert rule["from"] == [
        {
            "podSelector": {"matchLabels": {"app": "neuron-kube-scheduler"}},
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": UPSTREAM_NAMESPACES["custom"]}
            },
        }
    ]


def test_custom_scheduler_keys(upstream: list[Doc]) -> None:
    name = "neuron-kube-scheduler"  # customScheduler.fullnameOverride
    namespace = UPSTREAM_NAMESPACES["custom"]
    deployment = find(upstream, "Deployment", name)
    assert deployment["metadata"]["namespace"] == namespace
    assert deployment["spec"]["replicas"] == 2  # customScheduler.replicaCount
    assert deployment["spec"]["selector"]["matchLabels"] == {"app": "neuron-kube-scheduler"}
    main = container(upstream, "Deployment", name)
    assert (
        main["image"] == "public.ecr.aws/eks-distro/kubernetes/kube-scheduler:v1.31.12-eks-1-31-30"
    )
    # extraArgs after ours: a repeated flag (--v) wins.
    assert main["command"][-2:] == ["--kube-api-qps=100", "--v=4"]
    assert main["readinessProbe"]["httpGet"]["path"] == "/healthz"  # upstream's probe
    # Merged into the chart's defaults, as helm merges any map value.
    assert main["resources"]["requests"]["cpu"] == "0.1"
    assert main["securityContext"]["privileged"] is False
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    config = scheduler_config(upstream, name)
    (profile,) = config["profiles"]
    assert profile["schedulerName"] == name
    assert config["leaderElection"]["resourceNamespace"] == namespace
    (entry,) = config["extenders"]
    assert entry["urlPrefix"] == (
        f"https://neuron-extender.{UPSTREAM_NAMESPACES['scheduler']}.svc.cluster.local:12345"
    )
    assert (
        entry["tlsConfig"]["serverName"]
        == f"neuron-extender.{UPSTREAM_NAMESPACES['scheduler']}.svc"
    )
    # The extender binds the pods of the renamed scheduler.
    assert (
        f"--scheduler-name={name}" in container(upstream, "Deployment", "neuron-extender")["args"]
    )
    reader = find(upstream, "RoleBinding", f"{name}-extension-apiserver-authentication-reader")
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["subjects"][0]["namespace"] == namespace


def test_components_not_shipped_install_nothing(upstream: list[Doc]) -> None:
    """npd, draDriver, ultraserverOperator and monitor are on in UPSTREAM_VALUES: still only our
    three components are rendered, in the namespaces given for them."""
    names = {d["metadata"]["name"] for d in upstream}
    ours = {"ultraserverclaims.neuron-scheduler.io"}  # our claims CRD, not AWS's operator
    assert not {n for n in names - ours if "problem" in n or "ultraserver" in n or "monitor" in n}
    assert not {k for k in kinds(upstream) if "dra" in k.lower() or k.startswith("DeviceClass")}
    namespaces = {d["metadata"].get("namespace") for d in upstream} - {None, "kube-system"}
    assert namespaces == set(UPSTREAM_NAMESPACES.values())


def test_the_upstream_values_file_as_released() -> None:
    """AWS's own values.yaml (chart 1.0.0), unchanged: accepted, and its settings kept."""
    values = upstream_release_values()
    lint = helm("lint", "--strict", values=values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values, namespace="default")
    workloads = {
        f"{d['kind']}/{d['metadata']['name']}": d["metadata"]["namespace"]
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet")
    }
    assert workloads == {
        "Deployment/k8s-neuron-scheduler": "kube-system",
        "Deployment/my-scheduler": "kube-system",
        "DaemonSet/neuron-device-plugin": "kube-system",
    }
    (term,) = pod_spec(docs, "DaemonSet", "neuron-device-plugin")["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"][0]["values"] == values["neuronInstances"]
    assert container(docs, "DaemonSet", "neuron-device-plugin")["image"] == OUR_IMAGE
    assert container(docs, "Deployment", "k8s-neuron-scheduler")["image"] == OUR_IMAGE
    assert pod_spec(docs, "Deployment", "k8s-neuron-scheduler")["nodeSelector"] == {
        "node-role.kubernetes.io/master": ""
    }
    scheduler = container(docs, "Deployment", "my-scheduler")
    assert scheduler["image"] == (
        "public.ecr.aws/eks-distro/kubernetes/kube-scheduler:v1.28.5-eks-1-28-latest"
    )
    assert scheduler["resources"]["requests"]["cpu"] == "0.1"


def test_overlapping_keys_upstream_wins_when_given() -> None:
    """Each pair of an upstream key and ours: the upstream one, when given, decides."""
    both = {
        "neuronInstances": ["trn2.48xlarge"],
        "scheduler": {
            "replicas": 3,
            "replicaCount": 1,
            "image": {"repository": "registry.example/neuron-scheduler", "tag": "dev"},
            "customScheduler": {
                "name": "ours",
                "fullnameOverride": "theirs",
                "replicas": 1,
                "replicaCount": 2,
            },
        },
        "devicePlugin": {"instanceTypes": ["inf2.48xlarge"], "image": {"tag": "0.2.0"}},
        "image": {"pullPolicy": "Always"},
    }
    docs = render(both)
    assert find(docs, "Deployment", "k8s-neuron-scheduler")["spec"]["replicas"] == 1
    assert "PodDisruptionBudget/k8s-neuron-scheduler" not in kinds(docs)
    assert find(docs, "Deployment", "theirs")["spec"]["replicas"] == 2
    assert "Deployment/ours" not in kinds(docs)
    extender = container(docs, "Deployment", "k8s-neuron-scheduler")
    # A component image of someone else's build is used; missing keys come from image.*.
    assert extender["image"] == "registry.example/neuron-scheduler:dev"
    assert extender["imagePullPolicy"] == "Always"
    plugin = container(docs, "DaemonSet", "neuron-device-plugin")
    assert plugin["image"] == "ghcr.io/neuron-scheduler/neuron-scheduler:0.2.0"
    (term,) = pod_spec(docs, "DaemonSet", "neuron-device-plugin")["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"][0]["values"] == ["trn2.48xlarge"]
    # Ours alone: ours decides.
    alone = render({"scheduler": {"replicas": 2}, "devicePlugin": {"instanceTypes": ["x.large"]}})
    assert find(alone, "Deployment", "k8s-neuron-scheduler")["spec"]["replicas"] == 2
    (term,) = pod_spec(alone, "DaemonSet", "neuron-device-plugin")["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"][0]["values"] == ["x.large"]


def test_names_follow_the_upstream_rules() -> None:
    """An empty fullnameOverride gives <release>-<nameOverride> as upstream, or the release name
    when it already contains that name."""
    docs = render({"scheduler": {"fullnameOverride": "", "nameOverride": "ext"}})
    assert "Deployment/neuron-scheduler-ext" in kinds(docs)
    docs = render({"scheduler": {"fullnameOverride": "", "nameOverride": "scheduler"}})
    assert "Deployment/neuron-scheduler" in kinds(docs)  # the release is "neuron-scheduler"
    # The renamed extender's Service is what my-scheduler calls.
    (entry,) = scheduler_config(docs)["extenders"]
    assert entry["urlPrefix"].startswith("https://neuron-scheduler.kube-system.svc")


def test_default_scheduler_placement_keys() -> None:
    """defaultScheduler.nodeSelector/.tolerations add to the extender's in default-scheduler
    mode only (upstream runs the extender on control plane nodes so)."""
    placement = {
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}],
    }
    default_mode = {
        "scheduler": {
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "customScheduler": {"enabled": False},
            "defaultScheduler": {"enabled": True, **placement},
        }
    }
    spec = pod_spec(render(default_mode), "Deployment", "k8s-neuron-scheduler")
    assert spec["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "node-role.kubernetes.io/control-plane": "",
    }
    assert spec["tolerations"][-1] == placement["tolerations"][0]
    assert spec["tolerations"][0]["key"] == "CriticalAddonsOnly"  # ours first
    custom = with_values(default_mode, scheduler__customScheduler={"enabled": True})
    custom["scheduler"]["defaultScheduler"]["enabled"] = False
    spec = pod_spec(render(custom), "Deployment", "k8s-neuron-scheduler")
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}


def test_existing_service_accounts() -> None:
    values = {
        "scheduler": {"serviceAccount": {"create": False, "name": "extender-sa"}},
        "devicePlugin": {"serviceAccount": {"create": False, "name": "plugin-sa"}},
    }
    docs = render(values)
    assert not [
        k for k in kinds(docs) if k in ("ServiceAccount/extender-sa", "ServiceAccount/plugin-sa")
    ]
    assert "ServiceAccount/k8s-neuron-scheduler" not in kinds(docs)
    assert (
        pod_spec(docs, "Deployment", "k8s-neuron-scheduler")["serviceAccountName"] == "extender-sa"
    )
    (subject,) = find(docs, "ClusterRoleBinding", "k8s-neuron-scheduler")["subjects"]
    assert subject["name"] == "extender-sa"
    (subject,) = find(docs, "ClusterRoleBinding", "neuron-device-plugin")["subjects"]
    assert subject["name"] == "plugin-sa"


def test_device_plugin_affinity_keeps_dra_nodes_out() -> None:
    """With our DRA driver on, a user's devicePlugin.affinity still skips the DRA nodes."""
    values = with_values(UPSTREAM_VALUES, dra={"enabled": True})
    values["draDriver"] = {"enabled": False}
    spec = pod_spec(render(values), "DaemonSet", "aws-neuron-device-plugin")
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"][-1] == {
        "key": "neuron-scheduler.io/neuron-path",
        "operator": "NotIn",
        "values": ["dra"],
    }
    preferred_only = {
        "dra": {"enabled": True},
        "devicePlugin": {"affinity": {"podAntiAffinity": {}}},
    }
    spec = pod_spec(render(preferred_only), "DaemonSet", "neuron-device-plugin")
    assert spec["affinity"]["podAntiAffinity"] == {}
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == {"matchExpressions": [term["matchExpressions"][0]]}
    assert term["matchExpressions"][0]["key"] == "neuron-scheduler.io/neuron-path"


# --- the seeds' commands against a real API server ---------------------------------------------


@pytest.mark.compat
def test_seed_commands_install_as_typed(tmp_path: Path) -> None:
    """`helm upgrade --install` exactly as the seeds type it (only the chart reference is ours),
    against a real kube-apiserver: the custom-scheduler install, then the switch to the default
    scheduler; then what the notes say about the upstream components we do not ship."""
    with ControlPlane(find_kubebin(ROOT), tmp_path / "cp") as cp:
        custom = run_typed(SEED_COMMANDS["seed-custom-scheduler"], cp.kubeconfig_path)
        assert custom.returncode == 0, custom.stderr
        assert "schedulerName: my-scheduler" in custom.stdout
        assert "not part of this chart" not in custom.stdout
        deployments = "/apis/apps/v1/namespaces/default/deployments"
        names = {d["metadata"]["name"] for d in cp.request("GET", deployments)["items"]}
        assert names == {"k8s-neuron-scheduler", "my-scheduler"}

        default = run_typed(SEED_COMMANDS["seed-default-scheduler"], cp.kubeconfig_path)
        assert default.returncode == 0, default.stderr
        assert "extenders:" in default.stdout
        names = {d["metadata"]["name"] for d in cp.request("GET", deployments)["items"]}
        assert names == {"k8s-neuron-scheduler"}
        service = cp.request("GET", "/api/v1/namespaces/default/services/k8s-neuron-scheduler")
        assert service["spec"]["ports"][0]["nodePort"] == 32700

        # The components we do not ship, turned on: accepted, nothing installed, said so.
        values = tmp_path / "upstream-values.yaml"
        values.write_text(yaml.safe_dump(UPSTREAM_VALUES))
        dry_run = run_typed(
            "helm upgrade --install neuron-helm-chart oci://public.ecr.aws/neuron/neuron-helm-chart"
            f" -f {values} --dry-run",
            cp.kubeconfig_path,
        )
        assert dry_run.returncode == 0, dry_run.stderr
        notes = dry_run.stdout.partition("NOTES:")[2]
        for component in ("npd", "draDriver", "ultraserverOperator", "monitor"):
            assert f"{component}.enabled is true, but" in notes, notes
        assert "not part of this chart" in notes
        assert "This chart has its own DRA driver under dra.*" in notes
        for component, image in (
            ("scheduler", "public.ecr.aws/neuron/neuron-scheduler"),
            ("devicePlugin", "public.ecr.aws/neuron/neuron-device-plugin"),
        ):
            assert f"{component}.image names AWS's image ({image})" in notes, notes
        without_plugin = run_typed(
            "helm upgrade --install neuron-helm-chart oci://public.ecr.aws/neuron/neuron-helm-chart"
            ' --set "devicePlugin.enabled=false" --dry-run',
            cp.kubeconfig_path,
        )
        assert without_plugin.returncode == 0, without_plugin.stderr
        assert "the Neuron device plugin already on your nodes (AWS's)" in without_plugin.stdout
