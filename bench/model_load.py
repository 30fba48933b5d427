"""Time to first step and restart time, before vs after ranged weight loading: a random
Llama of a few hundred MB (bf16 safetensors, sharded) on the local S3 endpoint, a LoRA job on
2 FSDP2 CPU workers (one Ray node), each start timed from the worker function's start to the end
of its first optimizer step.

- before: each node downloads the whole model to its cache, rank 0 loads it whole and broadcasts
  it into the shards (today the fallback for models without safetensors files).
- after: each rank reads only its own slices of the safetensors files from S3, and keeps them in
  the node's slice cache (app/model/weights.py SliceCache).

Three starts of each: a cold start, a restart on a replacement node (empty node cache, as after
a spot reclaim) and a restart on a node that survived (the node cache as the previous start left it:
`before` finds its full copy there, `after` the slices its ranks read, at the same world size).

    .venv/bin/python bench/model_load.py [--hidden 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

BASE = "s3://eft/models/bench-load"


def save_model(uri: str, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama in bf16, sharded safetensors + index (as hub checkpoints are); its weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.storage import Store

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size="100MB")
        Store().upload_dir(tmp, uri, last=("config.json",))
        return sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors"))


def start_worker(config: dict) -> None:
    """Worker fn: build the model the `before` or `after` way, take one optimizer step."""
    import ray.train
    import ray.train.torch
    import torch

    from app.config import JobConfig
    from app.model.build import (apply_fsdp, build_meta_model, build_model, load_pretrained,
                                 load_weights_from_rank0, resolve_precision, trainable_parameters)
    from app.storage import Store

    started = time.monotonic()
    cfg = JobConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    rank, world, device = ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device()
    store = Store()
    if config["path"] == "after":
        model = build_model(cfg, store, device, rank, world)
    else:
        precision = resolve_precision(cfg, device)
        local_dir = store.cache_locally(cfg.model.uri)
        model, buffers = build_meta_model(local_dir, precision.storage_dtype, cfg.lora)
        apply_fsdp(model, precision)
        source = load_pretrained(local_dir, precision.storage_dtype, cfg.lora, cfg.training.seed) if rank == 0 else None
        load_weights_from_rank0(model, source, buffers, device)
        del source
    loaded = time.monotonic()
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    done = time.monotonic()
    read = torch.tensor([store.bytes_read, store.bytes_cached], dtype=torch.float64)
    torch.distributed.all_reduce(read)
    if rank == 0:  # Ray Train keeps reported metrics only with a checkpoint: the timings go to storage
        store.write_json(config["out"], {"load_s": loaded - started, "first_step_s": done - started,
                                         "bytes_read": int(read[0]), "bytes_cached": int(read[1])})


def time_start(cfg, path: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.storage import Store

    store = Store()
    fs, root = store.resolve(cfg.storage.root_uri)
    name = f"{cfg.name}-{path}-{time.time_ns()}"
    out = f"{cfg.storage.root_uri}/{name}/timing.json"
    began = time.monotonic()
    TorchTrainer(
        start_worker, train_loop_config={"cfg": cfg.model_dump(mode="json"), "path": path, "out": out},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=root, storage_filesystem=fs),
    ).fit()
    fit_s = time.monotonic() - began
    return {k: round(v, 2) if k.endswith("_s") else v for k, v in {**store.read_json(out), "fit_s": fit_s}.items()}


def main() -> None:
    import ray

    from app.config import build_config
    from app.dev import local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    cfg = build_config({
        "name": "bench-load", "model": {"uri": BASE},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        "data": {"uri": "s3://eft/data/unused", "seq_len": 64},
        "training": {"max_steps": 1, "parallelism": "fsdp"}, "storage": {"root_uri": "s3://eft/bench-runs"}})
    node_tmp = Path(tempfile.mkdtemp(prefix="eft-bench-node-"))  # this bench's node cache, nobody else's
    results: dict[str, dict] = {"before": {}, "after": {}}
    with local.serve_s3():
        weight_bytes = save_model(BASE, args.hidden, args.layers, args.vocab)
        ray.init(address="local", num_cpus=3, runtime_env={"env_vars": {"TMPDIR": str(node_tmp)}})
        try:
            # A restart on the same node finds what that path's previous start left in the node cache.
            plan = [("cold start", "before"), ("cold start", "after"),
                    ("restart, replacement node", "before"), ("restart, same node", "before"),
                    ("restart, replacement node", "after"), ("restart, same node", "after")]
            for start, path in plan:
                if start != "restart, same node":
                    shutil.rmtree(node_tmp)
                    node_tmp.mkdir()
                results[path][start] = time_start(cfg, path)
                print(start, path, results[path][start], flush=True)
        finally:
            ray.shutdown()
            shutil.rmtree(node_tmp, ignore_errors=True)

    rows, ratios = [], {}
    for start in results["before"]:
        before, after = results["before"][start], results["after"][start]
        ratios[start] = round(before["first_step_s"] / after["first_step_s"], 2)
        for path, r in (("before", before), ("after", after)):
            rows.append([start, path, r["load_s"], r["first_step_s"], r["fit_s"],
                         round(r["bytes_read"] / 1e6, 1), round(r["bytes_cached"] / 1e6, 1)])
    table = "\n\n".join([
        f"A random Llama (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}): "
        f"**{weight_bytes / 1e6:.0f} MB** of bf16 safetensors on the local S3 endpoint (moto), loaded as fp32 "
        "on 2 FSDP2 CPU workers of one Ray node, LoRA r=8. Seconds from the worker function's start; "
        "`fit s` is the driver's whole `TorchTrainer.fit` (worker start-up included).",
        markdown_table(["start", "path", "weights loaded (s)", "first step done (s)", "fit s",
                        "read from storage, both ranks (MB)", "from the node cache (MB)"], rows),
        "Time to first step, before / after: " + ", ".join(f"{k} **{v}x**" for k, v in ratios.items()) + ".",
        "Before, rank 0 reads the whole model (the node's one download, then from_pretrained) and broadcasts "
        "it; after, each rank reads only its half from S3, so a node of N ranks reads 1/(nodes) of the "
        "weights. One node here, so the per-node download saved by a multi-node cluster is not in these "
        "numbers (tests/test_weights.py measures bytes per node on 2 nodes).",
        "On a node that survived, `before` finds its full copy in the node cache and `after` the slices its "
        "ranks read last time (same world size, so the same byte ranges): neither reads weights from storage. "
        "A replacement node's cache is empty: there `after` reads only its slices from storage. "
        "`from the node cache` counts what each rank took from the node's cache instead of storage: "
        "`before` hands both ranks the node's full copy (only rank 0 reads it), `after` serves each rank its "
        "own slices. "
        "The store here is moto (one Python process) on a 2-CPU box shared with other jobs, so the seconds "
        "are slow and noisy; compare the ratios of the same run.",
    ])
    save_result("model_load", {"weight_bytes": weight_bytes, "model": vars(args), "results": results,
                               "first_step_ratio_before_over_after": ratios}, table)


if __name__ == "__main__":
    main()
