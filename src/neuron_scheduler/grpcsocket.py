"""A gRPC server on a unix socket in one of kubelet's directories, for the device plugin's
endpoints and the DRA driver's registration and DRAPlugin sockets.

kubelet (or a person cleaning the directory) may remove or replace the socket file while the
server runs; `intact` turns false then, and the owner starts it again. A file is told apart from
its successor by `identity` (device, inode, change time: an inode number alone is reused at once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

FileIdentity = tuple[int, int, int]


def identity(path: Path) -> FileIdentity | None:
    """Changes whenever the file is re-created; None while there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class SocketServer:
    """One gRPC server on one unix socket. `add` puts the services on a new server; `what` names
    them in the log."""

    def __init__(self, socket: Path, add: Callable[[grpc.aio.Server], None], what: str) -> None:
        self.socket = socket
        self.add = add
        self.what = what
        self._server: grpc.aio.Server | None = None
        self._identity: FileIdentity | None = None

    async def start(self) -> None:
        await self.stop()
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # left by an earlier run; binding over it would fail
        server = grpc.aio.server()
        self.add(server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        self._identity = identity(self.socket)
        log.info("serving %s on %s", self.what, self.socket)

    async def stop(self) -> None:
        """Stop serving; remove the socket file only if it is still the one this server made."""
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace=0.5)
        if self._identity is not None and identity(self.socket) == self._identity:
            with contextlib.suppress(FileNotFoundError):
                self.socket.unlink()
        self._identity = None

    @property
    def intact(self) -> bool:
        return self._server is not None and identity(self.socket) == self._identity
