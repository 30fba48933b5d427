"""jobs/slurm/finetune-torchrun.sbatch: shellcheck-clean, and its launch (one torchrun per node,
one c10d rendezvous on the first node) and USR1 → checkpoint → requeue run for real under a fake
two-node Slurm allocation. `srun`, `scontrol`, `torchrun` and `fi_info` are shims on PATH that
record every command and the environment each torchrun saw (no torch, no GPUs). The fake `srun`
runs a multi-task step as one task per node and forwards USR1/TERM to its tasks, as srun does;
the fake torchrun, like the real one, survives USR1 only when told to handle it
(`--signals-to-handle`), and then exits non-zero after its ranks saved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_slurm import SHIMS as SLURM_SHIMS
from test_slurm import FABRIC_FAILURES, allocation_env, install_shims, shellcheck

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "jobs" / "slurm" / "finetune-torchrun.sbatch"
CONFIG = "jobs/configs/llama3-70b-lora.yaml"

SHIMS = {
    # srun: record; answer `hostname --ip-address` as 10.0.0.<n> of node<n>; run a one-task step
    # locally "on" its node, and a multi-task step as one task per node of FAKE_HOSTNAMES, with
    # the signals it gets forwarded to every task and the worst exit code as its own.
    "srun": r'''#!/bin/bash
echo "srun $*" >> "$SHIM_LOG"
node="" ntasks=1
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
      -w|--nodelist) node=$2; shift 2 ;;
      --ntasks=*) ntasks=${1#--ntasks=}; shift ;;
      --export=*) IFS=, read -ra assignments <<<"${1#--export=}"
                  for a in "${assignments[@]}"; do [[ $a == *=* ]] && export "${a?}"; done; shift ;;
      *) shift ;;
    esac
done
if [[ $1 == hostname ]]; then echo "10.0.0.${node#node}"; exit 0; fi
if (( ntasks == 1 )); then SLURMD_NODENAME=$node SLURM_NODEID=0 SLURM_PROCID=0 exec "$@"; fi
pids=() interrupted=0
forward() { interrupted=1; echo "srun forwards $1 to ${#pids[@]} tasks" >> "$SHIM_LOG"; kill -"$1" "${pids[@]}" 2>/dev/null; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM
read -ra nodes <<<"$FAKE_HOSTNAMES"
for (( i = 0; i < ntasks && i < ${#nodes[@]}; i++ )); do
    SLURMD_NODENAME=${nodes[i]} SLURM_NODEID=$i SLURM_PROCID=$i "$@" &
    pids+=("$!")
done
worst=0
for pid in "${pids[@]}"; do
    while :; do
        interrupted=0 rc=0
        wait "$pid" || rc=$?
        (( interrupted )) || break  # a forwarded signal cut the wait short: wait again
    done
    (( rc > worst )) && worst=$rc
done
exit "$worst"
''',
    "scontrol": r'''#!/bin/bash
echo "scontrol $*" >> "$SHIM_LOG"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $FAKE_HOSTNAMES; fi
''',
    # torchrun: record its argv and the environment its ranks would get; run EFT_SHIM_SECONDS,
    # then exit FAKE_TORCHRUN_RC_<node> (default 0). USR1 is handled only when it is in
    # --signals-to-handle (otherwise it kills the agent before any rank saves, as for real); the
    # ranks checkpoint and the agent exits 1, as torchrun does after any forwarded signal.
    "torchrun": r'''#!/bin/bash
for arg; do
    if [[ $arg == --signals-to-handle=* && ,${arg#*=}, == *,SIGUSR1,* ]]; then
        trap 'echo "torchrun on $SLURMD_NODENAME got USR1; ranks checkpointed" >> "$SHIM_LOG"; exit 1' USR1
    fi
done
# Logged once the trap is set: a test that sees this line may signal at once.
echo "$SLURMD_NODENAME|${SLURM_NODEID:-}|${OMP_NUM_THREADS:-}|${RAY_USAGE_STATS_ENABLED:-}|${FI_PROVIDER:-}|${FI_EFA_USE_DEVICE_RDMA:-}|${FI_EFA_FORK_SAFE:-}|${NCCL_SOCKET_IFNAME:-}" >> "$ENV_LOG"
echo "torchrun $* [on $SLURMD_NODENAME]" >> "$SHIM_LOG"
end=$(( SECONDS + ${EFT_SHIM_SECONDS:-0} ))
while (( SECONDS < end )); do sleep 0.05; done
rc_var=FAKE_TORCHRUN_RC_$SLURMD_NODENAME
exit "${!rc_var:-0}"
''',
    # fi_info: libfabric's probe; it finds the efa provider only where FAKE_EFA=1.
    "fi_info": SLURM_SHIMS["fi_info"],
}

ONE_TASK = "srun --export=ALL --nodes=1 --ntasks=1"
SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = install_shims(tmp_path, SHIMS)
    log = tmp_path / "commands.log"
    log.touch()
    (tmp_path / "env.log").touch()
    env = {"ENV_LOG": str(tmp_path / "env.log"), **allocation_env(tmp_path, bin_dir, log)}
    return env, log


def start(env: dict, *args: str, **extra) -> subprocess.Popen:
    """The script as sbatch runs it; an `extra` of None unsets that variable."""
    env = {key: value for key, value in dict(env, **extra).items() if value is not None}
    return subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def torchrun_env(log: Path) -> list[tuple[str, ...]]:
    """(node, node id, OMP_NUM_THREADS, RAY_USAGE_STATS_ENABLED, FI_PROVIDER, FI_EFA_USE_DEVICE_RDMA,
    FI_EFA_FORK_SAFE, NCCL_SOCKET_IFNAME) as each torchrun saw them."""
    return sorted(tuple(line.split("|")) for line in (log.parent / "env.log").read_text().splitlines())


def test_shellcheck_is_clean():
    result = subprocess.run([shellcheck(), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_sbatch_directives():
    directives = {line.split()[1] for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH ")}
    assert directives >= {"--requeue", "--signal=B:USR1@120", "--nodes=2", "--gpus-per-node=8",
                          "--ntasks-per-node=1", "--exclusive", "--output=eft-torchrun-%j.out"}


@pytest.mark.parametrize("extra, nnodes, nproc, omp", [
    ({}, "2:2", "8", "12"),
    ({"EFT_MIN_NODES": "1"}, "1:2", "8", "12"),
    ({"OMP_NUM_THREADS": "4"}, "2:2", "8", "4"),      # the caller's setting wins
    ({"SLURM_GPUS_ON_NODE": None}, "2:2", "1", "96"),  # no GPUs: one rank per node, all the CPUs
], ids=["all-nodes", "min-nodes-1", "omp-set", "no-gpus"])
def test_one_torchrun_per_node_with_one_rendezvous(fake_slurm, extra, nnodes, nproc, omp):
    env, log = fake_slurm
    proc = start(env, CONFIG, "--set", "training.max_steps=10", **extra)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    lines = log.read_text().splitlines()
    assert lines[0] == "scontrol show hostnames node[1-2]"
    # The head's IP is looked up on the head, before the step that needs it.
    assert lines[1] == f"{ONE_TASK} -w node1 hostname --ip-address"
    args = (f"--nnodes={nnodes} --nproc-per-node={nproc} --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29500 "
            f"--rdzv-id=4242 --max-restarts=3 {SIGNALS} --shutdown-timeout=100 "
            f"-m app.train.torchrun {CONFIG} --wait-timeout-s 300 --set training.max_steps=10")
    assert lines[2] == (f"srun --export=ALL,OMP_NUM_THREADS={omp},RAY_USAGE_STATS_ENABLED=0 --nodes=2 --ntasks=2 "
                        f"--ntasks-per-node=1 --cpus-per-task=96 torchrun {args}")
    assert sorted(line for line in lines if line.startswith("torchrun")) == [
        f"torchrun {args} [on node1]", f"torchrun {args} [on node2]"]
    assert torchrun_env(log) == [("node1", "0", omp, "0", "", "", "", ""), ("node2", "1", omp, "0", "", "", "", "")]
    assert not any(line.startswith("scontrol requeue") for line in lines)
    assert (f"torchrun on node1 node2: {nproc} ranks per node, {nnodes.replace(':', ' to ')} nodes, "
            "rendezvous at 10.0.0.1:29500; fabric: none") in err
    assert "torchrun exited with 0" in err


def test_the_knobs_reach_torchrun(fake_slurm):
    env, log = fake_slurm
    proc = start(env, CONFIG, EFT_RDZV_PORT="29555", EFT_MAX_RESTARTS="7", EFT_SHUTDOWN_TIMEOUT_S="50",
                 EFT_LEASE_WAIT_S="60")
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    (line, _) = [line for line in log.read_text().splitlines() if line.startswith("torchrun")]
    assert (" --rdzv-endpoint=10.0.0.1:29555 --rdzv-id=4242 --max-restarts=7 "
            f"{SIGNALS} --shutdown-timeout=50 -m app.train.torchrun {CONFIG} --wait-timeout-s 60 [on ") in line


def test_a_failed_training_is_the_jobs_exit_code(fake_slurm):
    env, log = fake_slurm
    proc = start(env, CONFIG, FAKE_TORCHRUN_RC_node2="3")
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 3, err
    assert "torchrun exited with 3" in err
    assert "scontrol requeue" not in log.read_text()


def test_usr1_checkpoints_every_node_and_requeues(fake_slurm):
    env, log = fake_slurm
    began = time.monotonic()
    proc = start(env, "jobs/configs/tiny-cpu.yaml", EFT_SHIM_SECONDS="30")
    deadline = began + 10
    while log.read_text().count("\ntorchrun --") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text().count("\ntorchrun --") == 2
    os.kill(proc.pid, signal.SIGUSR1)  # what `--signal=B:USR1@120` delivers to the batch shell
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    # The ranks saved on the signal, not when the fake training's 30 s ran out.
    assert time.monotonic() - began < 15
    lines = log.read_text().splitlines()
    after = lines[max(i for i, line in enumerate(lines) if line.startswith("torchrun --")) + 1:]
    assert after[0] == "srun forwards USR1 to 2 tasks", lines
    saved = [after.index(f"torchrun on {node} got USR1; ranks checkpointed") for node in ("node1", "node2")]
    assert [line for line in lines if line.startswith("scontrol requeue")] == ["scontrol requeue 4242"]
    assert max(saved) < after.index("scontrol requeue 4242") == len(after) - 1
    assert "eft-slurm: USR1: asking the torchrun ranks to checkpoint, then requeueing job 4242" in err
    assert "torchrun exited with" not in err


@pytest.mark.parametrize("fabric", ["efa", None])
def test_the_efa_switch_reaches_every_torchrun(fake_slurm, fabric):
    env, log = fake_slurm
    extra = {"EFT_FABRIC": fabric, "FAKE_EFA": "1"} if fabric else {}
    proc = start(env, CONFIG, **extra)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    want = ("efa", "1", "1", "^lo,docker") if fabric else ("", "", "", "")
    assert torchrun_env(log) == [("node1", "0", "12", "0", *want), ("node2", "1", "12", "0", *want)]
    lines = log.read_text().splitlines()
    probe = f"{ONE_TASK} -w node1 fi_info -p efa"
    step = next(i for i, line in enumerate(lines) if line.startswith("srun --export=ALL,OMP_NUM_THREADS="))
    if fabric:
        assert lines.index(probe) < step and "fi_info -p efa [on node1]" in lines
    else:
        assert not any("fi_info" in line for line in lines)
    assert f"fabric: {fabric or 'none'}" in err


@pytest.mark.parametrize("extra, rc, message", FABRIC_FAILURES)
def test_a_missing_or_unknown_fabric_stops_before_torchrun(fake_slurm, extra, rc, message):
    env, log = fake_slurm
    proc = start(env, CONFIG, **extra)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == rc and f"eft-slurm: {message}" in err, err
    assert "torchrun" not in log.read_text()
    assert (log.parent / "env.log").read_text() == ""


def test_needs_a_config():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert result.returncode != 0
    assert "usage: sbatch finetune-torchrun.sbatch CONFIG.yaml" in result.stderr
