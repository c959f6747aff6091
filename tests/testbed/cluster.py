"""`make cluster`: a local control plane with the extender and my-scheduler, for kubectl by hand.

Run from a checkout (it needs the Kubernetes binaries `make` builds): `make cluster`, or
`uv run python -m tests.testbed.cluster --help`. Ctrl-C stops everything.

`make cluster CLUSTER_ARGS=--real-node` (as root) adds one real node: the upstream kubelet against
the fake CRI runtime (tests/testbed/kubelet.py), with our device plugin over a fake inf1.6xlarge
device tree, so pods really start and get their cores.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import threading
from pathlib import Path

from neuron_scheduler.commandline import out
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from tests.builders import node_json
from tests.testbed import ControlPlane, ManagedProcess, Stack, find_kubebin
from tests.testbed.deviceplugin import device_plugin
from tests.testbed.kubelet import Kubelet, NodeCA
from tests.testbed.stack import REPO

NODES = {
    "inf1-6xlarge-0": "inf1.6xlarge",
    "inf2-48xlarge-0": "inf2.48xlarge",
    "trn1-32xlarge-0": "trn1.32xlarge",
    "trn2-48xlarge-0": "trn2.48xlarge",
}
REAL_NODE, REAL_TYPE = "real-inf1-6xlarge-0", "inf1.6xlarge"


def start_real_node(cp: ControlPlane, ca: NodeCA, workdir: Path) -> tuple[Kubelet, ManagedProcess]:
    kubelet = Kubelet(cp, ca, REAL_NODE, instance_type=REAL_TYPE)
    kubelet.start()
    tree = workdir / "real-node-tree"
    shutil.rmtree(tree, ignore_errors=True)  # a previous run's
    plugin = device_plugin(
        REAL_NODE,
        kubelet.plugin_dir,
        tree,
        cp.kubeconfig_path,
        cp.log_dir / "device-plugin.log",
        devices=4,
        cores=4,
        extra_args=["--pod-resources-socket", str(kubelet.pod_resources_socket)],
    )
    plugin.start()
    kubelet.wait_allocatable({NEURONCORE: 16, NEURON: 4, NEURONDEVICE: 4})
    return kubelet, plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cluster"), help="keys, logs")
    parser.add_argument(
        "--full-node-list",
        action="store_true",
        help="kube-scheduler sends whole Node objects (nodeCacheCapable: false)",
    )
    parser.add_argument(
        "--real-node",
        action="store_true",
        help=f"add {REAL_NODE}: a real kubelet (fake container runtime) and our device plugin; "
        "needs root",
    )
    args = parser.parse_args()
    kubebin = find_kubebin(REPO)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ca = NodeCA(args.workdir / "node-ca") if args.real_node else None
    extra = ca.apiserver_args if ca is not None else []
    real: tuple[Kubelet, ManagedProcess] | None = None
    with ControlPlane(kubebin, args.workdir, extra_apiserver_args=extra) as cp:
        stack = Stack(cp)
        stack.use_scheduler(not args.full_node_list)
        for name, instance_type in NODES.items():
            cp.request("POST", "/api/v1/nodes", node_json(name, instance_type))
        names = list(NODES)
        if ca is not None:
            real = start_real_node(cp, ca, args.workdir)
            names.append(REAL_NODE)
        kubectl = f"{kubebin} kubectl --kubeconfig {cp.kubeconfig_path}"
        out.print(f"[bold]cluster ready[/] in {cp.startup_seconds:.1f}s; nodes: {', '.join(names)}")
        out.print(f"kubeconfig: {cp.kubeconfig_path}")
        out.print(f"kubectl:    {kubectl}")
        out.print(f"extender:   {stack.extender.url} (log {stack.extender.process.log_path})")
        out.print(f"logs:       {cp.log_dir}/")
        if real is not None:
            out.print(
                f"real node:  {REAL_NODE}: kubelet, fake container runtime and device plugin "
                f"(logs in {cp.log_dir}/); a pod with nodeSelector "
                f"kubernetes.io/hostname={REAL_NODE} really starts there",
                markup=False,
            )
        out.print(
            "try:        " + kubectl + " run nrt --image=x --restart=Never "
            '--overrides=\'{"spec":{"schedulerName":"my-scheduler","containers":'
            '[{"name":"nrt","image":"x","resources":{"limits":'
            '{"aws.amazon.com/neuroncore":"9"}}}]}}\'',
            markup=False,
        )
        out.print("Ctrl-C stops everything.")
        try:
            while not stop.wait(1):
                pass
        except KeyboardInterrupt:
            pass
        if real is not None:
            real[1].stop()
            real[0].close()
        stack.stop()


if __name__ == "__main__":
    main()
