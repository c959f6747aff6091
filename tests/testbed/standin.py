"""A stand-in for kubelet on the testbed's fake nodes: the two things preemption needs from one.

Nothing runs on a fake node, so without this a bound pod never starts (kube-scheduler orders
victims by start time) and a pod deleted gracefully stays Terminating forever (the API server
waits for a kubelet to confirm it). The stand-in, for the pods of one namespace:
- marks each bound pod Running with a start time, as kubelet does once its containers start;
- removes each terminating pod (a delete with grace period 0, as kubelet's final delete) once
  `finishing` is set and it has been terminating for `finish_after` seconds.

It is not a kubelet: no containers, no devices, no pod resources. The real one is
tests/testbed/kubelet.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import UTC, datetime
from typing import Any

from .client import KubeClient, KubeError

POLL_SECONDS = 0.2


class KubeletStandIn:
    def __init__(self, client: KubeClient, namespace: str, finish_after: float = 0.0) -> None:
        self.client = client
        self.namespace = namespace
        self.finish_after = finish_after
        self.finishing = threading.Event()  # cleared: terminating pods stay until it is set
        self.finishing.set()
        self.finished: list[str] = []  # names of the pods it removed, in order
        self.started: list[str] = []
        self._terminating_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-stand-in", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> KubeletStandIn:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise RuntimeError(f"the kubelet stand-in failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
                self._stop.wait(POLL_SECONDS)
        except BaseException as error:  # reported by stop(), in the test's thread
            self.error = error

    def _step(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        pods: list[dict[str, Any]] = self.client.request("GET", path)["items"]
        now = time.monotonic()
        for pod in pods:
            meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
            name = meta["name"]
            if meta.get("deletionTimestamp"):
                since = self._terminating_since.setdefault(meta["uid"], now)
                if self.finishing.is_set() and now - since >= self.finish_after:
                    self._finish(path, name, meta["uid"])
            elif spec.get("nodeName") and status.get("phase") != "Running":
                self._start(path, name)

    def _start(self, path: str, name: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "status": {
                "phase": "Running",
                "startTime": stamp,
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": stamp}],
            }
        }
        with contextlib.suppress(KubeError):  # deleted meanwhile
            self.client.request(
                "PATCH", f"{path}/{name}/status", body, "application/strategic-merge-patch+json"
            )
            self.started.append(name)

    def _finish(self, path: str, name: str, uid: str) -> None:
        options = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": uid},
        }
        with contextlib.suppress(KubeError):  # already gone
            self.client.request("DELETE", f"{path}/{name}", options)
            self.finished.append(name)
