"""Checkpoint cost: training time blocked per checkpoint with `checkpoint.async_upload: true`
vs a synchronous save of the same state, and the time to restore it. Target: blocked time with
async upload ≤ 20% of the synchronous save.

    .venv/bin/python bench/checkpoint_cost.py [--steps 13] [--save-every 3] [--rounds 2]

A full fine-tune (`lora: null`) of the bench model (3.6M parameters: ~14 MB of fp32 weights
+ ~29 MB of AdamW moments per checkpoint, split over 2 FSDP2 ranks), 2 CPU workers,
checkpointing every `--save-every` steps to the local S3 endpoint. Runs alternate async, sync,
async, sync, ... in one Ray session (interleaved, so load drift hits both).

Blocked time: `checkpoint_blocked_s` of metrics.jsonl is the total time the loop spent in its
checkpoint phase since the previous log line (DCP save to local disk, metrics flush, and
`ray.train.report` — which with SYNC uploads to storage before returning), so with
log_every_steps = 1 the record of the step after a save carries that save. The final save of a
run is not in any record and is not counted.

Restore time: measured directly. The worker loop runs unchanged, except that
`app.train.checkpoint.restore` is wrapped with a timer (download of the rank's checkpoint files
from S3 + `dcp.load` + set_model/optimizer_state_dict) that writes its duration to the run's
storage. A resume of each round's async run (+2 steps) exercises it. Timing restore() itself
is chosen over "time to first step on resume minus a fresh start" because Ray Train's
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


def timed_restore_loop(config: dict) -> None:
    """The eft worker loop, with ckpt.restore timed (written to <run>/bench/restore-r<rank>.json)."""
    import time as _time

    import ray.train

    from app.config import JobConfig
    from app.storage import Store, join
    from app.train import checkpoint as ckpt
    from app.train.loop import train_loop_per_worker

    original = ckpt.restore
    cfg = JobConfig.model_validate(config["cfg"])

    def timed(checkpoint, *args, **kwargs):
        began = _time.perf_counter()
        out = original(checkpoint, *args, **kwargs)
        took = _time.perf_counter() - began
        if checkpoint is not None:
            rank = ray.train.get_context().get_world_rank()
            Store.from_config(cfg.storage).write_json(join(cfg.run_uri, "bench", f"restore-r{rank}.json"),
                                                      {"restore_s": took, "step": out.step})
        return out

    ckpt.restore = timed
    try:
        train_loop_per_worker(config)
    finally:
        ckpt.restore = original


def blocked_per_save(metrics: list[dict], save_every: int) -> list[float]:
    """checkpoint_blocked_s of the records right after each logged save (step k*save_every + 1)."""
    return [m["checkpoint_blocked_s"] for m in metrics
            if m["step"] > 1 and (m["step"] - 1) % save_every == 0 and m.get("checkpoint_blocked_s") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from app.storage import Store, join
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
                    tree = {**base, "name": f"ckpt-{mode}-{tag}-{r}",
                            "checkpoint": {**base["checkpoint"], "async_upload": mode == "async"}}
                    cfg = S.build_job(tree)
                    print(f"round {r + 1}/{args.rounds}: {mode} upload ...", flush=True)
                    summary = run_training(cfg, store, train_fn=timed_restore_loop)
                    metrics = S.run_records(store, cfg.run_uri)["metrics"]
                    blocked = blocked_per_save(metrics, args.save_every)
                    latest = summary["latest_checkpoint"]
                    size = sum(store.list_file_sizes(latest).values())
                    runs[mode].append({"name": cfg.name, "blocked_s": blocked, "checkpoint_bytes": size,
                                       "steady_step_s": S.steady([m for m in metrics
                                                                  if m["checkpoint_blocked_s"] == 0], "step_time_s"),
                                       "wall_s": summary["wall_s"]})
                    print(f"  blocked per save: {[round(b, 3) for b in blocked]} s; checkpoint {size / 1e6:.1f} MB",
                          flush=True)
                # Resume this round's async run from its final checkpoint, with restore() timed.
                name = runs["async"][-1]["name"]
                tree = {**base, "name": name, "training": {**base["training"], "max_steps": args.steps + 2}}
                cfg = S.build_job(tree)
                print(f"round {r + 1}/{args.rounds}: resume {name} ...", flush=True)
                run_training(cfg, store, train_fn=timed_restore_loop)
                ranks = [store.read_json(join(cfg.run_uri, "bench", f)) for f in store.list_files(join(cfg.run_uri, "bench"))]
                restores.append({"name": name, "restore_s": [x["restore_s"] for x in ranks],
                                 "from_step": ranks[0]["step"] if ranks else None})
                print(f"  restore: {[round(x['restore_s'], 3) for x in ranks]} s", flush=True)
        finally:
            S.stop_ray()
    load_after = S.load_average()

    med_async = S.median(b for run in runs["async"] for b in run["blocked_s"])
    med_sync = S.median(b for run in runs["sync"] for b in run["blocked_s"])
    per_round = [S.median(a["blocked_s"]) / S.median(s["blocked_s"]) for a, s in zip(runs["async"], runs["sync"])]
    ratio = S.median(per_round)
    restore_s = S.median(x for r in restores for x in r["restore_s"])  # per rank
    restore_max = S.median(max(r["restore_s"]) for r in restores)  # the slower rank gates the first step
    size_mb = S.median(run["checkpoint_bytes"] for run in runs["async"] + runs["sync"]) / 1e6
    step_s = S.median(run["steady_step_s"] for run in runs["async"] + runs["sync"])
    met = ratio <= 0.20
    rows = [[mode, len([b for run in runs[mode] for b in run["blocked_s"]]),
             S.fmt(S.median(b for run in runs[mode] for b in run["blocked_s"]), 3),
             " / ".join(S.fmt(b, 3) for run in runs[mode] for b in run["blocked_s"])] for mode in ("async", "sync")]
    table = "\n\n".join([
        f"Full fine-tune of the bench model (hidden 256, 4 layers), 2 CPU workers (FSDP2), a checkpoint of "
        f"**{size_mb:.1f} MB** (weights + AdamW moments, both ranks) every {args.save_every} steps to the local S3 "
        f"endpoint; {args.rounds} rounds, async and sync interleaved. Steady step time without a save: "
        f"{S.fmt(step_s, 3)} s.",
        markdown_table(["upload", "saves", "median blocked s per save", "each save (blocked s)"], rows),
        f"**Blocked with async upload / synchronous save: {ratio:.3f}** (median of per-round ratios "
        + ", ".join(f"{p:.3f}" for p in per_round) + f"; target ≤ 0.20: {'met' if met else 'NOT met'}). "
        f"Medians over all saves: async {S.fmt(med_async, 3)} s, sync {S.fmt(med_sync, 3)} s.",
        f"**Restore** (download from S3 + DCP load + set state dicts; timed inside the worker): median "
        f"{S.fmt(restore_s, 3)} s per rank, {S.fmt(restore_max, 3)} s for the slower rank; per resume: "
        + "; ".join(f"from step {r['from_step']}: " + ", ".join(S.fmt(x, 3) for x in r["restore_s"]) for r in restores)
        + ".",
        S.load_note(load_before, load_after),
    ])
    save_result("checkpoint_cost", {
        "config": base, "rounds": args.rounds, "checkpoint_mb": size_mb, "blocked_s": {"async": med_async, "sync": med_sync},
        "ratio_async_over_sync": ratio, "per_round_ratios": per_round, "target": {"ratio <=": 0.20, "met": met},
        "restore_s_per_rank": restore_s, "restore_s_slower_rank": restore_max, "restores": restores, "runs": runs,
        "steady_step_s": step_s, "load_average": {"before": load_before, "after": load_after},
        "bench_wall_s": time.time() - wall0}, table)


if __name__ == "__main__":
    main()
