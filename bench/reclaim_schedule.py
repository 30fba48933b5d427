"""Goodput on a seeded reclaim schedule: the same LoRA run on a 3-node local Ray cluster
(elastic 2..3 workers), once uninterrupted and once while a seeded schedule of spot reclaims
plays out (by default two notices with a 30 s deadline and one hard kill, each node coming back
some steps later). Prints goodput (uninterrupted wall time / scheduled wall time), per
restart its cause, steps recomputed, seconds from the last step before to the first step after
and its phases, and per reclaim the seconds from the node's loss (and from its return) to the
next step; saves them to bench/results/reclaim_schedule.*.

Each reclaim is two restarts here (the loss, then the grow when the node returns). What a
reclaim costs in seconds does not depend on how long the run is, so the table also gives the
goodput those costs imply at a real spot fleet's rate of reclaims.

    .venv/bin/python bench/reclaim_schedule.py [--steps 400] [--seed 0] [--notices 2] [--kills 1]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.dev import chaos  # noqa: E402

chaos.configure_fast_failure_detection()

from bench.common import markdown_table, save_result  # noqa: E402
from bench.elastic_recovery import run_both  # noqa: E402


def run_scheduled(cluster: chaos.LocalCluster, cfg, schedule: list, seed: int) -> dict:
    from app.storage import Store
    from app.train.launch import run_training

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run_training(cfg, Store())), daemon=True)
    thread.start()
    run = chaos.RunWatcher(Store(), cfg.run_uri, alive=thread.is_alive)
    played = chaos.play_reclaims(cluster, run, schedule, seed)
    thread.join()
    return {**result["summary"], "reclaims": played}


def implied_goodput(cost_s: float, every_s: float) -> float:
    """Goodput when a reclaim costing `cost_s` comes once per `every_s` of training."""
    return every_s / (every_s + cost_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--notices", type=int, default=2)
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--deadline-s", type=float, default=30.0)
    args = parser.parse_args()

    from app.report import format_restart_phases

    schedule = chaos.build_reclaim_schedule(args.seed, args.steps, args.notices, args.kills, args.deadline_s)
    plain, hit = run_both(args.steps, "scheduled",
                          lambda cluster, cfg: run_scheduled(cluster, cfg, schedule, args.seed))

    restarts = hit["interruptions"]
    goodput = plain["wall_s"] / hit["wall_s"]
    lost_s = hit["wall_s"] - plain["wall_s"]
    per_reclaim_s = lost_s / max(len(schedule), 1)
    loss_diff = abs(plain["final_train_loss"] - hit["final_train_loss"])
    restart_rows = [[i["cause"], f"{i['world_size_before']}→{i['world_size_after']}", i["step_at_notice"],
                     i.get("jit_checkpoint_step"), i["last_step_before"], i["resumed_from_step"],
                     i["steps_recomputed"], i["recovery_s"], format_restart_phases(i.get("phases"))]
                    for i in restarts]
    reclaim_rows = [[r["kind"], r["at_step"], r["loss_to_first_step_s"], r["return_to_first_step_s"]]
                    for r in hit["reclaims"]]
    rates = [("1 h", 3600.0), ("4 h", 4 * 3600.0)]
    table = "\n\n".join([
        "Schedule (seed %d): %s." % (args.seed, "; ".join(
            f"{r.kind} at step {r.at_step}" + (f" ({r.deadline_s:.0f} s deadline)" if r.deadline_s else "")
            + f", back after {r.return_after_steps} steps" for r in schedule)),
        markdown_table(["run", "steps", "wall s", "final loss", "world sizes"], [
            ["uninterrupted", plain["steps"], plain["wall_s"], round(plain["final_train_loss"], 4), plain["world_sizes"]],
            ["scheduled reclaims", hit["steps"], hit["wall_s"], round(hit["final_train_loss"], 4), hit["world_sizes"]]]),
        f"Goodput (uninterrupted / scheduled wall time): **{goodput:.2f}**. Final loss within "
        f"{loss_diff:.1e} of the uninterrupted run's. Steps recomputed per restart: "
        f"**{[i['steps_recomputed'] for i in restarts]}**. Wall time lost: {lost_s:.1f} s, "
        f"**{per_reclaim_s:.1f} s per reclaim** (its loss and its return).",
        markdown_table(["restart", "world", "notice at step", "JIT checkpoint", "last step before", "resumed from",
                        "steps recomputed", "last step → first step (s)", "phases (s)"], restart_rows),
        markdown_table(["reclaim", "at step", "node loss → first step (s)", "node back → first step at full size (s)"],
                       reclaim_rows),
        "What these costs imply for a fleet (a reclaim of one node, and its return, every ...): " + ", ".join(
            f"{name}: goodput {implied_goodput(per_reclaim_s, every):.3f}" for name, every in rates) + ".",
    ])
    save_result("reclaim_schedule", {
        "seed": args.seed, "schedule": [r.__dict__ for r in schedule], "uninterrupted": plain, "scheduled": hit,
        "goodput": goodput, "final_loss_diff": loss_diff, "lost_s": lost_s, "lost_s_per_reclaim": per_reclaim_s,
        "steps_recomputed": [i["steps_recomputed"] for i in restarts],
        "implied_goodput": {name: implied_goodput(per_reclaim_s, every) for name, every in rates}}, table)


if __name__ == "__main__":
    main()
