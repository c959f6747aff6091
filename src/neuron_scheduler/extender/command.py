"""The `extender` command. `register(app)` adds it to a typer app (the project CLI does).

Options are checked here, before anything starts, so a mistake is one line naming the option.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from neuron_scheduler.commandline import UsageError, check_log_level, user_errors
from neuron_scheduler.core.catalog import Catalog, CatalogError
from neuron_scheduler.jobs.network import EKS_LEVELS, LevelsError, parse_levels

_CLASS_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?")

TopologyFile = Annotated[
    Path | None,
    typer.Option("--topology-file", help="YAML file adding or overriding instance types."),
]


def extender(
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubeconfig file (default: in-cluster service account)")
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="port kube-scheduler calls")] = 12345,
    tls_cert: Annotated[Path | None, typer.Option(help="serve HTTPS with this certificate")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="key for --tls-cert")] = None,
    client_ca: Annotated[
        Path | None,
        typer.Option(
            help="only callers with a client certificate signed by this CA reach the verbs "
            "(kube-scheduler's extender tlsConfig certFile/keyFile); needs --tls-cert"
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            help="serve the verbs without --client-ca: anyone who reaches the port can have "
            "pods bound (logged as a warning at start)"
        ),
    ] = False,
    metrics_port: Annotated[
        int, typer.Option(help="plain-HTTP port for /healthz, /readyz and /metrics; 0: none")
    ] = 12346,
    scheduler_name: Annotated[
        list[str] | None,
        typer.Option(
            help="a kube-scheduler profile whose pods this extender binds (repeatable; "
            "default my-scheduler)"
        ),
    ] = None,
    topology_file: TopologyFile = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
    body_limit: Annotated[int, typer.Option(help="largest request body in bytes")] = 64 << 20,
    leader_elect: Annotated[
        bool,
        typer.Option(help="take a Lease; only the leader is ready and binds (for >1 replica)"),
    ] = False,
    lease_name: Annotated[str, typer.Option(help="the Lease's name")] = "k8s-neuron-scheduler",
    lease_namespace: Annotated[
        str | None, typer.Option(help="Lease namespace (default: this pod's, or kube-system)")
    ] = None,
    lease_identity: Annotated[
        str | None, typer.Option(help="this replica's name in the Lease (default: $POD_NAME)")
    ] = None,
    lease_duration: Annotated[
        float, typer.Option(help="seconds a standby waits before taking over a silent leader")
    ] = 15.0,
    renew_deadline: Annotated[
        float, typer.Option(help="seconds the leader keeps leading without a renewal")
    ] = 10.0,
    retry_period: Annotated[float, typer.Option(help="seconds between Lease rounds")] = 2.0,
    wake_rate: Annotated[
        float,
        typer.Option(
            help="annotation writes per second that wake pending pods the extender refused once "
            "room frees for them (kube-scheduler sees no event for holds that end); 0: only log "
            "which pods would be woken"
        ),
    ] = 20.0,
    wake_grace: Annotated[
        float,
        typer.Option(
            help="seconds kube-scheduler gets to retry a refused pod itself after a cluster "
            "event freed its room, before the extender wakes it"
        ),
    ] = 0.5,
    ultraserver_claim_seconds: Annotated[
        float,
        typer.Option(
            "--job-claim-seconds",
            "--ultraserver-claim-seconds",
            help="how long a training job's Pending claim lasts after the job last did anything "
            "(kube-scheduler asked about one of its members); --ultraserver-claim-seconds is its "
            "first name",
        ),
    ] = 120.0,
    topology_levels: Annotated[
        str,
        typer.Option(
            help="the network's topology levels, broadest first: node-label keys, comma "
            "separated, training jobs are placed close in ('' for none; docs/training-jobs.md)"
        ),
    ] = ",".join(EKS_LEVELS),
    consolidation: Annotated[
        str,
        typer.Option(
            help="off, dry-run or on: move pods that can go elsewhere (Eviction API) so a pod "
            "that fits by count but finds no free block gets one; dry-run only writes an event "
            "on the pending pod saying what it would evict (docs/consolidation.md)"
        ),
    ] = "dry-run",
    consolidation_pending_seconds: Annotated[
        float,
        typer.Option(help="how long a pod waits, unschedulable, before consolidation plans for it"),
    ] = 30.0,
    consolidation_max_plans: Annotated[
        int, typer.Option(help="consolidation plans in flight at once, cluster-wide")
    ] = 2,
    consolidation_node_cooldown: Annotated[
        float, typer.Option(help="seconds between two consolidation plans on one node")
    ] = 120.0,
    consolidation_evictions_per_hour: Annotated[
        int, typer.Option(help="evictions consolidation may make in any hour")
    ] = 30,
    consolidation_plan_seconds: Annotated[
        float,
        typer.Option(
            help="how long a plan's holds last at most (the freed block, the places held for "
            "the moved pods' replacements)"
        ),
    ] = 300.0,
    consolidation_max_victims: Annotated[
        int, typer.Option(help="pods one consolidation plan may evict")
    ] = 16,
    consolidation_lease: Annotated[
        str,
        typer.Option(
            help="the Lease (in --lease-namespace) that keeps consolidation's eviction budget "
            "across restarts"
        ),
    ] = "k8s-neuron-scheduler-consolidation",
    capacity_requests: Annotated[
        str,
        typer.Option(
            help="off or on: ask the cluster's autoscaler for a node (a placeholder pod in "
            "--lease-namespace) for a pod stranded by fragmentation that consolidation cannot "
            "help (docs/autoscaling.md)"
        ),
    ] = "off",
    capacity_pending_seconds: Annotated[
        float,
        typer.Option(help="how long a stranded pod waits, unschedulable, before a node is asked"),
    ] = 120.0,
    capacity_max_in_flight: Annotated[
        int, typer.Option(help="placeholders waiting for a node at once, cluster-wide")
    ] = 2,
    capacity_timeout: Annotated[
        float,
        typer.Option(
            help="seconds a placeholder waits for a node; then it is removed, the pod gets an "
            "event, and it is not asked for again for as long"
        ),
    ] = 600.0,
    capacity_instance_type: Annotated[
        list[str] | None,
        typer.Option(
            help="an instance type a node may be asked of (repeatable; default: the types of "
            "the nodes the pod may go to)"
        ),
    ] = None,
    capacity_priority_class: Annotated[
        str,
        typer.Option(help="the placeholders' PriorityClass (the chart's: value -10)"),
    ] = "neuron-scheduler-capacity-request",
    capacity_placeholder_image: Annotated[
        str, typer.Option(help="the placeholders' image (never run: they are never bound)")
    ] = "registry.k8s.io/pause:3.10",
    autoscaler_do_not_disrupt: Annotated[
        bool,
        typer.Option(
            help="mark bound pods that no other node has a legal block for with "
            "karpenter.sh/do-not-disrupt (Karpenter's count-based consolidation would move them "
            "where they do not fit), and lift the mark when one has (docs/autoscaling.md)"
        ),
    ] = False,
    capacity_owner: Annotated[
        str | None,
        typer.Option(
            help="the value of the placeholders' label, telling this extender's from others' "
            "(default: --lease-name)"
        ),
    ] = None,
    device_failure_action: Annotated[
        str,
        typer.Option(
            help="report or evict: what the leader does about a pod running on a device that "
            "failed (always a warning event on it; evict also moves it through the Eviction "
            "API when a controller recreates it: docs/operations.md)"
        ),
    ] = "report",
    kueue_admission_check: Annotated[
        bool,
        typer.Option(
            help="answer Kueue's AdmissionChecks whose controllerName is "
            "neuron-scheduler.io/placement: a workload is admitted only when its pods can be "
            "placed now, and what they need is held for them until they bind (docs/kueue.md)"
        ),
    ] = False,
    kueue_hold_seconds: Annotated[
        float,
        typer.Option(
            help="how long the blocks and units held for a workload the check admitted wait for "
            "its pods to bind; then they are let go and the check goes to Retry"
        ),
    ] = 120.0,
    dra_driver: Annotated[
        str,
        typer.Option(
            help="score nodes for pods with claims of this DRA driver's classes "
            "(POST /prioritize-claims); empty: none"
        ),
    ] = "",
    dra_device_class_prefix: Annotated[
        str, typer.Option(help="its DeviceClasses for k connected devices: <prefix>-k")
    ] = "neuron",
    dra_core_class_prefix: Annotated[
        str, typer.Option(help="its DeviceClasses for k connected NeuronCores: <prefix>-k")
    ] = "neuroncore",
) -> None:
    """Serve kube-scheduler's extender calls: POST /filter, /prioritize, /bind, /preempt, and
    /prioritize-claims for pods with DRA claims."""
    from neuron_scheduler.dra import driver_name_problem
    from neuron_scheduler.extender.loops.consolidating import Limits, Mode
    from neuron_scheduler.extender.loops.devicefailures import Action
    from neuron_scheduler.extender.loops.requesting import CapacityLimits, CapacityMode
    from neuron_scheduler.extender.serve import ExtenderOptions, run
    from neuron_scheduler.extender.state.dranodes import ClaimClasses
    from neuron_scheduler.extender.verbs.binding import DEFAULT_SCHEDULER_NAMES
    from neuron_scheduler.kube.config import ConfigError, own_namespace
    from neuron_scheduler.kube.election import ElectionConfig, default_identity

    with user_errors(CatalogError, ConfigError):
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        if client_ca is not None and tls_cert is None:
            raise UsageError(
                "--client-ca needs --tls-cert and --tls-key (client certificates are TLS)"
            )
        if client_ca is None and not insecure:
            raise UsageError(
                "the extender binds pods to nodes: give --client-ca with --tls-cert/--tls-key "
                "so only kube-scheduler can call it, or --insecure to accept any caller"
            )
        for path in (tls_cert, tls_key, client_ca):
            if path is not None and not path.is_file():
                raise UsageError(f"{path}: no such file")
        log_level = check_log_level(log_level)
        for option, value in (("--port", port), ("--metrics-port", metrics_port)):
            if not 0 <= value < 65536 or (value == 0 and option == "--port"):
                raise UsageError(f"{option} {value} is not a TCP port")
        if metrics_port == port:
            raise UsageError("--metrics-port must differ from --port")
        if not 0 <= wake_rate <= 1000:
            raise UsageError(f"--wake-rate {wake_rate} is not between 0 and 1000 writes a second")
        if not 0 <= wake_grace <= 60:
            raise UsageError(f"--wake-grace {wake_grace} is not between 0 and 60 seconds")
        if not 1 <= ultraserver_claim_seconds <= 3600:
            raise UsageError(
                f"--job-claim-seconds {ultraserver_claim_seconds} is not between 1 and 3600 seconds"
            )
        try:
            levels = parse_levels(topology_levels)
        except LevelsError as error:
            raise UsageError(f"--topology-levels: {error}") from error
        modes = [m.value for m in Mode]
        if consolidation not in modes:
            raise UsageError(f"--consolidation {consolidation!r} is not one of {', '.join(modes)}")
        bounds: tuple[tuple[str, float, float, float], ...] = (
            ("--consolidation-pending-seconds", consolidation_pending_seconds, 0, 86400),
            ("--consolidation-max-plans", consolidation_max_plans, 1, 100),
            ("--consolidation-node-cooldown", consolidation_node_cooldown, 0, 86400),
            ("--consolidation-evictions-per-hour", consolidation_evictions_per_hour, 0, 10000),
            ("--consolidation-plan-seconds", consolidation_plan_seconds, 10, 3600),
            ("--consolidation-max-victims", consolidation_max_victims, 1, 64),
            ("--capacity-pending-seconds", capacity_pending_seconds, 0, 86400),
            ("--capacity-max-in-flight", capacity_max_in_flight, 1, 100),
            ("--capacity-timeout", capacity_timeout, 10, 86400),
            ("--kueue-hold-seconds", kueue_hold_seconds, 5, 3600),
        )
        for name, amount, low, high in bounds:
            if not low <= amount <= high:
                raise UsageError(f"{name} {amount:g} is not between {low:g} and {high:g}")
        actions = [a.value for a in Action]
        if device_failure_action not in actions:
            raise UsageError(
                f"--device-failure-action {device_failure_action!r} is not one of "
                f"{', '.join(actions)}"
            )
        if not consolidation_lease or len(consolidation_lease) > 253:
            raise UsageError("--consolidation-lease must be a Lease name")
        limits = Limits(
            Mode(consolidation),
            consolidation_pending_seconds,
            consolidation_max_plans,
            consolidation_node_cooldown,
            consolidation_evictions_per_hour,
            consolidation_plan_seconds,
            consolidation_max_victims,
        )
        capacity_modes = [m.value for m in CapacityMode]
        if capacity_requests not in capacity_modes:
            raise UsageError(
                f"--capacity-requests {capacity_requests!r} is not one of "
                f"{', '.join(capacity_modes)}"
            )
        catalog = Catalog.load(topology_file)  # fail now, with the file's name
        for instance_type in capacity_instance_type or ():
            if not catalog.knows(instance_type) or catalog.device_count(instance_type) is None:
                raise UsageError(
                    f"--capacity-instance-type {instance_type!r}: not an instance type of a "
                    "fixed size in the catalog (--topology-file adds types)"
                )
        owner = capacity_owner or lease_name
        for option, text in (
            ("--capacity-owner", owner),
            ("--capacity-priority-class", capacity_priority_class),
            ("--capacity-placeholder-image", capacity_placeholder_image),
        ):
            if not text or len(text) > 253 or not text.isprintable():
                raise UsageError(f"{option} {text[:60]!r} is not a name")
        capacity = CapacityLimits(
            CapacityMode(capacity_requests),
            capacity_pending_seconds,
            capacity_max_in_flight,
            capacity_timeout,
            tuple(capacity_instance_type or ()),
            lease_namespace or own_namespace("kube-system"),
            owner[:63],
            capacity_priority_class,
            capacity_placeholder_image,
        )
        dra = None
        if dra_driver:
            problem = driver_name_problem(dra_driver)
            if problem:
                raise UsageError(f"--dra-driver: {problem}")
            for option, prefix in (
                ("--dra-device-class-prefix", dra_device_class_prefix),
                ("--dra-core-class-prefix", dra_core_class_prefix),
            ):
                if not _CLASS_PREFIX.fullmatch(prefix):
                    raise UsageError(f"{option} {prefix[:60]!r} is not a DNS label prefix")
            if dra_device_class_prefix == dra_core_class_prefix:
                raise UsageError("--dra-device-class-prefix and --dra-core-class-prefix differ")
            dra = ClaimClasses(dra_driver, dra_device_class_prefix, dra_core_class_prefix)
        names = tuple(scheduler_name or DEFAULT_SCHEDULER_NAMES)
        if any(not n for n in names):
            raise UsageError("--scheduler-name cannot be empty")
        election = None
        if leader_elect:
            try:
                election = ElectionConfig(
                    lease_name,
                    lease_namespace or own_namespace("kube-system"),
                    lease_identity or default_identity(),
                    lease_duration,
                    renew_deadline,
                    retry_period,
                )
            except ValueError as error:
                raise UsageError(str(error)) from error
        run(
            ExtenderOptions(
                kubeconfig=kubeconfig,
                host=host,
                port=port,
                tls_cert=tls_cert,
                tls_key=tls_key,
                client_ca=client_ca,
                insecure=insecure,
                metrics_port=metrics_port,
                scheduler_names=names,
                topology_file=topology_file,
                log_level=log_level,
                body_limit=body_limit,
                election=election,
                wake_rate=wake_rate,
                wake_grace=wake_grace,
                claim_seconds=ultraserver_claim_seconds,
                topology_levels=levels,
                consolidation=limits,
                budget_lease=(lease_namespace or own_namespace("kube-system"), consolidation_lease),
                capacity=capacity,
                do_not_disrupt=autoscaler_do_not_disrupt,
                device_failure_action=Action(device_failure_action),
                dra=dra,
                kueue_hold_seconds=kueue_hold_seconds if kueue_admission_check else None,
            )
        )


def register(app: typer.Typer) -> None:
    app.command("extender")(extender)
