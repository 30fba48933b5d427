"""`eft status` / `eft report` on run records written by the app's own writers (config dump,
events, heartbeats, MetricsLog, DCP checkpoints, summary) on the real S3 endpoint."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import pytest

from app import cli
from app.config import build_config, dump_config
from app.data.manifest import FORMAT_VERSION, manifest_uri
from app.elastic.checkpoint import (TRAIN_STATE, build_sidecar, checkpoint_dir_name, list_checkpoints, list_local_files,
                                    write_sidecar)
from app.observe.metrics import METRICS_DIR, METRICS_FILE, MetricsLog, StepTimer, load_metrics
from app.observe.records import Heartbeat, record_event
from app.observe.summary import build_summary, write_summary
from app.report import NO_VALIDATION_NOTE, build_status, load_run, run_state, save_report
from app.storage import Store, join

ROOT = "s3://eft/test-report/runs"
REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, SEQ_LEN, TRAIN_ROWS = 4, 16, 40


def build_job(name: str, eval_every: int | None):
    return build_config({
        "name": name,
        "model": {"uri": "s3://eft/test-report/model"},
        "data": {"uri": f"s3://eft/test-report/data/{name}", "seq_len": SEQ_LEN},
        "training": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1, "max_steps": 12,
                     "eval_every_steps": eval_every},
        "scaling": {"min_workers": 1, "max_workers": 2},
        "storage": {"root_uri": ROOT},
    })


def start_driver(store: Store, cfg) -> None:
    """What `run_training` writes before the trainer starts."""
    store.write_text(join(cfg.run_uri, "config.yaml"), dump_config(cfg))
    record_event(store, cfg.run_uri, "driver_start", resumed=False)


def start_worker_group(store: Store, cfg, world: int, resumed_from_step: int | None) -> Heartbeat:
    """What rank 0 of a new worker group writes: its start event, then a heartbeat per step."""
    attempt = record_event(store, cfg.run_uri, "worker_group_start", world_size=world,
                           resumed_from_step=resumed_from_step)
    return Heartbeat(store, cfg.run_uri, attempt, enabled=True, interval_s=0, world_size=world,
                     resumed_from_step=resumed_from_step or 0)


def train_loss(step: int) -> float:
    return 8.0 - 0.1 * step


def val_loss(step: int) -> float:
    return 8.3 - 0.1 * step


def run_steps(store: Store, cfg, heartbeat: Heartbeat, world: int, first: int, last: int,
              flush_through: int | None = None, extra: dict | None = None) -> MetricsLog:
    """Steps first..last as the loop records them; metrics are uploaded only through
    `flush_through` (the loop flushes at checkpoints), heartbeats every step. The loop's timed
    background metrics uploads are off (an infinite interval), and the heartbeats'
    background writes are waited for: on return, storage holds exactly that."""
    log = MetricsLog(store, cfg.run_uri, enabled=True, upload_interval_s=math.inf)
    log.load(up_to_step=first - 1)
    timer = StepTimer(cfg.training.max_steps, start_step=first - 1)
    every = cfg.training.eval_every_steps
    for step in range(first, last + 1):
        record = {"step": step, "loss": train_loss(step), "lr": 1e-3, "grad_norm": 0.5, "world_size": world,
                  "rows_consumed": step * GLOBAL_BATCH, "epoch": step * GLOBAL_BATCH / TRAIN_ROWS,
                  **timer.end_step(step, GLOBAL_BATCH * SEQ_LEN), **(extra or {})}
        if every and step % every == 0:
            record["val_loss"] = val_loss(step)
        log.append(record)
        heartbeat.beat(step)
        if step == (flush_through or last):
            log.flush()
    heartbeat.flush()
    return log


def save_checkpoint(store: Store, run_uri: str, step: int, world: int) -> None:
    """A real (one-process) DCP checkpoint plus train_state.json and its sidecar, as Ray Train uploads it."""
    import torch
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as local, warnings.catch_warnings():
        # No process group here, on purpose: DCP then saves as a single process, and says so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": {"lora_A": torch.full((2, 2), float(step))}}, checkpoint_id=local)
        Path(local, TRAIN_STATE).write_text(json.dumps({"step": step, "rows_consumed": step * GLOBAL_BATCH,
                                                        "world_size": world, "seed": 0}))
        write_sidecar(Path(local), build_sidecar(list_local_files(Path(local)), step=step, world_size=world))
        store.upload_dir(local, join(run_uri, checkpoint_dir_name(step)))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def store(s3):
    return Store()


@pytest.fixture(scope="module")
def finished_run(store):
    """12 steps: 2 workers to a pre-emption notice at step 6 (JIT checkpoint), then 1 worker from
    step 6 to the end; validation every 4 steps; summary.json by the app's own builder."""
    cfg = build_job(unique("finished"), eval_every=4)
    # build_summary reads the train rows from the dataset manifest.
    store.write_json(manifest_uri(cfg.data.uri), {"format_version": FORMAT_VERSION, "seq_len": SEQ_LEN,
                                                  "splits": {"train": {"rows": TRAIN_ROWS, "shards": []}}})
    start_driver(store, cfg)
    beat = start_worker_group(store, cfg, world=2, resumed_from_step=None)
    run_steps(store, cfg, beat, world=2, first=1, last=6)
    record_event(store, cfg.run_uri, "preemption_notice", step=6, deadline_ms=30_000, nodes=["node-b"], ranks=[1])
    save_checkpoint(store, cfg.run_uri, 6, world=2)
    beat = start_worker_group(store, cfg, world=1, resumed_from_step=6)
    run_steps(store, cfg, beat, world=1, first=7, last=12)
    save_checkpoint(store, cfg.run_uri, 12, world=1)
    summary = build_summary(store, cfg, status="succeeded", wall_s=3.0,
                            checkpoints=list_checkpoints(store, cfg.run_uri))
    write_summary(store, cfg.run_uri, summary)
    return cfg, summary


def write_running_run(store: Store) -> tuple:
    """A run in progress: no eval, heartbeat at step 8, metrics flushed through step 6."""
    cfg = build_job(unique("running"), eval_every=None)
    start_driver(store, cfg)
    beat = start_worker_group(store, cfg, world=2, resumed_from_step=None)
    log = run_steps(store, cfg, beat, world=2, first=1, last=8, flush_through=6)
    return cfg, log.records[5]


def test_status_of_finished_run(store, finished_run, capsys, monkeypatch):
    cfg, summary = finished_run
    status = build_status(load_run(store, cfg.run_uri))
    assert status["state"] == "succeeded"
    assert (status["step"], status["total_steps"]) == (12, 12) == (summary["steps"], summary["target_steps"])
    assert status["train_loss"] == pytest.approx(train_loss(12)) == pytest.approx(summary["final_train_loss"])
    assert status["val_loss"] == pytest.approx(val_loss(12)) == pytest.approx(summary["final_val_loss"])
    assert status["val_ppl"] == pytest.approx(math.exp(val_loss(12)))
    assert status["tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    assert status["eta_s"] is None and status["mfu"] is None
    assert status["restarts"] == summary["restarts"] == 1
    (interruption,) = status["interruptions"]
    assert interruption == summary["interruptions"][0]
    assert (interruption["cause"], interruption["step_at_notice"], interruption["resumed_from_step"]) == \
        ("preemption", 6, 6)
    assert [w["world_size"] for w in status["world_size_timeline"]] == [2, 1]
    assert status["preemption_notices"] == [6]
    assert status["latest_checkpoint"] == summary["latest_checkpoint"] == join(cfg.run_uri, "checkpoint-00000012")

    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["status", cfg.run_uri]) == 0
    text = capsys.readouterr().out
    assert "succeeded" in text and "12 / 12" in text and "preemption (world 2→1" in text
    assert "MFU" in text and "checkpoint-00000012" in text


def test_status_json(store, finished_run, capsys):
    cfg, _ = finished_run
    assert cli.main(["status", cfg.run_uri, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = json.loads(json.dumps(build_status(load_run(store, cfg.run_uri))))
    assert printed == expected
    assert printed["mfu"] is None and printed["interruptions"][0]["cause"] == "preemption"


def test_status_of_running_run(store, capsys, monkeypatch):
    cfg, flushed = write_running_run(store)
    run = load_run(store, cfg.run_uri)
    # The heartbeat is ahead of the metrics, last uploaded at step 6.
    assert [m["step"] for m in run["metrics"]] == list(range(1, 7))
    (beat,) = run["heartbeats"]
    assert (beat["first_step"], beat["last_step"]) == (1, 8)
    status = build_status(run, now=beat["last_step_at"] + 1)
    assert status["state"] == "running"
    assert (status["step"], status["metrics_step"]) == (8, 6)
    assert status["train_loss"] == pytest.approx(train_loss(6))
    assert status["eta_s"] is not None and 0 <= status["eta_s"] <= flushed["eta_s"]
    assert status["val_loss"] is None and status["restarts"] == 0

    later = beat["last_step_at"] + 300
    assert run_state(run, now=later) == "stopped (no heartbeat for 300 s)"
    assert build_status(run, now=later)["eta_s"] is None

    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["status", cfg.run_uri]) == 0
    text = capsys.readouterr().out
    assert "running" in text and "8 / 12" in text and "driver" not in text  # no lease: nobody named

    # While a driver holds the run's lease, status names it and the lease's expiry.
    from app.lease import build_run_lease

    lease = build_run_lease(store, cfg.run_uri).start()
    try:
        held = build_status(load_run(store, cfg.run_uri))["lease"]
        assert (held["pid"], held["epoch"]) == (os.getpid(), 1) and held["expires_at"]
        assert cli.main(["status", cfg.run_uri]) == 0
        text = capsys.readouterr().out
        assert f"eft train (pid {os.getpid()} on" in text and "lease epoch 1 until" in text
    finally:
        lease.stop()
    assert build_status(load_run(store, cfg.run_uri))["lease"] is None


def test_resumed_run_is_not_reported_by_its_old_summary(store):
    cfg, _ = write_running_run(store)
    old = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    write_summary(store, cfg.run_uri, {"name": cfg.name, "status": "failed", "steps": 3, "finished_at": old})
    record_event(store, cfg.run_uri, "driver_start", resumed=True)
    assert run_state(load_run(store, cfg.run_uri)) == "running"


def test_report_writes_png_and_markdown(store, finished_run, capsys, tmp_path):
    from matplotlib.image import imread

    cfg, _ = finished_run
    uris = save_report(store, load_run(store, cfg.run_uri))
    assert uris == [join(cfg.run_uri, "report", "loss.png"), join(cfg.run_uri, "report", "report.md")]
    png = store.read_bytes(uris[0])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    pixels = imread(io.BytesIO(png), format="png")
    assert pixels.ndim == 3 and pixels.shape[0] > 0 and pixels.shape[1] > 0
    markdown = store.read_text(uris[1])
    assert "![loss curves](loss.png)" in markdown
    assert "| 1 | preemption | 2→1 | 6 |" in markdown
    assert NO_VALIDATION_NOTE not in markdown

    assert cli.main(["report", cfg.run_uri, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "loss.png"), str(tmp_path / "report.md")]
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert "preemption" in (tmp_path / "report.md").read_text()


def test_report_without_validation_says_so(store, tmp_path):
    cfg, _ = write_running_run(store)
    run = load_run(store, cfg.run_uri)
    save_report(store, run, out_uri=str(tmp_path))
    markdown = (tmp_path / "report.md").read_text()
    assert NO_VALIDATION_NOTE in markdown and "| val loss | - |" in markdown
    assert "None: the worker group ran without a restart." in markdown


def test_torn_last_line_is_ignored(store):
    cfg = build_job(unique("torn"), eval_every=None)
    start_driver(store, cfg)
    run_steps(store, cfg, start_worker_group(store, cfg, world=2, resumed_from_step=None), world=2, first=1, last=3)
    # A run recorded before segments: one metrics.jsonl, rewritten whole, cut off mid-line.
    rows = load_metrics(store, cfg.run_uri)
    store.delete_prefix(join(cfg.run_uri, METRICS_DIR))
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    store.write_text(join(cfg.run_uri, METRICS_FILE), lines + '{"step": 4, "loss": 7.')
    status = build_status(load_run(store, cfg.run_uri))
    assert (status["metrics_step"], status["step"]) == (3, 3)
    assert status["train_loss"] == pytest.approx(train_loss(3))


def test_optional_metrics_are_shown_when_recorded(store, monkeypatch, capsys):
    cfg = build_job(unique("extras"), eval_every=2)
    start_driver(store, cfg)
    extra = {"mfu": 0.412, "peak_mem_gb": 12.5, "tokens_per_s_per_worker": 1500.0, "val_ppl": 123.0}
    run_steps(store, cfg, start_worker_group(store, cfg, world=2, resumed_from_step=None), world=2,
              first=1, last=2, extra=extra)
    status = build_status(load_run(store, cfg.run_uri))
    assert {k: status[k] for k in extra} == extra
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["status", cfg.run_uri]) == 0
    text = capsys.readouterr().out
    assert "41.2%" in text and "12.50 GB (GPU)" in text and "1,500 per worker" in text and "perplexity 123.00" in text


def test_no_run_here_is_one_line_and_non_zero(s3):
    uri = f"{ROOT}/{unique('nothing')}"
    for command in (["status", uri], ["report", uri]):
        proc = subprocess.run([sys.executable, "-m", "app.cli", *command], cwd=REPO, env=dict(os.environ),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [
            f"eft: error: {uri}: no run here (no config.yaml, metrics or events/)"]


def test_a_restart_breaks_into_phases_that_add_up_to_its_recovery():
    from app.observe.summary import build_restart_phases
    from app.report import format_restart_phases

    prev = {"last_step_at": 100.0}
    between = [{"kind": "preemption_notice", "time": 99.0}, {"kind": "worker_group_failure", "time": 103.0},
               {"kind": "worker_group_launch", "time": 104.5}]
    after = {"entered_at": 108.0, "model_load_at": 109.0, "model_built_at": 112.0, "restored_at": 112.5}
    nxt = {"first_batch_at": 112.7, "first_step_at": 113.9}
    phases = build_restart_phases(between, after, prev, nxt)
    assert phases == {"detect_s": 3.0, "relaunch_s": 1.5, "worker_start_s": 3.5, "setup_s": 1.0, "model_load_s": 3.0,
                      "restore_s": 0.5, "first_batch_s": 0.2, "first_step_s": 1.2}
    assert sum(phases.values()) == pytest.approx(nxt["first_step_at"] - prev["last_step_at"])
    assert format_restart_phases(phases).startswith("detect 3.0, relaunch 1.5, worker start 3.5, setup 1.0")
    # A fixed-size run records no controller events: the time before the train function is one phase.
    alone = build_restart_phases([], after, prev, nxt)
    assert list(alone)[:2] == ["worker_start_s", "setup_s"] and alone["worker_start_s"] == 8.0
    # A run recorded before the marks existed: the whole recovery is its last phase.
    assert build_restart_phases([], {}, prev, {"first_step_at": 113.9}) == {"first_step_s": 13.9}
    assert build_restart_phases([], after, {}, nxt) is None
