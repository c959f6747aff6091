"""The DRA driver: a second front end of the same catalog and allocator, for nodes that use
Kubernetes Dynamic Resource Allocation instead of our device plugin.

Every legal set of Neuron devices, and every legal window of NeuronCores up to a configured size,
is published as one device (`shapes`, `slices`) consuming counters of what it takes, so the
scheduler's own allocator can only ever pick a legal set, and never two that share a core;
`devicegroups` adds AWS's EFA alignment attributes. On the node, `preparing` re-checks an
allocated claim and writes its CDI spec (`cdi`), remembered across restarts (`checkpoint`);
`service` serves kubelet's registration and DRAPlugin APIs; `publisher` keeps the ResourceSlices
current; `driver` runs it all; `command` is the CLI entry point. `firstfit` models the scheduler's
decision over our devices (for benchmarks, and for the extender's node score of pods with our
claims, `scoring`).

Kept free of imports so that loading the CLI does not load gRPC.
"""

import re
from pathlib import Path

from neuron_scheduler.core.resources import DRA_DRIVER

DEFAULT_DRIVER_NAME = DRA_DRIVER
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_CDI_ROOT = Path("/var/run/cdi")
DEFAULT_LOGICAL_NC_CONFIG = Path("/opt/aws/neuron/logical_nc_config")
# Core windows are published for these counts: powers of two, which cost kube-scheduler about
# what every count up to 4 does and serve claims up to 16 cores (BENCHMARKS.md "DRA at 500
# nodes" weighs slice sizes and the scheduler's time against them).
DEFAULT_CORE_WINDOWS = (1, 2, 4, 8, 16)


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+")
# Not ours to publish under: AWS's driver is neuron.aws.com.
FOREIGN_DOMAINS = ("aws.com", "amazonaws.com", "amazon.com", "k8s.io", "kubernetes.io")


def driver_name_problem(name: str) -> str | None:
    """Why a driver name cannot be used, or None."""
    if len(name) > 63 or not _DNS_SUBDOMAIN.fullmatch(name):
        return (
            f"{name[:80]!r} is not a domain-qualified DNS subdomain of at most 63 characters "
            "(e.g. neuron.example.com)"
        )
    for domain in FOREIGN_DOMAINS:
        if name == domain or name.endswith("." + domain):
            return f"{name} is under {domain}, which is not ours to publish devices for"
    return None
