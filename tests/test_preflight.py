"""`eft train` refuses, before Ray starts and before it writes a single object, what the model or
the dataset cannot take: LoRA targets the model lacks, sequences beyond its positions, evaluation
without a validation split, a dataset that a prepare is rewriting. Each refusal is one line
naming the key or URI at fault. No Ray for the refusals: a check that let a bad job through
would start one and fail the test on the run prefix or the exit code. One run (with a stand-in
worker loop) shows the reader lease a run holds on its dataset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml

from app.cli import main
from app.config import load_config
from app.data.lease import READERS_DIR, hold_prepare_lease
from app.data.prepare import prepare_dataset
from app.dev.tiny import build_corpus, save_tiny_base
from app.storage import Store, join
from app.train.launch import preflight, run_training

ROOT = Path(__file__).resolve().parents[1]
BASE = "s3://eft/models/preflight-tiny"
SHORT_BASE = "s3://eft/models/preflight-tiny-16-positions"
DATA = "s3://eft/data/preflight"
RUNS = "s3://eft/runs-preflight"
SEQ_LEN = 32
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def job(s3, tmp_path_factory) -> Path:
    """A tiny base, a copy of it that only has 16 positions, a dataset with no validation split
    (local engine, no Ray), and a job YAML for them."""
    store = Store()
    texts = build_corpus(max_docs=80)
    save_tiny_base(store, BASE, texts=texts, hidden_size=16, intermediate_size=32, max_positions=64)
    for name in store.list_files(BASE):
        if name != "config.json":
            store.write_bytes(join(SHORT_BASE, name), store.read_bytes(join(BASE, name)))
    config = {**store.read_json(join(BASE, "config.json")), "max_position_embeddings": 16}
    store.write_json(join(SHORT_BASE, "config.json"), config)
    store.write_text("s3://eft/raw/preflight.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts))
    tree = {
        "name": "preflight", "model": {"uri": BASE},
        "lora": {"r": 4, "alpha": 8, "target_modules": ALL_LINEAR},
        "data": {"uri": DATA, "seq_len": SEQ_LEN},
        "prepare": {"input_uri": "s3://eft/raw/preflight.jsonl", "engine": "local"},
        "training": {"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 1},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": RUNS},
    }
    path = tmp_path_factory.mktemp("preflight") / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    prepare_dataset(load_config(path), store)
    return path


def run_objects(name: str) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket="eft", Prefix=f"runs-preflight/{name}/")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_the_job_itself_passes_preflight(job):
    manifest = preflight(load_config(job), Store())
    assert manifest["seq_len"] == SEQ_LEN and not manifest["splits"]["validation"]["rows"]


@pytest.mark.parametrize("name, sets, named", [
    ("no-such-target", ["lora.target_modules=[q_proj, qkv_proj]"],
     f"lora.target_modules: 'qkv_proj' matches no module of the llama model at {BASE} (its layers: down_proj, "),
    ("block-target", ["lora.target_modules=[mlp]"],
     f"lora.target_modules: 'mlp' matches LlamaMLP modules (e.g. model.layers.0.mlp) of the llama model at {BASE}"),
    ("too-long", [f"model.uri={SHORT_BASE}"],
     f"data.seq_len {SEQ_LEN} exceeds max_position_embeddings 16 of the model at {SHORT_BASE}"),
    ("eval-no-val", ["training.eval_every_steps=1"],
     f"training.eval_every_steps 1: the dataset at {DATA} has no validation rows"),
])
def test_train_refuses_in_one_line_before_ray_or_any_object(job, capsys, monkeypatch, name, sets, named):
    import ray

    # The session's own Ray may already be up from earlier tests: point eft at a cluster that does
    # not exist, so reaching Ray at all would end in another error than the one expected here.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    was_initialized = ray.is_initialized()
    args = ["train", str(job), "--set", f"name={name}"]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"eft: error: {named}"), lines[-1]
    assert not any("Traceback" in line for line in lines)
    assert ray.is_initialized() == was_initialized
    assert run_objects(name) == []


def test_prepare_refuses_a_seq_len_beyond_the_models_positions_before_reading_input(job, capsys):
    """The same check as train's, at prepare: one line naming both numbers and the model, before
    the dataset's lease is taken or the input is read (the input named here does not exist, and
    reading it would be another error), and nothing written under the dataset's prefix."""
    data = "s3://eft/data/preflight-too-long"
    code = main(["prepare", str(job), "--set", f"model.uri={SHORT_BASE}", "--set", f"data.uri={data}",
                 "--set", "prepare.input_uri=s3://eft/raw/no-such-input.jsonl"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and lines == [
        f"eft: error: data.seq_len {SEQ_LEN} exceeds max_position_embeddings 16 of the model at {SHORT_BASE}"]
    assert not boto3.client("s3").list_objects_v2(Bucket="eft", Prefix="data/preflight-too-long/").get("Contents")
    # The model within its positions: the same command goes on to the input, and names it.
    assert main(["prepare", str(job), "--set", f"data.uri={data}",
                 "--set", "prepare.input_uri=s3://eft/raw/no-such-input.jsonl"]) == 1
    assert "no-such-input.jsonl" in capsys.readouterr().err.strip().splitlines()[-1]


def test_train_waits_for_a_prepare_that_holds_the_dataset(job, capsys):
    with hold_prepare_lease(Store(), DATA) as lease:
        assert main(["train", str(job), "--set", "name=during-prepare"]) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"eft: error: {DATA}: being prepared by prepare (pid ")
    assert lease.owner["host"] in message and "lease until 20" in message
    assert run_objects("during-prepare") == []


def test_the_console_script_names_a_missing_target_and_writes_nothing(job):
    """As a user runs it: the command line in a fresh process, with the session's S3."""
    out = subprocess.run([sys.executable, "-m", "app.cli", "train", str(job), "--set", "name=console",
                          "--set", "lora.target_modules=[q_proj, query_key_value]"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "eft: error: lora.target_modules: 'query_key_value' matches no module of the llama model at "), out.stderr
    assert "Traceback" not in out.stderr and "Warning" not in out.stderr, out.stderr
    assert run_objects("console") == []


def _expect_one_reader_lease(config):
    """The worker loop stand-in: while the workers run, the driver's reader lease is there."""
    readers = Store().list_files(join(DATA, READERS_DIR))
    if len(readers) != 1:
        raise RuntimeError(f"expected the run's reader lease under {DATA}/{READERS_DIR}, found {readers}")


def test_a_run_reads_its_dataset_under_a_reader_lease_it_releases(job, ray_cluster):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = load_config(job, ["name=reader-lease"])
    run_training(cfg, train_fn=_expect_one_reader_lease)
    assert Store().list_files(join(DATA, READERS_DIR)) == []
