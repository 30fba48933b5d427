"""Spot pre-emption on a real multi-node Ray cluster (one machine, `ray.cluster_utils.Cluster`):
a drain notice with a deadline → just-in-time checkpoint; the node goes → the run continues on 2
workers; a node comes back → it grows to 3; a node is killed without notice → the run resumes
from the last periodic checkpoint on 2. The committed trajectory consumes every row of each
epoch exactly once, with the rows per step and the losses of an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_dataset

from app.config import build_config
from app.data.stream import DataOrder
from app.storage import Store
from app.train.checkpoint import load_events
from app.train.metrics import load_metrics

ROOT = Path(__file__).resolve().parents[1]
BASE, DATA = "s3://eft/models/tiny-spot", "s3://eft/data/spot"
STEPS = 100  # the scenario's default (tests/scenarios/spot.py)
RUN = "s3://eft/runs-spot/spot"


@pytest.fixture(scope="module")
def spot_result(s3, ray_cluster, tmp_path_factory):
    manifest = build_tiny_dataset(build_config({
        "name": "p", "model": {"uri": BASE}, "data": {"uri": DATA, "seq_len": 64},
        "prepare": {"input_uri": "s3://eft/raw/spot.jsonl"}, "storage": {"root_uri": "s3://eft/runs-spot"},
        "training": {"max_steps": 1}}), tmp_path_factory.mktemp("raw"))
    out = tmp_path_factory.mktemp("spot") / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scenarios" / "spot.py"), str(out), BASE, DATA,
                           s3.endpoint], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), manifest


def test_spot_reclaim_takes_a_jit_checkpoint_and_loses_no_steps(spot_result):
    log, _ = spot_result
    summary = log["summary"]
    assert log["drain_accepted"] and summary["status"] == "succeeded" and summary["steps"] == STEPS
    notice = summary["preemption_notices"][0]["step"]
    assert 8 <= notice < STEPS  # mid-run
    first = summary["interruptions"][0]
    assert first["step_at_notice"] == notice
    assert first["cause"] == "preemption" and first["steps_lost"] == 0
    assert log["jit_checkpoint_step"] == notice  # complete in storage before the node went
    assert first["resumed_from_step"] >= first["step_at_notice"]
    assert first["world_size_before"] == 3 and first["world_size_after"] == 2


def test_run_shrinks_grows_back_and_survives_a_hard_kill(spot_result):
    log, _ = spot_result
    summary = log["summary"]
    assert summary["world_sizes"] == [3, 2, 3, 2]
    assert [i["cause"] for i in summary["interruptions"]] == ["preemption", "resize", "worker_failure"]
    assert all(i["steps_recomputed"] <= 10 for i in summary["interruptions"])  # ≤ the checkpoint interval
    kill = summary["interruptions"][2]
    # No notice, so no just-in-time save: it resumes from the last checkpoint before the kill.
    assert kill["step_at_notice"] is None and kill["resumed_from_step"] <= kill["last_step_before"]


def test_restarts_after_node_loss_are_sized_on_the_live_nodes(spot_result):
    """Each restart after a node loss launches straight away on the nodes still alive: the
    controller's events show one launch per worker group that ran, each sized on what the
    live nodes held, and no launch that failed, so no worker-group start timeout was waited
    out. (How many seconds recovery takes is measured by bench/elastic_recovery.py.)"""
    log, _ = spot_result
    print(f"recovery seconds (for information): {log['recovery_s']}")
    events = load_events(Store(), RUN)
    controller = [e for e in events if e["kind"] in ("worker_group_launch", "worker_group_failure")]
    launches = [e for e in controller if e["kind"] == "worker_group_launch"]
    failures = [e for e in controller if e["kind"] == "worker_group_failure"]
    assert [e["num_workers"] for e in launches] == log["summary"]["world_sizes"] == [3, 2, 3, 2], controller
    for launch in launches:
        assert launch["num_workers"] == min(launch["max_workers"], launch["live_capacity"]), launch
    # Each node loss: one failure, retried, then a launch on the 2 nodes left, with nothing in
    # between. A restart sized on stale capacity would show a launch of 3 failing out of
    # SCHEDULING (a start timeout) before the launch of 2.
    assert [(e["kind"], e.get("num_workers")) for e in controller] == [
        ("worker_group_launch", 3), ("worker_group_failure", None), ("worker_group_launch", 2),
        ("worker_group_launch", 3), ("worker_group_failure", None), ("worker_group_launch", 2)], controller
    assert [f["decision"] for f in failures] == ["RETRY", "RETRY"]
    assert all(f["from_state"] != "SCHEDULING" and f["to_state"] == "RESTARTING" for f in failures), failures
    assert not [f for f in failures if "Startup" in f["error"] or "Startup" in str(f["cause"])], failures
    # The launches bracket the node losses: the preempted node removed, the other one killed.
    assert launches[0]["time"] < log["removed_at"] < failures[0]["time"] < launches[1]["time"]
    assert launches[2]["time"] < log["killed_at"] < failures[1]["time"] < launches[3]["time"]


def test_committed_trajectory_is_exactly_once_and_matches_the_uninterrupted_run(spot_result):
    log, manifest = spot_result
    store = Store()
    metrics = load_metrics(store, RUN)
    reference = load_metrics(store, "s3://eft/runs-spot/spot-reference")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    order = DataOrder.from_manifest(manifest, seed=0)
    n = order.num_rows
    consumed = [r for m in metrics for r in m["row_ids"]]
    for epoch in range(len(consumed) // n + 1):
        part = consumed[epoch * n:(epoch + 1) * n]
        assert len(part) == len(set(part)), f"a row repeats within epoch {epoch}"
    assert sorted(consumed[:n]) == list(range(n))
    full, rest = divmod(STEPS * 12, n)
    assert full >= 1 and log["summary"]["rows_consumed_per_epoch"] == [n] * full + [rest] * bool(rest)
    drift = max(abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(metrics, reference))
    print(f"max relative loss drift vs the uninterrupted run: {drift:.2e}")
    for got, want in zip(metrics, reference):
        assert got["row_ids"] == want["row_ids"]
        # Only the summation order differs at 2 vs 3 workers: measured drift ~1e-7 over 100-150 steps
        # at lr 3e-3 (at lr 1e-2 training is chaotic enough to amplify it to ~1e-2).
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]
    assert log["summary"]["final_train_loss"] == pytest.approx(log["reference_summary"]["final_train_loss"], rel=1e-4)
