"""Driver side of `eft train`: preflight, the run lease, then a Ray Train V2 `TorchTrainer` built
from the config.

Re-running with the same run name resumes: Ray Train restores its checkpoint manager from
`<storage>/<name>/` and hands the workers the latest committed checkpoint. One driver at a time:
the run lease (`<run>/_lease.json`, app.lease) is taken before Ray starts and anything is
written, and the workers and controller carry its epoch (the fence) to every commit.
"""

from __future__ import annotations

import logging
import os
import time

from app.cluster import init_ray
from app.config import JobConfig, dump_config
from app.data.lease import check_not_being_prepared, hold_reader_lease
from app.lease import Fence, LeaseError, build_run_lease
from app.data.manifest import load_manifest
from app.data.reference import check_reference
from app.data.stream import document_isolation
from app.elastic import checkpoint as ckpt
from app.elastic.controller import NodeWatcher, build_controller_callbacks
from app.elastic.resume import check_resume
from app.eval.during import build_validation_config
from app.eval.sets import load_eval_set
from app.hub import resolve_model
from app.model.architecture import ModelError, check_lora_targets, check_seq_len, load_model_config
from app.model.loss import check_loss_setup
from app.observe import records
from app.observe.sinks import mlflow_settings, wandb_settings
from app.observe.summary import build_summary, write_summary
from app.plan import apply_parallelism
from app.storage import Store, join

log = logging.getLogger("eft.launch")


def preflight(cfg: JobConfig, store: Store) -> dict:
    """Everything that can be checked before Ray starts, each failure one line."""
    for uri in {cfg.storage.root_uri, cfg.data.uri, cfg.model.uri}:
        store.check_reachable(uri)
    if not store.exists(join(cfg.model.uri, "config.json")):
        raise ModelError(f"{cfg.model.uri}: not a Hugging Face model dir (no config.json)")
    check_not_being_prepared(store, cfg.data.uri)
    manifest = load_manifest(store, cfg.data.uri)
    if manifest["seq_len"] != cfg.data.seq_len:
        raise ValueError(f"data.seq_len {cfg.data.seq_len} != seq_len {manifest['seq_len']} of the dataset "
                         f"at {cfg.data.uri}")
    document_isolation(cfg, manifest)  # the note on an old dataset, here as well as on rank 0
    check_objective_fits(cfg, manifest)
    check_reference(cfg, store, manifest)
    train_rows = manifest["splits"]["train"]["rows"]
    if cfg.training.objective == "grpo":
        check_rl_setup(cfg, manifest)
    elif train_rows < cfg.training.global_batch_size:
        raise ValueError(f"training.global_batch_size {cfg.training.global_batch_size} exceeds the "
                         f"{train_rows} train rows of {cfg.data.uri}")
    if cfg.training.eval_every_steps and not manifest["splits"].get("validation", {}).get("rows"):
        raise ValueError(f"training.eval_every_steps {cfg.training.eval_every_steps}: the dataset at {cfg.data.uri} "
                         f"has no validation rows (prepare it with data.validation_fraction > 0, or unset "
                         f"training.eval_every_steps)")
    model_config = load_model_config(store, cfg.model.uri)
    check_seq_len(cfg.data.seq_len, model_config, cfg.model.uri)
    if cfg.lora is not None:
        check_lora_targets(cfg.lora, model_config, cfg.model.uri)
    check_loss_setup(cfg, model_config)
    if cfg.eval is not None and cfg.eval.every_checkpoints:
        sets = cfg.eval.named_sets()
        for name in cfg.eval.checkpoint_sets():  # a bad eval set is one line now, not a warning per checkpoint
            load_eval_set(store, sets[name])
    return manifest


def worker_error(err: Exception) -> Exception:
    """A worker's own one-line error (a reward past `rl.max_reward_errors`, a non-finite loss) in
    place of Ray Train's several-line summary of every rank's traceback, so `eft train` ends on it."""
    from app.rl.rewards import RewardError

    failures = getattr(err, "worker_failures", None) or {}
    for rank in sorted(failures):
        cause = failures[rank]
        cause = getattr(cause, "cause", None) or cause  # a RayTaskError carries the worker's exception
        if isinstance(cause, (RewardError, FloatingPointError)):
            return cause
    return err


def check_rl_setup(cfg: JobConfig, manifest: dict) -> None:
    """GRPO's prompts leave room for `rl.max_new_tokens` in a row, and every reward builds (a
    `module:function` that does not import here would not on the workers either)."""
    from app.rl.rewards import build_reward_fn

    longest = manifest["splits"]["train"].get("max_prompt_tokens", 0)
    if longest + cfg.rl.max_new_tokens > cfg.data.seq_len:
        raise ValueError(f"rl.max_new_tokens {cfg.rl.max_new_tokens}: the longest prompt of {cfg.data.uri} has "
                         f"{longest} tokens, and prompt + completion must fit data.seq_len {cfg.data.seq_len}")
    build_reward_fn(cfg.rl.weighted_rewards(), cfg.rl.normalize, cfg.rl.answer_regex)


def check_objective_fits(cfg: JobConfig, manifest: dict) -> None:
    """A preference objective trains on a dataset of pairs, GRPO on prompts, and SFT on neither."""
    fmt = manifest["source"].get("format")
    objective = cfg.training.objective
    if (objective == "grpo") != (fmt == "prompts"):
        raise ValueError(f"training.objective {objective}: the dataset at {cfg.data.uri} was prepared as {fmt!r}"
                         + (" (GRPO trains on prompt sets: prepare.format: prompts)" if objective == "grpo" else
                            " (a GRPO prompt set: set training.objective: grpo)"))
    if objective == "grpo":
        return
    if objective != "sft" and fmt != "preference":
        raise ValueError(f"training.objective {objective}: the dataset at {cfg.data.uri} was prepared as {fmt!r}, "
                         f"not preference pairs (prepare it with prepare.format: preference)")
    if objective == "sft" and fmt == "preference":
        raise ValueError(f"training.objective sft: the dataset at {cfg.data.uri} holds preference pairs (set "
                         f"training.objective to dpo, simpo or orpo)")


def build_trainer(cfg: JobConfig, store: Store, train_fn=None, fence: Fence | None = None, validation_fn=None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from app.compat import build_torch_trainer_class
    from app.train.loop import train_loop_per_worker

    s = cfg.scaling
    if s.worker_group_start_timeout_s is not None:
        # Ray Train's own knob, read by its controller (which inherits the driver's environment).
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(s.worker_group_start_timeout_s)
    resources = {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if s.use_gpu else {}),
                 **s.resources_per_worker}
    num_workers = s.min_workers if s.min_workers == s.max_workers else (s.min_workers, s.max_workers)
    fs, root = store.resolve(cfg.storage.root_uri)
    callbacks = build_controller_callbacks(elastic=s.min_workers < s.max_workers, fenced=fence is not None)
    return build_torch_trainer_class()(
        train_fn or train_loop_per_worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), "mlflow": mlflow_settings(), "wandb": wandb_settings(),
                           "fence": fence.to_dict() if fence is not None else None},
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=s.use_gpu, resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=s.elastic_resize_monitor_interval_s),
        run_config=RunConfig(
            name=cfg.name, storage_path=root, storage_filesystem=fs,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            failure_config=FailureConfig(max_failures=cfg.fault_tolerance.max_failures,
                                         max_preemption_failures=cfg.fault_tolerance.max_preemption_failures),
            callbacks=callbacks or None,
        ),
        validation_config=build_validation_config(cfg, mlflow_settings(), validation_fn, wandb=wandb_settings()),
    )


def build_local_trainer(cfg: JobConfig, train_fn=None, fence: Fence | None = None, driver: bool = True):
    """Ray Train's local mode (`num_workers=0`): the same loop, in this process, as one rank of the
    torchrun group whose environment this process has (app/train/torchrun.py). No Ray cluster:
    the ranks read the shards directly and commit their checkpoints themselves. `driver` False
    (ranks other than 0): the loop adopts rank 0's resolved config and fence when the group forms
    (app.train.loop.adopt_rank_zero_config), so it is handed none of its own."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.train.loop import train_loop_per_worker

    loop_config = {"launcher": "torchrun", "cfg": cfg.model_dump(mode="json") if driver else None,
                   "mlflow": mlflow_settings() if driver else None, "wandb": wandb_settings() if driver else None,
                   "fence": fence.to_dict() if fence is not None else None}
    return TorchTrainer(train_fn or train_loop_per_worker, train_loop_config=loop_config,
                        scaling_config=ScalingConfig(num_workers=0), run_config=RunConfig(name=cfg.name))


def check_launcher(cfg: JobConfig, launcher: str) -> None:
    """What only Ray's launch path does, refused in one line for the others before anything runs."""
    if launcher == "ray":
        return
    if cfg.training.objective == "grpo" and cfg.rl.rollout == "actors":
        raise ValueError(f"rl.rollout actors: the rollout pool runs on Ray, which {launcher} does not start; "
                         f"use rl.rollout: colocated")


def run_training(cfg: JobConfig, store: Store | None = None, train_fn=None, wait_s: float | None = None,
                 validation_fn=None, launcher: str = "ray") -> dict:
    """Preflight → the run lease → trainer.fit() → summary.json. Returns the summary. `train_fn`
    wraps the worker loop (tests inject faults with it), `validation_fn` stands in for the
    evaluation of checkpoints (a benchmark plants a slow one). `wait_s`: wait up to this long for a
    run lease another driver holds, instead of refusing at once. `launcher` "torchrun": this
    process is rank 0 of a torchrun group (app/train/torchrun.py) and joins no Ray cluster."""
    store = store or Store.from_config(cfg.storage)
    check_launcher(cfg, launcher)
    # A hub id becomes its pinned mirror here, on the driver, before Ray: no worker asks the hub.
    cfg, hub = resolve_model(cfg, store)
    preflight(cfg, store)
    cfg, why = apply_parallelism(cfg, store)
    log.info("training.parallelism %s: %s", cfg.training.parallelism, why)
    check_resume(cfg, store)
    # One writer per run, before Ray starts and before anything is written under the run.
    lease = build_run_lease(store, cfg.run_uri, ttl_s=cfg.fault_tolerance.run_lease_ttl_s,
                            seal=lambda: ckpt.list_committed(store, cfg.run_uri)).start(wait_s=wait_s)
    try:
        try:
            if launcher == "ray":
                init_ray(log_to_driver=True)
        except BaseException:
            lease.stop(discard=True)  # refused by the cluster: a run that never started leaves nothing
            raise
        if hub is not None:
            records.record_event(store, cfg.run_uri, "model_resolved", repo=hub["repo"], revision=hub["revision"],
                                 sha=hub["sha"], mirror_uri=hub["mirror_uri"])
        return train_holding(cfg, store, lease, train_fn, validation_fn, launcher)
    finally:
        lease.stop()


def stopped_on_signal(store: Store, run_uri: str, since: float) -> bool:
    return any(e["kind"] == "signal_checkpoint" and e["time"] >= since for e in records.load_events(store, run_uri))


def train_holding(cfg: JobConfig, store: Store, lease, train_fn=None, validation_fn=None,
                  launcher: str = "ray") -> dict:
    started = time.time()
    resumed = ckpt.find_latest_checkpoint(store, cfg.run_uri) is not None
    # The resolved config is stored with every run; it holds no credentials by construction.
    store.write_text(join(cfg.run_uri, "config.yaml"), dump_config(cfg))
    records.record_event(store, cfg.run_uri, "driver_start", resumed=resumed, lease_epoch=lease.epoch,
                         launcher=launcher)
    status, error = "succeeded", None
    # While the driver lives, a prepare may not replace the dataset the workers stream.
    reader = hold_reader_lease(store, cfg.data.uri, cfg.run_uri)
    elastic = launcher == "ray" and cfg.scaling.min_workers < cfg.scaling.max_workers
    watcher = NodeWatcher().start() if elastic else None
    try:
        if launcher == "ray":
            trainer = build_trainer(cfg, store, train_fn, fence=lease.fence(), validation_fn=validation_fn)
        else:
            trainer = build_local_trainer(cfg, train_fn, fence=lease.fence())
        trainer.fit()
    except Exception as err:  # the summary records the failure; the CLI re-raises it
        status, error = "failed", worker_error(err)
    finally:
        if watcher:
            watcher.stop()
        reader.stop()
    if status == "succeeded" and stopped_on_signal(store, cfg.run_uri, since=started):
        status = "stopped"  # torchrun: a stop signal, its checkpoint up; the same command resumes
    summary = build_summary(store, cfg, status=status, wall_s=time.time() - started,
                            checkpoints=ckpt.list_checkpoints(store, cfg.run_uri),
                            error=None if error is None else f"{type(error).__name__}: {error}")
    summary["lease_epoch"] = lease.epoch
    try:
        lease.check()  # a conditional renewal: the summary is committed only by the lease's holder
    except LeaseError as lost:
        raise LeaseError(f"{lost}; this driver wrote no summary") from error
    write_summary(store, cfg.run_uri, summary)
    if error is not None:
        raise error
    return summary
