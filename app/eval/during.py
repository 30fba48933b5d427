"""Evaluation on checkpoints while training goes on, through Ray Train V2's validation hook.

The workers report every `eval.every_checkpoints`-th periodic checkpoint (and the last) with
`validation=True`; Ray Train's controller then runs `validate_checkpoint` on it in a Ray task of
its own (`eval.cpus_per_actor` CPUs, a GPU when the workers have them), one at a time, while the
workers keep stepping. The task scores the checkpoint on every set of `eval.every_checkpoints_sets`
(all by default) in its own process (the same batches, so the same predictions, as `eft eval`),
writes `<run>/eval/step-N/<set>/`, and sends `eval_<set>_<metric>` (with its interval's `_low` and
`_high`) at the checkpoint's step to TensorBoard, MLflow and W&B. The harness is not run here: its
benchmarks are for `eft eval`. Any failure is a warning and an empty result: training
never waits on, or fails for, an evaluation. Under torchrun there is no Ray: rank 0 scores the
checkpoint the same way in its own process, between steps (`validate_in_process`).
"""

from __future__ import annotations

import logging
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

log = logging.getLogger("eft.eval")


def should_validate(cfg, step: int, periodic: bool, last_step: int) -> bool:
    """Every `every_checkpoints`-th periodic save, and the last step's."""
    every = cfg.eval.every_checkpoints if cfg.eval is not None else 0
    if not every or not periodic:
        return False
    return step == last_step or (step // cfg.checkpoint.save_every_steps) % every == 0


def build_validation_config(cfg, mlflow: Optional[dict], fn=None, wandb: Optional[dict] = None):
    """The trainer's ValidationConfig, or None when evaluation on checkpoints is off. `fn` stands in
    for validate_checkpoint (same arguments)."""
    if cfg.eval is None or not cfg.eval.every_checkpoints:
        return None
    from ray.train.v2.api.validation_config import ValidationConfig, ValidationTaskConfig

    resources = {"num_cpus": cfg.eval.cpus_per_actor, "max_retries": 0}
    if cfg.scaling.use_gpu:
        resources["num_gpus"] = 1
    return ValidationConfig(
        fn=fn or validate_checkpoint,
        task_config=ValidationTaskConfig(fn_kwargs={"cfg": cfg.model_dump(mode="json"), "mlflow": mlflow,
                                                    "wandb": wandb},
                                         timeout_s=cfg.eval.timeout_s),
        ray_remote_kwargs=resources)


def validate_checkpoint(checkpoint, cfg: dict, mlflow: Optional[dict] = None, wandb: Optional[dict] = None) -> dict:
    """Ray Train's validation function: each set's score as `eval_<set>_<metric>`, or {} on failure."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [eft] %(message)s")
    try:
        from app.config import JobConfig
        from app.eval.run import run_eval
        from app.storage import Store, join

        job = JobConfig.model_validate(cfg)
        store = Store.from_config(job.storage)
        name = str(checkpoint.path).rstrip("/").rsplit("/", 1)[-1]
        summary = run_eval(job, store, checkpoint=join(job.run_uri, name), in_process=True,
                           sets=job.eval.checkpoint_sets(), harness=False)
        record = {"step": summary["step"], **score_record(summary["results"])}
        tables = {f"eval/{set_name}/{summary['label']}": [flat_prediction(p) for p in results["examples"]]
                  for set_name, results in summary["results"].items()}
        publish_scalars(store, job.run_uri, record, mlflow, wandb, tables)
        return record
    except Exception as err:  # noqa: BLE001: an evaluation never fails the run
        log.warning("eval of %s failed, training goes on: %s: %s", getattr(checkpoint, "path", checkpoint),
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return {}


def score_record(results: dict[str, dict]) -> dict[str, float]:
    """`eval_<set>_<metric>` and its interval's `_low` / `_high`, for every scored set."""
    record = {}
    for set_name, r in results.items():
        key = f"eval_{set_name}_{r['metric']}"
        record.update({key: r["score"], f"{key}_low": r["interval"][0], f"{key}_high": r["interval"][1]})
    return record


def flat_prediction(row: dict) -> dict:
    """A prediction as one table row: the prompt as read, the answer, the prediction, right or not."""
    prompt = row.get("prompt") if row.get("prompt") is not None else (row.get("messages") or [{}])[-1].get("content")
    return {"index": row["index"], "prompt": prompt, "answer": str(row.get("answer")),
            "prediction": str(row.get("prediction")), "correct": bool(row.get("correct"))}


def validate_in_process(cfg, checkpoint_uri: str, mlflow: Optional[dict] = None, wandb: Optional[dict] = None) -> dict:
    """Under torchrun, where there is no Ray and so no validation task: the same scoring of a
    committed checkpoint, in the calling process (rank 0, between steps). Same outputs, same
    failure rule (a warning and {}); `eval.timeout_s` does not apply, since nothing runs beside it."""
    return validate_checkpoint(SimpleNamespace(path=checkpoint_uri), cfg.model_dump(mode="json"), mlflow, wandb)


def publish_scalars(store, run_uri: str, record: dict, mlflow: Optional[dict], wandb: Optional[dict] = None,
                    tables: Optional[dict[str, list[dict]]] = None) -> None:
    """The scores into the run's TensorBoard directory (an event file of its own, which TensorBoard
    reads beside the workers'), its MLflow run and its W&B run (with `tables`, a few predictions of
    each set); any of them failing is a warning."""
    from app.storage import join

    try:
        from torch.utils.tensorboard import SummaryWriter

        with tempfile.TemporaryDirectory(prefix="eft-eval-tb-") as tmp:
            writer = SummaryWriter(tmp)
            for key, value in record.items():
                if key != "step":
                    writer.add_scalar(key, value, record["step"])
            writer.close()
            for path in Path(tmp).iterdir():
                name = f"events.out.tfevents.{time.time_ns() // 10**6:013d}.eval-{record['step']:08d}.{socket.gethostname()}"
                store.write_bytes(join(run_uri, "tensorboard", name), path.read_bytes())
    except Exception as err:  # noqa: BLE001
        log.warning("eval: TensorBoard event file not written (%s)", err)
    if mlflow:
        try:
            from app.observe.sinks import log_to_mlflow

            log_to_mlflow(mlflow, run_uri, record)
        except Exception as err:  # noqa: BLE001
            log.warning("eval: MLflow not updated (%s)", err)
    if wandb:
        try:
            from app.observe.sinks import log_to_wandb

            log_to_wandb(wandb, run_uri, record, tables)
        except Exception as err:  # noqa: BLE001
            log.warning("eval: W&B not updated (%s)", err)
