"""The same loop under torchrun (Ray Train's local mode, no Ray cluster): torchrun's ranks train on
the rows and losses of the Ray Train run at the same world size, a run moves between torchrun and
Ray Train at any world size and stays on its trajectory, and each records itself as `eft train` does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_runs import make_cfg, write_eval_set

from app.config import dump_config
from app.elastic.checkpoint import list_checkpoints, load_train_state
from app.eval.results import load_results
from app.observe.metrics import load_metrics
from app.observe.records import load_events
from app.observe.summary import load_summary
from app.report import load_run
from app.storage import Store, join

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def torchrun(cfg_path: Path, nproc: int, *sets: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """torchrun as a user runs it, from the repository, on loopback with a rendezvous port of its own."""
    args = [TORCHRUN, f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
            "-m", "app.train.torchrun", str(cfg_path), *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_of(agent: "psutil.Process", rank: int) -> list:
    return [c for c in agent.children() if c.environ().get("RANK") == str(rank)]


def lose_a_node_then_signal(cfg_path: Path, lose_after_step: int, signal_after_step: int,
                            timeout_s: float = 600) -> tuple[int, str]:
    """Two torchrun agents of one rank each on loopback (`--nnodes=1:2`, as two nodes), the first
    hosting the c10d rendezvous and so rank 0. Once rank 0 has logged `lose_after_step`, the
    second node is gone at once (its agent and rank SIGKILLed); the first re-forms the group at
    its new size. Once the re-formed rank 0 logs `signal_after_step`, it gets SIGTERM. Returns
    the first agent's exit code and what it wrote to stderr."""
    import psutil

    port = free_port()
    args = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=moved", "--max-restarts=1",
            # Long enough a last call that the second agent, started once the first hosts the
            # store, always joins the first round (a node joining later restarts the group).
            "--rdzv-conf=last_call_timeout=15", "-m", "app.train.torchrun", str(cfg_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    deadline = time.monotonic() + timeout_s
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:  # the first agent hosts the store
        assert first.poll() is None and time.monotonic() < deadline, "the first agent never hosted the rendezvous"
        time.sleep(0.2)
    second = subprocess.Popen(args, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
    lines, lost, reformed, signalled = [], False, False, False
    try:
        for line in first.stderr:
            lines.append(line)
            if not lost and f" step {lose_after_step}/" in line:
                assert rank_of(psutil.Process(first.pid), 0), "rank 0 is not the first node's: " + "".join(lines)
                node = psutil.Process(second.pid)
                for proc in [*node.children(recursive=True), node]:
                    proc.kill()
                lost = True
            reformed = reformed or (lost and "world 1 x accum 4 x micro 2 = global batch 8" in line)
            if reformed and not signalled and f" step {signal_after_step}/" in line:
                (rank0,) = rank_of(psutil.Process(first.pid), 0)
                rank0.send_signal(signal.SIGTERM)
                signalled = True
            assert time.monotonic() < deadline, "".join(lines[-50:])
        return first.wait(timeout=60), "".join(lines)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()


def test_a_run_loses_a_node_under_torchrun_then_moves_to_ray_and_back_on_the_ray_runs_trajectory(
        straight_run, tmp_path):
    """One run of the reference config, three launches:
    - torchrun, two nodes of one rank (`--nnodes=1:2`). Up to the loss of a node, each step's
      global batch holds the rows of the Ray Train run's at 2 workers, and the losses are the same
      bit for bit (the same gloo reductions in the same order). One node is then lost after step 7
      (its agent and rank killed): the other's torchrun re-forms the group at 1 rank, which resumes
      from the step-6 checkpoint. SIGTERM to it (Kubernetes' pod termination) then gives a
      checkpoint at the next step boundary and exit 0 from the group;
    - Ray Train, 3 workers, two steps more, resumed from torchrun's checkpoint;
    - torchrun, 1 rank (`--nproc-per-node=1`), to step 12, resumed from Ray's checkpoint, scoring
      its checkpoints in process (eval.every_checkpoints) into the records Ray's validation writes.
    Across world sizes the rows stay the same and the losses match up to the reduction order, as
    in the 3 -> 2 -> 1 run under Ray; the checkpoints, metrics and summary are where and what they
    are under Ray alone."""
    from app.train.launch import run_training

    _, ref_summary, reference = straight_run
    cfg = make_cfg("moved")
    cfg_path = tmp_path / "moved.yaml"
    cfg_path.write_text(dump_config(cfg))
    code, stderr = lose_a_node_then_signal(cfg_path, lose_after_step=7, signal_after_step=7)
    assert code == 0, stderr[-4000:]
    assert "world 2 x accum 2 x micro 2 = global batch 8" in stderr
    store = Store()
    first = load_summary(store, cfg.run_uri)
    (saved,) = [e for e in load_events(store, cfg.run_uri) if e["kind"] == "signal_checkpoint"]
    stop = saved["step"]
    # The signal goes out when the re-formed rank 0 logs step 7; it lands at that step's boundary
    # or the next one's, as the rank is quicker or slower than this process to get there.
    assert saved["signal"] == "SIGTERM" and 7 <= stop < 10, saved
    # torchrun's restart is a driver restart: the re-formed rank 0 took the run lease over.
    assert first["status"] == "stopped" and first["steps"] == stop and first["launchers"] == ["torchrun"] * 2
    assert first["world_sizes"] == [2, 1] and first["resumed_from_steps"] == [6]
    assert first["latest_checkpoint"].endswith(f"checkpoint-{stop:08d}")
    assert f"SIGTERM: checkpoint at step {stop} is up; stopping" in stderr
    metrics = load_metrics(store, cfg.run_uri)
    assert [(m["step"], m["row_ids"], m["loss"]) for m in metrics[:6]] == [
        (m["step"], m["row_ids"], m["loss"]) for m in reference[:6]]

    padded = {**cfg.training.model_dump(), "max_steps": stop + 2, "pad_uneven_batches": True}
    on_ray = run_training(make_cfg("moved", training=padded, scaling={"min_workers": 3, "max_workers": 3}))
    assert on_ray["resumed_from_steps"] == [6, stop] and on_ray["launchers"] == ["torchrun", "torchrun", "ray"]

    # The last leg scores its checkpoints as the run goes (eval.every_checkpoints): with no Ray,
    # rank 0 does it in its own process, between steps, into the same records.
    scored_path = tmp_path / "moved-scored.yaml"
    scored_path.write_text(dump_config(make_cfg("moved", eval={"uri": write_eval_set(), "every_checkpoints": 1,
                                                               "max_new_tokens": 8, "batch_size": 4})))
    last = torchrun(scored_path, 1, "training.max_steps=12")
    assert last.returncode == 0, last.stderr[-4000:]
    summary = load_summary(store, cfg.run_uri)
    assert summary["status"] == "succeeded" and summary["steps"] == 12
    (result,) = load_results(store, cfg.run_uri)
    assert (result["label"], result["step"], result["n"], result["num_actors"]) == ("step-000012", 12, 12, 1)
    assert result["checkpoint"]["kind"] == "checkpoint" and result["checkpoint"]["checkpoint_uri"].endswith(
        "checkpoint-00000012")
    scored = {r["step"]: r["eval_default_exact_match"] for r in load_run(store, cfg.run_uri)["metrics"]
              if "eval_default_exact_match" in r}
    assert scored == {12: result["score"]}
    store.download_dir(join(cfg.run_uri, "tensorboard"), tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval_default_exact_match")] == [12]
    assert summary["launchers"] == ["torchrun", "torchrun", "ray", "torchrun"] and summary["driver_restarts"] == 3
    assert summary["world_sizes"] == [2, 1, 3, 1] and summary["resumed_from_steps"] == [6, stop, stop + 2]
    metrics = load_metrics(store, cfg.run_uri)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert [m["world_size"] for m in metrics] == [2] * 6 + [1] * (stop - 6) + [3] * 2 + [1] * (10 - stop)
    assert {m["step"]: m["row_ids"] for m in metrics} == {m["step"]: m["row_ids"] for m in reference}
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]
    assert summary["final_train_loss"] == pytest.approx(ref_summary["final_train_loss"], rel=1e-4)
    # torchrun keeps the newest checkpoint.num_to_keep, complete, as Ray's checkpoint manager does.
    kept = list_checkpoints(store, cfg.run_uri)
    assert [uri.rsplit("/", 1)[1] for uri in kept] == [f"checkpoint-{stop + 2:08d}", "checkpoint-00000012"]
    assert load_train_state(store, kept[-1])["rows_consumed"] == 12 * 8
    starts = [e for e in load_events(store, cfg.run_uri) if e["kind"] == "driver_start"]
    assert [(e["launcher"], e["lease_epoch"]) for e in starts] == [("torchrun", 1), ("torchrun", 2), ("ray", 3),
                                                                   ("torchrun", 4)]


def test_the_torchrun_entry_outside_torchrun_is_one_line(tmp_path):
    """Started by hand, without torchrun's environment: one line naming what is missing, exit 2."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-m", "app.train.torchrun", "jobs/configs/tiny-cpu.yaml"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "eft: error: not started by torchrun (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT unset): run `torchrun --nproc-per-node=N -m app.train.torchrun jobs/configs/tiny-cpu.yaml`"]


def test_what_only_ray_does_is_refused_under_torchrun_in_one_line():
    from app.config import load_config
    from app.train.launch import check_launcher

    cfg = load_config(ROOT / "jobs/configs/tiny-grpo.yaml", ["rl.rollout=actors", "rl.rollout_actors=2"])
    check_launcher(cfg, "ray")
    with pytest.raises(ValueError) as err:
        check_launcher(cfg, "torchrun")
    assert str(err.value) == ("rl.rollout actors: the rollout pool runs on Ray, which torchrun does not start; "
                              "use rl.rollout: colocated")


def _signal_one_rank(rank: int, world: int, init: str, out: str, signalled_rank: int, signum: int) -> None:
    import torch.distributed as dist

    from app.elastic.signals import build_signal_stop

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    stop = build_signal_stop(None)
    seen = []
    for step in range(1, 7):
        if step == 3 and rank == signalled_rank:
            os.kill(os.getpid(), signum)  # as the kubelet or Slurm would: to this process only
        if (got := stop.after_step()) is not None:
            seen.append((step, got.name))
            break
    Path(out, f"rank{rank}").write_text(repr(seen))
    dist.destroy_process_group()


@pytest.mark.parametrize("signalled_rank, signum", [(1, signal.SIGTERM), (0, signal.SIGUSR1)])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(signalled_rank, signum, rank_processes, tmp_path):
    """Any rank may get the signal (a node's kubelet signals only its own pods): one all-reduce a
    step makes every rank see it at the same step boundary."""
    rank_processes.spawn(_signal_one_rank, args=(2, f"file://{tmp_path / 'rdzv'}", str(tmp_path), signalled_rank,
                                                 signum), nprocs=2)
    name = signal.Signals(signum).name
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [repr([(3, name)])] * 2
