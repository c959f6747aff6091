"""Leader election over a coordination.k8s.io/v1 Lease, so only one extender replica binds.

The same protocol as client-go's leaderelection package, in small: every `retry_period` each
candidate reads the Lease; the holder renews it, the others take it over once it has not changed
for `lease_duration` (measured on the local monotonic clock from when *we* saw it change, so clock
skew between replicas does not matter). Writes carry the resourceVersion they read, so of two
candidates racing for an expired Lease the API server lets exactly one win (the other gets 409).

A leader that cannot renew within `renew_deadline` stops calling itself leader before its Lease
can expire for the others (renew_deadline < lease_duration), so two replicas never both bind.
On shutdown the leader releases the Lease (empty holder) and a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, NotFound
from neuron_scheduler.kube.objects import Lease, LeaseMeta, LeaseSpec

log = logging.getLogger("neuron_scheduler.kube.election")


class LeaseStore(Protocol):
    """What the elector needs from KubeAPI: one Lease, read and written with optimistic
    concurrency (a write with a stale resourceVersion, or a create of an existing Lease, is a
    Conflict)."""

    async def get_lease(self, namespace: str, name: str) -> Lease: ...

    async def create_lease(self, lease: Lease) -> Lease: ...

    async def replace_lease(self, lease: Lease) -> Lease: ...


def default_identity() -> str:
    """POD_NAME (downward API) when in a pod, else host name plus a random suffix, so two
    processes on one machine never share an identity."""
    pod = os.environ.get("POD_NAME")
    if pod:
        return pod
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ElectionConfig:
    name: str = "k8s-neuron-scheduler"
    namespace: str = "kube-system"
    identity: str = ""
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("leader election needs an identity")
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period:g} < {self.renew_deadline:g} < {self.lease_duration:g}"
            )


def micro_time(now: datetime | None = None) -> str:
    """A Kubernetes MicroTime: RFC 3339 with microseconds, in UTC."""
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


RELEASE_ATTEMPTS = 3  # writes of the released Lease at most, each after reading it back


class LeaderElector:
    """Holds or watches one Lease. `is_leader` is what readiness and bind consult."""

    def __init__(
        self,
        api: LeaseStore,
        config: ElectionConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self.on_change = on_change
        self.holder = ""  # who holds the Lease, as last read
        self._observed: Lease | None = None
        self._observed_at = 0.0  # local clock when the observed record last changed
        self._renewed_at: float | None = None  # local clock of our last successful write
        self._leading = False
        self._stopped = asyncio.Event()

    @property
    def lease_name(self) -> str:
        return f"{self.config.namespace}/{self.config.name}"

    @property
    def is_leader(self) -> bool:
        """True only while our last renewal is younger than the renew deadline."""
        return (
            self._leading
            and self._renewed_at is not None
            and self.clock() - self._renewed_at < self.config.renew_deadline
        )

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        if leading:
            log.info(
                "became leader: holding Lease %s/%s as %s",
                self.config.namespace,
                self.config.name,
                self.config.identity,
            )
        else:
            log.warning(
                "lost leadership of Lease %s/%s (holder now %s): no longer ready, binds refused",
                self.config.namespace,
                self.config.name,
                loggable(repr(self.holder)),
            )
        if self.on_change is not None:
            self.on_change(leading)

    def _record(self, holder: str, transitions: int, acquire: str | None) -> LeaseSpec:
        now = micro_time()
        return LeaseSpec(
            holderIdentity=holder,
            leaseDurationSeconds=max(1, round(self.config.lease_duration)),
            acquireTime=acquire or now,
            renewTime=now,
            leaseTransitions=transitions,
        )

    async def _read(self) -> Lease | None:
        try:
            return await self.api.get_lease(self.config.namespace, self.config.name)
        except NotFound:
            return None

    def _observe(self, lease: Lease) -> None:
        old = self._observed
        if old is None or old.spec != lease.spec:
            self._observed_at = self.clock()
        self._observed = lease
        self.holder = lease.spec.holderIdentity or ""

    async def try_acquire_or_renew(self) -> bool:
        """One round: create, renew or take over the Lease if we may. True if we hold it now."""
        me = self.config.identity
        lease = await self._read()
        if lease is None:
            body = Lease(
                metadata=LeaseMeta(name=self.config.name, namespace=self.config.namespace),
                spec=self._record(me, 0, None),
            )
            return await self._write(self.api.create_lease, body)
        self._observe(lease)
        spec = lease.spec
        holder = spec.holderIdentity or ""
        if holder and holder != me:
            duration = float(spec.leaseDurationSeconds or self.config.lease_duration)
            if self.clock() - self._observed_at < duration:
                return False  # someone else holds a live lease
        transitions = spec.leaseTransitions or 0
        if holder == me:
            body = Lease(metadata=lease.metadata, spec=self._record(me, transitions, None))
            body.spec.acquireTime = spec.acquireTime or body.spec.acquireTime
        else:
            body = Lease(metadata=lease.metadata, spec=self._record(me, transitions + 1, None))
        return await self._write(self.api.replace_lease, body)

    async def _write(self, write: Callable[[Lease], Awaitable[Lease]], body: Lease) -> bool:
        # The lease runs from when we asked, not from when the answer came back: a slow answer
        # must not stretch our leadership past the moment a standby may take over.
        asked_at = self.clock()
        try:
            lease = await write(body)
        except Conflict:  # another candidate wrote first; read again next round
            return False
        self._observe(lease)
        self._renewed_at = asked_at
        return True

    async def step(self) -> None:
        """One round, with errors logged and leadership dropped when the deadline passes."""
        try:
            held = await self.try_acquire_or_renew()
        except READ_ERRORS as error:  # (an answer that is no Lease, from a proxy say, too)
            log.warning(
                "leader election: cannot reach Lease %s: %s", self.lease_name, loggable(error)
            )
            held = False
        if held:
            self._set_leading(True)
        elif self._leading and not self.is_leader:
            self._set_leading(False)
        elif self._leading and self.holder and self.holder != self.config.identity:
            self._set_leading(False)  # someone else took it (we must have been too slow)

    async def run(self) -> None:
        """Until cancelled: a round every retry period."""
        log.info(
            "leader election on: Lease %s/%s, identity %s",
            self.config.namespace,
            self.config.name,
            self.config.identity,
        )
        while True:
            await self.step()
            await asyncio.sleep(self.config.retry_period)

    async def release(self) -> None:
        """Give the Lease up (empty holder, 1 s duration) if we hold it, so a standby takes over
        at once instead of waiting out the lease duration. A write that fails is tried again on
        the Lease as read back (`RELEASE_ATTEMPTS` in all): on a loaded API server one timed out
        on the client while it still landed, or not, and the standby then waited out the lease."""
        if not self._leading or self._observed is None:
            return
        self._set_leading(False)
        lease: Lease | None = self._observed
        for attempt in range(1, RELEASE_ATTEMPTS + 1):
            if lease is not None:
                if lease.spec.holderIdentity != self.config.identity:
                    if self.holder:  # taken over meanwhile: nothing of ours to give up
                        log.info(
                            "Lease %s is held by %s now", self.lease_name, loggable(self.holder)
                        )
                    else:  # a write that timed out landed after all
                        log.info("released Lease %s", self.lease_name)
                    return
                try:
                    await self.api.replace_lease(self._released(lease))
                    log.info("released Lease %s", self.lease_name)
                    return
                except READ_ERRORS as error:
                    log.warning(
                        "could not release Lease %s (attempt %d of %d): %s",
                        self.lease_name,
                        attempt,
                        RELEASE_ATTEMPTS,
                        loggable(error),
                    )
            if attempt == RELEASE_ATTEMPTS:
                break
            try:
                lease = await self.api.get_lease(self.config.namespace, self.config.name)
                self.holder = lease.spec.holderIdentity or ""
            except READ_ERRORS as error:
                log.warning("could not read Lease %s: %s", self.lease_name, loggable(error))
                lease = None
        log.warning(
            "gave up releasing Lease %s: a standby takes over once it expires", self.lease_name
        )

    @staticmethod
    def _released(lease: Lease) -> Lease:
        return Lease(
            metadata=lease.metadata,
            spec=LeaseSpec(
                holderIdentity="",
                leaseDurationSeconds=1,
                acquireTime=lease.spec.acquireTime,
                renewTime=micro_time(),
                leaseTransitions=lease.spec.leaseTransitions,
            ),
        )
