"""`neuron-scheduler ultraserver-init`: the launcher's init step, end to end.

Read the hostfile, gather every worker's UltraServer facts (sysfs over ssh, or node labels
through the API), validate and order them, write the runtime's variables into each worker's
/etc/environment over ssh, write the reordered hostfile, and log a summary.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from neuron_scheduler.ultraserver.launcher import environment, hostfile, ssh
from neuron_scheduler.ultraserver.launcher.hostfile import DEFAULT_HOSTFILE, DEFAULT_OUT_DIR
from neuron_scheduler.ultraserver.launcher.ranking import (
    Placed,
    UnitError,
    WorkerInfo,
    order,
    summary,
)


class Source(enum.StrEnum):
    SSH = "ssh"
    KUBE = "kube"


class InitError(RuntimeError):
    """The init step failed; str() is one line per problem."""


@dataclass
class InitOptions:
    node_config: int = 4
    hostfile: Path = Path(DEFAULT_HOSTFILE)
    out_dir: Path = Path(DEFAULT_OUT_DIR)
    source: Source = Source.SSH
    ssh: ssh.SshOptions = field(default_factory=ssh.SshOptions)
    kubeconfig: Path | None = None
    namespace: str | None = None


async def _gather(options: InitOptions, hosts: list[str]) -> list[WorkerInfo]:
    from neuron_scheduler.kube.client import KubeAPI
    from neuron_scheduler.kube.config import ConfigError, load_config, own_namespace
    from neuron_scheduler.ultraserver.launcher import nodes

    if options.source is Source.SSH:
        infos = await ssh.gather(options.ssh, hosts, options.node_config)
        # A worker does not know its Kubernetes node; the API does, when we may ask it (the
        # launcher's ServiceAccount, or --kubeconfig): then errors name the node too.
        try:
            config = load_config(options.kubeconfig)
        except ConfigError:
            return infos
        namespace = options.namespace or own_namespace("default")
        async with KubeAPI(config) as api:
            names = await nodes.node_names(api, hosts, namespace)
        return [replace(i, node=i.node or names.get(i.worker)) for i in infos]
    try:
        config = load_config(options.kubeconfig)
    except ConfigError as error:
        raise InitError(f"--source kube: {error}") from error
    namespace = options.namespace or own_namespace("default")
    async with KubeAPI(config) as api:
        return await nodes.gather(api, hosts, options.node_config, namespace)


async def _write_environment(options: InitOptions, placed: list[Placed]) -> None:
    leader = placed[0].info.fqdn
    path = options.ssh.environment_file

    async def one(host: str) -> str | None:
        p = next(p for p in placed if p.info.worker == host)
        try:
            current = await ssh.read_file(options.ssh, host, path)
            await ssh.write_file(
                options.ssh, host, path, environment.update(current, p.environment(leader))
            )
        except ssh.RemoteError as error:
            return f"worker {host} (node {p.info.node or 'unknown'}): writing {path}: {error}"
        return None

    failures = await ssh.bounded([p.info.worker for p in placed], options.ssh.parallel, one)
    problems = [f for f in failures if f]
    if problems:
        raise InitError("\n".join(problems))


async def run(options: InitOptions, log: Callable[[str], None]) -> list[Placed]:
    try:
        text = options.hostfile.read_text()
    except OSError as error:
        raise InitError(
            f"cannot read the hostfile {options.hostfile}: {error.strerror or error}"
        ) from error
    except UnicodeDecodeError as error:
        raise InitError(f"the hostfile {options.hostfile} is not UTF-8 text: {error}") from error
    try:
        lines = hostfile.parse(text, str(options.hostfile))
    except hostfile.HostfileError as error:
        raise InitError(str(error)) from error
    hosts = [line.host for line in lines]
    log(f"Using {options.node_config}-node config")
    log(f"Gathering {len(hosts)} workers from {options.hostfile} (source: {options.source.value})")
    workers = await _gather(options, hosts)
    try:
        placed = order(workers, options.node_config)
    except UnitError as error:
        raise InitError(str(error)) from error
    await _write_environment(options, placed)
    target = options.out_dir / hostfile.NEW_HOSTFILE
    try:
        options.out_dir.mkdir(parents=True, exist_ok=True)
        target.write_text(hostfile.reorder(lines, [p.info.worker for p in placed]))
    except OSError as error:
        raise InitError(f"cannot write {target}: {error.strerror or error}") from error
    for line in summary(placed, options.node_config)[1:]:
        log(line)
    log(f"wrote {target} and {options.ssh.environment_file} on {len(placed)} workers")
    return placed
