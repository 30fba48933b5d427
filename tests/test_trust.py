"""The run's bucket as a trust boundary, and runs that cannot be swapped under you, on the real
local stack (S3 endpoint, Ray, a tiny Llama): checkpoints carry a JSON sidecar that every
read-only path judges them by (a planted pickle is never executed), a resume on another dataset
or with another identity is refused before Ray starts, and the demo refuses a remote bucket.

The run is the session's shared one (tests/conftest.py's `straight_run`, which tests/test_train.py
asserts on first): a copy of it gets the planted pickles, and the last test here resumes it on
other data."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from train_runs import ALL_LINEAR, BASE, DATA, ROOT, make_cfg

from app.cli import main
from app.data.manifest import load_manifest
from app.data.prepare import prepare_dataset
from app.dev.demo import DemoBucketError, check_demo_bucket, is_loopback_endpoint
from app.elastic import checkpoint as ckpt
from app.elastic.resume import ResumeError, build_identity, check_resume, dataset_fingerprint
from app.export import ExportError, export_run
from app.observe import records
from app.observe.metrics import load_metrics
from app.storage import Store, join
from app.train.launch import run_training

OTHER_DATA = "s3://eft/data/trust-other"


@pytest.fixture(scope="module")
def trained(straight_run, train_dataset):
    """12 steps on 2 workers, checkpoints at 6 and 12: the run every test here reads or resumes."""
    cfg, summary, _ = straight_run
    assert summary["status"] == "succeeded"
    return cfg, train_dataset


class PlantedPickle:
    """What an attacker with write access to the bucket plants as `.metadata`: unpickling it
    runs code (here: creates a marker directory)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_every_checkpoint_has_a_sidecar_listing_every_ranks_files(trained):
    cfg, manifest = trained
    store = Store()
    checkpoints = ckpt.list_checkpoints(store, cfg.run_uri)
    assert [ckpt.step_of(c) for c in checkpoints] == [6, 12]
    for uri in checkpoints:
        sidecar = ckpt.load_sidecar(store, uri)
        stored = store.list_file_sizes(uri)
        del stored[ckpt.SIDECAR]
        assert sidecar["files"] == stored
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "train_state.json"} <= set(stored)
        assert sidecar["step"] == ckpt.step_of(uri) and sidecar["world_size"] == 2
        dataset = {"uri": DATA, "fingerprint": dataset_fingerprint(manifest)}
        assert sidecar["dataset"] == dataset
        assert ckpt.load_train_state(store, uri)["dataset"] == dataset
        assert sidecar["identity"] == build_identity(cfg.model_dump(mode="json"))


def copy_tree(store: Store, src_uri: str, dest_uri: str) -> None:
    fs, src = store.resolve(src_uri)
    _, dest = store.resolve(dest_uri)
    pafs.copy_files(src, dest, source_filesystem=fs, destination_filesystem=fs)


def plant_metadata(store: Store, ckpt_uri: str, payload: bytes, update_sidecar: bool) -> None:
    store.write_bytes(join(ckpt_uri, ".metadata"), payload)
    if update_sidecar:  # whoever can write the bucket can write the sidecar too
        sidecar = ckpt.load_sidecar(store, ckpt_uri)
        sidecar["files"][".metadata"] = len(payload)
        store.write_json(join(ckpt_uri, ckpt.SIDECAR), sidecar)


def test_looking_at_a_run_never_unpickles_what_the_bucket_holds(trained, tmp_path, capsys):
    """A copy of the run with pickles planted as `.metadata`: in a checkpoint whose sidecar the
    attacker also rewrote (complete, listed), in one without a sidecar (an old or planted one),
    and in one with a short shard. status, report, the resume check, checkpoint listing and export's
    completeness check never run them; incomplete ones are skipped, and named when asked for."""
    cfg, _ = trained
    store = Store()
    marker = tmp_path / "pickle-ran"
    payload = pickle.dumps(PlantedPickle(marker))
    run = join(ROOT, "planted")
    copy_tree(store, cfg.run_uri, run)
    latest = join(cfg.run_uri, ckpt.checkpoint_dir_name(12))

    rewritten, no_sidecar, short = (join(run, ckpt.checkpoint_dir_name(s)) for s in (90, 91, 92))
    for uri in (rewritten, no_sidecar, short):
        copy_tree(store, latest, uri)
    plant_metadata(store, rewritten, payload, update_sidecar=True)
    plant_metadata(store, no_sidecar, payload, update_sidecar=False)
    store.delete_prefix(join(no_sidecar, ckpt.SIDECAR))
    plant_metadata(store, short, payload, update_sidecar=True)
    shard = join(short, "__1_0.distcp")
    store.write_bytes(shard, store.read_bytes(shard)[:-16])

    assert ckpt.list_checkpoints(store, run) == [join(run, ckpt.checkpoint_dir_name(s)) for s in (6, 12, 90)]
    assert ckpt.find_latest_checkpoint(store, run) == rewritten
    assert "no checkpoint.json" in ckpt.check_complete(store, no_sidecar)
    assert "__1_0.distcp is" in ckpt.check_complete(store, short)
    check_resume(make_cfg("planted"), store)  # the driver's look before Ray starts

    assert main(["status", run, "--json"]) == 0
    assert f'"latest_checkpoint": "{rewritten}"' in capsys.readouterr().out
    assert main(["report", run, "--out", str(tmp_path / "report")]) == 0
    planted_cfg = make_cfg("planted")
    for uri, reason in ((no_sidecar, "no checkpoint.json"), (short, "__1_0.distcp is")):
        with pytest.raises(ExportError) as info:
            export_run(planted_cfg, checkpoint_uri=uri, store=store)
        assert str(info.value).startswith(f"{uri}: not a complete checkpoint") and reason in str(info.value)
        assert "\n" not in str(info.value)
    assert not marker.exists()
    pickle.loads(payload)  # the plant is live: unpickling it anywhere above would have shown
    assert marker.exists()


def test_resume_with_another_identity_is_refused_naming_the_keys(trained):
    cfg, _ = trained
    store = Store()
    before = len(records.load_events(store, cfg.run_uri))
    stored_config = store.read_text(join(cfg.run_uri, "config.yaml"))
    with pytest.raises(ResumeError) as info:
        run_training(make_cfg("straight", lora={"r": 4}, training={"max_steps": 13}))
    message = str(info.value)
    assert message.startswith(f"run {cfg.run_uri} cannot resume with this config: lora.r 8 → 4 (per ")
    assert "checkpoint-00000012" in message and "\n" not in message
    # Refused before the driver wrote anything: no event, the stored config untouched.
    assert len(records.load_events(store, cfg.run_uri)) == before
    assert store.read_text(join(cfg.run_uri, "config.yaml")) == stored_config

    refusals = {
        f"model.uri {BASE} → s3://eft/models/other": make_cfg("straight", model={"uri": "s3://eft/models/other"}),
        "lora r=8 → off": make_cfg("straight", lora=None),
        f"lora.alpha 16.0 → 8.0, lora.target_modules {sorted(ALL_LINEAR)} → ['o_proj', 'q_proj', 'v_proj']":
            make_cfg("straight", lora={"alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}),
        "training.seed 0 → 7": make_cfg("straight", training={"seed": 7}),
    }
    for change, other in refusals.items():
        with pytest.raises(ResumeError, match="cannot resume") as info:
            check_resume(other, store)
        assert change in str(info.value)
    # Checkpoints without a sidecar (an older eft; Ray Train may still resume one it registered):
    # the run's stored config.yaml decides.
    legacy = make_cfg("legacy")
    legacy_ckpt = join(legacy.run_uri, ckpt.checkpoint_dir_name(12))
    copy_tree(store, join(cfg.run_uri, "config.yaml"), join(legacy.run_uri, "config.yaml"))
    copy_tree(store, join(cfg.run_uri, ckpt.checkpoint_dir_name(12)), legacy_ckpt)
    store.delete_prefix(join(legacy_ckpt, ckpt.SIDECAR))
    with pytest.raises(ResumeError, match=f"lora.r 8 → 4 \\(per {legacy.run_uri}/config.yaml\\)"):
        check_resume(make_cfg("legacy", lora={"r": 4}), store)
    check_resume(legacy, store)
    # Knobs that leave the checkpoint meaningful may change on a resume.
    check_resume(make_cfg("straight", lora={"target_modules": ALL_LINEAR[::-1], "dropout": 0.0},
                          training={"max_steps": 50, "lr": 1e-3, "global_batch_size": 16, "parallelism": "ddp"},
                          checkpoint={"save_every_steps": 5}, scaling={"min_workers": 1, "max_workers": 1}), store)


def test_resume_on_another_dataset_is_refused_unless_overridden(trained, caplog):
    cfg, manifest = trained
    store = Store()
    old = dataset_fingerprint(manifest)
    other = dataset_fingerprint(prepare_dataset(make_cfg("prep", data={"uri": OTHER_DATA}), store))

    with pytest.raises(ResumeError) as info:
        run_training(make_cfg("straight", data={"uri": OTHER_DATA}, training={"max_steps": 13}))
    assert str(info.value) == (
        f"run {cfg.run_uri} was trained on dataset {old[:12]} at {DATA} (per {cfg.run_uri}/checkpoint-00000012), "
        f"but data.uri {OTHER_DATA} now holds dataset {other[:12]}; set checkpoint.resume_on_new_data: true to "
        f"continue on the new data, or use a new run name")

    # The override: a warning, training goes on from step 12, and the new data is recorded.
    moved = make_cfg("straight", data={"uri": OTHER_DATA}, training={"max_steps": 13},
                     checkpoint={"resume_on_new_data": True})
    with caplog.at_level(logging.WARNING, logger="eft.resume"):
        summary = run_training(moved)
    assert summary["status"] == "succeeded" and summary["steps"] == 13
    assert any("continuing on the new data" in r.getMessage() and OTHER_DATA in r.getMessage()
               for r in caplog.records)
    assert [m["step"] for m in load_metrics(store, cfg.run_uri)] == list(range(1, 14))
    latest = ckpt.find_latest_checkpoint(store, cfg.run_uri)
    assert ckpt.step_of(latest) == 13
    recorded = {"uri": OTHER_DATA, "fingerprint": dataset_fingerprint(load_manifest(store, OTHER_DATA))}
    assert ckpt.load_sidecar(store, latest)["dataset"] == recorded
    assert ckpt.load_train_state(store, latest)["dataset"] == recorded
    check_resume(moved.model_copy(update={"checkpoint": cfg.checkpoint}), store)  # the new data is now the run's

    # The same URI prepared anew is another dataset too. (Prepared anew at OTHER_DATA, the run's
    # data now: DATA is the session's shared dataset, which other modules read.)
    reprepared = dataset_fingerprint(prepare_dataset(make_cfg("prep", data={"uri": OTHER_DATA},
                                                              prepare={"overwrite": True}), store))
    assert reprepared != recorded["fingerprint"]
    back = make_cfg("straight", data={"uri": OTHER_DATA}, training={"max_steps": 13})
    with pytest.raises(ResumeError, match=f"data.uri {OTHER_DATA} now holds dataset {reprepared[:12]}") as info:
        check_resume(back, store)
    assert (f"dataset {recorded['fingerprint'][:12]} at {OTHER_DATA}" in str(info.value)
            and "checkpoint.resume_on_new_data" in str(info.value))


def test_demo_refuses_a_bucket_on_a_remote_endpoint(s3, monkeypatch, capsys, tmp_path):
    for endpoint in ("http://127.0.0.1:9000", "http://localhost:1", "http://[::1]:9", "127.0.0.5:9000"):
        assert is_loopback_endpoint(endpoint), endpoint
    for endpoint in ("https://s3.amazonaws.com", "http://10.0.0.1:9000", "http://127.0.0.1.nip.io", None):
        assert not is_loopback_endpoint(endpoint), endpoint

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    assert main(["demo", "--state-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "eft: error: demo: refusing to write to s3://eft at https://s3.example.com, which is not a loopback "
        "endpoint (the demo writes only to its local stack; pass --allow-remote-bucket if s3://eft there is yours)"]

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a cluster given, so the demo starts no stack
    assert main(["demo", "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "s3://eft at the default AWS endpoint" in err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written

    cfg = make_cfg("demo-bucket")
    with pytest.raises(DemoBucketError, match="s3://eft at the default AWS endpoint"):
        check_demo_bucket(cfg, Store())
    check_demo_bucket(cfg, Store(), allow_remote=True)
    check_demo_bucket(cfg, Store("http://127.0.0.1:9000"))
