"""What rank 0's metrics cost in uploads over a run: bytes and PUTs of the real `MetricsLog`
(append-only segments, each row uploaded once) against the policy it replaced, measured in the
same run on the same rows: the whole `metrics.jsonl` rewritten at every upload (every 10 s and
before every checkpoint), whose bytes grow with the square of the steps.

    .venv/bin/python bench/metrics_upload.py [--steps 200 2000 20000] [--step-s 0.5] [--save-every 20]

Both write through a real `Store` on local disk that counts the bytes and objects it is handed;
the clock is simulated (`--step-s` seconds a step, the tiny-cpu cadence by default), so the
numbers depend on the policy, not on the box. The rows are shaped like a real tiny-cpu metrics
row. No Ray, no network, a few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

REWRITE_INTERVAL_S = 10.0  # the replaced policy's background upload interval


def build_row(step: int) -> dict:
    return {"step": step, "loss": 5.123456789 - step * 1e-4, "lr": 0.01, "grad_norm": 0.123456789,
            "world_size": 2, "rows_consumed": step * 8, "epoch": step * 8 / 3000, "step_time_s": 0.5,
            "data_wait_s": 0.001, "compute_s": 0.4, "optimizer_s": 0.05, "checkpoint_blocked_s": 0.0,
            "tokens_per_s": 2048.0, "eta_s": 10.0, "elapsed_s": step * 0.5, "peak_rss_gb": 1.234,
            "tokens_per_s_per_worker": 1024.0, "mfu": None}


def build_counting_store():
    from app.storage import Store

    class CountingStore(Store):
        def __init__(self):
            super().__init__()
            self.bytes, self.puts = 0, 0

        def write_bytes(self, uri, data, *args, **kwargs):
            self.bytes += len(data)
            self.puts += 1
            return super().write_bytes(uri, data, *args, **kwargs)

        def write_text(self, uri, text, *args, **kwargs):
            return self.write_bytes(uri, text.encode(), *args, **kwargs)

    return CountingStore()


def measure_segments(steps: int, step_s: float, save_every: int) -> tuple[int, int]:
    from app.observe import metrics

    clock = [0.0]
    store = build_counting_store()
    with tempfile.TemporaryDirectory() as run_dir, \
            mock.patch.object(metrics.time, "monotonic", lambda: clock[0]):
        log = metrics.MetricsLog(store, run_dir, enabled=True)
        log.load(up_to_step=0)
        for step in range(1, steps + 1):
            clock[0] += step_s
            log.append(build_row(step))
            if step % save_every == 0 or step == steps:
                assert log.flush(timeout_s=60), "segments did not drain"
        uploaded = metrics.load_metrics(store, run_dir)
    assert [r["step"] for r in uploaded] == list(range(1, steps + 1)), "segments lost or duplicated rows"
    return store.bytes, store.puts


def measure_rewrite(steps: int, step_s: float, save_every: int) -> tuple[int, int]:
    store = build_counting_store()
    with tempfile.TemporaryDirectory() as run_dir:
        uri = str(Path(run_dir) / "metrics.jsonl")
        text, now, uploaded_at = "", 0.0, 0.0
        for step in range(1, steps + 1):
            now += step_s
            text += json.dumps(build_row(step)) + "\n"
            if now - uploaded_at >= REWRITE_INTERVAL_S or step % save_every == 0 or step == steps:
                store.write_text(uri, text)
                uploaded_at = now
    return store.bytes, store.puts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[200, 2000, 20000])
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--save-every", type=int, default=20)
    args = parser.parse_args()

    results, rows = [], []
    for steps in args.steps:
        seg_bytes, seg_puts = measure_segments(steps, args.step_s, args.save_every)
        old_bytes, old_puts = measure_rewrite(steps, args.step_s, args.save_every)
        ratio = old_bytes / seg_bytes
        results.append({"steps": steps, "segments_bytes": seg_bytes, "segments_puts": seg_puts,
                        "rewrite_bytes": old_bytes, "rewrite_puts": old_puts, "rewrite_over_segments": ratio})
        rows.append([f"{steps:,}", f"{old_bytes:,}", f"{old_puts:,}", f"{seg_bytes:,}", f"{seg_puts:,}",
                     f"**{ratio:.1f}×**"])
    table = (f"Metrics uploads over a run ({args.step_s:g} s a step, a checkpoint every {args.save_every} steps; "
             "real `MetricsLog` vs the whole-file rewrite it replaced, same rows, same run):\n\n"
             + markdown_table(["steps", "rewrite bytes", "rewrite PUTs", "segments bytes", "segments PUTs",
                               "rewrite / segments bytes"], rows)
             + "\n\nSegments grow with the steps; the rewrite with their square, so the ratio grows with the run.")
    save_result("metrics_upload", {"step_s": args.step_s, "save_every_steps": args.save_every,
                                   "results": results}, table)


if __name__ == "__main__":
    main()
