"""Session-wide real control plane, extender and kube-scheduler; per-test scenarios."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT, Scenario, own_stacks
from tests.testbed import ControlPlane, Stack, find_kubebin
from tests.testbed.kubeversion import binary_version, unmet

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


def _mode(item: pytest.Item) -> bool | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("mode") if callspec is not None else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within each run of one module's tests, those of the node mode in force come first, then
    the other's: a random order (`make test`) shuffles tests within their module, which would
    otherwise restart kube-scheduler (`mode`) at almost every test. Each mode's tests keep their
    shuffled order; pytest's own order (every module's tests of one mode, then the other's)
    comes through unchanged."""
    _skip_what_the_version_lacks(items)
    ordered: list[pytest.Item] = []
    current: bool | None = None
    for _, run in itertools.groupby(items, key=lambda item: item.path):
        tests = list(run)
        modes = [m for m in dict.fromkeys(map(_mode, tests)) if m is not None]
        modes.sort(key=lambda m: m != current)  # the mode in force first
        if modes:
            tests.sort(key=lambda t: -1 if _mode(t) is None else modes.index(_mode(t)))
            current = modes[-1]
        ordered += tests
    items[:] = ordered


def _skip_what_the_version_lacks(items: list[pytest.Item]) -> None:
    """A test marked `needs(...)` is skipped on a version that lacks what it names, with the
    reason (tests/testbed/kubeversion.py NEEDS): a compatibility run on an older version says
    what it did not try and why, as docs/install.md's "Tested on" table does."""
    marked = [(item, [n for m in item.iter_markers("needs") for n in m.args]) for item in items]
    marked = [(item, needs) for item, needs in marked if needs]
    if not marked:
        return
    version = binary_version(find_kubebin(ROOT))
    for item, needs in marked:
        why = unmet(version, needs)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))


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
    stacks = [s for s in (_stack, *own_stacks) if s is not None]
    if report.failed and "e2e" in str(item.path):
        logs = {name: path for stack in stacks for name, path in stack.logs().items()}
        for component, path in logs.items():
            try:
                lines = path.read_text(errors="replace").splitlines()[-60:]
            except OSError:
                continue
            report.sections.append((f"{component} log (last 60 lines)", "\n".join(lines)))
