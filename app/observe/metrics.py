"""Per-step metrics: timing without host syncs, the run's metrics segments, the progress line."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from app.storage import Store, StorageError, join

log = logging.getLogger("eft.metrics")

# Runs recorded before segments: one file, rewritten whole at each upload. Still read.
METRICS_FILE = "metrics.jsonl"
# Now: `<run>/metrics/<seq>-<writer>-<from step>.jsonl`, each uploaded once (S3 has no append).
METRICS_DIR = "metrics"
SEGMENT_NAME = re.compile(r"^(\d{8,})-([0-9a-f]+)-(\d{8,})\.jsonl$")


def segment_name(seq: int, writer: str, from_step: int) -> str:
    return f"{seq:08d}-{writer}-{from_step:08d}.jsonl"


def parse_jsonl(text: str) -> list[dict]:
    """Complete lines only: a run killed mid-write leaves a torn last line, which is dropped."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def merge_segments(segments: list[tuple[int, str, int, list[dict]]]) -> list[dict]:
    """The committed trajectory from (seq, writer, from_step, rows) segments. A writer is one
    worker-group attempt; it resumed from `from_step`, so when a new writer's segments begin,
    the rows past its `from_step` that earlier writers left are void: they were never committed
    (the attempt that wrote them died before its next checkpoint), and the new one redoes them."""
    out: list[dict] = []
    writer = None
    for _, seg_writer, from_step, rows in sorted(segments, key=lambda s: s[0]):
        if seg_writer != writer:
            out = [r for r in out if r.get("step", 0) <= from_step]
            writer = seg_writer
        out.extend(rows)
    return out


def list_segments(store: Store, run_uri: str) -> list[tuple[int, str, int, str]]:
    """(seq, writer, from_step, name) of the run's metric segments, in order."""
    found = []
    for name in store.list_files(join(run_uri, METRICS_DIR), recursive=False):
        match = SEGMENT_NAME.match(name)
        if match:
            found.append((int(match[1]), match[2], int(match[3]), name))
    return sorted(found)


def load_metrics(store: Store, run_uri: str) -> list[dict]:
    """Every committed metrics row of the run, oldest first: the old single file (if any), then
    the segments in order (read in parallel: a long run has thousands)."""
    segments: list[tuple[int, str, int, list[dict]]] = []
    legacy = join(run_uri, METRICS_FILE)
    if store.exists(legacy):
        segments.append((-1, "legacy", 0, parse_jsonl(store.read_text(legacy))))
    listed = list_segments(store, run_uri)

    def read(name: str) -> list[dict]:
        return parse_jsonl(store.read_text(join(run_uri, METRICS_DIR, name)))

    if listed:
        with ThreadPoolExecutor(max_workers=min(16, len(listed))) as pool:
            rows = list(pool.map(read, [name for *_, name in listed]))
        segments += [(seq, writer, from_step, r) for (seq, writer, from_step, _), r in zip(listed, rows)]
    return merge_segments(segments)


class MetricsLog:
    """Rank 0's record of the committed trajectory, as append-only segments: the rows logged
    since the last upload go up as one new object `<run>/metrics/<seq>-<writer>-<from step>.jsonl`
    at most every `upload_interval_s` in the background, and synchronously before each
    checkpoint, so a checkpoint never exists without the rows up to its step (unless storage
    does not take them within `flush_timeout_s`: then a warning, and they stay queued and go
    again with the next upload; a checkpoint is not held up by an outage). Each
    row is uploaded once, so the bytes grow with the steps, not their square. Only the last
    `tail_rows` rows stay in memory, plus those not yet uploaded (at most `max_unsent_rows`).
    On resume the rows past the restored step are dropped by the readers (`merge_segments`)."""

    def __init__(self, store: Store, run_uri: str, enabled: bool, upload_interval_s: float = 30.0,
                 tail_rows: int = 1000, max_unsent_rows: int = 100_000, flush_timeout_s: float = 10.0,
                 fence=None):
        from app.observe.sinks import BackgroundWriter

        self.store, self.run_uri, self.enabled = store, run_uri, enabled
        self.fence = fence  # app.lease.Fence: a segment is uploaded only while the run's lease is ours
        self.upload_interval_s, self.flush_timeout_s = upload_interval_s, flush_timeout_s
        self.max_unsent_rows = max_unsent_rows
        self.records: collections.deque = collections.deque(maxlen=tail_rows)
        self.writer_id = uuid.uuid4().hex[:8]
        self.from_step = 0
        self._seq = 0
        self._rows: list[dict] = []  # logged, not yet in a segment
        self._unsent: dict[int, list[dict]] = {}  # segments cut, not yet uploaded: seq → rows
        self._lock = threading.Lock()
        self.dropped_rows = 0
        self._uploaded_at = time.monotonic()
        self._writer = BackgroundWriter("metrics upload") if enabled else None

    def load(self, up_to_step: int) -> None:
        """Start after the restored step: new segments follow the run's existing ones."""
        if not self.enabled:
            return
        self.from_step = up_to_step
        try:
            existing = list_segments(self.store, self.run_uri)
        except (OSError, StorageError) as err:
            # Sequence numbers then start from the clock: still after any earlier attempt's.
            log.warning("metrics: cannot list %s (%s); numbering segments from the clock",
                        join(self.run_uri, METRICS_DIR), err)
            existing = [(int(time.time()), "", 0, "")]
        self._seq = existing[-1][0] + 1 if existing else 0

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self._rows.append(record)
        if time.monotonic() - self._uploaded_at >= self.upload_interval_s:
            self._upload_in_background()

    def latest(self) -> Optional[dict]:
        if not self.records:
            return None
        return {k: v for k, v in self.records[-1].items() if k != "row_ids"}

    @property
    def unsent_rows(self) -> int:
        with self._lock:
            return len(self._rows) + sum(len(r) for r in self._unsent.values())

    def _cut_segment(self) -> None:
        if not self._rows:
            return
        with self._lock:
            self._unsent[self._seq] = self._rows
            self._seq += 1
            self._rows = []
            # Storage down for long: keep the newest rows, count what is given up.
            while sum(len(r) for r in self._unsent.values()) > self.max_unsent_rows and len(self._unsent) > 1:
                oldest = min(self._unsent)
                self.dropped_rows += len(self._unsent.pop(oldest))
                log.warning("metrics: storage unreachable for long; %d rows dropped unsent so far",
                            self.dropped_rows)

    def _upload(self, seq: int) -> None:
        with self._lock:
            rows = self._unsent.get(seq)
        if rows is None:
            return
        uri = join(self.run_uri, METRICS_DIR, segment_name(seq, self.writer_id, self.from_step))
        if self.fence is not None:
            self.fence.check(self.store)
        self.store.write_text(uri, "".join(json.dumps(r) + "\n" for r in rows))
        with self._lock:
            self._unsent.pop(seq, None)

    def _upload_in_background(self) -> None:
        self._uploaded_at = time.monotonic()
        self._cut_segment()
        with self._lock:
            waiting = sorted(self._unsent)
        # Segments that failed before go again, under the same name: a retry never duplicates rows.
        for seq in waiting:
            self._writer.submit(f"metrics-{seq:08d}", lambda seq=seq: self._upload(seq))

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Upload now and wait for it (at most `timeout_s`). False, with a warning naming what
        is still unsent, if storage did not take it: training goes on, the rows stay queued."""
        if not self.enabled:
            return True
        self._upload_in_background()
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        drained = self._writer.drain(timeout_s)
        unsent = self.unsent_rows
        if not drained or unsent:
            log.warning("metrics: %d rows in %d segments not uploaded to %s after %.0f s%s; they stay queued",
                        unsent, len(self._unsent), join(self.run_uri, METRICS_DIR), timeout_s,
                        "" if drained else " (upload still running)")
            return False
        return True


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
        self.last_s: dict[str, float] = {}  # the last host-timed phase of each name, in seconds

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
        self.last_s[name] = time.perf_counter() - began
        self.sums[name] += self.last_s[name]

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
    # The preference objectives' implicit rewards: their margin and how often the chosen one wins.
    pairs = (f" margin {r['reward_margin']:.3f} acc {r['reward_accuracy']:.2f}" if "reward_margin" in r else "")
    # GRPO: the rollouts' reward, accuracy, length, and where the step's time went.
    if "reward_mean" in r:
        pairs += (f" reward {r['reward_mean']:.3f} acc {r['accuracy']:.2f} len {r['completion_len_mean']:.1f}"
                  f" zero-std {r['frac_zero_std']:.2f} rollout {r['rollout_s']:.2f}s update {r['update_s']:.2f}s")
    return (f"step {r['step']}/{total} loss {r['loss']:.4f}{pairs}{val} lr {r['lr']:.2e} gnorm {r['grad_norm']:.3f} "
            f"tok/s {r['tokens_per_s']:,.0f}{mfu} step {r['step_time_s']:.2f}s data {r['data_wait_s']:.3f}s "
            f"world {r['world_size']} eta {format_duration(r['eta_s'])}")


