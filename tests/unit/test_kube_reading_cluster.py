"""What the commands a person runs read from the API: where kubectl would find the cluster, and
lists read page by page with a bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from neuron_scheduler.kube.client import KubeAPI, ListTooLong
from neuron_scheduler.kube.config import ConfigError, KubeConfig, kubectl_config


class Item(msgspec.Struct):
    name: str


class Pager:
    """/items in pages of the asked limit; `endless` answers a continue token forever."""

    def __init__(self, count: int, endless: bool = False) -> None:
        self.count = count
        self.endless = endless
        self.calls: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        params = dict(request.query)
        self.calls.append(params)
        start = int(params.get("continue") or 0)
        limit = int(params["limit"])
        items = [{"name": f"i{n}"} for n in range(start, min(start + limit, self.count))]
        meta: dict[str, Any] = {}
        if self.endless or start + limit < self.count:
            meta["continue"] = str(start + limit)
        return web.json_response({"metadata": meta, "items": items})


async def serve(pager: Pager) -> tuple[web.AppRunner, KubeAPI]:
    app = web.Application()
    app.router.add_get("/items", pager.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, KubeAPI(KubeConfig(f"http://127.0.0.1:{runner.addresses[0][1]}"))


async def test_list_all_follows_continue_tokens_and_keeps_the_callers_params() -> None:
    pager = Pager(7)
    runner, api = await serve(pager)
    try:
        items = await api.list_all("/items", Item, params={"fieldSelector": "x=y"}, page=3)
    finally:
        await api.close()
        await runner.cleanup()
    assert [i.name for i in items] == [f"i{n}" for n in range(7)]
    assert [c.get("continue") for c in pager.calls] == [None, "3", "6"]
    assert all(c["fieldSelector"] == "x=y" and c["limit"] == "3" for c in pager.calls)


async def test_a_list_that_never_ends_is_refused_not_read_forever() -> None:
    pager = Pager(10**9, endless=True)
    runner, api = await serve(pager)
    try:
        with pytest.raises(ListTooLong, match="more than 20 objects"):
            await api.list_all("/items", Item, page=5, most=20)
    finally:
        await api.close()
        await runner.cleanup()
    assert len(pager.calls) <= 5
    # Empty pages with a token forever: bounded by pages too.
    pager = Pager(0, endless=True)
    runner, api = await serve(pager)
    try:
        with pytest.raises(ListTooLong):
            await api.list_all("/items", Item, page=5, most=20)
    finally:
        await api.close()
        await runner.cleanup()
    assert len(pager.calls) == 5


def kubeconfig(path: Path, server: str, namespace: str = "") -> Path:
    context: dict[str, str] = {"cluster": "c", "user": "u"}
    if namespace:
        context["namespace"] = namespace
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "x",
        "contexts": [{"name": "x", "context": context}],
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    }
    path.write_text(msgspec.json.encode(document).decode())
    return path


def test_kubectl_config_looks_where_kubectl_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(ConfigError, match="no kubeconfig"):
        kubectl_config(None)
    (tmp_path / ".kube").mkdir()
    kubeconfig(tmp_path / ".kube" / "config", "https://home:6443")
    assert kubectl_config(None).server == "https://home:6443"
    # $KUBECONFIG is a list: the first file that exists wins over ~/.kube/config.
    listed = kubeconfig(tmp_path / "b.yaml", "https://listed:6443", namespace="team")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing.yaml'}:{listed}")
    config = kubectl_config(None)
    assert (config.server, config.namespace) == ("https://listed:6443", "team")
    # --kubeconfig wins over both.
    given = kubeconfig(tmp_path / "c.yaml", "https://given:6443")
    assert kubectl_config(given).server == "https://given:6443"
    assert kubectl_config(given).namespace == ""


@pytest.mark.parametrize(
    ("served", "forbidden", "expected"),
    [
        ({"/v1beta1/groups", "/v1alpha2/groups"}, set(), "/v1beta1/groups"),  # 1.37
        ({"/v1alpha2/groups"}, set(), "/v1alpha2/groups"),  # 1.36
        (set(), set(), None),  # neither, or older
        # Not ours to read: the caller's own list meets the 403 and says so.
        ({"/v1alpha2/groups"}, {"/v1beta1/groups"}, "/v1beta1/groups"),
    ],
)
async def test_first_served_takes_the_first_version_not_answered_404(
    served: set[str], forbidden: set[str], expected: str | None
) -> None:
    """One resource in several API versions (PodGroups: v1beta1 in 1.37, v1alpha2 in 1.36)."""
    asked: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        asked.append(request.path)
        if request.path in forbidden:
            return web.json_response({"message": "forbidden"}, status=403)
        if request.path in served:
            return web.json_response({"metadata": {}, "items": []})
        return web.json_response({"message": "not found"}, status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    api = KubeAPI(KubeConfig(f"http://127.0.0.1:{runner.addresses[0][1]}"))
    paths = ("/v1beta1/groups", "/v1alpha3/groups", "/v1alpha2/groups")
    try:
        assert await api.first_served(paths) == expected
    finally:
        await api.close()
        await runner.cleanup()
    # Asked in order, and no further than the first it could take.
    assert asked == list(paths[: paths.index(expected) + 1] if expected else paths)
