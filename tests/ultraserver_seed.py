"""The Neuron docs' 4-node UltraServer example (seed 004), shared by unit and end-to-end tests."""

from __future__ import annotations

S2_A, S2_B, S4 = "u5wy80u0o2saugxy", "ygml2651y0lwdd46", "bog79p1y8tetj5uu"
# node -> (server-id-2, node-id-2, server-id-4, node-id-4), as `kubectl get nodes` shows them
NODES = {
    "ip-172-32-11-17.ap-southeast-4.compute.internal": (S2_A, 0, S4, 0),
    "ip-172-32-13-57.ap-southeast-4.compute.internal": (S2_A, 1, S4, 1),
    "ip-172-32-5-227.ap-southeast-4.compute.internal": (S2_B, 0, S4, 2),
    "ip-172-32-9-4.ap-southeast-4.compute.internal": (S2_B, 1, S4, 3),
}
# worker pod -> node, as `kubectl get pods` shows them
PODS = {
    "demo-worker-0": "ip-172-32-5-227.ap-southeast-4.compute.internal",
    "demo-worker-1": "ip-172-32-11-17.ap-southeast-4.compute.internal",
    "demo-worker-2": "ip-172-32-13-57.ap-southeast-4.compute.internal",
    "demo-worker-3": "ip-172-32-9-4.ap-southeast-4.compute.internal",
}
# Topology order the init step must produce (sorted by server id, node id, FQDN).
ORDER_4 = ["demo-worker-1", "demo-worker-2", "demo-worker-0", "demo-worker-3"]
ORDER_2 = ["demo-worker-1", "demo-worker-2", "demo-worker-0", "demo-worker-3"]
ORDER_1 = ["demo-worker-0", "demo-worker-1", "demo-worker-2", "demo-worker-3"]


def host(pod: str, namespace: str = "default") -> str:
    """The MPI operator's hostfile name for a worker pod."""
    return f"{pod}.demo.{namespace}.svc"


def sysfs(pod: str, modes: str = "1,2,4") -> dict[str, str]:
    """The driver's sysfs files on the node a worker runs on."""
    s2, n2, s4, n4 = NODES[PODS[pod]]
    return {
        "ultraserver_mode": modes,
        "server_id_2": s2,
        "node_id_2": str(n2),
        "server_id_4": s4,
        "node_id_4": str(n4),
    }


def labels(node: str) -> dict[str, str]:
    s2, n2, s4, n4 = NODES[node]
    prefix = "neuron.amazonaws.com/ultraserver-"
    return {
        prefix + "mode": "1_2_4",
        prefix + "server-id-2": s2,
        prefix + "node-id-2": str(n2),
        prefix + "server-id-4": s4,
        prefix + "node-id-4": str(n4),
    }
