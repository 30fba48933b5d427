"""Where rank 0's metric records go besides `<run>/metrics.jsonl`: TensorBoard event files in
the run's storage, and MLflow when a tracking URI is configured. Uploads happen on a
background thread, so the training loop never waits on storage to log."""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from app.storage import Store, join

log = logging.getLogger("eft.sinks")
SKIP = {"step", "row_ids", "world_size"}


def scalars_of(record: dict) -> dict[str, float]:
    """The plottable part of a record: finite numbers, not the step or the row trace."""
    return {k: float(v) for k, v in record.items()
            if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class BackgroundWriter:
    """Runs the latest submitted job on a thread; a newer job replaces one not yet started
    (each job writes a whole file, so only the newest matters). `drain()` waits for it."""

    def __init__(self):
        self._pending: dict[str, Callable[[], None]] = {}
        self._lock = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="eft-metrics-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, job: Callable[[], None]) -> None:
        with self._lock:
            self._pending[key] = job
            self._lock.notify_all()

    def drain(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            self._lock.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending)
                key = next(iter(self._pending))
                job = self._pending.pop(key)
                self._busy = True
            try:
                job()
            except Exception as err:  # a failed metrics upload must not stop training
                log.warning("metrics upload failed (%s): %s", key, err)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()


class TensorBoardSink:
    """Event files written locally by torch's SummaryWriter and mirrored to `<run>/tensorboard/`
    (at most every `upload_interval_s`, and at the end). `purge_step` makes TensorBoard drop
    the points past the step a resumed run restarted from."""

    def __init__(self, store: Store, run_uri: str, resumed_from_step: int, upload_interval_s: float = 30.0):
        from torch.utils.tensorboard import SummaryWriter

        self.store, self.uri = store, join(run_uri, "tensorboard")
        self.local = Path(tempfile.mkdtemp(prefix="eft-tb-"))
        self.writer = SummaryWriter(str(self.local), purge_step=resumed_from_step + 1 if resumed_from_step else None)
        self.upload_interval_s = upload_interval_s
        self._uploaded_at = time.monotonic()
        self._background = BackgroundWriter()

    def log(self, record: dict) -> None:
        for key, value in scalars_of(record).items():
            self.writer.add_scalar(key, value, record["step"])
        if time.monotonic() - self._uploaded_at >= self.upload_interval_s:
            self._uploaded_at = time.monotonic()
            self._background.submit("tensorboard", self._upload)

    def _upload(self) -> None:
        self.writer.flush()
        for path in self.local.iterdir():
            self.store.write_bytes(join(self.uri, path.name), path.read_bytes())

    def finish(self) -> None:
        self._background.submit("tensorboard", self._upload)
        self._background.drain()
        self.writer.close()


class MlflowSink:
    """One MLflow run per eft run, found again on resume by its `eft.run_uri` tag."""

    def __init__(self, settings: dict, run_uri: str, params: dict):
        os.environ.update(settings)
        from mlflow.tracking import MlflowClient

        tracking_uri, experiment = settings["MLFLOW_TRACKING_URI"], settings.get("MLFLOW_EXPERIMENT_NAME", "eft")
        self.client = MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`eft.run_uri` = '{run_uri}'",
                                       max_results=1)
        self._background = BackgroundWriter()
        if runs:
            self.run_id = runs[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, tags={"eft.run_uri": run_uri},
                                                 run_name=run_uri.rstrip("/").rsplit("/", 1)[-1]).info.run_id
            for key, value in params.items():
                self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["step"]) for k, v in scalars_of(record).items()]
        # A key per step: batches queue in order instead of replacing each other.
        self._background.submit(f"mlflow-{record['step']}",
                                lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def finish(self) -> None:
        self._background.drain()
        self.client.set_terminated(self.run_id)


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
FORWARDED_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE")


def mlflow_settings() -> Optional[dict]:
    """The MLflow settings of the driver's environment, or None when no tracking URI is set."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return {k: os.environ[k] for k in FORWARDED_MLFLOW_ENV if k in os.environ}
