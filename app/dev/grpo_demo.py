"""`eft demo --config jobs/configs/tiny-grpo.yaml`: RL visibly works on the parity task.

The chat demo's base after a short SFT (`WARMUP_STEPS` steps of the tiny-chat job, merged and
copied to the GRPO job's `model.uri`) answers some held-out "Is N even or odd?" prompts right;
GRPO with the `exact_match` reward on the task's training prompts then raises the held-out score.
Both scores come from `eft eval` on the same 100 numbers neither stage trained on:
`score: SFT … → GRPO …`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from app.config import load_config
from app.storage import Store, join

log = logging.getLogger("eft.demo")
WARMUP_STEPS = 35  # greedy: 75% of the held-out numbers (25 steps: 51%, chance; 45: 84%)


def warm_up_policy(cfg, store: Store, chat_config: Path, ensure_inputs: Callable) -> None:
    """The SFT'd policy at `cfg.model.uri`, trained and copied there unless it is there already;
    `ensure_inputs(sft_cfg)` seeds the chat job's base and conversations (app/dev/demo.py)."""
    import tempfile

    from app.data.manifest import read_committed_manifest
    from app.data.prepare import prepare_dataset
    from app.export import export_run
    from app.train.launch import run_training

    if store.exists(join(cfg.model.uri, "config.json")):
        return
    sft = load_config(chat_config, [f"name={cfg.name}-sft", f"training.max_steps={WARMUP_STEPS}",
                                    "training.eval_every_steps=null", "eval.every_checkpoints=0"])
    ensure_inputs(sft)
    if read_committed_manifest(store, sft.data.uri) is None:
        prepare_dataset(sft, store)
    log.info("warm-up: %d SFT steps of %s before GRPO", WARMUP_STEPS, sft.name)
    run_training(sft, store)
    merged = export_run(sft, merge=True, store=store)["merged_uri"]
    with tempfile.TemporaryDirectory() as tmp:
        store.download_dir(merged, tmp)
        store.upload_dir(tmp, cfg.model.uri, last=("config.json",))
    log.info("warm-up: the SFT'd policy is at %s", cfg.model.uri)


def write_task_prompts(cfg, store: Store) -> None:
    """The parity task's training numbers as prompt records, and its held-out ones as the eval set."""
    from app.dev.tasks import TASK_EVAL, TASK_TRAIN, build_task_records

    train, held_out = build_task_records(TASK_TRAIN, TASK_EVAL)
    if not store.exists(cfg.prepare.input_uri):
        prompts = [{"prompt": c["messages"][0]["content"], "answer": c["messages"][1]["content"]} for c in train]
        store.write_text(cfg.prepare.input_uri, "".join(json.dumps(p) + "\n" for p in prompts))
    if cfg.eval is not None and not store.exists(cfg.eval.uri):
        store.write_text(cfg.eval.uri, "".join(json.dumps(r) + "\n" for r in held_out))


def run_grpo_demo(cfg, store: Store, chat_config: Path, ensure_inputs: Callable) -> int:
    from app.data.manifest import read_committed_manifest
    from app.dev.tasks import format_score
    from app.eval.run import run_eval
    from app.export import export_run
    from app.observe.metrics import load_metrics
    from app.report import render_summary
    from app.rl.prompts import prepare_prompts
    from app.train.launch import run_training

    warm_up_policy(cfg, store, chat_config, ensure_inputs)
    write_task_prompts(cfg, store)
    if read_committed_manifest(store, cfg.data.uri) is None:
        prepare_prompts(cfg, store)
    before = run_eval(cfg, store, checkpoint="base")["results"]["default"]
    summary = run_training(cfg, store)
    exported = export_run(cfg, merge=True, store=store)
    after = run_eval(cfg, store, checkpoint=exported["export_uri"])["results"]["default"]
    render_summary(summary)
    rows = [m for m in load_metrics(store, cfg.run_uri) if "reward_mean" in m]
    first, last = rows[: min(5, len(rows))], rows[-min(5, len(rows)):]
    print(f"exported: {exported['adapter_uri']} (adapter), {exported['merged_uri']} (merged)")
    print(f"reward:   {sum(r['reward_mean'] for r in first) / len(first):.2f} (first {len(first)} steps) → "
          f"{sum(r['reward_mean'] for r in last) / len(last):.2f} (last {len(last)}) over {len(rows)} steps, "
          f"rollout {sum(r['rollout_s'] for r in rows) / len(rows):.2f} s and update "
          f"{sum(r['update_s'] for r in rows) / len(rows):.2f} s a step")
    print(f"score:    SFT {format_score(before)} → GRPO {format_score(after)} ({after['n']} held-out prompts, "
          f"{after['metric']})")
    return 0 if after["score"] > before["score"] else 1
