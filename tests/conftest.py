from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from random_order.config import Config as RandomOrder

from neuron_scheduler.core.catalog import Catalog


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    return Catalog.builtin()


@pytest.fixture(autouse=True)
def log_levels() -> Iterator[None]:
    """Commands run in-process set log levels for the whole process: `status` and `why` quiet
    the package's logger (live/commands.py `_quiet`), the device plugin's and DRA driver's
    commands set the root logger to their --log-level (commandline.setup_logging). Left behind,
    they hide or add records a later test reads from caplog: in a random order, device plugin
    tests after test_live_commands and test_waking after test_deviceplugin_command failed so
    (on ea36366 too). Each test starts with the levels the session started with."""
    loggers = [logging.getLogger(), logging.getLogger("neuron_scheduler")]
    levels = [logger.level for logger in loggers]
    # basicConfig(force=True) also swaps the root's handlers for one on the stderr pytest
    # captured for that test and closes afterwards ("I/O operation on closed file" later).
    handlers = list(logging.getLogger().handlers)
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)
    root = logging.getLogger()
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """`make test` runs the tests in a random order (pytest-random-order: modules shuffled, and
    tests within each module); the seed, again at the end where a failure is read, replays it."""
    order = RandomOrder(config)
    if order.is_enabled:
        terminalreporter.write_line(
            f"random order: --random-order-bucket={order.bucket_type} "
            f"--random-order-seed={order.seed} (replay: make test "
            f"PYTEST_ARGS=--random-order-seed={order.seed})"
        )
