"""Hostile requests for the extender's verbs (issue 15, part 4): bodies drawn by hypothesis from the
wire schema with the wrong types, and the hand-made classes a leaked client certificate allows.

The schema is msgspec's own for the wire types, so a field added there is attacked here too.
`Caller` sends over persistent HTTPS connections (thousands of requests in seconds); the slow and
concurrent classes use raw sockets, each bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st

from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from neuron_scheduler.extender.verbs.wire import ExtenderArgs, ExtenderBindingArgs

NO_ANSWER = 0  # the status recorded when the connection ended without an HTTP answer

# Strings no Kubernetes object name holds: what a caller with a stolen certificate may send.
HOSTILE_STRINGS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\r\n",
    "x\r\nTransfer-Encoding: chunked",
    "\x1b[2J",
    "\u202etxt.exe",
    "\ufeff",
    "\U0001f600" * 8,
    "ｎｏｄｅ",
    "../../../etc/passwd",
    "/api/v1/nodes",
    "%2e%2e%2f",
    "?watch=1",
    "#frag",
    "a" * 300,
    "é" * 2000,
    "null",
    "0",
    "-1",
    "1e100",
]
RESOURCES = [
    NEURON,
    NEURONCORE,
    NEURONDEVICE,
    "cpu",
    "aws.amazon.com/neuron ",
    "AWS.AMAZON.COM/NEURON",
]
QUANTITIES: list[Any] = [
    "1e100",
    "-3",
    "0.5",
    "1Ki",
    "1k",
    "1m",
    "1e3",
    "+1",
    "0x10",
    "１",
    "\u00b2",
    "1.0",
    " 1",
    "9" * 400,
    "",
    "NaN",
    "Infinity",
    1e100,
    -3,
    0.5,
    0,
    2**63,
    -(2**63) - 1,
    True,
    None,
    [],
    {},
]


def hostile_text() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=40), st.sampled_from(HOSTILE_STRINGS))


def wrong_type() -> st.SearchStrategy[Any]:
    """Anything JSON holds, of whatever type the field is not."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        hostile_text(),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(hostile_text(), inner, max_size=3)
        ),
        max_leaves=6,
    )


class SchemaBodies:
    """Strategies for JSON bodies shaped like a msgspec type, where every field may instead be
    missing, null or of a wrong type."""

    def __init__(self, kind: type[Any], extra_strings: Iterable[str] = ()) -> None:
        (self.root,), self.defs = msgspec.json.schema_components([kind])
        self.strings = st.one_of(hostile_text(), st.sampled_from(list(extra_strings) or [""]))

    def body(self) -> st.SearchStrategy[Any]:
        return self._field(self.root, depth=0)

    def _field(self, schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
        return st.one_of(self._shaped(schema, depth), wrong_type())

    def _shaped(self, schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            schema = self.defs[schema["$ref"].rsplit("/", 1)[1]]
        if "anyOf" in schema:
            return st.one_of([self._shaped(each, depth) for each in schema["anyOf"]])
        kind = schema.get("type")
        if depth > 8:
            return st.none()
        if kind == "object" and "properties" in schema:
            return st.fixed_dictionaries(
                {},
                optional={
                    name: self._field(sub, depth + 1) for name, sub in schema["properties"].items()
                },
            )
        if kind == "object":
            values = schema.get("additionalProperties", {})
            keys = st.one_of(self.strings, st.sampled_from(RESOURCES))
            if values.get("anyOf") and {"type": "integer"} in values["anyOf"]:
                return st.dictionaries(keys, st.sampled_from(QUANTITIES), max_size=3)
            return st.dictionaries(keys, self._field(values, depth + 1), max_size=3)
        if kind == "array":
            return st.lists(self._field(schema.get("items", {}), depth + 1), max_size=3)
        if kind == "string":
            return self.strings
        if kind == "integer":
            return st.integers()
        if kind == "null":
            return st.none()
        return wrong_type()


def filter_bodies(known_nodes: list[str]) -> st.SearchStrategy[Any]:
    return SchemaBodies(ExtenderArgs, known_nodes).body()


def bind_bodies(known: list[str]) -> st.SearchStrategy[Any]:
    return SchemaBodies(ExtenderBindingArgs, known).body()


@dataclass
class Tally:
    """Answers per class of request: class -> status -> count."""

    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, status: int) -> None:
        with self.lock:
            self.statuses.setdefault(kind, Counter())[status] += 1

    def total(self, kind: str | None = None) -> int:
        kinds = [kind] if kind else list(self.statuses)
        return sum(sum(self.statuses.get(k, Counter()).values()) for k in kinds)

    def server_errors(self) -> dict[str, dict[int, int]]:
        return {
            kind: {s: n for s, n in counts.items() if s >= 500}
            for kind, counts in self.statuses.items()
            if any(s >= 500 for s in counts)
        }

    def unanswered(self) -> dict[str, int]:
        return {k: c[NO_ANSWER] for k, c in self.statuses.items() if c[NO_ANSWER]}


Request = tuple[str, str, bytes]  # (method, path, body)


class Caller:
    """Requests over persistent HTTPS connections (a few in parallel), as fast as they go."""

    def __init__(self, port: int, context: ssl.SSLContext, tally: Tally, workers: int = 4) -> None:
        self.port = port
        self.context = context
        self.tally = tally
        self.workers = workers
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPSConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, context=self.context, timeout=60
            )
            self._local.connection = connection
        return connection

    def send(self, kind: str, request: Request) -> tuple[int, bytes]:
        status, payload = NO_ANSWER, b""
        # A connection left idle past the server's keep-alive is closed under us: one more try
        # on a new one, as any HTTP client does.
        for fresh in (getattr(self._local, "connection", None) is None, True):
            try:
                status, payload = self._exchange(request)
                break
            except (OSError, http.client.HTTPException):
                self._drop()
                if fresh:
                    break
        self.tally.add(kind, status)
        return status, payload

    def _exchange(self, request: Request) -> tuple[int, bytes]:
        method, path, body = request
        connection = self._connection()
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        status, payload = answer.status, answer.read()
        if answer.will_close:
            self._drop()
        return status, payload

    def _drop(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
        self._local.connection = None

    def send_all(self, kind: str, requests: Iterable[Request]) -> list[tuple[int, bytes]]:
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(lambda r: self.send(kind, r), requests))


def post(path: str, body: Any) -> Request:
    return ("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())


# --- raw sockets: slow bodies and bursts ----------------------------------------------------------


def _request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


def _status(reply: bytes) -> int:
    line = reply.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else NO_ANSWER


async def _read_status(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n")
    return _status(head)


async def _exchange(
    port: int, context: ssl.SSLContext, pieces: list[bytes], pause: float, deadline: float
) -> int:
    """One connection: write the pieces with a pause between them, then read the status line.
    NO_ANSWER when the connection ends without one (or the deadline passes)."""
    writer = None
    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            for i, piece in enumerate(pieces):
                if i:
                    await asyncio.sleep(pause)
                writer.write(piece)
                await writer.drain()
            return await _read_status(reader)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
        return NO_ANSWER
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()


def trickle(
    port: int,
    context: ssl.SSLContext,
    path: str,
    body: bytes,
    pieces: int,
    pause: float,
    connections: int,
    seconds: float,
) -> list[int]:
    """`connections` clients at once, each sending its request in `pieces` with `pause` between
    them (the head too, a byte at a time at first); statuses, NO_ANSWER past `seconds`."""
    raw = _request_head(path, len(body)) + body
    size = max(1, len(raw) // pieces)
    split = [raw[:1], raw[1:2], *(raw[i : i + size] for i in range(2, len(raw), size))]

    async def run() -> list[int]:
        deadline = time.monotonic() + seconds
        return list(
            await asyncio.gather(
                *(_exchange(port, context, split, pause, deadline) for _ in range(connections))
            )
        )

    return asyncio.run(run())


def abandoned(
    port: int, context: ssl.SSLContext, path: str, connections: int, seconds: float
) -> int:
    """Clients that promise a body and stop halfway, then hang up: how many the server answered
    before they did (it need not)."""
    head = _request_head(path, 10_000) + b'{"Pod": {'

    async def one(deadline: float) -> int:
        return await _exchange(port, context, [head], 0, deadline)

    async def run() -> list[int]:
        deadline = time.monotonic() + seconds
        return list(await asyncio.gather(*(one(deadline) for _ in range(connections))))

    return sum(1 for s in asyncio.run(run()) if s != NO_ANSWER)


def burst(port: int, context: ssl.SSLContext, requests: list[Request], seconds: float) -> list[int]:
    """Every request on its own connection, all opened at once."""

    async def run() -> list[int]:
        deadline = time.monotonic() + seconds
        return list(
            await asyncio.gather(
                *(
                    _exchange(port, context, [_request_head(path, len(body)) + body], 0, deadline)
                    for _, path, body in requests
                )
            )
        )

    return asyncio.run(run())


def oversized(port: int, context: ssl.SSLContext, path: str, size: int, chunked: bool) -> int:
    """A body of `size` bytes sent whole (declared, or chunked without a length); the status."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=60) as plain,
        context.wrap_socket(plain, server_hostname="127.0.0.1") as conn,
    ):
        chunk = b" " * (1 << 20)
        if chunked:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n"
            ).encode()
        else:
            head = _request_head(path, size)
        try:
            conn.sendall(head)
            sent = 0
            while sent < size:
                piece = chunk[: min(len(chunk), size - sent)]
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
            if chunked:
                conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer 413 and close before the whole body is sent
        try:
            return _status(conn.recv(4096))
        except OSError:
            return NO_ANSWER


def declared_only(port: int, context: ssl.SSLContext, path: str, length: int) -> int:
    """A Content-Length far beyond the limit and no body at all."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as plain,
        context.wrap_socket(plain, server_hostname="127.0.0.1") as conn,
    ):
        conn.sendall(_request_head(path, length))
        try:
            return _status(conn.recv(4096))
        except OSError:
            return NO_ANSWER


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
