"""Scheduling throughput through the real kube-scheduler, with and without our extender.

One control plane (etcd, kube-apiserver, kube-scheduler v1.36.3 from tools/kube). Two sets of
500 fake Neuron nodes; 2,000 Neuron pods per set. The pods are created first, for a scheduler that
is not running yet; then the scheduler starts and we time from the first binding to the last:
- `my-scheduler` with our extender (filter, prioritize, bind),
- `plain-scheduler` without it (kube-scheduler's own extended-resource counting).
Target (issue 4): with/without >= 0.7. Also reports the extender's CPU time and RSS during its run.

Run: uv run python bench/throughput.py [--nodes 500 --pods 2000] [--full-node-list]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet import CORE, NEURON, ROOT, TYPES, cpu_seconds, rss_mb
from tests.builders import node_json
from tests.testbed import ControlPlane, Stack, find_kubebin


def pod(
    name: str, namespace: str, group: str, scheduler: str, rng: random.Random
) -> dict[str, Any]:
    limits = {CORE: str(rng.choice([1, 2, 4]))} if rng.random() < 0.7 else {NEURON: "1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": {"bench-group": group},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": limits},
                }
            ],
        },
    }


def populate(cp: ControlPlane, group: str, nodes: int, pods: int, scheduler: str) -> str:
    namespace = f"bench-{group}"
    cp.client.ensure_namespace(namespace)
    rng = random.Random(group)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda i: cp.request(
                    "POST",
                    "/api/v1/nodes",
                    node_json(
                        f"{group}-{i:04d}",
                        TYPES[i % len(TYPES)][0],
                        labels={"bench-group": group},
                    ),
                ),
                range(nodes),
            )
        )
        bodies = [pod(f"p{i:05d}", namespace, group, scheduler, rng) for i in range(pods)]
        list(
            pool.map(
                lambda b: cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", b), bodies
            )
        )
    return namespace


def bound(cp: ControlPlane, namespace: str) -> int:
    items = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
    return sum(1 for p in items if p["spec"].get("nodeName"))


def timed_run(
    cp: ControlPlane, namespace: str, pods: int, start: Any, timeout: float = 900
) -> tuple[float, int]:
    """Starts the scheduler, returns (seconds from first to last binding, pods bound)."""
    start()
    first = last = None
    count = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.monotonic()
        count = bound(cp, namespace)
        if count and first is None:
            first = now
        if count >= pods:
            last = now
            break
        time.sleep(0.25)
    if first is None:
        return float("inf"), 0
    return (last or time.monotonic()) - first, count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument(
        "--full-node-list", action="store_true", help="extender with nodeCacheCapable: false"
    )
    args = parser.parse_args()
    with ControlPlane(find_kubebin(ROOT)) as cp:
        stack = Stack(cp)
        ours = populate(cp, "ext", args.nodes, args.pods, "my-scheduler")
        plain = populate(cp, "plain", args.nodes, args.pods, "plain-scheduler")
        pid = stack.extender.process.pid
        assert pid is not None
        cpu0 = cpu_seconds(pid)
        with_ext, n_ext = timed_run(
            cp, ours, args.pods, lambda: stack.use_scheduler(not args.full_node_list)
        )
        cpu = cpu_seconds(pid) - cpu0
        rss = rss_mb(pid)
        assert stack.scheduler is not None
        stack.scheduler.stop()
        without, n_plain = timed_run(
            cp, plain, args.pods, lambda: cp.start_scheduler(None, scheduler_name="plain-scheduler")
        )
        rate_ext = n_ext / with_ext
        rate_plain = n_plain / without
        mode = "nodeCacheCapable: false" if args.full_node_list else "nodeCacheCapable: true"
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores; Kubernetes v1.36.3; "
            f"{args.nodes} nodes and {args.pods} Neuron pods per run; extender {mode}"
        )
        print(f"with extender:    {n_ext} bound in {with_ext:.1f} s = {rate_ext:.0f} pods/s")
        print(f"without extender: {n_plain} bound in {without:.1f} s = {rate_plain:.0f} pods/s")
        print(
            f"ratio {rate_ext / rate_plain:.2f} (target >= 0.7); extender CPU {cpu:.1f} s "
            f"({100 * cpu / with_ext:.0f}% of one core during its run), RSS {rss:.0f} MB"
        )
        stack.stop()


if __name__ == "__main__":
    main()
