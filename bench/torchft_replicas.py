"""Survivors keep training: a prototype of `fault_tolerance.mode: replicas` (torchft replica
groups under Ray Train V2's `TorchftConfig`) against eft's restart mode, on one schedule.

Both modes train the same tiny Llama + LoRA on the same prepared dataset, G rows per step in
the order `DataOrder` fixes (the rows eft's loop consumes at step s), with 3 workers on a local
Ray cluster. Each is run uninterrupted and with one worker process SIGKILLed at a fixed step.

Replicas mode: each Ray Train worker is one replica group (Ray 2.60 fixes the group size at 1),
gloo on CPU, torchft's `Manager` (synchronous quorum) + its optimizer wrapper and one flat
all-reduce across groups, healing from a peer over its process group. Step s's G rows are split over the groups
*in the quorum of that step* (slots r*G//P .. (r+1)*G//P), and the loss is normalized by the
label tokens of all G rows, so a step that commits with fewer groups still consumes all G rows
once, and a step that does not commit is retried with the same rows. Each group logs, per step,
the rows it used and whether the step committed; the result checks every row was consumed
exactly once and compares the per-step losses with the uninterrupted run.

Restart mode: eft's own `run_training` (checkpoint every `--save-every` steps, Ray Train
restarts the whole group from the latest checkpoint).

    .venv/bin/python bench/torchft_replicas.py [--steps 120] [--kill-at 40] [--save-every 20]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.dev import chaos, local  # noqa: E402
from bench._setup import BENCH_MODEL  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

GROUPS = 3
GLOBAL_BATCH = 12
SEED = 0
# torchft's lighthouse drops a replica group from the quorum once its heartbeats stop for this
# long: the survivors' stall at a hard kill. Its default (5 s) is tuned for big clusters.
HEARTBEAT_TIMEOUT_MS = 2000
# A quorum normally forms in milliseconds (every group asks once per step); a group that waits
# this long is alone: the run ended, or its peers are gone.
QUORUM_TIMEOUT_S = 15


# -- the replica group's worker -------------------------------------------------------------


def train_replica(config: dict) -> None:
    """A Ray Train worker: one replica group (Ray 2.60 makes each worker its own group)."""
    import ray.train

    run_group(ray.train.get_context().get_world_rank(), config)


def count_starts(log_dir: Path) -> int:
    return sum(1 for p in log_dir.glob("group*.jsonl") if '"kind": "start"' in p.read_text())


def run_group(group: int, config: dict, store_addr: str | None = None, store_port: int | None = None,
              lighthouse_addr: str | None = None) -> None:
    """One replica group: quorum, heal, forward/backward on its share of the step's rows, commit.
    Logs one JSON line per attempted step to its own file. Under Ray Train, the group's store and
    the lighthouse come from the environment TorchftConfig sets; elsewhere, from the arguments.

    Two hooks for tests: `die_at` (group `die_group` SIGKILLs itself mid-step, once: after its
    backward, before the all-reduce) and `hold_at` (the others wait before that step until a
    replacement has started, so that it rejoins before the run ends)."""
    from datetime import timedelta

    import numpy as np
    import torch
    from peft import get_peft_model
    from torch.distributed import ReduceOp
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from transformers import AutoModelForCausalLM

    from app.config import LoraConfig
    from app.model.architecture import build_peft_config
    from app.model.loss import loss_sum

    started = time.time()
    torch.set_num_threads(1)
    groups = config.get("groups", GROUPS)
    data = np.load(config["data"])
    input_ids, labels, step_rows = data["input_ids"], data["labels"], data["step_rows"]
    # Global label tokens of each step (every group holds the table; a streaming version would
    # all-reduce its slice's count through the manager instead).
    step_tokens = (labels[step_rows][:, :, 1:] != -100).sum(axis=(1, 2))

    torch.manual_seed(SEED)  # the same LoRA init in every group; torchft syncs step 0 anyway
    model = AutoModelForCausalLM.from_pretrained(config["base_dir"], torch_dtype=torch.float32)
    model = get_peft_model(model, build_peft_config(LoraConfig(**config["lora"])))
    params = [p for p in model.parameters() if p.requires_grad]
    inner = torch.optim.AdamW(params, lr=config["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def state_dict() -> dict:
        return {"lora": {n: p.detach() for n, p in zip(names, params)}, "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        with torch.no_grad():
            for n, p in zip(names, params):
                p.copy_(state["lora"][n])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=30)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, min_replica_size=config["min_replicas"], load_state_dict=load_state_dict,
                      state_dict=state_dict, world_size=1, rank=0, replica_id=f"eft_{group}",
                      timeout=timeout, quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
                      # Synchronous quorum: the step's participants must be known before its rows are.
                      use_async_quorum=False, store_addr=store_addr, store_port=store_port,
                      lighthouse_addr=lighthouse_addr,
                      checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")))
    optimizer = Optimizer(manager, inner)
    log_dir = Path(config["log_dir"])
    out = open(log_dir / f"group{group}-{os.getpid()}.jsonl", "a", buffering=1)
    out.write(json.dumps({"kind": "start", "group": group, "pid": os.getpid(), "started_at": started,
                          "ready_at": time.time()}) + "\n")
    # The lighthouse forms a quorum from the groups it has heard of: wait (once, at the first
    # start) for every group's manager, so the run starts with all of them rather than healing
    # latecomers a few steps in.
    wait_until = time.time() + 120
    while len({p.name.split("-")[0] for p in log_dir.glob("group*.jsonl")}) < groups and time.time() < wait_until:
        time.sleep(0.1)
    died = log_dir / "died"

    steps = len(step_rows)
    finished = False
    while manager.current_step() < steps:
        t0, before = time.time(), manager.current_step()
        if before == config.get("hold_at") and group != config.get("die_group"):
            while count_starts(log_dir) <= groups and time.time() < wait_until + 120:
                time.sleep(0.1)
            time.sleep(0.5)  # its quorum request follows its start line: let it reach the lighthouse
        try:
            optimizer.zero_grad()  # quorum; a group behind the quorum's step heals here, from a peer
        except TimeoutError:
            # A replacement that arrives after the others finished never gets a quorum (Ray Train
            # still waits for it): it ends here, else the run fails on its timeouts.
            if any(log_dir.glob("final-group*.pt")):
                finished = True
                break
            raise
        step = manager.current_step()
        participants, rank = manager.num_participants(), manager.participating_rank()
        t_quorum = time.time()
        rows = step_rows[step]
        mine = rows[rank * GLOBAL_BATCH // participants:(rank + 1) * GLOBAL_BATCH // participants]
        x = torch.as_tensor(input_ids[mine], dtype=torch.long)
        y = torch.as_tensor(labels[mine], dtype=torch.long)
        loss = loss_sum(model, x, y, None)
        # Normalized by all G rows' label tokens and summed across groups: the same update
        # whatever the number of participants.
        (loss / float(step_tokens[step])).backward()
        if group == config.get("die_group") and step >= config.get("die_at", steps) and not died.exists():
            died.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        # The adapters' gradients in one flat all-reduce (torchft's DDP wrapper asserts on the
        # dummy future it gets once a peer has failed, so it cannot survive the kill it is for).
        t_backward = time.time()
        flat = torch.cat([p.grad.flatten() for p in params])
        manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        t_reduced = time.time()
        committed = manager.should_commit()  # every participant got here; decided per group
        t_commit = time.time()
        if committed:
            inner.step()
        out.write(json.dumps({
            "kind": "step", "group": group, "pid": os.getpid(), "step": step, "healed_from": before,
            "healed": step != before, "participants": participants, "rank": rank, "committed": committed,
            "rows": [int(r) for r in data["row_id"][mine]], "loss_sum": float(loss.detach()), "tokens": int(step_tokens[step]),
            "t0": t0, "t1": time.time(), "quorum_s": t_quorum - t0, "compute_s": t_backward - t_quorum,
            "allreduce_s": t_reduced - t_backward, "commit_s": t_commit - t_reduced}) + "\n")
    if not finished:
        torch.save({n: p.detach().clone() for n, p in zip(names, params)},
                   log_dir / f"final-group{group}-{os.getpid()}.pt")
    out.write(json.dumps({"kind": "done", "group": group, "pid": os.getpid(), "t": time.time(),
                          "arrived_after_the_end": finished}) + "\n")
    out.close()
    manager.shutdown()


def run_group_process(group: int, config: dict, lighthouse_addr: str) -> None:
    """A replica group in a plain process (no Ray): its own store, the given lighthouse."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    run_group(group, config, "localhost", store.port, lighthouse_addr)


def build_replicas_trainer(config: dict, name: str, storage: str):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    return TorchTrainer(
        train_replica, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=GROUPS, use_gpu=False, resources_per_worker={"CPU": 1, chaos.SLOT: 1}),
        torch_config=TorchftConfig(backend="gloo", lighthouse_kwargs={
            "min_replicas": config["min_replicas"], "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS}),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=2)),
    )


def read_logs(log_dir: Path) -> list[dict]:
    lines = []
    for path in sorted(log_dir.glob("group*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # the last line of a killed process may be cut
    return lines


def run_replicas(config: dict, name: str, storage: str, kill_at: int | None, kill_group: int) -> dict:
    """trainer.fit() in a thread; with `kill_at`, SIGKILL group `kill_group`'s worker once its
    log shows that step begun."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"eft-{name}-"))
    config = {**config, "log_dir": str(log_dir)}
    trainer = build_replicas_trainer(config, name, storage)
    error: list = []
    began = time.time()

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as err:  # reported below, with the logs
            error.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    killed = None
    while kill_at is not None and killed is None and thread.is_alive():
        hits = [r for r in read_logs(log_dir) if r["kind"] == "step" and r["group"] == kill_group
                and r["step"] >= kill_at]
        if hits:
            os.kill(hits[0]["pid"], signal.SIGKILL)
            killed = {"pid": hits[0]["pid"], "at": time.time(), "after_step": hits[0]["step"]}
        time.sleep(0.05)
    thread.join()
    wall = time.time() - began
    return {"name": name, "wall_s": round(wall, 2), "error": error[0] if error else None, "killed": killed,
            "log_dir": str(log_dir), "records": read_logs(log_dir), "began": began}


def check_replicas(run: dict, step_rows, base: dict | None = None) -> dict:
    """Per committed step: who took part, the rows, the loss; then the exactly-once check."""
    import torch

    steps = {}
    for r in run["records"]:
        if r["kind"] == "step" and r["committed"]:
            steps.setdefault(r["step"], []).append(r)
    n = len(step_rows)
    consumed, complete, commits_per_step, losses = [], True, {}, {}
    for s in range(n):
        recs = steps.get(s, [])
        commits_per_step[s] = len(recs)
        participants = {r["participants"] for r in recs}
        # A group killed after its gradient went into the all-reduce but before it logged leaves
        # fewer records than participants: its rows were consumed but not seen here.
        if len(participants) != 1 or len(recs) != participants.pop():
            complete = False
            continue
        recs.sort(key=lambda r: r["rank"])
        rows = [row for r in recs for row in r["rows"]]
        consumed += rows
        losses[s] = sum(r["loss_sum"] for r in recs) / recs[0]["tokens"]
    planned = [int(r) for s in range(n) for r in step_rows[s]]
    exactly_once = complete and consumed == planned
    finals = {}
    for path in glob.glob(os.path.join(run["log_dir"], "final-group*.pt")):
        finals[os.path.basename(path)] = torch.load(path)
    flat = {k: torch.cat([t.flatten() for t in v.values()]) for k, v in finals.items()}
    values = list(flat.values())
    same_weights = all(torch.equal(values[0], v) for v in values[1:]) if values else False
    out = {"steps_committed": len(steps), "every_step_committed_once_per_participant": complete,
           "exactly_once": exactly_once, "rows_consumed": len(consumed), "rows_planned": len(planned),
           "final_groups": len(values), "final_weights_identical": same_weights,
           "participants_per_step": {s: steps[s][0]["participants"] for s in sorted(steps)},
           "losses": losses}
    if base is not None:
        diffs = {s: abs(losses[s] - base["losses"][s]) for s in sorted(set(losses) & set(base["losses"]))}
        out["max_loss_diff_vs_uninterrupted"] = max(diffs.values())
        # Fewer participants sum the same rows in another order: rounding differences, which
        # training at a constant LR then amplifies; where they first exceed 1e-4 shows how soon.
        out["first_step_loss_diff_over_1e-4"] = min((s for s, d in diffs.items() if d > 1e-4), default=None)
        out["final_weights_max_diff_vs_uninterrupted"] = float((values[0] - base["final"]).abs().max())
    out["final"] = values[0] if values else None
    return out


def replicas_timing(run: dict, kill_group: int) -> dict:
    """Step times before / between / after, the survivors' stall at the kill, the rejoin."""
    recs = [r for r in run["records"] if r["kind"] == "step"]
    killed = run["killed"]
    survivor = min(g for g in range(GROUPS) if g != kill_group)
    mine = sorted((r for r in recs if r["group"] == survivor), key=lambda r: r["t0"])
    committed = [r for r in mine if r["committed"]]
    durations = [(r["t1"] - r["t0"]) for r in committed]
    timing = {"step_s_median": round(statistics.median(durations[5:] or durations), 3)}
    # What torchft adds to every step: the quorum before it (synchronous here) and the commit vote.
    for key in ("quorum_s", "compute_s", "allreduce_s", "commit_s"):
        timing[f"{key[:-2]}_s_median"] = round(statistics.median(r[key] for r in committed[5:] or committed), 4)
    if killed is None:
        return timing
    kill_t = killed["at"]
    before = [r for r in committed if r["t1"] <= kill_t]
    after = [r for r in committed if r["t0"] > kill_t]
    new_starts = [r for r in run["records"] if r["kind"] == "start" and r["group"] == kill_group
                  and r["pid"] != killed["pid"]]
    new_steps = sorted((r for r in recs if r["group"] == kill_group and r["pid"] != killed["pid"]),
                       key=lambda r: r["t0"])
    rejoin_t = new_steps[0]["t1"] if new_steps else None
    two = [r["t1"] - r["t0"] for r in after if rejoin_t is None or r["t0"] > kill_t and r["t1"] < rejoin_t][1:]
    three = [r["t1"] - r["t0"] for r in after if rejoin_t is not None and r["t0"] > rejoin_t][1:]
    median_before = statistics.median([r["t1"] - r["t0"] for r in before[5:]] or [0])
    first_after = after[0] if after else None
    failed = [r for r in mine if not r["committed"]]
    timing.update({
        "step_s_before_kill": round(median_before, 3),
        "step_s_two_groups": round(statistics.median(two), 3) if two else None,
        "step_s_after_rejoin": round(statistics.median(three), 3) if three else None,
        "failed_steps_on_survivor": len(failed),
        # Wall time from the survivor's last committed step before the kill to its first after,
        # less one ordinary step: what the kill cost the survivors.
        "survivor_stall_s": round(first_after["t1"] - before[-1]["t1"] - median_before, 2) if first_after and before else None,
        "kill_to_first_survivor_commit_s": round(first_after["t1"] - kill_t, 2) if first_after else None,
        "kill_to_replacement_started_s": round(new_starts[0]["started_at"] - kill_t, 2) if new_starts else None,
        "kill_to_replacement_ready_s": round(new_starts[0]["ready_at"] - kill_t, 2) if new_starts else None,
        "kill_to_replacement_healed_first_commit_s": round(rejoin_t - kill_t, 2) if rejoin_t else None,
        "replacement_healed_to_step": new_steps[0]["step"] if new_steps else None,
        "replacement_healed": bool(new_steps and new_steps[0]["healed"]),
        "steps_with_two_groups": sum(1 for r in after if r["participants"] == GROUPS - 1),
    })
    return timing


# -- eft's restart mode on the same schedule ------------------------------------------------------


def build_job(name: str, steps: int, save_every: int):
    from app.config import build_config

    return build_config({
        "name": name, "model": {"uri": "s3://eft/models/ft-tiny"},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]},
        "data": {"uri": "s3://eft/data/ft", "seq_len": 64},
        "prepare": {"input_uri": "s3://eft/raw/ft.jsonl"},
        "training": {"max_steps": steps, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // GROUPS, "lr": 3e-3,
                     "schedule": "constant", "seed": SEED},
        "checkpoint": {"save_every_steps": save_every},
        "scaling": chaos.elastic_scaling(min_workers=GROUPS, max_workers=GROUPS),
        "fault_tolerance": {"max_failures": 2},
        "storage": {"root_uri": "s3://eft/bench-runs"},
    })


def train_worker_pids() -> list[int]:
    import ray
    from ray.util.state import list_actors

    # This cluster's state API, by its address: another Ray may run on the same machine.
    return [a.pid for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                       filters=[("state", "=", "ALIVE")], limit=1000)
            if "Worker" in (a.class_name or "") and "Train" in (a.class_name or "")]


def run_restart(cfg, kill_at: int | None) -> dict:
    from app.storage import Store
    from app.train.launch import run_training

    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run_training(cfg, Store())), daemon=True)
    began = time.time()
    thread.start()
    killed = None
    if kill_at is not None:
        run = chaos.RunWatcher(Store(), cfg.run_uri, alive=thread.is_alive)
        run.wait_step(kill_at)
        pids = sorted(train_worker_pids())
        os.kill(pids[-1], signal.SIGKILL)
        killed = {"pid": pids[-1], "at": time.time()}
    thread.join()
    summary = result["summary"]
    summary["bench_wall_s"] = round(time.time() - began, 2)
    if killed:
        summary["kill_to_first_step_s"] = chaos.RunWatcher(Store(), cfg.run_uri).recovery_after(killed["at"])
    return summary


# -- the driver -----------------------------------------------------------------------------------


def prepare(cfg, work: Path) -> dict:
    """Base model and dataset in the local S3 (as eft's runs read them); the replicas' copy of
    the same rows, in the same per-step order, and of the base, on local disk."""
    import numpy as np

    from app.data.manifest import load_manifest, shard_uris
    from app.data.prepare import prepare_dataset
    from app.data.stream import DataOrder, load_split_rows
    from app.dev.tiny import build_corpus, save_tiny_base, write_jsonl
    from app.storage import Store

    store = Store()
    texts = build_corpus(max_docs=300)
    save_tiny_base(store, cfg.model.uri, texts=texts, **BENCH_MODEL)
    raw = write_jsonl(({"text": t} for t in texts), work / "corpus.jsonl")
    store.write_bytes(cfg.prepare.input_uri, raw.read_bytes())
    prepare_dataset(cfg, store)
    store.download_dir(cfg.model.uri, work / "base")
    manifest = load_manifest(store, cfg.data.uri)
    fs, _ = store.resolve(cfg.data.uri)
    rows = load_split_rows([store.resolve(u)[1] for u in shard_uris(cfg.data.uri, manifest, "train")], fs)
    order = DataOrder.from_manifest(manifest, SEED)
    position = {int(r): i for i, r in enumerate(rows["row_id"])}
    steps = cfg.training.max_steps
    step_ids = order.row_ids_at(0, steps * GLOBAL_BATCH).reshape(steps, GLOBAL_BATCH)
    step_rows = np.vectorize(position.__getitem__)(step_ids)
    np.savez(work / "rows.npz", row_id=rows["row_id"], input_ids=rows["input_ids"], labels=rows["labels"],
             step_rows=step_rows)
    return {"data": str(work / "rows.npz"), "base_dir": str(work / "base"), "step_rows": step_rows,
            "row_id": rows["row_id"]}


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, default=40)
    parser.add_argument("--kill-group", type=int, default=GROUPS - 1)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--skip-restart", action="store_true", help="replicas mode only")
    parser.add_argument("--restart-only", action="store_true", help="restart mode only (a check of its kill)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="eft-torchft-"))
    # Before the cluster starts: its processes read these when they start.
    chaos.configure_fast_failure_detection()
    with local.serve_s3():
        # One worker per simulated node (its trainer slot), as in bench/elastic_recovery.py.
        cluster = chaos.start_cluster(worker_nodes=GROUPS)
        try:
            cfg = build_job("ft-base", args.steps, args.save_every)
            inputs = prepare(cfg, work)
            step_ids = inputs["row_id"][inputs["step_rows"]]
            lora = cfg.lora.model_dump(mode="json")
            config = {"data": inputs["data"], "base_dir": inputs["base_dir"], "lora": lora, "lr": 3e-3,
                      "min_replicas": GROUPS - 1}
            storage = str(work / "ray-storage")
            restart_plain = restart_hit = None
            if args.restart_only:
                print(json.dumps(run_restart(cfg.model_copy(update={"name": "restart-check"}), args.kill_at),
                                 indent=1, default=str))
                return
            plain = run_replicas(config, "replicas-uninterrupted", storage, None, args.kill_group)
            hit = run_replicas(config, "replicas-interrupted", storage, args.kill_at, args.kill_group)
            if not args.skip_restart:
                restart_plain = run_restart(cfg.model_copy(update={"name": "restart-uninterrupted"}), None)
                restart_hit = run_restart(cfg.model_copy(update={"name": "restart-interrupted"}), args.kill_at)
        finally:
            ray.shutdown()
            cluster.shutdown()

    base = check_replicas(plain, step_ids)
    checked = check_replicas(hit, step_ids, base={"losses": base["losses"], "final": base["final"]})
    timing_plain, timing = replicas_timing(plain, args.kill_group), replicas_timing(hit, args.kill_group)
    report(args, plain, hit, base, checked, timing_plain, timing, restart_plain, restart_hit)


def report(args, plain, hit, base, checked, timing_plain, timing, restart_plain, restart_hit) -> None:
    for run in (plain, hit):
        if run["error"]:
            print(f"{run['name']}: {run['error']}", file=sys.stderr)
    goodput = plain["wall_s"] / hit["wall_s"]
    rows = [["replicas (torchft)", "uninterrupted", plain["wall_s"], timing_plain["step_s_median"], "-", "-",
             base["exactly_once"], "-"],
            ["replicas (torchft)", f"worker killed at step {args.kill_at}", hit["wall_s"], timing["step_s_median"],
             timing.get("survivor_stall_s"), timing.get("kill_to_replacement_healed_first_commit_s"),
             checked["exactly_once"], round(goodput, 3)]]
    data = {"steps": args.steps, "kill_at": args.kill_at, "groups": GROUPS, "global_batch": GLOBAL_BATCH,
            "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "replicas": {"uninterrupted": {"wall_s": plain["wall_s"], "error": plain["error"], **timing_plain,
                                            **{k: v for k, v in base.items() if k not in ("losses", "final")}},
                         "interrupted": {"wall_s": hit["wall_s"], "error": hit["error"], "killed": hit["killed"],
                                         **timing, **{k: v for k, v in checked.items() if k not in ("losses", "final")}},
                         "goodput": goodput}}
    if restart_plain and restart_hit:
        restart_goodput = restart_plain["wall_s"] / restart_hit["wall_s"]
        recomputed = [i.get("steps_recomputed") for i in restart_hit.get("interruptions", [])]
        rows += [["restart (eft)", "uninterrupted", restart_plain["wall_s"], "-", "-", "-", "yes (tested)", "-"],
                 ["restart (eft)", f"worker killed at step {args.kill_at}", restart_hit["wall_s"], "-",
                  restart_hit.get("kill_to_first_step_s"), "-", "yes (tested)", round(restart_goodput, 3)]]
        data["restart"] = {"uninterrupted_wall_s": restart_plain["wall_s"], "interrupted_wall_s": restart_hit["wall_s"],
                           "goodput": restart_goodput, "kill_to_first_step_s": restart_hit.get("kill_to_first_step_s"),
                           "steps_recomputed": recomputed, "interruptions": restart_hit.get("interruptions"),
                           "world_sizes": restart_hit.get("world_sizes")}
    table = markdown_table(["mode", "run", "wall s", "step s (median)", "lost at kill s",
                            "kill → replacement healed s", "rows exactly once", "goodput"], rows)
    details = markdown_table(["replicas, interrupted run", "value"],
                             [[k, v] for k, v in data["replicas"]["interrupted"].items()
                              if k not in ("participants_per_step", "error")])
    save_result("torchft_replicas", data, table + "\n\n" + details)


if __name__ == "__main__":
    main()
