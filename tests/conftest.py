"""Shared fixtures: a real S3 endpoint on a free loopback port, a real local Ray cluster,
and a tiny Hugging Face model + tokenizer saved to S3 (no hub is reachable).

Tiers, decided by a rule on the fixtures a test uses (their whole closure), never by hand:
- `cluster`: it runs on the session's Ray cluster (`ray_cluster`);
- `e2e`: it runs eft, Ray or training ranks as processes of their own: a new user's shell with its
  own stack (`new_user_shell`), a multi-node Ray cluster of its own (`run_scenario`, one of
  tests/scenarios/), or gloo ranks spawned without Ray (`rank_processes`);
- everything else is the fast tier: `make test-fast` runs it, in parallel. A fast-tier test that
  starts Ray or spawns ranks anyway fails, naming the fixture that would tier it right.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# The fast tier runs one pytest-xdist worker per core: each worker's torch (and the CLI processes it
# starts) on one intra-op thread, not one per core, so that the workers do not oversubscribe the
# cores (OpenMP threads spin while they wait for work another worker's threads hold the core for).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.dev import local  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s by default, so every run of a few steps waits
# up to 2 s to be seen starting and again to be seen finished. Ray Train propagates this setting
# from the driver to its controller; at 0.5 s a tiny test run takes ~15 s instead of ~21 s.
FAST_POLL_SET_HERE = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")

# fixture → the tier of every test that uses it.
TIER_OF_FIXTURE = {"ray_cluster": "cluster", "new_user_shell": "e2e", "rank_processes": "e2e", "run_scenario": "e2e"}


def pytest_configure(config):
    import box_cpu

    box_cpu.register(config)  # the machine's busy CPU-seconds per test, in the slow tiers' summary


def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in sorted({TIER_OF_FIXTURE[f] for f in getattr(item, "fixturenames", ()) if f in TIER_OF_FIXTURE}):
            item.add_marker(tier)
    # The slow tiers' modules that never use the session's Ray cluster go first, so that it is not
    # started yet and idles through none of them (its daemons use about 2 CPU-seconds a minute).
    # A stable sort by whole module: every module's tests keep their order and stay together.
    on_cluster = {item.module.__name__ for item in items
                  if "ray_cluster" in getattr(item, "fixturenames", ()) and getattr(item, "module", None)}
    items.sort(key=lambda item: bool(item.get_closest_marker("cluster") or item.get_closest_marker("e2e"))
               and getattr(item, "module", None) is not None and item.module.__name__ in on_cluster)


@pytest.fixture(autouse=True)
def _fast_tier_starts_nothing(request, monkeypatch):
    """A test of the fast tier may not start Ray or spawn training ranks: that would make
    `make test-fast` slow, and its tier a lie."""
    if any(request.node.get_closest_marker(tier) for tier in ("cluster", "e2e")):
        return
    import ray
    import torch.multiprocessing

    def refuse(what: str, fixture: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"{request.node.nodeid} {what} without the `{fixture}` fixture, which puts it in the "
                               f"tier that may (tests/conftest.py)")
        return refused

    monkeypatch.setattr(ray, "init", refuse("starts Ray", "ray_cluster"))
    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse("spawns training ranks", "rank_processes"))


def fresh_shell_env(home: Path) -> dict:
    """This process's environment as a new user's shell has it: no AWS or Ray settings (the
    test session's own S3 endpoint and Ray token live there), and an empty home."""
    home.mkdir(parents=True, exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}, "HOME": str(home)}


@pytest.fixture(scope="session")
def new_user_shell():
    """`make(home) -> env`: a new user's shell, for tests that run eft (and the stack it starts)
    as that user's processes."""
    return fresh_shell_env


@pytest.fixture(scope="session")
def run_scenario():
    """`run(name, *args, timeout_s)`: tests/scenarios/<name>.py in a process of its own, which owns
    the multi-node Ray cluster it starts; returns the CompletedProcess."""
    import subprocess
    import sys

    def run(name: str, *args: str, timeout_s: float = 900) -> "subprocess.CompletedProcess":
        script = Path(__file__).resolve().parent / "scenarios" / f"{name}.py"
        # The scenarios rehearse restarts as they happen in production: with Ray Train's own
        # controller polling, not the session's faster one (a restart decided 1.5 s sooner can be
        # sized before the GCS has dropped a drained node).
        env = {k: v for k, v in os.environ.items()
               if not (FAST_POLL_SET_HERE and k == "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
        # The whole stderr, for a failure whose cause scrolled out of the assertion's tail.
        (Path(tempfile.gettempdir()) / f"eft-scenario-{name}.log").write_text(proc.stderr)
        return proc

    return run


@pytest.fixture(scope="session")
def rank_processes():
    """torch.multiprocessing, for tests that spawn gloo training ranks as processes (no Ray)."""
    import torch.multiprocessing

    return torch.multiprocessing


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

    from app.cluster import own_dashboard_port, require_token_auth
    from app.compat import ray_session_dir
    from app.dev.chaos import NO_PRESTART

    require_token_auth()  # a private token: nothing read from or written to ~/.ray
    # Its processes ask its own state API: a scenario's cluster runs beside this one.
    dashboard_port = own_dashboard_port()
    # No idle workers started ahead of need (app/dev/chaos.py NO_PRESTART): 8 logical CPUs would
    # start 8 at the first driver, on a box of 2 cores.
    ray.init(address="local", num_cpus=8, include_dashboard=True, dashboard_port=dashboard_port, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, _system_config=NO_PRESTART)
    # Where `make test` looks for the reason if this driver is killed (tests/report_crash.py).
    session = Path(ray_session_dir())
    record = Path(__file__).resolve().parents[1] / "build" / "pytest-ray-session"
    record.parent.mkdir(exist_ok=True)
    record.write_text(str(session))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def base_cache(tmp_path_factory) -> Path:
    """One disk cache of the demo's pre-trained chat base for the stacks this session starts with
    `eft local up --cache-dir`. The base ships with eft (app/dev/tiny_chat_base/), so the cache stays
    empty unless the shipped base's recipe fingerprint does not match this Python's corpus: then the
    first stack pre-trains (about a minute) and the others reuse it."""
    return tmp_path_factory.mktemp("eft-cache")


def build_tiny_preference_dataset(cfg, work_dir: Path, max_chars: int = 60, per_topic: int = 4) -> dict:
    """A tiny base at cfg.model.uri, standard preference pairs from the pydoc topics (prompt text,
    then each completion: the tiny tokenizer has no chat template) at cfg.prepare.input_uri,
    prepared into cfg.data.uri with the reference pass when cfg's objective is dpo (needs the `s3`
    and `ray_cluster` fixtures). Returns the manifest."""
    from app.data.manifest import load_manifest
    from app.data.prepare import prepare_dataset
    from app.dev.tiny import build_corpus, build_preference_corpus, save_tiny_base, write_jsonl
    from app.storage import Store

    store = Store()
    save_tiny_base(store, cfg.model.uri, texts=build_corpus(max_docs=300))
    pairs = build_preference_corpus(conversational=False, max_chars=max_chars, per_topic=per_topic)
    raw = write_jsonl(pairs, Path(work_dir) / "pairs.jsonl")
    store.write_bytes(cfg.prepare.input_uri, raw.read_bytes())
    prepare_dataset(cfg, store)
    return load_manifest(store, cfg.data.uri)


def build_tiny_dataset(cfg, work_dir: Path, max_docs: int = 300) -> dict:
    """A tiny base at cfg.model.uri, the pydoc corpus at cfg.prepare.input_uri, prepared into
    cfg.data.uri (needs the `s3` and `ray_cluster` fixtures). Returns the manifest."""
    from app.data.manifest import load_manifest
    from app.data.prepare import prepare_dataset
    from app.dev.tiny import build_corpus, save_tiny_base, write_jsonl
    from app.storage import Store

    store = Store()
    texts = build_corpus(max_docs=max_docs)
    save_tiny_base(store, cfg.model.uri, texts=texts)
    raw = write_jsonl(({"text": t} for t in texts), Path(work_dir) / "corpus.jsonl")
    store.write_bytes(cfg.prepare.input_uri, raw.read_bytes())
    prepare_dataset(cfg, store)
    return load_manifest(store, cfg.data.uri)


@pytest.fixture(scope="session")
def train_dataset(s3, ray_cluster, tmp_path_factory):
    """The tiny base and the pydoc corpus prepared for the shared run (tests/train_runs.py)."""
    from train_runs import make_cfg

    return build_tiny_dataset(make_cfg("prep"), tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="session")
def train_mlflow_uri(tmp_path_factory):
    return (tmp_path_factory.mktemp("mlflow") / "mlruns").as_uri()


@pytest.fixture(scope="session")
def train_wandb_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("wandb")


@pytest.fixture(scope="session")
def straight_run(train_dataset, train_mlflow_uri, train_wandb_dir):
    """The reference run, trained once a session: 12 steps on 2 workers, uninterrupted (also logged
    to a file-store MLflow). tests/test_train.py reads it and compares other runs with it;
    tests/test_trust.py, which runs after it, plants pickles in a copy and resumes it. Also logged
    to W&B, offline. Returns
    (config, summary, metrics)."""
    from train_runs import straight_config

    from app.observe.metrics import load_metrics
    from app.storage import Store
    from app.train.launch import run_training

    cfg = straight_config()
    # MLflow 3 keeps its file store behind an opt-in; the runs here are throwaway. W&B offline:
    # its transaction logs land in WANDB_DIR, where tests/test_train.py reads them back.
    tracking = {"MLFLOW_TRACKING_URI": train_mlflow_uri, "MLFLOW_ALLOW_FILE_STORE": "true",
                "WANDB_MODE": "offline", "WANDB_PROJECT": "eft-tests", "WANDB_DIR": str(train_wandb_dir),
                "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}
    os.environ.update(tracking)
    try:
        summary = run_training(cfg)
    finally:
        for key in tracking:
            del os.environ[key]
    return cfg, summary, load_metrics(Store(), cfg.run_uri)


@pytest.fixture(scope="session")
def grpo_prompt_set(s3, ray_cluster):
    """GRPO's parity prompt set (tests/spot_runs.py), prepared once: (config, manifest)."""
    from spot_runs import prepare_grpo_prompts

    return prepare_grpo_prompts()


@pytest.fixture(scope="session")
def spot_scenarios(s3, ray_cluster, grpo_prompt_set, tmp_path_factory, run_scenario):
    """tests/scenarios/spot.py once, on one 3-node cluster of its own: the DPO run through a
    notice, a grow and a kill (tests/test_elastic.py), then GRPO's run through a spot node's life
    on the 2 nodes left (tests/test_grpo.py). Returns the process, each part's result file (each
    consumer checks its own) and the DPO dataset's manifest."""
    from spot_runs import DPO_BASE, DPO_DATA, build_dpo_pairs, grpo_spot_cfg

    manifest = build_dpo_pairs(tmp_path_factory.mktemp("raw"))
    work = tmp_path_factory.mktemp("spot")
    config_path = work / "grpo-spot.json"
    config_path.write_text(grpo_spot_cfg().model_dump_json())
    dpo, grpo = work / "dpo.json", work / "grpo.json"
    # GRPO's notice comes after step 3, with 12 s to its deadline.
    proc = run_scenario("spot", str(dpo), DPO_BASE, DPO_DATA, s3.endpoint, str(grpo), str(config_path), "3", "12",
                        timeout_s=1500)
    return {"proc": proc, "dpo": dpo, "grpo": grpo, "dpo_manifest": manifest}
