"""The fast fabric between GPU nodes: rendered worker pods request EFA / GPUDirect-TCPX(O) exactly
when a job spans nodes of a fabric node type, strictly valid against the KubeRay CRDs; the policy
grants the fabric's capabilities and host paths to exactly its containers and refuses a
multi-node job without it; and NCCL's transport is read back from recorded debug lines."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app import kube
from app.config import load_config
from app.kube.fabric import EFA_RESOURCE
from app.nodes import FABRIC_HOST_PATHS
from app.observe import nccl, records
from app.storage import Store

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "jobs" / "configs"
LOGS = ROOT / "tests" / "data" / "nccl"
IMAGE = "registry.example.com/eft:0.1.0"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def schemas():
    return kube.load_schemas()


def render(node_type: str, overlay: str, config: str = "llama3-70b-lora", overrides=None) -> dict:
    return kube.build_manifests(load_config(CONFIGS / f"{config}.yaml", overrides), overlay, IMAGE, node_type)


def workers(manifests: dict) -> list[dict]:
    """The worker pod template of both Ray manifests."""
    return [manifests["rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"],
            manifests["raycluster.yaml"]["spec"]["workerGroupSpecs"][0]["template"]]


def errors(manifests: dict, schemas) -> list[str]:
    return [str(v) for v in kube.errors_of(kube.check_documents(list(manifests.items()), schemas))]


# ----------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("node_type, overlay, fabric, devices", [
    ("p4d.24xlarge", "eks-spot", "efa", 4),
    ("p5.48xlarge", "eks-spot", "efa", 32),
    ("a3-highgpu-8g", "gke-spot", "tcpx", None),
    ("a3-megagpu-8g", "gke-spot", "tcpxo", None),
    ("g5.48xlarge", "eks-spot", None, None),
])
def test_multi_node_workers_get_their_fabric_and_nothing_else_does(node_type, overlay, fabric, devices, schemas):
    manifests = render(node_type, overlay)
    assert errors(manifests, schemas) == []
    for tpl in workers(manifests):
        spec = tpl["spec"]
        ray = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in ray["env"]}
        caps = ray["securityContext"]["capabilities"]
        names = [c["name"] for c in spec["containers"]]
        annotations = tpl["metadata"]["annotations"]
        host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert annotations["eft/node-type"] == node_type
        # EFA: every device of the node, hugepages, libfabric's provider with GPUDirect RDMA.
        for part in ("requests", "limits"):
            assert ray["resources"][part].get(EFA_RESOURCE) == (str(devices) if devices else None)
            assert ray["resources"][part].get("hugepages-2Mi") == ("5120Mi" if fabric == "efa" else None)
        assert (env.get("FI_PROVIDER"), env.get("FI_EFA_USE_DEVICE_RDMA")) == \
            (("efa", "1") if fabric == "efa" else (None, None))
        # GPUDirect: Google's RxDM sidecar, the GPU NICs, the plugin mounted from the node.
        daemon = {"tcpx": "tcpx-daemon", "tcpxo": "tcpxo-daemon"}.get(fabric)
        assert names == ["ray-worker"] + ([daemon] if daemon else [])
        assert ("networking.gke.io/interfaces" in annotations) == bool(daemon)
        assert bool(host_paths) == bool(daemon) and host_paths <= FABRIC_HOST_PATHS
        if fabric == "tcpx":
            assert env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
            assert env["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"] == "/run/tcpx"
        if fabric == "tcpxo":
            assert env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"] == "/dev/aperture_devices"
            assert "/dev/dmabuf_import_helper" in annotations["devices.gke.io/container.tcpxo-daemon"]
        if daemon:
            ctx = spec["containers"][1]["securityContext"]
            assert ctx["runAsUser"] == 0 and ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
            assert "NET_ADMIN" in ctx["capabilities"]["add"] and ctx["capabilities"]["drop"] == ["ALL"]
        # IPC_LOCK (pinned registrations) only where the fabric asks for it.
        assert caps.get("add", []) == (["IPC_LOCK"] if fabric in ("efa", "tcpx") else [])
        assert caps["drop"] == ["ALL"]
    head = manifests["rayjob.yaml"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert len(head["containers"]) == 1 and "add" not in head["containers"][0]["securityContext"]["capabilities"]
    assert EFA_RESOURCE not in head["containers"][0]["resources"]["requests"]


def test_a_job_that_fits_one_node_gets_no_fabric(schemas):
    # 8 workers x 1 GPU: one p4d node, where NCCL runs over NVLink whatever the NIC.
    manifests = render("p4d.24xlarge", "eks-spot", "llama3-8b-lora")
    assert errors(manifests, schemas) == []
    for tpl in workers(manifests):
        ray = tpl["spec"]["containers"][0]
        assert EFA_RESOURCE not in ray["resources"]["limits"]
        assert "FI_PROVIDER" not in {e["name"] for e in ray["env"]}
        assert "add" not in ray["securityContext"]["capabilities"]


# ----------------------------------------------------------------------------- the policy bites


def strip_efa(tpl: dict) -> None:
    ray = tpl["spec"]["containers"][0]
    for part in ("requests", "limits"):
        ray["resources"][part].pop(EFA_RESOURCE)
    ray["securityContext"]["capabilities"].pop("add")


def set_efa(count: str):
    def apply(tpl: dict) -> None:
        for part in ("requests", "limits"):
            tpl["spec"]["containers"][0]["resources"][part][EFA_RESOURCE] = count
    return apply


def drop_daemon(tpl: dict) -> None:
    tpl["spec"]["containers"].pop(1)
    tpl["spec"]["volumes"] = [v for v in tpl["spec"]["volumes"] if "hostPath" not in v]


def daemon_caps(tpl: dict) -> None:
    tpl["spec"]["containers"][1]["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")


def foreign_daemon(tpl: dict) -> None:
    tpl["spec"]["containers"][1]["image"] = "docker.io/someone/tcpgpudmarxd-dev:v2.0.12"


def docker_socket(tpl: dict) -> None:
    tpl["spec"]["volumes"].append({"name": "docker", "hostPath": {"path": "/var/run/docker.sock"}})


def ipc_lock_without_fabric(tpl: dict) -> None:
    tpl["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]


POLICY_CASES = {
    "p4d across nodes without EFA": ("p4d.24xlarge", "eks-spot", strip_efa, "spec.workerGroupSpecs[0].template.spec",
                                     "up to 4 p4d.24xlarge nodes without their efa fabric: NCCL falls back to TCP"),
    "half the EFA devices": ("p4d.24xlarge", "eks-spot", set_efa("2"),
                             "spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits",
                             "vpc.amazonaws.com/efa 2 of the 4 a p4d.24xlarge node has"),
    "a3-high without its RxDM": ("a3-highgpu-8g", "gke-spot", drop_daemon, "spec.workerGroupSpecs[0].template.spec",
                                 "without their tcpx fabric"),
    "RxDM with more capabilities": ("a3-highgpu-8g", "gke-spot", daemon_caps,
                                    "spec.workerGroupSpecs[0].template.spec.containers[1].securityContext"
                                    ".capabilities.add", "adds ['SYS_ADMIN']"),
    "a root sidecar that is not Google's RxDM": ("a3-highgpu-8g", "gke-spot", foreign_daemon,
                                                 "spec.workerGroupSpecs[0].template.spec.containers[1]"
                                                 ".securityContext.runAsUser", "0 runs as root"),
    "a host path beyond the fabric's": ("a3-megagpu-8g", "gke-spot", docker_socket,
                                        "spec.workerGroupSpecs[0].template.spec.volumes[", "'/var/run/docker.sock'"),
    "a host path without a fabric": ("g5.48xlarge", "eks-spot", docker_socket,
                                     "spec.workerGroupSpecs[0].template.spec.volumes[", "the pod uses no fabric"),
    "IPC_LOCK without a fabric": ("g5.48xlarge", "eks-spot", ipc_lock_without_fabric,
                                  "spec.workerGroupSpecs[0].template.spec.containers[0].securityContext"
                                  ".capabilities.add", "must add no capabilities (adds ['IPC_LOCK'])"),
}


@pytest.mark.parametrize("case", POLICY_CASES, ids=list(POLICY_CASES))
def test_the_fabric_policy_bites(case, schemas):
    node_type, overlay, change, field, message = POLICY_CASES[case]
    manifests = render(node_type, overlay)
    bad = copy.deepcopy(manifests["raycluster.yaml"])
    change(bad["spec"]["workerGroupSpecs"][0]["template"])
    found = errors(dict(manifests, **{"raycluster.yaml": bad}), schemas)
    assert any(line.startswith(f"raycluster.yaml: {field}") and message in line for line in found), found


def test_manifests_check_refuses_a_multi_node_p4d_job_without_efa(tmp_path):
    manifests = render("p4d.24xlarge", "eks-spot")
    strip_efa(manifests["rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"])
    kube.write_manifests(manifests, tmp_path)
    result = subprocess.run([sys.executable, "-m", "app.cli", "manifests", "--check", str(tmp_path)], cwd=ROOT,
                            env=dict(os.environ, **RAY_ENV), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "rayjob.yaml: spec.rayClusterSpec.workerGroupSpecs[0].template.spec: up to 4 p4d.24xlarge nodes " \
           "without their efa fabric" in result.stdout + result.stderr


# ----------------------------------------------------------------------------- what NCCL picked


@pytest.mark.parametrize("log, fabric, network, plugin, gdr, nodes, fallback", [
    ("efa_p4d_2nodes", "efa", "Libfabric", "Libfabric", True, 2, None),
    ("tcpx_a3high_2nodes", "tcpx", "GPUDirectTCPX", "GPUDirectTCPX_v7", True, 2, None),
    ("socket_no_plugin_2nodes", "efa", "Socket", None, False, 2,
     "NCCL could not load a network plugin (Could not find: libnccl-net.so"),
    ("socket_no_efa_device_2nodes", "efa", "Socket", "Libfabric", False, 2,
     "libfabric found no EFA device (OFI fi_getinfo() call failed: No data available)"),
    # One node: sockets are fine (NCCL talks over NVLink / P2P inside the node).
    ("single_node_h200", None, "Socket", None, False, 1, None),
])
def test_the_transport_is_read_from_recorded_debug_lines(log, fabric, network, plugin, gdr, nodes, fallback):
    found = nccl.read_nccl_transport((LOGS / f"{log}.log").read_text().splitlines())
    assert (found["network"], found["plugin"], found["gdr"], found["nodes"]) == (network, plugin, gdr, nodes)
    why = nccl.explain_fallback(found, fabric, nodes, {})
    assert (why is None) if fallback is None else (fallback in why and why.startswith("NCCL uses Socket between 2"))
    if log == "efa_p4d_2nodes":
        assert (found["provider"], found["nics"], found["plugin_version"]) == ("efa", 4, "1.9.1-aws")
        assert found["channels"] == ["NET/Libfabric", "P2P"]


def test_a_fallback_forced_by_the_environment_says_so():
    found = nccl.read_nccl_transport((LOGS / "socket_no_plugin_2nodes.log").read_text().splitlines())
    assert "NCCL_NET=Socket in the environment forces it" in nccl.explain_fallback(found, "efa", 2,
                                                                                  {"NCCL_NET": "Socket"})


def test_the_node_fabric_is_found_in_sysfs_or_the_rendered_env(tmp_path):
    drivers = tmp_path / "bus" / "pci" / "drivers"
    (drivers / "efa").mkdir(parents=True)
    (drivers / "mlx5_core").mkdir()
    device = tmp_path / "class" / "infiniband" / "rdmap16s27" / "device"
    device.mkdir(parents=True)
    (device / "driver").symlink_to(drivers / "mlx5_core")
    assert nccl.detect_fabric({}, str(tmp_path)) is None
    (device / "driver").unlink()
    (device / "driver").symlink_to(drivers / "efa")
    assert nccl.detect_fabric({}, str(tmp_path)) == "efa"
    empty = str(tmp_path / "nothing")
    assert nccl.detect_fabric({"FI_PROVIDER": "efa"}, empty) == "efa"
    assert nccl.detect_fabric({"NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1"}, empty) == "tcpx"
    assert nccl.detect_fabric({"NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices"}, empty) == "tcpxo"


def test_debug_capture_leaves_the_users_nccl_settings_alone(tmp_path):
    env: dict = {}
    path = nccl.apply_nccl_debug_capture(env, str(tmp_path))
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert path == str(tmp_path / f"nccl.{socket.gethostname()}.{os.getpid()}.log")
    assert nccl.apply_nccl_debug_capture({"NCCL_DEBUG": "WARN"}, str(tmp_path)) is None
    mine = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/logs/n.%h.%p"}
    assert nccl.apply_nccl_debug_capture(mine, str(tmp_path)) == f"/logs/n.{socket.gethostname()}.{os.getpid()}"
    assert mine == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/logs/n.%h.%p"}


def test_the_tcpxo_installer_profile_fills_in_what_the_env_leaves_open(tmp_path):
    profile = tmp_path / "nccl-env-profile.sh"
    profile.write_text("#!/bin/bash\nexport NCCL_FASTRAK_IFNAME=eth1,eth2\nexport NCCL_PROTO='Simple,LL128'\n"
                       "export NCCL_BUFFSIZE=8388608\necho done\n")
    env = {"NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices", "NCCL_BUFFSIZE": "4194304"}
    assert nccl.apply_fabric_profile(str(profile), env) == ["NCCL_FASTRAK_IFNAME", "NCCL_PROTO"]
    assert env["NCCL_PROTO"] == "Simple,LL128" and env["NCCL_BUFFSIZE"] == "4194304"
    assert nccl.apply_fabric_profile(str(profile), {}) == []  # not a TCPXO pod


def test_rank_0_records_and_warns_about_a_fallback(s3, tmp_path, caplog, monkeypatch):
    store, run_uri = Store(), "s3://eft/runs/fabric-record"
    debug = tmp_path / "nccl.log"
    debug.write_text((LOGS / "socket_no_efa_device_2nodes.log").read_text())
    monkeypatch.setenv("FI_PROVIDER", "efa")
    with caplog.at_level("INFO", logger="eft.nccl"):
        record = nccl.NcclProbe(str(debug), profile=[]).report(store, run_uri, nodes=2)
    assert record["network"] == "Socket" and record["fabric"] == "efa"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("libfabric found no EFA device" in w for w in warnings), warnings
    assert any("network Socket via plugin Libfabric 1.13.2-aws" in r.getMessage() for r in caplog.records)
    (event,) = [e for e in records.load_events(store, run_uri) if e["kind"] == "nccl_transport"]
    assert event["fallback"] == record["fallback"] and event["nodes"] == 2
    # `eft status` / `eft report` show it while the run goes on.
    from app.report import build_status, build_status_rows, load_run
    rows = dict(build_status_rows(build_status(load_run(store, run_uri))))
    assert rows["NCCL network"] == "Socket (fabric efa, 2 node(s), GPUDirect RDMA no)"
    assert "libfabric found no EFA device" in rows["NCCL warning"]


@pytest.mark.parametrize("config, node_type, overlay, line", [
    ("llama3-70b-lora", "p4d.24xlarge", "eks-spot",
     "eft: workers: up to 4 p4d.24xlarge node(s) over AWS Elastic Fabric Adapter through aws-ofi-nccl"),
    ("llama3-8b-lora", "p4d.24xlarge", "eks-spot", "NCCL over TCP sockets between nodes: the job fits one node"),
])
def test_eft_manifests_says_which_fabric_the_workers_use(tmp_path, config, node_type, overlay, line):
    result = subprocess.run([sys.executable, "-m", "app.cli", "manifests", str(CONFIGS / f"{config}.yaml"),
                             "--overlay", overlay, "--node-type", node_type, "--image", IMAGE, "--out", str(tmp_path)],
                            cwd=ROOT, env=dict(os.environ, **RAY_ENV), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert line in result.stderr


def test_the_probe_starts_on_gpu_workers_only(monkeypatch):
    import torch

    monkeypatch.setattr(os, "environ", {})
    assert nccl.NcclProbe.start(torch.device("cpu")) is None and os.environ == {}
    probe = nccl.NcclProbe.start(torch.device("cuda"))  # a device object needs no GPU
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert probe.debug_file.endswith(f"nccl.{socket.gethostname()}.{os.getpid()}.log")
