"""Per-step metrics: timing without host syncs, the run's metrics.jsonl, the progress line."""

from __future__ import annotations

import json
import time
from typing import Optional

from app.storage import Store, join

METRICS_FILE = "metrics.jsonl"


def parse_jsonl(text: str) -> list[dict]:
    """Complete lines only: a run killed mid-write leaves a torn last line, which is dropped."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_metrics(store: Store, run_uri: str) -> list[dict]:
    uri = join(run_uri, METRICS_FILE)
    return parse_jsonl(store.read_text(uri)) if store.exists(uri) else []


class MetricsLog:
    """Rank 0's record of the committed trajectory; rewritten whole at checkpoints (S3 has no
    append). On resume, lines past the restored step are dropped: they were never committed."""

    def __init__(self, store: Store, run_uri: str, enabled: bool):
        self.store, self.uri, self.enabled = store, join(run_uri, METRICS_FILE), enabled
        self.records: list[dict] = []

    def load(self, up_to_step: int) -> None:
        if self.enabled and self.store.exists(self.uri):
            self.records = [r for r in parse_jsonl(self.store.read_text(self.uri)) if r.get("step", 0) <= up_to_step]

    def append(self, record: dict) -> None:
        if self.enabled:
            self.records.append(record)

    def latest(self) -> Optional[dict]:
        if not self.records:
            return None
        return {k: v for k, v in self.records[-1].items() if k != "row_ids"}

    def flush(self) -> None:
        if self.enabled:
            self.store.write_text(self.uri, "".join(json.dumps(r) + "\n" for r in self.records))


class StepTimer:
    """Wall time per step and time spent waiting for data, averaged over a logging interval.
    Host-side clocks only; the logging step's sync makes the interval average exact."""

    def __init__(self, total_steps: int, start_step: int):
        self.total, self.start_step = total_steps, start_step
        self.t0 = self.mark = time.perf_counter()
        self.data_s = 0.0
        self.steps = 0
        self._data_start = 0.0

    def start_data(self) -> None:
        self._data_start = time.perf_counter()

    def end_data(self) -> None:
        self.data_s += time.perf_counter() - self._data_start

    def skip_step(self) -> None:
        self.steps += 1

    def end_step(self, step: int, tokens_per_step: int) -> dict:
        self.steps += 1
        now = time.perf_counter()
        step_s = (now - self.mark) / self.steps
        out = {"step_time_s": step_s, "data_wait_s": self.data_s / self.steps,
               "tokens_per_s": tokens_per_step / step_s if step_s > 0 else 0.0,
               "eta_s": step_s * (self.total - step), "elapsed_s": now - self.t0}
        self.mark, self.data_s, self.steps = now, 0.0, 0
        return out


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_progress(r: dict, total: int) -> str:
    val = f" val {r['val_loss']:.4f}" if "val_loss" in r else ""
    return (f"step {r['step']}/{total} loss {r['loss']:.4f}{val} lr {r['lr']:.2e} gnorm {r['grad_norm']:.3f} "
            f"tok/s {r['tokens_per_s']:,.0f} step {r['step_time_s']:.2f}s data {r['data_wait_s']:.3f}s "
            f"world {r['world_size']} eta {format_duration(r['eta_s'])}")


class Heartbeat:
    """Rank 0's progress marker for one worker-group attempt: `<run>/heartbeats/<attempt>.json`
    with the first and the last step it reached and when. Interruption accounting (steps
    recomputed, seconds to recover) is read from these. Written at most every `interval_s`."""

    def __init__(self, store: Store, run_uri: str, attempt: str, enabled: bool, interval_s: float = 1.0, **fields):
        self.store, self.enabled, self.interval_s = store, enabled, interval_s
        self.uri = join(run_uri, "heartbeats", f"{attempt}.json")
        self.state = {"attempt": attempt, "started_at": time.time(), "first_step": None, "first_step_at": None,
                      "last_step": None, "last_step_at": None, **fields}
        self._written = 0.0

    def beat(self, step: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self.state["first_step"] is None:
            self.state.update(first_step=step, first_step_at=now)
            force = True
        self.state.update(last_step=step, last_step_at=now)
        if force or now - self._written >= self.interval_s:
            self.store.write_json(self.uri, self.state)
            self._written = now


def load_heartbeats(store: Store, run_uri: str) -> list[dict]:
    """Read while the run writes them: one caught mid-overwrite is skipped, not fatal."""
    from app.storage import StorageError

    root = join(run_uri, "heartbeats")
    beats = []
    for name in store.list_files(root):
        try:
            beats.append(store.read_json(join(root, name)))
        except StorageError:
            continue
    return sorted(beats, key=lambda b: b["started_at"])
