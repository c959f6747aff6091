from __future__ import annotations

import pytest

from neuron_scheduler.core.catalog import Catalog


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    return Catalog.builtin()
