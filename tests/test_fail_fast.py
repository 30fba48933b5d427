"""Commands a person waits on answer at once: a config error is one line before anything heavy is
imported, and `plan`, `status`, `report`, `export`, `serve` and `prepare`'s preflight give one line within
seconds when storage cannot be reached or the bucket name is one S3 cannot have. The long retry
budget (about 100 s of backoff) is for training, to ride out an outage; these commands use a short
one. A command that waited out the long budget would hit the subprocess timeout here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "transformers", "peft", "pyarrow")
# Long enough for a cold interpreter and a couple of short retries on a loaded box; far shorter
# than the training budget's ~100 s of backoff per request.
COMMAND_TIMEOUT_S = 60


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eft(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=COMMAND_TIMEOUT_S)


def job_file(tmp_path: Path, bucket: str, **extra) -> Path:
    tree = {"name": "fail-fast", "model": {"uri": f"s3://{bucket}/models/m"}, "data": {"uri": f"s3://{bucket}/data/d"},
            "prepare": {"input_uri": f"s3://{bucket}/raw/r.jsonl"}, "training": {"max_steps": 1},
            "storage": {"root_uri": f"s3://{bucket}/runs"}, **extra}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def unreachable_env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}
    return {**env, "HOME": str(tmp_path), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "RAY_ADDRESS": "127.0.0.1:1"}


@pytest.mark.parametrize("command", ["config", "train", "prepare", "export", "plan", "manifests", "serve"])
def test_a_config_error_is_one_line_before_any_heavy_import(command, tmp_path):
    """Each command validates the config first: the error comes back before torch, Ray,
    transformers, PEFT or pyarrow is imported (those imports are what took 3-4 s)."""
    bad = job_file(tmp_path, "eft", training={"max_steps": 1, "lr_typo": 1})
    extra = ["--out", str(tmp_path / "out")] if command == "manifests" else []
    probe = ("import sys, runpy\n"
             "sys.argv = ['eft', *sys.argv[1:]]\n"
             "from app.cli import main\n"
             "code = main(sys.argv[1:])\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
             "sys.exit(code)\n")
    out = subprocess.run([sys.executable, "-c", probe, command, str(bad), *extra], capture_output=True, text=True,
                         cwd=ROOT, timeout=COMMAND_TIMEOUT_S)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"eft: error: {bad}: training.lr_typo: unknown key"]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("command", [["plan", "{job}"], ["status", "s3://{bucket}/runs/fail-fast"],
                                     ["report", "s3://{bucket}/runs/fail-fast"], ["export", "{job}"],
                                     ["prepare", "{job}"], ["serve", "{job}"],
                                     ["manifests", "{job}", "--serve", "--overlay", "base", "--out", "{out}"]])
def test_a_bucket_name_s3_cannot_have_is_one_line(command, tmp_path):
    """`YOUR-BUCKET`, as the reference configs ship it: refused before any request is sent (the
    endpoint here is a closed port, so a request would be another error)."""
    job = job_file(tmp_path, "YOUR-BUCKET")
    args = [a.format(job=job, bucket="YOUR-BUCKET", out=tmp_path / "out") for a in command]
    out = eft(*args, env=unreachable_env(tmp_path))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("eft: error: s3://YOUR-BUCKET/") and \
        "'YOUR-BUCKET' is not a valid S3 bucket name" in lines[0], lines[0]


@pytest.mark.parametrize("command", [["plan", "{job}"], ["status", "s3://{bucket}/runs/fail-fast"],
                                     ["report", "s3://{bucket}/runs/fail-fast"], ["export", "{job}"],
                                     ["prepare", "{job}"], ["serve", "{job}"],
                                     ["manifests", "{job}", "--serve", "--overlay", "base", "--out", "{out}"]])
def test_an_unreachable_endpoint_is_one_line_in_seconds(command, tmp_path):
    env = unreachable_env(tmp_path)
    job = job_file(tmp_path, "my-bucket")
    out = eft(*[a.format(job=job, bucket="my-bucket", out=tmp_path / "out") for a in command], env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"eft: error: cannot reach S3 endpoint {env['AWS_ENDPOINT_URL']} (for s3://my-bucket/"), \
        lines[0]


def test_plan_needs_only_a_config_json(tmp_path):
    """No weights, no bucket: a directory holding config.json is enough to plan (the reference
    jobs plan from jobs/models/, see tests/test_plan.py)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "jobs" / "models" / "Meta-Llama-3-8B" / "config.json").read_text())
    out = eft("plan", "jobs/configs/llama3-8b-lora.yaml", "--json", "--set", f"model.uri={model}",
              env=unreachable_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choice"] == "ddp"
