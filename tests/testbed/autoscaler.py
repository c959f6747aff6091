"""Karpenter's kwok cloud provider and kwok on a testbed control plane: a real autoscaler that adds
fake Nodes (test tooling only, built by tools/autoscaler.mk).

- `karpenter-kwok` is Karpenter v1.15.0's kwok provider (its own main, plus the step that gives
  instance types the ResourceSliceTemplates of a JSON file: tools/autoscaler/karpenter-kwok). It
  makes the Node object of each NodeClaim itself; its capacity holds the NodeClaim's requests,
  its allocatable the instance type's figures (../shared/design/autoscaler-facts.md).
- kwok v0.8.0 keeps those Nodes Ready (lease heartbeats) and moves pods bound to them to Running,
  with the "fast" stages of its own module.

Instance types are written from our catalog: a type's devices and cores as the device plugin
advertises them (`aws.amazon.com/neuron`, `aws.amazon.com/neuroncore`), a price that grows with
the devices (so Karpenter's cheapest choice is the smallest type that fits), one zone.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from neuron_scheduler.core.catalog import Catalog

from .client import KubeError
from .controlplane import ControlPlane, find_built
from .process import ManagedProcess, free_ports
from .stack import install_crds

KARPENTER = "/apis/karpenter.sh/v1"
NODE_CLASSES = "/apis/karpenter.kwok.sh/v1alpha1/kwoknodeclasses"
NODE_CLASS = "default"
ZONE = "test-zone-a"
# Karpenter's kwok provider marks its Nodes so; kwok manages the Nodes that carry it.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
# kwok's own options block (its kustomize/kwok/kwok.yaml): a config file must set every
# parallelism option, or kwok refuses to start.
KWOK_OPTIONS: dict[str, Any] = {
    "enableCRDs": [],
    "enablePodsOnNodeSyncListPager": False,
    "enablePodsOnNodeSyncStreamWatch": True,
    "nodeLeaseParallelism": 4,
    "podPlayStageParallelism": 4,
    "nodePlayStageParallelism": 4,
    "podsOnNodeSyncParallelism": 4,
    "nodeLeaseDurationSeconds": 40,
    "manageAllNodes": False,
    "manageNodesWithAnnotationSelector": f"{KWOK_ANNOTATION}=fake",
    "cidr": "127.64.0.0/16",
}


def find_autoscaler_bin(repo_root: str | os.PathLike[str] | None = None) -> Path:
    """The directory tools/autoscaler.mk builds."""
    return find_built("AUTOSCALER_BIN_DIR", "autoscaler-bin", repo_root)


def instance_types(catalog: Catalog, names: Sequence[str]) -> list[dict[str, Any]]:
    """The kwok provider's instance-type entries for these catalog types."""
    entries = []
    for name in names:
        topology = catalog.resolve(name, catalog.device_count(name) or 16).topology
        entries.append(
            {
                "name": name,
                "architecture": "amd64",
                "operatingSystems": ["linux"],
                "resources": {
                    "cpu": "192",
                    "memory": "768Gi",
                    "pods": "110",
                    "aws.amazon.com/neuron": str(topology.devices),
                    "aws.amazon.com/neuroncore": str(topology.total_cores),
                },
                "offerings": [
                    {
                        "Price": float(topology.devices),
                        "Available": True,
                        "Requirements": [
                            {
                                "key": "karpenter.sh/capacity-type",
                                "operator": "In",
                                "values": ["on-demand"],
                            },
                            {
                                "key": "topology.kubernetes.io/zone",
                                "operator": "In",
                                "values": [ZONE],
                            },
                        ],
                    }
                ],
            }
        )
    return entries


class Karpenter:
    """kwok and Karpenter's kwok provider for one control plane, stopped by `stop()`."""

    def __init__(
        self,
        cp: ControlPlane,
        bin_dir: Path,
        types: Sequence[str],
        catalog: Catalog,
        *,
        templates: Path | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "karpenter",
    ) -> None:
        """`templates`: a JSON file of ResourceSliceTemplates per instance type (`neuron-scheduler
        dra slice-templates`); `env`: more of Karpenter's options (IGNORE_DRA_REQUESTS=false)."""
        self.cp = cp
        self.bin_dir = bin_dir
        self.workdir = cp.workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        types_file = self.workdir / "instance-types.json"
        types_file.write_text(json.dumps(instance_types(catalog, types), indent=1))
        metrics, health, node_port = free_ports(3)
        karpenter_env = {
            **os.environ,
            "KUBECONFIG": str(cp.kubeconfig_path),
            "DISABLE_LEADER_ELECTION": "true",
            "METRICS_PORT": str(metrics),
            "HEALTH_PROBE_PORT": str(health),
            "INSTANCE_TYPES_FILE_PATH": str(types_file),
            # Decide within a second or three of a pending pod (defaults 1 s idle, 10 s max).
            "BATCH_IDLE_DURATION": "1s",
            "BATCH_MAX_DURATION": "3s",
            "LOG_LEVEL": "debug",
            **(env or {}),
        }
        if templates is not None:
            karpenter_env["NEURON_SLICE_TEMPLATES"] = str(templates)
        for key in ("NO_PROXY", "no_proxy"):
            karpenter_env[key] = ",".join(filter(None, (karpenter_env.get(key), "127.0.0.1")))
        self.karpenter = ManagedProcess(
            name,
            [str(bin_dir / "karpenter-kwok")],
            cp.log_dir / f"{name}.log",
            env=karpenter_env,
            cwd=self.workdir,
        )
        config = self.workdir / "kwok.yaml"
        options = {**KWOK_OPTIONS, "nodePort": node_port}
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
                    "kind": "KwokConfiguration",
                    "options": options,
                }
            )
        )
        stages = sorted((bin_dir / "stages").glob("*.yaml"))
        self.kwok = ManagedProcess(
            f"{name}-kwok",
            [
                str(bin_dir / "kwok"),
                f"--kubeconfig={cp.kubeconfig_path}",
                f"--config={config}",
                *(f"--config={stage}" for stage in stages),
                f"--server-address=127.0.0.1:{free_ports(1)[0]}",
            ],
            cp.log_dir / f"{name}-kwok.log",
            env=dict(karpenter_env),
            cwd=self.workdir,
        )
        self.health_url = f"http://127.0.0.1:{health}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        folder = self.bin_dir / "crds"
        install_crds(
            self.cp, [yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))]
        )
        self._node_class()
        self.kwok.start()
        self.karpenter.start()
        deadline = time.monotonic() + timeout
        while not self._healthy():
            for process in (self.kwok, self.karpenter):
                if not process.alive():
                    raise RuntimeError(f"{process.name} exited:\n{process.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Karpenter not healthy:\n{self.karpenter.log_tail()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.karpenter.stop()
        self.kwok.stop()

    def logs(self) -> dict[str, Path]:
        return {"karpenter": self.karpenter.log_path, "kwok": self.kwok.log_path}

    # --- objects -------------------------------------------------------------------------------

    def _node_class(self) -> None:
        """The KWOKNodeClass NodePools name, Ready: nothing else sets its status, and a NodePool
        whose class is not Ready is ignored ("ignoring nodepool, not ready")."""
        with contextlib.suppress(KubeError):  # (there already: another test's)
            self.cp.request(
                "POST",
                NODE_CLASSES,
                {
                    "apiVersion": "karpenter.kwok.sh/v1alpha1",
                    "kind": "KWOKNodeClass",
                    "metadata": {"name": NODE_CLASS},
                    "spec": {},
                },
            )
        found = self.cp.request("GET", f"{NODE_CLASSES}/{NODE_CLASS}")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.cp.request(
            "PATCH",
            f"{NODE_CLASSES}/{NODE_CLASS}/status",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "Ready",
                            "message": "",
                            "lastTransitionTime": now,
                            "observedGeneration": found["metadata"].get("generation", 1),
                        }
                    ]
                }
            },
            content_type="application/merge-patch+json",
        )

    def node_pool(
        self,
        name: str,
        types: Sequence[str],
        *,
        labels: Mapping[str, str] | None = None,
        policy: str = "WhenEmptyOrUnderutilized",
        consolidate_after: str = "10s",
    ) -> dict[str, Any]:
        """A NodePool of these instance types whose Nodes carry `labels`; consolidation as given
        (Karpenter's default policy, after 10 s: quick, so a test sees it act)."""
        body = {
            "apiVersion": "karpenter.sh/v1",
            "kind": "NodePool",
            "metadata": {"name": name},
            "spec": {
                "template": {
                    "metadata": {"labels": dict(labels or {})},
                    "spec": {
                        "nodeClassRef": {
                            "group": "karpenter.kwok.sh",
                            "kind": "KWOKNodeClass",
                            "name": NODE_CLASS,
                        },
                        "requirements": [
                            {
                                "key": "node.kubernetes.io/instance-type",
                                "operator": "In",
                                "values": list(types),
                            },
                            {
                                "key": "karpenter.sh/capacity-type",
                                "operator": "In",
                                "values": ["on-demand"],
                            },
                        ],
                        "expireAfter": "Never",
                    },
                },
                "disruption": {
                    "consolidationPolicy": policy,
                    "consolidateAfter": consolidate_after,
                    "budgets": [{"nodes": "100%"}],
                },
            },
        }
        created: dict[str, Any] = self.cp.request("POST", f"{KARPENTER}/nodepools", body)
        return created

    def delete_node_pool(self, name: str) -> None:
        """The pool and its NodeClaims (the garbage collector that would delete them with their
        pool is kube-controller-manager's, which the testbed does not run); Karpenter then
        terminates their Nodes."""
        for claim in self.node_claims(name):
            with contextlib.suppress(KubeError):
                self.cp.request("DELETE", f"{KARPENTER}/nodeclaims/{claim['metadata']['name']}")
        with contextlib.suppress(KubeError):
            self.cp.request("DELETE", f"{KARPENTER}/nodepools/{name}")

    def consolidation_rounds(self) -> int:
        """How many times Karpenter's disruption controller has evaluated single-node
        consolidation of underutilized nodes (once a round, every 10 s: its metric counts
        each)."""
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=10) as answer:
            text = answer.read().decode()
        name = "karpenter_voluntary_disruption_decision_evaluation_duration_seconds_count"
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name)
                and 'reason="underutilized"' in line
                and 'consolidation_type="single"' in line
            )
        )

    def consolidatable(self, pool: str) -> bool:
        """Every NodeClaim of the pool is Consolidatable (its consolidateAfter has passed)."""
        claims = self.node_claims(pool)
        return bool(claims) and all(
            any(
                c["type"] == "Consolidatable" and c["status"] == "True"
                for c in claim.get("status", {}).get("conditions", [])
            )
            for claim in claims
        )

    def node_claims(self, pool: str | None = None) -> list[dict[str, Any]]:
        listed = self.cp.request("GET", f"{KARPENTER}/nodeclaims")
        claims = list(listed["items"])
        if pool is not None:
            claims = [
                c for c in claims if c["metadata"]["labels"].get("karpenter.sh/nodepool") == pool
            ]
        return claims

    def nodes(self, pool: str) -> list[dict[str, Any]]:
        listed = self.cp.request("GET", f"/api/v1/nodes?labelSelector=karpenter.sh/nodepool={pool}")
        return list(listed["items"])
