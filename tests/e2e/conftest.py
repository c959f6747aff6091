"""Session-wide real control plane, extender and kube-scheduler; per-test scenarios."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT, Scenario
from tests.testbed import ControlPlane, Stack, find_kubebin

pytestmark = pytest.mark.e2e

_stack: Stack | None = None


@pytest.fixture(scope="session")
def kubebin() -> Path:
    return find_kubebin(ROOT)


@pytest.fixture(scope="session")
def control_plane(kubebin: Path) -> Iterator[ControlPlane]:
    # No workdir: a temporary one, removed at the end unless start-up failed (its logs stay).
    with ControlPlane(kubebin) as cp:
        yield cp


@pytest.fixture(scope="session")
def stack(control_plane: ControlPlane) -> Iterator[Stack]:
    global _stack
    _stack = Stack(control_plane)
    yield _stack
    _stack.stop()
    _stack = None


@pytest.fixture(scope="session", params=[True, False], ids=["nodeCacheCapable", "fullNodeList"])
def mode(request: pytest.FixtureRequest, stack: Stack) -> bool:
    value = bool(request.param)
    stack.use_scheduler(value)
    return value


@pytest.fixture
def scenario(stack: Stack, mode: bool) -> Iterator[Scenario]:
    if not stack.extender.process.alive():
        stack.extender.start()  # a previous test killed it and failed before restarting it
    s = Scenario(stack)
    yield s
    s.cleanup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _stack is not None and "e2e" in str(item.path):
        for component, path in _stack.logs().items():
            try:
                lines = path.read_text(errors="replace").splitlines()[-60:]
            except OSError:
                continue
            report.sections.append((f"{component} log (last 60 lines)", "\n".join(lines)))
