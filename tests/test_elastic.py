"""Spot pre-emption on a real multi-node Ray cluster (one machine, `ray.cluster_utils.Cluster`):
a drain notice with a deadline → just-in-time checkpoint; the node goes → the run continues on 2
workers; a node comes back → it grows to 3; the committed trajectory consumes every row of each
epoch exactly once, with the rows per step and the losses of an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import build_config
from app.data.prepare import load_manifest, prepare_dataset
from app.data.stream import DataOrder
from app.storage import Store
from app.tiny import build_corpus, save_tiny_base, write_jsonl
from app.train.metrics import load_metrics

ROOT = Path(__file__).resolve().parents[1]
BASE, DATA = "s3://eft/models/tiny-spot", "s3://eft/data/spot"


@pytest.fixture(scope="module")
def spot_result(s3, ray_cluster, tmp_path_factory):
    store = Store()
    texts = build_corpus(max_docs=300)
    save_tiny_base(store, BASE, texts=texts)
    raw = write_jsonl(({"text": t} for t in texts), tmp_path_factory.mktemp("raw") / "c.jsonl")
    store.write_bytes("s3://eft/raw/spot.jsonl", raw.read_bytes())
    prepare_dataset(build_config({"name": "p", "model": {"uri": BASE}, "data": {"uri": DATA, "seq_len": 64},
                                  "prepare": {"input_uri": "s3://eft/raw/spot.jsonl"},
                                  "storage": {"root_uri": "s3://eft/runs-spot"}, "training": {"max_steps": 1}}),
                    store)
    out = tmp_path_factory.mktemp("spot") / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scenarios" / "spot.py"), str(out), BASE, DATA,
                           s3.endpoint], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), load_manifest(store, DATA)


def test_spot_reclaim_takes_a_jit_checkpoint_and_loses_no_steps(spot_result):
    log, _ = spot_result
    summary = log["summary"]
    assert log["drain_accepted"] and summary["status"] == "succeeded" and summary["steps"] == 150
    notice = summary["preemption_notices"][0]["step"]
    assert 8 <= notice < 150  # mid-run
    first = summary["interruptions"][0]
    assert first["step_at_notice"] == notice
    assert first["cause"] == "preemption" and first["steps_lost"] == 0
    assert first["resumed_from_step"] >= first["step_at_notice"]
    assert first["world_size_before"] == 3 and first["world_size_after"] == 2


def test_run_shrinks_then_grows_back(spot_result):
    log, _ = spot_result
    summary = log["summary"]
    assert summary["world_sizes"] == [3, 2, 3]
    assert [i["cause"] for i in summary["interruptions"]] == ["preemption", "resize"]
    assert all(i["steps_recomputed"] <= 10 for i in summary["interruptions"])  # ≤ the checkpoint interval


def test_committed_trajectory_is_exactly_once_and_matches_the_uninterrupted_run(spot_result):
    log, manifest = spot_result
    store = Store()
    metrics = load_metrics(store, "s3://eft/runs-spot/spot")
    reference = load_metrics(store, "s3://eft/runs-spot/spot-reference")
    assert [m["step"] for m in metrics] == list(range(1, 151))
    order = DataOrder.from_manifest(manifest, seed=0)
    n = order.num_rows
    consumed = [r for m in metrics for r in m["row_ids"]]
    for epoch in range(len(consumed) // n + 1):
        part = consumed[epoch * n:(epoch + 1) * n]
        assert len(part) == len(set(part)), f"a row repeats within epoch {epoch}"
    assert sorted(consumed[:n]) == list(range(n))
    assert log["summary"]["rows_consumed_per_epoch"] == [n, n, 150 * 12 - 2 * n]
    for got, want in zip(metrics, reference):
        assert got["row_ids"] == want["row_ids"]
        # Summation order differs at 2 vs 3 workers; over 150 Adam steps at lr 1e-2 that drift
        # reaches ~1e-3 of the loss. A repeated or skipped batch moves it by ~1e-2 or more.
        assert got["loss"] == pytest.approx(want["loss"], rel=3e-3), got["step"]
    assert log["summary"]["final_train_loss"] == pytest.approx(log["reference_summary"]["final_train_loss"], rel=3e-3)
