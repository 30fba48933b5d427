"""What the run lease costs a step: step times of the same job with the lease (`eft train`'s
path: the driver renews `<run>/_lease.json` on a thread, the workers and controller check the
fence before their commits) and without it (the same Ray Train run, built and fitted directly,
no lease and no fences), interleaved in one invocation. Target: no measurable difference.

    .venv/bin/python bench/run_lease.py [--steps 40] [--save-every 5] [--rounds 2] [--ttl-s 8]

The leased runs use a short lease lifetime (`--ttl-s`, renewed every quarter of it), so the
driver renews several times during each run; the default 120 s would not renew once in a run
this short. Every `--save-every` steps a checkpoint: each rank reads the lease once before it
(the fence), and rank 0 once more before each metrics segment upload.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402


def run_without_lease(cfg, store) -> None:
    """The run as `eft train` starts it (the same preflight and the same parallelism resolved
    from `auto`), minus the run lease: no `_lease.json`, no fences."""
    from app.cluster import init_ray
    from app.plan import apply_parallelism
    from app.train.launch import build_trainer, preflight

    preflight(cfg, store)
    cfg, _ = apply_parallelism(cfg, store)
    init_ray()
    build_trainer(cfg, store, fence=None).fit()


def step_stats(metrics: list[dict], save_every: int) -> dict:
    """Median step time of the steady steps (the first ones warm up) split by whether a save
    came right before (a record right after a save carries its blocked time)."""
    steady = S.second_half([m for m in metrics if m["step"] > 2])
    after_save = [m for m in steady if (m["step"] - 1) % save_every == 0]
    plain = [m for m in steady if (m["step"] - 1) % save_every != 0]
    return {"step_s": S.median(m["step_time_s"] for m in plain),
            "blocked_s_per_save": S.median(m["checkpoint_blocked_s"] for m in after_save),
            "steps": len(metrics)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ttl-s", type=float, default=8.0, help="the leased runs' lease lifetime")
    args = parser.parse_args()

    from app.train.launch import run_training

    load_before = S.load_average()
    wall0 = time.time()
    base = S.job_tree("lease", training={"max_steps": args.steps},
                      checkpoint={"save_every_steps": args.save_every},
                      fault_tolerance={"run_lease_ttl_s": args.ttl_s})
    tag = time.strftime("%H%M%S")
    runs: dict[str, list[dict]] = {"lease": [], "no lease": []}
    with S.bench_session(base) as (store, _):
        for r in range(args.rounds):
            for mode in ("lease", "no lease"):
                cfg = S.build_job({**base, "name": f"lease-{mode.replace(' ', '-')}-{tag}-{r}"})
                print(f"round {r + 1}/{args.rounds}: {mode} ...", flush=True)
                began = time.monotonic()
                if mode == "lease":
                    run_training(cfg, store)
                else:
                    run_without_lease(cfg, store)
                wall_s = time.monotonic() - began
                stats = step_stats(S.run_records(store, cfg.run_uri)["metrics"], args.save_every)
                # The driver renews every ttl/4 s for as long as it holds the lease.
                renewals = int(wall_s // (args.ttl_s / 4)) if mode == "lease" else 0
                runs[mode].append({"name": cfg.name, "round": r + 1, **stats, "wall_s": wall_s,
                                   "lease_renewals": renewals})
                print(f"  steady step {S.fmt(stats['step_s'], 4)} s, blocked per save "
                      f"{S.fmt(stats['blocked_s_per_save'], 4)} s", flush=True)
    load_after = S.load_average()

    per_round = [a["step_s"] / b["step_s"] for a, b in zip(runs["lease"], runs["no lease"])]
    save_ratio = [a["blocked_s_per_save"] / b["blocked_s_per_save"] for a, b in zip(runs["lease"], runs["no lease"])
                  if a["blocked_s_per_save"] and b["blocked_s_per_save"]]
    ratio, save_r = S.median(per_round), S.median(save_ratio)
    rows = [[mode, len(runs[mode]), S.fmt(S.median(x["step_s"] for x in runs[mode]), 4),
             S.fmt(S.median(x["blocked_s_per_save"] for x in runs[mode]), 4),
             " / ".join(S.fmt(x["step_s"], 4) for x in runs[mode])] for mode in runs]
    table = "\n\n".join([
        f"LoRA on the bench model (hidden 256, 4 layers), 2 CPU workers (FSDP2), {args.steps} steps per run, a "
        f"checkpoint every {args.save_every} steps; the leased runs' lease lives {args.ttl_s:.0f} s and is renewed "
        f"every {args.ttl_s / 4:.0f} s on the driver. {args.rounds} rounds, the two interleaved.",
        markdown_table(["run", "runs", "steady step s (median)", "blocked s per save (median)", "each run's step s"],
                       rows),
        f"**Step time with the lease / without: {ratio:.3f}** (median of per-round ratios "
        + ", ".join(f"{p:.3f}" for p in per_round) + "); **blocked per save: "
        + (f"{save_r:.3f}" if save_r is not None else "-")
        + "** (the fence reads before each save). The renewals run on the driver, off the workers' path.",
        S.load_note(load_before, load_after),
    ])
    save_result("run_lease", {
        "config": base, "rounds": args.rounds, "ratio_step_s_lease_over_none": ratio, "per_round_ratios": per_round,
        "ratio_blocked_per_save": save_r, "runs": runs,
        "load_average": {"before": load_before, "after": load_after}, "bench_wall_s": time.time() - wall0}, table)


if __name__ == "__main__":
    main()
