"""What republishing a DRA node's device order costs (issue 42, "device order, measured").

A driver that kept first fit equal to best fit as its node fills would publish its devices in a
new order after every allocation and release on the node. Any change of order is a new pool
generation: every slice of the pool written again (the old ones deleted), and until the last is
written the pool is incomplete and kube-scheduler allocates nothing from it. This measures that,
with the driver's own publisher against a real kube-apiserver (tools/kube v1.36.3): per node
type, `--rounds` republishes alternating between our order and the same devices with one class's
order reversed (what a best-fit reorder does to the class a claim just took from), timed from
the first write to the last (the window the node is unusable), with the API writes each takes.

Run: uv run python bench/dra_republish.py [--rounds 10] [--core-windows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import replace

from dra_scale import DRIVER, counts, create_nodes, inventory, label
from fleet import ROOT
from neuron_scheduler.dra import DEFAULT_CORE_WINDOWS
from neuron_scheduler.dra import publisher as publishing
from neuron_scheduler.dra.publisher import Owner, Publisher
from neuron_scheduler.dra.slices import NodeInventory, SliceContent, pool_slices
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import load_kubeconfig
from tests.testbed import ControlPlane, find_kubebin
from throughput import machine

TYPES = ("inf2.48xlarge", "trn1.32xlarge", "trn2.48xlarge")


def reordered(driver: str, inv: NodeInventory) -> list[SliceContent]:
    """Our slices with the 1-core windows' order reversed (the class a best-fit reorder would
    change after a 1-core claim took its first window)."""
    slices = pool_slices(driver, inv)
    devices = [d for s in slices for d in s.devices]
    ones = [i for i, d in enumerate(devices) if d["name"].startswith("cores-1-at-")]
    for i, j in zip(ones, reversed(ones), strict=True):
        if i >= j:
            break
        devices[i], devices[j] = devices[j], devices[i]
    out, start = [], 0
    for content in slices:
        if content.devices:
            count = len(content.devices)
            out.append(replace(content, devices=tuple(devices[start : start + count])))
            start += count
        else:
            out.append(content)
    return out


async def measure(cp: ControlPlane, rounds: int, core_windows: tuple[int, ...]) -> None:
    nodes = create_nodes(cp, len(TYPES))
    print(f"machine: {machine()}\ncore windows of {label(core_windows)} cores, {rounds} rounds\n")
    print("| node | slices | devices | republish, mean (max) | API writes per republish |")
    print("|---|---|---|---|---|")
    async with KubeAPI(load_kubeconfig(cp.kubeconfig_path)) as api:
        for (name, uid, _), instance_type in zip(nodes, TYPES, strict=True):
            inv = inventory(name, instance_type, core_windows)
            publisher = Publisher(api, DRIVER, Owner(name, uid))
            await publisher.publish(inv)
            seconds, writes = [], []
            ours = pool_slices(DRIVER, inv)
            other = reordered(DRIVER, inv)
            for round_ in range(rounds):
                content = other if round_ % 2 == 0 else ours
                publishing.pool_slices = lambda driver, _inv, c=content: list(c)  # type: ignore[assignment]
                before = publisher.writes
                began = time.perf_counter()
                await publisher.publish(inv)
                seconds.append(time.perf_counter() - began)
                writes.append(publisher.writes - before)
            publishing.pool_slices = pool_slices
            devices = sum(len(c.devices) for c in ours)
            print(
                f"| {instance_type} | {len(ours)} | {devices} "
                f"| {1000 * statistics.fmean(seconds):.0f} ms ({1000 * max(seconds):.0f} ms) "
                f"| {statistics.fmean(writes):.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--core-windows", default=",".join(map(str, DEFAULT_CORE_WINDOWS)))
    args = parser.parse_args()
    with ControlPlane(find_kubebin(ROOT)) as cp:
        asyncio.run(measure(cp, args.rounds, counts(args.core_windows)))


if __name__ == "__main__":
    sys.exit(main())
