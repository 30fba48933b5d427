"""Where rank 0's metric records go besides `<run>/metrics/`: TensorBoard event files in the
run's storage, MLflow when a tracking URI is configured, and Weights & Biases when a project (or a
mode) is. Uploads happen on background threads with bounded queues, so the training loop never
waits on storage or a tracker to log, and none of them being down or hanging stops a run: it
costs a warning."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from app.compat import set_wandb_writer
from app.storage import Store, join

log = logging.getLogger("eft.sinks")
SKIP = {"step", "row_ids", "world_size"}


def scalars_of(record: dict) -> dict[str, float]:
    """The plottable part of a record: finite numbers, not the step or the row trace."""
    return {k: float(v) for k, v in record.items()
            if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class BackgroundWriter:
    """Runs submitted jobs in order on one daemon thread, so the training loop never waits on
    storage or a tracker. A job submitted under the key of one still queued replaces it (a job
    that writes a whole file: only the newest matters). At most `max_pending` jobs wait: past
    that the oldest is dropped and counted, so an endpoint that is down or hangs costs bounded
    memory. A failed job is logged (and handed to `on_error`), never raised: a failed upload
    must not stop training."""

    def __init__(self, what: str = "metrics upload", max_pending: int = 1000,
                 on_error: Optional[Callable[[str, Exception], None]] = None):
        self.what, self.max_pending, self.on_error = what, max_pending, on_error
        self._pending: dict[str, Callable[[], None]] = {}
        self._lock = threading.Condition()
        self._busy = False
        self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"eft-{what.replace(' ', '-')}", daemon=True)
        self._thread.start()

    def submit(self, key: str, job: Callable[[], None]) -> None:
        with self._lock:
            if key not in self._pending and len(self._pending) >= self.max_pending:
                del self._pending[next(iter(self._pending))]
                self.dropped += 1
            self._pending[key] = job
            self._lock.notify_all()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return len(self._pending) + int(self._busy)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait for every submitted job; False if some were still queued or running at the timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)

    def clear(self) -> int:
        """Drop the queued jobs (not the running one); returns how many."""
        with self._lock:
            dropped = len(self._pending)
            self._pending.clear()
            self.dropped += dropped
            self._lock.notify_all()
            return dropped

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending)
                key = next(iter(self._pending))
                job = self._pending.pop(key)
                self._busy = True
            try:
                job()
            except Exception as err:
                with self._lock:
                    self.failed += 1
                log.warning("%s failed (%s): %s: %s", self.what, key, type(err).__name__, err)
                if self.on_error is not None:
                    self.on_error(key, err)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()


class TensorBoardSink:
    """Event files written locally by torch's SummaryWriter and copied to `<run>/tensorboard/`.
    Every `upload_interval_s` (and at the end) the current file is closed, a new one opened, and
    the closed ones uploaded once each: TensorBoard reads all the event files of a directory in
    name order, so the bytes uploaded grow with the steps, not their square. A file storage did
    not take (past the store's retries) is a warning and goes again at the next upload.
    `purge_step` makes TensorBoard drop the points past the step a resumed run restarted from."""

    def __init__(self, store: Store, run_uri: str, resumed_from_step: int, upload_interval_s: float = 30.0,
                 finish_timeout_s: float = 60.0):
        self.store, self.uri = store, join(run_uri, "tensorboard")
        self.local = Path(tempfile.mkdtemp(prefix="eft-tb-"))
        self.upload_interval_s, self.finish_timeout_s = upload_interval_s, finish_timeout_s
        self.writer = self._open(purge_step=resumed_from_step + 1 if resumed_from_step else None)
        self._closed: list[tuple[str, Path]] = []  # closed event files not uploaded yet: (name up there, here)
        self._seq = 0
        self._origin = f"{socket.gethostname()}.{os.getpid()}"
        self._lock = threading.Lock()
        self._uploaded_at = time.monotonic()
        self._background = BackgroundWriter("tensorboard upload")

    def _open(self, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        # A file is named for when it was opened, not closed: a resumed run's first file opens with
        # the marker that drops the points past its restart, and must sort before the event files
        # other processes add meanwhile (a checkpoint's score) or TensorBoard drops those too.
        self._opened_ms = time.time_ns() // 10**6
        return SummaryWriter(str(self.local), purge_step=purge_step)

    def log(self, record: dict) -> None:
        for key, value in scalars_of(record).items():
            self.writer.add_scalar(key, value, record["step"])
        if time.monotonic() - self._uploaded_at >= self.upload_interval_s:
            self._uploaded_at = time.monotonic()
            self._roll(reopen=True)
            self._background.submit("tensorboard", self._upload)

    def _roll(self, reopen: bool) -> None:
        self.writer.close()
        with self._lock:
            known = {path for _, path in self._closed}
            for path in sorted(p for p in self.local.iterdir() if p not in known):
                # TensorBoard reads a directory's files in name order; SummaryWriter's names end in a
                # process-wide counter that sorts "10" before "9", so the uploaded name carries our own.
                name = f"events.out.tfevents.{self._opened_ms:013d}.{self._seq:06d}.{self._origin}"
                self._closed.append((name, path))
                self._seq += 1
        if reopen:
            self.writer = self._open()

    def _upload(self) -> None:
        with self._lock:
            files = list(self._closed)
        for name, path in files:
            self.store.write_bytes(join(self.uri, name), path.read_bytes())
            # Both under the lock: `_roll` lists the directory under it, and a file it saw still
            # there but no longer listed as closed would be queued again under a new name, then
            # vanish before its upload (a flake seen on a loaded 2-core box).
            with self._lock:
                path.unlink()
                self._closed.remove((name, path))

    def finish(self) -> bool:
        """Upload what is left, waiting at most `finish_timeout_s`; False (and a warning) if not all went up."""
        self._roll(reopen=False)
        self._background.submit("tensorboard", self._upload)
        drained = self._background.drain(self.finish_timeout_s)
        with self._lock:
            left = len(self._closed)
        if left:
            log.warning("tensorboard: %d event files not uploaded to %s%s; they stay in %s", left, self.uri,
                        f" after {self.finish_timeout_s:.0f} s" if not drained else "", self.local)
            return False
        # Everything is up: the local directory goes too, or every worker start on a long-lived
        # node leaves one behind in its temp directory.
        shutil.rmtree(self.local, ignore_errors=True)
        return True


# A tracker that is down must cost seconds, not the minutes of MLflow's default patience (7
# retries with exponential backoff, 120-s timeouts); the user's own settings win.
MLFLOW_PATIENCE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


class MlflowSink:
    """One MLflow run per eft run, found again on resume by its `eft.run_uri` tag. Everything,
    the connection included, happens on a background thread with a bounded queue: when the
    tracking server is down or fails a call, a warning says so and the sink turns itself off for
    the rest of the attempt; when it hangs, the queue drops its oldest batches and `finish`
    gives up after `finish_timeout_s`, with a warning that counts what was not sent. Training
    never waits on MLflow for longer than that."""

    def __init__(self, settings: dict, run_uri: str, params: dict, max_pending: int = 1000,
                 finish_timeout_s: float = 30.0):
        os.environ.update(settings)
        for key, value in MLFLOW_PATIENCE.items():
            os.environ.setdefault(key, value)
        self.tracking_uri = settings["MLFLOW_TRACKING_URI"]
        self.finish_timeout_s = finish_timeout_s
        self.enabled = True
        self.client = self.run_id = None
        self.sent = self.logged = 0
        self._background = BackgroundWriter("MLflow logging", max_pending=max_pending, on_error=self._disable)
        self._start_args = (settings, run_uri, params)
        # Connect early; any job connects first if this one was dropped from a full queue.
        self._background.submit("mlflow-start", self._connect)

    def _connect(self):
        if self.client is not None:
            return self.client
        # mlflow.entities first, as `log` (on the caller's thread) imports it: importing
        # mlflow.tracking first here raced it into a partially initialized module.
        from mlflow.entities import Param  # noqa: F401
        from mlflow.tracking import MlflowClient

        settings, run_uri, params = self._start_args
        client = MlflowClient(self.tracking_uri)
        self.client, self.run_id = client, find_mlflow_run(client, settings, run_uri, params)
        return client

    def _disable(self, key: str, err: Exception) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self._background.clear()
        log.warning("MLflow at %s failed (%s: %s): MLflow logging is off for the rest of this attempt "
                    "(%d of %d batches sent); training goes on", self.tracking_uri, type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "", self.sent, self.logged)

    def _send(self, metrics: list) -> None:
        self._connect().log_batch(self.run_id, metrics=metrics)
        self.sent += 1

    def _terminate(self) -> None:
        self._connect().set_terminated(self.run_id)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["step"]) for k, v in scalars_of(record).items()]
        self.logged += 1
        # A key per step: batches queue in order instead of replacing each other.
        self._background.submit(f"mlflow-{record['step']}", lambda: self._send(metrics))

    def finish(self) -> bool:
        """Send what is queued and close the MLflow run, waiting at most `finish_timeout_s`."""
        if self.enabled:
            self._background.submit("mlflow-finish", self._terminate)
        if self._background.drain(self.finish_timeout_s):
            return self.enabled
        self._background.clear()
        log.warning("MLflow at %s did not answer within %.0f s: %d of %d batches sent, the rest given up; "
                    "training goes on", self.tracking_uri, self.finish_timeout_s, self.sent, self.logged)
        return False


def find_mlflow_run(client, settings: dict, run_uri: str, params: Optional[dict] = None) -> str:
    """The MLflow run of an eft run (tagged `eft.run_uri`), created with `params` when absent."""
    from mlflow.entities import Param

    experiment = settings.get("MLFLOW_EXPERIMENT_NAME", "eft")
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    runs = client.search_runs([experiment_id], filter_string=f"tags.`eft.run_uri` = '{run_uri}'", max_results=1)
    if runs:
        return runs[0].info.run_id
    run_id = client.create_run(experiment_id, tags={"eft.run_uri": run_uri},
                               run_name=run_uri.rstrip("/").rsplit("/", 1)[-1]).info.run_id
    items = [Param(key, str(value)[:500]) for key, value in (params or {}).items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=items[i:i + 100])
    return run_id


def log_to_mlflow(settings: dict, run_uri: str, record: dict) -> None:
    """One record's scalars at its step into the eft run's MLflow run, from outside the workers
    (an evaluation task), with the same short patience as the sink."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    os.environ.update(settings)
    for key, value in MLFLOW_PATIENCE.items():
        os.environ.setdefault(key, value)
    client = MlflowClient(settings["MLFLOW_TRACKING_URI"])
    now = int(time.time() * 1000)
    client.log_batch(find_mlflow_run(client, settings, run_uri),
                     metrics=[Metric(k, v, now, record["step"]) for k, v in scalars_of(record).items()])


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Forwarded from the driver to the workers, which do not see the driver's environment. Never
# the credentials (MLFLOW_TRACKING_TOKEN, _PASSWORD...): on a cluster those come from the
# nodes' own environment (a Kubernetes secretKeyRef), so they are never written anywhere.
FORWARDED_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE",
                        *MLFLOW_PATIENCE)


def mlflow_settings() -> Optional[dict]:
    """The MLflow settings of the driver's environment, or None when no tracking URI is set."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return {k: os.environ[k] for k in FORWARDED_MLFLOW_ENV if k in os.environ}


# -- Weights & Biases ----------------------------------------------------------------------------

# Forwarded from the driver to the workers and the eval task, like FORWARDED_MLFLOW_ENV: settings
# only, never the credentials. WANDB_API_KEY (and WANDB_IDENTITY_TOKEN_FILE, WANDB_CREDENTIALS_FILE,
# a netrc) come on a cluster from the nodes' own environment (a Kubernetes secretKeyRef, a node's
# `wandb login`), so a key is never written into Ray's task specs, logs or the run's records.
FORWARDED_WANDB_ENV = ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL",
                       "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_JOB_TYPE", "WANDB_NOTES", "WANDB_INIT_TIMEOUT",
                       "WANDB_FINISH_TIMEOUT", "WANDB_SILENT", "WANDB_DISABLE_GIT", "WANDB_DISABLE_CODE")
# A W&B that is down must cost seconds, not wandb.init's default 90 s (the user's own settings win).
WANDB_INIT_TIMEOUT_S = 30.0
WANDB_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
# The runs the sinks of this process have open, by W&B run id: W&B refuses a second writer of a
# run in the process that has it open ("run ID ... is in use"), so log_to_wandb goes through them.
_open_wandb_runs: dict[str, "WandbSink"] = {}
_open_wandb_lock = threading.Lock()


def wandb_settings() -> Optional[dict]:
    """The W&B settings of the driver's environment, or None when W&B is not configured (neither
    WANDB_PROJECT nor WANDB_MODE set, or WANDB_MODE=disabled). Never the API key."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode == "disabled" or not (os.environ.get("WANDB_PROJECT") or mode):
        return None
    return {k: os.environ[k] for k in FORWARDED_WANDB_ENV if k in os.environ}


def wandb_run_id(run_uri: str) -> str:
    """The W&B run id of an eft run, the same on every attempt and election: its name in W&B's
    id alphabet ([A-Za-z0-9_-], at most 128), then a short hash of the whole run URI, so that runs
    of the same name under different roots do not share a W&B run."""
    uri = run_uri.rstrip("/")
    digest = hashlib.sha256(uri.encode()).hexdigest()[:10]
    name = WANDB_ID_CHARS.sub("-", uri.rsplit("/", 1)[-1]).strip("-") or "run"
    return f"{name[:128 - len(digest) - 1]}-{digest}"


def wandb_mode(settings: dict) -> str:
    """offline (or dryrun) and disabled as given; anything else is online, which eft runs in W&B's
    shared mode: the eval task writes the checkpoints' scores into the run while rank 0 has it
    open, which plain online mode does not allow two processes to do."""
    mode = settings.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun"):
        return "offline"
    return "disabled" if mode == "disabled" else "shared"


def open_wandb_run(settings: dict, run_uri: str, primary: bool, config: Optional[dict] = None,
                   finish_timeout_s: float = 30.0):
    """The eft run's W&B run, created or resumed (`resume="allow"`, the id from the run URI).
    `primary`: rank 0's sink, which owns the run's state; otherwise a second writer (the eval
    task), which never marks the run finished. W&B's own patience is bounded (init, finish), it
    never takes the process's stdout/stderr over (console off) and prints nothing (silent)."""
    os.environ.setdefault("WANDB_SILENT", "true")  # before wandb's first setup in this process reads it
    # W&B hands its service's address to child processes (WANDB_SERVICE), and one service refuses a
    # second writer of a run ("run ID ... is in use"): a process that inherited it (an eval task
    # started beneath a process that has the run open, a local Ray cluster under a driver that uses
    # W&B) starts a service of its own instead. A service this process already has is kept.
    os.environ.pop("WANDB_SERVICE", None)
    import wandb

    # The settings go to wandb.init explicitly, read as W&B reads its environment: W&B reads
    # os.environ once per process, so settings put there after its first run would be ignored.
    run_settings = wandb.Settings()
    run_settings.update_from_env_vars(settings)
    if settings.get("WANDB_DISABLE_CODE", "").strip().lower() in ("1", "true", "yes"):
        run_settings.save_code = False
    if settings.get("WANDB_DIR"):
        os.makedirs(settings["WANDB_DIR"], exist_ok=True)  # W&B writes to a temp dir if it is missing
    run_settings.mode = wandb_mode(settings)
    run_settings.console, run_settings.silent = "off", True
    if "WANDB_INIT_TIMEOUT" not in settings:
        run_settings.init_timeout = WANDB_INIT_TIMEOUT_S
    if "WANDB_FINISH_TIMEOUT" not in settings:
        run_settings.finish_timeout = finish_timeout_s
    set_wandb_writer(run_settings, primary, shared=run_settings.mode == "shared")
    run = wandb.init(project=settings.get("WANDB_PROJECT") or "eft", id=wandb_run_id(run_uri),
                     name=run_uri.rstrip("/").rsplit("/", 1)[-1], resume="allow", reinit="create_new",
                     config=config, settings=run_settings)
    # The training step is the x axis of every chart: W&B's own `_step` counts the rows a writer
    # logged, which neither the eval task's rows (a checkpoint's step, logged after later steps)
    # nor a resumed attempt's (steps an earlier attempt logged too) follow.
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def wandb_row(record: dict, tables: Optional[dict[str, list[dict]]] = None) -> dict:
    """A record's scalars at its step, and each table (flat row dicts) as a wandb.Table."""
    row = {**scalars_of(record), "step": record["step"]}
    if tables:
        import wandb

        for name, rows in tables.items():
            columns = list(dict.fromkeys(key for r in rows for key in r))
            row[name] = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows],
                                    allow_mixed_types=True)
    return row


class WandbSink:
    """One W&B run per eft run, its id derived from the run URI, so every attempt (a resume, a
    re-elected driver) continues the same run (`resume="allow"`); the config goes in as the run's
    config, each record's scalars at its step. Everything, `wandb.init` included, happens on a
    background thread with a bounded queue, as for MLflow: W&B failing (init or a log raising) is
    a warning and turns the sink off for the rest of the attempt; W&B hanging costs the queue's
    oldest rows and `finish` gives up after `finish_timeout_s`. Training never waits on W&B.

    A resumed attempt replays the steps past its checkpoint that an earlier attempt may have
    logged already: W&B keeps both (as MLflow does); the run's summary says where the latest
    attempt resumed (`eft/resumed_from_step`)."""

    def __init__(self, settings: dict, run_uri: str, config: dict, resumed_from_step: Optional[int] = None,
                 max_pending: int = 1000, finish_timeout_s: float = 30.0):
        self.settings, self.run_uri, self.config = dict(settings), run_uri, config
        self.resumed_from_step, self.finish_timeout_s = resumed_from_step, finish_timeout_s
        self.run_id = wandb_run_id(run_uri)
        self.enabled = True
        self.run = None
        self.sent = self.logged = 0
        self._background = BackgroundWriter("W&B logging", max_pending=max_pending, on_error=self._disable)
        with _open_wandb_lock:
            _open_wandb_runs[self.run_id] = self
        # Connect early; any job connects first if this one was dropped from a full queue.
        self._background.submit("wandb-start", self._connect)

    def _connect(self):
        if self.run is None:
            self.run = open_wandb_run(self.settings, self.run_uri, primary=True, config=self.config,
                                      finish_timeout_s=self.finish_timeout_s)
            if self.resumed_from_step:
                self.run.summary["eft/resumed_from_step"] = self.resumed_from_step
        return self.run

    def _disable(self, key: str, err: Exception) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self._background.clear()
        log.warning("W&B (%s) failed (%s: %s): W&B logging is off for the rest of this attempt (%d of %d rows "
                    "sent); training goes on", wandb_mode(self.settings), type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "", self.sent, self.logged)

    def _forget(self) -> None:
        with _open_wandb_lock:
            if _open_wandb_runs.get(self.run_id) is self:
                del _open_wandb_runs[self.run_id]

    def _send(self, record: dict, tables: Optional[dict] = None) -> None:
        self._connect().log(wandb_row(record, tables))
        self.sent += 1

    def _finish_run(self) -> None:
        self._connect().finish()

    def log(self, record: dict) -> None:
        # A key per step: rows queue in order instead of replacing each other.
        self._submit(f"wandb-{record['step']}", record)

    def _submit(self, key: str, record: dict, tables: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        self.logged += 1
        self._background.submit(key, lambda: self._send(record, tables))

    def finish(self) -> bool:
        """Send what is queued and finish the W&B run, waiting at most `finish_timeout_s`."""
        if self.enabled:
            self._background.submit("wandb-finish", self._finish_run)
        drained = self._background.drain(self.finish_timeout_s)
        self._forget()
        if drained:
            return self.enabled
        self._background.clear()
        log.warning("W&B (%s) did not answer within %.0f s: %d of %d rows sent, the rest given up; training "
                    "goes on", wandb_mode(self.settings), self.finish_timeout_s, self.sent, self.logged)
        return False


def log_to_wandb(settings: dict, run_uri: str, record: dict, tables: Optional[dict[str, list[dict]]] = None) -> None:
    """One record's scalars at its step, and `tables` (a name such as "eval/default/step-000004" to
    its flat row dicts) as wandb.Tables, into the eft run's W&B run, from outside the workers: the
    eval task. May raise (the caller warns).

    In the process of a sink that has the run open (rank 0 under torchrun, which scores its own
    checkpoints), the row goes through that sink's queue. Elsewhere (Ray's validation task, its own
    process) the run is opened as a second writer: online in W&B's shared mode, beside rank 0's
    writer; offline (wandb 0.31 has no shared offline mode) as the same run id with
    `resume="allow"`, in a run directory of its own (`offline-run-...-<id>-eval`), which
    `wandb sync` uploads into the same run, after rank 0's, in order of start time."""
    run_id = wandb_run_id(run_uri)
    with _open_wandb_lock:
        sink = _open_wandb_runs.get(run_id)
    if sink is not None:
        # Off already if W&B failed in this attempt (that was warned about): nothing to add then.
        sink._submit(f"wandb-eval-{record['step']}-{time.monotonic_ns()}", record, tables)
        return
    run = open_wandb_run(settings, run_uri, primary=False)
    try:
        run.log(wandb_row(record, tables))
    finally:
        run.finish()
