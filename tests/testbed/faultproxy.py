"""A TLS-terminating HTTP proxy between a client (the extender) and kube-apiserver that injects
the faults a real control plane has: answers cut off mid-body, watches dropped, answers delayed,
and writes answered 500, 409 or 429.

The client trusts the proxy's own certificate (`kubeconfig()` writes what it needs); the proxy
forwards each request, with the client's own Authorization header, to the real API server over
TLS checked against the testbed's CA. Watches (`watch=1`) are streamed through as they arrive.
Runs its own event loop in a thread; every fault it injects is counted in `counts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import ssl
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import yarl

from .client import write_kubeconfig
from .pki import Pki

# The two writes a bind makes: our annotation patch and the Binding.
POD_PATCH = re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+$")
BINDING = re.compile(r"^/api/v1/namespaces/[^/]+/pods/[^/]+/binding$")
REASONS = {500: "InternalError", 409: "Conflict", 429: "TooManyRequests"}
# Hop-by-hop and framing headers are the proxy's own business on each side.
NOT_FORWARDED = {
    "host",
    "connection",
    "keep-alive",
    "content-length",
    "transfer-encoding",
    "accept-encoding",
    "te",
    "upgrade",
}


@dataclass
class Faults:
    """Fractions of requests that get each fault (0 everywhere: a plain proxy)."""

    cut: float = 0.0  # a non-watch answer cut off mid-body (after the request was forwarded)
    # A watch dropped after `watch_seconds`; while none has been, every watch is (a client
    # opens few watches, so a share alone may drop none in a whole run).
    watch_cut: float = 0.0
    watch_seconds: tuple[float, float] = (1.0, 15.0)
    delay: float = 0.0  # an answer delayed by `delay_seconds` (before or after forwarding)
    delay_seconds: tuple[float, float] = (1.0, 10.0)
    write_error: float = 0.0  # a pod PATCH or Binding answered 500/409/429, not forwarded
    # A pod PATCH or Binding held until its client gave up on it (the extender's API timeout is
    # 10 s), then forwarded: a write that lands, or fails its preconditions, after its answer.
    late: float = 0.0
    late_seconds: float = 12.0
    # Every watch's data reaches the client this much after the API server sent it (in order):
    # a client whose cache lags behind kube-scheduler's.
    watch_lag: float = 0.0


class FaultProxy:
    def __init__(self, upstream: str, upstream_ca: Path, workdir: Path, seed: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.upstream_ca = upstream_ca
        self.pki = Pki.create(workdir)  # the proxy's serving certificate and its CA
        self.faults = Faults()
        self.counts: Counter[str] = Counter()
        self.random = random.Random(seed)
        self._errors = [500, 409, 429]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path, token: str) -> Path:
        """A kubeconfig for a client of the API server through this proxy."""
        return write_kubeconfig(
            path, server_url=self.url, token=token, user="through-proxy", cafile=self.pki.ca
        )

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> None:
        serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        serving.load_cert_chain(str(self.pki.server_cert), str(self.pki.server_key))
        upstream = ssl.create_default_context(cafile=str(self.upstream_ca))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=upstream, limit=0),
            auto_decompress=False,
        )
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", 0, ssl=serving, limit=1 << 20
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults

    # --- serving -----------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self._handle(method, target, headers, body, writer):
                    return
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            ssl.SSLError,
            ValueError,
        ):
            return
        finally:
            self._connections.discard(writer)
            if task is not None:
                self._tasks.discard(task)
            writer.transport.abort()

    async def _handle(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Forward one request (or answer it with a fault); False when the connection is cut."""
        faults, rng = self.faults, self.random
        parts = urlsplit(target)
        watch = parse_qs(parts.query).get("watch", [""])[0] in ("1", "true")
        write = (method == "PATCH" and POD_PATCH.match(parts.path)) or (
            method == "POST" and BINDING.match(parts.path)
        )
        if write and rng.random() < faults.write_error:
            status = self._errors[self.counts["write-error"] % 3]
            self.counts["write-error"] += 1
            self.counts[f"answered {status}"] += 1
            await self._answer_error(writer, status, method, parts.path)
            return True
        if write and rng.random() < faults.late:
            self.counts["late"] += 1
            await asyncio.sleep(faults.late_seconds)
            status = await self._forward_late(method, target, headers, body)
            self.counts["late landed" if status < 300 else f"late refused {status}"] += 1
            return False  # its client is long gone
        delay_after = False
        if rng.random() < faults.delay:
            seconds = rng.uniform(*faults.delay_seconds)
            self.counts["delay"] += 1
            delay_after = rng.random() < 0.5
            if not delay_after:
                await asyncio.sleep(seconds)
        try:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
            async with self._upstream(method, target, headers, body, timeout) as answer:
                if delay_after:
                    await asyncio.sleep(seconds)
                kept = [(k, v) for k, v in answer.headers.items() if k.lower() not in NOT_FORWARDED]
                if watch:
                    return await self._stream(answer, kept, writer)
                payload = await answer.read()
                cut = rng.random() < faults.cut and len(payload) > 1
                head = self._head(answer.status, answer.reason or "", kept, len(payload))
                if cut:
                    self.counts["cut"] += 1
                    self.counts[f"cut {method}"] += 1
                    writer.write(head + payload[: len(payload) // 2])
                    await writer.drain()
                    return False
                writer.write(head + payload)
                await writer.drain()
                self.counts["forwarded"] += 1
                return True
        except (aiohttp.ClientError, TimeoutError) as error:
            payload = json.dumps(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": f"fault proxy: upstream failed: {error}",
                    "code": 502,
                }
            ).encode()
            writer.write(
                self._head(502, "Bad Gateway", [("Content-Type", "application/json")], len(payload))
                + payload
            )
            await writer.drain()
            return True

    def _upstream(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        timeout: aiohttp.ClientTimeout,
    ) -> Any:
        """The request, as the client sent it, to the real API server (an async context)."""
        assert self._session is not None
        return self._session.request(
            method,
            yarl.URL(self.upstream + target, encoded=True),
            headers={k: v for k, v in headers.items() if k not in NOT_FORWARDED},
            data=body or None,
            timeout=timeout,
            allow_redirects=False,
        )

    async def _forward_late(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> int:
        """Sends a request whose client is gone; kube-apiserver's status for it."""
        try:
            timeout = aiohttp.ClientTimeout(total=60)
            async with self._upstream(method, target, headers, body, timeout) as answer:
                await answer.read()
                return answer.status
        except (aiohttp.ClientError, TimeoutError):
            return 502

    async def _stream(
        self,
        answer: aiohttp.ClientResponse,
        headers: list[tuple[str, str]],
        writer: asyncio.StreamWriter,
    ) -> bool:
        faults, rng = self.faults, self.random
        cut_at = None
        first = faults.watch_cut > 0 and not self.counts["watch-cut"]
        if first or rng.random() < faults.watch_cut:
            cut_at = asyncio.get_running_loop().time() + rng.uniform(*faults.watch_seconds)
        lines = [
            f"HTTP/1.1 {answer.status} {answer.reason or ''}",
            *(f"{k}: {v}" for k, v in headers),
            "Transfer-Encoding: chunked",
            "",
            "",
        ]
        writer.write("\r\n".join(lines).encode("latin-1"))
        await writer.drain()
        self.counts["watches"] += 1
        content = answer.content
        arrivals: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        reader = asyncio.get_running_loop().create_task(self._read_stream(content, arrivals))
        try:
            return await self._relay(arrivals, cut_at, writer)
        finally:
            reader.cancel()

    @staticmethod
    async def _read_stream(
        content: aiohttp.StreamReader, arrivals: asyncio.Queue[tuple[float, bytes | None]]
    ) -> None:
        """Each chunk of a watch as it arrives, with when (so a lag counts from its arrival);
        None when the upstream failed."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data: bytes | None = await content.readany()
            except (aiohttp.ClientError, TimeoutError):
                data = None
            await arrivals.put((loop.time(), data))
            if not data:
                return

    async def _relay(
        self,
        arrivals: asyncio.Queue[tuple[float, bytes | None]],
        cut_at: float | None,
        writer: asyncio.StreamWriter,
    ) -> bool:
        loop = asyncio.get_running_loop()
        while True:
            timeout = None
            if cut_at is not None:
                timeout = max(0.0, cut_at - loop.time())
            try:
                arrived, data = await asyncio.wait_for(arrivals.get(), timeout)
            except TimeoutError:
                if not self.faults.watch_cut:  # the faults stopped meanwhile
                    cut_at = None
                    continue
                self.counts["watch-cut"] += 1
                return False
            lag = arrived + self.faults.watch_lag - loop.time()
            if lag > 0:
                await asyncio.sleep(lag)
            if data is None:
                return False  # the upstream failed: the client sees the watch cut
            if not data:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

    @staticmethod
    def _head(status: int, reason: str, headers: list[tuple[str, str]], length: int) -> bytes:
        lines = [
            f"HTTP/1.1 {status} {reason}",
            *(f"{k}: {v}" for k, v in headers),
            f"Content-Length: {length}",
            "",
            "",
        ]
        return "\r\n".join(lines).encode("latin-1")

    async def _answer_error(
        self, writer: asyncio.StreamWriter, status: int, method: str, path: str
    ) -> None:
        reason = REASONS[status]
        payload = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"fault proxy: {method} {path} answered {status} on purpose",
                "reason": reason,
                "code": status,
            }
        ).encode()
        headers = [("Content-Type", "application/json")]
        if status == 429:
            headers.append(("Retry-After", "1"))
        writer.write(self._head(status, reason, headers, len(payload)) + payload)
        await writer.drain()

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        with contextlib.suppress(Exception):
            self.stop()
