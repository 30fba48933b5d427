"""The fast fabric between GPU nodes, and what a worker pod needs to use it.

FSDP all-gathers the sharded base in every forward and backward and reduce-scatters the
gradients across nodes; over plain TCP sockets a multi-node job is network-bound. NCCL reaches
each cloud's fabric only through a network plugin and the devices, environment and helpers
that plugin needs:

- AWS EFA (p4d/p4de: 4 devices, p5: 32): the aws-ofi-nccl plugin over libfabric's `efa`
  provider, both in the eft image. The pod requests `vpc.amazonaws.com/efa` devices (the EFA
  device plugin), 2 MiB hugepages for libfabric's bounce buffers, and IPC_LOCK.
- GKE a3-high, GPUDirect-TCPX, and a3-mega, GPUDirect-TCPXO: Google's NCCL plugin, installed on
  the node by its installer DaemonSet under /home/kubernetes/bin/nvidia/lib64, plus a receive
  data-path daemon (RxDM) in a sidecar with NET_ADMIN that steers flows on the GPU NICs, and
  GKE multi-networking annotations that give the pod those NICs.

Only a job that spans nodes gets any of it: inside one node NCCL uses NVLink whatever the NIC.
The policy check (app/kube/policy.py) grants the capabilities and host paths below to exactly
these containers and refuses a multi-node job on a fabric node type that does not request its
fabric.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
# Where GKE's NCCL plugin installer puts the plugin and its env profile on the node, and where
# Google's manifests mount it into the containers.
GKE_NVIDIA_HOST_DIR = "/home/kubernetes/bin/nvidia/lib64"
GKE_NVIDIA_MOUNT = "/usr/local/nvidia/lib64"
# The TCPXO installer writes the NCCL settings that match its plugin version here; the worker
# applies it at start (app/train/nccl.py), so a plugin upgrade never disagrees with the manifest.
TCPXO_ENV_PROFILE = f"{GKE_NVIDIA_MOUNT}/nccl-env-profile.sh"
TCPX_SOCKET_DIR = "/run/tcpx"
APERTURE_DIR = "/dev/aperture_devices"
NODE_TYPE_ANNOTATION = "eft/node-type"


@dataclass(frozen=True)
class Daemon:
    """The RxDM sidecar of a GPUDirect fabric: Google's image, run as its root user with the
    capabilities it needs (a non-root process loses added capabilities at exec)."""
    name: str
    image: str
    command: list
    capabilities: tuple
    host_mounts: tuple  # (volume, host path, mount path)


@dataclass(frozen=True)
class Fabric:
    name: str
    provider: str
    what: str
    # Network names NCCL prints in "Using network X" when the fabric is in use.
    nccl_networks: tuple
    # Capabilities the Ray container gets on top of the hardened drop-ALL context.
    capabilities: tuple = ()
    hugepages_2mi_mib: int = 0
    daemon: Optional[Daemon] = None
    # GKE multi-networking: the pod's extra interfaces, named after the cluster's Network objects.
    networks: tuple = ()
    # (volume, host path, mount path) mounted read-only into the Ray container.
    ray_host_mounts: tuple = ()
    env: dict = field(default_factory=dict)


GPU_DEVICE_PATHS = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]

FABRICS = {f.name: f for f in [
    Fabric("efa", "aws", "AWS Elastic Fabric Adapter through aws-ofi-nccl (libfabric efa provider)",
           nccl_networks=("Libfabric", "AWS Libfabric"),
           # libfabric pins the buffers it registers with the device; IPC_LOCK lifts the memlock cap.
           capabilities=("IPC_LOCK",), hugepages_2mi_mib=5120,
           env={"FI_PROVIDER": "efa",
                # Ray forks (raylet, workers, Ray Data): registered memory must survive a fork.
                "FI_EFA_FORK_SAFE": "1",
                # NCCL's bootstrap and socket fallback go over the pod's interface, never loopback.
                "NCCL_SOCKET_IFNAME": "^lo,docker"}),
    Fabric("tcpx", "gcp", "GKE GPUDirect-TCPX (a3-highgpu-8g), Google's NCCL plugin and its RxDM sidecar",
           nccl_networks=("GPUDirectTCPX",), capabilities=("IPC_LOCK",),
           daemon=Daemon("tcpx-daemon", "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12",
                         ["/tcpgpudmarxd/build/app/tcpgpudmarxd", "--gpu_nic_preset", "a3vm", "--gpu_shmem_type",
                          "fd", "--uds_path", TCPX_SOCKET_DIR, "--setup_param", "--verbose 128 2 0"],
                         ("NET_ADMIN",),
                         (("nvidia-libs", GKE_NVIDIA_HOST_DIR, GKE_NVIDIA_MOUNT), ("host-sys", "/sys", "/hostsysfs"),
                          ("host-proc-sys", "/proc/sys", "/hostprocsysfs"))),
           networks=("vpc1", "vpc2", "vpc3", "vpc4"),
           ray_host_mounts=(("nvidia-libs", GKE_NVIDIA_HOST_DIR, GKE_NVIDIA_MOUNT),),
           # Google's documented settings for a3-highgpu-8g (GKE "Maximize GPU network bandwidth
           # with GPUDirect-TCPX"); the bindings pin each NIC's flows to the cores of its NUMA node.
           env={"LD_LIBRARY_PATH": GKE_NVIDIA_MOUNT, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_CROSS_NIC": "0",
                "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_NSOCKS_PERTHREAD": "4",
                "NCCL_SOCKET_NTHREADS": "1", "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
                "NCCL_P2P_NET_CHUNKSIZE": "524288", "NCCL_P2P_PCI_CHUNKSIZE": "524288",
                "NCCL_P2P_NVL_CHUNKSIZE": "1048576", "NCCL_BUFFSIZE": "4194304", "NCCL_NET_GDR_LEVEL": "PIX",
                "NCCL_P2P_PXN_LEVEL": "0", "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
                "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
                "NCCL_GPUDIRECTTCPX_TX_BINDINGS": "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;"
                                                  "eth4:60-73,164-177",
                "NCCL_GPUDIRECTTCPX_RX_BINDINGS": "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;"
                                                  "eth4:74-87,178-191",
                "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
                "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": TCPX_SOCKET_DIR}),
    Fabric("tcpxo", "gcp", "GKE GPUDirect-TCPXO (a3-megagpu-8g), Google's NCCL plugin and its RxDM sidecar",
           nccl_networks=("FasTrak", "GPUDirectTCPXO"),
           daemon=Daemon("tcpxo-daemon", "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21",
                         ["/bin/sh", "-c", "/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8 --uid= "
                                           "--alsologtostderr"],
                         ("NET_ADMIN", "NET_BIND_SERVICE"),
                         (("nvidia-libs", GKE_NVIDIA_HOST_DIR, GKE_NVIDIA_MOUNT), ("host-sys", "/sys", "/hostsysfs"),
                          ("host-proc-sys", "/proc/sys", "/hostprocsysfs"))),
           networks=tuple(f"vpc{i}" for i in range(1, 9)),
           ray_host_mounts=(("nvidia-libs", GKE_NVIDIA_HOST_DIR, GKE_NVIDIA_MOUNT),
                            ("aperture-devices", APERTURE_DIR, APERTURE_DIR)),
           # The rest of NCCL's settings come from the installer's profile (TCPXO_ENV_PROFILE).
           env={"LD_LIBRARY_PATH": GKE_NVIDIA_MOUNT, "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": APERTURE_DIR}),
]}

# Host paths any fabric may mount, for the policy check: nothing else on the node is reachable.
FABRIC_HOST_PATHS = {host for f in FABRICS.values()
                     for _, host, _ in (f.ray_host_mounts + (f.daemon.host_mounts if f.daemon else ()))}
DAEMONS = {f.daemon.name: f for f in FABRICS.values() if f.daemon}


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

