"""The embedded stack (`eft local up/down`) and the demo's core, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import boto3

from app.demo import run_demo
from app.storage import Store

ROOT = Path(__file__).resolve().parents[1]


def eft(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_local_up_seeds_serves_and_down_stops_only_its_own(tmp_path):
    import json

    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_ADDRESS"))}
    up = eft("local", "up", "--state-dir", str(tmp_path), "--num-cpus", "3", env=clean_env)
    assert up.returncode == 0, up.stderr
    exports = dict(line[len("export "):].split("=", 1) for line in up.stdout.splitlines()
                   if line.startswith("export "))
    assert {"AWS_ENDPOINT_URL", "RAY_ADDRESS"} <= exports.keys()
    state = json.loads((tmp_path / "local.json").read_text())
    try:
        s3 = boto3.client("s3", endpoint_url=exports["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="eft")["Contents"]}
        assert {"models/tiny-llama/config.json", "raw/pydoc.jsonl"} <= keys
        probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"],
                               capture_output=True, text=True, env={**clean_env, **exports}, timeout=120)
        assert probe.stdout.strip().splitlines()[-1] == "3.0", probe.stderr[-2000:]
        assert eft("local", "status", "--state-dir", str(tmp_path)).returncode == 0
    finally:
        down = eft("local", "down", "--state-dir", str(tmp_path))
    assert down.returncode == 0 and "stopped" in down.stdout
    deadline = time.monotonic() + 30
    while (alive(state["ray_pid"]) or alive(state["s3_pid"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(state["ray_pid"]) and not alive(state["s3_pid"])
    assert alive(bystander.pid)
    bystander.kill()
    assert eft("local", "status", "--state-dir", str(tmp_path)).returncode == 1


def test_demo_core_runs_end_to_end(s3, ray_cluster, capsys):
    """`make demo` minus the venv: corpus → tokenizer + base → prepare → LoRA/FSDP2 train →
    export → generate, on this session's S3 endpoint and Ray cluster; exit 0 needs falling loss."""
    assert run_demo(max_steps=12) == 0
    out = capsys.readouterr().out
    assert "train loss" in out and "sample:" in out
    store = Store()
    files = store.list_files("s3://eft/runs/tiny-cpu/export")
    assert any(f.endswith("adapter/adapter_model.safetensors") for f in files)
    assert any(f.endswith("merged/model.safetensors") for f in files)
    assert store.read_json("s3://eft/runs/tiny-cpu/summary.json")["steps"] == 12


def test_cli_config_prepare_and_export_on_the_demo_config(s3, ray_cluster):
    """The README's commands through the real console entry point (after the demo test ran,
    the corpus, base model and a finished tiny-cpu run are in the bucket)."""
    env = dict(os.environ)
    cfg_path = "jobs/configs/tiny-cpu.yaml"
    shown = eft("config", cfg_path, "--set", "training.max_steps=7", env=env)
    assert shown.returncode == 0 and "max_steps: 7" in shown.stdout and "secret" not in shown.stdout.lower()
    prepared = eft("prepare", cfg_path, "--set", "data.uri=s3://eft/data/cli-prepared", env=env)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert "train rows" in prepared.stdout
    again = eft("prepare", cfg_path, "--set", "data.uri=s3://eft/data/cli-prepared", env=env)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1].startswith("eft: error: dataset already prepared at")
    exported = eft("export", cfg_path, env=env)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert '"adapter_uri"' in exported.stdout
