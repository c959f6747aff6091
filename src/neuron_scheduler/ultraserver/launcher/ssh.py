"""The workers over ssh: the driver's sysfs files and /etc/environment, as upstream reads them.

Every call is `<ssh command> <host> <remote command>` with the hostfile's host name, so the
launcher's ssh setup (keys and ~/.ssh/config from the MPI operator) decides how to connect.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from neuron_scheduler.ultraserver.labels import MODE_FILE, SYSFS_DIR, node_id_file, server_id_file
from neuron_scheduler.ultraserver.launcher.environment import DEFAULT_ENVIRONMENT_FILE
from neuron_scheduler.ultraserver.launcher.ranking import FactNames, WorkerInfo, read_worker

# accept-new: MPI workers are new pods with new host keys on every job; a changed key for a known
# name is still refused.
DEFAULT_SSH = "ssh -o BatchMode=yes -o ConnectTimeout=20 -o StrictHostKeyChecking=accept-new"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SshOptions:
    command: tuple[str, ...] = tuple(shlex.split(DEFAULT_SSH))
    sysfs_dir: str = SYSFS_DIR  # a relative path is read from the login directory
    environment_file: str = DEFAULT_ENVIRONMENT_FILE
    parallel: int = 16


class RemoteError(RuntimeError):
    """ssh or the remote command failed; the message is one line."""


async def run(options: SshOptions, host: str, script: str, stdin: bytes | None = None) -> str:
    try:
        process = await asyncio.create_subprocess_exec(
            *options.command,
            host,
            script,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as error:
        raise RemoteError(f"cannot run {options.command[0]}: {error.strerror or error}") from error
    out, err = await process.communicate(stdin)
    if process.returncode:
        lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
        detail = lines[-1].strip() if lines else "no error output"
        if process.returncode == 255:
            raise RemoteError(f"cannot reach it over ssh: {detail}")
        raise RemoteError(f"remote command failed with exit code {process.returncode}: {detail}")
    return out.decode(errors="replace")


def gather_script(sysfs_dir: str, config: int) -> str:
    """Prints fqdn=..., then file=contents for each sysfs file that exists."""
    files = " ".join([MODE_FILE, server_id_file(config), node_id_file(config)])
    directory = shlex.quote(sysfs_dir)
    return (
        'printf "fqdn=%s\\n" "$(hostname --fqdn 2>/dev/null || hostname)"; '
        f"for f in {files}; do "
        f'if [ -e {directory}/"$f" ]; then printf "%s=%s\\n" "$f" "$(cat {directory}/"$f")"; fi; '
        "done"
    )


def parse_gathered(host: str, text: str, sysfs_dir: str, config: int) -> WorkerInfo:
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value.strip()
    fqdn = values.get("fqdn") or host
    names = FactNames(
        no_modes=(
            f"no {sysfs_dir}/{MODE_FILE}: not an UltraServer node, or its Neuron driver is too old"
        ),
        modes=f"{sysfs_dir}/{MODE_FILE} says",
        node_id=f"{sysfs_dir}/{node_id_file(config)}",
    )
    keys = (MODE_FILE, server_id_file(config), node_id_file(config))
    return read_worker(host, fqdn, None, values, keys, names)


async def bounded(
    items: Sequence[str], parallel: int, work: Callable[[str], Awaitable[T]]
) -> list[T]:
    gate = asyncio.Semaphore(max(1, parallel))

    async def one(item: str) -> T:
        async with gate:
            return await work(item)

    return list(await asyncio.gather(*(one(item) for item in items)))


async def gather(options: SshOptions, hosts: Sequence[str], config: int) -> list[WorkerInfo]:
    script = gather_script(options.sysfs_dir, config)

    async def one(host: str) -> WorkerInfo:
        try:
            text = await run(options, host, script)
        except RemoteError as error:
            return WorkerInfo(host, host, None, None, problem=str(error))
        return parse_gathered(host, text, options.sysfs_dir, config)

    return await bounded(hosts, options.parallel, one)


async def read_file(options: SshOptions, host: str, path: str) -> str:
    quoted = shlex.quote(path)
    return await run(options, host, f"if [ -e {quoted} ]; then cat {quoted}; fi")


async def write_file(options: SshOptions, host: str, path: str, content: str) -> None:
    # Rewritten in place (not renamed over), so a bind-mounted file keeps working.
    await run(options, host, f"cat > {shlex.quote(path)}", stdin=content.encode())
