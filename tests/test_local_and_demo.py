"""The embedded stack (`eft local up/down`) and `make demo`, as a new user runs them: a shell
with no AWS or Ray variables and an empty home directory."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3

from app.config import load_config
from app.dev.demo import TEXT_CONFIG, ensure_inputs
from app.storage import Store, join

ROOT = Path(__file__).resolve().parents[1]
EFT = str(Path(sys.executable).with_name("eft"))  # the console script `make demo` runs


def eft(*args, env=None, timeout=240, cwd=ROOT):
    return subprocess.run([EFT, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def fresh_shell(home: Path) -> dict:
    """This process's environment as a new user's shell has it: no AWS or Ray settings (the
    test session's own S3 endpoint and Ray token live there), and an empty home."""
    home.mkdir(parents=True, exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}, "HOME": str(home)}


def exports_of(stdout: str) -> dict:
    return dict(line[len("export "):].split("=", 1) for line in stdout.splitlines() if line.startswith("export "))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_dead(*pids: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)


def test_local_up_on_a_fresh_home_requires_its_token_and_down_stops_only_its_own(tmp_path, base_cache):
    home, state_dir = tmp_path / "home", tmp_path / "state"
    shell = fresh_shell(home)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    up = eft("local", "up", "--state-dir", str(state_dir), "--num-cpus", "3", "--cache-dir", str(base_cache),
             env=shell, timeout=600)
    assert up.returncode == 0, up.stderr
    exports = exports_of(up.stdout)
    state = json.loads((state_dir / "local.json").read_text())
    try:
        token = Path(exports["RAY_AUTH_TOKEN_PATH"])
        assert exports["RAY_AUTH_MODE"] == "token" and token == state_dir / "auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) >= 32
        assert token.read_text() not in up.stdout + up.stderr + (state_dir / "local.json").read_text()
        s3 = boto3.client("s3", endpoint_url=exports["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"])
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="eft")["Contents"]}
        assert {"models/tiny-llama/config.json", "raw/pydoc.jsonl", "models/tiny-llama-chat/config.json",
                "models/tiny-llama-chat/pretrain.json", "raw/pydoc-chat.jsonl"} <= keys
        user = {**shell, **exports}
        probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"],
                               capture_output=True, text=True, env=user, timeout=120)
        assert probe.stdout.strip().splitlines()[-1] == "3.0", probe.stderr[-2000:]
        assert eft("local", "status", "--state-dir", str(state_dir), env=shell).returncode == 0
        assert exports_of(eft("local", "env", "--state-dir", str(state_dir), env=shell).stdout) == exports

        # A client that lacks the token, or holds another one, is refused; the user reads one line.
        cfg = "jobs/configs/tiny-cpu.yaml"
        assert eft("prepare", cfg, env=user).returncode == 0
        no_token = eft("train", cfg, env={k: v for k, v in user.items() if k != "RAY_AUTH_TOKEN_PATH"})
        assert no_token.returncode == 1 and "Traceback" not in no_token.stderr
        assert no_token.stderr.strip().splitlines()[-1].startswith(
            "eft: error: Token authentication is enabled but no authentication token was found"), no_token.stderr
        (tmp_path / "other_token").write_text(uuid.uuid4().hex * 2)
        wrong = eft("train", cfg, env={**user, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "other_token")})
        assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
        assert wrong.stderr.strip().splitlines()[-1].startswith(
            f"eft: error: RAY_ADDRESS={exports['RAY_ADDRESS']}: Failed to connect"), wrong.stderr
        assert "RAY_AUTH_TOKEN_PATH" in wrong.stderr.strip().splitlines()[-1]
        assert not s3.list_objects_v2(Bucket="eft", Prefix="runs/").get("Contents"), "refused run wrote objects"
    finally:
        down = eft("local", "down", "--state-dir", str(state_dir), env=shell)
    assert down.returncode == 0 and "stopped" in down.stdout
    wait_dead(state["ray_pid"], state["s3_pid"])
    assert not alive(state["ray_pid"]) and not alive(state["s3_pid"])
    assert alive(bystander.pid)
    bystander.kill()
    assert eft("local", "status", "--state-dir", str(state_dir), env=shell).returncode == 1
    assert not (home / ".ray").exists()


def test_local_down_leaves_a_recycled_pid_alone(tmp_path):
    """`eft local down` signals a recorded PID only while its process started when recorded: a PID
    reused by someone else's process since (here a `sleep`, leader of its own process group as
    the stack's processes are) survives, with a warning naming it; the stack's own goes."""
    import psutil

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    ours = subprocess.Popen(["sleep", "120"], start_new_session=True)
    # Reaped the moment it dies, as the stack's orphaned processes are by init.
    reaper = threading.Thread(target=ours.wait, daemon=True)
    reaper.start()
    try:
        (state_dir / "local.json").write_text(json.dumps({
            # The PID's first owner started an hour before the process that holds it now.
            "s3_pid": stranger.pid, "s3_started_at": psutil.Process(stranger.pid).create_time() - 3600.0,
            "ray_pid": ours.pid, "ray_started_at": psutil.Process(ours.pid).create_time(),
            "s3_endpoint": "http://127.0.0.1:1", "bucket": "eft", "ray_address": "127.0.0.1:1",
            "auth_token_path": str(state_dir / "auth_token")}))
        # This checkout's command line (the console script may belong to another install).
        cli = [sys.executable, "-m", "app.cli", "local"]
        shell = fresh_shell(tmp_path / "home")
        status = subprocess.run([*cli, "status", "--state-dir", str(state_dir)], capture_output=True, text=True,
                                cwd=ROOT, env=shell, timeout=120)
        assert status.returncode == 1 and json.loads(status.stdout)["s3_alive"] is False, status.stdout
        down = subprocess.run([*cli, "down", "--state-dir", str(state_dir)], capture_output=True, text=True,
                              cwd=ROOT, env=shell, timeout=120)
        assert down.returncode == 0, down.stderr
        assert f"PID {stranger.pid} (the stack's s3) is now another process" in down.stderr
        reaper.join(timeout=30)
        assert ours.returncode is not None  # the stack's own process was stopped
        assert stranger.poll() is None and alive(stranger.pid)
        assert not (state_dir / "local.json").exists()
    finally:
        for proc in (stranger, ours):
            proc.kill()
        stranger.wait()


def test_local_up_uses_the_token_it_is_given(tmp_path):
    shell = fresh_shell(tmp_path / "home")
    given = tmp_path / "my_token"
    given.write_text(uuid.uuid4().hex * 2)
    up = eft("local", "up", "--state-dir", str(tmp_path / "state"), "--no-seed", "--num-cpus", "2",
             "--auth-token-path", str(given), env=shell)
    try:
        assert up.returncode == 0, up.stderr
        exports = exports_of(up.stdout)
        assert exports["RAY_AUTH_TOKEN_PATH"] == str(given) and not (tmp_path / "state" / "auth_token").exists()
        probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(); print('joined')"], capture_output=True,
                               text=True, env={**shell, **exports}, timeout=120)
        assert probe.stdout.strip().splitlines()[-1] == "joined", probe.stderr[-2000:]
    finally:
        eft("local", "down", "--state-dir", str(tmp_path / "state"), env=shell)
    missing = eft("local", "up", "--state-dir", str(tmp_path / "state2"), "--auth-token-path",
                  str(tmp_path / "nope"), env=shell)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"eft: error: --auth-token-path: {tmp_path / 'nope'}: no token in that file"]
    assert not (tmp_path / "state2" / "local.json").exists()


def test_make_demo_runs_end_to_end_on_a_fresh_home(tmp_path):
    """What `make demo` runs (`.venv/bin/eft demo`), from a shell with nothing set up: the demo
    starts its own stack in ./.eft, seeds the pre-trained chat base, previews one conversation,
    fine-tunes, exports, asks the exported model a question through its chat template, and stops
    the stack."""
    home = tmp_path / "home"
    demo = eft("demo", "--max-steps", "12", env=fresh_shell(home), cwd=tmp_path, timeout=900)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    out = demo.stdout
    assert re.search(r"^exported: (s3://eft/runs/tiny-chat/export/checkpoint-00000012)/adapter \(adapter\), "
                     r"\1/merged \(merged\)$", out, re.MULTILINE), out[-3000:]
    # The base writes words: its held-out loss is far below a uniform guess over the vocabulary.
    before, after, uniform = map(float, re.search(
        r"^base: +pre-trained 300 steps in \d+ s \((?:trained|disk cache|bucket)\): held-out loss (\S+) → (\S+) "
        r"\(uniform (\S+)\)$", out, re.MULTILINE).groups())
    assert abs(before - uniform) < 0.1 and after < uniform - 2.0, out[-3000:]
    # One conversation previewed as training sees it: the ChatML rendering of the first record.
    assert "<|im_start|>user\nWhat is the \"assert\" statement?<|im_end|>" in out
    assert "1 record(s): 1 used" in out
    assert re.search(r"^question: 'What is the \"assert\" statement\?'$", out, re.MULTILINE)
    answer = re.search(r"^answer: +(.+)$", out, re.MULTILINE).group(1)
    assert len(answer) > 10, answer
    first, final = map(float, re.search(r"^train loss (\S+) → (\S+) over 12 steps$", out, re.MULTILINE).groups())
    assert final < first
    assert not (home / ".ray").exists()
    # The stack it started is gone: no state left, no process of it alive.
    assert not (tmp_path / ".eft" / "local.json").exists()
    ray_log = (tmp_path / ".eft" / "ray.log").read_text()
    assert "Ray runtime started" in ray_log


def test_cli_config_prepare_train_and_export(s3, ray_cluster, tmp_path):
    """The README's step-by-step commands through the console entry point, against this
    session's S3 endpoint and Ray cluster (the token is in the session's environment)."""
    run_id = uuid.uuid4().hex[:6]
    cfg_path = "jobs/configs/tiny-cpu.yaml"
    sets = ["--set", f"name=cli-{run_id}", "--set", f"data.uri=s3://eft/data/cli-{run_id}",
            "--set", "training.max_steps=2", "--set", "checkpoint.save_every_steps=2",
            "--set", "training.eval_every_steps=2"]
    ensure_inputs(load_config(TEXT_CONFIG), Store())
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}

    shown = eft("config", cfg_path, *sets, env=env)
    assert shown.returncode == 0 and "max_steps: 2" in shown.stdout and f"name: cli-{run_id}" in shown.stdout
    assert "secret" not in shown.stdout.lower()
    prepared = eft("prepare", cfg_path, *sets, env=env)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert f"prepared s3://eft/data/cli-{run_id}:" in prepared.stdout and "train rows" in prepared.stdout
    again = eft("prepare", cfg_path, *sets, env=env)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1].startswith("eft: error: dataset already prepared at")

    trained = eft("train", cfg_path, *sets, env=env, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_uri = f"s3://eft/runs/cli-{run_id}"
    assert Store().read_json(join(run_uri, "summary.json"))["steps"] == 2
    exported = eft("export", cfg_path, *sets, env=env)
    assert exported.returncode == 0, exported.stderr[-2000:]
    out = json.loads(exported.stdout)
    assert out["export_uri"] == join(run_uri, "export", "checkpoint-00000002")
    assert out["adapter_uri"] == join(out["export_uri"], "adapter")
    assert Store().exists(join(out["adapter_uri"], "adapter_model.safetensors"))
