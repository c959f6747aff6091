"""Leader election against an in-memory Lease store with the API server's optimistic concurrency."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import pytest
from starlette.types import ASGIApp, Message

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.extender.http import build_apps
from neuron_scheduler.extender.wiring import wire
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import KubeConfig
from neuron_scheduler.kube.election import ElectionConfig, LeaderElector
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Lease


class FakeLeases:
    """One Lease; a replace needs the current resourceVersion (else 409), a create fails if it
    exists: the API server's optimistic concurrency. Leases are kept as JSON, as it keeps them."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.calls: list[str] = []
        self.timeouts, self.landed = 0, False
        self.garbled = False  # answers that are no Lease (a proxy's page, a cut-off body)

    def _call(self, verb: str) -> None:
        self.calls.append(verb)
        if self.down:
            raise OSError("connection refused")
        if self.garbled:
            raise msgspec.DecodeError("JSON is malformed: invalid character (byte 0)")

    def time_out(self, puts: int, landed: bool) -> None:
        """The next `puts` writes time out on the client; `landed`: each was stored all the same
        (a loaded API server finishing it after the client gave up)."""
        self.timeouts, self.landed = puts, landed

    async def get_lease(self, namespace: str, name: str) -> Lease:
        self._call("GET")
        assert (namespace, name) == ("ns", "lease")
        if self.lease is None:
            raise api_error("GET", name, 404, b'{"reason": "NotFound"}')
        snapshot = msgspec.convert(self.lease, Lease)
        await asyncio.sleep(0)  # let concurrent candidates read the same version
        return snapshot

    async def create_lease(self, lease: Lease) -> Lease:
        self._call("POST")
        if self.lease is not None:
            raise api_error("POST", lease.metadata.name, 409, b'{"reason": "AlreadyExists"}')
        return self._store(lease)

    async def replace_lease(self, lease: Lease) -> Lease:
        self._call("PUT")
        assert self.lease is not None
        if lease.metadata.resourceVersion != self.lease["metadata"]["resourceVersion"]:
            raise api_error("PUT", lease.metadata.name, 409, b'{"reason": "Conflict"}')
        if self.timeouts:
            self.timeouts -= 1
            if self.landed:
                self._store(lease)
            raise TimeoutError()
        return self._store(lease)

    def _store(self, lease: Lease) -> Lease:
        body = msgspec.to_builtins(lease)
        assert body["apiVersion"] == "coordination.k8s.io/v1" and body["kind"] == "Lease"
        assert (body["metadata"]["namespace"], body["metadata"]["name"]) == ("ns", "lease")
        self.version += 1
        self.lease = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": str(self.version)},
        }
        return msgspec.convert(self.lease, Lease)

    @property
    def holder(self) -> str | None:
        return None if self.lease is None else self.lease["spec"].get("holderIdentity")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(api: FakeLeases, clock: Clock, identity: str) -> LeaderElector:
    config = ElectionConfig("lease", "ns", identity, 15.0, 10.0, 2.0)
    return LeaderElector(api, config, clock=clock)


async def test_first_candidate_creates_the_lease_and_leads() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    await a.step()
    assert a.is_leader
    assert api.holder == "a"
    assert api.lease is not None
    spec = api.lease["spec"]
    assert spec["leaseDurationSeconds"] == 15
    assert spec["leaseTransitions"] == 0
    assert spec["renewTime"].endswith("Z") and "." in spec["renewTime"]


async def test_standby_waits_for_a_live_lease_then_takes_over_a_silent_one() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.step()
    await b.step()
    assert a.is_leader and not b.is_leader
    assert b.holder == "a"
    for _ in range(5):  # a keeps renewing: b never takes over, however long it waits
        clock.now += 5
        await a.step()
        await b.step()
        assert a.is_leader and not b.is_leader
    # a goes silent: b must wait a full lease duration from the last change it saw.
    clock.now += 14
    await b.step()
    assert not b.is_leader
    assert not a.is_leader  # 14 s since a's last renewal is past its 10 s renew deadline
    clock.now += 2
    await b.step()
    assert b.is_leader
    assert api.holder == "b"
    assert api.lease is not None and api.lease["spec"]["leaseTransitions"] == 1


@pytest.mark.parametrize("failure", ["down", "garbled"])
async def test_a_leader_that_cannot_renew_steps_down_before_the_lease_expires(failure: str) -> None:
    """`garbled`: answers that do not decode are failed rounds too, like an API server that is
    down (a raise out of step() ends the election task, which stops the extender: serve's
    stop_on_failure)."""
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    await a.step()
    setattr(api, failure, True)
    clock.now += 9
    await a.step()
    assert a.is_leader  # still within the renew deadline
    clock.now += 1.5
    assert not a.is_leader  # deadline passed: stops binding even before the next round
    await a.step()
    assert not a.is_leader
    setattr(api, failure, False)
    await a.step()
    assert a.is_leader  # nobody else took it: renewing our own lease resumes leadership


async def test_racing_candidates_only_one_wins_through_resource_version() -> None:
    api, clock = FakeLeases(), Clock()
    a, b, c = (elector(api, clock, name) for name in "abc")
    await a.step()
    await asyncio.gather(b.step(), c.step())
    clock.now += 20  # a is gone; b and c both read the same expired record, then both write
    await asyncio.gather(b.step(), c.step())
    assert [b.is_leader, c.is_leader].count(True) == 1
    assert api.holder in ("b", "c")
    assert api.lease is not None and api.lease["spec"]["leaseTransitions"] == 1
    assert api.calls.count("PUT") == 2  # both tried; the API server refused the stale one


async def test_release_hands_over_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.step()
    await b.step()
    await a.release()
    assert not a.is_leader
    assert api.holder == ""
    await b.step()  # no waiting for the lease duration: the holder is empty
    assert b.is_leader


@pytest.mark.parametrize("landed", [False, True])
async def test_a_release_that_timed_out_is_read_back_and_tried_again(
    landed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """On a loaded API server the release's write timed out on the client, and the standby waited
    out the whole lease (tests/e2e/test_election.py failed so)."""
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.step()
    await b.step()
    api.time_out(1, landed)
    caplog.set_level(logging.INFO, "neuron_scheduler")
    before = len(api.calls)
    await a.release()
    assert api.holder == ""
    # Landed: the read shows it released; else it is written again on what was read.
    assert api.calls[before:] == (["PUT", "GET"] if landed else ["PUT", "GET", "PUT"])
    assert "released Lease ns/lease" in caplog.text
    await b.step()
    assert b.is_leader


async def test_a_release_gives_up_after_its_attempts(caplog: pytest.LogCaptureFixture) -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    await a.step()
    api.time_out(5, landed=False)
    await a.release()
    assert not a.is_leader
    assert api.holder == "a"  # the lease runs out in its own time
    assert api.calls.count("PUT") == 3
    assert "gave up releasing Lease ns/lease" in caplog.text


async def test_release_without_leadership_writes_nothing() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.step()
    await b.step()
    calls = len(api.calls)
    await b.release()
    assert len(api.calls) == calls
    assert api.holder == "a"


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        ElectionConfig("lease", "ns", "a", 10.0, 10.0, 2.0)
    with pytest.raises(ValueError, match="identity"):
        ElectionConfig("lease", "ns", "", 15.0, 10.0, 2.0)


async def call(app: ASGIApp, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    """One request straight through the ASGI interface."""
    payload = b"" if body is None else msgspec.json.encode(body)
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-length", str(len(payload)).encode())],
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_non_leader_is_not_ready_and_refuses_bind(catalog: Catalog) -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.step()
    await b.step()
    extender = wire(KubeAPI(KubeConfig("http://127.0.0.1:9")), catalog)
    extender.synced.set()
    # PodUID missing: the extender's own bind answers 400, so reaching it is visible.
    bind = {"PodName": "p", "PodNamespace": "ns", "Node": "n"}

    standby, _ = build_apps(extender, elector=b)
    status, text = await call(standby, "GET", "/readyz")
    assert (status, text) == (503, b"not the leader (holder: a)\n")
    status, text = await call(standby, "POST", "/bind", bind)
    assert status == 200
    error = msgspec.json.decode(text)["Error"]
    assert "replica (b) is not the leader (Lease holder: a); not binding" in error

    leader, _ = build_apps(extender, elector=a)
    assert await call(leader, "GET", "/readyz") == (200, b"ok\n")
    status, text = await call(leader, "POST", "/bind", bind)
    assert status == 400 and b"bind needs PodName" in text

    # Without a synced cache even the leader is not ready.
    extender.synced.clear()
    assert (await call(leader, "GET", "/readyz"))[0] == 503
