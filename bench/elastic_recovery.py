"""What a spot reclaim and a hard kill cost a run: the same short LoRA run on a 3-node local
Ray cluster (elastic 2..3 workers), once uninterrupted and once with one pre-emption (notice
with a 30 s deadline, node gone just before the deadline, capacity back later) and one node
killed outright. Prints the goodput (uninterrupted wall time / interrupted), steps lost and
recomputed per event, where the just-in-time checkpoint was taken, and the seconds from each
node loss to the first step after it; saves them to bench/results/elastic_recovery.*.

    .venv/bin/python bench/elastic_recovery.py [--steps 200] [--notice-s 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.dev import chaos, local  # noqa: E402

chaos.configure_fast_failure_detection()

from bench.common import markdown_table, save_result  # noqa: E402


def build_job(name: str, steps: int, base: str, data: str):
    from app.config import build_config

    return build_config({
        "name": name, "model": {"uri": base},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]},
        "data": {"uri": data, "seq_len": 64},
        "prepare": {"input_uri": "s3://eft/raw/bench.jsonl"},
        "training": {"max_steps": steps, "global_batch_size": 12, "micro_batch_size": 2, "lr": 3e-3,
                     "schedule": "constant"},
        "checkpoint": {"save_every_steps": 20},
        "scaling": chaos.elastic_scaling(min_workers=2, max_workers=3),
        "fault_tolerance": {"max_failures": 3},
        "storage": {"root_uri": "s3://eft/bench-runs"},
    })


def prepare_inputs(cfg) -> None:
    from app.data.prepare import prepare_dataset
    from app.storage import Store
    from app.dev.tiny import build_corpus, save_tiny_base, write_jsonl

    store = Store()
    texts = build_corpus(max_docs=300)
    save_tiny_base(store, cfg.model.uri, texts=texts)
    with tempfile.TemporaryDirectory() as tmp:
        raw = write_jsonl(({"text": t} for t in texts), Path(tmp) / "corpus.jsonl")
        store.write_bytes(cfg.prepare.input_uri, raw.read_bytes())
    prepare_dataset(cfg, store)


def run_interrupted(cluster: chaos.LocalCluster, cfg, notice_s: float) -> dict:
    from app.storage import Store
    from app.train.launch import run_training

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run_training(cfg, Store())), daemon=True)
    thread.start()
    run = chaos.RunWatcher(Store(), cfg.run_uri, alive=thread.is_alive)
    steps = cfg.training.max_steps
    run.wait_step(steps // 8)
    cluster.preempt(cluster.nodes[-1], deadline_s=notice_s)
    # The node goes at its deadline, as a reclaimed spot node does (a second before it, so
    # that the node's loss, not Ray Train's own deadline, ends the group).
    time.sleep(notice_s - 1.0)
    removed_at = time.time()
    cluster.remove(cluster.nodes[-1], graceful=True)
    run.wait_step(1, world_size=2, after=removed_at)
    cluster.add_node()
    grown = run.wait_step(1, world_size=3, after=time.time())
    run.wait_step(grown + 15, world_size=3)
    killed_at = time.time()
    cluster.remove(cluster.nodes[0], graceful=False)
    thread.join()
    summary = result["summary"]
    summary["recovery_from_loss_s"] = {"preemption": run.recovery_after(removed_at),
                                       "hard_kill": run.recovery_after(killed_at)}
    return summary


def run_both(steps: int, name: str, interrupt) -> tuple[dict, dict]:
    """On one 3-node local cluster and local S3: the run uninterrupted, then as `name` while
    `interrupt(cluster, cfg)` drives it. Returns both summaries."""
    import ray

    from app.train.launch import run_training

    with local.serve_s3():
        cluster = chaos.start_cluster(worker_nodes=3)
        try:
            base = build_job("base", steps, "s3://eft/models/bench-tiny", "s3://eft/data/bench")
            prepare_inputs(base)
            plain = run_training(base.model_copy(update={"name": "uninterrupted"}))
            hit = interrupt(cluster, base.model_copy(update={"name": name}))
        finally:
            ray.shutdown()
            cluster.shutdown()
    return plain, hit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--notice-s", type=float, default=30.0)
    args = parser.parse_args()

    from app.report import format_restart_phases

    plain, hit = run_both(args.steps, "interrupted",
                          lambda cluster, cfg: run_interrupted(cluster, cfg, args.notice_s))

    rows = [[i["cause"], f"{i['world_size_before']}→{i['world_size_after']}", i["step_at_notice"],
             i.get("jit_checkpoint_step"), i["last_step_before"], i["resumed_from_step"], i["steps_lost"],
             i["steps_recomputed"], i["recovery_s"], format_restart_phases(i.get("phases"))]
            for i in hit["interruptions"]]
    ratio = hit["wall_s"] / plain["wall_s"]
    late = hit.get("preemption_checkpoints") or [{}]
    table = "\n\n".join([
        markdown_table(["run", "steps", "wall s", "final loss", "world sizes"], [
            ["uninterrupted", plain["steps"], plain["wall_s"], round(plain["final_train_loss"], 4), plain["world_sizes"]],
            ["pre-emption + hard kill", hit["steps"], hit["wall_s"], round(hit["final_train_loss"], 4),
             hit["world_sizes"]]]),
        f"Goodput (uninterrupted / interrupted wall time): **{1 / ratio:.2f}** (overhead ratio {ratio:.2f}); "
        f"pre-emption: notice at step {hit['preemption_notices'][0]['step']} "
        f"({hit['preemption_notices'][0].get('plan')} save), just-in-time checkpoint at step {late[0].get('step')} "
        f"{late[0].get('seconds_left')} s before the deadline, steps recomputed "
        f"**{hit['interruptions'][0]['steps_recomputed']}**; "
        f"node loss → first step after restart: pre-emption **{hit['recovery_from_loss_s']['preemption']} s**, "
        f"hard kill **{hit['recovery_from_loss_s']['hard_kill']} s** "
        f"(the hard kill includes ~3 s of missed health checks before Ray declares the node dead).",
        markdown_table(["interruption", "world", "notice at step", "JIT checkpoint", "last step before",
                        "resumed from", "steps lost", "steps recomputed", "last step → first step (s)",
                        "restart phases (s)"], rows),
    ])
    save_result("elastic_recovery", {"uninterrupted": plain, "interrupted": hit, "overhead_ratio": ratio,
                                     "goodput": 1 / ratio, "notice_s": args.notice_s,
                                     "steps_recomputed": [i["steps_recomputed"] for i in hit["interruptions"]]},
                table)


if __name__ == "__main__":
    main()
