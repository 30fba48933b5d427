"""`eft status` and `eft report`: read one run's records and present them.

A run's records (`<run>/config.yaml`, `metrics/`, `events/`, `heartbeats/`,
`checkpoint-*/`, `summary.json`) are read with the same loaders the trainer uses, then turned
into one status dict. That dict is shown as a table, as JSON, or as a Markdown page beside
a PNG of the loss curves. Values a run did not record are None (shown as "-"), never estimated.
"""

from __future__ import annotations

import calendar
import io
import math
import time
from typing import Optional

from app.config import DEFAULT_SET
from app.elastic import checkpoint as ckpt
from app.elastic.resume import CONFIG_FILE, load_run_config
from app.eval.results import load_predictions, load_results, load_summaries
from app.lease import describe_run_lease
from app.observe import records
from app.observe.metrics import format_duration, load_metrics
from app.observe.summary import SUMMARY_FILE, build_interruptions, build_overlaps, latest_nccl, load_summary
from app.storage import Store, join

REPORT_DIR = "report"
PLOT_FILE = "loss.png"
EVAL_PLOT_FILE = "eval.png"
MARKDOWN_FILE = "report.md"
# Rank 0 writes its heartbeat at least once a second while it steps, and again after every
# checkpoint save: two minutes of silence means the worker group is gone (or hung).
STALE_HEARTBEAT_S = 120.0
NO_VALIDATION_NOTE = "no validation split: train loss only"


# -- load ---------------------------------------------------------------------------


def load_run(store: Store, run_uri: str) -> dict:
    """Every record of the run at `run_uri`; ValueError if nothing there looks like a run."""
    run_uri = run_uri.rstrip("/")
    store.check_reachable(run_uri)
    config = load_run_config(store, run_uri)
    evals = load_results(store, run_uri)
    harness = [s for s in load_summaries(store, run_uri) if s.get("harness")]
    metrics = merge_eval_metrics(load_metrics(store, run_uri), evals)
    events = records.load_events(store, run_uri)
    if config is None and not metrics and not events and not evals and not harness:
        raise ValueError(f"{run_uri}: no run here (no {CONFIG_FILE}, metrics or events/)")
    has_summary = store.exists(join(run_uri, SUMMARY_FILE))
    return {
        "uri": run_uri,
        "config": config or {},
        "metrics": metrics,
        "events": events,
        "heartbeats": records.load_heartbeats(store, run_uri),
        "checkpoints": ckpt.list_checkpoints(store, run_uri),
        "summary": load_summary(store, run_uri) if has_summary else None,
        "lease": describe_run_lease(store, run_uri),
        "evals": evals,
        "harness": harness,
    }


def merge_eval_metrics(metrics: list[dict], evals: list[dict]) -> list[dict]:
    """The evaluated checkpoints' scores as `eval_<set>_<metric>` (and its interval) on the metrics
    row of their step; a step without a row (an eval of a step whose rows were void) gets a row of
    its own."""
    by_step = {r.get("step"): r for r in metrics}
    extra = []
    for result in evals:
        if result.get("checkpoint", {}).get("kind") != "checkpoint" or result.get("step") is None:
            continue
        key = f"eval_{result.get('set', DEFAULT_SET)}_{result['metric']}"
        row = by_step.get(result["step"])
        if row is None:
            row = {"step": result["step"]}
            extra.append(row)
        row.update({key: result["score"], f"{key}_low": result["interval"][0], f"{key}_high": result["interval"][1]})
    return sorted(metrics + extra, key=lambda r: r.get("step", 0)) if extra else metrics


# -- derive -------------------------------------------------------------------------


def parse_utc(stamp: Optional[str]) -> Optional[float]:
    if not stamp:
        return None
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def current_summary(run: dict) -> Optional[dict]:
    """summary.json, unless a driver started after it was written: re-running `eft train`
    with the same name resumes the run, and the old summary stays until the new driver ends."""
    summary = run["summary"]
    if not summary:
        return None
    finished = parse_utc(summary.get("finished_at"))
    drivers = [e["time"] for e in run["events"] if e["kind"] == "driver_start"]
    # finished_at is truncated to the second: only a driver start a full second later is newer.
    if finished is not None and drivers and max(drivers) > finished + 1:
        return None
    return summary


def newest_heartbeat(heartbeats: list[dict]) -> Optional[dict]:
    stepped = [b for b in heartbeats if b.get("last_step_at")]
    return max(stepped, key=lambda b: b["last_step_at"], default=None)


def run_state(run: dict, now: Optional[float] = None) -> str:
    summary = current_summary(run)
    if summary:
        return summary["status"]
    beat = newest_heartbeat(run["heartbeats"])
    if beat is None:
        return "stopped (no heartbeat)" if run["metrics"] else "not started"
    age = (time.time() if now is None else now) - beat["last_step_at"]
    return "running" if age < STALE_HEARTBEAT_S else f"stopped (no heartbeat for {age:.0f} s)"


def last_value(records: list[dict], key: str):
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def current_step(run: dict) -> int:
    """Heartbeats first: metrics are uploaded every 30 s and at checkpoints, so they trail them."""
    summary = current_summary(run)
    if summary and summary.get("steps") is not None:
        return int(summary["steps"])
    beat = newest_heartbeat(run["heartbeats"])
    if beat and beat.get("last_step") is not None:
        return int(beat["last_step"])
    return int(last_value(run["metrics"], "step") or 0)


def total_steps(run: dict) -> Optional[int]:
    configured = (run["config"].get("training") or {}).get("max_steps")
    return configured or (run["summary"] or {}).get("target_steps")


def build_val_ppl(metrics: list[dict]) -> Optional[float]:
    record = next((r for r in reversed(metrics) if r.get("val_loss") is not None), None)
    if record is None:
        return None
    if record.get("val_ppl") is not None:
        return record["val_ppl"]
    # exp overflows a float past ~709; a loss that large has no meaningful perplexity anyway.
    return math.exp(record["val_loss"]) if record["val_loss"] < 700 else math.inf


def estimate_eta(latest: dict, step: int) -> Optional[float]:
    """The newest record's ETA, less the steps done since it at that record's pace (the record
    can trail the heartbeat by up to a checkpoint interval)."""
    if latest.get("eta_s") is None:
        return None
    behind = step - latest.get("step", step)
    pace = latest.get("step_time_s") or 0.0
    return max(latest["eta_s"] - max(behind, 0) * pace, 0.0)


def build_world_size_timeline(events: list[dict]) -> list[dict]:
    return [{"time": e["time"], "world_size": e["world_size"], "from_step": e.get("resumed_from_step") or 0}
            for e in events if e["kind"] == "worker_group_start"]


# The preference objectives' metrics `eft status` shows (app/train/objective.py logs them).
PAIR_STATUS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "val_reward_accuracy")
# GRPO's rollout metrics `eft status` shows (app/rl/colocated.py logs them).
RL_STATUS = ("reward_mean", "reward_std", "accuracy", "pass_at_g", "frac_zero_std", "completion_len_mean",
             "truncated_frac", "rollout_s", "update_s")


def build_status(run: dict, now: Optional[float] = None) -> dict:
    """The status of a run as plain JSON-able values; None where the run recorded nothing."""
    metrics, summary = run["metrics"], current_summary(run)
    latest = metrics[-1] if metrics else {}
    state = run_state(run, now)
    step = current_step(run)
    checkpoints = run["checkpoints"]
    interruptions = build_interruptions(run["events"], run["heartbeats"])
    return {
        "uri": run["uri"],
        "name": run["config"].get("name") or (run["summary"] or {}).get("name") or run["uri"].rsplit("/", 1)[-1],
        "state": state,
        "step": step,
        "total_steps": total_steps(run),
        "metrics_step": latest.get("step"),
        "tokens_per_s": latest.get("tokens_per_s"),
        "tokens_per_s_per_worker": latest.get("tokens_per_s_per_worker"),
        "mfu": latest.get("mfu"),
        "peak_mem_gb": latest.get("peak_mem_gb") or latest.get("peak_rss_gb"),
        "peak_mem_kind": "GPU" if latest.get("peak_mem_gb") is not None else "host RSS",
        "train_loss": last_value(metrics, "loss"),
        "val_loss": last_value(metrics, "val_loss"),
        "val_ppl": build_val_ppl(metrics),
        # The preference objectives' implicit rewards (None for SFT runs).
        **{name: last_value(metrics, name) for name in PAIR_STATUS},
        # GRPO's rollouts (None for the other objectives).
        **{name: last_value(metrics, name) for name in RL_STATUS},
        "eta_s": estimate_eta(latest, step) if state == "running" else None,
        "restarts": len(interruptions),
        "interruptions": interruptions,
        "preemption_notices": [e["step"] for e in run["events"] if e["kind"] == "preemption_notice"],
        "world_size_timeline": build_world_size_timeline(run["events"]),
        "checkpoints": len(checkpoints),
        "latest_checkpoint": checkpoints[-1] if checkpoints else None,
        "nccl": latest_nccl(run["events"]),
        "error": (summary or {}).get("error"),
        # Who holds the run now (the run lease), while a driver is live.
        "lease": run.get("lease"),
        "overlapping_attempts": build_overlaps(run["events"], run["heartbeats"]),
        "eval": summarize_eval(run.get("evals") or [], run.get("harness") or []),
    }


def summarize_eval(evals: list[dict], harness: Optional[list[dict]] = None) -> Optional[dict]:
    """The latest evaluation (highest step) and the base's, per set, for status lines; and the grid
    of every set and harness task × evaluated label."""
    if not evals and not harness:
        return None
    pick = lambda r: {k: r.get(k) for k in ("label", "set", "metric", "score", "interval", "n", "step")}  # noqa: E731
    sets = {}
    for name in dict.fromkeys(r.get("set", DEFAULT_SET) for r in evals):
        ours = [r for r in evals if r.get("set", DEFAULT_SET) == name]
        tuned = [r for r in ours if r["label"] != "base"]
        base = next((r for r in ours if r["label"] == "base"), None)
        sets[name] = {"latest": pick(tuned[-1]) if tuned else None, "base": pick(base) if base else None}
    first = next(iter(sets.values()), {"latest": None, "base": None})
    return {"latest": first["latest"], "base": first["base"], "sets": sets,
            "grid": build_eval_grid(evals, harness or [])}


def build_eval_grid(evals: list[dict], harness: list[dict]) -> dict:
    """Rows: each set (its metric) and each harness task; columns: the evaluated labels in step
    order; cells: the score with its 95% interval (sets) or lm-eval's standard error (tasks)."""
    order = lambda item: (item[1] is not None, item[1] or 0, item[0].startswith("export"), item[0])  # noqa: E731
    labels = [label for label, _ in sorted({(r["label"], r.get("step")) for r in evals}
                                           | {(h["label"], h.get("step")) for h in harness}, key=order)]
    rows = []
    for name in dict.fromkeys(r.get("set", DEFAULT_SET) for r in evals):
        ours = {r["label"]: r for r in evals if r.get("set", DEFAULT_SET) == name}
        metric = next(iter(ours.values()))["metric"]
        rows.append({"name": name, "kind": "set", "metric": metric,
                     "cells": {label: {"score": r["score"], "interval": r["interval"], "n": r["n"]}
                               for label, r in ours.items()}})
    tasks = dict.fromkeys(task for h in harness for task in h["harness"])
    for task in tasks:
        cells = {h["label"]: h["harness"][task] for h in harness if task in h["harness"]}
        rows.append({"name": task, "kind": "harness", "metric": next(iter(cells.values()))["metric"],
                     "cells": {label: {"score": c["score"], "stderr": c.get("stderr"), "n": c.get("n")}
                               for label, c in cells.items()}})
    return {"labels": labels, "rows": rows}


def format_grid_cell(cell: Optional[dict]) -> str:
    if cell is None:
        return "-"
    if "interval" in cell:
        return f"{cell['score']:.3f} ({cell['interval'][0]:.3f}-{cell['interval'][1]:.3f})"
    stderr = cell.get("stderr")
    return f"{cell['score']:.3f}" + (f" ± {stderr:.3f}" if stderr is not None else "")


def build_grid_table(grid: dict, title: str = "eval: sets and harness tasks × checkpoints"):
    """The grid as a rich Table: one row per set or task, one column per label."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("set / task")
    table.add_column("metric")
    for label in grid["labels"]:
        table.add_column(label)
    for row in grid["rows"]:
        name = row["name"] if row["kind"] == "set" else f"{row['name']} (harness)"
        table.add_row(name, row["metric"], *[format_grid_cell(row["cells"].get(label)) for label in grid["labels"]])
    return table


def render_grid_markdown(grid: dict) -> str:
    return render_markdown_table(
        ["set / task", "metric", *grid["labels"]],
        [[row["name"] if row["kind"] == "set" else f"{row['name']} (harness)", row["metric"],
          *[format_grid_cell(row["cells"].get(label)) for label in grid["labels"]]] for row in grid["rows"]])


# -- present ------------------------------------------------------------------------


def format_value(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def format_interruption(item: dict) -> str:
    notice = f", notice at step {item['step_at_notice']}" if item.get("step_at_notice") is not None else ""
    return (f"{item['cause']} (world {item['world_size_before']}→{item['world_size_after']}, "
            f"resumed from step {item['resumed_from_step']}{notice})")


def format_tokens(status: dict) -> str:
    text = format_value(status["tokens_per_s"], ",.0f")
    per_worker = status["tokens_per_s_per_worker"]
    return text if per_worker is None else f"{text} ({per_worker:,.0f} per worker)"


def format_losses(status: dict) -> tuple[str, str]:
    """(train, validation): each loss with the step it is from, and the validation perplexity."""
    train = format_value(status["train_loss"], ".4f")
    if status["train_loss"] is not None and status["metrics_step"] is not None:
        train += f" (step {status['metrics_step']})"
    val = format_value(status["val_loss"], ".4f")
    if status["val_ppl"] is not None:
        val += f" (perplexity {status['val_ppl']:.2f})"
    return train, val


def format_rewards(status: dict) -> list[tuple[str, str]]:
    """The preference objectives' rows (the implicit rewards and how often the chosen one wins), or
    GRPO's (the rollouts' reward, accuracy, lengths and where a step's time goes)."""
    if status.get("reward_mean") is not None:
        return [("reward", f"{status['reward_mean']:.3f} (std {status['reward_std']:.3f})"),
                ("accuracy", f"{status['accuracy']:.2f} (pass@G {status['pass_at_g']:.2f}, "
                             f"zero-std groups {status['frac_zero_std']:.2f})"),
                ("completions", f"{status['completion_len_mean']:.1f} tokens on average, "
                                f"{status['truncated_frac']:.0%} truncated"),
                ("step time", f"rollout {status['rollout_s']:.2f} s, update {status['update_s']:.2f} s")]
    if status.get("reward_margin") is None:
        return []
    return [("rewards", f"chosen {status['rewards_chosen']:.3f}, rejected {status['rewards_rejected']:.3f}, "
                        f"margin {status['reward_margin']:.3f}"),
            ("reward accuracy", f"{status['reward_accuracy']:.2f}"
                                + (f" (validation {status['val_reward_accuracy']:.2f})"
                                   if status.get("val_reward_accuracy") is not None else ""))]


def format_restarts(status: dict) -> str:
    if not status["interruptions"]:
        return "0"
    return f"{status['restarts']}: " + "; ".join(map(format_interruption, status["interruptions"]))


def format_timeline(status: dict) -> str:
    return " → ".join(f"{w['world_size']} (from step {w['from_step']})" for w in status["world_size_timeline"]) or "-"


def format_nccl(nccl: dict) -> list[tuple[str, str]]:
    rows = [("NCCL network", f"{nccl.get('network') or 'unknown'} (fabric {nccl.get('fabric') or 'none'}, "
                             f"{nccl.get('nodes')} node(s), GPUDirect RDMA {'yes' if nccl.get('gdr') else 'no'})")]
    return rows + [("NCCL warning", nccl["fallback"])] if nccl.get("fallback") else rows


def format_restart_phases(phases: Optional[dict]) -> str:
    if not phases:
        return "-"
    return ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {value:.1f}" for name, value in phases.items())


def build_status_rows(status: dict) -> list[tuple[str, str]]:
    """(label, text) pairs shared by the terminal table and the Markdown page."""
    train, val = format_losses(status)
    rows = [
        ("state", status["state"]),
        ("step", f"{status['step']} / {format_value(status['total_steps'])}"),
        ("tokens/s", format_tokens(status)),
        # Printed as recorded: whether a future writer logs MFU as a fraction or a percentage is its call.
        ("MFU", "- (no peak FLOP/s known for this device)" if status["mfu"] is None else f"{status['mfu']:.1%}"),
        ("peak memory", "-" if status["peak_mem_gb"] is None
         else f"{status['peak_mem_gb']:.2f} GB ({status['peak_mem_kind']})"),
        ("train loss", train),
        ("val loss", val),
        *format_rewards(status),
        ("ETA", "-" if status["eta_s"] is None else format_duration(status["eta_s"])),
        ("restarts", format_restarts(status)),
        ("pre-emption notices", ", ".join(f"step {s}" for s in status["preemption_notices"]) or "-"),
        ("world size", format_timeline(status)),
        ("latest checkpoint", format_value(status["latest_checkpoint"])),
    ]
    if status.get("eval"):
        rows.append(("eval", format_eval_status(status["eval"])))
    if status.get("nccl"):
        rows += format_nccl(status["nccl"])
    if status.get("lease"):
        lease = status["lease"]
        rows.append(("driver", f"{lease['holder']}, lease epoch {lease['epoch']} until {lease['expires_at']}"))
    if status.get("overlapping_attempts"):
        rows.append(("overlapping attempts", f"{len(status['overlapping_attempts'])} (two drivers stepped this run "
                                             "at once; not counted as restarts)"))
    if status["error"]:
        rows.append(("error", status["error"]))
    return rows


def format_score(result: dict) -> str:
    low, high = result["interval"]
    return f"{result['metric']} {result['score']:.3f} (95% {low:.3f}-{high:.3f}, n={result['n']})"


def format_eval_status(ev: dict) -> str:
    """One line per set: its latest score at its label, and the base's."""
    lines = []
    for name, one in ev.get("sets", {}).items():
        parts = []
        if one["latest"]:
            parts.append(f"{format_score(one['latest'])} at {one['latest']['label']}")
        if one["base"]:
            parts.append(f"base {one['base']['score']:.3f}")
        lines.append(f"{name}: " + "; ".join(parts))
    tasks = [r for r in ev.get("grid", {}).get("rows", []) if r["kind"] == "harness"]
    if tasks:
        lines.append("harness: " + ", ".join(f"{r['name']} {r['metric']} "
                                              f"{format_grid_cell(r['cells'][list(r['cells'])[-1]])}" for r in tasks))
    return "\n".join(lines)


def render_eval(summary: dict, evals: list[dict], harness: list[dict]):
    """`eft eval`'s closing tables: every set and harness task × every evaluated label (this one's
    column bold), then three predictions of each set scored now."""
    from rich.console import Group
    from rich.table import Table

    grid = build_eval_grid(evals, harness)
    table = build_grid_table(grid, title=f"eval of {summary['run_uri']}: {summary['label']} beside the run's others")
    for column in table.columns:
        if column.header == summary["label"]:
            column.style = "bold"
    parts = [table]
    for name, results in (summary.get("results") or {}).items():
        examples = Table(title=f"{results['label']}, set {name}: examples", show_lines=True)
        for column in ("prompt", "prediction", "answer", "correct"):
            examples.add_column(column, overflow="fold")
        for ex in results.get("examples", []):
            prompt = ex.get("prompt") or ex["messages"][-1]["content"]
            prediction = ex["prediction"] if "choices" not in ex else ex["choices"][ex["prediction"]]
            answer = ex["answer"] if "choices" not in ex else ex["choices"][ex["answer"]]
            examples.add_row(prompt, repr(prediction), str(answer), "yes" if ex["correct"] else "no")
        parts.append(examples)
    for name, results in (summary.get("results") or {}).items():
        low, high = results["interval"]
        parts.append(f"{summary['label']}, set {name}: {results['metric']} {results['score']:.3f} "
                     f"(95% interval {low:.3f}-{high:.3f}, n={results['n']})")
    return Group(*parts)


def render_status(status: dict):
    """A rich Table of the status; the caller prints it."""
    from rich.table import Table

    table = Table(title=f"run {status['name']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, text in [("uri", status["uri"]), *build_status_rows(status)]:
        table.add_row(label, text)
    return table


def mark_step(ax, step: float, label: str, color: str, style: str, at_top: bool) -> None:
    """A vertical line at `step`, labelled alongside it; notices sit low and restarts high,
    so a JIT checkpoint's notice and the restart from it (same step) stay readable."""
    ax.axvline(step, color=color, linestyle=style, linewidth=1.2)
    ax.annotate(label, xy=(step, 0.98 if at_top else 0.02), xycoords=("data", "axes fraction"),
                xytext=(-2, 0), textcoords="offset points", rotation=90, va="top" if at_top else "bottom",
                ha="right", fontsize=8, color=color, bbox={"boxstyle": "round,pad=0.2", "fc": "white",
                                                            "ec": "none", "alpha": 0.8})


def build_loss_figure(run: dict, status: dict):
    """Train (and validation) loss vs step, with pre-emption notices and restarts marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on the Agg canvas: no pyplot global state, no display needed.
    pairs = any(r.get("reward_margin") is not None for r in run["metrics"])
    rollouts = any(r.get("reward_mean") is not None for r in run["metrics"])
    panels = 1 + pairs + 2 * rollouts
    fig = Figure(figsize=(10, 3 + 3 * panels if panels > 1 else 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(panels, 1, 1)
    train = [(r["step"], r["loss"]) for r in run["metrics"] if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in run["metrics"] if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if val:
        ax.plot(*zip(*val), label="validation loss", color="tab:orange", marker="o")
    if not train:
        ax.text(0.5, 0.5, "no metrics recorded yet", transform=ax.transAxes, ha="center", va="center")
    for step in status["preemption_notices"]:
        mark_step(ax, step, f"pre-emption notice at step {step}", "tab:red", ":", at_top=False)
    for item in status["interruptions"]:
        mark_step(ax, item["resumed_from_step"],
                  f"restart: {item['cause']}, world {item['world_size_before']}→{item['world_size_after']}",
                  "tab:purple", "--", at_top=True)
    title = f"{status['name']}: loss vs step ({status['state']})"
    ax.set_title(title if val else f"{title}\n{NO_VALIDATION_NOTE}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if train:
        ax.legend(loc="upper right")
    if pairs:
        add_reward_panel(fig.add_subplot(panels, 1, 2, sharex=ax), run["metrics"])
    if rollouts:
        add_rl_reward_panel(fig.add_subplot(panels, 1, panels - 1, sharex=ax), run["metrics"])
        add_rl_rollout_panel(fig.add_subplot(panels, 1, panels, sharex=ax), run["metrics"])
    fig.tight_layout()
    return fig


def add_reward_panel(ax, metrics: list[dict]) -> None:
    """The preference objectives' panel: chosen and rejected rewards, their margin, and the reward
    accuracy on its own axis (0 to 1)."""
    for key, label, color in (("rewards_chosen", "reward, chosen", "tab:green"),
                              ("rewards_rejected", "reward, rejected", "tab:red"),
                              ("reward_margin", "reward margin", "tab:blue")):
        points = [(r["step"], r[key]) for r in metrics if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), label=label, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("implicit reward")
    ax.grid(alpha=0.3)
    accuracy = ax.twinx()
    points = [(r["step"], r["reward_accuracy"]) for r in metrics if r.get("reward_accuracy") is not None]
    accuracy.plot(*zip(*points), label="reward accuracy", color="black", linestyle=":")
    val = [(r["step"], r["val_reward_accuracy"]) for r in metrics if r.get("val_reward_accuracy") is not None]
    if val:
        accuracy.plot(*zip(*val), label="reward accuracy, validation", color="tab:orange", marker="o",
                      linestyle="none")
    accuracy.set_ylim(0, 1.05)
    accuracy.set_ylabel("reward accuracy")
    handles = ax.get_legend_handles_labels()
    more = accuracy.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("preference rewards")


def series(metrics: list[dict], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in metrics if r.get(key) is not None]


def add_rl_reward_panel(ax, metrics: list[dict]) -> None:
    """GRPO's rewards: the mean with its spread over the step's completions (±1 std), each reward
    function's share, and accuracy and pass@G on their own axis (0 to 1)."""
    mean, std = dict(series(metrics, "reward_mean")), dict(series(metrics, "reward_std"))
    steps = sorted(mean)
    ax.plot(steps, [mean[s] for s in steps], label="reward (mean)", color="tab:blue")
    if std:
        band = [s for s in steps if s in std]
        ax.fill_between(band, [mean[s] - std[s] for s in band], [mean[s] + std[s] for s in band],
                        color="tab:blue", alpha=0.15, label="reward ± std")
    # Per reward function: reward_<function> (app/rl/colocated.py's reward_metric).
    functions = sorted({k for r in metrics for k in r if k.startswith("reward_")} - {
        "reward_mean", "reward_std", "reward_errors", "reward_margin", "reward_accuracy"})
    for key in functions:
        ax.plot(*zip(*series(metrics, key)), label=key.replace("reward_", "reward: "), linewidth=0.9,
                linestyle="--")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    share = ax.twinx()
    for key, label, color in (("accuracy", "accuracy", "black"), ("pass_at_g", "pass@G", "tab:green"),
                              ("frac_zero_std", "zero-std groups", "tab:gray")):
        points = series(metrics, key)
        if points:
            share.plot(*zip(*points), label=label, color=color, linestyle=":")
    share.set_ylim(0, 1.05)
    share.set_ylabel("fraction")
    handles, more = ax.get_legend_handles_labels(), share.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("rollout rewards")


def add_rl_rollout_panel(ax, metrics: list[dict]) -> None:
    """Where a GRPO step's time goes (rollout vs update seconds, stacked) and how long the
    completions are (mean and max tokens, on their own axis)."""
    rollout, update = dict(series(metrics, "rollout_s")), dict(series(metrics, "update_s"))
    steps = sorted(set(rollout) & set(update))
    if steps:
        ax.stackplot(steps, [rollout[s] for s in steps], [update[s] for s in steps],
                     labels=["rollout s", "update s"], colors=["tab:orange", "tab:blue"], alpha=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.grid(alpha=0.3)
    lengths = ax.twinx()
    for key, label, style in (("completion_len_mean", "completion tokens (mean)", "-"),
                              ("completion_len_max", "completion tokens (max)", ":")):
        points = series(metrics, key)
        if points:
            lengths.plot(*zip(*points), label=label, color="black", linestyle=style)
    lengths.set_ylabel("tokens")
    handles, more = ax.get_legend_handles_labels(), lengths.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("rollouts: time and length")


def build_eval_figure(status: dict, evals: list[dict], harness: Optional[list[dict]] = None):
    """Each set's task score vs step with its 95% interval; each base score as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, metric in dict.fromkeys((r.get("set", DEFAULT_SET), r["metric"]) for r in evals):
        ours = [r for r in evals if r.get("set", DEFAULT_SET) == name and r["metric"] == metric]
        base = next((r for r in ours if r["label"] == "base"), None)
        steps = [r for r in ours if r["label"] != "base" and r.get("step") is not None
                 and r.get("checkpoint", {}).get("kind") == "checkpoint"]
        if steps:
            x = [r["step"] for r in steps]
            y = [r["score"] for r in steps]
            err = [[r["score"] - r["interval"][0] for r in steps], [r["interval"][1] - r["score"] for r in steps]]
            line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{name} {metric}, fine-tuned checkpoints")
            color = line.lines[0].get_color()
        else:
            color = "gray"
        if base:
            ax.axhline(base["score"], color=color, linestyle="--", alpha=0.7,
                       label=f"{name} {metric}, base ({base['score']:.3f})")
    for task in dict.fromkeys(t for h in harness or [] for t in h["harness"]):
        ours = [h for h in harness if task in h["harness"]]
        if any(not 0 <= h["harness"][task]["score"] <= 1 for h in ours):
            continue  # a perplexity, not a rate: the grid in report.md shows it
        base = next((h for h in ours if h["label"] == "base"), None)
        steps = [h for h in ours if h["label"] != "base" and h.get("step") is not None]
        color = "gray"
        if steps:
            cells = [h["harness"][task] for h in steps]
            line = ax.errorbar([h["step"] for h in steps], [c["score"] for c in cells],
                               yerr=[c.get("stderr") or 0.0 for c in cells], marker="s", capsize=3,
                               label=f"{task} {cells[0]['metric']} (harness)")
            color = line.lines[0].get_color()
        if base:
            ax.axhline(base["harness"][task]["score"], color=color, linestyle=":", alpha=0.7,
                       label=f"{task} (harness), base ({base['harness'][task]['score']:.3f})")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    bars = "95% bootstrap intervals" + ("; harness tasks: ± lm-eval's standard error" if harness else "")
    ax.set_title(f"{status['name']}: task score vs step ({bars})")
    ax.grid(alpha=0.3)
    # Beside the axes, not on them: several sets' curves and base lines leave no empty corner.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    return fig


def render_eval_markdown(store: Store, run: dict, plot_name: str = EVAL_PLOT_FILE, examples: int = 3,
                         max_columns: int = 5) -> str:
    """Each evaluation's score, then the same prompts answered by the base and the evaluated
    checkpoints side by side (the base and the last few)."""
    parts = ["## Evaluation", "", render_grid_markdown(build_eval_grid(run["evals"], run.get("harness") or [])), "",
             f"![task score vs step]({plot_name})", ""]
    for name in dict.fromkeys(r.get("set", DEFAULT_SET) for r in run["evals"]):
        parts += render_set_examples(store, run, name, [r for r in run["evals"] if r.get("set", DEFAULT_SET) == name],
                                     examples, max_columns)
    return "\n".join(parts) + "\n"


def render_set_examples(store: Store, run: dict, set_name: str, evals: list[dict], examples: int,
                        max_columns: int) -> list[str]:
    """The same prompts of one set answered by the base and the last few evaluated labels."""
    parts = []
    shown = ([r for r in evals if r["label"] == "base"] + [r for r in evals if r["label"] != "base"])[:1]
    shown += [r for r in evals if r["label"] != "base"][-(max_columns - len(shown)):]
    columns = {}
    for r in dict((r["label"], r) for r in shown).values():
        try:
            columns[r["label"]] = {p["index"]: p for p in load_predictions(store, run["uri"], r["label"], set_name)}
        except (OSError, ValueError):
            continue
    if columns:
        first = next(iter(columns.values()))
        indexes = sorted(first)[:examples]
        parts += [f"### Examples of set {set_name}: the same prompts, base vs fine-tuned", ""]
        table = []
        for i in indexes:
            p = first[i]
            prompt = p.get("prompt") or p["messages"][-1]["content"]
            answer = p["answer"] if "choices" not in p else p["choices"][p["answer"]]
            cells = [prompt, answer]
            for label, preds in columns.items():
                q = preds.get(i)
                if q is None:
                    cells.append("-")
                    continue
                shown_pred = q["prediction"] if "choices" not in q else q["choices"][q["prediction"]]
                cells.append(f"{'✓' if q['correct'] else '✗'} {shown_pred}")
            table.append(cells)
        parts += [render_markdown_table(["prompt", "answer", *columns], table), ""]
    return parts


def render_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def escape_cell(text) -> str:
    return "-" if text is None else str(text).replace("|", "\\|").replace("\n", "<br>")


def render_markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(status: dict, has_val: bool, plot_name: str = PLOT_FILE) -> str:
    parts = [f"# Run `{status['name']}`", "", f"`{status['uri']}`", "",
             render_markdown_table(["field", "value"], [list(r) for r in build_status_rows(status)]), "",
             "## Interruptions", ""]
    if status["interruptions"]:
        header = ["#", "cause", "world", "step at notice", "last step before", "resumed from",
                  "steps recomputed", "steps lost", "recovery (s)", "recovery phases (s)"]
        rows = [[i, it["cause"], f"{it['world_size_before']}→{it['world_size_after']}", it["step_at_notice"],
                 it["last_step_before"], it["resumed_from_step"], it["steps_recomputed"], it["steps_lost"],
                 it["recovery_s"], format_restart_phases(it.get("phases"))]
                for i, it in enumerate(status["interruptions"], 1)]
        parts.append(render_markdown_table(header, rows))
    else:
        parts.append("None: the worker group ran without a restart.")
    parts += ["", "## Loss", ""]
    if not has_val:
        parts += [f"_{NO_VALIDATION_NOTE}._", ""]
    parts.append(f"![loss curves]({plot_name})")
    return "\n".join(parts) + "\n"


def save_report(store: Store, run: dict, out_uri: Optional[str] = None, now: Optional[float] = None) -> list[str]:
    """Write loss.png and report.md (to `<run>/report/` or `out_uri`); returns their URIs."""
    out_uri = (out_uri or join(run["uri"], REPORT_DIR)).rstrip("/")
    status = build_status(run, now)
    has_val = any(r.get("val_loss") is not None for r in run["metrics"])
    png_uri, md_uri = join(out_uri, PLOT_FILE), join(out_uri, MARKDOWN_FILE)
    store.write_bytes(png_uri, render_png(build_loss_figure(run, status)))
    markdown = render_markdown(status, has_val)
    written = [png_uri, md_uri]
    if run.get("evals") or run.get("harness"):
        eval_png = join(out_uri, EVAL_PLOT_FILE)
        store.write_bytes(eval_png, render_png(build_eval_figure(status, run["evals"], run.get("harness"))))
        markdown += "\n" + render_eval_markdown(store, run)
        written.insert(1, eval_png)
    store.write_text(md_uri, markdown)
    return written


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
    for i, item in enumerate(summary.get("interruptions", []), 1):
        rows.append((f"interruption {i}", f"{item['cause']}: world {item['world_size_before']}→"
                     f"{item['world_size_after']}, resumed at step {item['resumed_from_step']}, "
                     f"lost {item['steps_lost']}, recomputed {item['steps_recomputed']}, "
                     f"recovery {item['recovery_s']}s ({format_restart_phases(item.get('phases'))})"))
    if summary.get("nccl"):
        rows += format_nccl(summary["nccl"])
    if summary.get("error"):
        rows.append(("error", summary["error"]))
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
