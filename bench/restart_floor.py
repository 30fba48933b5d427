"""The floor under a restart on this machine: what starting one training worker costs in CPU,
and what N of them starting at once cost in wall time, with no Ray scheduling, no rendezvous
across workers, no storage traffic and no checkpoint in it.

Each worker is a fresh Python process (as every restart of a Ray Train worker group is) that
imports what a Ray Train worker imports (Ray, `ray.train.torch`, torch), then our train loop's
module, then builds the model the benchmarks train (the tiny Llama + LoRA, FSDP2 on a one-rank
gloo group). It reports its wall time and its own CPU time per phase.

Measured alone, then N at once (N = the workers a restart of `bench/reclaim_schedule.py` starts
on this machine's cores). If N at once take about N x CPU / cores, the restart's worker start
and model load are CPU bound here, and no change to the order of the phases can make them
shorter than that; on a node with a core per worker the same start takes the alone figure.

Then Ray Train's own restart on a one-node local Ray (no simulated nodes, no storage, no
checkpoint): 2 workers build the same model, rank 0 exits, and the new group's workers record
when their train function started, when the train loop's module was imported and when the
model was built, from the moment rank 0 exited.

    .venv/bin/python bench/restart_floor.py [--workers 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS, markdown_table, save_result  # noqa: E402

def floor_job(base: str) -> dict:
    """The job every worker here builds the model of: the benchmarks' tiny Llama + LoRA."""
    return {"name": "floor", "model": {"uri": base}, "data": {"uri": "/tmp/floor-data"},
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"]},
            "training": {"max_steps": 1}, "storage": {"root_uri": "/tmp/floor-runs"}}


# One worker's start, phase by phase. argv: the job (JSON), a file for the gloo rendezvous.
WORKER = r"""
import json, resource, sys, time
marks = [("started", time.time())]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
cpus = [cpu()]
import ray, ray.train.torch  # what the Ray Train worker imports before the train function runs
marks.append(("ray_torch", time.time())); cpus.append(cpu())
import app.train.loop  # the train function's module, imported when the function is unpickled
marks.append(("train_module", time.time())); cpus.append(cpu())
import torch, torch.distributed as dist
from app.config import build_config
from app.storage import Store
from app.model.build import build_model
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
build_model(build_config(json.loads(sys.argv[1])), Store(), torch.device("cpu"), 0, 1)
marks.append(("model_built", time.time())); cpus.append(cpu())
dist.destroy_process_group()
print("FLOOR " + json.dumps({"marks": marks, "cpu": cpus}))
"""

PHASES = [("imports_ray_torch", "Ray, ray.train.torch, torch"), ("imports_train_module", "app.train.loop"),
          ("model_build", "transformers, PEFT, model build, FSDP2")]


def start_workers(n: int, base: str, tmp: Path) -> list[dict]:
    """n fresh worker processes at once; per worker, wall and CPU seconds per phase, timed from
    its spawn."""
    procs, job = [], json.dumps(floor_job(base))
    for i in range(n):
        rendezvous = tmp / f"pg-{time.monotonic_ns()}-{i}"
        spawned = time.time()
        procs.append((spawned, subprocess.Popen([sys.executable, "-c", WORKER, job, str(rendezvous)], cwd=ROOT,
                                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)))
    out = []
    for spawned, proc in procs:
        stdout, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"worker exited {proc.returncode}")
        rec = json.loads(next(line for line in stdout.splitlines() if line.startswith("FLOOR "))[6:])
        times = [t for _, t in rec["marks"]]
        row = {"wall_s": round(times[-1] - spawned, 2), "cpu_s": round(rec["cpu"][-1], 2),
               "interpreter_s": round(times[0] - spawned, 2)}
        for i, (name, _) in enumerate(PHASES):
            row[f"{name}_wall_s"] = round(times[i + 1] - times[i], 2)
            row[f"{name}_cpu_s"] = round(rec["cpu"][i + 1] - rec["cpu"][i], 2)
        out.append(row)
    return out


def restart_worker(config: dict) -> None:
    """Ray Train worker fn: the floor's work inside a real worker group. The first group's rank
    0 exits once every rank has built the model; the next group records its marks and ends."""
    import json
    import os
    import time

    entered = time.time()
    import importlib

    import ray.train
    importlib.import_module("app.train.loop")  # what the real train function's unpickling imports
    imported = time.time()
    import torch
    import torch.distributed as dist

    from app.config import build_config
    from app.model.build import build_model
    from app.storage import Store

    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    cfg = build_config(config["cfg"])
    build_model(cfg, Store(), torch.device("cpu"), rank, world)
    built = time.time()
    marks = Path(config["marks"])
    died = marks / "died.json"
    if not died.exists():
        dist.barrier()
        if rank == 0:
            died.write_text(json.dumps({"at": time.time()}))
            os._exit(1)
        time.sleep(120)  # the controller tears this group down once it sees rank 0 gone
    (marks / f"rank{rank}.json").write_text(json.dumps({"entered": entered, "imported": imported,
                                                        "built": built}))


def measure_ray_train_restart(base: str, tmp: Path, workers: int = 2) -> dict:
    """Seconds from a worker's exit to the new group's train function started, its train module
    imported and its model built (the slowest rank), on a one-node local Ray."""
    import json

    os.environ.update({"RAY_TRAIN_V2_ENABLED": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1",
                       "RAY_USAGE_STATS_ENABLED": "0"})
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks = tmp / "marks"
    marks.mkdir()
    # Logical CPUs above the cores: the controller and Ray's helper actors need some too.
    ray.init(num_cpus=workers + 4, include_dashboard=True, log_to_driver=False)
    try:
        TorchTrainer(restart_worker, train_loop_config={"cfg": floor_job(base), "marks": str(marks)},
                     scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(name="restart-floor", storage_path=str(tmp / "ray"),
                                          failure_config=FailureConfig(max_failures=1))).fit()
    finally:
        ray.shutdown()
    died = json.loads((marks / "died.json").read_text())["at"]
    ranks = [json.loads((marks / f"rank{r}.json").read_text()) for r in range(workers)]
    return {k: round(max(r[k] for r in ranks) - died, 2) for k in ("entered", "imported", "built")}


def measured_restarts() -> list[dict]:
    """Per restart in the last reclaim-schedule result: the old group's last step to the new
    group's model built (detect, relaunch, worker start, setup, model load)."""
    path = RESULTS / "reclaim_schedule.json"
    if not path.exists():
        return []
    rows = []
    for i in json.loads(path.read_text())["scheduled"]["interruptions"]:
        p = i.get("phases") or {}
        rows.append({"cause": i["cause"], "world": f"{i['world_size_before']}→{i['world_size_after']}",
                     "to_model_built_s": round(sum(p.get(k, 0) for k in ("detect_s", "relaunch_s", "worker_start_s", "setup_s",
                                                                           "model_load_s")), 1),
                     "workers": i["world_size_after"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from app.dev.tiny import build_corpus, save_tiny_base
    from app.storage import Store

    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        base = save_tiny_base(Store(), str(Path(tmp) / "base"), texts=build_corpus(max_docs=300))
        start_workers(1, base, Path(tmp))  # a first start warms the page cache and the .pyc files
        # Alternated, so drifting load on the box hits both sides alike.
        alone, together = [], []
        for _ in range(args.repeats):
            alone += start_workers(1, base, Path(tmp))
            together.append(start_workers(args.workers, base, Path(tmp)))
        ray_restart = measure_ray_train_restart(base, Path(tmp))

    def med(rows: list[dict], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 2)

    alone_wall, alone_cpu = med(alone, "wall_s"), med(alone, "cpu_s")
    # A restart waits for its slowest worker: per repeat, the last of the N to finish.
    slowest = [max(group, key=lambda r: r["wall_s"]) for group in together]
    together_wall = round(statistics.median(r["wall_s"] for r in slowest), 2)
    together_cpu = round(statistics.median(sum(r["cpu_s"] for r in g) for g in together), 2)
    cpu_bound_s = round(together_cpu / min(cores, args.workers), 2)
    phase_rows = [[label, med(alone, f"{name}_cpu_s"), med(alone, f"{name}_wall_s"),
                   round(statistics.median(r[f"{name}_wall_s"] for r in slowest), 2)]
                  for name, label in PHASES]
    phase_rows.insert(0, ["interpreter start", "-", med(alone, "interpreter_s"),
                          round(statistics.median(r["interpreter_s"] for r in slowest), 2)])
    restarts = measured_restarts()
    table = "\n\n".join([
        f"One worker's start (fresh process → imports → model built), alone and {args.workers} at once on "
        f"{cores} cores; medians of {args.repeats}.",
        markdown_table(["phase", "CPU s (alone)", "wall s (alone)", f"wall s ({args.workers} at once, slowest)"],
                       phase_rows + [["**total**", alone_cpu, alone_wall, together_wall]]),
        f"{args.workers} at once: **{together_wall} s** for the slowest, {together_wall / alone_wall:.2f}x one "
        f"alone; they use {together_cpu} CPU-s, which {min(cores, args.workers)} cores cannot do in under "
        f"**{cpu_bound_s} s**. That is the floor under a restart's worker start and model load here, before "
        f"Ray schedules an actor, before the process group forms and before any byte is read from storage.",
        "Ray Train's own restart, 2 workers on a one-node local Ray (health checks every 1 s, as in the "
        "benchmarks), from rank 0's exit to the slowest rank of the new group:",
        markdown_table(["train function started (s)", "app.train.loop imported (s)", "model built (s)"],
                       [[ray_restart["entered"], ray_restart["imported"], ray_restart["built"]]]),
        (markdown_table(["restart in bench/results/reclaim_schedule.md", "world",
                         "last step → model built (s)", "CPU floor of its workers' start (s)"],
                        [[r["cause"], r["world"], r["to_model_built_s"],
                          round(r["workers"] * alone_cpu / min(cores, r["workers"]), 1)] for r in restarts])
         if restarts else ""),
    ])
    save_result("restart_floor", {"workers": args.workers, "cores": cores, "alone": alone, "together": together,
                                  "alone_wall_s": alone_wall, "alone_cpu_s": alone_cpu,
                                  "together_wall_s": together_wall, "together_cpu_s": together_cpu,
                                  "cpu_bound_s": cpu_bound_s, "ray_train_restart_s": ray_restart,
                                  "restarts": restarts}, table)


if __name__ == "__main__":
    main()
