"""`<run>/summary.json`: what a run did, machine-readable (`eft train` prints it through
`app.report.render_summary`)."""

from __future__ import annotations

import time
from typing import Optional

from app.data.manifest import load_manifest
from app.observe import records
from app.observe.metrics import load_metrics
from app.storage import Store, join

SUMMARY_FILE = "summary.json"


def _first(rows: list[dict], key: str) -> Optional[float]:
    return next((r[key] for r in rows if key in r), None)


def _last(rows: list[dict], key: str) -> Optional[float]:
    return next((r[key] for r in reversed(rows) if key in r), None)


def classify_interruption(between: list[dict], before: dict, after: dict) -> str:
    if any(e["kind"] == "driver_start" for e in between):
        return "driver_restart"
    if any(e["kind"] == "preemption_notice" for e in between):
        return "preemption"
    if after["world_size"] > before["world_size"]:
        return "resize"
    return "worker_failure"


# A restart from the old group's last step to the new group's first, as consecutive phases: each
# named by the mark that ends it, from the driver's events and the new rank 0's marks.
RESTART_PHASES = [
    ("detect_s", "the controller decided on the failure"),
    ("relaunch_s", "the new worker group was launched"),
    ("worker_start_s", "the train function started (actors, imports, process group)"),
    ("setup_s", "the model load began (config, data order, stream start)"),
    ("model_load_s", "the model was built and its weights loaded"),
    ("restore_s", "the checkpoint was restored"),
    ("first_batch_s", "the first batch was in hand"),
    ("first_step_s", "the first step was done"),
]


def build_restart_phases(between: list[dict], after: dict, prev: dict, nxt: dict) -> Optional[dict]:
    """Seconds per phase of one restart. A mark that was not recorded merges its phase into the
    next, so the phases always add up to the recovery time."""
    failures = [e["time"] for e in between if e["kind"] == "worker_group_failure"]
    launches = [e["time"] for e in between if e["kind"] == "worker_group_launch"]
    marks = [failures[0] if failures else None, launches[-1] if launches else None, after.get("entered_at"),
             after.get("model_load_at"), after.get("model_built_at"), after.get("restored_at"),
             nxt.get("first_batch_at"), nxt.get("first_step_at")]
    last = prev.get("last_step_at")
    if last is None or marks[-1] is None:
        return None
    phases = {}
    for (name, _), mark in zip(RESTART_PHASES, marks):
        if mark is not None and mark >= last:
            phases[name], last = round(mark - last, 2), mark
    return phases


def build_interruptions(events: list[dict], heartbeats: list[dict]) -> list[dict]:
    """One record per restart of the worker group, from the events and heartbeats of the run.

    steps_lost: steps done before the group went (its last heartbeat) that are not in the
    checkpoint resumed from: work thrown away. steps_recomputed: those of them that a later
    group ran again (fewer than lost only if the run ended first). Both come from the
    heartbeats, not the metrics rows: a resumed group's rows supersede the voided ones in the
    merged trajectory, and a group that dies never uploads the rows logged since its last
    checkpoint (rank 0 sends them at checkpoints and every 30 s), which are exactly the steps
    redone; rank 0's heartbeat marks the last step every second, and exactly at a just-in-time
    save. recovery_s: last heartbeat before it → first step after it."""
    starts = [e for e in events if e["kind"] == "worker_group_start"]
    beats = {b["attempt"]: b for b in heartbeats}
    out = []
    for i, (before, after) in enumerate(zip(starts, starts[1:])):
        if is_overlap(beats.get(before.get("id"), {}), beats.get(after.get("id"), {})):
            continue  # not a restart: two groups stepping at once (build_overlaps)
        between = [e for e in events if before["time"] < e["time"] < after["time"]]
        notices = [e for e in between if e["kind"] == "preemption_notice"]
        late_saves = [e for e in between if e["kind"] == "preemption_checkpoint"]
        prev, nxt = beats.get(before.get("id"), {}), beats.get(after.get("id"), {})
        resumed = after.get("resumed_from_step") or 0
        last = prev.get("last_step")
        # How far the groups after it got: the steps past `resumed` they ran again.
        reach = max([beats.get(s.get("id"), {}).get("last_step") or 0 for s in starts[i + 1:]] + [resumed])
        recovery = (nxt["first_step_at"] - prev["last_step_at"]
                    if nxt.get("first_step_at") and prev.get("last_step_at") else None)
        out.append({
            "cause": classify_interruption(between, before, after),
            "world_size_before": before["world_size"], "world_size_after": after["world_size"],
            "step_at_notice": notices[0]["step"] if notices else None,
            "jit_checkpoint_step": late_saves[0]["step"] if late_saves else None,
            "last_step_before": last,
            "resumed_from_step": resumed,
            "steps_lost": max(last - resumed, 0) if last is not None else None,
            "steps_recomputed": max(min(last, reach) - resumed, 0) if last is not None else None,
            "recovery_s": round(recovery, 2) if recovery is not None else None,
            "phases": build_restart_phases(between, after, prev, nxt),
        })
    return out


def is_overlap(prev: dict, nxt: dict) -> bool:
    """A group that took its first step before the group started ahead of it took its last:
    two drivers on one run at once (before the run lease, or a lease's last write let through)."""
    return bool(prev.get("last_step_at") and nxt.get("first_step_at") and nxt["first_step_at"] < prev["last_step_at"])


def build_overlaps(events: list[dict], heartbeats: list[dict]) -> list[dict]:
    """Consecutive worker groups that stepped at the same time: said as such, never counted as
    an interruption with a negative recovery."""
    starts = [e for e in events if e["kind"] == "worker_group_start"]
    beats = {b["attempt"]: b for b in heartbeats}
    out = []
    for before, after in zip(starts, starts[1:]):
        prev, nxt = beats.get(before.get("id"), {}), beats.get(after.get("id"), {})
        if is_overlap(prev, nxt):
            out.append({"attempts": [before.get("id"), after.get("id")],
                        "overlap_s": round(prev["last_step_at"] - nxt["first_step_at"], 2),
                        "steps_before": [prev.get("first_step"), prev.get("last_step")],
                        "steps_after": [nxt.get("first_step"), nxt.get("last_step")]})
    return out


def latest_nccl(events: list[dict]) -> Optional[dict]:
    """What NCCL picked at the latest start (GPU runs only): network, plugin, fallback warning."""
    return next(({k: v for k, v in e.items() if k not in ("kind", "time", "id")}
                 for e in reversed(events) if e["kind"] == "nccl_transport"), None)


def rows_per_epoch(rows_consumed: int, train_rows: int) -> list[int]:
    """Rows consumed in each epoch so far (the data order makes each epoch's rows distinct)."""
    if train_rows <= 0:
        return []
    full, rest = divmod(rows_consumed, train_rows)
    return [train_rows] * full + ([rest] if rest else [])


def build_summary(store: Store, cfg, status: str, wall_s: float, checkpoints: list[str],
                  error: Optional[str] = None) -> dict:
    """The run's summary from its records; `checkpoints` are its complete checkpoints, oldest first."""
    metrics = load_metrics(store, cfg.run_uri)
    events = records.load_events(store, cfg.run_uri)
    heartbeats = records.load_heartbeats(store, cfg.run_uri)
    starts = [e for e in events if e["kind"] == "worker_group_start"]
    drivers = [e for e in events if e["kind"] == "driver_start"]
    steps = int(_last(metrics, "step") or 0)
    rows = int(_last(metrics, "rows_consumed") or 0)
    train_rows = load_manifest(store, cfg.data.uri)["splits"]["train"]["rows"]
    return {
        "name": cfg.name,
        "status": status,
        "error": error,
        "steps": steps,
        "target_steps": cfg.training.max_steps,
        "tokens": steps * cfg.training.global_batch_size * cfg.data.seq_len,
        "rows_consumed": rows,
        "train_rows_per_epoch": train_rows,
        "rows_consumed_per_epoch": rows_per_epoch(rows, train_rows),
        "first_train_loss": _first(metrics, "loss"),
        "final_train_loss": _last(metrics, "loss"),
        "first_val_loss": _first(metrics, "val_loss"),
        "final_val_loss": _last(metrics, "val_loss"),
        "tokens_per_s": _last(metrics, "tokens_per_s"),
        "restarts": max(len(starts) - 1, 0),
        "driver_restarts": sum(1 for d in drivers if d.get("resumed")),
        # How each driver ran the loop ("ray" or "torchrun"): a run may move between them.
        "launchers": [d.get("launcher", "ray") for d in drivers],
        "world_sizes": [s["world_size"] for s in starts],
        "world_size_timeline": [{"time": s["time"], "world_size": s["world_size"],
                                 "from_step": s.get("resumed_from_step") or 0} for s in starts],
        "interruptions": build_interruptions(events, heartbeats),
        "overlapping_attempts": build_overlaps(events, heartbeats),
        "preemption_notices": [{"step": e["step"], "deadline_ms": e.get("deadline_ms"), "nodes": e.get("nodes"),
                                "plan": e.get("plan"), "fallback": e.get("fallback")}
                               for e in events if e["kind"] == "preemption_notice"],
        # The late just-in-time saves: their step, and how long before the deadline they were up.
        "preemption_checkpoints": [{"step": e["step"], "notice_step": e.get("notice_step"),
                                    "seconds_left": e.get("seconds_left"), "time": e["time"]}
                                   for e in events if e["kind"] == "preemption_checkpoint"],
        "resumed_from_steps": [s["resumed_from_step"] for s in starts if s.get("resumed_from_step") is not None],
        "nccl": latest_nccl(events),
        "checkpoints": checkpoints,
        "latest_checkpoint": checkpoints[-1] if checkpoints else None,
        "wall_s": round(wall_s, 2),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_summary(store: Store, run_uri: str, summary: dict) -> None:
    store.write_json(join(run_uri, SUMMARY_FILE), summary)


def load_summary(store: Store, run_uri: str) -> dict:
    return store.read_json(join(run_uri, SUMMARY_FILE))
