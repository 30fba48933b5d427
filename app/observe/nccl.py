"""Which transport NCCL picked, said at start: from NCCL's own debug lines.

A multi-node job on a fabric node type that silently fell back to TCP sockets runs, only
several times slower; nothing fails. So each GPU worker has NCCL write its INIT/NET debug lines
to a file of its own (unless the user set NCCL_DEBUG), and after the first step rank 0 reads
its file: the network NCCL uses ("Using network Libfabric" / "Socket" / "GPUDirectTCPX" ...),
the plugin it loaded or failed to load, the libfabric provider, whether channels run GPUDirect
RDMA, and the node count. It logs one line, records an event (the summary carries it) and warns
loudly, with the reason from the same lines, when a multi-node run on a fabric uses sockets.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import socket
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from app.nodes import FABRICS, TCPXO_ENV_PROFILE

log = logging.getLogger("eft.nccl")

# Networks that are a cloud fabric, by the name NCCL prints, and the fabric they belong to.
FABRIC_NETWORKS = {net: name for name, fabric in FABRICS.items() for net in fabric.nccl_networks} | {"IB": "ib"}

_PATTERNS = {
    "nccl_version": re.compile(r"NCCL version (\S+)"),
    "plugin": re.compile(r"NET/Plugin ?: ?Loaded (?:net|collnet)? ?plugin (.+?)(?: \(v\d+\))?$"),
    "plugin_error": re.compile(r"NET/Plugin ?: ?(Plugin load (?:\(\S+\) )?returned .*|No plugin found.*|"
                               r"Could not find: .*|Failed to find .*)$"),
    "plugin_version": re.compile(r"NET/OFI (?:Initializing|Using) aws-ofi-nccl (\S+)"),
    "provider": re.compile(r"NET/OFI Selected [Pp]rovider is (\S+?),?(?: |$)"),
    "nics": re.compile(r"NET/OFI .*\(found (\d+) nics\)"),
    "provider_error": re.compile(r"NET/OFI (.*(?:No eligible providers|fi_getinfo(?:\(\))? (?:call )?failed|"
                                 r"Unable to find a provider|Couldn't find any optimal provider|"
                                 r"No NICs? (?:found|available)).*)$"),
    "network": re.compile(r"Using network (.+?)\s*$"),
    "socket_interface": re.compile(r"NET/Socket : Using \[0\](\S+?):"),
    "nodes": re.compile(r"nRanks \d+ nNodes (\d+)"),
}
_CHANNEL = re.compile(r"via (NET/[^/\s]+|P2P|SHM|CollNet)(?:/\S*?)?(/GDRDMA)?(?:\s|$)")


def read_nccl_transport(lines: Iterable[str]) -> dict:
    """What NCCL's INFO lines (INIT and NET subsystems) say about the transport it picked."""
    found: dict = {"network": None, "plugin": None, "plugin_version": None, "plugin_error": None,
                   "provider": None, "provider_error": None, "nics": None, "gdr": False, "channels": [],
                   "nodes": None, "nccl_version": None, "socket_interface": None}
    channels = set()
    for line in lines:
        if "NCCL" not in line:
            continue
        text = line.rstrip("\n")
        for key, pattern in _PATTERNS.items():
            if (match := pattern.search(text)) and found[key] in (None, False):
                value = match.group(1).strip()
                found[key] = int(value) if key in ("nics", "nodes") else value
        for via, gdr in _CHANNEL.findall(text):
            channels.add(via)
            found["gdr"] = found["gdr"] or bool(gdr)
    found["channels"] = sorted(channels)
    if found["network"] is None:
        # Channel lines alone still name the network of the inter-node ones.
        nets = [c.split("/", 1)[1] for c in channels if c.startswith("NET/")]
        found["network"] = nets[0] if nets else None
    return found


def detect_fabric(env: dict, sys_root: str = "/sys") -> Optional[str]:
    """The fabric this node offers: EFA devices under sysfs (or the manifest's FI_PROVIDER=efa),
    or the GPUDirect settings the manifest set."""
    if env.get("NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY") or any(k.startswith("NCCL_FASTRAK_") for k in env):
        return "tcpxo"
    if any(k.startswith("NCCL_GPUDIRECTTCPX_") for k in env):
        return "tcpx"
    if env.get("FI_PROVIDER") == "efa":
        return "efa"
    for driver in Path(sys_root, "class", "infiniband").glob("*/device/driver"):
        if os.path.basename(os.path.realpath(driver)) == "efa":
            return "efa"
    return None


def explain_fallback(transport: dict, fabric: Optional[str], nodes: int, env: dict) -> Optional[str]:
    """Why a multi-node run on a fabric is not using it, or None when it is (or cannot)."""
    network = transport.get("network")
    if not fabric or nodes <= 1 or (network and FABRIC_NETWORKS.get(network) == fabric):
        return None
    if network is None:
        return None  # no debug lines to judge by: report_nccl_transport says so separately
    if env.get("NCCL_NET") and env["NCCL_NET"].lower() == network.lower():
        why = f"NCCL_NET={env['NCCL_NET']} in the environment forces it"
    elif transport.get("plugin_error"):
        why = (f"NCCL could not load a network plugin ({transport['plugin_error']}): the image lacks the "
               f"{'aws-ofi-nccl' if fabric == 'efa' else 'GPUDirect'} plugin or LD_LIBRARY_PATH misses it")
    elif transport.get("provider_error"):
        why = (f"the OFI plugin loaded but libfabric found no EFA device ({transport['provider_error']}): the "
               f"pod got no vpc.amazonaws.com/efa devices, or the EFA device plugin is not running on the node")
    elif fabric in ("tcpx", "tcpxo") and not transport.get("plugin"):
        why = ("Google's NCCL plugin was not loaded: is the installer DaemonSet running, and is "
               "/home/kubernetes/bin/nvidia/lib64 mounted at /usr/local/nvidia/lib64?")
    else:
        why = "NCCL gave no reason in its INIT/NET lines; rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ALL"
    return (f"NCCL uses {network} between {nodes} nodes on a node with the {fabric} fabric: collectives across nodes run "
            f"over TCP, several times slower. {why}")


def read_memlock() -> Optional[int]:
    """RLIMIT_MEMLOCK in bytes, None when unlimited: libfabric pins what it registers."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def apply_fabric_profile(path: str = TCPXO_ENV_PROFILE, env=None) -> list[str]:
    """On TCPXO, take NCCL's settings from the installer's profile (`export K=V` lines), under
    whatever the environment already sets. Returns the names applied."""
    env = os.environ if env is None else env
    if not env.get("NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY") or not os.path.isfile(path):
        return []
    applied = []
    for line in Path(path).read_text().splitlines():
        match = re.match(r"\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if match and match.group(1) not in env:
            env[match.group(1)] = match.group(2).strip().strip("'\"")
            applied.append(match.group(1))
    return applied


def apply_nccl_debug_capture(env=None, directory: Optional[str] = None) -> Optional[str]:
    """Point NCCL's INIT/NET debug lines at a file of this process's own, before its first
    communicator. Returns the file NCCL will write, or None when the user's NCCL_DEBUG settings
    send them elsewhere (they are left alone)."""
    env = os.environ if env is None else env
    if "NCCL_DEBUG_FILE" not in env:
        if env.get("NCCL_DEBUG"):
            return None
        directory = directory or os.path.join(tempfile.gettempdir(), "eft-nccl")
        os.makedirs(directory, exist_ok=True)
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
        env["NCCL_DEBUG_FILE"] = os.path.join(directory, "nccl.%h.%p.log")
    return env["NCCL_DEBUG_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))


def build_transport_record(debug_file: Optional[str], nodes: int, env=None, sys_root: str = "/sys") -> dict:
    """The `nccl_transport` record: what the debug file says, the fabric, memlock and a warning."""
    env = os.environ if env is None else env
    lines: list[str] = []
    if debug_file and os.path.isfile(debug_file):
        lines = Path(debug_file).read_text(errors="replace").splitlines()
    transport = read_nccl_transport(lines)
    fabric = detect_fabric(env, sys_root)
    memlock = read_memlock()
    record = {**transport, "fabric": fabric, "nodes": transport["nodes"] or nodes,
              "memlock_bytes": memlock, "debug_lines": len(lines)}
    record["fallback"] = explain_fallback(transport, fabric, record["nodes"], env)
    if fabric == "efa" and memlock is not None and memlock < 2**30:
        record["memlock_warning"] = (f"RLIMIT_MEMLOCK is {memlock} bytes: libfabric cannot pin NCCL's buffers "
                                     f"for EFA; the node's container runtime must set memlock unlimited")
    return record


def format_transport(record: dict) -> str:
    if not record["debug_lines"]:
        return ("NCCL transport: unknown (its debug lines went elsewhere: NCCL_DEBUG is set without "
                "NCCL_DEBUG_FILE)")
    plugin = record["plugin"] or "internal"
    if record["plugin_version"]:
        plugin += f" {record['plugin_version']}"
    provider = f", provider {record['provider']}" + (f" ({record['nics']} NICs)" if record["nics"] else "") \
        if record["provider"] else ""
    return (f"NCCL {record['nccl_version'] or '?'}: network {record['network'] or '?'} via plugin {plugin}"
            f"{provider}, GPUDirect RDMA {'yes' if record['gdr'] else 'no'}, {record['nodes']} node(s), "
            f"fabric on this node: {record['fabric'] or 'none'}; channels {', '.join(record['channels']) or '?'}")


class NcclProbe:
    """Started on every GPU worker before NCCL's first communicator; rank 0 reports after the
    first step, once the communicators exist."""

    def __init__(self, debug_file: Optional[str], profile: list[str]):
        self.debug_file, self.profile = debug_file, profile

    @classmethod
    def start(cls, device) -> Optional["NcclProbe"]:
        if getattr(device, "type", str(device)) != "cuda":
            return None
        profile = apply_fabric_profile()
        return cls(apply_nccl_debug_capture(), profile)

    def report(self, store, run_uri: str, nodes: int) -> dict:
        from app.observe import records

        record = build_transport_record(self.debug_file, nodes)
        record["env_profile_applied"] = len(self.profile)
        log.info(format_transport(record))
        for key in ("fallback", "memlock_warning"):
            if record.get(key):
                log.warning("!" * 20 + " %s " + "!" * 20, record[key])
        records.record_event(store, run_uri, "nccl_transport", **record)
        return record
