"""The Weights & Biases sink, with the real wandb in offline mode: what it writes is read back from
W&B's own transaction log (`<WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb`, what `wandb sync`
uploads), and W&B down or hanging costs a warning, never the run. No network, no Ray, and nothing
written under HOME (the CI's HOME is empty)."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from app.observe.sinks import (FORWARDED_WANDB_ENV, WandbSink, log_to_wandb, scalars_of, wandb_run_id,
                               wandb_settings)

ROOT = Path(__file__).resolve().parents[1]
RUN_URI = "s3://eft/runs/my-run"
CONFIG = {"name": "my-run", "training": {"learning_rate": 0.001, "max_steps": 6}, "lora": {"r": 8}}


@pytest.fixture(scope="module", autouse=True)
def wandb_home(tmp_path_factory):
    """W&B's per-user directories (settings, cache, artifact staging) in a temp directory, and a
    HOME that does not exist, so a write there would show. W&B reads its environment once per
    process, at its first run: the module's runs share these, and W&B is torn down after them."""
    root = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for key in (*FORWARDED_WANDB_ENV, "WANDB_API_KEY", "WANDB_SERVICE"):
            mp.delenv(key, raising=False)
        mp.setenv("HOME", str(root / "home"))
        for key, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                         ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
            mp.setenv(key, str(root / sub))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DISABLE_GIT", "true")
        mp.setenv("WANDB_DISABLE_CODE", "true")
        mp.setenv("WANDB__DISABLE_STATS", "true")  # no system-metrics sampler: CPU the tests do not need
        mp.setenv("WANDB__SAVE_REQUIREMENTS", "false")
        mp.setenv("WANDB_ERROR_REPORTING", "false")
        yield root
        import wandb

        wandb.teardown()
    assert not (root / "home").exists(), "W&B wrote under HOME"


@pytest.fixture
def offline(tmp_path, monkeypatch) -> dict:
    """The driver's W&B settings for an offline run into a temp WANDB_DIR."""
    monkeypatch.setenv("WANDB_PROJECT", "eft-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep-7")
    monkeypatch.setenv("WANDB_TAGS", "lora,tiny")
    return wandb_settings()


# -- reading W&B's transaction log back ----------------------------------------------------------
# wandb 0.31 ships no Python reader of its `.wandb` files (wandb.sdk.internal.datastore is gone;
# wandb-core reads them, in Go). The format is LevelDB's log format behind a 7-byte W&B header
# (":W&B", magic 0xBEE1, version 0): 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of the
# type byte then the data, length, type: full / first / middle / last); each record is a
# wandb.proto.wandb_internal_pb2.Record. Checked against wandb 0.31.0's files.

def read_records(path: Path, timeout_s: float = 20.0) -> list:
    """The run's records, once its `exit` record is written: wandb-core writes the log on a
    thread of its own, so the last records can land just after `run.finish()` returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = parse_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def parse_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < 7:
        return []
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B transaction log"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is zeros
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):  # the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


class WandbRun:
    """One offline run directory's transaction log, decoded."""

    def __init__(self, directory: Path):
        self.directory = directory
        (self.file,) = directory.glob("run-*.wandb")
        self.records = read_records(self.file)
        (run,) = [r.run for r in self.records if r.WhichOneof("record_type") == "run"]
        self.run_id, self.name, self.project = run.run_id, run.display_name, run.project
        self.group, self.tags = run.run_group, list(run.tags)
        self.config = {item.key: json.loads(item.value_json) for item in run.config.update}
        for r in self.records:
            if r.WhichOneof("record_type") == "config":
                self.config.update({item.key: json.loads(item.value_json) for item in r.config.update})
        self.history = [self._items(r.history.item) for r in self.records if r.WhichOneof("record_type") == "history"]
        self.summary = {}
        for r in self.records:
            if r.WhichOneof("record_type") == "summary":
                self.summary.update(self._items(r.summary.update))

    @staticmethod
    def _items(items) -> dict:
        return {"/".join(item.nested_key) if item.nested_key else item.key: json.loads(item.value_json)
                for item in items}

    def rows(self) -> list[dict]:
        """The history rows as logged: W&B's own keys (`_step`, `_runtime`...) left out."""
        return [{k: v for k, v in row.items() if not k.startswith("_")} for row in self.history]


def wandb_runs(settings: dict) -> list[WandbRun]:
    """The offline runs written under the settings' WANDB_DIR, oldest first."""
    return [WandbRun(d) for d in sorted((Path(settings["WANDB_DIR"]) / "wandb").glob("offline-run-*"))]


def training_records(steps) -> list[dict]:
    """Records as the training loop makes them: a step, scalars, and what is not plotted."""
    return [{"step": s, "loss": 2.0 / s, "lr": 1e-3 * s / 6, "tokens_per_s": 1000.0 + s, "grad_norm": 0.5,
             "rows_consumed": 8 * s, "world_size": 2, "row_ids": [s, s + 1], "val_loss": float("nan")}
            for s in steps]


def logged(records: list[dict]) -> list[dict]:
    return [{**scalars_of(r), "step": r["step"]} for r in records]


# -- what the sink writes ------------------------------------------------------------------------

def test_the_sink_logs_each_record_at_its_step_and_the_config(offline):
    records = training_records(range(1, 6))
    sink = WandbSink(offline, RUN_URI, CONFIG)
    for record in records:
        sink.log(record)
    assert sink.finish() is True
    (run,) = wandb_runs(offline)
    assert (run.run_id, run.name, run.project) == (wandb_run_id(RUN_URI), "my-run", "eft-test")
    assert (run.group, run.tags) == ("sweep-7", ["lora", "tiny"])  # forwarded settings, applied
    assert run.rows() == logged(records)
    assert {"row_ids", "world_size", "val_loss"}.isdisjoint(run.rows()[0])  # not scalars, or not finite
    assert {k: run.config[k] for k in CONFIG} == CONFIG
    assert run.summary["loss"] == records[-1]["loss"]
    # The training step is the charts' x axis (W&B's _step counts rows, whoever wrote them).
    metrics = [r.metric for r in run.records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metrics)


def test_a_resumed_attempt_continues_the_same_wandb_run(offline):
    first = WandbSink(offline, RUN_URI, CONFIG)
    for record in training_records(range(1, 5)):
        first.log(record)
    assert first.finish()
    # The attempt restarted from the checkpoint at step 2 (steps 3 and 4 were lost with the nodes).
    second = WandbSink(offline, RUN_URI, CONFIG, resumed_from_step=2)
    resumed = training_records(range(3, 7))
    for record in resumed:
        second.log(record)
    assert second.finish()
    before, after = wandb_runs(offline)
    assert before.run_id == after.run_id == wandb_run_id(RUN_URI)
    assert [row["step"] for row in before.rows()] == [1, 2, 3, 4]
    assert after.rows() == logged(resumed)
    assert after.summary["eft/resumed_from_step"] == 2


# -- the eval task's scores and tables -------------------------------------------------------------

EVAL_RECORD = {"step": 4, "eval_default_accuracy": 0.5, "eval_default_accuracy_low": 0.2,
               "eval_default_accuracy_high": 0.8}
PREDICTIONS = [{"index": 0, "prompt": "2+2?", "answer": "4", "prediction": "4", "correct": True},
               {"index": 1, "prompt": None, "answer": "7", "prediction": "9", "correct": False}]
TABLE = "eval/default/step-000004"


def assert_scores_and_table(run: WandbRun) -> None:
    (row,) = [r for r in run.rows() if any(k.startswith(TABLE) for k in r)]
    assert {k: row[k] for k in EVAL_RECORD} == EVAL_RECORD
    assert row[f"{TABLE}/_type"] == "table-file" and row[f"{TABLE}/nrows"] == len(PREDICTIONS)
    table = json.loads((run.directory / "files" / row[f"{TABLE}/path"]).read_text())
    assert table["columns"] == list(PREDICTIONS[0])
    assert table["data"] == [list(p.values()) for p in PREDICTIONS]
    artifacts = [r.artifact for r in run.records if r.WhichOneof("record_type") == "artifact"]
    assert [a.type for a in artifacts] == ["run_table"]


def test_log_to_wandb_writes_the_scores_and_a_table_into_the_run(offline):
    sink = WandbSink(offline, RUN_URI, CONFIG)
    for record in training_records(range(1, 4)):
        sink.log(record)
    assert sink.finish()
    log_to_wandb(offline, RUN_URI, EVAL_RECORD, {TABLE: PREDICTIONS})
    train, evaluation = wandb_runs(offline)
    assert evaluation.directory.name.endswith("-eval")
    assert train.run_id == evaluation.run_id == wandb_run_id(RUN_URI)
    assert_scores_and_table(evaluation)


def test_log_to_wandb_in_the_process_of_an_open_sink_goes_through_it(offline):
    """Under torchrun rank 0 scores its own checkpoints while its sink has the run open: W&B takes
    no second writer of a run in one process, so the scores go through the sink."""
    sink = WandbSink(offline, RUN_URI, CONFIG)
    for record in training_records(range(1, 5)):
        sink.log(record)
    log_to_wandb(offline, RUN_URI, EVAL_RECORD, {TABLE: PREDICTIONS})
    sink.log(training_records([5])[0])
    assert sink.finish()
    (run,) = wandb_runs(offline)
    assert [row["step"] for row in run.rows()] == [1, 2, 3, 4, 4, 5]
    assert_scores_and_table(run)


def test_log_to_wandb_from_another_process_while_the_sink_has_the_run_open(offline):
    """Ray's validation task: a process of its own, while rank 0's sink has the run open."""
    sink = WandbSink(offline, RUN_URI, CONFIG)
    for record in training_records(range(1, 4)):
        sink.log(record)
    assert sink._background.drain(30) and sink.run is not None  # the run is open
    script = textwrap.dedent(f"""
        import json, sys
        from app.observe.sinks import log_to_wandb
        log_to_wandb(json.loads(sys.argv[1]), {RUN_URI!r}, json.loads(sys.argv[2]), json.loads(sys.argv[3]))
    """)
    subprocess.run([sys.executable, "-c", script, json.dumps(offline), json.dumps(EVAL_RECORD),
                    json.dumps({TABLE: PREDICTIONS})], cwd=ROOT, check=True, timeout=120)
    sink.log(training_records([4])[0])
    assert sink.finish()
    train, evaluation = sorted(wandb_runs(offline), key=lambda r: r.directory.name.endswith("-eval"))
    assert train.run_id == evaluation.run_id
    assert [row["step"] for row in train.rows()] == [1, 2, 3, 4]
    assert_scores_and_table(evaluation)


# -- W&B failing is a warning ------------------------------------------------------------------------

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def online(tmp_path, base_url: str, init_timeout_s: int) -> dict:
    return {"WANDB_PROJECT": "eft-test", "WANDB_MODE": "online", "WANDB_BASE_URL": base_url,
            "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_INIT_TIMEOUT": str(init_timeout_s)}


def test_wandb_down_turns_the_sink_off_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # past the key check, to the (closed) server
    # A run URI of its own: W&B's service keeps a run id whose init failed as taken, for its lifetime.
    sink = WandbSink(online(tmp_path, f"http://127.0.0.1:{closed_port()}", 2), "s3://eft/runs/down", CONFIG,
                     finish_timeout_s=20)
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="eft.sinks"):
        for record in training_records(range(1, 6)):
            sink.log(record)
        assert time.monotonic() - began < 0.5  # log never waits on W&B
        assert sink.finish() is False
    assert time.monotonic() - began < 15
    assert not sink.enabled
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B (")]
    assert warning.startswith("W&B (shared) failed (") and "training goes on" in warning


def test_a_hanging_wandb_costs_a_bounded_queue_and_a_bounded_wait(tmp_path, monkeypatch, caplog):
    """A server that accepts connections and never answers: `log` never blocks, the queue keeps
    the newest rows only, and `finish` gives up after its timeout with a warning."""
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        sink = WandbSink(online(tmp_path, f"http://127.0.0.1:{listener.getsockname()[1]}", 3), "s3://eft/runs/hung",
                         CONFIG, max_pending=3, finish_timeout_s=1)
        with caplog.at_level("WARNING", logger="eft.sinks"):
            for record in training_records(range(1, 21)):
                sink.log(record)
            assert sink._background.pending <= 4  # 3 queued + the hung init
            began = time.monotonic()
            assert sink.finish() is False
            assert time.monotonic() - began < 3
            assert sink._background.drain(20)  # wandb.init gives up on its own (WANDB_INIT_TIMEOUT)
    finally:
        listener.close()
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B (")]
    assert warnings[0].startswith("W&B (shared) did not answer within 1 s: 0 of 20 rows sent, the rest given up")


# -- settings and ids ------------------------------------------------------------------------------

def test_wandb_settings_are_on_by_project_or_mode_and_never_carry_the_api_key(monkeypatch):
    for key in (*FORWARDED_WANDB_ENV, "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    assert wandb_settings() is None
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-never-forwarded")
    assert wandb_settings() is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_settings() is None
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_settings() == {"WANDB_MODE": "offline"}
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_PROJECT", "p")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    monkeypatch.setenv("WANDB_TAGS", "a,b")
    settings = wandb_settings()
    assert settings == {"WANDB_PROJECT": "p", "WANDB_ENTITY": "team", "WANDB_TAGS": "a,b"}
    assert "secret-key-never-forwarded" not in json.dumps(settings)
    assert not any("KEY" in k or "TOKEN" in k or "CREDENTIALS" in k for k in FORWARDED_WANDB_ENV)


def test_the_wandb_run_id_is_the_run_name_made_safe_and_a_hash_of_its_uri():
    run_id = wandb_run_id("s3://eft/runs/my-run")
    assert run_id == wandb_run_id("s3://eft/runs/my-run/") and run_id.startswith("my-run-")
    assert run_id != wandb_run_id("gs://other/runs/my-run")  # same name, another root
    odd = wandb_run_id("file:///tmp/runs/qwen 0.5b:sft@v2.1")
    assert odd.startswith("qwen-0-5b-sft-v2-1-")
    long = wandb_run_id("s3://eft/runs/" + "x" * 300)
    assert len(long) == 128
    for value in (run_id, odd, long):
        assert all(c.isascii() and (c.isalnum() or c in "_-") for c in value)
