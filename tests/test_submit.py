"""`ray job submit` with the real Ray Jobs CLI to a real `ray start --head` (the local stack):
the README's command runs prepare + train, and a bad config reaches `ray job logs` readably."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
EXCLUDES = json.dumps({"excludes": [".venv", ".eft", ".git", "bench", "notebooks", "kuberay"]})


def run(cmd, env, timeout=600):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def submit(env, *entrypoint: str, submission_id: str):
    cmd = [RAY, "job", "submit", "--address", env["RAY_API_SERVER_ADDRESS"], "--working-dir", ".",
           "--submission-id", submission_id, "--runtime-env-json", EXCLUDES, "--", *entrypoint]
    for _ in range(10):
        out = run(cmd, env)
        # The head's job agent can lag the dashboard by a moment; Ray says to try again.
        if "No available agent to submit job" not in out.stdout + out.stderr:
            return out
        time.sleep(3)
    return out


def job_status(env, submission_id: str) -> str:
    """The job's status through Ray's SDK, in a process that has the stack's env (token auth)."""
    probe = ("import sys; from ray.job_submission import JobSubmissionClient; "
             "print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    out = run([sys.executable, "-c", probe, env["RAY_API_SERVER_ADDRESS"], submission_id], env)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]


def test_ray_job_submit_trains_and_reports_errors(tmp_path, base_cache):
    # A new user's shell: no AWS or Ray settings (the session's token among them), an empty home.
    (tmp_path / "home").mkdir()
    clean = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))},
             "HOME": str(tmp_path / "home")}
    up = run([sys.executable, "-m", "app.cli", "local", "up", "--state-dir", str(tmp_path / "stack"),
              "--cache-dir", str(base_cache)], clean)
    assert up.returncode == 0, up.stderr[-2000:]
    env = {**clean, **dict(line[len("export "):].split("=", 1) for line in up.stdout.splitlines()
                           if line.startswith("export "))}
    try:
        eft = [sys.executable, "-m", "app.cli"]
        cfg = "jobs/configs/tiny-cpu.yaml"
        good = f"eft-test-{uuid.uuid4().hex[:6]}"
        entry = " ".join(eft + ["prepare", cfg]) + " && " + " ".join(eft + ["train", cfg, "--set",
                                                                           "training.max_steps=4"])
        done = submit(env, "bash", "-c", entry, submission_id=good)
        assert job_status(env, good) == "SUCCEEDED", done.stdout[-3000:] + done.stderr[-3000:]
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        summary = json.loads(s3.get_object(Bucket="eft", Key="runs/tiny-cpu/summary.json")["Body"].read())
        assert summary["status"] == "succeeded" and summary["steps"] == 4

        bad = f"eft-bad-{uuid.uuid4().hex[:6]}"
        submit(env, *eft, "train", cfg, "--set", "training.lr_typo=1", submission_id=bad)
        assert job_status(env, bad) == "FAILED"
        logs = run([RAY, "job", "logs", "--address", env["RAY_API_SERVER_ADDRESS"], bad], env).stdout
        assert f"eft: error: {cfg}: training.lr_typo: unknown key" in logs
        assert "Traceback" not in logs

        # The Jobs API wants the token too: the same CLI, from a shell without the token
        # settings, is refused by the head.
        tokenless = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")}
        listed = run([RAY, "job", "list", "--address", env["RAY_API_SERVER_ADDRESS"]], tokenless, timeout=120)
        assert listed.returncode != 0 and good not in listed.stdout
        assert "Unauthorized: Missing authentication token" in listed.stdout + listed.stderr
    finally:
        run([sys.executable, "-m", "app.cli", "local", "down", "--state-dir", str(tmp_path / "stack")], clean)
    assert not (tmp_path / "home" / ".ray").exists()
