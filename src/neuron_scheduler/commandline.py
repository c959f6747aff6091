"""What every command shares: errors a person can fix as one line and an exit code, never a
traceback, the process's log format (one line per message, whatever text it carries), and the
options several commands take (declared once here, with their checks: `node_agent_options` for
the device plugin and the DRA driver).

Each package's `command` module defines its commands with these; `cli` only registers them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypedDict

import typer
from rich.console import Console
from rich.text import Text

from neuron_scheduler.core.logtext import LINE_LIMIT, loggable

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class UsageError(ValueError):
    """Bad command-line input or a problem the user can fix; reported as one line."""


def fail(message: str, code: int = 2) -> NoReturn:
    """`error: <message>` on stderr (one line per line of the message) and exit with `code`."""
    for line in message.splitlines() or [message]:
        # A Text, not markup: messages quote user input, which may hold [brackets] or :codes:.
        err.print(Text.assemble(("error:", "bold red"), " ", line))
    raise typer.Exit(code)


@contextmanager
def user_errors(*kinds: type[Exception], code: int = 2) -> Iterator[None]:
    """Errors of these kinds (and UsageError) become `fail(message, code)`."""
    caught: tuple[type[Exception], ...] = (UsageError, *kinds)
    try:
        yield
    except caught as error:
        fail(str(error), code)


def check_log_level(level: str) -> str:
    if level.lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level {level!r}: use {', '.join(LOG_LEVELS)}")
    return level.lower()


class OneLineFormatter(logging.Formatter):
    """LOG_FORMAT with every message escaped and bounded (core.logtext), so that no text it
    quotes can start a line of its own: call sites escape what they take from requests and API
    objects; this catches what any other code logs. A traceback, logged on purpose, follows on
    lines of its own, each indented (and escaped), so that only a record starts a line."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._second_text = ""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = loggable(record.message, LINE_LIMIT)
        return super().formatMessage(record)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """The default format, with its strftime done once a second: the extender logs a line per
        pod at each verb, and strftime was a sixth of what a line cost (issue 50)."""
        if datefmt is not None or self.default_msec_format is None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return self.default_msec_format % (self._second_text, record.msecs)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(f"    {loggable(line, LINE_LIMIT)}" for line in text.splitlines())


def setup_logging(level: str) -> None:
    """One format for every long-running command; third-party chatter kept at INFO or above."""
    # LOG_FORMAT names no thread, process or source line: records need not look them up (the
    # logging HOWTO's "Optimization"; a record cost the extender as much as writing it, issue 50).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    quieter = max(logging.INFO, logging.getLogger().level)
    # grpc's debug output is one line per call on every stream; aiohttp's per connection.
    for name in ("grpc", "aiohttp", "asyncio"):
        logging.getLogger(name).setLevel(quieter)


# Options several commands take. A parameter of one of these types becomes the option named after
# it (`node_name: NodeName = None` is --node-name); the default stays with the command.
NodeName = Annotated[
    str | None,
    typer.Option(
        envvar="NODE_NAME",
        help="this node's name (a pod gets it from the downward API: spec.nodeName)",
    ),
]
Kubeconfig = Annotated[
    Path | None, typer.Option(help="kubeconfig file (default: in-cluster service account)")
]
DevRoot = Annotated[
    Path,
    typer.Option(
        help="where this process sees the host's /dev (what containers are given still names /dev)"
    ),
]
SysRoot = Annotated[Path, typer.Option(help="where this process sees the host's /sys")]
LogicalNcConfig = Annotated[
    Path, typer.Option(help="Trn2 Logical NeuronCore setting; cores per device = physical/LNC")
]
CoresPerDevice = Annotated[
    int | None,
    typer.Option(help="logical cores per device, instead of sysfs core_count and the LNC file"),
]
HealthInterval = Annotated[float, typer.Option(help="seconds between device health checks")]
LogLevel = Annotated[str, typer.Option(help="debug, info, warning or error")]


def check_kubeconfig(kubeconfig: Path | None) -> None:
    if kubeconfig is not None and not kubeconfig.is_file():
        raise UsageError(f"--kubeconfig {kubeconfig}: no such file")


class NodeAgentOptions(TypedDict):
    """What the device plugin and the DRA driver are both told, checked; their configs take these
    as keywords (`PluginConfig(**options, ...)`)."""

    node_name: str
    kubeconfig: Path | None
    dev_root: Path
    sys_root: Path
    logical_nc_config: Path
    cores_per_device: int | None
    health_interval: float


def node_agent_options(
    *,
    node_name: str | None,
    kubeconfig: Path | None,
    dev_root: Path,
    sys_root: Path,
    logical_nc_config: Path,
    cores_per_device: int | None,
    health_interval: float,
    log_level: str,
    **own: object,
) -> tuple[NodeAgentOptions, str]:
    """A node agent command's shared options, checked, and its log level. Called with all the
    command's parameters (`**ctx.params`); the command checks its `own` itself. Raises
    UsageError naming the option."""
    if not node_name:
        raise UsageError("--node-name (or NODE_NAME) is required")
    level = check_log_level(log_level)
    if cores_per_device is not None and cores_per_device < 1:
        raise UsageError(f"--cores-per-device {cores_per_device}: must be at least 1")
    check_positive("--health-interval", health_interval)
    check_kubeconfig(kubeconfig)
    options = NodeAgentOptions(
        node_name=node_name,
        kubeconfig=kubeconfig,
        dev_root=dev_root,
        sys_root=sys_root,
        logical_nc_config=logical_nc_config,
        cores_per_device=cores_per_device,
        health_interval=health_interval,
    )
    return options, level


def check_positive(option: str, value: float) -> None:
    if value <= 0:
        raise UsageError(f"{option} {value}: must be positive")
