"""Scheduling throughput through the real kube-scheduler: without an extender, with the null
extender, and with ours, in one run (issues 4 and 36).

One control plane (etcd, kube-apiserver v1.36.3 from tools/kube) and one set of fake Neuron nodes
(inf1, inf2, trn1, trn2). Each configuration in turn gets the same nodes and its own pods (70%
asking for 1, 2 or 4 cores, 30% for one device), created before its kube-scheduler starts; it is
timed from the first binding to the last, as a watch on bound pods sees them. Then its scheduler
(and extender) stop and its pods are deleted, so the next one finds the cluster as it was.
- `without`: kube-scheduler with the chart's profile and no extender (extended-resource counting);
- `null`: the same kube-scheduler configuration as ours (verbs, nodeCacheCapable, weight, HTTPS
  with client certificates) calling bench/nullextender.py, which does no work: every node passes,
  scores are constant, bind is one Binding. The floor any extender pays;
- `ours`: the extender, run as the chart runs it.
ours / null is what we own; null / without is what the extender protocol costs kube-scheduler.
More configurations below (CONFIGS): `null-writes`, the null extender making our bind's API calls
with our annotation keys, is the floor ours is measured against (issue 50); `null-watch` the
same with our list and watch of the pods, the floor of an extender that keeps its devices' state
from the API (what is left between it and ours is our extender's own work). Every configuration
runs under the chart's admission policies on pod writes, as the chart installs them; one named
with `-no-policies` (e.g. `null-writes-no-policies`) runs with them lifted, which prices them.
A configuration that does not bind all its pods fails the run (exit status 1) after its table.

Only the configuration being timed runs: our extender is started for its turn (it lists the
nodes, then watches its pods being created) and stopped after it, so it never competes for the
CPU with the others. Per configuration the run reports each component's CPU per pod, the
machine's idle share, how long each component waited for a CPU per pod (runnable but not running:
the machine's contention), kube-scheduler's own figures per scheduling attempt (its metrics
`scheduler_scheduling_attempt_duration_seconds`, `scheduler_scheduling_algorithm_duration_seconds`
and `scheduler_framework_extension_point_duration_seconds`: the extenders' filter and prioritize
round trips are the algorithm's time its framework plugins do not account for), each extender's
time in its handlers per pod (the null extender's too), ours' watch, decisions and event loop,
kube-apiserver's requests per pod, and its reads of other kinds a second (informers, leases, and
any loop of ours that reads the API). `--profile DIR` records each extender with py-spy (a dev
dependency) into DIR while it is timed, for bench/profile_summary.py.

Run: uv run python bench/throughput.py [--nodes 500 --pods 2000] [--configs without,null,ours]
     [--rounds N] [--full-node-list] [--profile DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fleet import (
    ROOT,
    TYPES,
    cpu_seconds,
    cpu_ticks,
    machine_line,
    neuron_pod,
    rss_mb,
    run_delay_seconds,
)
from neuron_scheduler.sim.kubescheduler import PROFILES
from tests.builders import node_json
from tests.testbed import ControlPlane, ExtenderProcess, Stack, find_kubebin
from tests.testbed.client import KubeClient, KubeError, opener, ssl_context
from tests.testbed.kubeversion import binary_version
from tests.testbed.manifests import scheduler_config
from tests.testbed.process import ManagedProcess, free_port

# The null extender binding with our bind's API calls (null-writes), or with those of a bind of
# one write (null-one-write), or with our writes and our watch on pods (null-watch: the floor of
# an extender that learns from the API which devices are taken): not run unless asked for
# (bench/nullextender.py).
# baseline: our extender from another source tree (--baseline-src), e.g. the code before a change.
# null-writes-twin: null-writes again, the same code as a configuration of its own: the ratio of the
# two in a round is what this machine cannot tell apart (an A/A measure of the run's resolution).
# null-h2, null-writes-h2, null-watch-h2, ours-h2: serving HTTP/2 too (zttp, a dev dependency;
# bench/h2serve.py): kube-scheduler then sends every call over one connection.
# without-qps: without, its client allowed 1,000 requests a second rather than kube-scheduler's
# default 50 (its binds go through that limit; an extender's do not).
CONFIGS = (
    "without",
    "without-qps",
    "null",
    "ours",
    "null-writes",
    "null-writes-twin",
    "null-watch",
    "null-one-write",
    "null-h2",
    "null-writes-h2",
    "null-watch-h2",
    "ours-h2",
    "baseline",
)
DEFAULT_CONFIGS = ("without", "null", "ours")
# Any configuration but `without`, run with the chart's admission policies on pod writes lifted
# (Stack.enforce_policies): null-writes-no-policies against null-writes prices their evaluation.
NO_POLICIES = "-no-policies"
SCHEDULER = "my-scheduler"
# kube-scheduler's framework extension points inside its scheduling algorithm (schedulePod); the
# rest of the algorithm's time is the extenders' filter and prioritize calls.
ALGORITHM_POINTS = ("PreFilter", "Filter", "PreScore", "Score")
STALL_SECONDS = 180.0  # no new binding for this long: the run is reported as it stands


def create_nodes(cp: ControlPlane, nodes: int) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda i: cp.request(
                    "POST", "/api/v1/nodes", node_json(f"node-{i:05d}", TYPES[i % len(TYPES)][0])
                ),
                range(nodes),
            )
        )


def create_pods(cp: ControlPlane, namespace: str, pods: int) -> None:
    """The same pods for every configuration (one seed), in a namespace of its own."""
    cp.client.ensure_namespace(namespace)
    rng = random.Random(36)
    bodies = [neuron_pod(f"p{i:05d}", namespace, SCHEDULER, rng) for i in range(pods)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda b: cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", b), bodies
            )
        )


def delete_pods(cp: ControlPlane, namespace: str) -> None:
    """Every pod of the namespace, at once (no kubelet confirms termination), and waits until
    none is left. kube-apiserver ends a request after a minute, and deleting 20,000 pods takes
    longer: the deletion is asked again until nothing is left."""
    path = f"/api/v1/namespaces/{namespace}/pods"
    client = KubeClient(cp.server_url, cp.admin_token, cafile=cp.ca_path, timeout=120)
    while cp.request("GET", path + "?limit=1")["items"]:
        try:
            client.delete(path)
        except (OSError, KubeError) as error:  # timed out or cut off: what it deleted stays so
            print(f"deleting the pods of {namespace}: {error}; asking again")
            time.sleep(5)


class Bindings(threading.Thread):
    """When each pod of a namespace was first seen bound: a watch on bound pods (one event per
    pod, where listing 20,000 pods every quarter second would load the API server itself)."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        super().__init__(daemon=True)
        query = "watch=1&fieldSelector=spec.nodeName%21%3D&timeoutSeconds=7200"
        self.path = f"/api/v1/namespaces/{namespace}/pods?{query}"
        self.headers = {"Authorization": f"Bearer {cp.admin_token}"}
        url = urllib.parse.urlsplit(cp.server_url)
        # A connection of our own, opened here: stop() shuts its socket down from another thread.
        self.connection = http.client.HTTPSConnection(
            url.hostname or "127.0.0.1", url.port, context=ssl_context(cp.ca_path)
        )
        self.seen: set[str] = set()
        self.times: list[float] = []
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def stop(self) -> None:
        """End the watch: left open, it stays on the API server, which then sends every later
        run in the namespace's events to it too (the next round's figures paid for it)."""
        self.stopping.set()
        if self.connection.sock is not None:
            with contextlib.suppress(OSError):
                self.connection.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read
        self.join(10)
        self.connection.close()

    def run(self) -> None:
        try:
            self.connection.connect()
            if self.stopping.is_set():
                return
            self.connection.request("GET", self.path, headers=self.headers)
            with self.connection.getresponse() as stream:
                if stream.status != 200:
                    raise RuntimeError(f"watch: HTTP {stream.status}: {stream.read(2000)!r}")
                for line in stream:
                    event = json.loads(line)
                    uid = event["object"]["metadata"].get("uid", "")
                    if event["type"] in ("ADDED", "MODIFIED") and uid not in self.seen:
                        self.seen.add(uid)
                        self.times.append(time.monotonic())
        except BaseException as error:  # reported by the caller
            if not self.stopping.is_set():
                self.error = error

    @property
    def count(self) -> int:
        return len(self.times)

    def wait(self, pods: int, stall_seconds: float, name: str) -> None:
        """Until `pods` are bound, the watch fails, or none is bound for `stall_seconds` (then
        the run is reported as it stands, and says so)."""
        last_count, last_change = 0, time.monotonic()
        while self.count < pods and self.error is None:
            time.sleep(0.25)
            if self.count != last_count:
                last_count, last_change = self.count, time.monotonic()
            elif time.monotonic() - last_change > stall_seconds:
                print(f"{name}: no binding for {stall_seconds:.0f} s; reporting what is bound")
                return


class Polling(Bindings):
    """The way this benchmark counted bindings before issue 36, for comparison: the namespace's
    pods listed every `every` seconds (each list of 20,000 pods is tens of MB of JSON the API
    server makes while the scheduler runs)."""

    def __init__(self, cp: ControlPlane, namespace: str, every: float) -> None:
        super().__init__(cp, namespace)
        self.cp, self.namespace, self.every = cp, namespace, every

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                items = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")
                now = time.monotonic()
                for pod in items["items"]:
                    uid = pod["metadata"]["uid"]
                    if pod["spec"].get("nodeName") and uid not in self.seen:
                        self.seen.add(uid)
                        self.times.append(now)
                time.sleep(self.every)
        except BaseException as error:  # reported by the caller
            self.error = error


@dataclass
class Outcome:
    name: str
    pods: int
    bound: int = 0
    seconds: float = float("inf")
    cpu: dict[str, float] = field(default_factory=dict)  # component -> CPU seconds
    # component -> seconds its threads waited, runnable, for a CPU (the machine's contention)
    waits: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0  # share of the machine's CPU time in use during the run
    steal: float = 0.0  # share of it the hypervisor gave to other VMs
    scheduler: dict[str, float] = field(default_factory=dict)  # its metrics, per attempt
    extender: dict[str, float] = field(default_factory=dict)  # handler ms per pod, and ours: more
    rss: float = 0.0
    connections: int = 0  # TCP connections opened on the machine during the run
    # kube-apiserver's requests (verb, resource) and watch events sent (kind), per pod bound
    api: dict[str, float] = field(default_factory=dict)
    api_seconds: float = 0.0  # the span `api` was counted over (from before kube-scheduler starts)

    @property
    def rate(self) -> float:
        return self.bound / self.seconds if self.bound and self.seconds > 0 else 0.0


Samples = dict[str, list[tuple[dict[str, str], float]]]


def families(text: str) -> Samples:
    """A /metrics page as name -> [(labels, value)] over every sample."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    return sum(
        value
        for got, value in samples.get(name, [])
        if all(got.get(key) == want for key, want in labels.items())
    )


def scheduler_figures(text: str) -> dict[str, float]:
    """kube-scheduler's own times, ms per scheduling attempt (mean), from its /metrics."""
    m = families(text)
    attempts = total(m, "scheduler_scheduling_attempt_duration_seconds_count")
    if not attempts:
        return {}
    per = 1000 / attempts
    figures = {
        "attempts": attempts,
        "attempt": per * total(m, "scheduler_scheduling_attempt_duration_seconds_sum"),
        "algorithm": per * total(m, "scheduler_scheduling_algorithm_duration_seconds_sum"),
    }
    point = "scheduler_framework_extension_point_duration_seconds_sum"
    for name in (*ALGORITHM_POINTS, "Reserve", "Permit", "PreBind", "Bind"):
        figures[name] = per * total(m, point, extension_point=name)
    figures["extenders"] = figures["algorithm"] - sum(figures[p] for p in ALGORITHM_POINTS)
    return figures


def extender_figures(before: str, after: str, pods: int) -> dict[str, float]:
    """Our extender during the timed run (the difference of two /metrics pages): time in its
    handlers, decoding and applying watch events, and waiting for its event loop, in ms per pod;
    decisions computed per pod; prioritize calls answered from filter's, per pod; demand
    snapshots taken."""
    m0, m1 = families(before), families(after)

    def delta(name: str, **labels: str) -> float:
        return total(m1, name, **labels) - total(m0, name, **labels)

    figures: dict[str, float] = {}
    for verb in ("filter", "prioritize", "bind", "preempt"):
        figures[f"{verb} calls"] = delta("neuron_scheduler_request_seconds_count", verb=verb) / pods
        figures[verb] = 1000 * delta("neuron_scheduler_request_seconds_sum", verb=verb) / pods
    figures["bind work"] = 1000 * delta("neuron_scheduler_bind_work_seconds_sum") / pods
    figures["watch"] = 1000 * delta("neuron_scheduler_watch_event_seconds_sum") / pods
    figures["watch events"] = delta("neuron_scheduler_watch_event_seconds_count") / pods
    samples = delta("neuron_scheduler_loop_lag_seconds_count")
    figures["loop lag"] = 1000 * delta("neuron_scheduler_loop_lag_seconds_sum") / max(samples, 1)
    figures["decisions"] = delta("neuron_scheduler_decisions_total") / pods
    figures["from filter"] = delta("neuron_scheduler_prioritize_from_filter_total") / pods
    figures["demand snapshots"] = delta("neuron_scheduler_demand_snapshots_total")
    # The null extender times its verbs only (bench/nullextender.py).
    figures["ours"] = float("neuron_scheduler_bind_work_seconds_sum" in m1)
    return figures


WAITING = ("kube-scheduler", "kube-apiserver", "etcd", "extender")  # the run-queue line's order
STEADY = "steady "  # apiserver_figures' prefix of reads that do not come with each pod


def apiserver_figures(cp: ControlPlane) -> dict[str, float]:
    """kube-apiserver's counts so far: requests by verb and resource (subresource), watch
    events sent by kind, and their bytes (`watch bytes`)."""
    request = urllib.request.Request(
        f"{cp.server_url}/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"}
    )
    with opener(cp.ca_path).open(request, timeout=30) as answer:
        m = families(answer.read().decode())
    figures: dict[str, float] = {}
    for labels, value in m.get("apiserver_request_total", []):
        resource = labels.get("resource", "") + (
            f"/{labels['subresource']}" if labels.get("subresource") else ""
        )
        key = f"{labels.get('verb')} {resource}"
        if labels.get("verb") in ("WATCH", "LIST", "GET") and labels.get("resource") != "pods":
            key = STEADY + key  # informers' and leases' steady traffic, not per pod
        figures[key] = figures.get(key, 0.0) + value
    for labels, value in m.get("apiserver_watch_events_total", []):
        key = f"watch {labels.get('kind') or labels.get('resource', '?')}"
        figures[key] = figures.get(key, 0.0) + value
    figures["watch bytes"] = total(m, "apiserver_watch_events_sizes_sum")
    return figures


class NullExtender:
    """bench/nullextender.py as a process, served with the stack's PKI."""

    def __init__(
        self,
        cp: ControlPlane,
        stack: Stack,
        writes: str = "binding",
        http2: bool = False,
        watch_pods: bool = False,
        twin: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.context = stack.pki.client_context()
        pki = stack.pki
        self.process = ManagedProcess(
            "null-extender",
            [
                sys.executable,
                str(ROOT / "bench" / "nullextender.py"),
                *("--kubeconfig", str(stack.extender_kubeconfig), "--port", str(self.port)),
                *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)),
                *("--client-ca", str(pki.ca), "--bind-writes", writes),
                *(["--http2"] if http2 else []),
                *(["--watch-pods"] if watch_pods else []),
            ],
            cp.log_dir
            / f"null-extender-{writes}{'-h2' if http2 else ''}{'-watch' if watch_pods else ''}"
            f"{'-twin' if twin else ''}.log",
        )

    def start(self) -> None:
        self.process.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    self.url + "/readyz", timeout=2, context=self.context
                ) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"null extender not ready:\n{self.process.log_tail()}")

    def stop(self) -> None:
        self.process.stop()

    def pid(self) -> int | None:
        return self.process.pid

    def metrics(self) -> str:
        """Its verbs' time, as ours' /metrics counts it (bench/nullextender.py)."""
        url = self.url + "/metrics"
        with urllib.request.urlopen(url, timeout=10, context=self.context) as page:
            return str(page.read().decode())


class Profiler:
    """A sampling profiler recording one process while it is timed.
    - cpu: bench/cpuprofile.py, which the extender was started under (`under_cpu_profiler`):
      Python stacks by CPU time (collapsed, for bench/profile_summary.py);
    - perf: CPU time by native function and library (TLS, the interpreter, msgspec, the kernel);
    - py-spy: Python stacks by wall clock; it counts a thread waiting for a CPU as busy, so on a
      saturated machine read its shares with care (most of it lands on writes that woke a peer).
    """

    def __init__(self, kind: str, pid: int, output: Path) -> None:
        self.kind, self.pid, self.output = kind, pid, output
        self.process: subprocess.Popen[bytes] | None = None
        if kind == "cpu":
            os.kill(pid, signal.SIGUSR1)  # counts from here
            return
        if kind == "perf":
            argv = ["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", f"{output}.perf"]
        else:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            options = ["--rate", "200", "--format", "raw", "--nonblocking", "--output", str(output)]
            argv = [spy, "record", "--pid", str(pid), *options]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.process is None:
            self.output.unlink(missing_ok=True)
            os.kill(self.pid, signal.SIGUSR2)  # writes what it counted
            # Its handler runs when the interpreter next gets the CPU: an idle extender's event
            # loop may sleep in epoll for seconds first (at 5,000 nodes one second was too short).
            deadline = time.monotonic() + 30
            while not self.output.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)  # (written in one call; let it finish)
            return
        self.process.send_signal(signal.SIGINT)
        self.process.wait(60)


def under_cpu_profiler(process: ManagedProcess, output: Path) -> None:
    """Starts a Python process under bench/cpuprofile.py from now on."""
    python, *rest = process.argv
    process.argv = [python, str(ROOT / "bench" / "cpuprofile.py"), str(output), *rest]


@dataclass
class Contender:
    """An extender process, started for its configuration's turn only."""

    start: Callable[[], None]
    stop: Callable[[], None]
    pid: Callable[[], int | None]
    metrics: Callable[[], str] | None = None  # ours: its /metrics page


def settle(pid: int, idle: float = 0.05) -> None:
    """Waits until the process uses less than `idle` of a core over a second (the extender's
    watch has caught up with the pods just created), two minutes at most."""
    deadline = time.monotonic() + 120
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(1)
        now = cpu_seconds(pid)
        if now - before < idle:
            return
        before = now


def run(
    cp: ControlPlane,
    name: str,
    pods: int,
    config: dict[str, Any],
    extender: Contender | None,
    profile: Path | None,
    profiler: str = "py-spy",
    poll: float = 0.0,
    stall_seconds: float = STALL_SECONDS,
) -> Outcome:
    """One configuration: (extender up,) pods created, scheduler started and timed, all stopped
    and its pods deleted."""
    namespace = f"bench-{name}"
    outcome = Outcome(name, pods)
    if extender is not None:
        extender.start()
    create_pods(cp, namespace, pods)
    ext_pid = extender.pid() if extender is not None else None
    if ext_pid is not None:
        settle(ext_pid)
    watch = Polling(cp, namespace, poll) if poll else Bindings(cp, namespace)
    watch.start()
    components = {p.name: p.pid for p in cp.processes if p.pid is not None and p.alive()}
    if ext_pid is not None:
        components["extender"] = ext_pid
    components["bench"] = os.getpid()
    # (read before the counts start: its connection and CPU are not the run's)
    metrics_before = extender.metrics() if extender is not None and extender.metrics else ""
    cpu0 = {component: cpu_seconds(pid) for component, pid in components.items()}
    wait0 = {component: run_delay_seconds(pid) for component, pid in components.items()}
    steal0, ticks0 = cpu_ticks()
    idle0 = _idle_ticks()
    opens0 = tcp_opens()
    api_before = apiserver_figures(cp)
    api_since = time.monotonic()
    recording = None
    if profile is not None and ext_pid is not None:
        recording = Profiler(profiler, ext_pid, profile / f"{name}.txt")
    scheduler = cp.start_scheduler(config=config)
    components["kube-scheduler"] = scheduler.process.pid or 0
    cpu0["kube-scheduler"] = wait0["kube-scheduler"] = 0.0  # all of its CPU is this run's
    watch.wait(pods, stall_seconds, name)
    if recording is not None:
        recording.stop()
    outcome.cpu = {c: cpu_seconds(pid) - cpu0[c] for c, pid in components.items()}
    outcome.waits = {c: run_delay_seconds(pid) - wait0[c] for c, pid in components.items()}
    steal1, ticks1 = cpu_ticks()
    elapsed = max(ticks1 - ticks0, 1)
    outcome.busy = 1 - (_idle_ticks() - idle0) / elapsed
    outcome.steal = (steal1 - steal0) / elapsed
    outcome.connections = tcp_opens() - opens0
    outcome.bound = watch.count
    watch.stop()
    if watch.times:
        outcome.seconds = max(watch.times[-1] - watch.times[0], 1e-9)
    outcome.scheduler = scheduler_figures(scheduler.metrics(cp.admin_token))
    outcome.api_seconds = time.monotonic() - api_since
    api_after = apiserver_figures(cp)
    per = 1 / max(outcome.bound, 1)
    outcome.api = {
        key: (value - api_before.get(key, 0.0)) * per
        for key, value in api_after.items()
        if value - api_before.get(key, 0.0) > 0
    }
    if extender is not None and extender.metrics is not None and ext_pid is not None:
        outcome.extender = extender_figures(metrics_before, extender.metrics(), outcome.bound or 1)
        outcome.rss = rss_mb(ext_pid)
    scheduler.stop()
    if extender is not None:
        extender.stop()
    if watch.error is not None:
        raise RuntimeError(f"{name}: the watch on bound pods failed: {watch.error}")
    return outcome


def tcp_opens() -> int:
    """TCP connections accepted on the machine so far (/proc/net/snmp PassiveOpens): on loopback,
    each is a new connection, and each to a TLS server a full handshake."""
    lines = Path("/proc/net/snmp").read_text().splitlines()
    header, values = [line.split() for line in lines if line.startswith("Tcp:")]
    return int(values[header.index("PassiveOpens")])


def _idle_ticks() -> int:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4]  # idle + iowait


def machine() -> str:
    return f"{machine_line()}, Kubernetes {binary_version(find_kubebin(ROOT))}"


def report(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    mode = "false" if args.full_node_list else "true"
    w = max([9, *(len(o.name) for o in outcomes)])  # the names' column
    print(
        f"\n{args.nodes} nodes, {args.pods} Neuron pods per configuration, nodeCacheCapable {mode}"
    )
    print(
        f"{'':{w}} {'bound':>6} {'seconds':>8} {'pods/s':>7} | CPU ms per pod: {'scheduler':>9} "
        f"{'apiserver':>9} {'etcd':>6} {'extender':>8} {'all':>6} | busy  steal  conns/pod"
    )
    for o in outcomes:
        per = 1000 / max(o.bound, 1)
        cpu = {k: v * per for k, v in o.cpu.items()}
        print(
            f"{o.name:{w}} {o.bound:6d} {o.seconds:8.1f} {o.rate:7.1f} | {'':15} "
            f"{cpu.get('kube-scheduler', 0):9.2f} {cpu.get('kube-apiserver', 0):9.2f} "
            f"{cpu.get('etcd', 0):6.2f} {cpu.get('extender', 0):8.2f} {sum(cpu.values()):6.2f} "
            f"| {100 * o.busy:3.0f}%  {100 * o.steal:4.1f}%  {o.connections / max(o.bound, 1):6.2f}"
        )
    print("\nwaiting for a CPU (runnable, not running), ms per pod, by component:")
    for o in outcomes:
        per = 1000 / max(o.bound, 1)
        waits = {k: v * per for k, v in o.waits.items()}
        print(
            f"{o.name:{w}} "
            + ", ".join(f"{c} {waits.get(c, 0):.2f}" for c in WAITING)
            + f"; all {sum(waits.values()):.2f}"
        )
    print("\nkube-scheduler, ms per scheduling attempt (its metrics):")
    print(
        f"{'':{w}} {'attempts':>8} {'attempt':>8} {'algorithm':>9} "
        + " ".join(f"{p:>9}" for p in ALGORITHM_POINTS)
        + f" {'extenders':>9}"
    )
    for o in outcomes:
        s = o.scheduler
        if s:
            print(
                f"{o.name:{w}} {s['attempts']:8.0f} {s['attempt']:8.2f} {s['algorithm']:9.2f} "
                + " ".join(f"{s[p]:9.2f}" for p in ALGORITHM_POINTS)
                + f" {s['extenders']:9.2f}"
            )
    for o in outcomes:
        if not o.extender:
            continue
        e = o.extender
        verbs = ", ".join(
            f"{verb} {e[verb]:.2f} ({e[verb + ' calls']:.2f} calls)"
            for verb in ("filter", "prioritize", "bind")
        )
        if not e["ours"]:
            print(f"\n{o.name}, ms per pod in its handlers: {verbs}")
            continue
        work, kept = e["bind work"], e["from filter"]
        print(
            f"\n{o.name}, ms per pod in its handlers: {verbs}; bind's own work {work:.3f}; "
            f"prioritize answered from filter's {kept:.2f} a pod"
        )
        print(
            f"{o.name}, watch events {e['watch']:.2f} ms per pod ({e['watch events']:.1f} events); "
            f"event loop lag {e['loop lag']:.2f} ms on average; {e['decisions']:.1f} decisions "
            f"computed per pod; {e['demand snapshots']:.0f} demand snapshots; RSS {o.rss:.0f} MB"
        )
    print("\nkube-apiserver, per pod bound: requests by verb and resource, watch events sent:")
    for o in outcomes:
        shown = sorted(
            ((v, k) for k, v in o.api.items() if k != "watch bytes" and not k.startswith(STEADY)),
            reverse=True,
        )
        text = ", ".join(f"{key} {value:.2f}" for value, key in shown if value >= 0.005)
        print(f"{o.name:{w}} {text}; watch {o.api.get('watch bytes', 0) / 1024:.1f} KiB")
    # (a WATCH is counted when it ends: a watch opened during the run and still open is not)
    print("kube-apiserver, reads of other kinds a second (informers, leases, loops):")
    for o in outcomes:
        per_second = max(o.bound, 1) / max(o.api_seconds, 1e-9)  # (api holds counts per pod)
        steady = sorted(
            ((v * per_second, k[len(STEADY) :]) for k, v in o.api.items() if k.startswith(STEADY)),
            reverse=True,
        )
        text = ", ".join(f"{key} {value:.2f}" for value, key in steady if value >= 0.005)
        print(f"{o.name:{w}} {text or 'none'}")
    rates = {o.name: o.rate for o in outcomes}
    print()
    if rates.get("null") and rates.get("ours"):
        print(
            f"ours / null    = {rates['ours'] / rates['null']:.2f}  (what we own; target >= 0.95)"
        )
    if rates.get("without") and rates.get("null"):
        print(f"null / without = {rates['null'] / rates['without']:.2f}  (what the protocol costs)")
    if rates.get("without-qps") and rates.get("null"):
        print(f"null / without-qps = {rates['null'] / rates['without-qps']:.2f}")
    if rates.get("without") and rates.get("ours"):
        print(f"ours / without = {rates['ours'] / rates['without']:.2f}  (issue 4's ratio)")
    if rates.get("null-watch") and rates.get("null-writes"):
        print(
            f"null-watch / null-writes = {rates['null-watch'] / rates['null-writes']:.2f}  "
            "(what watching the pods costs any extender)"
        )
    if rates.get("null-writes-twin") and rates.get("null-writes"):
        print(
            f"null-writes-twin / null-writes = "
            f"{rates['null-writes-twin'] / rates['null-writes']:.2f}  (the same code twice)"
        )
    for name in ("null-writes", "null-watch", "null-one-write", "null-h2", "ours-h2", "baseline"):
        if rates.get(name) and rates.get("null"):
            print(f"{name} / null = {rates[name] / rates['null']:.2f}")
        if rates.get(name) and rates.get("ours"):
            print(f"ours / {name} = {rates['ours'] / rates[name]:.2f}")
    if rates.get("ours-h2") and rates.get("null-h2"):
        print(f"ours-h2 / null-h2 = {rates['ours-h2'] / rates['null-h2']:.2f}")
    by_name = {o.name: o for o in outcomes}
    for lifted in by_name:
        checked = by_name.get(lifted.removesuffix(NO_POLICIES))
        if not lifted.endswith(NO_POLICIES) or checked is None or not rates.get(lifted):
            continue
        lifted_run = by_name[lifted]

        def per_pod(o: Outcome, component: str) -> float:
            return 1000 * o.cpu.get(component, 0) / max(o.bound, 1)

        apiserver, ext = (
            per_pod(checked, c) - per_pod(lifted_run, c) for c in ("kube-apiserver", "extender")
        )
        print(
            f"{checked.name} / {lifted} = {rates[checked.name] / rates[lifted]:.2f}  (the "
            f"pod-write policies: kube-apiserver {apiserver:+.2f} ms CPU per pod, "
            f"extender {ext:+.2f})"
        )
    short = [f"{o.name} {o.bound} of {o.pods}" for o in outcomes if o.bound < o.pods]
    if short:
        print(f"NOT EVERY POD BOUND: {', '.join(short)}")


# The pairs a sitting's summary compares (contender, floor), when both ran.
PAIRS = (
    ("ours", "null-writes"),
    ("ours", "null-watch"),
    ("null-watch", "null-writes"),
    ("null-writes-twin", "null-writes"),
    ("ours-h2", "null-writes-h2"),
    ("ours-h2", "null-writes"),
    ("ours-h2", "ours"),
    ("null-writes-h2", "null-writes"),
    ("ours", "null"),
    ("baseline", "ours"),
)
COMPONENTS = ("kube-scheduler", "kube-apiserver", "etcd", "extender")


def summary(rounds: list[list[Outcome]]) -> None:
    """Over the rounds of a sitting: each pair's ratio of mean rates, the ratio its mean CPU a pod
    predicts (the machine is CPU-bound: rate ~ CPU / CPU a pod), and where the difference in CPU
    goes, component by component. A round's ratio moves with the machine's speed from one run to
    the next (every component of a run costs more or less together); means over rounds that
    alternate the order are what a difference of a few percent can be read from."""
    by_name: dict[str, list[Outcome]] = {}
    for outcomes in rounds:
        for o in outcomes:
            if o.bound:
                by_name.setdefault(o.name, []).append(o)

    def per_pod(runs: list[Outcome], component: str | None = None) -> float:
        """Mean over the runs of ms of CPU a pod, one component's or all of them."""
        return sum(
            1000 * (o.cpu.get(component, 0.0) if component else sum(o.cpu.values())) / o.bound
            for o in runs
        ) / len(runs)

    lines = []
    for contender, floor in PAIRS:
        a, b = by_name.get(contender), by_name.get(floor)
        if not a or not b:
            continue
        rate = (sum(o.rate for o in a) / len(a)) / (sum(o.rate for o in b) / len(b))
        predicted = per_pod(b) / per_pod(a)
        deltas = ", ".join(
            f"{c} {per_pod(a, c) - per_pod(b, c):+.2f}" for c in COMPONENTS if c != "kube-scheduler"
        )
        scheduler = per_pod(a, "kube-scheduler") - per_pod(b, "kube-scheduler")
        # Each round's own ratio, where both ran in it: a target "in every run" is read here.
        each = [
            run.rate / other.rate
            for outcomes in rounds
            for run in outcomes
            for other in outcomes
            if run.name == contender and other.name == floor and run.bound and other.bound
        ]
        by_round = " / ".join(f"{r:.3f}" for r in each)
        lines.append(
            f"{contender} / {floor}: {rate:.2f} by mean pods/s, {predicted:.2f} by mean CPU a pod; "
            f"{contender} - {floor}, ms CPU a pod: kube-scheduler {scheduler:+.2f}, {deltas} "
            f"({len(a)} and {len(b)} runs); by round {by_round or '-'}"
            + (f", lowest {min(each):.3f}" if each else "")
        )
    if lines:
        print(f"\n=== over {len(rounds)} rounds")
        for line in lines:
            print(line)


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"in this order, of {', '.join(CONFIGS)}",
    )
    parser.add_argument(
        "--full-node-list", action="store_true", help="extenders with nodeCacheCapable: false"
    )
    parser.add_argument("--profile", type=Path, help="record each extender with py-spy here")
    parser.add_argument(
        "--scoring",
        choices=sorted(PROFILES),
        default="chart",
        help="kube-scheduler's profile (sim/kubescheduler.py); filter-only: no prioritize verb",
    )
    parser.add_argument(
        "--percentage-of-nodes-to-score",
        type=int,
        default=0,
        help="the profile's percentageOfNodesToScore (0: kube-scheduler's adaptive default)",
    )
    parser.add_argument("--profiler", choices=("cpu", "perf", "py-spy"), default="cpu")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="configuration baseline: our extender with neuron_scheduler from this directory "
        "(e.g. `git archive ea36366 src | tar -x -C /tmp/old`, then /tmp/old/src)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=0.0,
        help="count bindings by listing the pods every POLL seconds, as this benchmark did "
        "before issue 36 (0: a watch)",
    )
    parser.add_argument("--workdir", type=Path, help="keep the control plane's logs here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration in turn, this many times over (interleaved: on a shared "
        "machine each configuration then sees the same neighbours), on one control plane",
    )
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="run every other round in the reverse order, so that no configuration always "
        "runs first or last in a round",
    )
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=STALL_SECONDS,
        help="no new binding for this long: the configuration is reported as it stands",
    )
    args = parser.parse_args()
    configs = args.configs.split(",")
    bases = {name.removesuffix(NO_POLICIES) for name in configs}
    if unknown := bases - set(CONFIGS):
        parser.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    if any(n.startswith("without") and n.endswith(NO_POLICIES) for n in configs):
        parser.error(f"{NO_POLICIES} is for configurations with an extender")
    if "baseline" in bases and not args.baseline_src:
        parser.error("configuration baseline needs --baseline-src")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    rounds: list[list[Outcome]] = []
    with ControlPlane(find_kubebin(ROOT), args.workdir) as cp:
        create_nodes(cp, args.nodes)
        stack = Stack(cp)
        stack.extender.process.stop()  # started for its own turn only
        nulls = {
            "null": NullExtender(cp, stack),
            "null-writes": NullExtender(cp, stack, "ours"),
            "null-writes-twin": NullExtender(cp, stack, "ours", twin=True),
            "null-watch": NullExtender(cp, stack, "ours", watch_pods=True),
            "null-one-write": NullExtender(cp, stack, "one-write"),
            "null-h2": NullExtender(cp, stack, http2=True),
            "null-writes-h2": NullExtender(cp, stack, "ours", http2=True),
            "null-watch-h2": NullExtender(cp, stack, "ours", http2=True, watch_pods=True),
        }
        ours = {"ours": stack.extender}
        if "ours-h2" in bases:
            h2 = ExtenderProcess(cp, stack.extender_kubeconfig, name="extender-h2", pki=stack.pki)
            python, *rest = h2.process.argv
            h2.process.argv = [python, str(ROOT / "bench" / "h2serve.py"), *rest]
            ours["ours-h2"] = h2
        if args.baseline_src:
            baseline = ExtenderProcess(
                cp, stack.extender_kubeconfig, name="extender-baseline", pki=stack.pki
            )
            baseline.process.env = {**os.environ, "PYTHONPATH": str(args.baseline_src.resolve())}
            ours["baseline"] = baseline
        if args.profile and args.profiler == "cpu":
            for name, process in ours.items():
                under_cpu_profiler(process.process, args.profile / f"{name}.txt")
            for name, null in nulls.items():
                under_cpu_profiler(null.process, args.profile / f"{name}.txt")
        node_cache_capable = not args.full_node_list
        profile = replace(
            PROFILES[args.scoring], percentage_of_nodes_to_score=args.percentage_of_nodes_to_score
        )
        turns = []  # (whether it starts a round, configuration)
        for number in range(args.rounds):
            ordered = configs[::-1] if args.alternate and number % 2 else configs
            turns += [(i == 0, name) for i, name in enumerate(ordered)]
        for starts, name in turns:
            if starts:
                rounds.append([])
                if args.rounds > 1:
                    print(f"\n=== round {len(rounds)} of {args.rounds}")
            lifted = name.endswith(NO_POLICIES)
            base = name.removesuffix(NO_POLICIES)
            if base.startswith("without"):
                config = scheduler_config(scheduler_name=SCHEDULER, profile=profile)
                if name == "without-qps":
                    config["clientConnection"] = {"qps": 1000, "burst": 2000}
                extender = None
            else:
                null = nulls.get(base)
                url = null.url if null is not None else ours[base].url
                config = scheduler_config(
                    scheduler_name=SCHEDULER,
                    extender_url=url,
                    node_cache_capable=node_cache_capable,
                    pki=stack.pki,
                    profile=profile,
                )
                if null is not None:
                    extender = Contender(null.start, null.stop, null.pid, null.metrics)
                else:
                    process = ours[base]
                    pid = lambda managed=process.process: managed.pid  # noqa: E731
                    extender = Contender(process.start, process.process.stop, pid, process.metrics)
            if lifted:
                stack.enforce_policies(False)
            outcome = run(
                cp,
                name,
                args.pods,
                config,
                extender,
                args.profile,
                args.profiler,
                args.poll,
                args.stall_seconds,
            )
            if lifted:
                stack.enforce_policies(True)
            rounds[-1].append(outcome)
            report([outcome], args)  # at once: the run may not get to its end
            delete_pods(cp, f"bench-{name}")
        for number, outcomes in enumerate(rounds, 1):
            print(f"\n=== all configurations{f', round {number}' if args.rounds > 1 else ''}")
            report(outcomes, args)
        if len(rounds) > 1:
            summary(rounds)
        stack.stop()
    # A configuration that did not bind every pod measured something else (a refused write, a
    # broken extender): the table is printed, and the run fails.
    return 1 if any(o.bound < o.pods for outcomes in rounds for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
