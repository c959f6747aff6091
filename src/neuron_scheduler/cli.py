"""The `neuron-scheduler` command: registers each package's commands, nothing else.

Each `register` only adds typer commands; the packages' heavy imports (uvicorn, grpc, matplotlib)
happen inside the command that needs them, so `--help` and `explain` start fast.
"""

from __future__ import annotations

import sys

import typer

from neuron_scheduler.deviceplugin.command import register as register_device_plugin
from neuron_scheduler.dra.command import register as register_dra_driver
from neuron_scheduler.extender.command import register as register_extender
from neuron_scheduler.live.commands import register as register_live
from neuron_scheduler.sim.commands import register as register_sim
from neuron_scheduler.ultraserver.command import register as register_ultraserver

app = typer.Typer(
    help="Topology-aware scheduling for AWS Neuron devices on Kubernetes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

register_sim(app)
register_extender(app)
register_device_plugin(app)
register_dra_driver(app)
register_ultraserver(app)
register_live(app)

# `kubectl neuron status`, `kubectl neuron why POD`: kubectl runs `kubectl-neuron` from PATH with
# the words after `neuron`, and its own environment (KUBECONFIG).
kubectl_plugin = typer.Typer(
    help="neuron-scheduler's live views of the cluster, as a kubectl plugin.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register_live(kubectl_plugin)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


def kubectl_main() -> None:
    """The `kubectl-neuron` executable."""
    try:
        kubectl_plugin(prog_name="kubectl neuron")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
