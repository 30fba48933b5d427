"""Faults that must not kill a run, tried as a user meets them: a real Ray Train run (2 CPU
workers) whose storage goes through a misbehaving proxy in front of the local S3 endpoint
(app/dev/faults.py), and a tracker that is down or hangs. The faulty run must finish on the
same trajectory as an untouched one: the session's shared straight run of the same job."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from app.dev.faults import SlowDownProxy, TcpProxy
from app.elastic.checkpoint import checkpoint_dir_name, is_complete
from app.observe.metrics import load_metrics
from app.observe.records import load_events, load_heartbeats
from app.observe.sinks import MlflowSink
from app.storage import Store, join
from app.train.launch import run_training

def faulted_config(endpoint: str):
    """The session's shared straight run (tests/train_runs.py: 12 steps on 2 workers), its storage
    behind `endpoint`, every checkpoint kept (one a restart resumed from is still there to be
    looked at), without its scoring of checkpoints: the straight run is the untouched reference."""
    from train_runs import make_cfg

    steps = make_cfg("x").training.max_steps
    return make_cfg("faulted", checkpoint={"save_every_steps": 4, "num_to_keep": steps // 4},
                    storage={"root_uri": "s3://eft/runs-faults", "s3_endpoint": endpoint})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics}


def assert_same_trajectory(metrics: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in metrics] == [m["step"] for m in reference] and len(reference) >= 8
    want = losses(reference)
    for step, loss in losses(metrics).items():
        assert loss == pytest.approx(want[step], rel=1e-6, abs=1e-9), step


def test_an_outage_throttling_and_a_dead_tracker_cost_time_not_the_run(s3, straight_run, monkeypatch, capfd):
    """One run meets all three (one Ray Train start instead of one each): 503 SlowDown to ~10% of
    all storage requests for the whole run; MLFLOW_TRACKING_URI at a closed port; and, once the run
    is past step 2, a proxy that drops every connection and refuses new ones for 20 s. Ray Train's
    controller, the workers' checkpoint uploads, the data stream, metrics and heartbeats all ride
    it out; no torn checkpoint is ever resumed from; the run finishes identical to the clean one (the
    session's straight run: the same job with nothing in the way), with a warning for MLflow."""
    _, clean_summary, reference = straight_run
    tracking_uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    # The outage cuts TCP in front; the throttling answers behind it, as an S3 front end would.
    with SlowDownProxy(s3.endpoint, fraction=0.1, seed=7) as throttle, TcpProxy(throttle.endpoint) as proxy:
        cfg = faulted_config(proxy.endpoint)
        seen: dict = {}

        def cut_mid_run() -> None:
            # Watched from outside the proxy: the heartbeat says where the run is.
            while not seen.get("done"):
                beats = load_heartbeats(Store(), cfg.run_uri)
                step = beats[-1]["last_step"] if beats else None
                if step is not None and step >= 2:
                    seen["step"] = step
                    proxy.refuse_for(20)
                    return
                time.sleep(0.2)

        cutter = threading.Thread(target=cut_mid_run, daemon=True)
        cutter.start()
        try:
            summary = run_training(cfg)
        finally:
            seen["done"] = True
            cutter.join()
    assert proxy.refusals == 1 and 2 <= seen["step"] < cfg.training.max_steps  # the outage hit mid-run
    assert throttle.log.count(503) >= 10  # the store really was throttling
    assert summary["status"] == "succeeded" and summary["steps"] == cfg.training.max_steps
    assert summary["final_train_loss"] == pytest.approx(clean_summary["final_train_loss"], rel=1e-6)
    assert_same_trajectory(load_metrics(Store(), cfg.run_uri), reference)
    store = Store()
    for start in load_events(store, cfg.run_uri):
        resumed = start.get("resumed_from_step")
        if start["kind"] == "worker_group_start" and resumed:
            assert is_complete(store, join(cfg.run_uri, checkpoint_dir_name(resumed)))
    # Worker logs reach the driver's output through Ray's log monitor, a moment after the fact.
    out, deadline = "", time.monotonic() + 60
    while f"MLflow at {tracking_uri} failed" not in out and time.monotonic() < deadline:
        time.sleep(0.5)
        out += "".join(capfd.readouterr())
    assert f"MLflow at {tracking_uri} failed" in out and "training goes on" in out


# -- the MLflow sink on its own: down, hanging, bounded -----------------------------------


@pytest.fixture
def mlflow_env(monkeypatch):
    """MlflowSink sets the MLflow variables in its process (a worker's); put them back after."""
    from app.observe.sinks import FORWARDED_MLFLOW_ENV

    for key in FORWARDED_MLFLOW_ENV:
        monkeypatch.delenv(key, raising=False)


def test_mlflow_down_turns_the_sink_off_with_a_warning(mlflow_env, caplog):
    uri = f"http://127.0.0.1:{closed_port()}"
    sink = MlflowSink({"MLFLOW_TRACKING_URI": uri}, "s3://eft/runs/x", {"a": 1})
    with caplog.at_level("WARNING", logger="eft.sinks"):
        for step in range(1, 6):
            sink.log({"step": step, "loss": 1.0})
        assert sink.finish() is False
    assert not sink.enabled
    (warning,) = [r.getMessage() for r in caplog.records if "MLflow at" in r.getMessage()]
    assert warning.startswith(f"MLflow at {uri} failed (") and "training goes on" in warning


def test_a_hanging_mlflow_costs_a_bounded_queue_and_a_bounded_wait(mlflow_env, caplog):
    """A server that accepts connections and never answers: `log` never blocks, the queue keeps
    the newest batches only, and `finish` gives up after its timeout with a warning that counts
    what was not sent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        sink = MlflowSink({"MLFLOW_TRACKING_URI": uri}, "s3://eft/runs/x", {}, max_pending=3, finish_timeout_s=1)
        with caplog.at_level("WARNING", logger="eft.sinks"):
            for step in range(1, 21):
                sink.log({"step": step, "loss": 1.0})
            assert sink._background.pending <= 4  # 3 queued + the hung one
            assert sink.finish() is False
    finally:
        listener.close()
    (warning,) = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert warning.startswith(f"MLflow at {uri} did not answer within 1 s: 0 of 20 batches sent, the rest given up")
