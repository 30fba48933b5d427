"""Per-step metrics: timing without host syncs, the run's metrics.jsonl, the progress line."""

from __future__ import annotations

import contextlib
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
    """Rank 0's record of the committed trajectory, `<run>/metrics.jsonl`, rewritten whole (S3
    has no append) in the background at most every `upload_interval_s`, and synchronously before
    each checkpoint, so a checkpoint never exists without the lines up to its step. On resume,
    lines past the restored step are dropped: they were never committed."""

    def __init__(self, store: Store, run_uri: str, enabled: bool, upload_interval_s: float = 10.0):
        from app.train.sinks import BackgroundWriter

        self.store, self.uri, self.enabled = store, join(run_uri, METRICS_FILE), enabled
        self.upload_interval_s = upload_interval_s
        self.records: list[dict] = []
        self._uploaded_at = time.monotonic()
        self._writer = BackgroundWriter() if enabled else None

    def load(self, up_to_step: int) -> None:
        if self.enabled and self.store.exists(self.uri):
            self.records = [r for r in parse_jsonl(self.store.read_text(self.uri)) if r.get("step", 0) <= up_to_step]

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        if time.monotonic() - self._uploaded_at >= self.upload_interval_s:
            self._upload_in_background()

    def latest(self) -> Optional[dict]:
        if not self.records:
            return None
        return {k: v for k, v in self.records[-1].items() if k != "row_ids"}

    def _upload_in_background(self) -> None:
        self._uploaded_at = time.monotonic()
        # The job reads the records when it runs, not now: a late job never writes an old list.
        self._writer.submit("metrics.jsonl", lambda: self.store.write_text(
            self.uri, "".join(json.dumps(r) + "\n" for r in list(self.records))))

    def flush(self) -> None:
        """Upload now and wait for it."""
        if self.enabled:
            self._upload_in_background()
            self._writer.drain()


class StepTimer:
    """Where a step's time goes, averaged over a logging interval: waiting for data, forward +
    backward, optimizer, and time blocked on checkpoints. On CUDA the compute phases are timed
    with CUDA events, read at the logging step (whose sync is there anyway); elsewhere, and for
    host-side phases, host clocks."""

    PHASES = ("data", "compute", "optimizer", "checkpoint")

    def __init__(self, total_steps: int, start_step: int, device=None):
        self.total, self.start_step = total_steps, start_step
        self.cuda = getattr(device, "type", None) == "cuda"
        self.t0 = self.mark = time.perf_counter()
        self.sums = dict.fromkeys(self.PHASES, 0.0)
        self.events: list = []
        self.steps = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda and name in ("compute", "optimizer"):
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((name, start, end))
            return
        began = time.perf_counter()
        yield
        self.sums[name] += time.perf_counter() - began

    def skip_step(self) -> None:
        self.steps += 1

    def end_step(self, step: int, tokens_per_step: int) -> dict:
        """Called on logging steps, after their sync."""
        self.steps += 1
        for name, start, end in self.events:
            self.sums[name] += start.elapsed_time(end) / 1000
        now = time.perf_counter()
        step_s = (now - self.mark) / self.steps
        out = {"step_time_s": step_s, "data_wait_s": self.sums["data"] / self.steps,
               "compute_s": self.sums["compute"] / self.steps, "optimizer_s": self.sums["optimizer"] / self.steps,
               # Checkpoints are rare: the total blocked since the last log says more than an average.
               "checkpoint_blocked_s": self.sums["checkpoint"],
               "tokens_per_s": tokens_per_step / step_s if step_s > 0 else 0.0,
               "eta_s": step_s * (self.total - step), "elapsed_s": now - self.t0}
        self.mark, self.steps, self.events = now, 0, []
        self.sums = dict.fromkeys(self.PHASES, 0.0)
        return out


def peak_memory(device) -> dict:
    """Peak accelerator memory allocated (GPU), or the process's peak resident set (CPU)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        return {"peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9}
    import resource

    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}  # KiB on Linux


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_progress(r: dict, total: int) -> str:
    val = f" val {r['val_loss']:.4f}" if "val_loss" in r else ""
    mfu = f" mfu {r['mfu']:.1%}" if r.get("mfu") is not None else ""
    return (f"step {r['step']}/{total} loss {r['loss']:.4f}{val} lr {r['lr']:.2e} gnorm {r['grad_norm']:.3f} "
            f"tok/s {r['tokens_per_s']:,.0f}{mfu} step {r['step_time_s']:.2f}s data {r['data_wait_s']:.3f}s "
            f"world {r['world_size']} eta {format_duration(r['eta_s'])}")


class Heartbeat:
    """Rank 0's progress marker for one worker-group attempt: `<run>/heartbeats/<attempt>.json`
    with the first and the last step it reached and when. Interruption accounting (steps
    recomputed, seconds to recover) is read from these. Written at most every `interval_s`, on a
    background thread: the other ranks wait at the next collective for whatever rank 0 does in
    the step, so a storage round trip here would slow every rank."""

    def __init__(self, store: Store, run_uri: str, attempt: str, enabled: bool, interval_s: float = 1.0, **fields):
        from app.train.sinks import BackgroundWriter

        self.store, self.enabled, self.interval_s = store, enabled, interval_s
        self.uri = join(run_uri, "heartbeats", f"{attempt}.json")
        self.state = {"attempt": attempt, "started_at": time.time(), "first_step": None, "first_step_at": None,
                      "last_step": None, "last_step_at": None, **fields}
        self._written = 0.0
        self._writer = BackgroundWriter() if enabled else None

    def beat(self, step: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self.state["first_step"] is None:
            self.state.update(first_step=step, first_step_at=now)
            force = True
        self.state.update(last_step=step, last_step_at=now)
        if force or now - self._written >= self.interval_s:
            snapshot = dict(self.state)
            self._writer.submit(self.uri, lambda: self.store.write_json(self.uri, snapshot))
            self._written = now

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.drain()


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
