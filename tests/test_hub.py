"""`model.uri: hf://ORG/NAME[@REV]` against a stand-in hub on loopback (tests/hub_server.py), talked
to by the real `huggingface_hub` client through HF_ENDPOINT, and a real S3 endpoint (moto): the
revision pinned to a sha, the repo mirrored once with its marker last, a second resolve that
downloads nothing, a cut-off mirror redone, a gated repo, pickled weights refused, and the token
in no object written and no log line."""

from __future__ import annotations

import hashlib
import logging
import tempfile
from pathlib import Path

import boto3
import pytest
from hub_server import HubRepo, HubServer

from app.config import ConfigError, build_config
from app.dev.faults import SlowDownProxy
from app.hub import MARKER, HubError, default_mirror_root, list_mirrors, mirror_model, resolve_model
from app.storage import Store, join

TOKEN = "hf_eftTestTokenThatMustNeverBeStored0042"
MIRROR = "s3://eft/hub-tests/mirror"
ORG_NAME = "acme/tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny base in Hugging Face format, as a hub repo holds it."""
    from app.dev.tiny import build_corpus, build_tiny_model, build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny-hub")
    tokenizer = build_tiny_tokenizer(build_corpus(max_docs=40), vocab_size=256)
    build_tiny_model(tokenizer).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text("a model card: not needed by a run, so not mirrored\n")
    return out


@pytest.fixture
def hub(monkeypatch, model_dir):
    with HubServer() as server:
        repo = HubRepo()
        repo.commit_dir(model_dir)
        server.repos[ORG_NAME] = repo
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        # huggingface_hub's own token file lives under HF_HOME: an empty one, so no token of the
        # machine's is found.
        monkeypatch.setenv("HF_HOME", tempfile.mkdtemp())
        yield server


def fresh_root(name: str) -> str:
    return f"{MIRROR}-{name}"


def job(uri: str, mirror: str, prepare: dict | None = None, **model):
    return build_config({"name": "hub", "model": {"uri": uri, "mirror_uri": mirror, **model},
                         "data": {"uri": "s3://eft/data/unused", "seq_len": 64}, "training": {"max_steps": 1},
                         "storage": {"root_uri": "s3://eft/hub-tests/runs"}, "prepare": prepare})


def test_a_hub_id_is_pinned_and_mirrored_once_with_its_marker_last(s3, hub, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store, root = Store(), fresh_root("once")
    sha = hub.repos[ORG_NAME].refs["main"]
    cfg, marker = resolve_model(job(f"hf://{ORG_NAME}", root), store)
    assert marker["sha"] == sha and marker["revision"] == "main"
    assert cfg.model.uri == join(root, "acme", "tiny-llama", sha)
    mirrored = set(store.list_file_sizes(cfg.model.uri))
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= {Path(p).name for p in mirrored}
    assert not any(p.endswith("README.md") for p in mirrored)
    # The marker is the last object written: every file it lists was up before it.
    s3c = boto3.client("s3", region_name="us-east-1")
    prefix = cfg.model.uri.removeprefix("s3://eft/") + "/"
    objects = s3c.list_objects_v2(Bucket="eft", Prefix=prefix)["Contents"]
    marker_time = [o["LastModified"] for o in objects if o["Key"].endswith(MARKER)][0]
    assert all(o["LastModified"] <= marker_time for o in objects)
    assert hub.requests["download"] == len(marker["files"])

    # Loaded back by transformers from a copy of the mirror: the repo's weights, byte for byte.
    local = store.cache_locally(cfg.model.uri)
    got = AutoModelForCausalLM.from_pretrained(local).state_dict()
    want = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert all((got[k] == want[k]).all() for k in want)
    assert AutoTokenizer.from_pretrained(local)("import os").input_ids == \
        AutoTokenizer.from_pretrained(model_dir)("import os").input_ids

    # Again by branch: one API call to learn where main points, no download.
    before = dict(hub.requests)
    again, _ = resolve_model(job(f"hf://{ORG_NAME}@main", root), store)
    assert again.model.uri == cfg.model.uri
    assert hub.requests["download"] == before["download"] and hub.requests["api"] == before["api"] + 1
    # By sha, mirrored: the hub is not contacted at all (how a cluster without internet runs).
    pinned, _ = resolve_model(job(f"hf://{ORG_NAME}@{sha}", root), store)
    assert pinned.model.uri == cfg.model.uri and dict(hub.requests) == {**before, "api": before["api"] + 1}
    assert [m["sha"] for m in list_mirrors(store, root) if m["complete"]] == [sha]


def test_a_moved_branch_is_a_new_mirror_and_resume_against_it_is_refused(s3, hub, model_dir, tmp_path):
    from app.elastic.resume import ResumeError, check_resume

    store, root = Store(), fresh_root("moved")
    first, _ = resolve_model(job(f"hf://{ORG_NAME}", root), store)
    old_sha = first.model.uri.rsplit("/", 1)[1]
    # A run trained on the old commit (its stored config is what a resume compares with).
    from app.config import dump_config

    store.write_text(join(first.run_uri, "config.yaml"), dump_config(first))
    store.write_text(join(first.run_uri, "checkpoint-00000001", "placeholder"), "a checkpoint of the run")
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    files["generation_config.json"] = b'{"max_new_tokens": 7}'
    new_sha = hub.repos[ORG_NAME].commit(files)
    moved, _ = resolve_model(job(f"hf://{ORG_NAME}", root), store)
    assert moved.model.uri.endswith(new_sha) and new_sha != old_sha
    with pytest.raises(ResumeError, match=rf"model.uri .*{old_sha} → .*{new_sha} \(the hub commit of acme/tiny-llama "
                                          rf"is now {new_sha}, the run's is {old_sha}: pin hf://{ORG_NAME}@{old_sha}"):
        check_resume(moved, store, manifest={"dataset": "any"})
    # Looking at the run (export, eval) keeps the commit it was trained on.
    from app.elastic.resume import resolve_run_model

    assert resolve_run_model(job(f"hf://{ORG_NAME}", root), store).model.uri == first.model.uri


def test_a_mirror_cut_off_midway_is_not_used_and_is_redone(s3, hub, monkeypatch):
    monkeypatch.setattr("app.hub.RETRY_PAUSE_S", 0.01)  # the retries still happen, without the pauses
    store, root = Store(), fresh_root("cut")
    hub.fail_downloads_after = 2
    with pytest.raises(HubError, match=rf"hf://{ORG_NAME}"):
        mirror_model(store, f"hf://{ORG_NAME}", root)
    sha = hub.repos[ORG_NAME].refs["main"]
    dest = join(root, "acme", "tiny-llama", sha)
    assert store.list_files(dest) and not store.exists(join(dest, MARKER))
    assert [m["complete"] for m in list_mirrors(store, root)] == [False]
    hub.fail_downloads_after = None
    marker = mirror_model(store, f"hf://{ORG_NAME}@{sha}", root)  # a sha without a marker: mirrored anew
    assert store.exists(join(dest, MARKER)) and marker["sha"] == sha
    assert [m["complete"] for m in list_mirrors(store, root)] == [True]


def test_a_commit_sha_that_is_not_one_is_refused_before_anything_is_written(s3, hub):
    """The sha the hub answers becomes part of a storage path: a broken or hostile endpoint's
    answer (a path, upper case, short, a trailing newline) is one line, and nothing is written."""
    store, root = Store(), fresh_root("bad-sha")
    real = hub.repos[ORG_NAME].refs["main"]
    for answer in ("../../../../escaped", real.upper(), real[:39], real + "\n", "/" + real[1:]):
        hub.repos[ORG_NAME].answer_sha = answer
        with pytest.raises(HubError) as info:
            mirror_model(store, f"hf://{ORG_NAME}", root)
        line = str(info.value)
        assert line == (f"hf://{ORG_NAME}@main: the hub at {hub.endpoint} answered {answer!r} as the commit, not a "
                        f"40-character lowercase hex sha; nothing mirrored"), line
    assert store.list_files(root) == [] and hub.requests["download"] == 0
    hub.repos[ORG_NAME].answer_sha = None
    assert mirror_model(store, f"hf://{ORG_NAME}", root)["sha"] == real


def test_a_mirrored_file_unlike_the_hubs_listing_fails_the_mirror(s3, hub):
    """Each file is checked against the hub's listing as it goes up: its size, and the sha256 of
    its LFS entry. A mismatch (a truncated or swapped file, a lying endpoint) is one line naming
    the file, and the mirror gets no marker, so it is never used; once the hub agrees, it is."""
    store, root = Store(), fresh_root("mismatch")
    repo = hub.repos[ORG_NAME]
    sha = repo.refs["main"]
    dest = join(root, "acme", "tiny-llama", sha)
    size = len(repo.commits[sha]["config.json"])
    repo.listed = {"config.json": {"size": size + 1}}
    with pytest.raises(HubError) as info:
        mirror_model(store, f"hf://{ORG_NAME}", root)
    assert str(info.value) == (f"hf://{ORG_NAME}@{sha}: config.json arrived as {size} bytes, the hub lists {size + 1} "
                               f"(from {hub.endpoint}); the mirror at {dest} is not marked complete")
    assert not store.exists(join(dest, MARKER))

    forged = "0" * 64
    repo.listed = {"model.safetensors": {"lfs": {"sha256": forged}}}
    with pytest.raises(HubError) as info:
        mirror_model(store, f"hf://{ORG_NAME}", root)
    actual = hashlib.sha256(repo.commits[sha]["model.safetensors"]).hexdigest()
    assert str(info.value) == (f"hf://{ORG_NAME}@{sha}: model.safetensors has sha256 {actual}, the hub's LFS entry "
                               f"says {forged} (from {hub.endpoint}); the mirror at {dest} is not marked complete")
    assert [m["complete"] for m in list_mirrors(store, root)] == [False]

    repo.listed = {}
    marker = mirror_model(store, f"hf://{ORG_NAME}", root)
    assert marker["sha256"]["model.safetensors"] == actual
    assert [m["complete"] for m in list_mirrors(store, root)] == [True]


class FirstRequestsThrottled(SlowDownProxy):
    """A SlowDownProxy that answers 503 SlowDown to the first `count` requests it gets and
    forwards every later one: a storage blip of a known length."""

    def __init__(self, upstream: str, count: int):
        super().__init__(upstream, fraction=0.0)
        self.left = count

    def _throttle(self) -> bool:
        with self._random_lock:
            self.left -= 1
            return self.left >= 0


def test_a_storage_blip_reading_the_marker_is_retried_never_taken_for_no_mirror(s3, hub, monkeypatch):
    """`eft plan` (an interactive store) on a pinned, mirrored sha: the first reads of the marker
    answer 503. They are retried, and config.json comes from the mirror: the hub is not asked
    (offline, it could not be). A store that keeps failing is one line naming the marker, never
    a download."""
    from app.hub import read_model_file

    store, root = Store(), fresh_root("blip")
    marker = mirror_model(store, f"hf://{ORG_NAME}", root)
    sha, before = marker["sha"], dict(hub.requests)
    with FirstRequestsThrottled(s3.endpoint, count=3) as proxy:
        data, where = read_model_file(Store(endpoint=proxy.endpoint, interactive=True), f"hf://{ORG_NAME}@{sha}", root)
    assert proxy.log.count(503) == 3  # the blip happened
    assert where == join(marker["mirror_uri"], "config.json") and data == store.read_bytes(where)
    assert dict(hub.requests) == before

    from app.storage import StorageError

    with SlowDownProxy(s3.endpoint, fraction=1.0) as proxy:
        away = Store(endpoint=proxy.endpoint, interactive=True)
        with pytest.raises(StorageError) as info:
            read_model_file(away, f"hf://{ORG_NAME}@{sha}", root)
    line = str(info.value)
    assert line.startswith(f"{join(marker['mirror_uri'], MARKER)}: the mirror's marker could not be read (OSError: ")
    assert "\n" not in line and line.endswith("not mirroring again over a blip: try again once storage answers")
    assert dict(hub.requests) == before


def test_a_gated_repo_names_the_repo_and_the_way_in_and_the_token_is_never_written(s3, hub, model_dir, monkeypatch,
                                                                                      caplog):
    store, root = Store(), fresh_root("gated")
    gated = HubRepo(gated_token=TOKEN)
    gated.commit_dir(model_dir)
    hub.repos["acme/gated"] = gated
    with pytest.raises(HubError) as info:
        mirror_model(store, "hf://acme/gated", root)
    line = str(info.value)
    assert "\n" not in line and "hf://acme/gated is gated at" in line and "HF_TOKEN" in line

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with caplog.at_level(logging.DEBUG):
        marker = mirror_model(store, "hf://acme/gated", root)
    assert any({k.lower(): v for k, v in h.items()}.get("authorization") == f"Bearer {TOKEN}"
               for h in hub.seen_headers)  # it was sent to the hub
    s3c = boto3.client("s3", region_name="us-east-1")
    keys = [o["Key"] for o in s3c.list_objects_v2(Bucket="eft", Prefix=root.removeprefix("s3://eft/"))["Contents"]]
    assert marker["mirror_uri"] and keys
    for key in keys:
        assert TOKEN.encode() not in s3c.get_object(Bucket="eft", Key=key)["Body"].read(), key
    assert TOKEN not in caplog.text


def test_missing_repos_and_revisions_and_a_dead_hub_are_one_line(s3, hub, monkeypatch):
    store, root = Store(), fresh_root("errors")
    with pytest.raises(HubError, match=r"^hf://acme/nothing does not exist at http://127\.0\.0\.1:\d+"):
        mirror_model(store, "hf://acme/nothing", root)
    with pytest.raises(HubError, match=rf"^hf://{ORG_NAME}: revision 'v9' does not exist"):
        mirror_model(store, f"hf://{ORG_NAME}@v9", root)
    with pytest.raises(ConfigError, match=r"model\.uri: hf://just-a-name is not a hub id"):
        job("hf://just-a-name", root)  # the config refuses it (tests/test_configs.py), before the hub
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    with pytest.raises(HubError) as info:
        mirror_model(store, f"hf://{ORG_NAME}", root)
    assert str(info.value).startswith(f"cannot reach the hub at {dead} for hf://{ORG_NAME}")
    assert f"eft model pull hf://{ORG_NAME} --to {root}" in str(info.value)


def test_pickled_weights_are_refused_unless_allowed(s3, hub, model_dir, caplog):
    import torch
    from safetensors.torch import load_file

    store, root = Store(), fresh_root("pickle")
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(load_file(model_dir / "model.safetensors"), Path(tmp) / "pytorch_model.bin")
        files["pytorch_model.bin"] = (Path(tmp) / "pytorch_model.bin").read_bytes()
    legacy = HubRepo()
    legacy.commit(files)
    hub.repos["acme/legacy"] = legacy
    with pytest.raises(HubError, match=r"^hf://acme/legacy@main has only pickled weights \(pytorch_model\.bin\): "
                                       r"loading a pickle runs code; set model\.allow_pickle_weights: true"):
        resolve_model(job("hf://acme/legacy", root), store)
    assert hub.requests["download"] == 0  # refused before a byte was fetched
    with caplog.at_level(logging.WARNING, logger="eft.hub"):
        cfg, marker = resolve_model(job("hf://acme/legacy", root, allow_pickle_weights=True), store)
    assert marker["pickled_weights"] and "pytorch_model.bin" in marker["files"]
    assert any("model.allow_pickle_weights is true" in r.getMessage() for r in caplog.records)


def test_eft_model_pull_and_ls_through_the_cli(s3, hub, capsys):
    from app.cli import main

    root = fresh_root("cli")
    sha = hub.repos[ORG_NAME].refs["main"]
    assert main(["model", "pull", f"hf://{ORG_NAME}", "--to", root]) == 0
    assert capsys.readouterr().out.strip() == f"hf://{ORG_NAME}@{sha} -> {join(root, 'acme', 'tiny-llama', sha)}"
    assert main(["model", "ls", root]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"hf://{ORG_NAME}@{sha}  ") and "files" in line
    assert main(["model", "ls", fresh_root("cli-empty")]) == 0
    assert capsys.readouterr().err.strip() == f"eft: no mirrors under {fresh_root('cli-empty')}"
    assert main(["model", "pull", "hf://nope"]) == 1
    assert capsys.readouterr().err.strip() == ("eft: error: eft model pull hf://nope: not a hub id "
                                               "(hf://ORG/NAME or hf://ORG/NAME@REVISION)")


def test_the_default_mirror_sits_beside_the_runs():
    assert default_mirror_root("s3://bucket/eft/runs") == "s3://bucket/eft/models-mirror"
    assert default_mirror_root("s3://bucket") == "s3://bucket/models-mirror"
    assert default_mirror_root("/data/runs") == "/data/models-mirror"


def test_an_endpoint_with_credentials_in_it_is_never_written_with_them(s3, hub, monkeypatch):
    from urllib.parse import urlparse

    store, root = Store(), fresh_root("userinfo")
    port = urlparse(hub.endpoint).port
    monkeypatch.setenv("HF_ENDPOINT", f"http://mirror-user:{TOKEN}@127.0.0.1:{port}")
    marker = mirror_model(store, f"hf://{ORG_NAME}", root)
    assert marker["endpoint"] == hub.endpoint
    assert TOKEN not in store.read_text(join(marker["mirror_uri"], MARKER))
    with pytest.raises(HubError) as info:
        mirror_model(store, "hf://acme/nothing", root)
    assert TOKEN not in str(info.value) and hub.endpoint in str(info.value)


def test_plan_reads_only_config_json_from_the_hub_and_writes_nothing(s3, hub):
    from app.plan import plan_job

    store, root = Store(), fresh_root("plan")
    sha = hub.repos[ORG_NAME].refs["main"]
    # Before anything is mirrored: one API call and config.json alone, and nothing is written.
    plan, _ = plan_job(job(f"hf://{ORG_NAME}", root))
    assert dict(hub.requests) == {"api": 1, "download": 1} and plan.choice
    assert not store.list_files(root)
    # Pinned and mirrored: read from the mirror, without a request.
    mirror_model(store, f"hf://{ORG_NAME}", root)
    before = dict(hub.requests)
    again, _ = plan_job(job(f"hf://{ORG_NAME}@{sha}", root))
    assert dict(hub.requests) == before and again.to_dict() == plan.to_dict()


def test_prepare_preview_tokenizes_with_the_mirrored_tokenizer(s3, hub, model_dir):
    from transformers import AutoTokenizer

    from app.data.preview import preview_records

    store, root = Store(), fresh_root("preview")
    store.write_text("s3://eft/hub-tests/raw/preview.jsonl", '{"text": "import os"}\n')
    cfg = job(f"hf://{ORG_NAME}", root, prepare={"input_uri": "s3://eft/hub-tests/raw/preview.jsonl"})
    _, (record,) = preview_records(cfg, 1, store)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = [tokenizer.bos_token_id, *tokenizer("import os", add_special_tokens=False).input_ids]
    assert record.input_ids[:len(want)] == want
    assert [m["complete"] for m in list_mirrors(store, root)] == [True]


def test_a_run_from_a_hub_id_prepares_trains_and_exports_from_its_mirror(s3, ray_cluster, hub, tmp_path):
    """The slow tier's run: prepare resolves the branch and mirrors the repo (its tokenizer tokenizes
    the data); training, pinned at the sha, asks the hub nothing, and neither do its workers, which
    read the mirror; the export names the commit."""
    import yaml

    from app.data.prepare import prepare_dataset
    from app.dev.tiny import build_corpus, write_jsonl
    from app.export import export_run
    from app.train.launch import run_training

    store, root = Store(), fresh_root("e2e")
    sha = hub.repos[ORG_NAME].refs["main"]
    mirror = join(root, "acme", "tiny-llama", sha)
    raw = write_jsonl(({"text": t} for t in build_corpus(max_docs=40)), tmp_path / "corpus.jsonl")
    store.write_bytes("s3://eft/hub-tests/raw/corpus.jsonl", raw.read_bytes())

    def cfg(uri: str):
        return build_config({
            "name": "hub-e2e", "model": {"uri": uri, "mirror_uri": root},
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "data": {"uri": "s3://eft/hub-tests/data", "seq_len": 64},
            "prepare": {"input_uri": "s3://eft/hub-tests/raw/corpus.jsonl"},
            "training": {"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 2},
            "checkpoint": {"save_every_steps": 2},
            "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
            "storage": {"root_uri": "s3://eft/hub-tests/runs"}})

    manifest = prepare_dataset(cfg(f"hf://{ORG_NAME}"), store)
    assert manifest["splits"]["train"]["rows"] >= 4
    files = store.read_json(join(mirror, MARKER))["files"]
    assert dict(hub.requests) == {"api": 1, "download": len(files)}
    before = dict(hub.requests)
    summary = run_training(cfg(f"hf://{ORG_NAME}@{sha}"), store)
    assert summary["status"] == "succeeded" and summary["steps"] == 2
    assert dict(hub.requests) == before  # the driver read the marker; the workers read the mirror
    stored = yaml.safe_load(store.read_text(join(cfg(f"hf://{ORG_NAME}").run_uri, "config.yaml")))
    assert stored["model"]["uri"] == mirror
    exported = export_run(cfg(f"hf://{ORG_NAME}@{sha}"), store=store)
    assert exported["base_model_hub"] == {"repo": ORG_NAME, "revision": sha, "sha": sha, "mirror_uri": mirror}
    assert dict(hub.requests) == before
