"""What every command shares: errors a person can fix as one line and an exit code, never a
traceback, and the process's log format (one line per message, whatever text it carries).

Each package's `command` module defines its commands with these; `cli` only registers them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

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

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = loggable(record.message, LINE_LIMIT)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(f"    {loggable(line, LINE_LIMIT)}" for line in text.splitlines())


def setup_logging(level: str) -> None:
    """One format for every long-running command; third-party chatter kept at INFO or above."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    quieter = max(logging.INFO, logging.getLogger().level)
    # grpc's debug output is one line per call on every stream; aiohttp's per connection.
    for name in ("grpc", "aiohttp", "asyncio"):
        logging.getLogger(name).setLevel(quieter)
