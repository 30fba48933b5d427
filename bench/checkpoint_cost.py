"""Checkpoint cost: training time blocked per checkpoint with `checkpoint.async_upload: true`
vs a synchronous save of the same state, and the time to restore it. Target: blocked time with
async upload ≤ 20% of the synchronous save.

    .venv/bin/python bench/checkpoint_cost.py [--steps 10] [--save-every 3] [--rounds 2]

A full fine-tune (`lora: null`) of the bench model (3.6M parameters: ~14 MB of fp32 weights
+ ~29 MB of AdamW moments per checkpoint, split over 2 FSDP2 ranks), 2 CPU workers,
checkpointing every `--save-every` steps to the local S3 endpoint. Two runs, one with async
upload and one without, take turns in one Ray session: round 1 trains each `--steps` steps,
every later round resumes each run from its last checkpoint for `--steps` more (interleaved
async, sync, async, sync, ... so load drift hits both).

Blocked time: `checkpoint_blocked_s` of metrics.jsonl is the total time the loop spent in its
checkpoint phase since the previous log line (DCP save to local disk, metrics flush, and
`ray.train.report` — which with SYNC uploads to storage before returning), so with
log_every_steps = 1 the record of the step after a save carries that save. The final save of a
run is not in any record and is not counted.

Restore time: measured directly. The worker loop runs unchanged, except that
`app.elastic.checkpoint.restore` is wrapped with a timer (download of the rank's checkpoint files
from S3 + `dcp.load` + set_model/optimizer_state_dict) that writes its duration to the run's
storage; every resumed round exercises it (both runs, both ranks). Timing restore() itself is
chosen over "time to first step on resume minus a fresh start" because Ray Train's
worker-group start varies by seconds between runs on this box, which would swamp it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402


def instrumented_loop(config: dict) -> None:
    """The eft worker loop, unchanged but for timers around ckpt.restore and around the three
    parts of a save (the local DCP write, rank 0's metrics flush, ray.train.report); each rank
    writes them to <run>/bench/r<rank>.json at the end."""
    import time as _time

    import ray.train
    import torch.distributed.checkpoint as dcp

    from app.config import JobConfig
    from app.elastic import checkpoint as ckpt
    from app.observe.metrics import MetricsLog
    from app.storage import Store, join
    from app.train.loop import train_loop_per_worker

    cfg = JobConfig.model_validate(config["cfg"])
    rank = ray.train.get_context().get_world_rank()
    times: dict[str, list] = {"restore_s": [], "dcp_save_s": [], "metrics_flush_s": [], "report_s": []}
    originals = [(ckpt, "restore"), (dcp, "save"), (ray.train, "report"), (MetricsLog, "flush")]
    saved = [getattr(obj, attr) for obj, attr in originals]

    def timer(fn, key, skip=lambda *a, **k: False):
        def wrapped(*args, **kwargs):
            began = _time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if not skip(*args, **kwargs):
                    times[key].append(_time.perf_counter() - began)
        return wrapped

    ckpt.restore = timer(saved[0], "restore_s", skip=lambda checkpoint, *a, **k: checkpoint is None)
    dcp.save = timer(saved[1], "dcp_save_s")
    ray.train.report = timer(saved[2], "report_s")
    MetricsLog.flush = timer(saved[3], "metrics_flush_s", skip=lambda self: not self.enabled)
    try:
        train_loop_per_worker(config)
    finally:
        for (obj, attr), fn in zip(originals, saved):
            setattr(obj, attr, fn)
        Store.from_config(cfg.storage).write_json(join(cfg.run_uri, "bench", f"r{rank}.json"), times)


def blocked_per_save(metrics: list[dict], save_every: int) -> list[float]:
    """checkpoint_blocked_s of the records right after each logged save (step k*save_every + 1)."""
    return [m["checkpoint_blocked_s"] for m in metrics
            if m["step"] > 1 and (m["step"] - 1) % save_every == 0 and m.get("checkpoint_blocked_s") is not None]


def read_phases(store, run_uri: str) -> list[dict]:
    from app.storage import join

    root = join(run_uri, "bench")
    return [store.read_json(join(root, f)) for f in sorted(store.list_files(root))]


def save_breakdown(phases: list[dict], logged_saves: int) -> dict:
    """Per logged save (the final save is in no metrics record): the slower rank's DCP write and
    report, and rank 0's metrics flush."""
    out = {}
    for key in ("dcp_save_s", "report_s"):
        per_save = [max(p[key][i] for p in phases) for i in range(logged_saves)]
        out[key] = S.median(per_save)
    flushes = [x for p in phases for x in p["metrics_flush_s"]][:logged_saves]
    out["metrics_flush_s"] = S.median(flushes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run and round")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="round 1 starts both runs, later rounds resume them")
    args = parser.parse_args()

    from app.storage import Store
    from app.train.launch import run_training

    load_before = S.load_average()
    wall0 = time.time()
    base = S.job_tree("ckpt", lora=None,
                      training={"max_steps": args.steps, "lr": 1e-4},
                      checkpoint={"save_every_steps": args.save_every, "num_to_keep": 2})
    tag = time.strftime("%H%M%S")
    runs: dict[str, list[dict]] = {"async": [], "sync": []}
    restores: list[dict] = []
    with S.local_s3():
        store = Store()
        S.seed_model_and_corpus(store, S.bench_texts())
        S.start_ray()
        try:
            S.prepare(S.build_job(base), store)
            for r in range(args.rounds):
                for mode in ("async", "sync"):
                    tree = {**base, "name": f"ckpt-{mode}-{tag}",
                            "training": {**base["training"], "max_steps": args.steps * (r + 1)},
                            "checkpoint": {**base["checkpoint"], "async_upload": mode == "async"}}
                    cfg = S.build_job(tree)
                    print(f"round {r + 1}/{args.rounds}: {mode} upload, steps {args.steps * r + 1}.."
                          f"{args.steps * (r + 1)} ...", flush=True)
                    summary = run_training(cfg, store, train_fn=instrumented_loop)
                    metrics = [m for m in S.run_records(store, cfg.run_uri)["metrics"] if m["step"] > args.steps * r]
                    blocked = blocked_per_save(metrics, args.save_every)
                    size = sum(store.list_file_sizes(summary["latest_checkpoint"]).values())
                    phases = read_phases(store, cfg.run_uri)
                    parts = save_breakdown(phases, len(blocked))
                    runs[mode].append({"name": cfg.name, "round": r + 1, "blocked_s": blocked, "checkpoint_bytes": size,
                                       **parts, "steady_step_s": S.steady([m for m in metrics
                                                                           if not m["checkpoint_blocked_s"]],
                                                                          "step_time_s"),
                                       "wall_s": summary["wall_s"]})
                    print(f"  blocked per save: {[round(b, 3) for b in blocked]} s; checkpoint {size / 1e6:.1f} MB; "
                          f"median parts: {({k: round(v, 3) for k, v in parts.items()})}", flush=True)
                    if r:
                        per_rank = [x for p in phases for x in p["restore_s"]]
                        restores.append({"name": cfg.name, "from_step": args.steps * r, "restore_s": per_rank})
                        print(f"  restore per rank: {[round(x, 3) for x in per_rank]} s", flush=True)
        finally:
            S.stop_ray()
    load_after = S.load_average()

    def all_blocked(mode):
        return [b for run in runs[mode] for b in run["blocked_s"]]

    med = {mode: S.median(all_blocked(mode)) for mode in runs}
    per_round = [S.median(a["blocked_s"]) / S.median(s["blocked_s"]) for a, s in zip(runs["async"], runs["sync"])]
    ratio = S.median(per_round)
    restore_s = S.median(x for r in restores for x in r["restore_s"])  # per rank
    restore_max = S.median(max(r["restore_s"]) for r in restores) if restores else None  # gates the first step
    size_mb = S.median(run["checkpoint_bytes"] for run in runs["async"] + runs["sync"]) / 1e6
    step_s = S.median(run["steady_step_s"] for run in runs["async"] + runs["sync"])
    part = {mode: {k: S.median(run[k] for run in runs[mode]) for k in ("dcp_save_s", "metrics_flush_s", "report_s")}
            for mode in runs}
    met = ratio <= 0.20
    rows = [[mode, len(all_blocked(mode)), S.fmt(med[mode], 3), S.fmt(part[mode]["dcp_save_s"], 3),
             S.fmt(part[mode]["metrics_flush_s"], 3), S.fmt(part[mode]["report_s"], 3),
             " / ".join(S.fmt(b, 3) for b in all_blocked(mode))] for mode in ("async", "sync")]
    table = "\n\n".join([
        f"Full fine-tune of the bench model (hidden 256, 4 layers), 2 CPU workers (FSDP2), a checkpoint of "
        f"**{size_mb:.1f} MB** (fp32 weights + AdamW moments, both ranks) every {args.save_every} steps to the local "
        f"S3 endpoint; {args.rounds} rounds, async and sync interleaved. Steady step time without a save: "
        f"{S.fmt(step_s, 3)} s.",
        markdown_table(["upload", "saves", "blocked s per save (median)", "of which DCP write to local disk",
                        "metrics flush (rank 0)", "ray.train.report", "each save (blocked s)"], rows),
        f"**Blocked with async upload / synchronous save: {ratio:.3f}** (median of per-round ratios "
        + ", ".join(f"{p:.3f}" for p in per_round) + f"; target ≤ 0.20: {'met' if met else 'NOT met'}). "
        "The parts are medians of the slower rank per save (timed inside the workers); with async upload "
        "ray.train.report no longer uploads, and what stays blocking is the local DCP write and the flush.",
        f"**Restore** (download of the rank's files from S3 + DCP load + set state dicts, timed inside the worker): "
        f"median {S.fmt(restore_s, 3)} s per rank, {S.fmt(restore_max, 3)} s for the slower rank ("
        + "; ".join(f"{r['name']} from step {r['from_step']}: " + ", ".join(S.fmt(x, 3) for x in r["restore_s"])
                    for r in restores) + ").",
        S.load_note(load_before, load_after),
    ])
    save_result("checkpoint_cost", {
        "config": base, "rounds": args.rounds, "checkpoint_mb": size_mb, "blocked_s_median": med,
        "blocked_parts_median": part, "ratio_async_over_sync": ratio, "per_round_ratios": per_round,
        "target": {"ratio <=": 0.20, "met": met}, "restore_s_per_rank": restore_s,
        "restore_s_slower_rank": restore_max, "restores": restores, "runs": runs, "steady_step_s": step_s,
        "load_average": {"before": load_before, "after": load_after}, "bench_wall_s": time.time() - wall0}, table)


if __name__ == "__main__":
    main()
