"""Shared fixtures: a real S3 endpoint on a free loopback port, a real local Ray cluster,
and a tiny Hugging Face model + tokenizer saved to S3 (no hub is reachable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.dev import local  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def s3():
    """An S3 endpoint (moto's server) with bucket `eft`; the process env points boto3/pyarrow at it."""
    with local.serve_s3() as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster(s3):
    """A real local Ray cluster; workers inherit the S3 env. More logical CPUs than cores so
    Ray Data has slots beside the training workers."""
    import ray

    from app.cluster import require_token_auth

    require_token_auth()  # a private token: nothing read from or written to ~/.ray
    ray.init(address="local", num_cpus=8, include_dashboard=True, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    # Where `make test` looks for the reason if this driver is killed (tests/report_crash.py).
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    record = Path(__file__).resolve().parents[1] / "build" / "pytest-ray-session"
    record.parent.mkdir(exist_ok=True)
    record.write_text(str(session))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def base_cache(tmp_path_factory) -> Path:
    """One disk cache of the demo's pre-trained chat base for the stacks this session starts with
    `eft local up --cache-dir`: the first one pre-trains (about a minute), the others reuse it."""
    return tmp_path_factory.mktemp("eft-cache")


def build_tiny_dataset(cfg, work_dir: Path, max_docs: int = 300) -> dict:
    """A tiny base at cfg.model.uri, the pydoc corpus at cfg.prepare.input_uri, prepared into
    cfg.data.uri (needs the `s3` and `ray_cluster` fixtures). Returns the manifest."""
    from app.data.manifest import load_manifest
    from app.data.prepare import prepare_dataset
    from app.storage import Store
    from app.dev.tiny import build_corpus, save_tiny_base, write_jsonl

    store = Store()
    texts = build_corpus(max_docs=max_docs)
    save_tiny_base(store, cfg.model.uri, texts=texts)
    raw = write_jsonl(({"text": t} for t in texts), Path(work_dir) / "corpus.jsonl")
    store.write_bytes(cfg.prepare.input_uri, raw.read_bytes())
    prepare_dataset(cfg, store)
    return load_manifest(store, cfg.data.uri)
