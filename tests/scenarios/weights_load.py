"""Loading a model on a real multi-node Ray cluster on one machine (run as a subprocess by
tests/test_weights.py, so it owns its Ray cluster): 2 nodes x 1 FSDP2 worker build the model from
S3, each reading its own slices; rank 0 compares the gathered model with from_pretrained. What
each node read is in the run's `weights_loaded` event; the comparison in `load-check.json`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from app.dev import chaos, local  # noqa: E402


def main(cfg_json: str, s3_endpoint: str) -> None:
    import ray
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import test_train
    from app.config import JobConfig
    from app.storage import Store

    local.point_env_at(s3_endpoint)
    cfg = JobConfig.model_validate_json(cfg_json)
    cluster = chaos.start_cluster(worker_nodes=2, cpus_per_node=1, head_cpus=1)
    try:
        cloudpickle.register_pickle_by_value(test_train)  # workers cannot import tests/
        fs, root = Store().resolve(cfg.storage.root_uri)
        TorchTrainer(
            test_train._compare_sharded_load, train_loop_config={"cfg": cfg.model_dump(mode="json")},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, chaos.SLOT: 1}),
            run_config=RunConfig(name=cfg.name, storage_path=root, storage_filesystem=fs),
        ).fit()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
