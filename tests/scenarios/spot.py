"""A spot reclaim on a real multi-node Ray cluster on one machine (run as a subprocess by
tests/test_elastic.py, so it owns its Ray cluster): 3 worker nodes, min 2 / max 3 workers;
mid-run one node gets a pre-emption drain notice with a deadline and is then removed; later a
node is added back. Writes what happened to the JSON file named on the command line."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Ray Train's own knobs, lowered so the scenario runs in a minute or two.
os.environ.update({
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
    "RAY_USAGE_STATS_ENABLED": "0",
})

from app import local  # noqa: E402


def main(out_path: str, base_uri: str, data_uri: str, s3_endpoint: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    os.environ.update(local.LOCAL_S3_ENV)
    os.environ["AWS_ENDPOINT_URL"] = s3_endpoint
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": True,
                                                               "dashboard_port": local.find_free_port()})
    worker_args = {"num_cpus": 2, "resources": {"trainer_slot": 1}}
    nodes = [cluster.add_node(**worker_args) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)

    try:
        run_scenario(cluster, nodes, worker_args, out_path, base_uri, data_uri)
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_scenario(cluster, nodes, worker_args, out_path: str, base_uri: str, data_uri: str) -> None:
    import ray
    from ray.core.generated import autoscaler_pb2

    from app.config import build_config
    from app.storage import Store, join
    from app.train.launch import run_training
    from app.train.metrics import load_heartbeats

    cfg = build_config({
        "name": "spot", "model": {"uri": base_uri},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]},
        "data": {"uri": data_uri, "seq_len": 64},
        "training": {"max_steps": int(os.environ.get("SPOT_STEPS", "150")), "global_batch_size": 12,
                     "micro_batch_size": 2, "lr": 3e-3, "schedule": "constant", "trace_rows": True},
        "checkpoint": {"save_every_steps": 10},
        "scaling": {"min_workers": 2, "max_workers": 3, "cpus_per_worker": 1,
                    "resources_per_worker": {"trainer_slot": 1}, "elastic_resize_monitor_interval_s": 3,
                    "worker_group_start_timeout_s": 5},
        "fault_tolerance": {"max_failures": 1},
        "storage": {"root_uri": "s3://eft/runs-spot"},
    })
    store = Store()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run_training(cfg, store)), daemon=True)
    started = time.time()
    thread.start()

    def wait_until_group(world_size: int, after: float, timeout_s: float = 300) -> int:
        """Block until a worker group of `world_size` started after `after` has taken a step."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and thread.is_alive():
            for b in load_heartbeats(store, cfg.run_uri):
                if b.get("world_size") == world_size and b["started_at"] > after and b.get("last_step"):
                    return b["last_step"]
            time.sleep(0.2)
        raise TimeoutError(f"no worker group of {world_size} after the node came back")

    def wait_step(at_least: int, world_size: int | None = None, timeout_s: float = 300) -> int:
        """Block until some worker group (of `world_size`, if given) has reached `at_least`."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and thread.is_alive():
            beats = load_heartbeats(store, cfg.run_uri) if store.exists(join(cfg.run_uri, "heartbeats")) else []
            beats = [b for b in beats if world_size is None or b.get("world_size") == world_size]
            step = max([b.get("last_step") or 0 for b in beats] or [0])
            if step >= at_least:
                return step
            time.sleep(0.2)
        raise TimeoutError(f"run did not reach step {at_least} (world size {world_size})")

    log = {}
    log["notice_after_step"] = wait_step(8)
    victim = nodes[2]
    gcs = ray._raylet.GcsClient(address=cluster.address)
    deadline_ms = int(time.time() * 1000) + 20_000
    accepted, msg = gcs.drain_node(victim.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "spot reclaim (test)", deadline_ms)
    log["drain_accepted"] = bool(accepted)
    time.sleep(4)  # the notice lands, the JIT checkpoint is taken, training goes on
    log["removed_at"] = time.time()
    # The node goes the way a reclaimed spot node does after its drain: gracefully.
    cluster.remove_node(victim, allow_graceful=True)
    # The run must go on at 2 workers before capacity comes back and it grows to 3 again.
    log["resumed_on_two_at_step"] = wait_step(log["notice_after_step"] + 6, world_size=2)
    cluster.add_node(**worker_args)
    log["added_at"] = time.time()
    log["regrown_step"] = wait_until_group(3, after=log["added_at"])
    thread.join(timeout=600)
    log["wall_s"] = time.time() - started
    log["summary"] = result.get("summary")
    # The same run, uninterrupted on a fixed 3 workers: the reference trajectory.
    reference = cfg.model_copy(update={"name": "spot-reference", "scaling": cfg.scaling.model_copy(
        update={"min_workers": 3, "max_workers": 3})})
    log["reference_summary"] = run_training(reference, store)
    Path(out_path).write_text(json.dumps(log, indent=2, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:5])
