"""`train_loop_per_worker`: what every Ray Train worker runs, in torchtitan's shape:
`setup` (stream, model, optimizer) → `resume` (the checkpoint's state, this attempt's records)
→ `train`: `train_step`, `log_step`, `maybe_checkpoint` (with the PreemptionWatcher and the
grow requests) until the last step → `report`. Each reads and advances one `Worker`, whose
state is a few named parts: data, model, recorders, watchers and progress.

The optimizer always sees `training.global_batch_size` sequences per step, whatever the
world size: each worker takes its G/W rows per step (floor or ceil, with
`training.pad_uneven_batches`) in `accum` micro-batches, the same number on every rank,
and the loss is normalized over the whole global batch (its label tokens for SFT, its pairs for
the preference objectives: app/train/objective.py), so the gradient of step k is the same function
of the same rows at every world size.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from app.batch import IGNORE_INDEX as IGNORE, BatchPlan
from app.config import JobConfig
from app.data.manifest import load_manifest, split_shard_uris
from app.data.stream import (DataOrder, RankSlice, document_isolation, iter_rank_rows, iter_step_batches,
                             load_split_rows, opens_epoch, prefetch_in_background)
from app.elastic import checkpoint as ckpt
from app.elastic.grow import GrowRequests, build_grow_requests
from app.elastic.preemption import PreemptionWatcher, build_preemption_watcher, state_bytes
from app.elastic.resume import build_lineage
from app.elastic.signals import SignalStop, build_signal_stop
from app.eval.during import should_validate, validate_in_process
from app.lease import Fence
from app.model.build import build_model, count_parameters, resolve_precision, trainable_parameters
from app.model.dropout import apply_row_dropout
from app.model.loss import apply_loss
from app.model.mfu import mfu, model_flops_per_token, peak_flops
from app.model.sharding import (Float64GradSum, all_reduce_gradients, forward_autocast_dtype,
                                replicated_parameters)
from app.observe import records
from app.observe.metrics import MetricsLog, StepTimer, format_progress, peak_memory
from app.observe.nccl import NcclProbe
from app.observe.records import record_weights_loaded
from app.observe.sinks import MlflowSink, TensorBoardSink, WandbSink, flatten
from app.storage import Store, join
from app.train.objective import build_objective, summarize

log = logging.getLogger("eft.train")

PREFETCH_STEPS = 2  # step batches the prefetch thread builds ahead of the loop


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
    """`max_steps`, or the steps `epochs` passes over the train rows (GRPO: prompts) take."""
    if cfg.training.max_steps:
        return cfg.training.max_steps
    return max(int(cfg.training.epochs * train_rows) // rows_per_step(cfg), 1)


def rows_per_step(cfg) -> int:
    """Train rows an optimizer step consumes: the global batch, or GRPO's prompts."""
    return cfg.rl.prompts_per_step if cfg.training.objective == "grpo" else cfg.training.global_batch_size


def setup_worker_logging(rank: int) -> None:
    # Workers never print; rank 0 logs progress, the others only warnings.
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s [eft] %(message)s", force=True)
    for noisy in ("ray.data", "ray.train", "transformers", "peft", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


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
def evaluate(model, objective, val: dict, rank: int, world: int, micro_batch: int, device,
             autocast_dtype) -> Optional[dict]:
    """The objective's validation loss and metrics (`val_loss`, `val_<metric>`) over the held-out
    rows; every rank runs the same number of forwards (FSDP2 all-gathers in each), padding its share
    with rows that carry no labels."""
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
    refs = [val["ref_logps"][j] for j in idx] if "ref_logps" in val else None
    k = len(objective.metric_names)
    total = torch.zeros(2 + k, dtype=torch.float64, device=device)
    for i in range(0, per_rank, micro_batch):
        p = None if positions is None else positions[i:i + micro_batch]
        ref = None if refs is None else flat_refs(refs[i:i + micro_batch])
        loss, metrics = objective.forward(model, inputs[i:i + micro_batch], labels[i:i + micro_batch], p, ref,
                                          device, autocast_dtype)
        total[0] += loss.double()
        total[1] += float(objective.units(labels[i:i + micro_batch], p))
        total[2:] += metrics
    all_reduce_sum(total)
    model.train()
    values = total.tolist()
    return summarize(objective, values[0], values[1], values[2:], prefix="val_")


def flat_refs(rows: list) -> np.ndarray:
    """Rows' precomputed reference log-probs (one per document), end to end in row order."""
    return np.concatenate([np.asarray(r, dtype=np.float32) for r in rows]) if rows else np.zeros(0, np.float32)


def train_loop_per_worker(config: dict) -> None:
    w = setup(config)
    resume(w, config)
    train(w)
    report(w)


def train(w: "Worker") -> None:
    """Step, log and checkpoint until the last step."""
    w.model.module.train()
    while w.progress.step < w.data.steps_total and w.progress.stopped_on is None:
        micro, lr, grad_norm = train_step(w)
        log_step(w, micro, lr, grad_norm)
        maybe_checkpoint(w)


@dataclass
class DataParts:
    """What this rank trains on: the batch split, the row stream, the held-out rows, and where
    the run resumes in them."""

    manifest: dict
    plan: Optional[BatchPlan]  # None for GRPO, whose rows per rank come from its rollouts
    lineage: dict  # what every checkpoint records it was trained from
    train_rows: int
    steps_total: int
    checkpoint: object  # Ray's (or a newer complete) checkpoint to resume from, or None
    start_rows: int
    batches: Iterator
    isolate: bool  # attention stays inside each packed document
    # Seconds from each epoch pipeline's start to its first row, appended by the prefetch thread.
    epoch_openings_s: list = field(default_factory=list)
    val: dict = field(default_factory=lambda: {"row_id": []})
    rollouts: object = None  # GRPO: app/rl/colocated.py's ColocatedRollouts, which builds each step's rows


@dataclass
class ModelParts:
    """The model this rank trains, and what trains it."""

    module: torch.nn.Module
    row_seeds: object  # dropout masks keyed on (seed, step, row)
    autocast_dtype: Optional[torch.dtype]
    params: list
    replicated: list  # trainable parameters the loop reduces itself (LoRA adapters under FSDP2)
    optimizer: torch.optim.Optimizer
    objective: object  # app/train/objective.py: what a micro-batch's loss is, and what it is divided by
    n_trainable: int
    n_total: int
    # GRPO with every trainable parameter reduced by the loop: the step's gradient summed in float64
    # (app.model.sharding.Float64GradSum), the same at any world size; None elsewhere.
    exact_sum: Optional[Float64GradSum] = None


@dataclass
class Recorders:
    """What records this attempt: metrics and their sinks, the heartbeat, timings, the NCCL probe."""

    marks: dict  # wall-clock marks of this start, for the restart breakdown in the summary
    nccl_probe: Optional[NcclProbe]
    metrics: Optional[MetricsLog] = None
    sinks: list = field(default_factory=list)
    heartbeat: Optional[records.Heartbeat] = None
    timer: Optional[StepTimer] = None
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    device_peak: Optional[float] = None


@dataclass
class Watchers:
    """What may stop the loop early at a step boundary, each after a checkpoint."""

    preemption: Optional[PreemptionWatcher] = None
    grow: Optional[GrowRequests] = None
    signal: Optional[SignalStop] = None  # torchrun: SIGTERM or SIGUSR1, then a checkpoint and stop


@dataclass
class Progress:
    """Where the loop is, and the loss, its units (label tokens or pairs) and the objective's
    metric sums since the last logging step (on device: no host sync until it is logged)."""

    step: int = 0
    rows_consumed: int = 0
    loss_sum: Optional[torch.Tensor] = None
    units: Optional[torch.Tensor] = None
    metric_sums: Optional[torch.Tensor] = None
    nonfinite: Optional[torch.Tensor] = None
    rollout_sums: dict = field(default_factory=dict)  # GRPO: the rollout statistics since the last log
    rollout_maxima: dict = field(default_factory=dict)
    stopped_on: Optional[str] = None  # the signal that stopped the loop early (torchrun), once saved


@dataclass
class Worker:
    """One worker of one worker-group attempt: built by `setup` and `resume`, then read and
    advanced by `train_step`, `log_step` and `maybe_checkpoint`."""

    cfg: JobConfig
    rank: int
    world: int
    nodes: int
    device: torch.device
    store: Store
    data: DataParts
    model: ModelParts
    recorders: Recorders
    fence: Optional[Fence] = None  # the run lease's epoch this group was started with
    launcher: str = "ray"  # or "torchrun": Ray Train's local mode, no Ray cluster (app/train/torchrun.py)
    mlflow: Optional[dict] = None  # the driver's MLflow settings (rank 0 only)
    wandb: Optional[dict] = None  # the driver's W&B settings (rank 0 only)
    watchers: Watchers = field(default_factory=Watchers)
    progress: Progress = field(default_factory=Progress)


def setup(config: dict) -> Worker:
    """The data stream, the model, the optimizer: everything but the checkpoint's state."""
    import ray.train
    import ray.train.torch

    marks = {"entered_at": time.time()}
    launcher = config.get("launcher", "ray")
    if launcher == "torchrun":
        config = adopt_rank_zero_config(config)
    cfg = JobConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_worker_logging(rank)
    store = Store.from_config(cfg.storage)
    # A group started by a driver that has since lost the run (Ray Train restarts groups on its
    # own) stops here, before it writes anything.
    fence = Fence.from_dict(config.get("fence"))
    if fence is not None:
        fence.check(store)
    device = ray.train.torch.get_device()
    # Before NCCL's first communicator, so its INIT/NET lines land where rank 0 can read them.
    nccl_probe = NcclProbe.start(device)
    reader = "direct" if launcher == "torchrun" else "ray"
    data = setup_data(cfg, store, rank, world, reader)
    # A Store of its own, so its byte count is what loading the model read from storage.
    model_store, load_started = Store.from_config(cfg.storage), time.monotonic()
    marks["model_load_at"] = time.time()
    model = setup_model(cfg, model_store, device, rank, world)
    marks["model_built_at"] = time.time()
    record_weights_loaded(store, cfg, rank, model_store.bytes_read, time.monotonic() - load_started,
                          bytes_cached=model_store.bytes_cached)
    if cfg.training.eval_every_steps and data.manifest["splits"].get("validation", {}).get("rows"):
        data.val = load_validation_rows(cfg, store, data.manifest, data.isolate, reader)
    if cfg.training.objective == "grpo":
        data.rollouts = build_rollouts(cfg, store, data.manifest, rank, world, device, model.autocast_dtype)
    return Worker(cfg=cfg, rank=rank, world=world, nodes=max(world // ctx.get_local_world_size(), 1), device=device,
                  store=store, data=data, model=model, recorders=Recorders(marks=marks, nccl_probe=nccl_probe),
                  fence=fence, launcher=launcher, mlflow=config.get("mlflow"), wandb=config.get("wandb"))


def adopt_rank_zero_config(config: dict) -> dict:
    """torchrun: rank 0 took the run lease and resolved the config before the group formed (the
    other ranks started with cfg None); every rank trains on what rank 0 resolved, with its fence."""
    if not dist.is_initialized():
        return config
    box = [config if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def setup_data(cfg: JobConfig, store: Store, rank: int, world: int, reader: str = "ray") -> DataParts:
    """This rank's row stream, started at the checkpoint's data position: it comes from the
    checkpoint's train_state.json alone, so the stream's start-up overlaps building the model and
    restoring the shards. `reader`: "ray" (Ray Data) or "direct" (torchrun: the same rows)."""
    import ray.train

    if cfg.training.objective == "grpo":
        return setup_prompt_data(cfg, store, rank)
    t = cfg.training
    plan = BatchPlan(t.global_batch_size, world, t.micro_batch_size)
    if problem := plan.problem(t.pad_uneven_batches):
        raise ValueError(problem)
    manifest = load_manifest(store, cfg.data.uri)
    isolate = document_isolation(cfg, manifest, note=rank == 0)
    order = DataOrder.from_manifest(manifest, t.seed)
    data_fs, _ = store.resolve(cfg.data.uri)
    # DPO's precomputed reference log-probs travel in a copy of the shards that carries them.
    reference = cfg.reference_mode == "precomputed"
    train_shards = [store.resolve(u)[1] for u in split_shard_uris(cfg.data.uri, manifest, "train", reference)]
    checkpoint = ckpt.select_resume_checkpoint(ray.train.get_checkpoint(), store, cfg.run_uri, rank)
    start_rows = int(ckpt.peek_train_state(checkpoint).get("rows_consumed", 0))
    my_slice = RankSlice(rank, world, t.global_batch_size, origin=start_rows)
    openings: list[float] = []
    rows = iter_rank_rows(order, train_shards, data_fs, my_slice, start=start_rows, position_ids=isolate,
                          ref_logps=reference, on_epoch_start=openings.append, reader=reader)
    batches = prefetch_in_background(iter_step_batches(rows, my_slice.rows_per_step, t.micro_batch_size,
                                                       plan.accum, trim=not manifest.get("packing", True)),
                                     depth=PREFETCH_STEPS)
    return DataParts(manifest=manifest, plan=plan, lineage=build_lineage(cfg, manifest), train_rows=order.num_rows,
                     steps_total=total_steps(cfg, order.num_rows), checkpoint=checkpoint, start_rows=start_rows,
                     batches=batches, isolate=isolate, epoch_openings_s=openings)


def setup_prompt_data(cfg: JobConfig, store: Store, rank: int) -> DataParts:
    """GRPO: the prompt set and where the run resumes in its seeded order (prompts consumed). The
    rows come from each step's rollouts (`build_rollouts`, once the model is built)."""
    import ray.train

    manifest = load_manifest(store, cfg.data.uri)
    checkpoint = ckpt.select_resume_checkpoint(ray.train.get_checkpoint(), store, cfg.run_uri, rank)
    start_rows = int(ckpt.peek_train_state(checkpoint).get("rows_consumed", 0))
    prompts = manifest["splits"]["train"]["rows"]
    return DataParts(manifest=manifest, plan=None, lineage=build_lineage(cfg, manifest), train_rows=prompts,
                     steps_total=total_steps(cfg, prompts), checkpoint=checkpoint, start_rows=start_rows,
                     batches=iter(()), isolate=True)


def build_rollouts(cfg: JobConfig, store: Store, manifest: dict, rank: int, world: int, device, autocast_dtype):
    from app.data.engines import load_tokenizer
    from app.rl.prompts import load_prompt_split

    if cfg.rl.rollout == "actors":  # sampling on the pool; scoring, packing and the rest as colocated
        from app.rl.actors import ActorRollouts as Rollouts
    else:
        from app.rl.colocated import ColocatedRollouts as Rollouts

    prompts = load_prompt_split(store, cfg.data.uri, manifest, "train")
    tokenizer = load_tokenizer(store, cfg.tokenizer_uri)
    facts = manifest["tokenizer"]
    return Rollouts(cfg, prompts, tokenizer, manifest["stop_token_ids"], facts["pad_token_id"], rank, world, device,
                    autocast_dtype)


def load_validation_rows(cfg: JobConfig, store: Store, manifest: dict, isolate: bool, reader: str = "ray") -> dict:
    """The held-out rows evaluated at every eval step (at most eval_max_batches global batches)."""
    t = cfg.training
    data_fs, _ = store.resolve(cfg.data.uri)
    reference = cfg.reference_mode == "precomputed"
    val_shards = [store.resolve(u)[1] for u in split_shard_uris(cfg.data.uri, manifest, "validation", reference)]
    return load_split_rows(val_shards, data_fs, limit=t.eval_max_batches * t.global_batch_size, position_ids=isolate,
                           ref_logps=reference, reader=reader)


def setup_model(cfg: JobConfig, model_store: Store, device: torch.device, rank: int, world: int) -> ModelParts:
    """The model built and its weights loaded, the loss and dropout applied, the optimizer."""
    t = cfg.training
    model = build_model(cfg, model_store, device, rank, world)
    apply_loss(model, t.loss, t.loss_chunk_tokens)  # train and evaluate both go through loss_sum
    row_seeds = apply_row_dropout(model, t.seed, note=rank == 0)  # masks keyed on rows, not ranks
    precision = resolve_precision(cfg, device)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    n_trainable, n_total = count_parameters(model)
    reference = None
    if t.objective == "grpo" and cfg.rl.kl_beta and cfg.lora is None:
        # A full fine-tune's KL reference: the base, frozen (LoRA's is the policy, adapters off).
        # Read through a Store of its own: model_store's byte count is the policy's load.
        reference = build_model(cfg, Store.from_config(cfg.storage), device, rank, world, frozen=True)
        apply_loss(reference, t.loss, t.loss_chunk_tokens)
    replicated = replicated_parameters(model)
    exact = t.objective == "grpo" and bool(replicated) and len(replicated) == len(params)
    return ModelParts(module=model, row_seeds=row_seeds,
                      autocast_dtype=forward_autocast_dtype(model, precision.param_dtype), params=params,
                      replicated=replicated, optimizer=optimizer,
                      objective=build_objective(cfg, reference), n_trainable=n_trainable, n_total=n_total,
                      exact_sum=Float64GradSum(replicated) if exact else None)


def resume(w: Worker, config: dict) -> None:
    """The checkpoint's state, then what records this attempt: metrics, sinks, its start
    event and heartbeat, and what watches for a notice or a grow."""
    cfg, t, d, m, rec = w.cfg, w.cfg.training, w.data, w.model, w.recorders
    restore_started = time.time()
    state = ckpt.restore(d.checkpoint, w.store, m.module, m.optimizer, lora=cfg.lora is not None)
    rec.marks["restored_at"] = time.time()
    if state.restored and w.rank == 0:
        log.info("restored step %d in %.1f s (%.1f MB read from storage by rank 0)", state.step,
                 rec.marks["restored_at"] - restore_started, state.bytes_read / 1e6)
    w.progress.step, w.progress.rows_consumed = state.step, state.rows_consumed
    if state.rows_consumed != d.start_rows:
        raise RuntimeError(f"checkpoint {d.checkpoint.path}: train_state changed while loading "
                           f"({d.start_rows} then {state.rows_consumed} rows consumed)")
    step = state.step
    rec.metrics = MetricsLog(w.store, cfg.run_uri, enabled=w.rank == 0, fence=w.fence)
    rec.metrics.load(up_to_step=step)
    attempt = None
    if w.rank == 0:
        rec.sinks.append(TensorBoardSink(w.store, cfg.run_uri, resumed_from_step=step))
        if config.get("mlflow"):
            rec.sinks.append(MlflowSink(config["mlflow"], cfg.run_uri, flatten(config["cfg"])))
        if config.get("wandb"):
            rec.sinks.append(WandbSink(config["wandb"], cfg.run_uri, config["cfg"], resumed_from_step=step))
        padding = d.plan.padding_rows if d.plan is not None else 0
        if d.plan is None:
            log.info("world %d | %d prompts x %d completions per step, micro %d | params %.2fM trainable of %.2fM | "
                     "%s from step %d of %d", w.world, cfg.rl.prompts_per_step, cfg.rl.group_size, t.micro_batch_size,
                     m.n_trainable / 1e6, m.n_total / 1e6, "resuming" if step else "starting", step, d.steps_total)
        else:
            log.info("world %d x accum %d x micro %d = global batch %d%s | params %.2fM trainable of %.2fM | "
                     "%s from step %d of %d", w.world, d.plan.accum, t.micro_batch_size, t.global_batch_size,
                     f" + {padding} padding rows" if padding else "", m.n_trainable / 1e6, m.n_total / 1e6,
                     "resuming" if step else "starting", step, d.steps_total)
        attempt = records.record_event(w.store, cfg.run_uri, "worker_group_start", world_size=w.world,
                                       resumed_from_step=step if state.restored else None, padding_rows=padding,
                                       document_isolation=d.isolate, metrics_writer=rec.metrics.writer_id,
                                       lease_epoch=w.fence.epoch if w.fence is not None else None, **rec.marks)
    rec.heartbeat = records.Heartbeat(w.store, cfg.run_uri, attempt or "", enabled=w.rank == 0,
                                      world_size=w.world, resumed_from_step=step)
    # Ray's notice comes only from its controller: Ray Train's local mode (torchrun) has none, and
    # its stop signals have a watcher of their own (below).
    if w.launcher == "ray" and cfg.checkpoint.on_preemption:
        w.watchers.preemption = build_preemption_watcher(w.store, cfg.run_uri, w.rank, w.device,
                                                         state_bytes(m.params),
                                                         min_margin_s=cfg.checkpoint.preemption_margin_s)
    # A grow is Ray Train's (a bigger group started on new nodes); torchrun re-forms its own group.
    if w.launcher == "ray" and cfg.scaling.min_workers < cfg.scaling.max_workers and cfg.checkpoint.before_grow:
        w.watchers.grow = build_grow_requests(w.store, cfg.run_uri, w.rank)
    if w.launcher == "torchrun" and cfg.checkpoint.on_preemption:
        w.watchers.signal = build_signal_stop(w.device)
    rec.timer = StepTimer(d.steps_total, start_step=step, device=w.device)
    rec.tokens_per_step = t.global_batch_size * cfg.data.seq_len
    rec.flops_per_token = model_flops_per_token(m.module, cfg.data.seq_len, cfg.lora is not None, m.n_total,
                                                m.n_trainable)
    rec.device_peak = peak_flops(w.device)
    w.progress.loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
    w.progress.units = torch.zeros((), dtype=torch.float64, device=w.device)
    w.progress.metric_sums = torch.zeros(len(m.objective.metric_names), dtype=torch.float64, device=w.device)
    w.progress.nonfinite = torch.zeros((), dtype=torch.bool, device=w.device)


def train_step(w: Worker) -> tuple[list, float, torch.Tensor]:
    """One optimizer step over this rank's share of the global batch: (its micro-batches, the
    learning rate, the gradient norm). No host sync."""
    t, m, p, timer = w.cfg.training, w.model, w.progress, w.recorders.timer
    lr = lr_at(p.step, w.data.steps_total, t)
    for group in m.optimizer.param_groups:
        group["lr"] = lr
    # Dropout masks come from RowSeeds (seed, step, row). The global RNG is seeded only for
    # random ops outside them (none in the models we train): a resumed step redraws the same.
    torch.manual_seed(step_seed(t.seed, p.step, w.rank))

    with timer.phase("data"):  # GRPO: the rollout (sample, score, pack) with the current policy
        micro = next_micro_batches(w)
    w.recorders.heartbeat.mark_first_batch()
    with timer.phase("compute"):
        # The units (label tokens or pairs) come from the host arrays: one all-reduce, no sync.
        global_units = all_reduce_sum(torch.tensor(float(sum(m.objective.units(mb[2], mb[3]) for mb in micro)),
                                                   dtype=torch.float64, device=w.device))
        p.units += global_units
        # The exact sum adds the ranks' gradients; FSDP2, DDP and all_reduce_gradients average them.
        scale = (1.0 if m.exact_sum is not None else w.world) / global_units.clamp(min=1)
        for i, (row_ids, inputs, labels, positions, *ref) in enumerate(micro):
            with grad_sync_context(m.module, enabled=i == len(micro) - 1), m.row_seeds.rows(row_ids, p.step):
                loss, metrics = m.objective.forward(m.module, inputs, labels, positions, ref[0] if ref else None,
                                                    w.device, m.autocast_dtype)
                (loss * scale).backward()
            if m.exact_sum is not None:
                m.exact_sum.add_micro_batch()
            p.loss_sum += loss.detach().double()
            p.metric_sums += metrics
        if m.exact_sum is not None:
            m.exact_sum.reduce_into_grads(w.world)
        else:
            all_reduce_gradients(m.replicated, w.world)
    with timer.phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(m.params, t.grad_clip_norm or float("inf"))
        m.optimizer.step()
        m.optimizer.zero_grad(set_to_none=True)
    p.nonfinite |= ~torch.isfinite(p.loss_sum)
    p.step += 1
    p.rows_consumed += rows_per_step(w.cfg)
    return micro, lr, grad_norm


def next_micro_batches(w: Worker) -> list:
    """The step's micro-batches: the next of the row stream, or GRPO's rollouts of this step."""
    if w.data.rollouts is None:
        return next(w.data.batches)
    step = w.data.rollouts.build(w.model.module, w.progress.step)
    p = w.progress
    for key, value in {**step.sums, "steps": 1.0}.items():
        p.rollout_sums[key] = p.rollout_sums.get(key, 0.0) + value
    for key, value in step.maxima.items():
        p.rollout_maxima[key] = max(p.rollout_maxima.get(key, 0.0), value)
    return step.micro


def log_step(w: Worker, micro: list, lr: float, grad_norm: torch.Tensor) -> None:
    """On logging and eval steps (the loop's only host syncs): the loss, metrics, validation;
    every step: the heartbeat."""
    t, d, m, p, rec = w.cfg.training, w.data, w.model, w.progress, w.recorders
    step = p.step
    is_eval = bool(t.eval_every_steps) and (step % t.eval_every_steps == 0 or step == d.steps_total)
    if is_eval or step % t.log_every_steps == 0 or step == d.steps_total:
        sums = all_reduce_sum(torch.cat([p.loss_sum.reshape(1), p.metric_sums])).tolist()
        values = summarize(m.objective, sums[0], float(p.units), sums[1:])
        train_loss = values["loss"]
        if bool(p.nonfinite) or not math.isfinite(train_loss):
            raise FloatingPointError(f"non-finite loss {train_loss} at step {step}; stopping")
        tokens_per_step = rec.tokens_per_step
        if d.rollouts is not None:  # GRPO: the completion tokens trained per step since the last log
            tokens_per_step = int(p.rollout_sums.get("trained_tokens", 0.0) / (rec.timer.steps + 1))
        record = {"step": step, **values, "lr": lr, "grad_norm": to_scalar(grad_norm),
                  "world_size": w.world, "rows_consumed": p.rows_consumed, "epoch": p.rows_consumed / d.train_rows,
                  **rec.timer.end_step(step, tokens_per_step), **peak_memory(w.device)}
        if d.rollouts is not None:
            record.update(rollout_record(w, record))
        record["tokens_per_s_per_worker"] = record["tokens_per_s"] / w.world
        record["mfu"] = mfu(record["tokens_per_s"], rec.flops_per_token, rec.device_peak, w.world)
        if t.trace_rows:
            record["row_ids"] = gather_row_ids(micro, w.world, w.device)
        p.loss_sum.zero_()
        p.units.zero_()
        p.metric_sums.zero_()
        if is_eval:
            val = evaluate(m.module, m.objective, d.val, w.rank, w.world, t.micro_batch_size, w.device,
                           m.autocast_dtype)
            if val is not None:
                record.update(val)
                if t.objective == "sft":
                    record["val_ppl"] = math.exp(min(val["val_loss"], 50.0))
        rec.metrics.append(record)
        for sink in rec.sinks:
            sink.log(record)
        if w.rank == 0:
            log.info(format_progress(record, d.steps_total))
    else:
        rec.timer.skip_step()
    rec.heartbeat.beat(step)
    if rec.nccl_probe and w.rank == 0 and step == rec.timer.start_step + 1:
        rec.nccl_probe.report(w.store, w.cfg.run_uri, nodes=w.nodes)


def rollout_record(w: Worker, record: dict) -> dict:
    """GRPO's logged rollout metrics since the last log: rewards, accuracy, lengths, the rollout's
    and the update's seconds per step, generated tokens per second; then the sums start over."""
    from app.rl.colocated import summarize_rollouts

    p, rl = w.progress, w.cfg.rl
    out = summarize_rollouts(p.rollout_sums, p.rollout_maxima, rl.reward_names(), rl.group_size)
    out["rollout_s"] = record["data_wait_s"]
    out["update_s"] = record["compute_s"] + record["optimizer_s"]
    rollout_total_s = record["data_wait_s"] * p.rollout_sums.get("steps", 1.0)
    out["generated_tokens_per_s"] = p.rollout_sums.get("completion_tokens", 0.0) / max(rollout_total_s, 1e-9)
    p.rollout_sums, p.rollout_maxima = {}, {}
    return out


def maybe_checkpoint(w: Worker) -> None:
    """Every `save_every_steps`, at the last step, at the last safe step before a pre-emption
    deadline (then drain), before a grow (then wait for the restart), and under torchrun at the
    first step boundary after a stop signal (then leave the loop)."""
    cfg, p, rec, watch = w.cfg, w.progress, w.recorders, w.watchers
    step, last = p.step, w.data.steps_total
    periodic = step % cfg.checkpoint.save_every_steps == 0 or step == last
    just_in_time = None
    if watch.preemption is not None:
        if step == rec.timer.start_step + 1:  # the group's pipeline started cold
            watch.preemption.record_epoch_start(rec.timer.last_s.get("data", 0.0))
        # An opening's own length, too: the first one may have been hidden behind the model's
        # set-up (no step waited for it), yet the next one lands between steps and slows them
        # and any save beside it (a late save next to one took 6.5 s against 0.5 s and missed
        # its deadline on a 2-core box).
        watch.preemption.record_epoch_start(max(w.data.epoch_openings_s, default=0.0))
        # A step overlaps an epoch's pipeline start when its rows or those the prefetch thread may
        # be building meanwhile include the epoch's first row.
        gbs, n = cfg.training.global_batch_size, w.data.train_rows
        window = (PREFETCH_STEPS + 2) * gbs
        just_in_time = watch.preemption.after_step(step, save_due=periodic, epoch_opening=(
            opens_epoch(p.rows_consumed - gbs, window, n), opens_epoch(p.rows_consumed, window, n)))
    before_grow = watch.grow.after_step(step) if watch.grow is not None else None
    signalled = watch.signal.after_step() if watch.signal is not None else None
    if not (just_in_time or before_grow or periodic or signalled):
        return
    # A just-in-time or pre-grow save waits for its upload: the group drains only once it is up.
    # So does any save while a late one is pending (see PreemptionWatcher.save_pending).
    pending = watch.preemption is not None and watch.preemption.save_pending
    wait_for_upload = (just_in_time is not None or before_grow is not None or pending or signalled is not None
                       or not cfg.checkpoint.async_upload)
    if before_grow:
        # Written now: the save's report to Ray may block until the group is torn down (see
        # GrowRequests.acknowledge_when_up), and the heartbeat must already say this step was done.
        rec.heartbeat.beat(step, force=True)
        rec.heartbeat.flush()
        watch.grow.acknowledge_when_up(before_grow, step, cfg.checkpoint.before_grow_timeout_s)
    with rec.timer.phase("checkpoint"):
        began = time.monotonic()
        # Every rank: no rank's files go up once the run has another driver. Rank 0 checks again
        # after its upload, right before the sidecar's commit (ckpt.commit_checkpoint): with an
        # async upload, the run may change hands while it goes up.
        if w.fence is not None:
            w.fence.check(w.store)
        # Lines first: a checkpoint never exists without the metrics up to its step.
        rec.metrics.flush()
        validate = should_validate(cfg, step, periodic, last)
        ckpt.save(cfg, w.store, w.model.module, w.model.optimizer, step=step, rows_consumed=p.rows_consumed,
                  world_size=w.world, metrics=rec.metrics.latest(), rank=w.rank, lineage=w.data.lineage,
                  wait_for_upload=wait_for_upload, fence=w.fence, validate=validate and w.launcher == "ray",
                  direct=w.launcher == "torchrun")
    if validate and w.launcher == "torchrun" and w.rank == 0:
        # No Ray, so no validation task: rank 0 scores the committed checkpoint itself, between
        # steps, while the other ranks wait at the next step's first collective.
        # The score joins the run's metrics from <run>/eval/, as under Ray (app/report.py); the
        # steps are blocked meanwhile, so its time counts as the checkpoint's.
        with rec.timer.phase("checkpoint"):
            validate_in_process(cfg, join(cfg.run_uri, ckpt.checkpoint_dir_name(step)), w.mlflow,
                                wandb=w.wandb)
    if watch.preemption is not None:
        watch.preemption.record_save(time.monotonic() - began, uploaded=wait_for_upload)
    rec.heartbeat.beat(step, force=True)
    if signalled and step < last:
        if w.rank == 0:
            log.info("%s: checkpoint at step %d is up; stopping (resume with the same command)", signalled.name, step)
            records.record_event(w.store, cfg.run_uri, "signal_checkpoint", step=step, signal=signalled.name,
                                 seconds=round(time.monotonic() - began, 3))
        p.stopped_on = signalled.name
    if just_in_time and just_in_time.drain and step < last:
        rec.heartbeat.flush()
        watch.preemption.drain(step)  # raises once the node is gone: Ray restarts from this checkpoint
    if before_grow and step < last:
        rec.heartbeat.flush()
        watch.grow.drain(cfg.checkpoint.before_grow_timeout_s)  # Ray restarts the group bigger


def report(w: Worker) -> None:
    """The final step always saved (above), which reported its metrics and checkpoint to Ray."""
    rec = w.recorders
    if w.watchers.grow is not None:
        w.watchers.grow.stop()
    if w.watchers.signal is not None:
        w.watchers.signal.restore()
    rec.metrics.flush()
    rec.heartbeat.flush()
    for sink in rec.sinks:
        sink.finish()
    if w.rank == 0:
        log.info("done: %d steps, %d rows consumed", w.progress.step, w.progress.rows_consumed)


def gather_row_ids(micro, world: int, device) -> list[int]:
    """The global batch's row_ids in slot order (rank 0 first, padding dropped); tracing only."""
    mine = torch.as_tensor(np.concatenate([m[0] for m in micro]), dtype=torch.long, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [r for r in torch.cat(out).cpu().tolist() if r >= 0]
