"""A spot reclaim and a hard kill on a real multi-node Ray cluster on one machine (run as a
subprocess by tests/conftest.py's `spot_scenarios`, so it owns its Ray cluster): 3 worker nodes,
min 2 / max 3 workers, a DPO run on precomputed reference log-probs. Mid-run one node gets a
pre-emption drain notice with a deadline and is then removed; a node is added back and the run
grows to 3; then a node is killed outright, without notice, and the run finishes on 2. Writes
what happened to the JSON file named on the command line.

Given a second output file and a run's config (JSON), the same cluster then takes that run
through a spot node's whole life on the 2 nodes left (tests/scenarios/reclaim_notice_grow_kill.py:
GRPO for tests/test_grpo.py): one cluster start and one driver for both rehearsals."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.dev import chaos, local  # noqa: E402

chaos.configure_fast_failure_detection()
# Steps the uninterrupted reference runs past the step the last restart resumed into.
REFERENCE_PAST_RESTART = 5


def main(out_path: str, base_uri: str, data_uri: str, s3_endpoint: str, *then: str) -> None:
    """`then`: (out_path, config_path, notice_after_step, notice_s) of a run for
    reclaim_notice_grow_kill on the same cluster, after this one."""
    import ray

    local.point_env_at(s3_endpoint)
    cluster = chaos.start_cluster(worker_nodes=3)
    try:
        run_scenario(cluster, out_path, base_uri, data_uri)
        if then:
            from reclaim_notice_grow_kill import run_scenario as run_through_a_nodes_life

            then_out, config_path, notice_after_step, notice_s = then
            run_through_a_nodes_life(cluster, then_out, config_path, int(notice_after_step), float(notice_s))
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_scenario(cluster: chaos.LocalCluster, out_path: str, base_uri: str, data_uri: str) -> None:
    from app.config import build_config
    from app.storage import Store
    from app.train.launch import run_training

    cfg = build_config({
        "name": "spot", "model": {"uri": base_uri},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]},
        # DPO on preference pairs, the reference log-probs precomputed (tests/test_elastic.py).
        "data": {"uri": data_uri, "seq_len": 96},
        "training": {"max_steps": int(os.environ.get("SPOT_STEPS", "140")), "global_batch_size": 12,
                     "micro_batch_size": 2, "lr": 3e-3, "schedule": "constant", "trace_rows": True,
                     # SPOT_OBJECTIVE=simpo (or orpo) rehearses a reference-free objective the same way.
                     "objective": os.environ.get("SPOT_OBJECTIVE", "dpo")},
        # Steps here take 0.1-0.5 s (1-4 s on a loaded CI box), and a step after a save can stall
        # for 3-4 s when the 3 workers, Ray and the S3 endpoint share 2 cores: a margin that
        # rides that out.
        "checkpoint": {"save_every_steps": 10, "preemption_margin_s": 5.0},
        "scaling": chaos.elastic_scaling(min_workers=2, max_workers=3),
        "fault_tolerance": {"max_failures": 2},
        "storage": {"root_uri": "s3://eft/runs-spot"},
    })
    store = Store()
    background = chaos.BackgroundRun(cfg, store)
    run = background.watcher

    log = {"notice_after_step": run.wait_step(8)}
    # Long enough for several steps between the notice and the late just-in-time save, and for
    # a save on a loaded CI box (DPO steps there took 1-4 s), yet short enough that the late save
    # comes before the first epoch ends (tests/test_elastic.py).
    notice_s = 15
    # The notice lands and training goes on; the just-in-time checkpoint is taken as late as
    # is safe (complete in storage before the deadline) and the group drains; the node goes
    # just before its deadline, as a reclaimed spot node does.
    log.update(chaos.reclaim_with_notice(cluster, cluster.nodes[2], run, notice_s))
    # The run must go on at 2 workers before capacity comes back and it grows to 3 again.
    log["resumed_on_two_at_step"] = run.wait_step(log["notice_after_step"] + 6, world_size=2)
    cluster.add_node()
    log["added_at"] = time.time()
    log["regrown_step"] = run.wait_step(1, world_size=3, after=log["added_at"])
    # No notice this time: the node and everything on it are killed at once.
    run.wait_step(log["regrown_step"] + 5, world_size=3)
    log["killed_at"] = time.time()
    cluster.remove(cluster.nodes[0], graceful=False)
    log["summary"] = background.join(600)
    log["wall_s"] = time.time() - background.started
    log["recovery_s"] = {"preemption": run.recovery_after(log["removed_at"]),
                         "hard_kill": run.recovery_after(log["killed_at"])}
    # The same run, uninterrupted on 1 worker: the reference trajectory (the world size changes
    # only the order of the sums, as it does between the run's 3 and 2). It runs just past the
    # last restart (the steps redone after the hard kill, then REFERENCE_PAST_RESTART new ones on
    # 2 workers): after that the run is one group stepping on, which the steps before already
    # compared. The schedule is constant, so a shorter run takes the same steps. One worker on a
    # node left standing: no node to add, and two fewer worker processes to start.
    last = (log["summary"] or {}).get("interruptions", [{}])[-1]
    reference_steps = min(cfg.training.max_steps, last.get("last_step_before", cfg.training.max_steps)
                          + REFERENCE_PAST_RESTART)
    # It needs only its metrics: one checkpoint, at the end.
    reference = cfg.model_copy(update={"name": "spot-reference", "scaling": cfg.scaling.model_copy(
        update={"min_workers": 1, "max_workers": 1}), "checkpoint": cfg.checkpoint.model_copy(
        update={"save_every_steps": reference_steps}), "training": cfg.training.model_copy(
        update={"max_steps": reference_steps})})
    log["reference_summary"] = run_training(reference, store)
    Path(out_path).write_text(json.dumps(log, indent=2, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
