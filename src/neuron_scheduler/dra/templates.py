"""What an autoscaler's cloud provider needs to see our devices on a node that does not exist yet:
the ResourceSlices our driver would publish there, per instance type, from the catalog, through
the driver's own slice code (`dra.slices.pool_slices`). Pure.

Karpenter (v1.14+, `IGNORE_DRA_REQUESTS=false`) simulates a new node's DRA devices from
`InstanceType.DynamicResources.ResourceSliceTemplates`, which its cloud provider fills; AWS's
provider has none for Neuron yet (aws/karpenter-provider-aws#9519). Its own allocator handles
partitionable devices with shared counters, so with these it sees contiguity itself: a claim for
a 3-device window strands on a fragmented node and brings a new one (docs/autoscaling.md).
cluster-autoscaler (1.36) takes template slices from its provider the same way.

`slice_templates` gives each instance type a list of resource.k8s.io/v1 ResourceSliceSpec objects
without a node (a template is every node of the type): one pool, named after the type.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra import DEFAULT_CORE_WINDOWS
from neuron_scheduler.dra.shapes import CoreWindows
from neuron_scheduler.dra.slices import JSON, NodeInventory, pool_slices


def slice_templates(
    catalog: Catalog,
    driver: str,
    instance_types: Iterable[str] | None = None,
    core_windows: CoreWindows = DEFAULT_CORE_WINDOWS,
) -> dict[str, list[JSON]]:
    """{instance type: [ResourceSliceSpec, ...]} for the catalog's types of a fixed size (all
    of them by default; types sized by their node, switches, are left out), with the core
    windows the driver publishes (its --core-windows)."""
    if instance_types is None:
        names = [n for n in catalog.instance_types if catalog.device_count(n) is not None]
    else:
        names = list(instance_types)
    templates: dict[str, list[JSON]] = {}
    for name in names:
        if not catalog.knows(name) or catalog.device_count(name) is None:
            raise ValueError(f"{name}: not an instance type of a fixed size in the catalog")
        topology = catalog.resolve(name).topology
        slices = pool_slices(driver, NodeInventory(name, topology, core_windows=core_windows))
        specs = []
        for content in slices:
            spec: dict[str, Any] = content.spec(driver, name, 0, len(slices))
            del spec["nodeName"]  # every node of the type
            specs.append(spec)
        templates[name] = specs
    return templates
