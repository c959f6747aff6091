"""The `ultraserver-init` and `ultraserver-affinity` commands. `register(app)` adds them."""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml

from neuron_scheduler.commandline import Kubeconfig, check_kubeconfig, fail, user_errors
from neuron_scheduler.jobs.units import ENV_NODE_CONFIG, NodeConfigError, parse_node_config
from neuron_scheduler.ultraserver.labels import SYSFS_DIR
from neuron_scheduler.ultraserver.launcher.environment import DEFAULT_ENVIRONMENT_FILE
from neuron_scheduler.ultraserver.launcher.hostfile import DEFAULT_HOSTFILE, DEFAULT_OUT_DIR
from neuron_scheduler.ultraserver.launcher.init import InitError, InitOptions, Source
from neuron_scheduler.ultraserver.launcher.ssh import DEFAULT_SSH, SshOptions


def _log(line: str) -> None:
    print(line, flush=True)


def ultraserver_init(
    node_config: Annotated[
        str | None,
        typer.Option(
            envvar=ENV_NODE_CONFIG,
            show_envvar=True,
            help="UltraServer nodes per unit: 4, 2 or 1 (default 4)",
        ),
    ] = None,
    hostfile: Annotated[Path, typer.Option(help="the MPI hostfile")] = Path(DEFAULT_HOSTFILE),
    out_dir: Annotated[Path, typer.Option(help="where new_hostfile is written")] = Path(
        DEFAULT_OUT_DIR
    ),
    source: Annotated[
        Source, typer.Option(help="worker facts: sysfs over ssh, or node labels from the API")
    ] = Source.SSH,
    ssh: Annotated[
        str, typer.Option(help="ssh command line; the worker host and command are appended")
    ] = DEFAULT_SSH,
    sysfs_dir: Annotated[
        str, typer.Option(help="the driver's sysfs directory on the workers")
    ] = SYSFS_DIR,
    environment_file: Annotated[
        str, typer.Option(help="the file on each worker that gets the runtime's variables")
    ] = DEFAULT_ENVIRONMENT_FILE,
    kubeconfig: Kubeconfig = None,
    namespace: Annotated[
        str | None,
        typer.Option(help="--source kube: the workers' namespace when the hostfile has none"),
    ] = None,
) -> None:
    """The MPIJob launcher's init step for Trn2 UltraServers: validate the workers' placement,
    write NEURON_GLOBAL_TOPOID & co. into each worker's /etc/environment, write new_hostfile.

    The API (--kubeconfig, else the pod's service account): --source kube reads the workers' node
    labels from it; --source ssh, when it can be reached, names each worker's node in errors."""
    with user_errors(NodeConfigError, ValueError):
        config = parse_node_config(node_config)
        check_kubeconfig(kubeconfig)
        command = tuple(shlex.split(ssh))
    if not command:
        fail("--ssh is empty")
    options = InitOptions(
        node_config=config,
        hostfile=hostfile,
        out_dir=out_dir,
        source=source,
        ssh=SshOptions(command, sysfs_dir, environment_file),
        kubeconfig=kubeconfig,
        namespace=namespace,
    )
    from neuron_scheduler.ultraserver.launcher.init import run

    with user_errors(InitError, code=1):
        asyncio.run(run(options, _log))


def ultraserver_affinity(
    job_name: Annotated[str, typer.Option(help="the MPIJob's name")],
    workers: Annotated[int, typer.Option(help="Worker replicas")],
    node_config: Annotated[str, typer.Option(help="UltraServer nodes per unit: 4, 2 or 1")] = "4",
    full_example: Annotated[
        bool, typer.Option(help="a whole MPIJob with the launcher's two init containers")
    ] = False,
    namespace: Annotated[str, typer.Option(help="--full-example: the MPIJob's namespace")] = (
        "default"
    ),
) -> None:
    """Print the Worker template's nodeSelector and affinity for an UltraServer MPIJob (and, as
    a comment, the template metadata's annotations the extender reads)."""
    from neuron_scheduler.ultraserver.affinity import mpijob, worker_annotations, worker_placement

    with user_errors(NodeConfigError):
        config = parse_node_config(node_config, "--node-config")
        if full_example:
            document = mpijob(job_name, workers, config, namespace=namespace)
        else:
            document = worker_placement(job_name, workers, config)
            metadata = {"metadata": {"annotations": worker_annotations(workers, config)}}
            shown = yaml.dump(metadata, Dumper=_PlainDumper, sort_keys=False, width=100)
            sys.stdout.write(
                "# The Worker template's metadata (the extender reserves UltraServer units for\n"
                "# all the job's workers at once):\n"
                + "".join(f"#   {line}\n" for line in shown.splitlines())
                + "# and its spec:\n"
            )
    sys.stdout.write(yaml.dump(document, Dumper=_PlainDumper, sort_keys=False, width=100))


class _PlainDumper(yaml.SafeDumper):
    """YAML for people who copy the manifest and edit it by hand: a value used twice (the
    launcher's volume mounts) written out twice, not as an anchor and an alias (`&id001`,
    `*id001`), and a script of several lines as a literal block (`|`), not one quoted line of
    escaped newlines. Both load back to the same document."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # PyYAML writes quoted instead where a literal block cannot hold the text exactly.
    return dumper.represent_scalar(
        "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None
    )


_PlainDumper.add_representer(str, _text)


def register(app: typer.Typer) -> None:
    app.command("ultraserver-init")(ultraserver_init)
    app.command("ultraserver-affinity")(ultraserver_affinity)
