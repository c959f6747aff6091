"""The Helm chart as the tests use it: helm built by make, rendering, and strict server-side apply.

helm comes from tools/helm.mk like the Kubernetes binary comes from tools/kube.mk: $HELM_BIN when
make runs the tests, else `make -f tools/helm.mk helm-bin` (which builds it on first use). A missing
helm is a failure, never a skip.
"""

from __future__ import annotations

import base64
import os
import shlex
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.testbed import ControlPlane, find_kubebin
from tests.testbed.controlplane import ServiceAccountCredentials
from tests.testbed.kubeversion import binary_version
from tests.testbed.pki import Pki
from tests.testbed.stack import ExtenderProcess

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "neuron-scheduler"
RULES = CHART / "files" / "extender-rules.yaml"

Doc = dict[str, Any]


@cache
def kube_version_of_testbed() -> str:
    """The testbed binary's Kubernetes version (the default's, or KUBE_MINOR's in a compatibility
    run), so that rendering matches the API server the tests apply to."""
    return str(binary_version(find_kubebin(ROOT)))


@cache
def helm_bin() -> Path:
    env = os.environ.get("HELM_BIN")
    if env:
        path = Path(env)
    else:
        result = subprocess.run(
            ["make", "-s", "--no-print-directory", "-f", "tools/helm.mk", "helm-bin"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"building helm failed:\n{result.stdout}\n{result.stderr}"
        path = Path(result.stdout.strip().splitlines()[-1])
    assert os.access(path, os.X_OK), f"helm binary {path} is missing or not executable"
    return path


def helm_env(kubeconfig: Path | None = None) -> dict[str, str]:
    # helm keeps caches and a registry config under these; keep them out of $HOME.
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(Path(tempfile.gettempdir()) / "ns-helm-cache"),
        "HELM_CONFIG_HOME": str(Path(tempfile.gettempdir()) / "ns-helm-config"),
        "HELM_DATA_HOME": str(Path(tempfile.gettempdir()) / "ns-helm-data"),
    }
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


def helm(*args: str, values: Doc | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm on the chart with a values file; never raises, the caller checks."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="values-") as handle:
        yaml.safe_dump(values or {}, handle)
        handle.flush()
        return subprocess.run(
            [str(helm_bin()), *args, str(CHART), "-f", handle.name],
            capture_output=True,
            text=True,
            check=False,
            env=helm_env(),
        )


# The upstream chart's reference in the AWS install commands; the tests put ours in its place.
UPSTREAM_CHART = "oci://public.ecr.aws/neuron/neuron-helm-chart"


def typed(command: str) -> list[str]:
    """A helm command line as a user types it (shell quoting, line continuations), with only the
    upstream chart reference replaced by this chart's directory and `helm` by the built binary."""
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "helm" and argv.count(UPSTREAM_CHART) == 1, argv
    return [str(helm_bin()), *(str(CHART) if a == UPSTREAM_CHART else a for a in argv[1:])]


def run_typed(command: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        typed(command), capture_output=True, text=True, check=False, env=helm_env(kubeconfig)
    )


def render_typed(command: str) -> list[Doc]:
    """What `command` (helm upgrade --install RELEASE CHART ARGS...) would install: helm template
    with the same release, chart and arguments, exactly as typed."""
    argv = typed(command)
    assert argv[1:3] == ["upgrade", "--install"], argv
    result = subprocess.run(
        [argv[0], "template", *argv[3:]],
        capture_output=True,
        text=True,
        check=False,
        env=helm_env(),
    )
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def render(
    values: Doc | None = None, namespace: str = "kube-system", kube_version: str | None = None
) -> list[Doc]:
    result = helm(
        "template",
        "neuron-scheduler",
        "--namespace",
        namespace,
        "--kube-version",
        kube_version or kube_version_of_testbed(),
        values=values,
    )
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def refusal(values: Doc) -> str:
    """helm template's error for values the chart must refuse."""
    result = helm("template", "neuron-scheduler", values=values)
    assert result.returncode != 0, f"helm template accepted {values}:\n{result.stdout[:2000]}"
    return result.stderr


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered; have {kinds(docs)}"
    return matches[0]


def kinds(docs: list[Doc]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


def apply(cp: ControlPlane, docs: list[Doc], *, manager: str = "chart-test") -> str:
    """Server-side apply with strict field validation (unknown or duplicate fields are errors)."""
    result = cp.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        f"--field-manager={manager}",
        "--validate=strict",
        "-f",
        "-",
        input=yaml.safe_dump_all(docs),
        check=False,
    )
    assert result.returncode == 0, f"kubectl apply failed:\n{result.stderr}\n{result.stdout}"
    return result.stdout


DEVICE_PLUGIN = "neuron-device-plugin"  # its ServiceAccount, ClusterRole and binding


HEALTH_POLICY = f"{DEVICE_PLUGIN}-own-node-health"
POD_POLICY = f"{DEVICE_PLUGIN}-own-node-pods"


def device_plugin_credentials(
    cp: ControlPlane, node: str | None = None
) -> ServiceAccountCredentials:
    """The device plugin's ServiceAccount, ClusterRole, ClusterRoleBinding and the admission
    policies on what it writes to Nodes and pods, as the chart renders them (applied
    server-side, so again is harmless), and a token for that account, bound to a pod on `node`
    when given (as the DaemonSet pod's is): a plugin run with it may do what the chart lets it
    do, and nothing more."""
    docs = render({"scheduler": {"enabled": False}})
    apply(
        cp,
        [
            find(docs, kind, name)
            for kind, name in (
                ("ServiceAccount", DEVICE_PLUGIN),
                ("ClusterRole", DEVICE_PLUGIN),
                ("ClusterRoleBinding", DEVICE_PLUGIN),
                ("ValidatingAdmissionPolicy", HEALTH_POLICY),
                ("ValidatingAdmissionPolicyBinding", HEALTH_POLICY),
                ("ValidatingAdmissionPolicy", POD_POLICY),
                ("ValidatingAdmissionPolicyBinding", POD_POLICY),
            )
        ],
    )
    return cp.service_account("kube-system", DEVICE_PLUGIN, node=node)


EXTENDER = "k8s-neuron-scheduler"  # its ServiceAccount, ClusterRole and binding


def extender_credentials(cp: ControlPlane, docs: list[Doc]) -> ServiceAccountCredentials:
    """The extender's ServiceAccount, every Role, ClusterRole and binding the rendered chart
    gives it and the admission policy on its pod updates, applied server-side (again is
    harmless), and a token for that account: an extender run with it may do what this rendering
    lets it do, whatever else a test applied."""
    bindings = [
        d
        for d in docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and any(s.get("name") == EXTENDER for s in d.get("subjects", []))
    ]
    roles = {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bindings}
    granted = [d for d in docs if (d["kind"], d["metadata"]["name"]) in roles]
    policy = [
        find(docs, kind, f"{EXTENDER}-pod-writes")
        for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    ]
    apply(cp, [find(docs, "ServiceAccount", EXTENDER), *granted, *bindings, *policy])
    return cp.service_account("kube-system", EXTENDER)


def extender_args(docs: list[Doc]) -> list[str]:
    """The rendered extender container's arguments after the `extender` command, minus --port
    and --metrics-port (the test process listens on free ports)."""
    deployment = find(docs, "Deployment", EXTENDER)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args: list[str] = container["args"]
    assert args[0] == "extender", args
    return [a for a in args[1:] if not a.startswith(("--port", "--metrics-port"))]


def scheduler_config(docs: list[Doc], name: str = "my-scheduler") -> Doc:
    configmap = find(docs, "ConfigMap", f"{name}-config")
    config: Doc = yaml.safe_load(configmap["data"][f"{name}-config.yaml"])
    return config


# Where the rendered pods find their certificates, and which Secret key each comes from: the
# extender's own (serving certificate, client CA), my-scheduler's client certificate, and the
# files the install notes put on a control plane host.
CERTIFICATE_FILES = {
    "/etc/neuron-scheduler/tls/": ("k8s-neuron-scheduler-tls", {}),
    "/etc/neuron-scheduler/client/": ("k8s-neuron-scheduler-client-tls", {}),
    "/etc/kubernetes/neuron-scheduler/": (
        "k8s-neuron-scheduler-client-tls",
        {"client.crt": "tls.crt", "client.key": "tls.key"},
    ),
}


def localize(value: Any, docs: list[Doc], directory: Path) -> Any:
    """`value` (arguments, a KubeSchedulerConfiguration) with every certificate path the chart
    renders replaced by a file written from the rendered Secret: the tests run the chart's own
    certificates, as its pods would read them."""
    if isinstance(value, str):
        for prefix, (secret, renamed) in CERTIFICATE_FILES.items():
            if prefix in value:
                before, _, name = value.partition(prefix)
                data = find(docs, "Secret", secret)["data"]
                target = directory / secret / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(data[renamed.get(name, name)]))
                return before + str(target)
        return value
    if isinstance(value, list):
        return [localize(v, docs, directory) for v in value]
    if isinstance(value, dict):
        return {k: localize(v, docs, directory) for k, v in value.items()}
    return value


def chart_extender_process(
    cp: ControlPlane,
    docs: list[Doc],
    directory: Path,
    name: str,
    kubeconfig: Path,
    extra_args: list[str] | None = None,
) -> ExtenderProcess:
    """The extender with the rendered arguments and the chart's own certificates, called as
    my-scheduler calls it (the chart's CA and client certificate). Not started."""
    args = localize(extender_args(docs), docs, directory)
    client = localize(
        [f"/etc/neuron-scheduler/client/{f}" for f in ("tls.crt", "tls.key")], docs, directory
    )
    server = directory / "k8s-neuron-scheduler-tls"
    pki = Pki(
        server / "ca.crt", server / "tls.crt", server / "tls.key", Path(client[0]), Path(client[1])
    )
    return ExtenderProcess(
        cp,
        kubeconfig,
        name=name,
        extra_args=[*args, *(extra_args or [])],
        pki=pki,
        scheduler_names=(),
        check_hostname=False,  # the chart's certificate names the Service, not 127.0.0.1
    )


# The AWS install commands of the seed documents (neuron-facts.md §8), as seed 001 prints them:
# the custom-scheduler one (EKS) and the default-scheduler one (self-managed control planes).
SEED_COMMANDS = {
    "seed-custom-scheduler": (
        "helm upgrade --install neuron-helm-chart "
        "oci://public.ecr.aws/neuron/neuron-helm-chart \\\n"
        '--set "scheduler.enabled=true" \\\n'
        '--set "npd.enabled=false"'
    ),
    "seed-default-scheduler": (
        "helm upgrade --install neuron-helm-chart "
        "oci://public.ecr.aws/neuron/neuron-helm-chart \\\n"
        '--set "scheduler.enabled=true" \\\n'
        '--set "scheduler.customScheduler.enabled=false" \\\n'
        '--set "scheduler.defaultScheduler.enabled=true" \\\n'
        '--set "npd.enabled=false"'
    ),
}

# A values file that sets every key of the upstream neuron-helm-chart (1.10.x, the superset of
# 1.9.x; `monitor` from 1.1.x), as a migrating user's file would, with values of its own so each
# key's effect can be seen. The three components get three namespaces of their own.
UPSTREAM_NAMESPACES = {"scheduler": "neuron-ext", "custom": "neuron-sched", "plugin": "neuron-dp"}
UPSTREAM_VALUES: Doc = yaml.safe_load(
    """
neuronInstances: [inf2.48xlarge, trn2.48xlarge, trn3.48xlarge]
devicePlugin:
  enabled: true
  nameOverride: neuron-device-plugin
  namespaceOverride: neuron-dp
  fullnameOverride: aws-neuron-device-plugin
  selectorLabelsOverride: {name: neuron-device-plugin-ds}
  priorityClassName: system-node-critical
  runtimeClassName: null
  imagePullSecrets: [{name: plugin-pull}]
  image:
    repository: public.ecr.aws/neuron/neuron-device-plugin
    pullPolicy: Always
    tag: "2.32.0.0"
  podSecurityContext: {}
  serviceAccount:
    create: true
    annotations: {eks.amazonaws.com/role-arn: "arn:aws:iam::111122223333:role/plugin"}
    name: plugin-account
  updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 2}}
  podAnnotations: {team: ml}
  securityContext: {}
  resources: {}
  nodeSelector: {}
  tolerations:
    - {key: CriticalAddonsOnly, operator: Exists}
    - {key: aws.amazon.com/neuron, operator: Exists, effect: NoSchedule}
  env:
    - {name: KUBECONFIG, value: /etc/kubernetes/kubelet.conf}
    - {name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - {key: "__INSTANCE_TYPE_KEY__", operator: In, values: "__NEURON_INSTANCES__"}
              - key: eks.amazonaws.com/compute-type
                operator: NotIn
                values: [fargate, hybrid, auto]
  volumeMounts:
    - {name: device-plugin, mountPath: /var/lib/kubelet/device-plugins}
    - {name: infa-map, mountPath: /run}
    - {name: aws-config, mountPath: /opt/aws, readOnly: true}
  volumes:
    - {name: device-plugin, hostPath: {path: /var/lib/kubelet/device-plugins}}
    - {name: infa-map, hostPath: {path: /run}}
    - {name: aws-config, hostPath: {path: /opt/aws}}
scheduler:
  enabled: true
  image:
    repository: public.ecr.aws/neuron/neuron-scheduler
    pullPolicy: IfNotPresent
    tag: "2.32.0.0"
  imagePullSecrets: [{name: extender-pull}]
  nameOverride: neuron-scheduler
  namespaceOverride: neuron-ext
  fullnameOverride: neuron-extender
  selectorLabelsOverride: {app: neuron-extender}
  replicaCount: 2
  strategy: {type: Recreate}
  priorityClassName: system-node-critical
  serviceAccount: {create: true, annotations: {}, name: ""}
  podAnnotations: {team: ml}
  podSecurityContext: {fsGroup: 65532}
  securityContext: {runAsNonRoot: true}
  nodeSelector: {kubernetes.io/os: linux}
  tolerations: []
  affinity: {}
  env:
    - {name: PORT, value: "12345"}
  resources: {}
  customScheduler:
    enabled: true
    nameOverride: ""
    namespaceOverride: neuron-sched
    fullnameOverride: neuron-kube-scheduler
    selectorLabelsOverride: {app: neuron-kube-scheduler}
    extraArgs: ["--kube-api-qps=100", "--v=4"]
    image:
      repository: public.ecr.aws/eks-distro/kubernetes/kube-scheduler
      pullPolicy: IfNotPresent
      tag: v1.31.12-eks-1-31-30
    replicaCount: 2
    serviceAccount: {create: true, annotations: {}, name: ""}
    livenessProbe:
      httpGet: {path: /healthz, port: 10259, scheme: HTTPS}
      initialDelaySeconds: 15
    readinessProbe:
      httpGet: {path: /healthz, port: 10259, scheme: HTTPS}
    resources: {requests: {cpu: "0.1"}}
    securityContext: {privileged: false}
    nodeSelector: {}
    tolerations: []
    affinity: {}
  defaultScheduler:
    enabled: false
    nodeSelector: {node-role.kubernetes.io/control-plane: ""}
    tolerations:
      - {effect: NoSchedule, operator: Exists, key: node-role.kubernetes.io/control-plane}
npd:
  enabled: true
  updateStrategy: {type: RollingUpdate}
  config: {name: node-problem-detector-config, kernelMonitor: "{}"}
  namespaceOverride: neuron-healthcheck-system
  nodeProblemDetector:
    image: {repository: registry.k8s.io/node-problem-detector/node-problem-detector, tag: v1.36.0}
  nodeRecovery: {enabled: false, startupDelaySeconds: 60, counters: [NeuronHasError_DMA_ERROR]}
draDriver:
  enabled: true
  namespaceOverride: neuron-dra-driver
  image: {repository: public.ecr.aws/neuron/neuron-dra-driver, tag: "1.2.0"}
  livenessProbe: {grpc: {port: 51515, service: liveness}}
ultraserverOperator:
  enabled: true
  image: {repository: public.ecr.aws/neuron/neuron-ultraserver-operator, tag: "0.2.0"}
  leaderElect: true
  healthPort: 8081
monitor:
  enabled: true
  exporter: {port: 8000}
"""
)


def upstream_release_values() -> Doc:
    """The upstream chart's own values.yaml (1.0.0, checked in verbatim) as a user who copied it
    passes it, with the scheduler turned on as the seed commands do."""
    values: Doc = yaml.safe_load(UPSTREAM_VALUES_FILE.read_text())
    values["scheduler"]["enabled"] = True
    return values


UPSTREAM_VALUES_FILE = ROOT / "tests" / "e2e" / "upstream" / "neuron-helm-chart-1.0.0-values.yaml"
