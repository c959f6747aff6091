"""Two extender replicas against the real kube-apiserver, with the chart's leader-election RBAC:
one leader (ready, binds), one standby (not ready, refuses binds); the standby takes over when the
leader is killed, and at once when the leader shuts down cleanly and releases the Lease."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.chart import apply, chart_extender_process, extender_args, render
from tests.testbed import ControlPlane, ExtenderProcess

pytestmark = pytest.mark.e2e

PATIENCE = 60.0  # a safety net against hangs, never a performance bound
# Short timings so a takeover after a kill is quick; the chart's are 15/10/2 s.
TIMINGS = ["--lease-duration=3", "--renew-deadline=2", "--retry-period=0.25"]

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], what: str) -> T:
    deadline = time.monotonic() + PATIENCE
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def readyz(extender: ExtenderProcess) -> tuple[int, str]:
    """What kubelet's readiness probe sees (the metrics port)."""
    try:
        with urllib.request.urlopen(extender.metrics_url + "/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, str(error)


def bind_error(extender: ExtenderProcess) -> str:
    args = {"PodName": "absent", "PodNamespace": "default", "PodUID": "u", "Node": "n"}
    status, answer = extender.call("bind", args, timeout=5)
    assert status == 200, answer
    return str(answer["Error"])


class Replicas:
    def __init__(self, cp: ControlPlane, namespace: str, directory: Path) -> None:
        self.cp = cp
        self.namespace = namespace
        docs = render({"scheduler": {"replicas": 2}, "devicePlugin": {"enabled": False}}, namespace)
        # Not the chart's admission policies: they are cluster-wide, and on this shared control
        # plane they would hold the other tests' extender (another ServiceAccount) to this
        # release's (only this release's extender may write consolidation plans).
        apply(cp, [d for d in docs if not d["kind"].startswith("ValidatingAdmissionPolicy")])
        credentials = cp.service_account(namespace, "k8s-neuron-scheduler")
        assert "--leader-elect" in extender_args(docs)
        self.replicas = {
            name: chart_extender_process(
                cp,
                docs,
                directory,
                f"extender-{namespace}-{name}",
                credentials.kubeconfig_path,
                [
                    *TIMINGS,
                    f"--lease-namespace={namespace}",  # a pod gets it from POD_NAMESPACE
                    f"--lease-identity={name}",  # a pod's is its name (POD_NAME)
                ],
            )
            for name in ("replica-a", "replica-b")
        }

    def lease(self) -> dict[str, Any]:
        found: dict[str, Any] = self.cp.request(
            "GET",
            f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/k8s-neuron-scheduler",
        )
        return found

    def ready(self) -> list[str]:
        return [n for n, e in self.replicas.items() if readyz(e)[0] == 200]

    def one_leader(self) -> str:
        def single() -> str | None:
            ready = self.ready()
            return ready[0] if len(ready) == 1 else None

        leader = wait_for(single, "exactly one ready replica")
        assert self.lease()["spec"]["holderIdentity"] == leader
        return leader

    def stop(self) -> None:
        for extender in self.replicas.values():
            extender.process.stop()


@pytest.fixture
def replicas(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Replicas]:
    namespace = f"el-{uuid.uuid4().hex[:6]}"
    control_plane.client.ensure_namespace(namespace)
    r = Replicas(control_plane, namespace, tmp_path)
    for extender in r.replicas.values():
        extender.process.start()
    yield r
    r.stop()


def test_one_leader_the_standby_is_not_ready_and_takes_over(replicas: Replicas) -> None:
    leader = replicas.one_leader()
    standby = next(n for n in replicas.replicas if n != leader)
    # Until its first read of the Lease (its create may have lost the race) it names no holder.
    wait_for(
        lambda: readyz(replicas.replicas[standby]) == (503, f"not the leader (holder: {leader})\n"),
        "the standby to report the leader on /readyz",
    )
    assert "not the leader" in bind_error(replicas.replicas[standby])
    # The leader passes the election gate to the extender's own bind (the pod does not exist).
    assert "cannot read pod default/absent" in bind_error(replicas.replicas[leader])
    transitions = replicas.lease()["spec"].get("leaseTransitions", 0)

    # Killed without a chance to release: the standby waits out the lease, then takes over.
    replicas.replicas[leader].kill()
    assert replicas.one_leader() == standby
    assert replicas.lease()["spec"]["leaseTransitions"] == transitions + 1
    assert "became leader" in replicas.replicas[standby].process.log_path.read_text()

    # The old leader comes back as a standby and stays one.
    replicas.replicas[leader].process.start()
    wait_for(
        lambda: readyz(replicas.replicas[leader])[1].startswith("not the leader"),
        "the restarted replica to be a standby",
    )
    assert replicas.one_leader() == standby

    # A clean shutdown releases the Lease: the other replica takes over without waiting it out.
    # Time enough to shut down on a loaded machine (at 5 s it was once killed before releasing).
    replicas.replicas[standby].process.stop(timeout=60)
    assert replicas.lease()["spec"]["holderIdentity"] in ("", leader)
    assert "released Lease" in replicas.replicas[standby].process.log_path.read_text()
    assert replicas.one_leader() == leader
