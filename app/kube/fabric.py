"""What a worker pod needs to use the fast fabric between GPU nodes: devices, environment, host
mounts and the RxDM sidecar. Which fabric a node type has, and what each one is, are facts in
app/nodes.py.

Only a job that spans nodes gets any of it: inside one node NCCL uses NVLink whatever the NIC.
The policy check (app/kube/policy.py) grants the capabilities and host paths below to exactly
these containers and refuses a multi-node job on a fabric node type that does not request its
fabric.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from app.nodes import FABRICS, GKE_NVIDIA_MOUNT, TCPX_SOCKET_DIR, Daemon, Fabric

EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
NODE_TYPE_ANNOTATION = "eft/node-type"
GPU_DEVICE_PATHS = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]


def needs_fabric(node, max_replicas: int, pod_gpus: int) -> Optional[Fabric]:
    """The fabric a worker group must use: a GPU group that can span nodes, on a node type that
    has one. One node's GPUs talk over NVLink, so a group that fits one node gets none."""
    if not node.fabric or not pod_gpus or max_replicas <= 1:
        return None
    return FABRICS[node.fabric]


def build_fabric_env(fabric: Fabric, node) -> list[dict]:
    env = dict(fabric.env)
    if fabric.name == "efa" and node.rdma:
        # GPUDirect RDMA: the NIC reads and writes GPU memory (p4d, p4de, p5), no host bounce.
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return [{"name": k, "value": v} for k, v in env.items()]


def build_daemon_container(daemon: Daemon) -> dict:
    return {"name": daemon.name, "image": daemon.image, "imagePullPolicy": "IfNotPresent",
            "command": daemon.command,
            "env": [{"name": "LD_LIBRARY_PATH", "value": GKE_NVIDIA_MOUNT}],
            # Google's image runs as root: NET_ADMIN only takes effect for a root process. It gets
            # those capabilities and nothing else (no privileged, no escalation, drop ALL).
            "securityContext": {"runAsNonRoot": False, "runAsUser": 0, "privileged": False,
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], "add": list(daemon.capabilities)},
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "volumeMounts": [{"name": name, "mountPath": mount} for name, _, mount in daemon.host_mounts]
                            + ([{"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR}]
                               if daemon.name == "tcpx-daemon" else [])}


def build_network_annotations(fabric: Fabric, daemon_devices: list[str]) -> dict:
    interfaces = [{"interfaceName": "eth0", "network": "default"}] + [
        {"interfaceName": f"eth{i}", "network": net} for i, net in enumerate(fabric.networks, start=1)]
    return {"networking.gke.io/default-interface": "eth0",
            "networking.gke.io/interfaces": json.dumps(interfaces),
            # GKE's NRI device injector hands the daemon the GPUs without a GPU request of its own.
            f"devices.gke.io/container.{fabric.daemon.name}": "".join(f"- path: {p}\n" for p in daemon_devices)}


def apply_fabric(template: dict, fabric: Fabric, node) -> None:
    """Make a worker pod template use `fabric`: devices, environment, mounts and the sidecar."""
    spec = template["spec"]
    ray = spec["containers"][0]
    ray["env"] += build_fabric_env(fabric, node)
    if fabric.capabilities:
        ray["securityContext"]["capabilities"]["add"] = list(fabric.capabilities)
    resources = ray["resources"]
    if fabric.name == "efa":
        # The node sets hugepages aside from its RAM, so they come out of the pod's memory.
        memory_gib = int(resources["limits"]["memory"].removesuffix("Gi")) - math.ceil(fabric.hugepages_2mi_mib / 1024)
        for part in ("requests", "limits"):
            resources[part]["memory"] = f"{memory_gib}Gi"
            resources[part][EFA_RESOURCE] = str(node.fabric_devices)
            resources[part][HUGEPAGES_RESOURCE] = f"{fabric.hugepages_2mi_mib}Mi"
    volumes = {v["name"] for v in spec["volumes"]}
    host_mounts = fabric.ray_host_mounts + (fabric.daemon.host_mounts if fabric.daemon else ())
    for name, host, _ in host_mounts:
        if name not in volumes:
            spec["volumes"].append({"name": name, "hostPath": {"path": host, "type": "Directory"}})
            volumes.add(name)
    for name, _, mount in fabric.ray_host_mounts:
        ray["volumeMounts"].append({"name": name, "mountPath": mount, "readOnly": True})
    if fabric.daemon:
        if fabric.daemon.name == "tcpx-daemon":
            # The daemon's Unix sockets, shared with NCCL in the Ray container.
            spec["volumes"].append({"name": "tcpx-socket", "emptyDir": {}})
            ray["volumeMounts"].append({"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR})
        spec["containers"].append(build_daemon_container(fabric.daemon))
        devices = GPU_DEVICE_PATHS + (["/dev/dmabuf_import_helper"] if fabric.name == "tcpxo" else [])
        template["metadata"].setdefault("annotations", {}).update(build_network_annotations(fabric, devices))

