"""Child processes that are always cleaned up, and free-port allocation."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
_live: set[ManagedProcess] = set()


def _die_with_parent() -> None:
    # Runs in the child before exec: if the test runner is SIGKILLed, the kernel
    # kills the component too, so no etcd/apiserver outlives a crashed session.
    # Caveat: Linux ties this to the *thread* that forked, so start components
    # from a long-lived thread (pytest fixtures and CLI commands use the main one).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """Return n distinct free TCP ports on 127.0.0.1.

    All sockets are held open until every port is chosen, so the same port is
    never handed out twice; another process can still take one before use.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ManagedProcess:
    """One long-running component whose stdout and stderr go to a log file.

    Can be stopped and started again (the log is appended to, so a restart keeps
    the earlier output). Processes still alive at interpreter exit are stopped.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, alive={self.alive()})"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"==> starting: {' '.join(self.argv)}\n".encode())
        self._log.flush()
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                # Own session: a terminal Ctrl-C reaches only Python, which then
                # tears components down in order instead of all dying at once.
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        except BaseException:
            self._close_log()
            raise
        _live.add(self)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 5.0, *, kill: bool = False) -> int | None:
        """Stop the process: SIGTERM, then SIGKILL after timeout (at once if kill).

        Returns the exit code, or None if it was never started.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        _live.discard(self)
        self._close_log()
        return proc.returncode

    def restart(self, timeout: float = 5.0) -> None:
        self.stop(timeout)
        self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@atexit.register
def _stop_all() -> None:
    for p in list(_live):
        p.stop(timeout=2.0)
