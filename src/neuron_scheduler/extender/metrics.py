"""The extender's Prometheus metrics. Per-node gauges are computed at scrape time from the ledger,
not kept up to date on every change: free devices and the largest free block are what the
allocator would still give on the node's state (`core.allocation`), the state filter decides on,
cores held by pods of unknown ids included."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from neuron_scheduler.core.allocation import free_devices, largest_free_block
from neuron_scheduler.extender.state.ledger import Ledger


class Metrics:
    def __init__(self, ledger: Ledger) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "neuron_scheduler_request_seconds",
            "Time to answer kube-scheduler, by verb",
            ["verb"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.filter_outcomes = Counter(
            "neuron_scheduler_filter_nodes",
            "Nodes judged by filter, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.prioritize_from_filter = Counter(
            "neuron_scheduler_prioritize_from_filter",
            "prioritize calls answered from the filter just before (the same pod and nodes, no "
            "decision changed since): no node looked up again",
            registry=self.registry,
        )
        self.binds = Counter(
            "neuron_scheduler_binds",
            "Bind requests, by result",
            ["result"],
            registry=self.registry,
        )
        self.rollbacks = Counter(
            "neuron_scheduler_rollbacks",
            "Binds whose reservation and annotations were rolled back after an API error",
            registry=self.registry,
        )
        self.unsettled = Counter(
            "neuron_scheduler_unsettled_binds",
            "Failed binds whose Binding could still land when they gave up (the API kept "
            "failing): their devices stayed held until it could not",
            registry=self.registry,
        )
        self.watch_seconds = Histogram(
            "neuron_scheduler_watch_event_seconds",
            "Time to decode and apply one watch event, by resource: work the event loop does "
            "between requests",
            ["resource"],
            registry=self.registry,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
        )
        self.loop_lag = Histogram(
            "neuron_scheduler_loop_lag_seconds",
            "How late a timer ran on the extender's event loop (sampled 20 times a second; its "
            "resolution is about 1 ms): the wait a request arriving then has before its handler "
            "starts, while the loop finishes other work",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        self.bind_work = Histogram(
            "neuron_scheduler_bind_work_seconds",
            "Bind's own work under the node lock, excluding API round trips",
            registry=self.registry,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
        )
        self.preemptions = Counter(
            "neuron_scheduler_preemptions",
            "preempt calls from kube-scheduler",
            registry=self.registry,
        )
        self.preempt_nodes = Counter(
            "neuron_scheduler_preempt_nodes",
            "Candidate nodes of preempt calls, by outcome: kept (kube-scheduler's victims free a "
            "block), replaced (other victims do), dropped (no set of lower-priority pods helps)",
            ["outcome"],
            registry=self.registry,
        )
        self.preempt_victims = Counter(
            "neuron_scheduler_preempt_victims",
            "Victims named in preempt answers",
            registry=self.registry,
        )
        self.kueue_checks = Counter(
            "neuron_scheduler_kueue_checks",
            "The placement admission check's answers for Kueue workloads, by outcome: ready "
            "(placed, its blocks and units held), retry (no room now; Kueue gives the quota to "
            "the next workload), pending (not decided yet), expired (its pods did not bind in "
            "time: holds let go, Retry), released (evicted, finished or deleted while held)",
            ["outcome"],
            registry=self.registry,
        )
        self.job_preemptions = Counter(
            "neuron_scheduler_job_preemptions",
            "Preemptions for training jobs (whole jobs or nothing), by outcome: "
            "asked (the preempt verb recorded an ask for the job), impossible (the reservation "
            "loop found no units for it, even with every lower-priority job evicted), "
            "carried_out (its claim written, its victims evicted), "
            "failed (a claim write failed: undone, nobody evicted)",
            ["outcome"],
            registry=self.registry,
        )
        self.job_preemption_victims = Counter(
            "neuron_scheduler_job_preemption_victims",
            "Pods the extender evicted for training jobs' preemptions",
            registry=self.registry,
        )
        self.wakes = Counter(
            "neuron_scheduler_wakes",
            "Pending pods the extender refused and then woke (an annotation update kube-scheduler "
            "retries them on) because room freed for them, by why it freed and the write's "
            "result: woken, failed (left to kube-scheduler's flush), gone (pod deleted), off "
            "(--wake-rate 0: only logged)",
            ["cause", "result"],
            registry=self.registry,
        )
        self.failed_device_evictions = Counter(
            "neuron_scheduler_failed_device_evictions",
            "Evictions of pods running on a failed device (--device-failure-action evict), by "
            "result: evicted, refused (a disruption budget; asked again later), gone, failed",
            ["result"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "neuron_scheduler_waiting_pods",
            "Pending pods the extender refused everywhere, kept to wake when room frees",
            registry=self.registry,
        )
        self.registry.register(_NodeCollector(ledger))


class _NodeCollector(Collector):
    """Per-node free devices and largest free block, computed at scrape time (not per change)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        free = GaugeMetricFamily(
            "neuron_scheduler_node_free_devices",
            "Devices device requests could still get on the node: those with no core in use, less"
            " those the cores held by pods of unknown ids must take",
            labels=["node"],
        )
        block = GaugeMetricFamily(
            "neuron_scheduler_node_largest_free_block",
            "Most devices one request could still get on the node (what filter allows)",
            labels=["node"],
        )
        unhealthy = GaugeMetricFamily(
            "neuron_scheduler_node_unhealthy_devices",
            "Devices the node's device plugin reports failed: never placed on, neither free nor"
            " any pod's",
            labels=["node"],
        )
        on_failed = GaugeMetricFamily(
            "neuron_scheduler_pods_on_unhealthy_devices",
            "Pods whose devices include one their node reports failed (they run on without it)",
        )
        pods = GaugeMetricFamily(
            "neuron_scheduler_cached_pods", "Pods holding Neuron resources in the cache"
        )
        unusable = GaugeMetricFamily(
            "neuron_scheduler_unusable_nodes",
            "Nodes left out of placement because their Neuron capacity cannot be right",
            labels=["reason"],
        )
        rejected = CounterMetricFamily(
            "neuron_scheduler_rejected_assignments",
            "Pods whose annotated ids could not be theirs; counted by their request instead",
            labels=["reason"],
        )
        decisions = CounterMetricFamily(
            "neuron_scheduler_decisions",
            "Placement decisions filter and prioritize computed (the others came from those kept"
            " per request shape, until their node or the demand snapshot changes)",
        )
        snapshots = CounterMetricFamily(
            "neuron_scheduler_demand_snapshots",
            "Times the request-shape weights placement goes by were replaced (each drops the"
            " kept filter decisions)",
        )
        weights = GaugeMetricFamily(
            "neuron_scheduler_demand_weight",
            "Share of recent Neuron pods that asked for this shape, in 1/1024ths, as placement"
            " weighs it",
            labels=["unit", "count"],
        )
        for name, entry in list(self.ledger.nodes.items()):
            state = self.ledger.state(name)
            free.add_metric([name], free_devices(entry.topology, state))
            block.add_metric([name], largest_free_block(entry.topology, state))
            unhealthy.add_metric([name], entry.unhealthy_devices.bit_count())
        on_failed.add_metric([], sum(1 for _ in self.ledger.on_failed_devices()))
        pods.add_metric([], self.ledger.pod_count)
        for code, count in Tally(p.code for p in list(self.ledger.unusable.values())).items():
            unusable.add_metric([code], count)
        for code, count in self.ledger.rejected_assignments.items():
            rejected.add_metric([code], count)
        decisions.add_metric([], self.ledger.decisions)
        snapshots.add_metric([], self.ledger.demand.version)
        for unit, count, weight in self.ledger.demand.weights:
            weights.add_metric([unit.value, str(count)], weight)
        yield free
        yield block
        yield unhealthy
        yield on_failed
        yield pods
        yield unusable
        yield rejected
        yield decisions
        yield snapshots
        yield weights
