"""Joining a Ray cluster, or starting one in this process, always with token authentication.

A Ray cluster runs whatever code a client sends it, so every cluster eft starts requires Ray's
token auth, and the token lives in a file only this user can read (never in `~/.ray`, which a
fresh machine does not have and which another cluster's token may occupy). Ray finds the token
through its documented variables, `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH`, which the
processes of the cluster inherit from the one that starts them.

`map_on_actor_pool` runs a Ray Data actor pool (eval's scorers, the reference pass) so that a lost
actor costs only the blocks it had not returned.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

log = logging.getLogger("eft.cluster")

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_ENV = "RAY_AUTH_TOKEN"


class ClusterError(RuntimeError):
    """Ray cannot be joined or started as configured; the message is one line."""


def default_num_cpus() -> int:
    """Logical CPUs for a Ray started on one machine: more than its cores, so Ray Data has slots
    beside the training workers."""
    return max(8, 4 * (os.cpu_count() or 2))


# Ray's own setting (a RayConfig entry, read from the environment by the raylet) for how many
# worker processes a node starts at once. Ray derives it from the node's cores (2 here), while a
# one-machine eft Ray has 4x as many logical CPUs so that Ray Data runs beside the training
# workers; the raylet then warns at every start that it has run 4x more workers than expected.
STARTUP_CONCURRENCY_ENV = "RAY_worker_maximum_startup_concurrency"


# Ray's own variable for where a cluster's state API (its dashboard) answers. Ray Train's
# placement-group cleaner asks the state API whether the run's controller still lives; given no
# address, it looks for the one Ray on this machine, and where there are two (a notebook's beside
# `eft local up`'s, a test session's beside a scenario's) its monitor thread dies on "Found
# multiple active Ray instances": a lost controller's placement group is then never removed.
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"


def startup_env(num_cpus: int, dashboard_port: int | None = None) -> dict[str, str]:
    """The environment a one-machine Ray head starts with (its processes inherit it): its worker
    pool sized to its logical CPUs, as it would be on a machine with that many cores (an explicit
    setting wins), and, given the dashboard's port, its own state API's address."""
    env = {STARTUP_CONCURRENCY_ENV: os.environ.get(STARTUP_CONCURRENCY_ENV) or str(num_cpus)}
    return {**env, **state_api_env(dashboard_port)} if dashboard_port is not None else env


def state_api_env(dashboard_port: int) -> dict[str, str]:
    """Where the processes of a Ray whose dashboard listens on `dashboard_port` find its state API."""
    return {API_SERVER_ENV: f"http://127.0.0.1:{dashboard_port}"}


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def own_dashboard_port() -> int:
    """A free port for the dashboard of a Ray this process is about to start, its state API's
    address exported first: that Ray's processes inherit this environment, so they ask its state
    API and no other Ray's on the machine."""
    port = find_free_port()
    os.environ.update(state_api_env(port))
    return port


def write_token(path: Path) -> Path:
    """A fresh random token at `path`, readable by this user alone (created 0600, never wider)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, the form `ray get-auth-token --generate` writes
    return path


def check_auth_mode() -> None:
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode and mode.lower() != "token":
        raise ClusterError(f"{AUTH_MODE_ENV}={mode}: eft starts Ray only with token authentication; "
                           f"unset {AUTH_MODE_ENV} or set it to token")


def require_token_auth() -> None:
    """Token auth for a Ray cluster this process is about to start: the token the environment
    names, else a new one in a private directory that lives as long as this process."""
    check_auth_mode()
    if not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV)):
        token_dir = Path(tempfile.mkdtemp(prefix="eft-ray-auth-"))  # mode 0700
        # Registered before ray.init, so it runs after Ray's own shutdown hook.
        atexit.register(shutil.rmtree, token_dir, ignore_errors=True)
        os.environ[TOKEN_PATH_ENV] = str(write_token(token_dir / "auth_token"))
    os.environ[AUTH_MODE_ENV] = "token"
    refresh_ray_auth()


def refresh_ray_auth() -> None:
    """Ray reads its auth mode and token once per process: an `import ray` before the variables
    were set would keep the old ones. Re-read them, as Ray does when it turns token auth on
    itself; only valid before this process joins or starts a cluster."""
    from app.compat import reload_ray_auth

    reload_ray_auth()


def init_ray(num_cpus: int | None = None, **kwargs) -> None:
    """Join the cluster named by RAY_ADDRESS, or start a local one (token auth on) with CPU
    slots to spare for Ray Data beside the training workers."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        refresh_ray_auth()
        try:
            ray.init(**kwargs)
        except ConnectionError as err:
            # A head with token auth drops a client with no token or the wrong one, and Ray
            # says only that it could not connect.
            raise ClusterError(f"RAY_ADDRESS={address}: {err}; if the cluster requires token auth, set "
                               f"{AUTH_MODE_ENV}=token and {TOKEN_PATH_ENV} to its token file "
                               "(for the local stack: eval \"$(eft local env)\")") from err
        return
    require_token_auth()
    num_cpus = num_cpus or default_num_cpus()
    os.environ.update(startup_env(num_cpus))  # the raylet this starts inherits it
    dashboard_port = own_dashboard_port()
    # The dashboard serves the state API that Ray Train's placement-group cleaner polls.
    # address="local": never join some other cluster that happens to run on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_port=dashboard_port, **kwargs)


# How many times a pool may lose an actor (a node reclaimed, a process killed) before the pass fails.
ACTOR_LOSSES_RIDDEN = 3
# How long a pool's actors may take to start, all of them, before the pass fails in one line. Ray
# Data starts a fixed pool without waiting for it, and a pass whose first actor takes every block
# ends while another is still loading its model: cancelling that actor's creation makes the GCS
# log an error-level line at the end of a normal run ("Failed to kill actor ... Socket closed").
# So the pool starts whole first. Long, since an autoscaling cluster may add a node for it.
ACTOR_POOL_START_TIMEOUT_S = 1800


def is_actor_loss(err: BaseException) -> bool:
    """An actor that died or became unreachable, anywhere in the exception's chain (Ray Data
    wraps what its operators raise)."""
    from ray.exceptions import RayActorError  # ActorDiedError and ActorUnavailableError among them

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, RayActorError):
            return True
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    return False


def map_on_actor_pool(blocks: list, udf: type, constructor_args: tuple, *, key: str, size: int,
                      batch_format: str = "pyarrow", num_cpus: float = 1, num_gpus: float = 0,
                      what: str = "actor pool", size_key: str = "its size") -> Iterator:
    """Each Arrow table of `blocks` through `udf` (a Ray Data callable class) on `size` actors, one
    block a call, yielding the output batches. `key` names a column each block and its output both
    carry (every input value comes back in the output). The actors all start before the first
    block goes out; a pool the cluster cannot hold within ACTOR_POOL_START_TIMEOUT_S is one
    ClusterError naming `size_key`, the setting that sized it.

    The actors start with max_restarts=0, and a lost actor is ridden out here instead: the blocks
    whose keys have not all come back run again on a new pool (up to ACTOR_LOSSES_RIDDEN times).
    A block's output depends on the block alone, so a block run twice gives what it gave once.
    Ray Data's own restarts (max_restarts=-1) pass the actor the operator's object refs, and on
    every pool start Ray's core worker logs an error-level line that a restart might fail
    (ray-project/ray#57733: the refs do stay alive, so it is noise a user should not see)."""
    import ray.data
    import ray.exceptions

    seen: set = set()
    for losses in range(ACTOR_LOSSES_RIDDEN + 1):
        todo = [b for b in blocks if not set(b.column(key).to_pylist()) <= seen]
        if not todo:
            return
        with warnings.catch_warnings():
            # max_restarts has no named parameter in Ray 2.60; the extra-kwargs route it takes is
            # deprecated for removal in 2.64 (the pin is <2.61).
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ray.data.from_arrow(todo).map_batches(
                udf, batch_format=batch_format, batch_size=None, max_restarts=0,
                compute=ray.data.ActorPoolStrategy(size=min(size, len(todo))),
                num_cpus=num_cpus, num_gpus=num_gpus, fn_constructor_args=constructor_args)
        ds.context.wait_for_min_actors_s = ACTOR_POOL_START_TIMEOUT_S
        pool = min(size, len(todo))
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format=batch_format):
                keys = batch.column(key).to_pylist() if batch_format == "pyarrow" else list(batch[key])
                seen.update(keys)
                yield batch
            return
        except ray.exceptions.GetTimeoutError as err:
            if "while starting actors" not in str(err):  # Ray Data's wait for the pool, not another
                raise
            raise ClusterError(f"{what}: its {pool} actors did not all start within "
                               f"{ACTOR_POOL_START_TIMEOUT_S} s; the cluster cannot hold them (each "
                               f"{num_cpus} CPU, {num_gpus} GPU): lower {size_key}") from err
        except Exception as err:  # noqa: BLE001: only an actor's loss is ridden out
            if losses == ACTOR_LOSSES_RIDDEN or not is_actor_loss(err):
                raise
            log.warning("%s: an actor was lost (%s); the blocks it had not returned run again on a new pool",
                        what, type(err).__name__)
