"""The scheduler configuration the testbed runs kube-scheduler with (nodes, pods: builders)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from neuron_scheduler.sim.kubescheduler import CHART, FitStrategy, Profile, scheduler_profile

if TYPE_CHECKING:
    from .pki import Pki


def scheduler_config(
    *,
    scheduler_name: str = "my-scheduler",
    extender_url: str | None = None,
    node_cache_capable: bool = False,
    preemption: bool = True,
    kubeconfig: str | None = None,
    pki: Pki | None = None,
    profile: Profile = CHART,
    dra_prioritize: bool = False,
) -> dict[str, Any]:
    """A KubeSchedulerConfiguration with one profile and, optionally, our extender.

    The profile's scoring is the chart's (sim/kubescheduler.py CHART) unless told otherwise,
    so the e2e suite schedules as a chart install does.

    Without kubeconfig the scheduler uses its in-cluster service account, which
    is what the Helm chart deploys; the testbed passes one. With `pki`, kube-scheduler calls
    the extender over HTTPS with my-scheduler's client certificate, as the chart sets it up.
    With `dra_prioritize`, the entries that score nodes for pods with our DRA claims, as the
    chart adds them with dra.enabled (the packing one with a packing profile, packNeuron).
    """
    config: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "profiles": [scheduler_profile(profile, scheduler_name)],
        # Refused pods are retried within a second (the default backs off up to 10 s): tests
        # and the sim-vs-real replay wait for kube-scheduler to settle, not for its back-off.
        "podInitialBackoffSeconds": 1,
        "podMaxBackoffSeconds": 1,
    }
    if kubeconfig is not None:
        config["clientConnection"] = {"kubeconfig": kubeconfig}
    if extender_url is not None:
        config["extenders"] = [
            {
                "urlPrefix": extender_url,
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "weight": profile.extender_weight,
                "bindVerb": "bind",
                "nodeCacheCapable": node_cache_capable,
                # A down extender must fail scheduling, not silently bypass it.
                "ignorable": False,
                # ignoredByScheduler false: the in-tree fit check still counts
                # these, so the extender only sees nodes with enough capacity.
                "managedResources": [
                    {"name": r, "ignoredByScheduler": False}
                    for r in (NEURON, NEURONCORE, NEURONDEVICE)
                ],
            }
        ]
        if not profile.extender_prioritizes:
            del config["extenders"][0]["prioritizeVerb"]
        if preemption:
            config["extenders"][0]["preemptVerb"] = "preempt"
        if dra_prioritize:
            entries = [("prioritize-claims", profile.extender_weight)]
            if profile.fit_strategy is FitStrategy.MOST_ALLOCATED:
                entries.append(("prioritize-claims-packing", 1))  # the chart's packNeuron
            config["extenders"] += [
                {
                    "urlPrefix": extender_url,
                    "prioritizeVerb": verb,
                    "weight": weight,
                    "nodeCacheCapable": node_cache_capable,
                    "ignorable": True,
                }
                for verb, weight in entries
            ]
        if pki is not None:
            for entry in config["extenders"]:
                entry["enableHTTPS"] = True
                entry["tlsConfig"] = {
                    "certFile": str(pki.client_cert),
                    "keyFile": str(pki.client_key),
                    "caFile": str(pki.ca),
                }
    return config
