"""Training end to end on real Ray Train (2 CPU workers, gloo), a real S3 endpoint and a tiny
Llama: loss falls, checkpoints hold adapters only, resume is exact, world size may change."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_runs import BASE, DATA, make_cfg

from app.data.stream import DataOrder
from app.elastic.checkpoint import list_checkpoints
from app.observe.metrics import load_metrics
from app.observe.records import load_events, load_heartbeats
from app.storage import Store, join
from app.train.launch import run_training



@pytest.fixture(scope="module")
def dataset(train_dataset):
    return train_dataset


@pytest.fixture(scope="module")
def mlflow_uri(train_mlflow_uri):
    return train_mlflow_uri


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


def step_one_reference(manifest: dict, data_uri: str, row_ids: list[int], positions: bool) -> float:
    """Single process, no Ray: step 1's loss on its rows, per label token, from the base model (the
    LoRA B matrices start at zero, so the adapted model equals it at step 1), micro-batches of 2."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from app.data.manifest import shard_uris
    from app.model.build import load_pretrained
    from app.model.loss import loss_sum
    from app.train.objective import label_tokens

    store = Store()
    table = pa.concat_tables([pq.read_table(store.resolve(u)[1], filesystem=store.resolve(u)[0])
                              for u in shard_uris(data_uri, manifest, "train")])
    where = {rid: i for i, rid in enumerate(table["row_id"].to_pylist())}
    take = pa.array([where[r] for r in row_ids])
    ids, labels, pos = (np.asarray(table[c].take(take).to_pylist()) for c in ("input_ids", "labels", "position_ids"))
    model = load_pretrained(store.cache_locally(BASE), torch.float32)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(row_ids), 2):
            p = torch.as_tensor(pos[i:i + 2]) if positions else None
            total += float(loss_sum(model, torch.as_tensor(ids[i:i + 2]), torch.as_tensor(labels[i:i + 2]), None, p))
    return total / label_tokens(labels)


def test_fsdp_run_keeps_packed_documents_apart(straight_run, dataset):
    """The default run (2 FSDP2 workers) passes position_ids: its step-1 loss is the single-process
    loss of the same rows with attention kept inside documents, not the one across them."""
    cfg, _, metrics = straight_run
    assert cfg.data.cross_document_attention is False and dataset["position_ids"] is True
    rows = metrics[0]["row_ids"]
    isolated = step_one_reference(dataset, DATA, rows, positions=True)
    crossing = step_one_reference(dataset, DATA, rows, positions=False)
    assert abs(isolated - crossing) > 1e-3
    assert metrics[0]["loss"] == pytest.approx(isolated, rel=1e-5)
    group = [e for e in load_events(Store(), cfg.run_uri) if e["kind"] == "worker_group_start"][0]
    assert group["document_isolation"] is True


def test_a_dataset_prepared_without_position_ids_trains_across_documents(straight_run, dataset, caplog):
    """An old dataset (no position_ids column, no manifest key): training runs, as before, with
    cross-document attention and a note; step 1 equals the single-process loss without isolation.
    The run also checks its FSDP2 load against from_pretrained (tests/test_train.py's DDP run does
    the same for DDP)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.manifest import manifest_uri, shard_uris

    store, old_uri = Store(), "s3://eft/data/train-tests-old"
    old = {k: v for k, v in dataset.items() if k != "position_ids"}
    for uri in shard_uris(DATA, dataset, "train") + shard_uris(DATA, dataset, "validation"):
        fs, path = store.resolve(uri)
        buf = pa.BufferOutputStream()
        pq.write_table(pq.read_table(path, filesystem=fs).drop_columns(["position_ids"]), buf)
        store.write_bytes(uri.replace(DATA, old_uri, 1), buf.getvalue().to_pybytes())
    store.write_json(manifest_uri(old_uri), old)
    cfg = make_cfg("old-dataset", data={"uri": old_uri}, training={"max_steps": 2, "eval_every_steps": None},
                   checkpoint={"save_every_steps": 2})
    with caplog.at_level("WARNING", logger="app.data.stream"):
        summary = run_checking_the_load(cfg.model_copy(update={"training": cfg.training.model_copy(
            update={"parallelism": "fsdp"})}))
    assert any("prepared without position_ids" in r.getMessage() for r in caplog.records)
    # The run's FSDP2 ranks read their own slices and loaded exactly what from_pretrained loads.
    assert_loaded_what_from_pretrained_loads(cfg, "fsdp")
    assert summary["status"] == "succeeded" and summary["steps"] == 2
    metrics, reference = load_metrics(store, cfg.run_uri), straight_run[2]
    assert metrics[0]["row_ids"] == reference[0]["row_ids"]
    crossing = step_one_reference(dataset, DATA, metrics[0]["row_ids"], positions=False)
    assert metrics[0]["loss"] == pytest.approx(crossing, rel=1e-5)
    assert abs(metrics[0]["loss"] - reference[0]["loss"]) > 1e-3
    group = [e for e in load_events(store, cfg.run_uri) if e["kind"] == "worker_group_start"][0]
    assert group["document_isolation"] is False


def test_metrics_break_down_each_step_and_report_no_mfu_on_cpu(straight_run):
    import math

    _, _, metrics = straight_run
    for m in metrics:
        assert m["step_time_s"] > 0 and m["compute_s"] > 0 and m["optimizer_s"] > 0 and m["data_wait_s"] >= 0
        assert m["compute_s"] + m["optimizer_s"] + m["data_wait_s"] <= m["step_time_s"] * 1.05
        assert m["tokens_per_s_per_worker"] == pytest.approx(m["tokens_per_s"] / 2)
        assert m["peak_rss_gb"] > 0.1
        assert m["mfu"] is None  # no honest peak FLOP/s for a CPU
    saves = [m for m in metrics if m["step"] in (1, 7)]  # the logs right after the step-6 save, and not
    assert saves[1]["checkpoint_blocked_s"] > 0 and saves[0]["checkpoint_blocked_s"] == 0
    evals = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evals] == [6, 12]
    assert all(m["val_ppl"] == pytest.approx(math.exp(m["val_loss"])) for m in evals)


def test_metrics_reach_tensorboard_and_mlflow(straight_run, mlflow_uri, tmp_path, monkeypatch):
    """Read back by the libraries' own readers: TensorBoard's event accumulator, MLflow's client."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, metrics = straight_run
    Store().download_dir(join(cfg.run_uri, "tensorboard"), tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "val_loss", "tokens_per_s", "grad_norm"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("eft").experiment_id],
                                filter_string=f"tags.`eft.run_uri` = '{cfg.run_uri}'")
    assert run.info.status == "FINISHED" and run.data.params["training.global_batch_size"] == "8"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(h.step for h in history) == list(range(1, 13))
    assert "aws_secret" not in str(run.data.params).lower()


def test_checkpoints_are_scored_while_training_goes_on(straight_run, mlflow_uri, train_wandb_dir, tmp_path,
                                                      monkeypatch):
    """eval.every_checkpoints 1 with two sets: Ray Train's validation task scored each checkpoint
    (steps 6 and 12) on both; each set's score is in the run's metrics at those steps as
    `eval_<set>_<metric>`, in TensorBoard, in MLflow and in W&B (offline, read back from its own
    files: rank 0's run has every step's metrics and the config, the eval task's writes of the
    same run id the scores and a table of predictions), and each label's summary lists both."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from app.eval.results import load_results, load_summaries
    from app.report import build_status, load_run

    cfg, _, _ = straight_run
    store = Store()
    results = load_results(store, cfg.run_uri)
    assert [(r["label"], r["set"], r["step"], r["n"]) for r in results] == [
        ("step-000006", "choices", 6, 6), ("step-000006", "default", 6, 12),
        ("step-000012", "choices", 12, 6), ("step-000012", "default", 12, 12)]
    assert all(r["num_actors"] == 1 and r["checkpoint"]["kind"] == "checkpoint" for r in results)
    summaries = load_summaries(store, cfg.run_uri)
    assert [(s["label"], sorted(s["sets"])) for s in summaries] == [("step-000006", ["choices", "default"]),
                                                                   ("step-000012", ["choices", "default"])]
    run = load_run(store, cfg.run_uri)
    keys = {"default": "eval_default_exact_match", "choices": "eval_choices_acc"}
    for name, key in keys.items():
        scored = {r["step"]: r[key] for r in run["metrics"] if key in r}
        assert scored == {r["step"]: r["score"] for r in results if r["set"] == name}
    status = build_status(run)
    assert status["eval"]["latest"]["label"] == "step-000012"
    assert status["eval"]["sets"]["choices"]["latest"]["metric"] == "acc"
    assert [row["name"] for row in status["eval"]["grid"]["rows"]] == ["choices", "default"]

    store.download_dir(join(cfg.run_uri, "tensorboard"), tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(mlflow_uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("eft").experiment_id],
                                  filter_string=f"tags.`eft.run_uri` = '{cfg.run_uri}'")
    for name, key in keys.items():
        expected = {r["step"]: r["score"] for r in results if r["set"] == name}
        assert {e.step: e.value for e in events.Scalars(key)} == pytest.approx(expected)
        assert {h.step: h.value for h in client.get_metric_history(mlrun.info.run_id, key)} == pytest.approx(expected)
        assert sorted(e.step for e in events.Scalars(f"{key}_low")) == [6, 12]

    from test_wandb import WandbRun

    runs = [WandbRun(d) for d in sorted((train_wandb_dir / "wandb").glob("offline-run-*"))]
    (train,) = [r for r in runs if not r.directory.name.endswith("-eval")]
    evals = [r for r in runs if r.directory.name.endswith("-eval")]
    assert len(evals) == 2 and {r.run_id for r in runs} == {train.run_id} and train.name == cfg.name
    assert train.config["training"]["max_steps"] == 12
    losses = {row["step"]: row["loss"] for row in train.rows() if "loss" in row}
    assert losses == pytest.approx({m["step"]: m["loss"] for m in run["metrics"] if m.get("loss") is not None})
    for name, key in keys.items():
        expected = {r["step"]: r["score"] for r in results if r["set"] == name}
        assert {row["step"]: row[key] for r in evals for row in r.rows() if key in row} == pytest.approx(expected)
    tables = {key.rsplit("/", 1)[0]: row[key.rsplit("/", 1)[0] + "/nrows"] for r in evals for row in r.rows()
              for key in row if key.endswith("/_type") and row[key] == "table-file"}
    assert tables == {f"eval/{name}/step-{step:06d}": 3 for name in keys for step in (6, 12)}  # three examples


def test_eft_eval_on_1_and_3_actors_one_lost_midway_gives_the_validation_tasks_predictions(
        straight_run, tmp_path, monkeypatch, caplog, capsys):
    """The Ray Data pipeline (1 actor, then 3 through the CLI) predicts bit for bit what the
    in-process validation task predicted for the same checkpoint. In the 3-actor pass one actor's
    process exits at its first batch (as with its node reclaimed): the batches it had not returned
    run again on a new pool, and cost only that."""
    import yaml

    import app.eval.engine as engine
    from app.cli import main
    from app.dev.faults import ExitOnce
    from app.eval.results import load_predictions
    from app.eval.run import run_eval

    cfg, _, _ = straight_run
    store = Store()
    during = load_predictions(store, cfg.run_uri, "step-000012")
    assert len({p["prediction"] for p in during}) > 1
    one = run_eval(cfg, store, checkpoint="12")["results"]["default"]
    assert one["num_actors"] == 1
    assert load_predictions(store, cfg.run_uri, "step-000012") == during

    marker = tmp_path / "exited"
    monkeypatch.setattr(engine, "ScoreEval", type("ExitingScoreEval", (ExitOnce, engine.ScoreEval),
                                                  {"marker": str(marker)}))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with caplog.at_level("WARNING", logger="eft.cluster"):
        assert main(["eval", str(path), "--checkpoint", "12", "--set", "eval.num_actors=3"]) == 0
    assert marker.exists()
    assert any("eval: an actor was lost (ActorDiedError)" in r.getMessage() for r in caplog.records)
    results = store.read_json(join(cfg.run_uri, "eval", "step-000012", "default", "results.json"))
    assert results["num_actors"] == 3 and results["n"] == 12
    assert load_predictions(store, cfg.run_uri, "step-000012") == during
    out = capsys.readouterr().out
    assert "95% interval" in out and "step-000012, set default: examples" in out
    assert "step-000012, set choices: acc" in out  # every set of the config, on one pool


def test_an_eval_pool_the_cluster_cannot_hold_fails_in_one_line_naming_its_key(straight_run, monkeypatch):
    """The eval pool starts whole before its first batch (app/cluster.py): 2 actors of 5 CPUs on
    the session's 8 cannot, and the wait ends in one line naming the setting to lower."""
    import app.cluster
    from app.cluster import ClusterError
    from app.eval.run import run_eval

    cfg, _, _ = straight_run
    monkeypatch.setattr(app.cluster, "ACTOR_POOL_START_TIMEOUT_S", 5)
    wide = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"num_actors": 2, "cpus_per_actor": 5.0})})
    with pytest.raises(ClusterError) as refused:
        run_eval(wide, Store(), checkpoint="12")
    assert str(refused.value) == ("eval: its 2 actors did not all start within 5 s; the cluster cannot hold them "
                                  "(each 5.0 CPU, 0 GPU): lower eval.num_actors")


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


def gather_trainable_state(model, optimizer) -> dict:
    """The full trainable state of a (sharded) model and its optimizer, on CPU."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, optimizer, options=opts)}


def _train_capturing_the_restored_state(config: dict, out: str) -> None:
    """Worker fn: the training loop, with the state it restored gathered and saved by rank 0
    before the first step (a checkpoint of another world size, resharded on load)."""
    import torch

    from app.train import loop

    w = loop.setup(config)
    loop.resume(w, config)
    gathered = {**gather_trainable_state(w.model.module, w.model.optimizer), "step": w.progress.step}
    if w.rank == 0:
        torch.save(gathered, out)
    loop.train(w)
    loop.report(w)


def restore_in_this_process(cfg, checkpoint_uri: str) -> dict:
    """One rank, no Ray: the checkpoint restored into a fresh model and optimizer, gathered."""
    import ray.train
    import torch
    import torch.distributed as dist

    from app.elastic import checkpoint as ckpt
    from app.model.build import build_model, trainable_parameters

    store = Store()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(cfg, store, torch.device("cpu"), 0, 1)
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.training.lr)
        fs, path = store.resolve(checkpoint_uri)
        state = ckpt.restore(ray.train.Checkpoint(path, filesystem=fs), store, model, optimizer, lora=True)
        return {**gather_trainable_state(model, optimizer), "step": state.step}
    finally:
        dist.destroy_process_group()


def read_checkpoint_offline(checkpoint_uri: str, work: Path) -> dict:
    """The checkpoint's full state, read by DCP in one process with no process group."""
    import pyarrow.fs as pafs
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fs, path = Store().resolve(checkpoint_uri)
    (work / "dcp").mkdir()
    pafs.copy_files(path, str(work / "dcp"), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    dcp_to_torch_save(str(work / "dcp"), str(work / "full.pt"))
    return torch.load(work / "full.pt", weights_only=False)


@pytest.fixture(scope="module")
def reshard_run(straight_run, tmp_path_factory):
    """3 workers (8 rows split 3/3/2, padded) to step 4 → 2 workers to step 8 → 1 worker to 12.
    The 3-worker checkpoint's state as the 2-worker run restored it (gathered before its first
    step), and as one rank restores it in this process, beside the checkpoint read offline."""
    import functools

    import torch
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    work = tmp_path_factory.mktemp("reshard")
    padded = {"pad_uneven_batches": True}
    three = make_cfg("reshard", training={**padded, "max_steps": 4}, scaling={"min_workers": 3, "max_workers": 3})
    run_training(three)
    checkpoint_uri = list_checkpoints(Store(), three.run_uri)[-1]
    offline = read_checkpoint_offline(checkpoint_uri, work)
    restored = {1: restore_in_this_process(three.model_copy(update={"scaling": three.scaling.model_copy(
        update={"min_workers": 1, "max_workers": 1})}), checkpoint_uri)}
    run_training(make_cfg("reshard", training={**padded, "max_steps": 8}),
                 train_fn=functools.partial(_train_capturing_the_restored_state, out=str(work / "w2.pt")))
    restored[2] = torch.load(work / "w2.pt", weights_only=False)
    summary = run_training(make_cfg("reshard", training=padded, scaling={"min_workers": 1, "max_workers": 1}))
    return summary, load_metrics(Store(), three.run_uri), restored, offline


def test_resharded_restore_loads_the_same_parameters_and_optimizer_state(reshard_run):
    """A checkpoint saved by 3 workers, restored at 2 and at 1: the gathered full state equals
    what the 3 workers wrote, tensor for tensor (DCP reshards on load)."""
    import torch

    _, _, restored, offline = reshard_run
    saved_model, saved_optim = offline["model"], offline["optim"]["state"]
    assert saved_model and all("lora_" in k for k in saved_model)
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in saved_model.items())  # trained
    for world, got in restored.items():
        assert got["step"] == 4
        assert set(got["model"]) == set(saved_model), world
        for key, value in saved_model.items():
            assert torch.equal(got["model"][key], value), (world, key)
        assert set(got["optim"]["state"]) == set(saved_optim), world
        for key, moments in saved_optim.items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got["optim"]["state"][key][name], moments[name]), (world, key, name)


def test_training_continues_across_3_2_1_workers_on_the_same_trajectory(reshard_run, straight_run):
    """The global batch and the rows per step stay the same at 3 (padded), 2 and 1 workers;
    losses match the 2-worker run up to the reduction order, LoRA dropout 0.1 included. Each
    relaunch of the finished run with more steps (the same name, `max_steps` raised) continues
    exactly where it stopped: at the same world size the losses match bit for bit (the cut-off
    upload and the driver-loss runs below), here up to the reduction order."""
    _, _, reference = straight_run
    summary, metrics, _, _ = reshard_run
    assert summary["steps"] == 12 and summary["world_sizes"] == [3, 2, 1]
    assert summary["resumed_from_steps"] == [4, 8] and summary["driver_restarts"] == 2
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert step_rows(metrics) == step_rows(reference)
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]
    assert [m["world_size"] for m in metrics] == [3] * 4 + [2] * 4 + [1] * 4


def _cut_off_the_first_upload(config: dict) -> None:
    """Worker fn: the training loop, except that rank 0 dies halfway through uploading the first
    checkpoint this run writes (small files up, its shard not), the way a reclaimed node would."""
    import os

    import pyarrow.fs as pafs

    from app.compat import patch_checkpoint_copy
    from app.config import JobConfig
    from app.train.loop import train_loop_per_worker

    cfg = JobConfig.model_validate(config["cfg"])
    store, marker = Store(), join(cfg.run_uri, "upload-cut-off")

    def cut_off(upload, source, destination, source_filesystem=None, destination_filesystem=None, **kwargs):
        names = sorted(os.listdir(source)) if os.path.isdir(source) else []
        # Only rank 0's part of a checkpoint holds DCP's .metadata.
        if ".metadata" in names and not store.exists(marker):
            store.write_text(marker, destination.rstrip("/").rsplit("/", 1)[1])
            for name in names:
                if not name.endswith(".distcp"):
                    pafs.copy_files(os.path.join(source, name), f"{destination}/{name}",
                                    destination_filesystem=destination_filesystem)
            os._exit(1)
        return upload(source, destination, source_filesystem, destination_filesystem, **kwargs)

    patch_checkpoint_copy(lambda upload: lambda *args, **kwargs: cut_off(upload, *args, **kwargs))
    train_loop_per_worker(config)


def test_a_torn_checkpoint_directory_is_not_listed(straight_run):
    """Outside Ray (resume detection, export, status): a checkpoint missing a shard named by its
    metadata is incomplete, and the latest complete one is used instead."""
    import pyarrow.fs as pafs

    cfg, _, _ = straight_run
    store = Store()
    fs, path = store.resolve(cfg.run_uri)
    complete = list_checkpoints(store, cfg.run_uri)
    torn = f"{path}/checkpoint-00000099"
    pafs.copy_files(f"{path}/checkpoint-00000012", torn, source_filesystem=fs, destination_filesystem=fs)
    assert list_checkpoints(store, cfg.run_uri)[-1].endswith("checkpoint-00000099")
    fs.delete_file(f"{torn}/__1_0.distcp")
    try:
        assert list_checkpoints(store, cfg.run_uri) == complete
    finally:
        fs.delete_dir(torn)


def test_ddp_loads_what_from_pretrained_loads_and_follows_the_fsdp_trajectory(straight_run, tmp_path, monkeypatch):
    """The base given as a hub id (`hf://`, a stand-in hub on loopback, tests/hub_server.py): the
    driver resolves it to a sha and mirrors it once; the workers read only the mirror. DDP loads
    what from_pretrained loads and steps like the FSDP2 run."""
    from hub_server import HubRepo, HubServer

    from app.hub import MARKER

    _, _, reference = straight_run
    Store().download_dir(BASE, tmp_path / "base")
    with HubServer() as hub:
        repo = HubRepo()
        sha = repo.commit_dir(tmp_path / "base")
        hub.repos["eft-tests/tiny-train"] = repo
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        cfg = make_cfg("ddp", model={"uri": "hf://eft-tests/tiny-train", "mirror_uri": "s3://eft/models-mirror-tests"},
                       training={"parallelism": "ddp", "max_steps": 3})
        summary = run_checking_the_load(cfg)
        requests = dict(hub.requests)
    mirror = f"s3://eft/models-mirror-tests/eft-tests/tiny-train/{sha}"
    mirrored = Store().read_json(join(mirror, MARKER))["files"]
    # One API call and one download per file, all by the driver: no worker asked the hub.
    assert requests == {"api": 1, "download": len(mirrored)} and "model.safetensors" in mirrored
    import yaml

    assert yaml.safe_load(Store().read_text(join(cfg.run_uri, "config.yaml")))["model"]["uri"] == mirror
    (resolved,) = [e for e in load_events(Store(), cfg.run_uri) if e["kind"] == "model_resolved"]
    assert (resolved["repo"], resolved["revision"], resolved["sha"]) == ("eft-tests/tiny-train", "main", sha)
    assert_loaded_what_from_pretrained_loads(cfg, "ddp")
    metrics = load_metrics(Store(), cfg.run_uri)
    assert summary["status"] == "succeeded" and summary["steps"] == 3
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert step_rows(metrics) == step_rows(reference[:3])
    for got, want in zip(metrics, reference[:3], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]


def test_full_finetune_checkpoints_every_weight(dataset):
    cfg = make_cfg("full", lora=None, training={"max_steps": 6, "lr": 5e-3, "eval_every_steps": 3},
                   checkpoint={"save_every_steps": 6})
    summary = run_training(cfg)
    assert summary["final_val_loss"] < summary["first_val_loss"]
    meta = pickle.loads(Store().read_bytes(join(summary["latest_checkpoint"], ".metadata")))
    keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert "model.lm_head.weight" in keys and not any("lora_" in k for k in keys)


def test_train_rejects_bad_inputs_before_ray_work(dataset):
    from app.data.manifest import DatasetError
    from app.model.architecture import ModelError

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
    store = Store()
    assert [e["kind"] for e in events] == ["driver_start", "weights_loaded", "worker_group_start"]
    driver, loaded, group = events
    # Each FSDP2 rank read only its slices of the base's weights, from storage.
    assert loaded["mode"] == "ranged" and [r["rank"] for r in loaded["ranks"]] == [0, 1]
    # One object per event, named by its id; the id leads with the event's UTC time.
    assert store.list_files(join(cfg.run_uri, "events")) == sorted(f"{e['id']}.json" for e in events)
    for event in events:
        assert event["id"].startswith(time.strftime("%Y%m%dT%H%M%S", time.gmtime(event["time"])))
    assert driver["resumed"] is False
    assert driver["time"] <= group["time"]
    assert {k: group[k] for k in ("world_size", "resumed_from_step", "padding_rows")} == \
        {"world_size": 2, "resumed_from_step": None, "padding_rows": 0}
    # The group's heartbeat carries its event id: that is how interruptions are accounted.
    (beat,) = load_heartbeats(store, cfg.run_uri)
    assert beat["attempt"] == group["id"] and beat["world_size"] == 2
    assert (beat["first_step"], beat["last_step"]) == (1, 12)
    assert group["time"] <= beat["started_at"] <= beat["first_step_at"] <= beat["last_step_at"]
    # The marks a restart's breakdown is built from, in the order the start passes them.
    marks = [group["entered_at"], group["model_load_at"], group["model_built_at"], group["restored_at"],
             beat["first_batch_at"], beat["first_step_at"]]
    assert driver["time"] <= marks[0] and marks == sorted(marks) and marks[3] <= group["time"]


def _train_checking_what_was_loaded(config: dict, check_uri: str) -> None:
    """Worker fn: the training loop, with the model it built and loaded (meta device, each rank's
    own reads) gathered before the first step and compared by rank 0 with a plain
    from_pretrained (+ the same deterministic LoRA init); the findings go to `check_uri`."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from app.model.build import load_pretrained
    from app.train import loop

    w = loop.setup(config)
    gathered = get_model_state_dict(w.model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if w.rank == 0:
        local_dir = Store().cache_locally(w.cfg.model.uri)
        reference = load_pretrained(local_dir, torch.float32, w.cfg.lora, w.cfg.training.seed).state_dict()
        assert set(gathered) == set(reference), set(gathered) ^ set(reference)
        found = {"keys": len(gathered),
                 "max_abs_diff": max(float((gathered[k] - reference[k]).abs().max()) for k in reference),
                 # The adapters' init is drawn, not loaded: A random (the same as the reference's), B zero.
                 "lora_a_std": min(float(v.std()) for k, v in gathered.items() if ".lora_A." in k)}
        # Rotary frequencies are non-persistent buffers: they must survive the meta-device build.
        rotary = [b for n, b in w.model.module.named_buffers() if n.endswith("inv_freq")]
        ref_rotary = [b for n, b in load_pretrained(local_dir, torch.float32).named_buffers() if n.endswith("inv_freq")]
        found["rotary_diff"] = max(float((a - b).abs().max()) for a, b in zip(rotary, ref_rotary))
        Store().write_json(check_uri, found)
    loop.resume(w, config)
    loop.train(w)
    loop.report(w)


def run_checking_the_load(cfg) -> dict:
    """`run_training` with `_train_checking_what_was_loaded`; returns its summary."""
    import functools

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    return run_training(cfg, train_fn=functools.partial(_train_checking_what_was_loaded,
                                                        check_uri=join(cfg.run_uri, "load-check.json")))


def assert_loaded_what_from_pretrained_loads(cfg, parallelism: str) -> None:
    """Meta-device build + each rank's own reads (FSDP2: its slices from S3; DDP: the node's one
    download) == a plain from_pretrained (+ the same deterministic LoRA init)."""
    check = Store().read_json(join(cfg.run_uri, "load-check.json"))
    assert check["keys"] > 20
    assert check["max_abs_diff"] == 0.0
    assert check["rotary_diff"] == 0.0
    assert check["lora_a_std"] > 0.01
    (loaded,) = [e for e in load_events(Store(), cfg.run_uri) if e["kind"] == "weights_loaded"]
    model_dir_bytes = sum(Store().list_file_sizes(loaded["model_uri"]).values())  # BASE, or its hub mirror
    if parallelism == "fsdp":
        # Disjoint slices: the two ranks together read each weight byte once (+ headers, small files),
        # from storage or from the node's slice cache (an earlier load of BASE at this world size).
        assert loaded["mode"] == "ranged"
        small_files = model_dir_bytes - loaded["weights_bytes"]
        got = sum(loaded["bytes_per_node"].values()) + sum(loaded["cached_per_node"].values())
        assert 0.5 * loaded["weights_bytes"] < got <= 1.1 * loaded["weights_bytes"] + 2 * small_files
    else:
        # Every DDP rank needs all of it: at most one download for the node, never one per rank.
        assert loaded["mode"] == "node_cache"
        assert sum(loaded["bytes_per_node"].values()) <= model_dir_bytes


def test_a_paused_driver_then_a_killed_one_hand_the_run_on_and_it_ends_on_one_trajectory(straight_run, tmp_path):
    """Three drivers of one run (`eft train` each).
    A is paused (SIGSTOP) past its run lease's lifetime while its workers train on; B, started with
    `--wait`, takes the lease over (epoch 2) and resumes. From the takeover on nothing of epoch 1 is
    committed: A's workers stop at their next commit, its controller ends that run without a retry,
    and A, resumed (SIGCONT), exits non-zero with one line and writes no summary.
    B is then killed outright mid-run. The same command again (C) is refused at once while B's lease
    lives, takes it over once it expires (epoch 3), resumes from the latest checkpoint with the data
    position intact, and finishes: the summary shows the driver restarts, and the run is one
    trajectory, the uninterrupted run's rows and losses bit for bit (the same world size).
    On the way C's rank 0 dies halfway through uploading its first checkpoint (small files up, its
    shard not): C's next worker group resumes from the checkpoint C started from, never from the
    torn one, and recomputes the steps since (this was a run of its own, 12 steps on 2 workers)."""
    import datetime as dt
    import os
    import signal

    import boto3
    import ray

    from app.config import dump_config
    from app.lease import LeaseError, read_lease

    _, _, reference = straight_run
    steps = 150  # A's workers must still be training when A loses the run, and B when it is killed
    cfg = make_cfg("drivers", training={"max_steps": steps, "eval_every_steps": None},
                   checkpoint={"save_every_steps": 3}, fault_tolerance={"run_lease_ttl_s": 6})
    job = tmp_path / "job.yaml"
    job.write_text(dump_config(cfg))
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
    lease_at = join(cfg.run_uri, "_lease.json")

    def start_driver(name: str, *args: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.err", "w") as err:
            return subprocess.Popen([sys.executable, "-m", "app.cli", "train", str(job), *args], env=env,
                                    cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)

    def wait_for(what, timeout_s: float = 300, *alive: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline and all(p.poll() is None for p in alive), what.__doc__
            time.sleep(0.2)

    store = Store()
    driver_a = start_driver("a")
    wait_for(lambda: list_checkpoints(store, cfg.run_uri), 300, driver_a)
    os.kill(driver_a.pid, signal.SIGSTOP)
    try:
        driver_b = start_driver("b", "--wait", "--wait-timeout-s", "60")

        took_over = {}

        def b_holds_the_lease():
            """B takes the lease over"""
            lease = read_lease(store, lease_at) if store.exists(lease_at) else None
            took_over.update(lease if lease and lease["epoch"] == 2 else {})
            return bool(took_over)

        wait_for(b_holds_the_lease, 120, driver_b)
    finally:
        os.kill(driver_a.pid, signal.SIGCONT)
    driver_a.wait(timeout=300)
    # Its workers' log lines (Ray forwards them to the driver) may come after its own line.
    (line,) = [x for x in (tmp_path / "a.err").read_text().splitlines() if x.startswith("eft: error:")]
    assert driver_a.returncode == 1
    assert line.startswith(f"eft: error: run {cfg.run_uri}: lease ") and " lost to eft train (pid " in line, line
    assert line.endswith("epoch 2 (this holder's epoch was 1); this driver wrote no summary"), line

    def b_committed_a_checkpoint():
        """B commits a checkpoint of its own"""
        latest = list_checkpoints(store, cfg.run_uri)
        return latest and store.read_json(join(latest[-1], "checkpoint.json")).get("lease_epoch") == 2

    wait_for(b_committed_a_checkpoint, 300, driver_b)
    driver_b.kill()
    driver_b.wait()
    killed_at = len(load_metrics(store, cfg.run_uri))
    assert killed_at < steps
    with pytest.raises(LeaseError, match=rf"^run {cfg.run_uri}: held by eft train \(pid {driver_b.pid} on "):
        run_training(cfg)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    summary = run_training(cfg, wait_s=60, train_fn=_cut_off_the_first_upload)

    assert summary["status"] == "succeeded" and summary["steps"] == steps and summary["lease_epoch"] == 3
    assert summary["driver_restarts"] == 2, [(e["lease_epoch"], e["resumed"]) for e in load_events(store, cfg.run_uri)
                                             if e["kind"] == "driver_start"]
    *takeovers, cut_off = summary["interruptions"]
    assert takeovers and {i["cause"] for i in takeovers} == {"driver_restart"}, summary["interruptions"]
    # The upload was cut off (the fault did happen), and C's next group resumed from the checkpoint
    # C started from, not from the torn one after it.
    torn = store.read_text(join(cfg.run_uri, "upload-cut-off"))
    started_from = takeovers[-1]["resumed_from_step"]
    assert torn == f"checkpoint-{started_from + cfg.checkpoint.save_every_steps:08d}", (torn, summary["interruptions"])
    assert cut_off["cause"] == "worker_failure" and cut_off["resumed_from_step"] == started_from, cut_off
    lease = read_lease(store, lease_at)
    assert lease["epoch"] == 3 and lease["released"]
    events = load_events(store, cfg.run_uri)
    assert sorted(e["lease_epoch"] for e in events if e["kind"] == "driver_start") == [1, 2, 3]
    writers = {e["metrics_writer"]: e["lease_epoch"] for e in events if e["kind"] == "worker_group_start"}
    assert sorted(set(writers.values())) == [1, 2, 3]
    # Whatever landed after B's takeover is a later epoch's. A fence is a read just before the
    # write, so a commit that had passed it as the lease changed hands may land a moment later.
    late = dt.datetime.fromisoformat(took_over["created_at"]) + dt.timedelta(seconds=3)
    s3 = boto3.client("s3", region_name="us-east-1")
    prefix = cfg.run_uri.removeprefix("s3://eft/") + "/"
    after = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="eft", Prefix=prefix)
             for o in page.get("Contents", []) if o["LastModified"] > late]
    sidecars = [k for k in after if k.endswith("/checkpoint.json")]
    segments = [k for k in after if "/metrics/" in k and k.endswith(".jsonl")]
    assert sidecars and segments and any(k.endswith("/summary.json") for k in after)
    for key in sidecars:
        assert json.loads(s3.get_object(Bucket="eft", Key=key)["Body"].read())["lease_epoch"] >= 2, key
    for key in segments:
        assert writers[key.rsplit("/", 1)[1].split("-")[1]] >= 2, key
    # One trajectory: every step once, the first ones as the uninterrupted run took them.
    metrics = load_metrics(store, cfg.run_uri)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert step_rows(metrics[:len(reference)]) == step_rows(reference)
    for got, want in zip(metrics, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9, abs=1e-9), got["step"]


def test_sft_then_dpo_from_the_merged_export(straight_run, tmp_path):
    """The usual pipeline: the SFT run's merged export is the DPO run's model.uri, and so its
    reference. Standard preference pairs (the tokenizer has no chat template: prompt text, then
    each completion); `eft prepare` scores them with the export; at step 1 the policy is that
    reference, so the loss is ln 2; the run records the export as its model."""
    import math

    from app.data.prepare import prepare_dataset
    from app.dev.tiny import build_preference_corpus, write_jsonl
    from app.export import export_run

    sft_cfg, _, _ = straight_run
    merged = export_run(sft_cfg, merge=True, store=Store())["merged_uri"]
    store = Store()
    raw = write_jsonl(build_preference_corpus(conversational=False, max_chars=100), tmp_path / "pairs.jsonl")
    store.write_bytes("s3://eft/raw/train-tests-pairs.jsonl", raw.read_bytes())
    cfg = make_cfg("sft-then-dpo", model={"uri": merged}, data={"uri": "s3://eft/data/train-tests-pairs",
                                                                "seq_len": 128, "validation_fraction": 0.0},
                   prepare={"input_uri": "s3://eft/raw/train-tests-pairs.jsonl", "format": "preference"},
                   training={"objective": "dpo", "max_steps": 4, "global_batch_size": 4, "eval_every_steps": None,
                             "trace_rows": False}, checkpoint={"save_every_steps": 4},
                   # The pipeline is the point, not the sharding: DPO on 2 workers is tests/test_preference_train.py's.
                   scaling={"min_workers": 1, "max_workers": 1})
    manifest = prepare_dataset(cfg, store)
    assert manifest["reference"]["model"]["uri"] == merged and manifest["source"]["format"] == "preference"
    summary = run_training(cfg)
    metrics = load_metrics(store, cfg.run_uri)
    assert summary["status"] == "succeeded" and [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    import yaml

    stored = yaml.safe_load(store.read_text(join(cfg.run_uri, "config.yaml")))
    assert stored["model"]["uri"] == merged and stored["training"]["objective"] == "dpo"
