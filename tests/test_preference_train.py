"""Preference tuning on real Ray: `eft prepare` with `training.objective: dpo` packs the pydoc
preference corpus and scores it with the reference model as a Ray Data actor-pool pass; DPO runs
on 2 FSDP2 workers from those log-probs, starts at ln 2 and learns to prefer the chosen answers;
the same run with the live reference (adapters disabled) stopped at step 6 on 1 worker and
resumed on 2 follows it step for step; SimPO runs without a reference; a dataset without
reference log-probs for the model, or prepared as chat, is refused in one line before Ray work."""

from __future__ import annotations

import math
import tempfile

import pytest

from app.config import build_config
from app.data.reference import ReferenceLogpsError, check_reference
from app.dev.tiny import add_chat_template, build_corpus, build_preference_corpus, build_tiny_model, \
    build_tiny_tokenizer, write_jsonl
from app.observe.metrics import load_metrics
from app.storage import Store
from app.train.launch import run_training

MODEL = "s3://eft/models/tiny-dpo"
DATA = "s3://eft/data/dpo"
RAW = "s3://eft/raw/dpo/pairs.jsonl"
METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
           "logps_rejected")


def make_cfg(name: str, **sections):
    tree = {
        "name": name, "model": {"uri": MODEL},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]},
        "data": {"uri": DATA, "seq_len": 256, "validation_fraction": 0.1},
        "prepare": {"input_uri": RAW, "format": "preference", "engine": "local", "local_threads": 1},
        "training": {"objective": "dpo", "max_steps": 40, "global_batch_size": 4, "micro_batch_size": 2,
                     "lr": 5e-3, "schedule": "constant", "eval_every_steps": 20, "trace_rows": True},
        "preference": {"beta": 0.1},
        "checkpoint": {"save_every_steps": 10},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": "s3://eft/runs-dpo"},
    }
    for key, value in sections.items():
        tree[key] = None if value is None else {**(tree.get(key) or {}), **value}
    return build_config(tree)


@pytest.fixture(scope="module")
def prepared(s3, ray_cluster, tmp_path_factory):
    from app.data.prepare import prepare_dataset

    store = Store()
    tok = add_chat_template(build_tiny_tokenizer(build_corpus(max_docs=200)))
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tok).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        store.upload_dir(tmp, MODEL, last=("config.json",))
    raw = write_jsonl(build_preference_corpus(), tmp_path_factory.mktemp("raw") / "pairs.jsonl")
    store.write_bytes(RAW, raw.read_bytes())
    cfg = make_cfg("prep")
    return cfg, prepare_dataset(cfg, store)


@pytest.fixture(scope="module")
def dpo_run(prepared):
    cfg = make_cfg("dpo")
    return cfg, run_training(cfg), load_metrics(Store(), cfg.run_uri)


def test_prepare_scores_every_shard_with_the_reference_model_once(prepared):
    from app.data.prepare import prepare_dataset

    cfg, manifest = prepared
    reference = manifest["reference"]
    assert reference["model"]["uri"] == MODEL
    shards = sum(len(part["shards"]) for part in manifest["splits"].values())
    assert reference["stats"]["shards"] == reference["stats"]["shards_scored"] == shards
    assert reference["stats"]["rows"] == sum(part["rows"] for part in manifest["splits"].values())
    # Again: the dataset and its log-probs are there, nothing is scored twice.
    assert prepare_dataset(cfg, Store())["reference"] == reference


def test_a_cut_off_reference_pass_resumes_scoring_only_what_is_missing(prepared):
    """A pass pre-empted after some shards: the shards written stay, the next `eft prepare` scores
    only the others and commits the same log-probs."""
    from app.data.manifest import commit_manifest, load_manifest
    from app.data.prepare import prepare_dataset

    cfg, manifest = prepared
    store = Store()
    targets = [shard["path"] for part in manifest["reference"]["splits"].values() for shard in part["shards"]]
    before = {path: store.read_bytes(f"{DATA}/{path}") for path in targets}
    # As a pass cut off after its first shard leaves it: no reference entry, one shard missing.
    commit_manifest(store, DATA, {k: v for k, v in manifest.items() if k != "reference"})
    store.delete_prefix(f"{DATA}/{targets[-1]}")
    resumed = prepare_dataset(cfg, store)["reference"]
    assert resumed["stats"]["shards_scored"] == 1 and resumed["stats"]["shards"] == len(targets) > 1
    assert resumed["splits"] == manifest["reference"]["splits"]
    for path in targets:
        import io

        import pyarrow.parquet as pq

        got = pq.read_table(io.BytesIO(store.read_bytes(f"{DATA}/{path}")))["ref_logps"].to_pylist()
        want = pq.read_table(io.BytesIO(before[path]))["ref_logps"].to_pylist()
        assert got == want, path
    assert load_manifest(store, DATA)["reference"]["key"] == manifest["reference"]["key"]


def test_dpo_starts_at_ln2_and_learns_to_prefer_the_chosen_answer(dpo_run):
    _, summary, metrics = dpo_run
    assert summary["status"] == "succeeded" and [m["step"] for m in metrics] == list(range(1, 41))
    assert all(name in m for m in metrics for name in METRICS)
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert metrics[0]["reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert metrics[-1]["reward_accuracy"] >= 0.9 and metrics[-1]["loss"] < 0.5 * math.log(2)
    assert metrics[-1]["reward_margin"] > 0.5
    last = metrics[-1]
    assert {f"val_{name}" for name in METRICS} <= set(last) and "val_ppl" not in last


def test_the_live_reference_resumed_at_another_world_size_follows_the_same_trajectory(dpo_run):
    """Live reference (the adapters disabled) instead of precomputed, 1 worker for 6 steps, then
    2: the same rows and, to fp32 summation order, the same per-step losses."""
    _, _, reference = dpo_run
    first = make_cfg("dpo-live", preference={"reference": "live"}, training={"max_steps": 6, "eval_every_steps": None},
                     scaling={"min_workers": 1, "max_workers": 1})
    run_training(first)
    summary = run_training(make_cfg("dpo-live", preference={"reference": "live"},
                                    training={"eval_every_steps": None}))
    metrics = load_metrics(Store(), first.run_uri)
    assert summary["world_sizes"] == [1, 2]
    assert [m["row_ids"] for m in metrics] == [m["row_ids"] for m in reference]
    for got, want in zip(metrics, reference):
        for name in ("loss", "reward_margin", "logps_chosen"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-5), (got["step"], name)


def test_simpo_needs_no_reference_and_learns(prepared):
    cfg = make_cfg("simpo", training={"objective": "simpo", "max_steps": 8, "eval_every_steps": None},
                   preference={"beta": 2.0})
    summary = run_training(cfg)
    metrics = load_metrics(Store(), cfg.run_uri)
    assert summary["status"] == "succeeded"
    assert metrics[-1]["reward_margin"] > metrics[0]["reward_margin"]
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_a_dataset_without_the_models_reference_or_of_chat_records_is_refused_before_ray_work(prepared, tmp_path):
    from app.data.manifest import load_manifest

    store = Store()
    manifest = load_manifest(store, DATA)
    other = "s3://eft/models/tiny-dpo-other"
    tok = add_chat_template(build_tiny_tokenizer(build_corpus(max_docs=50)))
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tok, hidden_size=32).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        store.upload_dir(tmp, other, last=("config.json",))
    with pytest.raises(ReferenceLogpsError, match=rf"^data.uri {DATA} holds reference log-probs of {MODEL} .* not of "
                                              rf"model.uri {other} .*run `eft prepare`"):
        check_reference(make_cfg("x", model={"uri": other}), store, manifest)
    without = {k: v for k, v in manifest.items() if k != "reference"}
    with pytest.raises(ReferenceLogpsError, match=r"has no reference log-probs .* run `eft prepare`"):
        check_reference(make_cfg("x"), store, without)
    chat_like = {**manifest, "source": {**manifest["source"], "format": "chat"}}
    from app.train.launch import check_objective_fits

    with pytest.raises(ValueError, match=r"^training.objective dpo: the dataset at .* was prepared as 'chat'"):
        check_objective_fits(make_cfg("x", prepare=None), chat_like)


def test_status_and_report_show_the_rewards(dpo_run):
    from app.report import build_loss_figure, build_status, build_status_rows, load_run

    cfg, _, metrics = dpo_run
    run = load_run(Store(), cfg.run_uri)
    status = build_status(run)
    rows = dict(build_status_rows(status))
    assert status["reward_accuracy"] == metrics[-1]["reward_accuracy"]
    assert rows["rewards"].startswith("chosen ") and rows["reward accuracy"].startswith(
        f"{metrics[-1]['reward_accuracy']:.2f} (validation ")
    figure = build_loss_figure(run, status)
    assert [ax.get_title() for ax in figure.axes][1] == "preference rewards"


def test_a_dpo_run_exports_like_any_other(dpo_run):
    """Export is unchanged: the adapter loads into PEFT on the base, the merged model into
    transformers, and both carry the chat template the pairs were rendered with, so the tuned
    model's logits are the adapted base's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.export import export_run

    cfg, _, _ = dpo_run
    store = Store()
    exported = export_run(cfg, merge=True, store=store)
    merged_dir, adapter_dir = (store.cache_locally(exported[k]) for k in ("merged_uri", "adapter_uri"))
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(store.cache_locally(MODEL), dtype=torch.float32)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(store.cache_locally(MODEL)).chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is a list?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, adapter_dir).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4 * adapted.abs().max().item())
