"""The MPI hostfile: read the workers, write it back in topology order. Pure."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOSTFILE = "/etc/mpi/hostfile"
NEW_HOSTFILE = "new_hostfile"
DEFAULT_OUT_DIR = "/root/ultraserver_init"


class HostfileError(ValueError):
    """A hostfile we cannot use, with the line that is wrong."""


@dataclass(frozen=True, slots=True)
class HostLine:
    host: str  # column 1, what ssh connects to
    line: str  # the whole line, kept as written (slots=...)


def parse(text: str, source: str = DEFAULT_HOSTFILE) -> list[HostLine]:
    hosts: list[HostLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0]
        if host in seen:
            raise HostfileError(
                f"{source}:{number}: host {host} is listed again (first on line {seen[host]})"
            )
        seen[host] = number
        hosts.append(HostLine(host, line))
    return hosts


def reorder(lines: list[HostLine], hosts_in_order: list[str]) -> str:
    """The hostfile with its lines in the given host order."""
    by_host = {h.host: h.line for h in lines}
    return "".join(by_host[host] + "\n" for host in hosts_in_order)
