"""The `status` and `why` commands. `register(app)` adds them to a typer app: the project CLI, and
the `kubectl-neuron` plugin (cli.py), so `kubectl neuron status` works too.

Both only read (nodes and pods: get, list; `status` also lists Leases for consolidation's
eviction budget, and says so when it may not). The cluster is found as kubectl finds it
(`--kubeconfig`, $KUBECONFIG, ~/.kube/config, the pod's service account); `why` takes its
namespace from `-n`, else the kubeconfig context's, else `default`. The kube client, the ledger
and matplotlib are imported inside the commands, so `--help` stays fast.

Exit codes: 0 the answer was printed; 1 the cluster could not be read, or `why` has nothing to
say (no such pod, not pending, no Neuron request); 2 bad input (one line on stderr).
"""

from __future__ import annotations

import asyncio
import binascii
import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from neuron_scheduler.commandline import UsageError, fail, out, user_errors
from neuron_scheduler.kube.names import LABEL, SUBDOMAIN

if TYPE_CHECKING:
    from neuron_scheduler.core.catalog import Catalog
    from neuron_scheduler.kube.config import KubeConfig
    from neuron_scheduler.kube.objects import Pod
    from neuron_scheduler.live.snapshot import Snapshot

Kubeconfig = Annotated[
    Path | None,
    typer.Option(
        help="kubeconfig file (default: as kubectl: $KUBECONFIG, ~/.kube/config, in-cluster)"
    ),
]
TopologyFile = Annotated[
    Path | None,
    typer.Option(
        "--topology-file", help="the extender's YAML file adding or overriding instance types"
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]
RBAC_HINT = "reading needs get and list on nodes and pods (docs/operations.md, 'Access')"
SERVER_URL = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?", re.IGNORECASE)
REQUEST_SECONDS = 30.0  # per API call (a page of 500 pods from a busy API server)


def _quiet() -> None:
    # The ledger logs what the extender would turn into events (unusable nodes, unreadable
    # annotations); the views print those themselves.
    logging.getLogger("neuron_scheduler").setLevel(logging.ERROR)


def one_line(text: str) -> str:
    """A message as one line (YAML and TLS errors come over several)."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or text


def _setup(kubeconfig: Path | None, topology_file: Path | None) -> tuple[KubeConfig, Catalog]:
    from neuron_scheduler.core.catalog import Catalog, CatalogError
    from neuron_scheduler.kube.config import ConfigError, kubectl_config

    _quiet()
    try:
        config = kubectl_config(kubeconfig)
        catalog = Catalog.load(topology_file)
    except (CatalogError, ConfigError) as error:
        fail(one_line(str(error)))
    except binascii.Error as error:  # certificate or key data that is not base64
        fail(f"kubeconfig: embedded certificate or key data is not base64 ({error})")
    if not SERVER_URL.fullmatch(config.server):
        fail(f"kubeconfig: server {shown_url(config.server)!r} is not an http(s) URL")
    return config, catalog


def shown_url(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:200])


def _read_failed(error: BaseException, config: KubeConfig) -> NoReturn:
    from neuron_scheduler.kube.errors import ApiError, error_text

    if isinstance(error, TimeoutError):
        text = f"no answer from {shown_url(config.server)} within {REQUEST_SECONDS:g}s"
    else:
        text = one_line(error_text(error))
    hint = f"; {RBAC_HINT}" if isinstance(error, ApiError) and error.status in (401, 403) else ""
    fail(f"cannot read the cluster: {text}{hint}", 1)


def status(
    kubeconfig: Kubeconfig = None,
    node: Annotated[str | None, typer.Option(help="only this node")] = None,
    as_json: AsJson = False,
    report: Annotated[
        Path | None,
        typer.Option(help="also write device maps (as simulate --report) and status.json here"),
    ] = None,
    topology_file: TopologyFile = None,
) -> None:
    """Which Neuron devices are free where: each node's pods and ids, and the UltraServers with
    the training jobs' claims, from the live cluster."""

    from rich.text import Text

    from neuron_scheduler.core.resources import DRA_DRIVER
    from neuron_scheduler.kube.client import KubeAPI, ListTooLong
    from neuron_scheduler.kube.errors import READ_ERRORS
    from neuron_scheduler.live.consolidation import (
        capacity_json,
        consolidation_json,
        consolidation_view,
    )
    from neuron_scheduler.live.dranodes import dra_json, dra_text
    from neuron_scheduler.live.fleet import fleet_json, fleet_view
    from neuron_scheduler.live.gated import gated_json
    from neuron_scheduler.live.snapshot import Budget, read_budget, read_cluster
    from neuron_scheduler.live.terminal import (
        consolidation_block,
        gated_lines,
        shown,
        status_view,
        ultraserver_tables,
    )
    from neuron_scheduler.live.ultraservers import ultraserver_json, ultraserver_view

    config, catalog = _setup(kubeconfig, topology_file)
    unreadable: tuple[type[BaseException], ...] = (*READ_ERRORS, ListTooLong)

    async def read() -> tuple[Snapshot, Budget]:
        async with KubeAPI(config, timeout=REQUEST_SECONDS) as api:
            # (the gated groups, and their Workloads, are shown for the whole fleet only)
            snapshot = await read_cluster(api, catalog, kueue_workloads=node is None)
            return snapshot, await read_budget(api)

    try:
        snapshot, budget = asyncio.run(read())
    except unreadable as error:
        _read_failed(error, config)
    plans = consolidation_view(snapshot.plans, budget, time.time(), snapshot.placeholders)
    ledger = snapshot.ledger
    ultraservers = ultraserver_view(snapshot.occupancy, ledger, time.time(), snapshot.claims_unread)
    names = None
    if node is not None:
        if node not in ledger.nodes and node not in ledger.unusable:
            known = "advertises no Neuron resources" if node in snapshot.node_names else "not found"
            fail(f"node {shown(node)}: {known}", 1)
        names = [node]
    fleet = fleet_view(ledger, names, snapshot.other_nodes if node is None else 0)
    if as_json:
        document = fleet_json(fleet) | {
            "consolidation": consolidation_json(plans),
            "capacity_requests": capacity_json(plans),
        }
        if node is None:
            document["ultraservers"] = ultraserver_json(ultraservers)
            document["dra"] = dra_json(snapshot.dra, snapshot.dra_unread, DRA_DRIVER)
            document["gated"] = gated_json(snapshot.gated)
        print(json.dumps(document, indent=2))
    else:
        for part in status_view(fleet):
            out.print(part)
        if node is None and not ultraservers.empty:
            for part in ultraserver_tables(ultraservers):
                out.print(part)
        if node is None:
            for line in gated_lines(snapshot.gated):
                out.print(line)
        if node is None and (snapshot.dra or snapshot.dra_unread):
            dra = dra_text(snapshot.dra) if snapshot.dra else ""
            out.print(Text(f"DRA: {shown(snapshot.dra_unread or dra, 2000)}"))
        out.print(consolidation_block(plans))
    if report is not None:
        try:
            from neuron_scheduler.live.pictures import write_pictures
        except ImportError as error:  # matplotlib is the `sim` extra, not in the server image
            fail(f"--report needs matplotlib ({error}); install neuron-scheduler[sim]")
        try:
            written = write_pictures(fleet, report)
        except OSError as error:
            fail(f"cannot write the report to {report}: {error.strerror or error}")
        # On stderr with --json: stdout stays one JSON document.
        typer.echo(f"wrote {len(written)} files to {report}/", err=as_json)


def _pod_name(text: str) -> str:
    """`name`, `pod/name` or `pods/name`, as kubectl takes them."""
    kind, slash, name = text.partition("/")
    if slash:
        if kind not in ("pod", "pods", "po"):
            raise UsageError(f"{text!r}: only pods can be asked about (pod/NAME or NAME)")
        text = name
    if not SUBDOMAIN.fullmatch(text):
        raise UsageError(f"{text!r} is not a pod name (lower-case letters, digits, '-' and '.')")
    return text


def why(
    pod: Annotated[str, typer.Argument(help="the pending pod: NAME or pod/NAME")],
    namespace: Annotated[
        str | None,
        typer.Option("--namespace", "-n", help="its namespace (default: the context's)"),
    ] = None,
    kubeconfig: Kubeconfig = None,
    as_json: AsJson = False,
    topology_file: TopologyFile = None,
) -> None:
    """Why a pod is pending: each Neuron node's answer, and what would have to be freed."""
    from neuron_scheduler.kube.client import KubeAPI, ListTooLong
    from neuron_scheduler.kube.errors import READ_ERRORS, NotFound, error_text
    from neuron_scheduler.live.diagnosis import (
        NotPending,
        diagnose,
        diagnosis_json,
        failed_devices_of,
        on_failed_devices_text,
        pending_request,
    )
    from neuron_scheduler.live.dranodes import dra_text
    from neuron_scheduler.live.snapshot import read_cluster, read_dra_nodes, read_workload
    from neuron_scheduler.live.terminal import why_view
    from neuron_scheduler.live.workloadstatus import WorkloadReport, report_of

    with user_errors():
        name = _pod_name(pod)
        if namespace is not None and not LABEL.fullmatch(namespace):
            raise UsageError(f"-n {namespace!r} is not a namespace name")
    config, catalog = _setup(kubeconfig, topology_file)
    ns = namespace or config.namespace or "default"
    unreadable: tuple[type[BaseException], ...] = (*READ_ERRORS, ListTooLong)
    if not LABEL.fullmatch(ns):
        fail(f"the kubeconfig's namespace {ns!r} is not a namespace name")

    async def read_pod() -> Pod:
        async with KubeAPI(config, timeout=REQUEST_SECONDS) as api:
            return await api.get_pod(ns, name)

    async def read() -> Snapshot:
        async with KubeAPI(config, timeout=REQUEST_SECONDS) as api:
            return await read_cluster(api, catalog)

    async def dra_answer(pending: Pod) -> str:
        """A pod with DRA claims: kube-scheduler's DRA plugin places it; what our driver's
        nodes say of their failed devices (status says the same)."""
        async with KubeAPI(config, timeout=REQUEST_SECONDS) as api:
            try:
                nodes, unread = await read_dra_nodes(api)
            except unreadable as error:
                nodes, unread = (), error_text(error)
        where = unread or (dra_text(nodes) if nodes else "no node is served by DRA")
        return (
            f"It asks through DRA claims ({len(pending.spec.resourceClaims)}): kube-scheduler's "
            "DRA plugin places it (`kubectl describe pod` shows its reason), on connected "
            f"devices our driver publishes and never on a tainted one. {where}"
        )

    async def workload_of(namespace: str, workload: str) -> WorkloadReport:
        """What Kueue says of the gated pod's Workload (not being able to read it is said too:
        the rest of the answer stands without it)."""
        async with KubeAPI(config, timeout=REQUEST_SECONDS) as api:
            read = await read_workload(api, namespace, workload)
        return report_of(f"{namespace}/{workload}", read)

    async def failed_on(bound: Pod) -> tuple[int, ...]:
        """The failed devices the bound pod runs on; none when its node cannot be read."""
        async with KubeAPI(config, timeout=REQUEST_SECONDS) as api:
            try:
                node = await api.get_node(bound.spec.nodeName)
            except READ_ERRORS:
                return ()
        return failed_devices_of(bound, node, catalog)

    try:
        found = asyncio.run(read_pod())
    except NotFound:
        fail(f"pod {ns}/{name} not found", 1)
    except READ_ERRORS as error:
        _read_failed(error, config)
    try:
        pending_request(found)  # before listing the whole cluster
    except NotPending as error:
        text = str(error)
        if found.spec.nodeName:
            failed = asyncio.run(failed_on(found))
            if failed:
                text = f"{text}; {on_failed_devices_text(found, failed)}"
        elif found.spec.resourceClaims and not found.finished:
            text = f"{text}. {asyncio.run(dra_answer(found))}"
        fail(text, 1)
    try:
        snapshot = asyncio.run(read())
    except unreadable as error:
        _read_failed(error, config)
    snapshot.apply_pod(found)  # as read just now (the list may be older)
    diagnosis = diagnose(
        snapshot.ledger,
        found,
        snapshot.other_nodes,
        occupancy=snapshot.occupancy,
        plans=snapshot.plans,
        movability=snapshot.movability,
        placeholders=snapshot.placeholders,
        catalog=catalog,
        now=time.time(),
    )
    gate = diagnosis.gating
    if gate is not None and gate.workload:
        diagnosis = dataclasses.replace(
            diagnosis, workload=asyncio.run(workload_of(gate.namespace, gate.workload))
        )
    if as_json:
        print(json.dumps(diagnosis_json(diagnosis), indent=2))
        return
    for part in why_view(diagnosis):
        out.print(part)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("why")(why)
