"""Restore: what each rank reads from storage, and how long it takes, for a full fine-tune's
checkpoint (weights + AdamW moments, FSDP2-sharded over 2 ranks) on the local S3 endpoint.

- before: each node downloads the checkpoint whole to local disk (what Ray's
  `Checkpoint.as_directory` did, and eft's restore copy after it), then DCP reads its
  shards from the copy. Here each rank stands for a node of its own, with its own copy.
- after: each rank reads, by ranged requests straight from the bucket, only the records it
  loads (`app.elastic.checkpoint.build_checkpoint_reader`).

Both restore the same checkpoint into the same sharded model and optimizer, in turns, and the
restored state is compared tensor for tensor. No Ray: 2 processes in a gloo group.

    .venv/bin/python bench/restore_reads.py [--hidden 512] [--layers 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

URI = "s3://eft/bench-restore/checkpoint-00000001"


def build_sharded(hidden: int, layers: int):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def flat_state(model, optimizer) -> dict:
    from app.elastic.checkpoint import build_app_state

    state = build_app_state(model, optimizer, lora=False)
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for key, moments in state["optim"]["state"].items():
        out.update({f"optim.{key}.{n}": v for n, v in moments.items() if hasattr(v, "to_local")})
    return {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone() for k, v in out.items()}


def worker(rank: int, world: int, args, work: str, endpoint: str, out: str) -> None:
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from app.dev import local
    from app.elastic import checkpoint as ckpt
    from app.storage import Store

    local.point_env_at(endpoint)
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    store = Store()
    model, optimizer = build_sharded(args.hidden, args.layers)
    # One step, so the AdamW moments exist and the checkpoint holds them, as a run's does.
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    dcp.save(ckpt.build_app_state(model, optimizer, lora=False), checkpoint_id=f"{work}/saved")
    dist.barrier()
    if rank == 0:
        store.upload_dir(f"{work}/saved", URI)
    dist.barrier()
    fs, path = store.resolve(URI)
    checkpoint = ray.train.Checkpoint(path, filesystem=fs)
    reference = flat_state(model, optimizer)

    def restore_before() -> int:
        before = store.bytes_read
        copy = store.cache_locally(URI, cache_root=Path(work) / f"node{rank}")
        dcp.load(ckpt.build_app_state(model, optimizer, lora=False), checkpoint_id=str(copy))
        shutil.rmtree(copy)
        return store.bytes_read - before

    def restore_after() -> int:
        reader = ckpt.build_checkpoint_reader(checkpoint, store)
        dcp.load(ckpt.build_app_state(model, optimizer, lora=False), storage_reader=reader)
        return reader.bytes_read

    results = []
    for r in range(args.rounds):
        for name, fn in ([("before", restore_before), ("after", restore_after)] if r % 2 == 0 else
                         [("after", restore_after), ("before", restore_before)]):
            for p in model.parameters():  # restore must write every value back
                p.data.zero_()
            dist.barrier()
            started = time.perf_counter()
            nbytes = fn()
            seconds = time.perf_counter() - started
            state = flat_state(model, optimizer)
            equal = state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
            results.append({"round": r, "name": name, "rank": rank, "bytes": nbytes, "s": seconds, "equal": equal})
    total = sum(p.stat().st_size for p in Path(f"{work}/saved").iterdir())
    Path(f"{out}.{rank}").write_text(json.dumps({"results": results, "checkpoint_bytes": total}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from app.dev import local

    world = 2
    with local.serve_s3() as server, tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "result")
        mp.spawn(worker, args=(world, args, work, server.endpoint, out), nprocs=world, join=True)
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    total = per_rank[0]["checkpoint_bytes"]
    rows, summary = [], {}
    for name in ("before", "after"):
        runs = [x for p in per_rank for x in p["results"] if x["name"] == name]
        per_rank_bytes = [statistics.median(x["bytes"] for x in runs if x["rank"] == r) for r in range(world)]
        # A restore gates the first step on its slowest rank: per round, the slower rank.
        slowest = statistics.median(max(x["s"] for x in runs if x["round"] == r) for r in range(args.rounds))
        summary[name] = {"bytes_per_rank": per_rank_bytes, "slowest_rank_s": round(slowest, 3),
                         "equal": all(x["equal"] for x in runs)}
        rows.append([name, " / ".join(f"{b / 1e6:.1f}" for b in per_rank_bytes),
                     f"{sum(per_rank_bytes) / total:.2f}", f"{slowest:.2f}", summary[name]["equal"]])
    speedup = summary["before"]["slowest_rank_s"] / summary["after"]["slowest_rank_s"]
    table = "\n\n".join([
        f"Checkpoint: {total / 1e6:.1f} MB (full fine-tune, Llama hidden {args.hidden} x {args.layers} layers, "
        f"fp32 weights + AdamW moments, FSDP2 over {world} ranks), on the local S3 endpoint; medians of "
        f"{args.rounds} rounds, taking turns.",
        markdown_table(["restore", "MB read per rank (rank 0 / 1)", "read / checkpoint, all ranks",
                        "slowest rank (s)", "state equals the saved"], rows),
        f"Reading ranges: each rank reads **{summary['after']['bytes_per_rank'][0] / total:.2f}x** the checkpoint "
        f"instead of the whole, and the restore is **{speedup:.2f}x** as fast as a copy per node then a local "
        f"read.",
    ])
    save_result("restore_reads", {"checkpoint_bytes": total, "world": world, "rounds": args.rounds,
                                  **summary, "speedup": round(speedup, 2), "per_rank": per_rank}, table)


if __name__ == "__main__":
    main()
