"""`torchrun --nproc-per-node=N [--nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT]
-m app.train.torchrun CONFIG [--set KEY=VALUE ...]`: the same training loop without a Ray cluster.

Every rank runs `train_loop_per_worker` unchanged, through Ray Train's local mode
(`ScalingConfig(num_workers=0)` in a process with torchrun's environment: the same `ray.train`
APIs, the process group formed from torchrun's variables). Rank 0 is also the driver: it checks
the config and storage, takes the run lease, stores the resolved config, and writes summary.json,
as `eft train` does; the other ranks adopt its resolved config and fence when the group forms.

What differs from Ray, and why:
- the shards are read by pyarrow in each rank's process (no read tasks without a cluster), in
  the same order and through the same filter: each rank trains on the rows Ray Data would give
  it at the same world size (app/data/stream.py);
- the ranks commit their checkpoints themselves (Ray Train's local mode uploads nothing), in the
  same layout, sidecar last: a run moves between torchrun and Ray at any world size;
- the world size is torchrun's (`scaling.min_workers`/`max_workers` are set to it), and there is
  no grow: torchrun re-forms its group itself (`--nnodes=MIN:MAX`), and each start resumes from
  the latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# What torch.distributed's env:// rendezvous needs; torchrun sets all of them for each rank.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
EXIT_FAILED, EXIT_USAGE = 1, 2

log = logging.getLogger("eft.torchrun")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.train.torchrun",
        description="one rank of an eft run under torchrun: torchrun --nproc-per-node=N -m app.train.torchrun CONFIG")
    parser.add_argument("config", help="job YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.max_steps=200")
    parser.add_argument("--wait-timeout-s", type=float, default=None, metavar="S",
                        help="rank 0 waits up to S seconds for a run lease another driver holds (a restarted "
                             "group whose last rank 0 was killed), instead of refusing at once")
    return parser


def sized_for(cfg, world_size: int):
    """The config at torchrun's world size: the run's records and its stored config say what ran."""
    from app.config import JobConfig

    tree = cfg.model_dump(mode="json")
    tree["scaling"].update(min_workers=world_size, max_workers=world_size)
    return JobConfig.model_validate(tree)


def run_rank(cfg, rank: int, wait_s: float | None = None) -> None:
    from app.train.launch import build_local_trainer, run_training

    if rank == 0:
        summary = run_training(cfg, wait_s=wait_s, launcher="torchrun")
        log.info("%s: %s, %d steps, final train loss %s; %s/summary.json", cfg.name, summary["status"],
                 summary["steps"], summary["final_train_loss"], cfg.run_uri)
    else:
        build_local_trainer(cfg, driver=False).fit()


def main(argv: list[str] | None = None) -> int:
    from app.config import ConfigError, load_config

    args = build_parser().parse_args(argv)
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        print(f"eft: error: not started by torchrun ({', '.join(missing)} unset): run "
              f"`torchrun --nproc-per-node=N -m app.train.torchrun {args.config}`", file=sys.stderr)
        return EXIT_USAGE
    rank = int(os.environ["RANK"])
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Rank 0 logs progress, the others only warnings (as under Ray: app.train.loop).
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s [eft] %(message)s")
    logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
    try:
        # Every rank reads the config: a bad one is the same line from each, before any rendezvous.
        cfg = sized_for(load_config(args.config, args.set), int(os.environ["WORLD_SIZE"]))
        run_rank(cfg, rank, args.wait_timeout_s)
    except ConfigError as err:
        print(f"eft: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # expected failures carry one-line messages
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"eft: error: rank {rank}: {msg}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
