"""The embedded stack for development, the demo and the tests: an S3 endpoint and a Ray head
on loopback, started and stopped by PID.

This is the only module that knows the S3 endpoint is an emulator (moto's server); every
other module talks to it through boto3 / pyarrow exactly as to AWS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import psutil

from app.cluster import (AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, default_num_cpus, find_free_port, startup_env,
                         write_token)

# The emulator accepts any key pair; these are not secrets, and real runs never see them.
LOCAL_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
DEFAULT_BUCKET = "eft"

log = logging.getLogger("eft.local")


def wait_for_port(port: int, timeout_s: float = 30.0, proc: Optional[subprocess.Popen] = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def wait_for_log(path: Path, text: str, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}; see {path}")
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in {path} after {timeout_s}s")


@dataclass
class S3Server:
    proc: subprocess.Popen
    endpoint: str

    def stop(self) -> None:
        stop_pid(self.proc.pid)


def start_s3_server(port: Optional[int] = None, bucket: str = DEFAULT_BUCKET,
                    log_path: Optional[Path] = None) -> S3Server:
    """Start the S3 endpoint on 127.0.0.1 in its own process group and create `bucket`."""
    import importlib.util

    if importlib.util.find_spec("moto") is None:
        raise RuntimeError("the local stack's S3 endpoint needs moto: pip install 'eft[local]' "
                           "(make demo installs it)")
    port = port or find_free_port()
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    wait_for_port(port, proc=proc)
    create_bucket(endpoint, bucket)
    return S3Server(proc, endpoint)


def point_env_at(endpoint: str) -> None:
    """This process's env, and so every child's, sends boto3 and pyarrow to `endpoint`."""
    os.environ.update(LOCAL_S3_ENV)
    os.environ["AWS_ENDPOINT_URL"] = endpoint


@contextlib.contextmanager
def serve_s3(bucket: str = DEFAULT_BUCKET) -> Iterator[S3Server]:
    """The S3 endpoint on a free port for the life of the block, with the env pointed at it;
    the env is put back as it was afterwards."""
    saved = {k: os.environ.get(k) for k in [*LOCAL_S3_ENV, "AWS_ENDPOINT_URL"]}
    server = start_s3_server(bucket=bucket)
    point_env_at(server.endpoint)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=LOCAL_S3_ENV["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=LOCAL_S3_ENV["AWS_SECRET_ACCESS_KEY"])
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """Stop the process group led by `pid`: SIGTERM to the leader, then SIGKILL to whatever of the
    group is left once the leader is gone (or `timeout_s` has passed). The leader first, because
    `ray start --block` stops every process it started, in order, within seconds of its own
    SIGTERM; a SIGTERM to the whole group instead leaves its children as zombies it never reaps,
    and the group lingered until the timeout's SIGKILL (23 s for every `eft local down`)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and leader_running(pid):
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def leader_running(pid: int) -> bool:
    """Whether `pid` still runs: a zombie does not (it is reaped here when it is our child)."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return False
    try:  # our own child: reap it, so it does not linger as a zombie
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return False


# -- `eft local up/down/status` ------------------------------------------------------

def state_file(state_dir: Path) -> Path:
    return Path(state_dir) / "local.json"


def local_env(state: dict) -> dict[str, str]:
    """The environment a shell needs to use the local stack: the S3 endpoint, the Ray address,
    and where the stack's Ray token is (the head refuses clients without it)."""
    env = {**LOCAL_S3_ENV, "AWS_ENDPOINT_URL": state["s3_endpoint"], "RAY_ADDRESS": state["ray_address"],
           AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: state["auth_token_path"]}
    if state.get("dashboard_url"):  # where `ray job submit` finds the head
        env["RAY_API_SERVER_ADDRESS"] = state["dashboard_url"]
    return env


def read_state(state_dir: Path) -> Optional[dict]:
    path = state_file(state_dir)
    return json.loads(path.read_text()) if path.exists() else None


def process_start_time(pid: int) -> Optional[float]:
    """When the process `pid` started (seconds since the epoch), None if there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_our_process(pid: int, started_at: Optional[float]) -> bool:
    """True while `pid` is still the process that started at `started_at`: a PID alone may have
    been recycled for someone else's process since the state file was written."""
    now = process_start_time(pid)
    # Both readings come from the same kernel clock ticks; the tolerance only absorbs float rounding.
    return now is not None and started_at is not None and abs(now - started_at) < 0.05


def _alive(state: dict, name: str) -> bool:
    return is_our_process(state[f"{name}_pid"], state.get(f"{name}_started_at"))


def up(state_dir: Path, num_cpus: Optional[int] = None, s3_port: Optional[int] = None,
       ray_port: Optional[int] = None, bucket: str = DEFAULT_BUCKET,
       auth_token_path: Optional[Path] = None) -> dict:
    """Start S3 + a Ray head with token auth; idempotent while both still run. The head uses
    the token at `auth_token_path` if given, else a new one written to the state dir."""
    state_dir = Path(state_dir).absolute()
    state_dir.mkdir(parents=True, exist_ok=True)
    state = read_state(state_dir)
    if state and _alive(state, "s3") and _alive(state, "ray"):
        return state
    if state:
        down(state_dir)
    if auth_token_path is not None:
        token_path = Path(auth_token_path).absolute()
        if not token_path.is_file() or not token_path.read_text().strip():
            raise FileNotFoundError(f"--auth-token-path: {token_path}: no token in that file")
    else:
        token_path = write_token(state_dir / "auth_token")
    s3 = start_s3_server(s3_port, bucket, log_path=state_dir / "s3.log")
    ray_port = ray_port or find_free_port()
    dashboard_port = find_free_port()
    num_cpus = num_cpus or default_num_cpus()
    # Token auth on by the head's own environment, not by Ray's default (which depends on what
    # ~/.ray holds); a token from the caller's environment must not override the stack's.
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update({**LOCAL_S3_ENV, "AWS_ENDPOINT_URL": s3.endpoint, "RAY_USAGE_STATS_ENABLED": "0",
                AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(token_path), **startup_env(num_cpus, dashboard_port)})
    ray_bin = Path(sys.executable).with_name("ray")
    log = open(state_dir / "ray.log", "ab")
    ray_proc = subprocess.Popen(
        [str(ray_bin) if ray_bin.exists() else "ray", "start", "--head", "--block",
         f"--port={ray_port}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         # Every agent port free too: a second Ray on this machine (a notebook's, a test
         # session's) holds the defaults, and a head whose job agent cannot bind takes no jobs.
         f"--dashboard-agent-listen-port={find_free_port()}", f"--dashboard-agent-grpc-port={find_free_port()}",
         f"--runtime-env-agent-port={find_free_port()}", f"--metrics-export-port={find_free_port()}",
         "--disable-usage-stats",
         f"--temp-dir={Path('/tmp') / ('ray-eft-' + str(ray_port))}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    try:
        wait_for_port(ray_port, timeout_s=120, proc=ray_proc)
        # The GCS port opens first; jobs can be submitted once `ray start` reports the whole
        # runtime (dashboard and its agents) up.
        wait_for_log(state_dir / "ray.log", "Ray runtime started", timeout_s=120, proc=ray_proc)
        wait_for_port(dashboard_port, timeout_s=60, proc=ray_proc)
    except Exception:
        stop_pid(ray_proc.pid)
        s3.stop()
        raise
    state = {
        "s3_pid": s3.proc.pid, "s3_endpoint": s3.endpoint, "bucket": bucket,
        "ray_pid": ray_proc.pid, "ray_address": f"127.0.0.1:{ray_port}", "num_cpus": num_cpus,
        "s3_started_at": process_start_time(s3.proc.pid), "ray_started_at": process_start_time(ray_proc.pid),
        "dashboard_url": f"http://127.0.0.1:{dashboard_port}", "auth_token_path": str(token_path),
    }
    state_file(state_dir).write_text(json.dumps(state, indent=2))
    return state


def down(state_dir: Path) -> Optional[dict]:
    """Stop exactly the processes `up` started (their process groups), nothing else: a recorded
    PID whose process started at another time than recorded belongs to someone else now."""
    state = read_state(state_dir)
    if not state:
        return None
    for name in ("ray", "s3"):
        pid = state[f"{name}_pid"]
        if _alive(state, name):
            stop_pid(pid)
        elif process_start_time(pid) is not None:
            log.warning("local: PID %d (the stack's %s) is now another process (started %s, recorded %s); "
                        "left alone", pid, name, process_start_time(pid), state.get(f"{name}_started_at"))
    state_file(state_dir).unlink(missing_ok=True)
    return state


def status(state_dir: Path) -> Optional[dict]:
    state = read_state(state_dir)
    if not state:
        return None
    return {**state, "s3_alive": _alive(state, "s3"), "ray_alive": _alive(state, "ray")}
