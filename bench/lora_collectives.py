"""LoRA under FSDP2, adapters sharded with their blocks (the path before issue 14, `lora.fsdp_adapters:
sharded`) vs replicated (the default): collectives per optimizer step, tensors FSDP2 gathers, and
step time, on 2 gloo processes (pure torch, no Ray), both variants in the same processes.

    .venv/bin/python bench/lora_collectives.py [--rounds 4] [--steps 4] [--accum 4] [--threads 1]

The model is the benches' random-init Llama (bench/_setup.py BENCH_MODEL: hidden 256, 4 layers)
with BENCH_LORA (r 8 on all 7 projections), fp32 on CPU, built by app.model.build.build_model; the
step is the loop's (micro-batches with the gradient sync on the last, the replicated gradients'
all-reduce, clipping, AdamW). Collectives are counted by the backend's profiler events on one step
(app/dev/collectives.py), so they include FSDP2's gathers and reductions and DTensor's all-reduce
of the sharded gradients' norm. Step times alternate variant by variant (A B, B A, ...) after a
warm-up step of each; the ratio is taken per round and the median reported. Wall clock and the CPU
time of the stepping thread are both given: on a loaded 2-core box the wall clock is noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._setup import BENCH_LORA, BENCH_MODEL, BENCH_SEQ_LEN, load_average, load_note  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

VARIANTS = ("sharded", "replicated")


def build_cfg(model_dir: Path, variant: str, args):
    from app.config import build_config

    return build_config({
        "name": "lora-collectives", "model": {"uri": str(model_dir)},
        "lora": {**BENCH_LORA, "fsdp_adapters": variant},
        "data": {"uri": str(model_dir / "no-data"), "seq_len": args.seq_len},
        "training": {"max_steps": 1, "global_batch_size": 2 * args.accum, "micro_batch_size": 1,
                     "parallelism": "fsdp"},
        "storage": {"root_uri": str(model_dir / "no-runs")},
    })


def make_step(model, rank: int, world: int, args):
    """One optimizer step of the loop on fixed random rows; returns a closure."""
    import torch

    from app.model.build import trainable_parameters
    from app.model.sharding import all_reduce_gradients, forward_autocast_dtype, replicated_parameters
    from app.model.loss import loss_sum
    from app.train.loop import grad_sync_context

    params, replicated = trainable_parameters(model), replicated_parameters(model)
    autocast = forward_autocast_dtype(model, None)
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    vocab = model.config.vocab_size
    rows = torch.randint(3, vocab, (args.accum, 1, args.seq_len), generator=torch.Generator().manual_seed(rank))
    scale = world / (world * args.accum * (args.seq_len - 1))

    def step() -> None:
        for i in range(args.accum):
            with grad_sync_context(model, enabled=i == args.accum - 1):
                (loss_sum(model, rows[i], rows[i], autocast) * scale).backward()
        all_reduce_gradients(replicated, world)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def describe(model) -> dict:
    from torch.distributed.tensor import DTensor

    from app.model.sharding import replicated_parameters

    params = list(model.parameters())
    adapters = [p for p in params if p.requires_grad]
    return {"fsdp2_tensors": sum(isinstance(p, DTensor) for p in params),
            "replicated_tensors": len(replicated_parameters(model)), "adapter_tensors": len(adapters),
            "adapter_params": sum(p.numel() for p in adapters)}


def worker(rank: int, world: int, model_dir: str, port: int, out: str, args) -> None:
    import torch
    import torch.distributed as dist

    from app.dev.collectives import count_collectives
    from app.model.build import build_model
    from app.storage import Store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    models = {v: build_model(build_cfg(Path(model_dir), v, args), Store(), torch.device("cpu"), rank, world)
              for v in VARIANTS}
    steps = {v: make_step(m, rank, world, args) for v, m in models.items()}
    result = {v: describe(m) for v, m in models.items()}
    for v in VARIANTS:
        steps[v]()  # warm-up: FSDP2's lazy init, allocator
        with count_collectives() as calls:
            steps[v]()
        result[v]["collectives"] = dict(calls)
    timings = {v: {"wall": [], "cpu": []} for v in VARIANTS}
    for r in range(args.rounds):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                steps[v]()
            timings[v]["wall"].append((time.perf_counter() - wall) / args.steps)
            timings[v]["cpu"].append((time.thread_time() - cpu) / args.steps)
    if rank == 0:
        torch.save({"variants": result, "timings": timings}, out)
    dist.destroy_process_group()


def build_model_dir(path: Path, seq_len: int) -> None:
    from app.dev.tiny import build_corpus, build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(build_corpus(max_docs=200), vocab_size=512)
    build_tiny_model(tokenizer, **{**BENCH_MODEL, "max_positions": max(seq_len, 512)}).save_pretrained(path)


def main() -> None:
    from app.dev.local import find_free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step on each worker")
    parser.add_argument("--seq-len", type=int, default=BENCH_SEQ_LEN)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp

    before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = Path(tmp) / "model", Path(tmp) / "result.pt"
        build_model_dir(model_dir, args.seq_len)
        mp.spawn(worker, args=(2, str(model_dir), find_free_port(), str(out), args), nprocs=2)
        data = torch.load(out, weights_only=False)
    after = load_average()

    variants, timings = data["variants"], data["timings"]

    def reductions(calls: dict) -> int:
        return sum(n for op, n in calls.items() if op != "all_gather")

    ratio = {clock: statistics.median(s / r for s, r in zip(timings["sharded"][clock], timings["replicated"][clock]))
             for clock in ("wall", "cpu")}
    rows = []
    for v in VARIANTS:
        calls = variants[v]["collectives"]
        rows.append([v, sum(calls.values()), calls.get("all_gather", 0), reductions(calls),
                     variants[v]["fsdp2_tensors"], variants[v]["replicated_tensors"],
                     f"{statistics.median(timings[v]['wall']):.3f}", f"{statistics.median(timings[v]['cpu']):.3f}"])
    table = markdown_table(["adapters", "collectives / step", "all-gathers", "reductions", "tensors FSDP2 gathers",
                            "replicated tensors", "step s (wall)", "step s (CPU)"], rows)
    blocks = BENCH_MODEL["num_layers"]
    text = (
        f"LoRA r={BENCH_LORA['r']} on all 7 projections of the bench Llama (hidden {BENCH_MODEL['hidden_size']}, "
        f"{blocks} blocks; {variants['replicated']['adapter_tensors']} adapter tensors, "
        f"{variants['replicated']['adapter_params'] / 1e6:.2f}M parameters), 2 gloo processes, FSDP2, fp32, "
        f"seq {args.seq_len}, {args.accum} micro-batches of 1 per worker per step. Collectives counted on one "
        f"step; times are medians over {args.rounds} interleaved rounds of {args.steps} steps.\n\n{table}\n\n"
        f"**Sharded / replicated step time: {ratio['wall']:.2f}x wall, {ratio['cpu']:.2f}x CPU** (median of per-round "
        "ratios; above 1 = replicated faster).\n\n"
        f"Reductions per step fall from one per block plus the sharded gradients' norm ({blocks} + 1; gloo runs "
        "FSDP2's reduce-scatter as an all-reduce) to one all-reduce of one bucket. The base is all-gathered as "
        "before (per micro-batch, each block in forward and again in backward), now without the adapters in "
        "the gathered groups. On a GPU the saving is the per-micro-batch copy-in/cast/copy-out of the hundreds "
        "of adapter tensors in those gathers, which a 2-core CPU box cannot weigh; the GPU check measures it.\n\n"
        f"{load_note(before, after)}")
    save_result("lora_collectives", {"args": vars(args), "variants": variants, "timings": timings,
                                     "ratio_sharded_over_replicated": ratio}, text)


if __name__ == "__main__":
    main()
