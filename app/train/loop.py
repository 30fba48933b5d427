"""`train_loop_per_worker`: what every Ray Train worker runs. Read it top to bottom:
setup → resume → loop → report.

The optimizer always sees `training.global_batch_size` sequences per step, whatever the
world size: each worker takes its G/W rows per step (floor or ceil, with
`training.pad_uneven_batches`) in `accum` micro-batches, the same number on every rank,
and the loss is normalized by the label tokens of the whole global batch, so the gradient of
step k is the same function of the same rows at every world size.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from app.config import JobConfig
from app.data.manifest import load_manifest, shard_uris
from app.data.packing import IGNORE_INDEX as IGNORE
from app.data.stream import (DataOrder, RankSlice, document_isolation, iter_rank_rows, iter_step_batches,
                             load_split_rows, prefetch_in_background)
from app.storage import Store
from app.train import checkpoint as ckpt
from app.train import records
from app.train.batch import BatchPlan
from app.train.dropout import apply_row_dropout
from app.train.grow import build_grow_requests
from app.train.loss import apply_loss, loss_sum
from app.train.metrics import MetricsLog, StepTimer, format_progress, peak_memory
from app.train.mfu import mfu, model_flops_per_token, peak_flops
from app.train.nccl import NcclProbe
from app.train.preemption import build_preemption_watcher, state_bytes
from app.train.resume import build_lineage
from app.train.sinks import MlflowSink, TensorBoardSink, flatten
from app.train.model import build_model, count_parameters, resolve_precision, trainable_parameters
from app.train.sharding import all_reduce_gradients, forward_autocast_dtype, replicated_parameters
from app.train.weights import record_weights_loaded

log = logging.getLogger("eft.train")


def lr_at(step: int, total: int, t) -> float:
    """Warmup then decay, keyed on optimizer steps only (a resize does not bend it)."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    progress = min(max(step - t.warmup_steps, 0) / max(total - t.warmup_steps, 1), 1.0)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * decay)


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 1_009 + rank) % (2**31 - 1)


def total_steps(cfg, train_rows: int) -> int:
    if cfg.training.max_steps:
        return cfg.training.max_steps
    return max(int(cfg.training.epochs * train_rows) // cfg.training.global_batch_size, 1)


def setup_worker_logging(rank: int) -> None:
    # Workers never print; rank 0 logs progress, the others only warnings.
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s [eft] %(message)s", force=True)
    for noisy in ("ray.data", "ray.train", "transformers", "peft", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def as_positions(positions: Optional[np.ndarray], device) -> Optional[torch.Tensor]:
    return None if positions is None else torch.as_tensor(positions, dtype=torch.long, device=device)


def label_tokens(labels: np.ndarray) -> int:
    return int((labels[:, 1:] != IGNORE).sum())


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def grad_sync_context(model, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if enabled else model.no_sync()  # DDP


def to_scalar(t: torch.Tensor) -> float:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t.item())


@torch.no_grad()
def evaluate(model, val: dict, rank: int, world: int, micro_batch: int, device, autocast_dtype) -> Optional[float]:
    """Validation loss over the held-out rows; every rank runs the same number of forwards
    (FSDP2 all-gathers in each), padding its share with rows that carry no labels."""
    n = len(val["row_id"])
    if n == 0:
        return None
    model.eval()
    per_rank = math.ceil(n / world)
    per_rank = math.ceil(per_rank / micro_batch) * micro_batch
    idx = np.arange(rank, n, world)
    inputs, labels = val["input_ids"][idx], val["labels"][idx]
    positions = val["position_ids"][idx] if "position_ids" in val else None
    pad = per_rank - len(idx)
    if pad:
        inputs = np.concatenate([inputs, np.repeat(val["input_ids"][:1], pad, 0)])
        labels = np.concatenate([labels, np.full((pad, labels.shape[1]), IGNORE, labels.dtype)])
        if positions is not None:
            positions = np.concatenate([positions, np.repeat(val["position_ids"][:1], pad, 0)])
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, per_rank, micro_batch):
        x = torch.as_tensor(inputs[i:i + micro_batch], dtype=torch.long, device=device)
        y = torch.as_tensor(labels[i:i + micro_batch], dtype=torch.long, device=device)
        p = as_positions(None if positions is None else positions[i:i + micro_batch], device)
        total[0] += loss_sum(model, x, y, autocast_dtype, p).double()
        total[1] += float(label_tokens(labels[i:i + micro_batch]))
    all_reduce_sum(total)
    model.train()
    return float(total[0] / total[1].clamp(min=1))


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    # --- setup -------------------------------------------------------------------
    # Wall-clock marks of this start, for the restart breakdown in the summary.
    marks = {"entered_at": time.time()}
    cfg = JobConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_worker_logging(rank)
    store = Store.from_config(cfg.storage)
    device = ray.train.torch.get_device()
    # Before NCCL's first communicator, so its INIT/NET lines land where rank 0 can read them.
    nccl_probe = NcclProbe.start(device)
    t = cfg.training
    plan = BatchPlan(t.global_batch_size, world, t.micro_batch_size)
    if problem := plan.problem(t.pad_uneven_batches):
        raise ValueError(problem)
    accum, padding_rows = plan.accum, plan.padding_rows

    manifest = load_manifest(store, cfg.data.uri)
    lineage = build_lineage(cfg, manifest)  # recorded with every checkpoint: what it was trained from
    isolate = document_isolation(cfg, manifest, note=rank == 0)
    order = DataOrder.from_manifest(manifest, t.seed)
    steps_total = total_steps(cfg, order.num_rows)
    data_fs, _ = store.resolve(cfg.data.uri)
    train_shards = [store.resolve(u)[1] for u in shard_uris(cfg.data.uri, manifest, "train")]

    # The data position comes from the checkpoint's train_state.json alone, so the stream starts
    # here and its start-up overlaps building the model and restoring the shards.
    checkpoint = ckpt.select_resume_checkpoint(ray.train.get_checkpoint(), store, cfg.run_uri, rank)
    start_rows = int(ckpt.peek_train_state(checkpoint).get("rows_consumed", 0))
    my_slice = RankSlice(rank, world, t.global_batch_size, origin=start_rows)
    rows = iter_rank_rows(order, train_shards, data_fs, my_slice, start=start_rows, position_ids=isolate)
    batches = prefetch_in_background(iter_step_batches(rows, my_slice.rows_per_step, t.micro_batch_size, accum),
                                     depth=2)

    # A Store of its own, so its byte count is what loading the model read from storage.
    model_store, load_started = Store.from_config(cfg.storage), time.monotonic()
    marks["model_load_at"] = time.time()
    model = build_model(cfg, model_store, device, rank, world)
    marks["model_built_at"] = time.time()
    record_weights_loaded(store, cfg, rank, model_store.bytes_read, time.monotonic() - load_started,
                          bytes_cached=model_store.bytes_cached)
    apply_loss(model, t.loss, t.loss_chunk_tokens)  # train and evaluate both go through loss_sum
    row_seeds = apply_row_dropout(model, t.seed, note=rank == 0)  # masks keyed on rows, not ranks
    precision = resolve_precision(cfg, device)
    autocast_dtype = forward_autocast_dtype(model, precision.param_dtype)
    params = trainable_parameters(model)
    replicated = replicated_parameters(model)  # LoRA adapters under FSDP2: reduced here, once per step
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    n_trainable, n_total = count_parameters(model)
    val = {"row_id": []}
    if t.eval_every_steps and manifest["splits"].get("validation", {}).get("rows"):
        val_shards = [store.resolve(u)[1] for u in shard_uris(cfg.data.uri, manifest, "validation")]
        val = load_split_rows(val_shards, data_fs, limit=t.eval_max_batches * t.global_batch_size,
                              position_ids=isolate)

    # --- resume ------------------------------------------------------------------
    state = ckpt.restore(checkpoint, model, optimizer, lora=cfg.lora is not None)
    marks["restored_at"] = time.time()
    step, rows_consumed = state.step, state.rows_consumed
    if rows_consumed != start_rows:
        raise RuntimeError(f"checkpoint {checkpoint.path}: train_state changed while loading "
                           f"({start_rows} then {rows_consumed} rows consumed)")
    metrics = MetricsLog(store, cfg.run_uri, enabled=rank == 0)
    metrics.load(up_to_step=step)
    sinks = []
    if rank == 0:
        sinks.append(TensorBoardSink(store, cfg.run_uri, resumed_from_step=step))
        if config.get("mlflow"):
            sinks.append(MlflowSink(config["mlflow"], cfg.run_uri, flatten(config["cfg"])))
    attempt = None
    if rank == 0:
        log.info("world %d x accum %d x micro %d = global batch %d%s | params %.2fM trainable of %.2fM | "
                 "%s from step %d of %d", world, accum, t.micro_batch_size, t.global_batch_size,
                 f" + {padding_rows} padding rows" if padding_rows else "", n_trainable / 1e6, n_total / 1e6,
                 "resuming" if step else "starting", step, steps_total)
        attempt = records.record_event(store, cfg.run_uri, "worker_group_start", world_size=world,
                                    resumed_from_step=step if state.restored else None, padding_rows=padding_rows,
                                    document_isolation=isolate, **marks)
    heartbeat = records.Heartbeat(store, cfg.run_uri, attempt or "", enabled=rank == 0, world_size=world,
                          resumed_from_step=step)
    watcher = (build_preemption_watcher(store, cfg.run_uri, rank, device, state_bytes(params))
               if cfg.checkpoint.on_preemption else None)
    elastic = cfg.scaling.min_workers < cfg.scaling.max_workers
    grow = build_grow_requests(store, cfg.run_uri, rank) if elastic and cfg.checkpoint.before_grow else None

    timer = StepTimer(steps_total, start_step=step, device=device)
    tokens_per_step = t.global_batch_size * cfg.data.seq_len
    flops_per_token = model_flops_per_token(model, cfg.data.seq_len, cfg.lora is not None, n_total, n_trainable)
    device_peak = peak_flops(device)
    # Summed loss and label tokens since the last logging step, kept on device: no host sync.
    loss_acc = torch.zeros((), dtype=torch.float64, device=device)
    tokens_acc = torch.zeros((), dtype=torch.float64, device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)

    # --- loop --------------------------------------------------------------------
    model.train()
    while step < steps_total:
        lr = lr_at(step, steps_total, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # Dropout masks come from RowSeeds (seed, step, row). The global RNG is seeded only for
        # random ops outside them (none in the models we train): a resumed step redraws the same.
        torch.manual_seed(step_seed(t.seed, step, rank))

        with timer.phase("data"):
            micro = next(batches)
        heartbeat.mark_first_batch()
        with timer.phase("compute"):
            global_tokens = all_reduce_sum(torch.tensor(float(sum(label_tokens(m[2]) for m in micro)),
                                                        dtype=torch.float64, device=device))
            tokens_acc += global_tokens
            scale = world / global_tokens.clamp(min=1)
            for i, (row_ids, inputs, labels, positions) in enumerate(micro):
                x = torch.as_tensor(inputs, dtype=torch.long, device=device)
                y = torch.as_tensor(labels, dtype=torch.long, device=device)
                with grad_sync_context(model, enabled=i == accum - 1), row_seeds.rows(row_ids, step):
                    loss = loss_sum(model, x, y, autocast_dtype, as_positions(positions, device))
                    (loss * scale).backward()
                loss_acc += loss.detach().double()
            all_reduce_gradients(replicated, world)
        with timer.phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        nonfinite |= ~torch.isfinite(loss_acc)
        step += 1
        rows_consumed += t.global_batch_size

        is_eval = bool(t.eval_every_steps) and (step % t.eval_every_steps == 0 or step == steps_total)
        if is_eval or step % t.log_every_steps == 0 or step == steps_total:
            # Logging steps are the only host syncs in the loop.
            train_loss = float(all_reduce_sum(loss_acc.clone()) / tokens_acc.clamp(min=1))
            if bool(nonfinite) or not math.isfinite(train_loss):
                raise FloatingPointError(f"non-finite loss {train_loss} at step {step}; stopping")
            record = {"step": step, "loss": train_loss, "lr": lr, "grad_norm": to_scalar(grad_norm),
                      "world_size": world, "rows_consumed": rows_consumed, "epoch": rows_consumed / order.num_rows,
                      **timer.end_step(step, tokens_per_step), **peak_memory(device)}
            record["tokens_per_s_per_worker"] = record["tokens_per_s"] / world
            record["mfu"] = mfu(record["tokens_per_s"], flops_per_token, device_peak, world)
            if t.trace_rows:
                record["row_ids"] = gather_row_ids(micro, world, device)
            loss_acc.zero_()
            tokens_acc.zero_()
            if is_eval:
                val_loss = evaluate(model, val, rank, world, t.micro_batch_size, device, autocast_dtype)
                if val_loss is not None:
                    record["val_loss"], record["val_ppl"] = val_loss, math.exp(min(val_loss, 50.0))
            metrics.append(record)
            for sink in sinks:
                sink.log(record)
            if rank == 0:
                log.info(format_progress(record, steps_total))
        else:
            timer.skip_step()
        heartbeat.beat(step)
        if nccl_probe and rank == 0 and step == timer.start_step + 1:
            nccl_probe.report(store, cfg.run_uri, nodes=max(world // ctx.get_local_world_size(), 1))

        just_in_time = watcher.after_step(step) if watcher is not None else None
        before_grow = grow.after_step(step) if grow is not None else None
        if just_in_time or before_grow or step % cfg.checkpoint.save_every_steps == 0 or step == steps_total:
            # A just-in-time or pre-grow save waits for its upload: the group drains only once it is up.
            wait_for_upload = just_in_time is not None or before_grow is not None or not cfg.checkpoint.async_upload
            if before_grow:
                grow.acknowledge_when_up(before_grow, step, cfg.checkpoint.before_grow_timeout_s)
            with timer.phase("checkpoint"):
                began = time.monotonic()
                # Lines first: a checkpoint never exists without the metrics up to its step.
                metrics.flush()
                ckpt.save(cfg, store, model, optimizer, step=step, rows_consumed=rows_consumed, world_size=world,
                          metrics=metrics.latest(), rank=rank, lineage=lineage, wait_for_upload=wait_for_upload)
            if watcher is not None:
                watcher.record_save(time.monotonic() - began, uploaded=wait_for_upload)
            heartbeat.beat(step, force=True)
            if just_in_time and just_in_time.drain and step < steps_total:
                heartbeat.flush()
                watcher.drain(step)  # raises once the node is gone: Ray restarts from this checkpoint
            if before_grow and step < steps_total:
                heartbeat.flush()
                grow.drain(cfg.checkpoint.before_grow_timeout_s)  # Ray restarts the group bigger

    # --- report ------------------------------------------------------------------
    # The final step always saves (above), which reports its metrics and checkpoint to Ray.
    if grow is not None:
        grow.stop()
    metrics.flush()
    heartbeat.flush()
    for sink in sinks:
        sink.finish()
    if rank == 0:
        log.info("done: %d steps, %d rows consumed", step, rows_consumed)


def gather_row_ids(micro, world: int, device) -> list[int]:
    """The global batch's row_ids in slot order (rank 0 first, padding dropped); tracing only."""
    mine = torch.as_tensor(np.concatenate([m[0] for m in micro]), dtype=torch.long, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [r for r in torch.cat(out).cpu().tolist() if r >= 0]
