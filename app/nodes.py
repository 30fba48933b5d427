"""Node types and their fabrics: the facts about the machines a job runs on.

One table, read by `eft plan` (GPU memory per worker), the KubeRay renderer (pod sizes, which
fabric a multi-node worker group needs) and the NCCL probe on the workers (which network names
mean the fabric is in use). It imports nothing of eft's, so any layer may read it.

The fast fabric between GPU nodes matters because FSDP all-gathers the sharded base in every
forward and backward and reduce-scatters the gradients across nodes; over plain TCP sockets a
multi-node job is network-bound. NCCL reaches each cloud's fabric only through a network plugin
and the devices, environment and helpers that plugin needs:

- AWS EFA (p4d/p4de: 4 devices, p5: 32): the aws-ofi-nccl plugin over libfabric's `efa`
  provider, both in the eft image. The pod requests `vpc.amazonaws.com/efa` devices (the EFA
  device plugin), 2 MiB hugepages for libfabric's bounce buffers, and IPC_LOCK.
- GKE a3-high, GPUDirect-TCPX, and a3-mega, GPUDirect-TCPXO: Google's NCCL plugin, installed on
  the node by its installer DaemonSet under /home/kubernetes/bin/nvidia/lib64, plus a receive
  data-path daemon (RxDM) in a sidecar with NET_ADMIN that steers flows on the GPU NICs, and
  GKE multi-networking annotations that give the pod those NICs.

How a pod requests a fabric is the renderer's business (app/kube/fabric.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# Where GKE's NCCL plugin installer puts the plugin and its env profile on the node, and where
# Google's manifests mount it into the containers.
GKE_NVIDIA_HOST_DIR = "/home/kubernetes/bin/nvidia/lib64"
GKE_NVIDIA_MOUNT = "/usr/local/nvidia/lib64"
# The TCPXO installer writes the NCCL settings that match its plugin version here; the worker
# applies it at start (app/observe/nccl.py), so a plugin upgrade never disagrees with the manifest.
TCPXO_ENV_PROFILE = f"{GKE_NVIDIA_MOUNT}/nccl-env-profile.sh"
TCPX_SOCKET_DIR = "/run/tcpx"
APERTURE_DIR = "/dev/aperture_devices"


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


@dataclass(frozen=True)
class NodeType:
    name: str
    provider: str  # "aws" or "gcp"
    gpus: int
    gpu: str
    # What a pod may request on the node: allocatable minus kubelet, system and DaemonSet reserve.
    cpus: int
    memory_gib: int
    # Memory per GPU as CUDA reports it (torch.cuda.get_device_properties().total_memory), a little
    # under the marketing GB: what `eft plan` fits a worker into.
    gpu_memory_gib: float = 0.0
    # The fast fabric between nodes (FABRICS above): "efa", "tcpx", "tcpxo" or None, with
    # EFA's device count and whether its NICs do GPUDirect RDMA.
    fabric: Optional[str] = None
    fabric_devices: int = 0
    rdma: bool = False

    @property
    def model_cache_gib(self) -> int:
        """Local disk for the cached base model: the node's combined GPU memory. A frozen bf16
        base the run trains is at most what the GPUs of a few nodes hold sharded, and one node's
        GPU memory is a generous bound that still schedules on the usual root volumes (a 70B
        bf16 base is ~140 GB; a p4d holds 320 GB). CPU nodes cache tiny models: 10 GiB."""
        if not self.gpus:
            return 10
        return self.gpus * int(re.search(r"(\d+)GB", self.gpu).group(1))


NODE_TYPES = {n.name: n for n in [
    NodeType("p4d.24xlarge", "aws", 8, "A100-40GB", 92, 1050, 39.4, fabric="efa", fabric_devices=4, rdma=True),
    NodeType("p4de.24xlarge", "aws", 8, "A100-80GB", 92, 1050, 79.2, fabric="efa", fabric_devices=4, rdma=True),
    NodeType("p5.48xlarge", "aws", 8, "H100-80GB", 188, 1900, 79.2, fabric="efa", fabric_devices=32, rdma=True),
    # g5.48xlarge has one EFA at 100 Gbps without GPUDirect RDMA, no faster than its ENA: left off.
    NodeType("g5.48xlarge", "aws", 8, "A10G-24GB", 188, 700, 22.0),
    NodeType("g5.12xlarge", "aws", 4, "A10G-24GB", 44, 170, 22.0),
    NodeType("m6i.2xlarge", "aws", 0, "", 7, 26),
    NodeType("a3-highgpu-8g", "gcp", 8, "H100-80GB", 200, 1700, 79.2, fabric="tcpx"),
    NodeType("a3-megagpu-8g", "gcp", 8, "H100-80GB", 200, 1800, 79.2, fabric="tcpxo"),
    NodeType("a2-highgpu-8g", "gcp", 8, "A100-40GB", 92, 600, 39.4),
    NodeType("a2-ultragpu-8g", "gcp", 8, "A100-80GB", 92, 1200, 79.2),
    NodeType("g2-standard-48", "gcp", 4, "L4-24GB", 44, 170, 22.0),
    NodeType("n2-standard-8", "gcp", 0, "", 7, 26),
]}
