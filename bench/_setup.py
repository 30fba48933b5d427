"""Shared by the throughput benchmarks (overhead, checkpoint_cost, prepare_throughput, ingest):
the local S3 endpoint, the bench model (bigger than the tests' tiny one, so compute dominates),
job configs, reading a run's records, medians, and the machine load.

Nothing here is a benchmark itself; see bench/README.md.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PYTHON = sys.executable
VENV_BIN = Path(sys.executable).parent

# Bigger than the tests' tiny Llama (hidden 64, 2 layers, seq 64-128) so that the step is
# dominated by compute, small enough that a 30-step run takes seconds on 2 cores.
BENCH_MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 688,
               "max_positions": 512, "initializer_range": 0.02}
BENCH_SEQ_LEN = 256
BENCH_LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}

MODEL_URI = "s3://eft/models/bench-model"
RAW_URI = "s3://eft/raw/bench.jsonl"
DATA_URI = "s3://eft/data/bench"
RUNS_URI = "s3://eft/bench-runs"


# -- the local stack ----------------------------------------------------------------------

@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """moto's S3 server on a free loopback port; this process's env (and so every child's)
    points boto3/pyarrow at it. Yields the endpoint."""
    from app.dev import local

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with local.serve_s3() as server:
        yield server.endpoint


@contextlib.contextmanager
def bench_session(tree: dict, texts: Optional[list[str]] = None):
    """The local S3 endpoint seeded with the bench model and corpus, a local Ray cluster, and
    the job's dataset prepared; yields (store, manifest), and stops Ray at the end."""
    from app.storage import Store

    with local_s3():
        store = Store()
        seed_model_and_corpus(store, texts if texts is not None else bench_texts())
        start_ray()
        try:
            yield store, prepare(build_job(tree), store)
        finally:
            stop_ray()


def start_ray(num_cpus: int = 8) -> None:
    """A local Ray cluster like the tests' (more logical CPUs than cores, so Ray Data has
    slots beside the training workers). Workers inherit this process's env."""
    import ray

    from app.cluster import require_token_auth

    if not ray.is_initialized():
        require_token_auth()
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


# -- inputs -------------------------------------------------------------------------------

def bench_texts(repeat: int = 1) -> list[str]:
    """The pydoc corpus (754 paragraphs, ~290 kB), repeated `repeat` times."""
    from app.dev.tiny import build_corpus

    return build_corpus() * repeat


def seed_model_and_corpus(store, texts: list[str], model_uri: str = MODEL_URI, raw_uri: str = RAW_URI,
                          model: Optional[dict] = None) -> None:
    """BPE tokenizer + random-init Llama (BENCH_MODEL) at model_uri, texts as JSONL at raw_uri."""
    from app.dev.tiny import build_corpus, save_tiny_base, write_jsonl

    # The tokenizer is trained on the plain corpus: repeats would change nothing but the time.
    save_tiny_base(store, model_uri, texts=build_corpus(), **(model or BENCH_MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        raw = write_jsonl(({"text": t} for t in texts), Path(tmp) / "corpus.jsonl")
        store.write_bytes(raw_uri, raw.read_bytes())


def job_tree(name: str, **sections) -> dict:
    """A job config tree for the bench model: 2 x 1-CPU workers, LoRA + FSDP2, global batch 8 =
    2 workers x micro 2 x accum 2, constant LR, a log line every step. `sections` override
    whole keys of a section (`training={"max_steps": 30}` merges into training)."""
    tree = {
        "name": name, "model": {"uri": MODEL_URI},
        "lora": dict(BENCH_LORA),
        "data": {"uri": DATA_URI, "seq_len": BENCH_SEQ_LEN},
        "prepare": {"input_uri": RAW_URI},
        "training": {"max_steps": 30, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-3,
                     "schedule": "constant", "log_every_steps": 1, "seed": 0},
        "checkpoint": {"save_every_steps": 1000, "num_to_keep": 2, "async_upload": True},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": RUNS_URI},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **value}
        else:
            tree[key] = value
    return tree


def build_job(tree: dict):
    from app.config import build_config

    return build_config(tree)


def write_job_yaml(tree: dict, path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def prepare(cfg, store) -> dict:
    """`eft prepare` in-process; the ray engine gets a Ray cluster started (and stopped) around it."""
    import ray

    from app.data.engines import choose_engine, list_input_files
    from app.data.prepare import prepare_dataset

    started_here = False
    inputs = list_input_files(store, cfg.prepare.input_uri, cfg.prepare.input_format)
    if choose_engine(cfg, inputs) == "ray" and not ray.is_initialized():
        start_ray()
        started_here = True
    try:
        return prepare_dataset(cfg, store)
    finally:
        if started_here:
            stop_ray()


# -- a run's records ----------------------------------------------------------------------

def run_records(store, run_uri: str) -> dict:
    """metrics.jsonl lines, events and heartbeats of a run."""
    from app.observe.metrics import load_metrics
    from app.observe.records import load_events, load_heartbeats

    return {"metrics": load_metrics(store, run_uri), "events": load_events(store, run_uri),
            "heartbeats": load_heartbeats(store, run_uri)}


def second_half(values: list) -> list:
    return values[len(values) // 2:]


def median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def steady(records: list[dict], key: str) -> Optional[float]:
    """Median of `key` over the second half of the records (steady state)."""
    return median(r.get(key) for r in second_half(records))


# -- processes and the machine ---------------------------------------------------------------

def child_env(threads: Optional[int] = None, **extra) -> dict:
    """This process's env (S3 endpoint included), with OMP_NUM_THREADS pinned or removed."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if threads is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_logged(cmd: list[str], env: dict, log_path: Path, timeout_s: float = 600) -> tuple[float, float]:
    """Run `cmd` with output to `log_path`; returns (wall-clock start, seconds it took).
    Raises with the log's tail if it fails."""
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              cwd=ROOT, timeout=timeout_s)
    took = time.time() - started
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; log tail:\n{tail}")
    return started, took


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def load_note(before: tuple, after: tuple) -> str:
    cpus = os.cpu_count() or 1
    note = (f"Load average (1/5/15 min) before: {before[0]:.1f}/{before[1]:.1f}/{before[2]:.1f}, "
            f"after: {after[0]:.1f}/{after[1]:.1f}/{after[2]:.1f} on {cpus} CPUs (a run of this benchmark alone "
            f"keeps it at about 2-5 on 2 CPUs)")
    if before[0] > 1.5 * cpus or after[0] > 4 * cpus:
        note += (" — **the machine was loaded by other work**: absolute rates are low and noisy; the "
                 "interleaved side-by-side ratios are the numbers to read")
    return note + "."


def fmt(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"
