from __future__ import annotations

import pytest
from random_order.config import Config as RandomOrder

from neuron_scheduler.core.catalog import Catalog


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    return Catalog.builtin()


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
