"""`make cluster`: a local control plane with the extender and my-scheduler, for kubectl by hand.

Run from a checkout (it needs the Kubernetes binaries `make` builds): `make cluster`, or
`uv run python -m tests.testbed.cluster --help`. Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from neuron_scheduler.commandline import out
from tests.builders import node_json
from tests.testbed import ControlPlane, Stack, find_kubebin
from tests.testbed.stack import REPO

NODES = {
    "inf1-6xlarge-0": "inf1.6xlarge",
    "inf2-48xlarge-0": "inf2.48xlarge",
    "trn1-32xlarge-0": "trn1.32xlarge",
    "trn2-48xlarge-0": "trn2.48xlarge",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cluster"), help="keys, logs")
    parser.add_argument(
        "--full-node-list",
        action="store_true",
        help="kube-scheduler sends whole Node objects (nodeCacheCapable: false)",
    )
    args = parser.parse_args()
    kubebin = find_kubebin(REPO)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ControlPlane(kubebin, args.workdir) as cp:
        stack = Stack(cp)
        stack.use_scheduler(not args.full_node_list)
        for name, instance_type in NODES.items():
            cp.request("POST", "/api/v1/nodes", node_json(name, instance_type))
        kubectl = f"{kubebin} kubectl --kubeconfig {cp.kubeconfig_path}"
        out.print(f"[bold]cluster ready[/] in {cp.startup_seconds:.1f}s; nodes: {', '.join(NODES)}")
        out.print(f"kubeconfig: {cp.kubeconfig_path}")
        out.print(f"kubectl:    {kubectl}")
        out.print(f"extender:   {stack.extender.url} (log {stack.extender.process.log_path})")
        out.print(f"logs:       {cp.log_dir}/")
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
        stack.stop()


if __name__ == "__main__":
    main()
