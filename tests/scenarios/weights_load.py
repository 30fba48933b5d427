"""Loading a model on a real multi-node Ray cluster on one machine (run as a subprocess by
tests/test_weights.py, so it owns its Ray cluster): 2 nodes x 1 FSDP2 worker build the model from
S3, each reading its own slices; rank 0 compares the gathered model with from_pretrained. What
each node read is in the run's `weights_loaded` event; the comparison in `load-check.json`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from app.dev import chaos, local  # noqa: E402


def compare_sharded_load(config: dict) -> None:
    """Worker fn: build the model the scalable way, gather it, compare with from_pretrained."""
    import ray.train
    import ray.train.torch
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from app.config import JobConfig
    from app.model.build import build_model, load_pretrained
    from app.observe.records import record_weights_loaded
    from app.storage import Store, join

    cfg = JobConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    model_store = Store()
    model = build_model(cfg, model_store, ray.train.torch.get_device(), ctx.get_world_rank(), ctx.get_world_size())
    record_weights_loaded(Store(), cfg, ctx.get_world_rank(), model_store.bytes_read, 0.0,
                          bytes_cached=model_store.bytes_cached)
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.get_world_rank() == 0:
        local_dir = Store().cache_locally(cfg.model.uri)
        reference = load_pretrained(local_dir, torch.float32, cfg.lora, cfg.training.seed).state_dict()
        assert set(gathered) == set(reference), set(gathered) ^ set(reference)
        found = {"keys": len(gathered),
                 "max_abs_diff": max(float((gathered[k] - reference[k]).abs().max()) for k in reference),
                 # The adapters' init is drawn, not loaded: A random (the same as the reference's), B zero.
                 "lora_a_std": min(float(v.std()) for k, v in gathered.items() if ".lora_A." in k)}
        # Rotary frequencies are non-persistent buffers: they must survive the meta-device build.
        rotary = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
        ref_rotary = [b for n, b in load_pretrained(local_dir, torch.float32).named_buffers() if n.endswith("inv_freq")]
        found["rotary_diff"] = max(float((a - b).abs().max()) for a, b in zip(rotary, ref_rotary))
        Store().write_json(join(cfg.run_uri, "load-check.json"), found)
    ray.train.report({})


def main(cfg_json: str, s3_endpoint: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.config import JobConfig
    from app.storage import Store

    local.point_env_at(s3_endpoint)
    cfg = JobConfig.model_validate_json(cfg_json)
    cluster = chaos.start_cluster(worker_nodes=2, cpus_per_node=1, head_cpus=1)
    try:
        fs, root = Store().resolve(cfg.storage.root_uri)
        # A function of __main__: cloudpickle sends it by value (workers cannot import tests/).
        TorchTrainer(
            compare_sharded_load, train_loop_config={"cfg": cfg.model_dump(mode="json")},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, chaos.SLOT: 1}),
            run_config=RunConfig(name=cfg.name, storage_path=root, storage_filesystem=fs),
        ).fit()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
