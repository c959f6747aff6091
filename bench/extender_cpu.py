"""The extender's own CPU per pod, in one process, with no control plane (issue 50).

bench/throughput.py measures what the whole stack does, and on a shared 2-vCPU machine its
rounds move by more than a tenth of a millisecond a pod; this replays the same work through the
extender alone, so that a cut of that size can be seen, and says where each pod's CPU goes.

The fleet and pods are throughput.py's (node i of type i % 5, pods 70% 1, 2 or 4 cores and 30%
one device, seed 36), the pods as the API server returns them (its defaults and status). The
extender is wired as `serve` wires it (`wire`, the pod router feeding every view) over
tests/podapi.FakeAPI, which answers bind's annotation patch and Binding at once. Every pod is
listed pending first, as a started extender lists them (with `--arriving`: none is, and every
pod's creation reaches the extender by the watch once it has started, as in throughput.py's runs,
where the pods are made after the extender started and so are not among what it froze out of the
garbage collector), then each in turn goes through what kube-scheduler and the API server make
the extender do:
- filter: the JSON body kube-scheduler sends (the pod, and `--window` node names, the next ones
  after the last window, as kube-scheduler's percentageOfNodesToScore asks 500 of 5,000),
  decoded by the verb's own decoder, judged, the answer encoded;
- prioritize: the same, for the nodes that passed (answered from what filter kept, as the verb
  does, when it can);
- bind: to the best-scored node (the first of equal ones), through the binder;
- watch: the pod watch's two events (annotations patched, pod bound), each decoded from JSON
  into a Pod and applied to every view (with `--arriving`, its creation event too).
Logging is on at INFO with the extender's format, into /dev/null: its lines cost what they cost.

With `--evict-mb N`, N MB are written over before each phase (not timed): live, kube-apiserver,
etcd and kube-scheduler run between the extender's calls and take the CPU caches, and each call
then finds the extender's data in memory, not in cache. At 32 (this machine's L3) the figures are
about three times the warm ones, as the live extender's profile is (BENCHMARKS.md).

Reported: process CPU per pod in each phase, the best of `--repeats` runs (each on a fresh
extender, with the pure core's caches emptied, its nodes and listed pods frozen out of the
garbage collector as `serve` freezes its first lists), decisions computed per pod, and how
much of it the garbage collector took.
`--profile FILE` writes a cProfile of one more run (pstats format) and prints its 25 largest
entries by own time.

Run: uv run python bench/extender_cpu.py [--nodes 5000 --pods 2000 --window 500 --repeats 3]
     [--evict-mb 32] [--arriving] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import logging
import pstats
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from fleet import TYPES, machine_line, neuron_pod
from neuron_scheduler.commandline import setup_logging
from neuron_scheduler.core import allocation, handoff, ids, topology
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.extender.state.placeholders import PodRouter
from neuron_scheduler.extender.verbs.wire import ExtenderArgs, ExtenderBindingArgs, HostPriority
from neuron_scheduler.extender.wiring import Extender, wire
from neuron_scheduler.kube.objects import Node, Pod
from tests.builders import node_json
from tests.podapi import FakeAPI

NAMESPACE = "bench"
SCHEDULER = "my-scheduler"
PHASES = ("filter", "prioritize", "bind", "watch")
# filter's and prioritize's request, as kube-scheduler's json.Marshal writes it (nodeCacheCapable).
REQUEST = b'{"Pod":%b,"Nodes":null,"NodeNames":%b}'


def pod_as_served(index: int, rng: random.Random, version: int) -> dict[str, Any]:
    """throughput.py's pod `index`, with what kube-apiserver adds before anyone reads it."""
    body = neuron_pod(f"p{index:05d}", NAMESPACE, SCHEDULER, rng)
    body["metadata"].update(
        uid=f"00000000-0000-4000-8000-{index:012d}",
        resourceVersion=str(version),
        creationTimestamp="2026-11-29T12:00:00Z",
    )
    (container,) = body["spec"]["containers"]
    container["resources"]["requests"] = dict(container["resources"]["limits"])
    container.update(
        terminationMessagePath="/dev/termination-log",
        terminationMessagePolicy="File",
        imagePullPolicy="IfNotPresent",
    )
    body["spec"].update(
        restartPolicy="Always",
        terminationGracePeriodSeconds=30,
        dnsPolicy="ClusterFirst",
        serviceAccountName="default",
        serviceAccount="default",
        securityContext={},
        priority=0,
        enableServiceLinks=True,
        preemptionPolicy="PreemptLowerPriority",
        tolerations=[
            {
                "key": f"node.kubernetes.io/{taint}",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }
            for taint in ("not-ready", "unreachable")
        ],
    )
    body["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    return body


class CollectorTime:
    """CPU the garbage collector takes while installed (its callbacks around each collection)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started
            self.collections[info["generation"]] += 1


@dataclass
class Run:
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    decisions: int = 0
    bound: int = 0
    refused: int = 0
    collector: CollectorTime | None = None


class Replay:
    """One fresh extender and the run's nodes and pods."""

    def __init__(
        self, nodes: int, pods: int, window: int, evict_mb: int = 0, arriving: bool = False
    ) -> None:
        self.api = FakeAPI()
        # Written over before each phase (untimed) when given: live, kube-apiserver, etcd and
        # kube-scheduler run between the extender's calls and take the CPU caches.
        self.evictor = bytearray(evict_mb << 20)
        self._fill = bytes(len(self.evictor))  # copied over it: no allocation per phase
        self.names = [f"node-{i:05d}" for i in range(nodes)]
        self.window = min(window, nodes)
        rng = random.Random(36)
        served = [pod_as_served(i, rng, next(self.api.version)) for i in range(pods)]
        for body in served:
            self.api.pods[body["metadata"]["name"]] = body
        self.pod_bodies = [msgspec.json.encode(body) for body in served]
        self.extender: Extender = wire(self.api, Catalog.builtin())  # type: ignore[arg-type]
        # Decoded from one list, as the node watch's list is (where objects lie in memory matters).
        listed = [node_json(name, TYPES[i % len(TYPES)][0]) for i, name in enumerate(self.names)]
        node_objects = msgspec.json.decode(msgspec.json.encode(listed), type=list[Node])
        for view in self.extender.views:
            view.replace_nodes(node_objects)
        self.router = PodRouter(self.extender.views, self.extender.placeholders)
        self.arriving = arriving
        listed = [] if arriving else self.pod_bodies
        self.router.replace_pods([msgspec.json.decode(b, type=Pod) for b in listed])
        self.extender.synced.set()
        self.args_decoder = msgspec.json.Decoder(ExtenderArgs)
        self.window_start = 0

    def _names(self) -> list[str]:
        start, count = self.window_start, len(self.names)
        self.window_start = (start + self.window) % count
        return [self.names[(start + k) % count] for k in range(self.window)]

    def evict(self) -> None:
        if self.evictor:
            self.evictor[:] = self._fill

    async def run(self) -> Run:
        judge, binder, router = self.extender.judge, self.extender.binder, self.router
        ledger = self.extender.ledger
        outcome = Run()
        before = ledger.decisions
        clock = time.process_time
        cpu = outcome.cpu
        evict = self.evict
        if self.arriving:  # their creations, as the watch brings them
            evict()
            start = clock()
            for pod_body in self.pod_bodies:
                router.apply_pod(msgspec.json.decode(pod_body, type=Pod))
            cpu["watch"] += clock() - start
        for pod_body in self.pod_bodies:
            names = self._names()
            body = REQUEST % (pod_body, msgspec.json.encode(names))
            evict()
            start = clock()
            result = judge.filter(self.args_decoder.decode(body), body)
            msgspec.json.encode(result)
            cpu["filter"] += clock() - start
            if not result.passed:
                outcome.refused += 1
                continue
            body = REQUEST % (pod_body, msgspec.json.encode(result.passed))
            evict()
            start = clock()
            answer = judge.answer_as_filtered(body)
            if answer is None:
                answer = msgspec.json.encode(judge.prioritize(self.args_decoder.decode(body), body))
            cpu["prioritize"] += clock() - start
            scores = msgspec.json.decode(answer, type=list[HostPriority])
            best = max(scores, key=lambda h: h.Score)
            pod = msgspec.json.decode(pod_body, type=Pod)
            meta = pod.metadata
            args = ExtenderBindingArgs(meta.name, meta.namespace, meta.uid, best.Host)
            evict()
            start = clock()
            error = await binder.bind(args)
            cpu["bind"] += clock() - start
            if error:
                raise SystemExit(f"bind of {meta.name} to {best.Host} refused: {error}")
            outcome.bound += 1
            events = [msgspec.json.encode(changed) for _, changed in self.api.events]
            self.api.events.clear()
            evict()
            start = clock()
            for event in events:
                router.apply_pod(msgspec.json.decode(event, type=Pod))
            cpu["watch"] += clock() - start
        outcome.decisions = ledger.decisions - before
        return outcome


def forget_decisions() -> None:
    """Empties the pure core's caches (the allocator's, the ids', the annotations' memo): each
    run starts as a fresh extender does. Kept from the run before, a run's decisions were mostly
    found there, and its figures left out what deciding a node's new state costs."""
    for module in (allocation, handoff, ids, topology):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()
    if hasattr(handoff, "_MEMO"):  # (older trees, run with PYTHONPATH for a before and after)
        handoff._MEMO.clear()


def measure(args: argparse.Namespace, profile: cProfile.Profile | None = None) -> Run:
    forget_decisions()
    replay = Replay(args.nodes, args.pods, args.window, args.evict_mb, args.arriving)
    # As `serve` does once its first lists are in: what they made lives as long as the process.
    gc.collect()
    gc.freeze()
    collector = CollectorTime()
    gc.callbacks.append(collector)
    try:
        if profile is not None:
            profile.enable()
        outcome = asyncio.run(replay.run())
    finally:
        if profile is not None:
            profile.disable()
        gc.callbacks.remove(collector)
        gc.unfreeze()
    outcome.collector = collector
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--window", type=int, default=500, help="node names per filter")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help="write over this many MB before each phase (untimed), as the control plane's "
        "processes take the CPU caches between the extender's calls live (0: warm caches)",
    )
    parser.add_argument(
        "--arriving",
        action="store_true",
        help="no pod is listed at the start: they arrive by the watch after the freeze, as the "
        "pods of a live run do",
    )
    parser.add_argument("--profile", type=Path, help="write a cProfile of one more run here")
    args = parser.parse_args()
    if min(args.nodes, args.pods, args.window, args.repeats) < 1:
        parser.error("--nodes, --pods, --window and --repeats must be at least 1")
    if args.evict_mb < 0:
        parser.error("--evict-mb must be 0 or more")
    print(f"machine: {machine_line()}")
    setup_logging("info")
    devnull = open("/dev/null", "w")  # noqa: SIM115 (the handler keeps it for the run)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(devnull)
    runs = [measure(args) for _ in range(args.repeats)]
    best = {phase: min(r.cpu[phase] for r in runs) for phase in PHASES}
    first = runs[0]
    if any(
        (r.bound, r.refused, r.decisions) != (first.bound, first.refused, first.decisions)
        for r in runs
    ):
        print("warning: the runs did not do the same work", file=sys.stderr)
    per_pod = 1000 / max(first.bound, 1)
    print(
        f"\n{args.nodes} nodes, {args.pods} pods ({first.bound} bound, {first.refused} refused "
        f"everywhere), {args.window} names a filter; best of {args.repeats}"
    )
    if args.evict_mb:
        print(f"CPU caches written over ({args.evict_mb} MB) before each phase, as live")
    if args.arriving:
        print("pods arriving by the watch after the extender started, as live")
    print("| phase | CPU ms per bound pod |")
    print("|---|---|")
    for phase in PHASES:
        print(f"| {phase} | {best[phase] * per_pod:.3f} |")
    print(f"| all | {sum(best.values()) * per_pod:.3f} |")
    print(f"decisions computed per pod: {first.decisions / max(args.pods, 1):.2f}")
    collected = [r.collector for r in runs if r.collector is not None]
    if collected:
        least = min(collected, key=lambda c: c.seconds)
        print(
            f"of it, the garbage collector: {least.seconds * per_pod:.3f} ms per pod "
            f"(collections by generation {', '.join(map(str, least.collections))}; least of runs)"
        )
    print(
        f"each run's total, ms per pod: "
        f"{', '.join(f'{sum(r.cpu.values()) * per_pod:.3f}' for r in runs)}"
    )
    if args.profile:
        profile = cProfile.Profile()
        measure(args, profile)
        profile.dump_stats(str(args.profile))
        print(f"\nprofile of one more run: {args.profile}; by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
