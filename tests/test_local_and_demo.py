"""The embedded stack (`eft local up/down`), `ray job submit` to it, and `make demo`, as a new user
runs them: a shell with no AWS or Ray variables and an empty home directory."""

from __future__ import annotations

import ast
import json
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import pytest
from conftest import fresh_shell_env

from app.cluster import find_free_port
from app.storage import join

ROOT = Path(__file__).resolve().parents[1]
EFT = str(Path(sys.executable).with_name("eft"))  # the console script `make demo` runs
RAY = str(Path(sys.executable).with_name("ray"))
SUBMIT_EXCLUDES = json.dumps({"excludes": [".venv", ".eft", ".git", "bench", "notebooks", "kuberay"]})
# Ray's C++ log lines at error or fatal level: `[2026-12-02 08:59:46,266 E 18699 18699] core_worker.cc...`
RAY_ERROR_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,]+ [EF] \d+ \d+\]")


def eft(*args, env=None, timeout=240, cwd=ROOT):
    return subprocess.run([EFT, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def exports_of(stdout: str) -> dict:
    return dict(line[len("export "):].split("=", 1) for line in stdout.splitlines() if line.startswith("export "))


def alive(pid: int) -> bool:
    """Running: a zombie waiting for its (re)parent to reap it has stopped."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_dead(*pids: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def user_stack(new_user_shell, base_cache, tmp_path_factory):
    """`eft local up` from a new user's shell (no AWS or Ray settings, an empty home), with a token
    file of the user's own (`--auth-token-path`; the demo below covers the token `up` writes),
    beside a bystander process of the same user. The tests below use it in file order: look at
    it, be refused by it, submit jobs to it, and last take it down. It seeds the chat base that
    ships with eft (app/dev/tiny_chat_base/): nothing is pre-trained."""
    work = tmp_path_factory.mktemp("user-stack")
    home, state_dir, given = work / "home", work / "state", work / "my_token"
    shell = new_user_shell(home)
    given.write_text(uuid.uuid4().hex * 2)
    bystander = subprocess.Popen(["sleep", "900"], start_new_session=True)
    up = eft("local", "up", "--state-dir", str(state_dir), "--num-cpus", "3", "--cache-dir", str(base_cache),
             "--auth-token-path", str(given), env=shell, timeout=600)
    assert up.returncode == 0, up.stderr
    stack = {"work": work, "home": home, "state_dir": state_dir, "shell": shell, "up": up, "token": given,
             "exports": exports_of(up.stdout), "state": json.loads((state_dir / "local.json").read_text()),
             "bystander": bystander}
    stack["user"] = {**shell, **stack["exports"]}
    yield stack
    eft("local", "down", "--state-dir", str(state_dir), env=shell)  # a no-op once the last test took it down
    bystander.kill()


def stack_s3(stack: dict):
    exports = stack["exports"]
    return boto3.client("s3", endpoint_url=exports["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"])


def test_local_up_on_a_fresh_home_uses_the_given_token_and_seeds_the_bucket(user_stack):
    up, exports, state_dir = user_stack["up"], user_stack["exports"], user_stack["state_dir"]
    assert exports["RAY_AUTH_MODE"] == "token" and exports["RAY_AUTH_TOKEN_PATH"] == str(user_stack["token"])
    assert not (state_dir / "auth_token").exists()
    assert user_stack["token"].read_text() not in up.stdout + up.stderr + (state_dir / "local.json").read_text()
    keys = {o["Key"] for o in stack_s3(user_stack).list_objects_v2(Bucket="eft")["Contents"]}
    assert {"models/tiny-llama/config.json", "raw/pydoc.jsonl", "models/tiny-llama-chat/config.json",
            "models/tiny-llama-chat/pretrain.json", "raw/pydoc-chat.jsonl"} <= keys
    probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"],
                           capture_output=True, text=True, env=user_stack["user"], timeout=120)
    assert probe.stdout.strip().splitlines()[-1] == "3.0", probe.stderr[-2000:]
    shell = user_stack["shell"]
    assert eft("local", "status", "--state-dir", str(state_dir), env=shell).returncode == 0
    assert exports_of(eft("local", "env", "--state-dir", str(state_dir), env=shell).stdout) == exports


README_RUN = f"cli-{uuid.uuid4().hex[:6]}"
README_SETS = ["--set", f"name={README_RUN}", "--set", f"data.uri=s3://eft/data/{README_RUN}"]


def test_the_readmes_steps_through_the_console_script(user_stack):
    """The README's step-by-step commands (`config`, `prepare`, `train`, `export`, `serve`) through
    the console entry point, as the user runs them against the stack."""
    user, cfg_path = user_stack["user"], "jobs/configs/tiny-cpu.yaml"
    # One worker: what these steps check is the commands, not the sharding (`make demo`'s run on
    # its own stack, below, trains on the config's two).
    sets = [*README_SETS, "--set", "training.max_steps=2", "--set", "checkpoint.save_every_steps=2",
            "--set", "training.eval_every_steps=2", "--set", "scaling.min_workers=1", "--set", "scaling.max_workers=1"]
    shown = eft("config", cfg_path, *sets, env=user)
    assert shown.returncode == 0 and "max_steps: 2" in shown.stdout and f"name: {README_RUN}" in shown.stdout
    assert "secret" not in shown.stdout.lower()
    prepared = eft("prepare", cfg_path, *sets, env=user)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert f"prepared s3://eft/data/{README_RUN}:" in prepared.stdout and "train rows" in prepared.stdout
    # The same prepare again (a pipeline re-run): nothing to do, exit 0; another setting is refused.
    again = eft("prepare", cfg_path, *sets, env=user)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.startswith(f"already prepared s3://eft/data/{README_RUN}:")
    assert again.stdout.rstrip().endswith("; nothing to do")
    other = eft("prepare", cfg_path, *sets, "--set", "prepare.rows_per_shard=7", env=user)
    assert other.returncode == 1
    assert other.stderr.strip().splitlines()[-1].startswith(
        f"eft: error: dataset already prepared at s3://eft/data/{README_RUN} from another recipe: "
        f"prepare.rows_per_shard "), other.stderr[-2000:]

    # One driver per run: a second `eft train` of the same run is refused in one line while the
    # first holds its lease, before Ray starts; one with --wait, submitted with the README's
    # `ray job submit` as a RayJob's retry would be, starts when the first is done and resumes
    # from its last checkpoint.
    run_uri, work = f"s3://eft/runs/{README_RUN}", user_stack["work"]
    with open(work / "first.out", "w") as out, open(work / "first.err", "w") as err:
        first = subprocess.Popen([EFT, "train", cfg_path, *sets], stdout=out, stderr=err, cwd=ROOT, env=user)
    deadline = time.monotonic() + 240
    while first.poll() is None and time.monotonic() < deadline and not stack_s3(user_stack).list_objects_v2(
            Bucket="eft", Prefix=f"runs/{README_RUN}/_lease.json").get("Contents"):
        time.sleep(0.2)
    second = eft("train", cfg_path, *sets, env=user)
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(f"eft: error: run {run_uri}: held by eft train (pid {first.pid} on "), line
    assert " until " in line and "epoch 1 (lease " in line, line
    assert "Connecting to existing Ray cluster" not in second.stderr  # refused before Ray
    four = ["--set", "training.max_steps=4", "--set", "checkpoint.save_every_steps=2"]
    waiter_id, waited = f"eft-wait-{uuid.uuid4().hex[:6]}", {}
    waiter = threading.Thread(target=lambda: waited.update(out=submit(
        user_stack, sys.executable, "-m", "app.cli", "train", cfg_path, *sets, *four, "--wait", "--wait-timeout-s",
        "300", submission_id=waiter_id)))
    waiter.start()
    assert first.wait(timeout=600) == 0, (work / "first.err").read_text()[-3000:]
    waiter.join(timeout=600)
    assert job_status(user_stack, waiter_id) == "SUCCEEDED", waited["out"].stdout[-3000:] + waited["out"].stderr[-3000:]
    summary = json.loads(stack_s3(user_stack).get_object(Bucket="eft", Key=f"runs/{README_RUN}/summary.json")["Body"]
                         .read())
    assert summary["steps"] == 4 and summary["resumed_from_steps"] == [2] and summary["lease_epoch"] == 2
    events = [json.loads(stack_s3(user_stack).get_object(Bucket="eft", Key=o["Key"])["Body"].read())
              for o in stack_s3(user_stack).list_objects_v2(Bucket="eft", Prefix=f"runs/{README_RUN}/events/")
              ["Contents"]]
    assert sorted(e["lease_epoch"] for e in events if e["kind"] == "driver_start") == [1, 2]
    exported = eft("export", cfg_path, *sets, env=user)
    assert exported.returncode == 0, exported.stderr[-2000:]
    out = json.loads(exported.stdout)
    assert out["export_uri"] == join(run_uri, "export", "checkpoint-00000004")
    assert out["adapter_uri"] == join(out["export_uri"], "adapter")
    key = out["adapter_uri"].removeprefix("s3://eft/") + "/adapter_model.safetensors"
    assert stack_s3(user_stack).head_object(Bucket="eft", Key=key)["ContentLength"] > 0

    # `eft serve` as the README runs it: in the foreground on the stack's Ray, asked through the
    # openai client, then stopped with Ctrl-C, which deletes the application and exits 0.
    import openai

    port = find_free_port()
    with open(work / "serve.out", "w") as out, open(work / "serve.err", "w") as err:
        serving = subprocess.Popen([EFT, "serve", cfg_path, *sets, "--port", str(port)], stdout=out, stderr=err,
                                   cwd=ROOT, env=user)
    try:
        deadline = time.monotonic() + 240
        while "# serving until Ctrl-C" not in (work / "serve.out").read_text():
            assert serving.poll() is None and time.monotonic() < deadline, (work / "serve.err").read_text()[-3000:]
            time.sleep(0.5)
        assert f"url:   http://127.0.0.1:{port}/v1" in (work / "serve.out").read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == [README_RUN]
        reply = client.completions.create(model=README_RUN, prompt="The list", max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 4
    finally:
        serving.send_signal(signal.SIGINT)
        code = serving.wait(timeout=120)
    assert code == 0, (work / "serve.err").read_text()[-3000:]


def test_a_client_without_the_stacks_token_is_refused_in_one_line(user_stack):
    """A client that lacks the token, or holds another one, is refused; the user reads one line,
    and the refused run writes nothing (it trains on the dataset the steps above prepared)."""
    user, exports = user_stack["user"], user_stack["exports"]
    cfg = ["jobs/configs/tiny-cpu.yaml", "--set", "name=refused", "--set", f"data.uri=s3://eft/data/{README_RUN}"]
    no_token = eft("train", *cfg, env={k: v for k, v in user.items() if k != "RAY_AUTH_TOKEN_PATH"})
    assert no_token.returncode == 1 and "Traceback" not in no_token.stderr
    assert no_token.stderr.strip().splitlines()[-1].startswith(
        "eft: error: Token authentication is enabled but no authentication token was found"), no_token.stderr
    other_token = user_stack["work"] / "other_token"
    other_token.write_text(uuid.uuid4().hex * 2)
    # Ray retries a refused connect once a second for 20 s by default; its documented operator
    # budget for that window keeps the test to the same refusal in a few seconds.
    wrong = eft("train", *cfg, env={**user, "RAY_AUTH_TOKEN_PATH": str(other_token),
                                    "RAY_gcs_server_port_wait_time_s": "3"})
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert wrong.stderr.strip().splitlines()[-1].startswith(
        f"eft: error: RAY_ADDRESS={exports['RAY_ADDRESS']}: Failed to connect"), wrong.stderr
    assert "RAY_AUTH_TOKEN_PATH" in wrong.stderr.strip().splitlines()[-1]
    assert not stack_s3(user_stack).list_objects_v2(Bucket="eft", Prefix="runs/refused/").get("Contents"), \
        "refused run wrote objects"


def ray_job(stack: dict, *args: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "job", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env or stack["user"])


def submit(stack: dict, *entrypoint: str, submission_id: str) -> subprocess.CompletedProcess:
    args = ["submit", "--address", stack["exports"]["RAY_API_SERVER_ADDRESS"], "--working-dir", ".",
            "--submission-id", submission_id, "--runtime-env-json", SUBMIT_EXCLUDES, "--", *entrypoint]
    for _ in range(10):
        out = ray_job(stack, *args)
        # The head's job agent can lag the dashboard by a moment; Ray says to try again.
        if "No available agent to submit job" not in out.stdout + out.stderr:
            return out
        time.sleep(3)
    return out


def job_status(stack: dict, submission_id: str) -> str:
    """The job's status through Ray's SDK, in a process that has the stack's env (token auth)."""
    probe = ("import sys; from ray.job_submission import JobSubmissionClient; "
             "print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    out = subprocess.run([sys.executable, "-c", probe, stack["exports"]["RAY_API_SERVER_ADDRESS"], submission_id],
                         capture_output=True, text=True, cwd=ROOT, env=stack["user"], timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]


def test_ray_job_submit_reports_errors_and_wants_the_token(user_stack):
    """`ray job submit` with the real Ray Jobs CLI to the stack's `ray start --head` (the README's
    steps above trained through it): a bad config reaches `ray job logs` readably, and the Jobs
    API refuses a client without the token."""
    eft_cli = [sys.executable, "-m", "app.cli"]
    cfg = "jobs/configs/tiny-cpu.yaml"
    bad = f"eft-bad-{uuid.uuid4().hex[:6]}"
    submit(user_stack, *eft_cli, "train", cfg, "--set", "training.lr_typo=1", submission_id=bad)
    assert job_status(user_stack, bad) == "FAILED"
    logs = ray_job(user_stack, "logs", "--address", user_stack["exports"]["RAY_API_SERVER_ADDRESS"], bad).stdout
    assert f"eft: error: {cfg}: training.lr_typo: unknown key" in logs
    assert "Traceback" not in logs

    # The Jobs API wants the token too: the same CLI, from a shell without the token settings,
    # is refused by the head.
    tokenless = {k: v for k, v in user_stack["user"].items() if not k.startswith("RAY_AUTH_")}
    listed = ray_job(user_stack, "list", "--address", user_stack["exports"]["RAY_API_SERVER_ADDRESS"],
                     env=tokenless, timeout=120)
    assert listed.returncode != 0 and bad not in listed.stdout
    assert "Unauthorized: Missing authentication token" in listed.stdout + listed.stderr


def test_local_down_stops_only_the_stacks_own_processes(user_stack):
    """Last of the stack's tests: `down` stops its Ray head and S3 endpoint, leaves the user's
    other process alone, and nothing was ever written to the home directory's ~/.ray."""
    shell, state_dir, state = user_stack["shell"], user_stack["state_dir"], user_stack["state"]
    down = eft("local", "down", "--state-dir", str(state_dir), env=shell)
    assert down.returncode == 0 and "stopped" in down.stdout
    wait_dead(state["ray_pid"], state["s3_pid"])
    assert not alive(state["ray_pid"]) and not alive(state["s3_pid"])
    assert alive(user_stack["bystander"].pid)
    assert eft("local", "status", "--state-dir", str(state_dir), env=shell).returncode == 1
    assert not (user_stack["home"] / ".ray").exists()


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
        shell = fresh_shell_env(tmp_path / "home")
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


def test_local_up_refuses_a_token_file_that_holds_no_token(tmp_path):
    """Before anything starts: one line, and no stack recorded."""
    shell = fresh_shell_env(tmp_path / "home")
    missing = eft("local", "up", "--state-dir", str(tmp_path / "state"), "--auth-token-path",
                  str(tmp_path / "nope"), env=shell)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"eft: error: --auth-token-path: {tmp_path / 'nope'}: no token in that file"]
    assert not (tmp_path / "state" / "local.json").exists()


def test_make_demo_runs_end_to_end_on_a_fresh_home(tmp_path, new_user_shell, base_cache):
    """What `make demo` runs (`.venv/bin/eft demo`), from a shell with nothing set up: the demo
    starts its own stack in ./.eft, seeds the pre-trained chat base, previews one conversation,
    scores the base on the task's held-out prompts, fine-tunes, exports, scores the export, serves
    it with `eft serve` and asks it a question through the `openai` client, and stops the stack,
    printing no error-level line on the way. The base is the one that ships with eft, as on a fresh
    clone (a disk cache is used only where the shipped base's recipe fingerprint does not match)."""
    home = tmp_path / "home"
    if any(base_cache.iterdir()):
        shutil.copytree(base_cache, tmp_path / ".eft" / "cache")
    demo = eft("demo", "--max-steps", "12", env=new_user_shell(home), cwd=tmp_path, timeout=900)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    out = demo.stdout
    assert re.search(r"^exported: (s3://eft/runs/tiny-chat/export/checkpoint-00000012)/adapter \(adapter\), "
                     r"\1/merged \(merged\)$", out, re.MULTILINE), out[-3000:]
    # The base writes words: its held-out loss is far below a uniform guess over the vocabulary. It
    # is the one eft ships: a fresh clone pre-trains nothing.
    source, before, after, uniform = re.search(
        r"^base: +pre-trained 300 steps in \d+ s \((shipped|trained|disk cache|bucket)\): held-out loss (\S+) → (\S+) "
        r"\(uniform (\S+)\)$", out, re.MULTILINE).groups()
    before, after, uniform = float(before), float(after), float(uniform)
    assert source == "shipped" and abs(before - uniform) < 0.1 and after < uniform - 2.0, out[-3000:]
    # One conversation previewed as training sees it: the ChatML rendering of the first record.
    assert "<|im_start|>user\nWhat is the \"assert\" statement?<|im_end|>" in out
    assert "1 record(s): 1 used" in out
    assert re.search(r"^question: 'What is the \"assert\" statement\?'$", out, re.MULTILINE)
    # Asked of the export as `eft serve` serves it (Ray Serve on loopback, the real openai client).
    assert re.search(r"^served: +tiny-chat at http://127\.0\.0\.1:\d+/v1 \(eft serve: Ray Serve, OpenAI API\)$",
                     out, re.MULTILINE), out[-3000:]
    # What a 12-step model says is noise (a few words, or none); that it said it through the served
    # API is the point here. tests/test_serve.py checks the served text equals `generate`'s.
    answer = re.search(r"^answer: +(.+)$", out, re.MULTILINE).group(1)
    assert isinstance(ast.literal_eval(answer), str), answer
    first, final = map(float, re.search(r"^train loss (\S+) → (\S+) over 12 steps$", out, re.MULTILINE).groups())
    assert final < first
    # The headline: the task's held-out prompts scored on the base and on the export, the base at
    # most 10% (12 steps are too few to ask the same of the tuned model; a full demo scores 100%).
    assert re.search(r"^task: +100 held-out prompts of s3://eft/raw/parity-eval\.jsonl \(e\.g\. 'Is \d+ even or odd\?' → "
                     r"'(even|odd)'\), exact_match$", out, re.MULTILINE), out[-3000:]
    base_score, _ = map(float, re.search(
        r"^score: +base (\S+)% \(95% \S+\) → fine-tuned (\S+)% \(95% \S+\)$", out, re.MULTILINE).groups())
    assert base_score <= 10.0
    assert not (home / ".ray").exists()
    # The stack it started is gone: no state left, no process of it alive.
    assert not (tmp_path / ".eft" / "local.json").exists()
    ray_log = (tmp_path / ".eft" / "ray.log").read_text()
    assert "Ray runtime started" in ray_log
    # The head required the token `up` wrote for it: private to the user, and never printed.
    token = tmp_path / ".eft" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) >= 32
    assert token.read_text() not in out + demo.stderr
    # A normal run says nothing at error level, and its worker pool fits the stack's CPUs.
    errors = [line for line in (out + demo.stderr).splitlines() if RAY_ERROR_LINE.search(line)]
    assert not errors, errors
    assert "maximum expected startup concurrency" not in out + demo.stderr + ray_log
