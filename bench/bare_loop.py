"""The baseline for bench/overhead.py: the same fine-tune as `eft train`, in plain PyTorch.

Same Hugging Face model dir (from_pretrained), the same LoRA through PEFT (or a full
fine-tune), the same prepared Parquet shards read locally with pyarrow, the same rows per
step (the manifest + seed order of app/data/stream.py, a pure numpy helper), the same
micro-batch / accumulation / global batch, AdamW(betas 0.9/0.95), grad clipping, and the
loss normalized by the label tokens of the whole global batch, like app/train/loop.py. No
Ray, no S3, no checkpoints, no metrics files.

Single process: `python bench/bare_loop.py ...`. Under `torchrun --nproc_per_node N` (WORLD_SIZE
> 1) it initializes gloo and applies FSDP2 `fully_shard` per decoder layer and at the root,
like app/model/build.py, and each rank takes its G/N rows of every step. With `--ray-workers N`
it starts a local Ray cluster the way `eft train` does and runs the same loop as the training
function of a Ray Train `TorchTrainer` with N 1-CPU workers (Ray Train sets up gloo): the loop
of torchrun in the processes of Ray, to tell Ray's cost from eft's.

`--device cuda` runs it on a GPU the way eft resolves precision there: a LoRA base in bf16, full
fine-tuning with fp32 weights, bf16 autocast for the forward (single process), or FSDP2 with
bf16 compute / fp32 reduction and nccl (under torchrun).

Rank 0 writes per-step timings (and the wall-clock time of the end of step 1) to --out.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the heavy imports: time to first step counts them

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

IGNORE = -100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data-dir", required=True, help="a prepared dataset copied locally (manifest.json + shards)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--lora", default=None, help="LoRA config as JSON (r, alpha, dropout, target_modules); "
                                                 "omit for a full fine-tune")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as the env sets it)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", required=True, help="rank 0 writes its per-step timings here (JSON)")
    p.add_argument("--ray-workers", type=int, default=None, help="run as a Ray Train job with this many workers")
    p.add_argument("--process-start", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ray_train_worker(config: dict) -> None:
    import ray.train

    ctx = ray.train.get_context()
    os.environ.update(RANK=str(ctx.get_world_rank()), WORLD_SIZE=str(ctx.get_world_size()))
    main(config["argv"])


def run_under_ray(args, argv: list[str]) -> None:
    """The driver of --ray-workers: a local Ray as `eft train` starts one (app/train/launch.py)."""
    import tempfile

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    i = argv.index("--ray-workers")
    worker_argv = argv[:i] + argv[i + 2:] + ["--process-start", str(PROCESS_START)]
    from app.cluster import default_num_cpus, require_token_auth

    require_token_auth()  # as eft's own local Ray
    ray.init(address="local", num_cpus=default_num_cpus(), include_dashboard=True,
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
    try:
        with tempfile.TemporaryDirectory(prefix="bare-loop-ray-") as storage:
            TorchTrainer(ray_train_worker, train_loop_config={"argv": worker_argv},
                         scaling_config=ScalingConfig(num_workers=args.ray_workers, resources_per_worker={"CPU": 1}),
                         torch_config=TorchConfig(backend="gloo"),
                         run_config=RunConfig(storage_path=storage, name="bare-loop")).fit()
    finally:
        ray.shutdown()


def load_rows(data_dir: Path, manifest: dict):
    """All train rows in memory, indexed by row_id (shards hold consecutive row_ids)."""
    import numpy as np
    import pyarrow.parquet as pq

    inputs, labels = [], []
    for shard in manifest["splits"]["train"]["shards"]:
        table = pq.read_table(data_dir / shard["path"], columns=["row_id", "input_ids", "labels"])
        row_id = table["row_id"].to_numpy()
        assert row_id[0] == shard["row_id_start"] and (np.diff(row_id) == 1).all(), shard["path"]
        n = table.num_rows
        inputs.append(table["input_ids"].combine_chunks().flatten().to_numpy().reshape(n, -1))
        labels.append(table["labels"].combine_chunks().flatten().to_numpy().reshape(n, -1))
    return np.concatenate(inputs), np.concatenate(labels)


def decoder_blocks(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(inner, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ray_workers:
        return run_under_ray(args, list(sys.argv[1:] if argv is None else argv))
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from app.data.stream import DataOrder  # numpy only: the same row order as eft

    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    own_group = world > 1 and not dist.is_initialized()  # Ray Train sets up its workers' group itself
    if own_group:
        dist.init_process_group("nccl" if on_gpu else "gloo")

    data_dir = Path(args.data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    all_inputs, all_labels = load_rows(data_dir, manifest)
    order = DataOrder.from_manifest(manifest, args.seed)
    epoch_cache: dict[int, np.ndarray] = {}

    def rows_of_step(step: int) -> np.ndarray:
        g = args.global_batch
        n = order.num_rows
        out, pos = [], step * g
        while pos < (step + 1) * g:
            epoch, offset = divmod(pos, n)
            if epoch not in epoch_cache:
                epoch_cache[epoch] = order.epoch_row_ids(epoch)
            take = min((step + 1) * g - pos, n - offset)
            out.append(epoch_cache[epoch][offset:offset + take])
            pos += take
        ids = np.concatenate(out)
        return ids[rank * g // world:(rank + 1) * g // world]

    # As eft on a GPU: a frozen LoRA base can live in bf16, trainable full-FT weights stay fp32.
    storage_dtype = torch.bfloat16 if on_gpu and args.lora else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=storage_dtype).to(device)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = json.loads(args.lora)
        torch.manual_seed(args.seed)  # the same adapter init on every rank (and as eft's rank 0)
        model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"],
                                                 lora_dropout=lora.get("dropout", 0.0),
                                                 target_modules=list(lora["target_modules"]), bias="none",
                                                 task_type="CAUSAL_LM"))
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # As eft resolves it: fp32 on CPU, bf16 compute with fp32 reduction on a GPU.
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu
              else MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None))
        for block in decoder_blocks(model):
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rows_per_rank = args.global_batch // world
    accum = math.ceil(rows_per_rank / args.micro_batch)
    assert rows_per_rank * world == args.global_batch and accum * args.micro_batch == rows_per_rank

    def all_reduce(t):
        if world > 1:
            dist.all_reduce(t)
        return t

    model.train()
    records = []
    mark = time.perf_counter()
    first_step_end = None
    for step in range(args.steps):
        rows = rows_of_step(step)
        inputs, labels = all_inputs[rows], all_labels[rows]
        began_compute = time.perf_counter()
        global_tokens = all_reduce(torch.tensor(float((labels[:, 1:] != IGNORE).sum()), dtype=torch.float64,
                                                device=device))
        scale = world / global_tokens.clamp(min=1)
        loss_acc = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(accum):
            x = torch.as_tensor(inputs[i * args.micro_batch:(i + 1) * args.micro_batch], dtype=torch.long,
                                device=device)
            y = torch.as_tensor(labels[i * args.micro_batch:(i + 1) * args.micro_batch], dtype=torch.long,
                                device=device)
            if world > 1:
                model.set_requires_gradient_sync(i == accum - 1)
            # Single process on a GPU: autocast gives the bf16 compute that FSDP2's policy gives under torchrun.
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu and world == 1):
                logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten(),
                                   ignore_index=IGNORE, reduction="sum")
            (loss * scale).backward()
            loss_acc += loss.detach().double()
        # Host clock: on a GPU, compute_s and optimizer_s are launch time only; step_time_s (after the
        # per-step sync below) is the number to compare there.
        began_optimizer = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended_optimizer = time.perf_counter()
        # One host sync per step, as eft has with log_every_steps=1.
        train_loss = float(all_reduce(loss_acc) / global_tokens.clamp(min=1))
        now = time.perf_counter()
        if first_step_end is None:
            first_step_end = time.time()
        records.append({"step": step + 1, "loss": train_loss, "step_time_s": now - mark,
                        "compute_s": began_optimizer - began_compute, "optimizer_s": ended_optimizer - began_optimizer,
                        "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                           else grad_norm)})
        mark = now
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "process_start": args.process_start or PROCESS_START, "first_step_end": first_step_end, "world_size": world,
            "torch_threads": torch.get_num_threads(), "global_batch": args.global_batch,
            "micro_batch": args.micro_batch, "accum": accum, "seq_len": int(all_inputs.shape[1]),
            "trainable_params": sum(p.numel() for p in params),
            "total_params": sum(p.numel() for p in model.parameters()), "steps": records,
        }, indent=1))
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
