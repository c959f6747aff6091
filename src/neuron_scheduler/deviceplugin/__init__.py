"""The Neuron device plugin: kubelet's side of the scheduler's choice.

One gRPC endpoint per resource (neuroncore, neuron, neurondevice) in kubelet's device plugin
directory. Discovery and health come from /dev and sysfs (`hardware`, `inventory`,
`devicewatch`); `registration` serves and keeps the endpoints registered; `assigning` and
`matching` turn kubelet's id-only requests into the containers the scheduler annotated, and
`admission` says which pod kubelet is admitting (its pod resources, else its own order);
`holdings` reads which container kubelet really gave each id (its pod resources API, stubs in
podresources/), `reconciling` finds the annotations that disagree and `correcting` rewrites them;
`plugin` runs it all; `command` is the CLI entry point.

Kept free of imports so that loading the CLI does not load gRPC.
"""

from pathlib import Path

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_LOGICAL_NC_CONFIG = Path("/opt/aws/neuron/logical_nc_config")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
