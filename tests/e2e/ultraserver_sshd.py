"""A real OpenSSH server on 127.0.0.1 standing in for the MPI workers of the UltraServer tests.

Debian's openssh-server and openssh-client come unpacked from tools/sshd.mk (`make test` builds
it; $SSHD_ROOT or `make sshd-root` finds it). One sshd serves every fake worker: each worker is
an account (passwd file given to sshd through nss_wrapper) whose login directory holds its own
`sys/class/neuron_device/*`, `etc/environment` and a `bin/hostname` printing its FQDN (PATH from
~/.ssh/environment). The ssh client config maps each hostfile host name to its account, so the
init step runs exactly as in a launcher (`ssh <host> <command>`), pointed at relative paths.

sshd refuses to run as root without its system user and /run/sshd, so as root it runs in a user
namespace (`unshare --user`) as an ordinary uid; otherwise it runs as the current user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT
from tests.testbed import ManagedProcess, free_ports

SYSFS = "sys/class/neuron_device"
ENVIRONMENT = "etc/environment"
NAMESPACE_UID = 4242


def sshd_root() -> Path:
    """The unpacked OpenSSH; fails the test (never skips) when it cannot be had."""
    env = os.environ.get("SSHD_ROOT")
    if env:
        root = Path(env)
    else:
        result = subprocess.run(
            ["make", "-s", "--no-print-directory", "-C", str(ROOT), "sshd-root"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or not result.stdout.strip():
            pytest.fail(
                "cannot install Debian's OpenSSH for the UltraServer tests (`make sshd-root`): "
                + (result.stderr.strip() or result.stdout.strip())[-2000:]
            )
        root = Path(result.stdout.strip().splitlines()[-1])
    if not (root / "usr/sbin/sshd").exists() or not (root / "usr/bin/ssh").exists():
        pytest.fail(f"{root} has no usr/sbin/sshd and usr/bin/ssh: run `make sshd-root`")
    return root


@dataclass
class FakeWorker:
    host: str  # as in the hostfile
    fqdn: str
    sysfs: dict[str, str] | None  # file -> contents; None: not an UltraServer node
    environment: str = "PATH=/usr/local/bin:/usr/bin:/bin\n"
    user: str = ""
    home: Path = field(default_factory=Path)

    def env_file(self) -> Path:
        return self.home / ENVIRONMENT


class FakeWorkers:
    """Accounts on one sshd, one per worker; `ssh_command` is what the init step runs."""

    def __init__(self, workers: list[FakeWorker], unreachable: Sequence[str] = ()) -> None:
        self.root = sshd_root()
        self.dir = Path(tempfile.mkdtemp(prefix="ns-sshd-"))
        self.workers = {w.host: w for w in workers}
        self.unreachable = list(unreachable)
        self.port, self.dead_port = free_ports(2)
        as_root = os.geteuid() == 0
        self.uid = NAMESPACE_UID if as_root else os.getuid()
        self.gid = NAMESPACE_UID if as_root else os.getgid()
        self.process: ManagedProcess | None = None
        self._prepare()

    # --- files -------------------------------------------------------------------------------

    def _keygen(self, name: str) -> Path:
        path = self.dir / name
        subprocess.run(
            [
                str(self.root / "usr/bin/ssh-keygen"),
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-f",
                str(path),
            ],
            check=True,
        )
        return path

    def _prepare(self) -> None:
        host_key = self._keygen("host_key")
        user_key = self._keygen("user_key")
        (self.dir / "authorized_keys").write_text((self.dir / "user_key.pub").read_text())
        passwd = []
        client = []
        for i, worker in enumerate(self.workers.values()):
            worker.user = f"worker{i}"
            worker.home = self.dir / "homes" / worker.user
            (worker.home / "bin").mkdir(parents=True)
            (worker.home / ".ssh").mkdir()
            (worker.home / "etc").mkdir()
            hostname = worker.home / "bin" / "hostname"
            hostname.write_text(f"#!/bin/sh\necho {worker.fqdn}\n")
            hostname.chmod(0o755)
            (worker.home / ".ssh" / "environment").write_text(
                f"PATH={worker.home / 'bin'}:/usr/bin:/bin\n"
            )
            worker.env_file().write_text(worker.environment)
            if worker.sysfs is not None:
                sysfs = worker.home / SYSFS
                sysfs.mkdir(parents=True)
                for name, text in worker.sysfs.items():
                    (sysfs / name).write_text(text + "\n")
            passwd.append(f"{worker.user}:x:{self.uid}:{self.gid}::{worker.home}:/bin/sh")
            client.append(
                f"Host {worker.host}\n  HostName 127.0.0.1\n  Port {self.port}\n"
                f"  User {worker.user}\n"
            )
        for host in self.unreachable:  # nothing listens there: a worker that is not up
            client.append(f"Host {host}\n  HostName 127.0.0.1\n  Port {self.dead_port}\n")
        (self.dir / "passwd").write_text("\n".join(passwd) + "\n")
        (self.dir / "group").write_text(f"workers:x:{self.gid}:\n")
        client.append(
            "Host *\n"
            f"  IdentityFile {user_key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.dir / 'known_hosts'}\n"
            "  StrictHostKeyChecking yes\n  CheckHostIP no\n  BatchMode yes\n"
            "  ConnectTimeout 10\n  LogLevel ERROR\n"
        )
        (self.dir / "ssh_config").write_text("".join(client))
        public = (self.dir / "host_key.pub").read_text().split()
        (self.dir / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {public[0]} {public[1]}\n")
        (self.dir / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1\nPort {self.port}\nHostKey {host_key}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitUserEnvironment PATH\nPidFile none\n"
            "LogLevel VERBOSE\n"
        )
        os.chmod(self.dir, 0o755)

    # --- process -----------------------------------------------------------------------------

    @property
    def ssh_command(self) -> str:
        return f"{self.root / 'usr/bin/ssh'} -F {self.dir / 'ssh_config'}"

    def start(self) -> None:
        libs = sorted({str(p.parent) for p in self.root.rglob("libwrap.so.0")})
        preload = next(self.root.rglob("libnss_wrapper.so"), None)
        if preload is None:
            pytest.fail(f"{self.root} has no libnss_wrapper.so: run `make sshd-clean sshd-root`")
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": ":".join(libs),
            "LD_PRELOAD": str(preload),
            "NSS_WRAPPER_PASSWD": str(self.dir / "passwd"),
            "NSS_WRAPPER_GROUP": str(self.dir / "group"),
        }
        argv = [str(self.root / "usr/sbin/sshd"), "-D", "-e", "-f", str(self.dir / "sshd_config")]
        if os.geteuid() == 0:
            argv = ["unshare", "--user", f"--map-user={self.uid}", f"--map-group={self.gid}", *argv]
        self.process = ManagedProcess("sshd", argv, self.dir / "sshd.log", env=env)
        self.process.start()
        deadline = time.monotonic() + 30
        while True:
            if not self.process.alive():
                pytest.fail(f"sshd exited:\n{self.process.log_tail()}")
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"sshd not listening after 30s:\n{self.process.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        return self.process.log_tail(80) if self.process else ""
