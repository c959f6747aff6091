"""The Registrar says when a kubelet starts while the plugin watches: the pods bound by then reach
that kubelet in one batch."""

from __future__ import annotations

from pathlib import Path

from neuron_scheduler.deviceplugin.registration import KUBELET_SOCKET, Registrar


def registrar(plugin_dir: Path, starts: list[int]) -> Registrar:
    async def started() -> None:
        starts.append(1)

    return Registrar(plugin_dir, [], on_kubelet_start=started)


async def test_a_kubelet_that_starts_while_the_plugin_watches_is_said(tmp_path: Path) -> None:
    plugin_dir = tmp_path / "device-plugins"
    starts: list[int] = []
    subject = registrar(plugin_dir, starts)
    await subject.tick()  # no directory: kubelet has not started
    plugin_dir.mkdir()
    await subject.tick()  # no socket yet
    assert starts == []
    (plugin_dir / KUBELET_SOCKET).touch()
    await subject.tick()
    await subject.tick()
    assert starts == [1]
    (plugin_dir / KUBELET_SOCKET).unlink()  # kubelet restarts: a new socket
    await subject.tick()
    (plugin_dir / KUBELET_SOCKET).touch()
    await subject.tick()
    assert starts == [1, 1]


async def test_a_kubelet_running_before_the_plugin_is_not_said(tmp_path: Path) -> None:
    (tmp_path / KUBELET_SOCKET).touch()
    starts: list[int] = []
    subject = registrar(tmp_path, starts)
    await subject.tick()
    await subject.tick()
    assert starts == []
