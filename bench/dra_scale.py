"""The DRA driver's ResourceSlices at 500 nodes: their size, and what they cost kube-scheduler's
DRA allocator, with core windows of 1 .. W cores published beside the device sets (issue 42).

Per configuration of core windows (none: device sets only, as before core claims), a fresh
control plane (etcd, kube-apiserver from tools/kube; KUBE_BIN=... for another version's) and the
chart's DRA objects (DeviceClasses neuron-1 .. 16 and neuroncore-1 .. 32); `--nodes` fake nodes
of the benchmarks' five types (bench/fleet.py TYPES: inf2.48xlarge, trn1.32xlarge, trn2.48xlarge,
inf1.24xlarge, inf2.24xlarge), each with the slices `neuron-scheduler dra-driver --core-windows
...` publishes (the driver's own publisher, run here for every node). Then kube-scheduler (the
cluster's default profile, as DRA pods get it) and:
- `--pods` pods, each with its own ResourceClaim: 70% a core claim of 1, 2 or 4 cores, 30% one
  device (where no window of its count is published, a core claim asks for the devices that hold
  its cores, neuron-1 or neuron-2, as DRA users had to); created before the scheduler starts,
  timed from the first binding to the
  last, as a watch on bound pods sees them;
- `--probes` pods whose claim fits no node (a 1-core or 1-device claim with a selector no device
  matches): every attempt walks every published device of every node, the allocator's worst
  case; its mean attempt time is read from kube-scheduler's metrics
  (`scheduler_scheduling_attempt_duration_seconds{result="unschedulable"}`) after
  `--probe-seconds`.
Reported per configuration: devices and slices per node and bytes of slice JSON (per type, and
for the fleet), kube-scheduler's and kube-apiserver's RSS once all is bound, pods bound per
second, kube-scheduler's CPU per pod and its mean attempt times (scheduled, unschedulable).

Run: uv run python bench/dra_scale.py [--nodes 500 --pods 20 --configs "none;1,2;1,2,4,8,16"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet import ROOT, TYPES, cpu_seconds, rss_mb
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.dra import DEFAULT_DRIVER_NAME
from neuron_scheduler.dra.devicegroups import pairing
from neuron_scheduler.dra.publisher import Owner, Publisher
from neuron_scheduler.dra.shapes import EVERY_CORE_WINDOW, core_window_counts
from neuron_scheduler.dra.slices import NodeInventory, pool_slices
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import load_kubeconfig
from tests.builders import PAUSE_IMAGE, node_json
from tests.e2e.chart import apply, render
from tests.testbed import ControlPlane, find_kubebin
from throughput import Bindings, families, machine, total

DRIVER = DEFAULT_DRIVER_NAME
RESOURCE = "/apis/resource.k8s.io/v1"
SYSTEM = "neuron-system"
NAMESPACE = "bench"
CATALOG = Catalog.builtin()
STALL_SECONDS = 900.0

Json = dict[str, Any]


@dataclass
class Outcome:
    core_windows: tuple[int, ...]
    per_type: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # slices, devices, B
    fleet_bytes: int = 0
    fleet_devices: int = 0
    publish_seconds: float = 0.0
    pods: int = 0
    bound: int = 0
    seconds: float = float("inf")
    scheduler_cpu: float = 0.0
    scheduler_rss: float = 0.0
    apiserver_rss: float = 0.0
    attempt_ms: dict[str, float] = field(default_factory=dict)  # result -> mean ms
    attempts: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.bound / self.seconds if self.bound and self.seconds > 0 else 0.0


def counts(text: str) -> tuple[int, ...]:
    """`1,2,4` or `1-4` or `none`: the counts of core windows published."""
    found: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            found.update(range(int(low), int(high) + 1))
        elif part.strip() not in ("", "0", "none"):
            found.add(int(part))
    return core_window_counts(found)


def label(core_windows: tuple[int, ...]) -> str:
    return format_ids(list(core_windows)) if core_windows else "none"


def inventory(name: str, instance_type: str, core_windows: tuple[int, ...]) -> NodeInventory:
    topology = CATALOG.resolve(instance_type).topology
    return NodeInventory(name, topology, pairing(instance_type), core_windows=core_windows)


def slice_bytes(inv: NodeInventory) -> tuple[int, int, int]:
    slices = pool_slices(DRIVER, inv)
    size = sum(
        len(json.dumps(s.spec(DRIVER, inv.node, 1, len(slices)), separators=(",", ":")))
        for s in slices
    )
    return len(slices), sum(len(s.devices) for s in slices), size


def create_nodes(cp: ControlPlane, nodes: int) -> list[tuple[str, str, str]]:
    """(name, uid, instance type) of each node created."""

    def one(i: int) -> tuple[str, str, str]:
        instance_type = TYPES[i % len(TYPES)][0]
        created = cp.request("POST", "/api/v1/nodes", node_json(f"node-{i:05d}", instance_type))
        return created["metadata"]["name"], created["metadata"]["uid"], instance_type

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, range(nodes)))


def publish_all(
    cp: ControlPlane, nodes: list[tuple[str, str, str]], core_windows: tuple[int, ...]
) -> None:
    async def run() -> None:
        async with KubeAPI(load_kubeconfig(cp.kubeconfig_path)) as api:
            gate = asyncio.Semaphore(8)

            async def one(name: str, uid: str, instance_type: str) -> None:
                async with gate:
                    await Publisher(api, DRIVER, Owner(name, uid)).publish(
                        inventory(name, instance_type, core_windows)
                    )

            await asyncio.gather(*(one(*node) for node in nodes))

    asyncio.run(run())


def claim_class(rng: random.Random, core_windows: tuple[int, ...]) -> str:
    if rng.random() < 0.3:
        return "neuron-1"
    cores = rng.choice([1, 2, 4])
    if cores in core_windows:
        return f"neuroncore-{cores}"
    return "neuron-1" if cores <= 2 else "neuron-2"


def claim_and_pod(name: str, device_class: str, selector: str | None) -> tuple[Json, Json]:
    exactly: Json = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": 1}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "neurons", "exactly": exactly}]}},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {"name": "c", "image": PAUSE_IMAGE, "resources": {"claims": [{"name": "neurons"}]}}
            ],
            "resourceClaims": [{"name": "neurons", "resourceClaimName": name}],
        },
    }
    return claim, pod


def create_workload(
    cp: ControlPlane, pods: int, probes: int, core_windows: tuple[int, ...]
) -> None:
    cp.client.ensure_namespace(NAMESPACE)
    rng = random.Random(42)
    bodies = [claim_and_pod(f"p{i:05d}", claim_class(rng, core_windows), None) for i in range(pods)]
    nowhere = f"device.attributes['{DRIVER}'].members == 'nowhere'"
    probe_class = "neuroncore-1" if 1 in core_windows else "neuron-1"
    bodies += [claim_and_pod(f"probe-{i}", probe_class, nowhere) for i in range(probes)]

    def create(pair: tuple[Json, Json]) -> None:
        claim, pod = pair
        cp.request("POST", f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims", claim)
        cp.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(create, bodies))


def attempt_figures(text: str) -> tuple[dict[str, float], dict[str, float]]:
    m = families(text)
    means, counts = {}, {}
    for result in ("scheduled", "unschedulable", "error"):
        count = total(m, "scheduler_scheduling_attempt_duration_seconds_count", result=result)
        if count:
            seconds = total(m, "scheduler_scheduling_attempt_duration_seconds_sum", result=result)
            means[result] = 1000 * seconds / count
            counts[result] = count
    return means, counts


def run(kubebin: Path, args: argparse.Namespace, core_windows: tuple[int, ...]) -> Outcome:
    outcome = Outcome(core_windows, pods=args.pods)
    for instance_type, *_ in TYPES:
        outcome.per_type[instance_type] = slice_bytes(
            inventory("ip-10-0-1-7.ec2.internal", instance_type, core_windows)
        )
    with ControlPlane(kubebin) as cp:
        cp.client.ensure_namespace(SYSTEM)
        classes = {"enabled": True, "coreWindows": list(EVERY_CORE_WINDOW)}
        values = {"dra": classes, "scheduler": {"enabled": False}}
        apply(cp, render({**values, "devicePlugin": {"enabled": False}}, namespace=SYSTEM))
        nodes = create_nodes(cp, args.nodes)
        began = time.monotonic()
        publish_all(cp, nodes, core_windows)
        outcome.publish_seconds = time.monotonic() - began
        for _, _, instance_type in nodes:
            _, devices, size = outcome.per_type[instance_type]
            outcome.fleet_bytes += size
            outcome.fleet_devices += devices
        create_workload(cp, args.pods, args.probes, core_windows)
        watch = Bindings(cp, NAMESPACE)
        watch.start()
        scheduler = cp.start_scheduler(scheduler_name="default-scheduler", extra_args=())
        pid = scheduler.process.pid or 0
        watch.wait(args.pods, STALL_SECONDS, label(core_windows))
        outcome.scheduler_cpu = cpu_seconds(pid)
        outcome.bound = watch.count
        watch.stop()
        if watch.times:
            outcome.seconds = max(watch.times[-1] - watch.times[0], 1e-9)
        time.sleep(args.probe_seconds)
        outcome.attempt_ms, outcome.attempts = attempt_figures(scheduler.metrics(cp.admin_token))
        outcome.scheduler_rss = rss_mb(pid)
        apiserver = next(p for p in cp.processes if p.name == "kube-apiserver")
        outcome.apiserver_rss = rss_mb(apiserver.pid or 0)
        scheduler.stop()
    return outcome


def report(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    print(f"\nmachine: {machine()}")
    print(f"{args.nodes} nodes ({', '.join(t for t, *_ in TYPES)} in turn), {args.pods} pods\n")
    print("| core windows | " + " | ".join(t for t, *_ in TYPES) + " |")
    print("|---|" + "---|" * len(TYPES))
    for o in outcomes:
        cells = [f"{d} devices, {s} slices, {b / 1024:.0f} KiB" for s, d, b in o.per_type.values()]
        print(f"| {label(o.core_windows)} | " + " | ".join(cells) + " |")
    print(
        "\n| core windows | devices | slice JSON | publish | kube-apiserver RSS "
        "| kube-scheduler RSS | bound | pods/s | scheduler CPU per pod "
        "| attempt, scheduled | attempt, fits nowhere |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        per_pod = 1000 * o.scheduler_cpu / o.bound if o.bound else float("nan")
        print(
            f"| {label(o.core_windows)} | {o.fleet_devices:,} | {o.fleet_bytes / 2**20:.0f} MiB "
            f"| {o.publish_seconds:.0f} s | {o.apiserver_rss:.0f} MB | {o.scheduler_rss:.0f} MB "
            f"| {o.bound}/{o.pods} | {o.rate:.1f} | {per_pod:.0f} ms "
            f"| {o.attempt_ms.get('scheduled', float('nan')):.1f} ms "
            f"| {o.attempt_ms.get('unschedulable', float('nan')):.0f} ms "
            f"({o.attempts.get('unschedulable', 0):.0f} attempts) |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--probes", type=int, default=2)
    parser.add_argument("--probe-seconds", type=float, default=30.0)
    parser.add_argument(
        "--configs",
        default="none;1,2;1-4;1,2,4,8,16",
        help="core windows per configuration, ';' between them: counts and ranges (1,2 or 1-4)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/dra_scale.json"))
    args = parser.parse_args()
    kubebin = find_kubebin(ROOT)
    outcomes = []
    for config in map(counts, args.configs.split(";")):
        outcome = run(kubebin, args, config)
        outcomes.append(outcome)
        print(f"{label(config)}: {outcome}", flush=True)
    report(outcomes, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1, default=str))
    # Every pod's claim fits (only the probes' fit nowhere): pods left unbound measured a broken
    # run, after its table.
    return 1 if any(o.bound < o.pods for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
