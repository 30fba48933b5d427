"""Training end to end on real Ray Train (2 CPU workers, gloo), a real S3 endpoint and a tiny
Llama: loss falls, checkpoints hold adapters only, resume is exact, world size may change."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_dataset

from app.config import build_config
from app.data.stream import DataOrder
from app.storage import Store, join
from app.train.checkpoint import list_checkpoints, load_events
from app.train.launch import run_training
from app.train.metrics import load_metrics

BASE = "s3://eft/models/tiny-train"
DATA = "s3://eft/data/train-tests"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_cfg(name: str, **sections):
    tree = {
        "name": name,
        "model": {"uri": BASE},
        "lora": {"r": 8, "alpha": 16, "target_modules": ALL_LINEAR},
        "data": {"uri": DATA, "seq_len": 64, "validation_fraction": 0.05},
        "prepare": {"input_uri": "s3://eft/raw/train-tests.jsonl"},
        # A constant LR: a run extended from 6 to 12 steps must follow the 12-step run exactly.
        "training": {"max_steps": 12, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-2,
                     "schedule": "constant", "eval_every_steps": 6, "trace_rows": True},
        "checkpoint": {"save_every_steps": 6, "num_to_keep": 2},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": "s3://eft/runs-tests"},
    }
    for key, value in sections.items():
        if value is None:
            tree[key] = None
        else:
            tree[key] = {**(tree.get(key) or {}), **value}
    return build_config(tree)


@pytest.fixture(scope="module")
def dataset(s3, ray_cluster, tmp_path_factory):
    return build_tiny_dataset(make_cfg("prep"), tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="module")
def straight_run(dataset):
    """The reference: 12 steps on 2 workers, uninterrupted."""
    cfg = make_cfg("straight")
    summary = run_training(cfg)
    return cfg, summary, load_metrics(Store(), cfg.run_uri)


def step_rows(metrics: list[dict]) -> dict[int, list[int]]:
    return {m["step"]: m["row_ids"] for m in metrics}


def test_lora_fsdp_run_learns_and_records_itself(straight_run, dataset):
    cfg, summary, metrics = straight_run
    store = Store()
    assert summary["status"] == "succeeded" and summary["steps"] == 12
    assert summary["final_train_loss"] < summary["first_train_loss"] - 0.3
    assert summary["final_val_loss"] is not None and summary["final_val_loss"] < summary["first_val_loss"]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    # The rows of each step are exactly the deterministic order's: G consecutive positions.
    order = DataOrder.from_manifest(dataset, seed=0)
    for m in metrics:
        expected = order.row_ids_at((m["step"] - 1) * 8, m["step"] * 8).tolist()
        assert m["row_ids"] == expected
    # num_to_keep=2 keeps the last two; the run summary names them.
    ckpts = list_checkpoints(store, cfg.run_uri)
    assert [c.rsplit("-", 1)[1] for c in ckpts] == ["00000006", "00000012"]
    assert summary["latest_checkpoint"] == ckpts[-1]


def test_lora_checkpoint_holds_adapters_not_the_base(straight_run):
    cfg, summary, _ = straight_run
    store = Store()
    meta = pickle.loads(store.read_bytes(join(summary["latest_checkpoint"], ".metadata")))
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    state = store.read_json(join(summary["latest_checkpoint"], "train_state.json"))
    assert state["step"] == 12 and state["rows_consumed"] == 96


def test_run_stores_resolved_config_and_no_credentials(straight_run):
    cfg, _, _ = straight_run
    store = Store()
    assert "trace_rows: true" in store.read_text(join(cfg.run_uri, "config.yaml"))
    for rel in store.list_files(cfg.run_uri):
        if rel.endswith((".json", ".yaml", ".jsonl")):
            text = store.read_text(join(cfg.run_uri, rel))
            assert "AWS_SECRET_ACCESS_KEY" not in text and "aws_secret" not in text.lower(), rel


def test_resume_continues_exactly_where_it_stopped(straight_run):
    """6 steps, relaunch with the same name, 6 more == 12 straight: same rows, same losses."""
    _, _, reference = straight_run
    first = run_training(make_cfg("resumed", training={"max_steps": 6}))
    assert first["steps"] == 6
    summary = run_training(make_cfg("resumed"))
    metrics = load_metrics(Store(), make_cfg("resumed").run_uri)
    assert summary["steps"] == 12 and [m["step"] for m in metrics] == list(range(1, 13))
    assert step_rows(metrics) == step_rows(reference)
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9, abs=1e-9), got["step"]
    assert summary["resumed_from_steps"] == [6] and summary["driver_restarts"] == 1


def test_resume_on_a_different_worker_count(straight_run):
    """Checkpoint at 2 workers, resume at 1: DCP reshards, the global batch and the rows per step
    stay the same, and the run ends at the configured step."""
    _, _, reference = straight_run
    run_training(make_cfg("reshard", training={"max_steps": 6}))
    one = {"min_workers": 1, "max_workers": 1}
    summary = run_training(make_cfg("reshard", scaling=one))
    metrics = load_metrics(Store(), make_cfg("reshard").run_uri)
    assert summary["steps"] == 12 and summary["world_sizes"] == [2, 1]
    assert step_rows(metrics) == step_rows(reference)
    for got, want in zip(metrics, reference):  # only the reduction order differs
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]
    assert metrics[-1]["world_size"] == 1


def test_ddp_follows_the_same_trajectory_as_fsdp(straight_run):
    _, _, reference = straight_run
    summary = run_training(make_cfg("ddp", training={"parallelism": "ddp", "max_steps": 3}))
    metrics = load_metrics(Store(), make_cfg("ddp").run_uri)
    assert summary["status"] == "succeeded"
    for got, want in zip(metrics, reference[:3]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


def test_full_finetune_checkpoints_every_weight(dataset):
    cfg = make_cfg("full", lora=None, training={"max_steps": 6, "lr": 5e-3, "eval_every_steps": 3},
                   checkpoint={"save_every_steps": 6})
    summary = run_training(cfg)
    assert summary["final_val_loss"] < summary["first_val_loss"]
    meta = pickle.loads(Store().read_bytes(join(summary["latest_checkpoint"], ".metadata")))
    keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert "model.lm_head.weight" in keys and not any("lora_" in k for k in keys)


def test_train_rejects_bad_inputs_before_ray_work(dataset):
    from app.data.prepare import DatasetError
    from app.train.model import ModelError

    with pytest.raises(DatasetError, match="s3://eft/data/nothing-here"):
        run_training(make_cfg("bad-data", data={"uri": "s3://eft/data/nothing-here"}))
    with pytest.raises(ModelError, match="s3://eft/raw"):
        run_training(make_cfg("bad-model", model={"uri": "s3://eft/raw"}))
    with pytest.raises(ValueError, match="data.seq_len 32"):
        run_training(make_cfg("bad-seq", data={"seq_len": 32}))
    from app.storage import StorageError

    with pytest.raises(StorageError, match="bucket s3://no-such-bucket"):
        run_training(make_cfg("bad-bucket", storage={"root_uri": "s3://no-such-bucket/runs"}))


def test_cli_errors_are_one_line_and_non_zero(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {uri: /m}\ndata: {uri: /d}\nstorage: {root_uri: /r}\n"
                   "training: {max_steps: 1, lr_typo: 3}\n")
    out = subprocess.run([sys.executable, "-m", "app.cli", "train", str(bad)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"eft: error: {bad}: training.lr_typo: unknown key"]
    assert "Traceback" not in out.stderr


def test_events_record_each_worker_group(straight_run):
    cfg, _, _ = straight_run
    events = load_events(Store(), cfg.run_uri)
    kinds = [e["kind"] for e in events]
    assert kinds == ["driver_start", "worker_group_start"]
    assert json.dumps(events)  # serializable, machine-readable


def _compare_sharded_load(config: dict) -> None:
    """Worker fn: build the model the scalable way, gather it, compare with from_pretrained."""
    import ray.train
    import ray.train.torch
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from app.config import JobConfig
    from app.storage import Store
    from app.train.model import build_model, load_pretrained

    cfg = JobConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    local_dir = Store().cache_locally(cfg.model.uri)
    model = build_model(cfg, local_dir, ray.train.torch.get_device(), ctx.get_world_rank(), ctx.get_world_size())
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    metrics = {"keys": len(gathered)}
    if ctx.get_world_rank() == 0:
        reference = load_pretrained(local_dir, torch.float32, cfg.lora, cfg.training.seed).state_dict()
        assert set(gathered) == set(reference), set(gathered) ^ set(reference)
        metrics["max_abs_diff"] = max(float((gathered[k] - reference[k]).abs().max()) for k in reference)
        # Rotary frequencies are non-persistent buffers: they must survive the meta-device build.
        rotary = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
        ref_rotary = [b for n, b in load_pretrained(local_dir, torch.float32).named_buffers() if n.endswith("inv_freq")]
        metrics["rotary_diff"] = max(float((a - b).abs().max()) for a, b in zip(rotary, ref_rotary))
        Store().write_json(join(cfg.run_uri, "load-check.json"), metrics)
    ray.train.report(metrics)


@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_sharded_load_equals_from_pretrained(dataset, parallelism):
    """Meta-device build + rank-0 broadcast into shards == a plain from_pretrained (+ same LoRA init)."""
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = make_cfg(f"load-{parallelism}", training={"parallelism": parallelism})
    fs, root = Store().resolve(cfg.storage.root_uri)
    TorchTrainer(
        _compare_sharded_load, train_loop_config={"cfg": cfg.model_dump(mode="json")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=cfg.name, storage_path=root, storage_filesystem=fs),
    ).fit()
    check = Store().read_json(join(cfg.run_uri, "load-check.json"))
    assert check["keys"] > 20
    assert check["max_abs_diff"] == 0.0
    assert check["rotary_diff"] == 0.0


def test_driver_loss_resumes_with_the_data_position(straight_run, tmp_path):
    """`eft train` killed outright mid-run, then the same command again: it resumes from the
    latest checkpoint with the data position intact, and the summary shows one driver restart."""
    import os
    import time

    import ray

    from app.config import dump_config

    _, _, reference = straight_run
    cfg = make_cfg("driver-loss", checkpoint={"save_every_steps": 3})
    job = tmp_path / "job.yaml"
    job.write_text(dump_config(cfg))
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
    driver = subprocess.Popen([sys.executable, "-m", "app.cli", "train", str(job)], env=env,
                              cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    store, deadline = Store(), time.monotonic() + 300
    while not list_checkpoints(store, cfg.run_uri) and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.5)
    driver.kill()
    driver.wait()
    killed_at = len(load_metrics(store, cfg.run_uri))
    assert list_checkpoints(store, cfg.run_uri) and killed_at < 12
    summary = run_training(cfg)
    metrics = load_metrics(store, cfg.run_uri)
    assert summary["steps"] == 12 and summary["driver_restarts"] == 1
    assert summary["interruptions"][0]["cause"] == "driver_restart"
    assert step_rows(metrics) == step_rows(reference)
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9, abs=1e-9), got["step"]
