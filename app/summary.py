"""`<run>/summary.json`: what a run did, machine-readable; and its table for the terminal."""

from __future__ import annotations

import time
from typing import Optional

from app.storage import Store, join
from app.train import checkpoint as ckpt
from app.train.metrics import load_metrics

SUMMARY_FILE = "summary.json"


def _first(records: list[dict], key: str) -> Optional[float]:
    return next((r[key] for r in records if key in r), None)


def _last(records: list[dict], key: str) -> Optional[float]:
    return next((r[key] for r in reversed(records) if key in r), None)


def build_summary(store: Store, cfg, status: str, wall_s: float, error: Optional[str] = None) -> dict:
    metrics = load_metrics(store, cfg.run_uri)
    events = ckpt.load_events(store, cfg.run_uri)
    starts = [e for e in events if e["kind"] == "worker_group_start"]
    drivers = [e for e in events if e["kind"] == "driver_start"]
    checkpoints = ckpt.list_checkpoints(store, cfg.run_uri)
    steps = int(_last(metrics, "step") or 0)
    return {
        "name": cfg.name,
        "status": status,
        "error": error,
        "steps": steps,
        "target_steps": cfg.training.max_steps,
        "tokens": steps * cfg.training.global_batch_size * cfg.data.seq_len,
        "rows_consumed": int(_last(metrics, "rows_consumed") or 0),
        "first_train_loss": _first(metrics, "loss"),
        "final_train_loss": _last(metrics, "loss"),
        "first_val_loss": _first(metrics, "val_loss"),
        "final_val_loss": _last(metrics, "val_loss"),
        "tokens_per_s": _last(metrics, "tokens_per_s"),
        "restarts": max(len(starts) - 1, 0),
        "driver_restarts": sum(1 for d in drivers if d.get("resumed")),
        "world_sizes": [s["world_size"] for s in starts],
        "resumed_from_steps": [s["resumed_from_step"] for s in starts if s.get("resumed_from_step") is not None],
        "checkpoints": checkpoints,
        "latest_checkpoint": checkpoints[-1] if checkpoints else None,
        "wall_s": round(wall_s, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_summary(store: Store, run_uri: str, summary: dict) -> None:
    store.write_json(join(run_uri, SUMMARY_FILE), summary)


def load_summary(store: Store, run_uri: str) -> dict:
    return store.read_json(join(run_uri, SUMMARY_FILE))


def render_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {summary['name']}: {summary['status']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    rows = [
        ("steps", f"{summary['steps']} / {summary['target_steps']}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("train loss", f"{fmt(summary['first_train_loss'])} → {fmt(summary['final_train_loss'])}"),
        ("val loss", f"{fmt(summary['first_val_loss'])} → {fmt(summary['final_val_loss'])}"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-"),
        ("restarts", f"{summary['restarts']} (driver {summary['driver_restarts']})"),
        ("world sizes", ", ".join(map(str, summary["world_sizes"]))),
        ("latest checkpoint", str(summary["latest_checkpoint"])),
        ("wall time", f"{summary['wall_s']:.1f}s"),
    ]
    if summary.get("error"):
        rows.append(("error", summary["error"]))
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
