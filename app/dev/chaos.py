"""Rehearse spot pre-emption on one machine: a real multi-node Ray cluster
(`ray.cluster_utils.Cluster`, one raylet per simulated node), pre-emption notices sent the way
a cloud's drain is (GCS `DrainNode` with reason PREEMPTION and a deadline), nodes removed
gracefully or killed outright, and a watcher that follows a run through its heartbeats.
A seeded reclaim schedule (`build_reclaim_schedule`, `play_reclaims`) strings several of them
over one run. Used by the elastic tests, `bench/elastic_recovery.py` and
`bench/reclaim_schedule.py`.

Ray reads its knobs when its processes start, so `configure_fast_failure_detection()` must run
before the cluster does: nodes it starts inherit this process's environment.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from app.compat import drain_node_for_preemption
from app.elastic.checkpoint import checkpoint_dir_name, is_complete
from app.observe.records import load_events, load_heartbeats
from app.storage import Store, join

SLOT = "trainer_slot"  # one per simulated node, so each training worker lands on its own node
# A node killed outright is declared dead after missed health checks: 3 x 1 s instead of
# Ray's default of several times longer.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                      "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
# No idle workers started ahead of need: a rehearsal's first driver otherwise has every node start
# one per CPU (and a node added later, its own), and most were never used: 35 idle processes, 38
# CPU-seconds, in one spot scenario on 4 nodes. Its actors and tasks start their workers on demand.
NO_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def configure_fast_failure_detection() -> None:
    """Ray Train's poll intervals, lowered so a rehearsal takes a minute, not ten."""
    os.environ.update({"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
                       "RAY_USAGE_STATS_ENABLED": "0"})


def elastic_scaling(min_workers: int = 2, max_workers: int = 3) -> dict:
    """The `scaling` section for a run on a cluster from `start_cluster`: one worker per node
    (its slot), and resize checks and start timeouts short enough for a rehearsal."""
    return {"min_workers": min_workers, "max_workers": max_workers, "cpus_per_worker": 1,
            "resources_per_worker": {SLOT: 1}, "elastic_resize_monitor_interval_s": 3,
            "worker_group_start_timeout_s": 5}


@dataclass
class LocalCluster:
    cluster: object
    nodes: list
    node_args: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self):
        node = self.cluster.add_node(**self.node_args)
        self.nodes.append(node)
        return node

    def preempt(self, node, deadline_s: float) -> bool:
        """A spot reclaim notice: drain `node` with reason PREEMPTION, going in `deadline_s`.
        Returns whether the GCS accepted it."""
        return drain_node_for_preemption(self.address, node.node_id, int((time.time() + deadline_s) * 1000),
                                         "spot reclaim (rehearsal)")

    def remove(self, node, graceful: bool) -> None:
        """graceful: the node goes the way a drained spot node does; else killed outright."""
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.nodes.remove(node)

    def shutdown(self) -> None:
        self.cluster.shutdown()


def start_cluster(worker_nodes: int, cpus_per_node: int = 2, head_cpus: int = 3) -> LocalCluster:
    """A head (CPU for the driver, Train's controller and Ray Data) and `worker_nodes` nodes,
    each with one `trainer_slot`; then `ray.init` joins it."""
    import ray
    from ray.cluster_utils import Cluster

    from app.cluster import own_dashboard_port, require_token_auth

    require_token_auth()  # every node inherits the token from this process's environment
    dashboard_port = own_dashboard_port()  # and its state API's address
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "include_dashboard": True, "dashboard_port": dashboard_port,
        "_system_config": {**FAST_HEALTH_CHECKS, **NO_PRESTART}})
    node_args = {"num_cpus": cpus_per_node, "resources": {SLOT: 1}}
    nodes = [cluster.add_node(**node_args) for _ in range(worker_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return LocalCluster(cluster, nodes, node_args)


def reclaim_with_notice(cluster: LocalCluster, node, run: "RunWatcher", notice_s: float) -> dict:
    """A spot reclaim as a cloud does it: a pre-emption notice on `node` with a deadline, the
    run's just-in-time checkpoint, then the node gone a second before the deadline (so that the
    node's loss, not Ray Train's own deadline, ends the group). The watcher may see the save a
    poll late (a save 0.1 s before the deadline was missed by a watcher that gave up at it):
    whether the save beat the deadline is the caller's to check, from the run's events. Returns
    drain_accepted, deadline, jit_checkpoint_step and removed_at."""
    noticed_at = time.time()
    out = {"drain_accepted": cluster.preempt(node, deadline_s=notice_s), "deadline": noticed_at + notice_s}
    out["jit_checkpoint_step"] = run.wait_jit_checkpoint(after=noticed_at, timeout_s=notice_s + 10)
    time.sleep(max(out["deadline"] - 1.0 - time.time(), 0.0))
    out["removed_at"] = time.time()
    cluster.remove(node, graceful=True)
    return out


class BackgroundRun:
    """`run_training` on a thread of this process while a rehearsal acts on the cluster, and a
    watcher that follows it from its records in storage."""

    def __init__(self, cfg, store: Store):
        from app.train.launch import run_training

        self.result: dict = {}
        self.thread = threading.Thread(target=lambda: self.result.update(summary=run_training(cfg, store)),
                                       daemon=True)
        self.started = time.time()
        self.thread.start()
        self.watcher = RunWatcher(store, cfg.run_uri, alive=self.thread.is_alive)

    def join(self, timeout_s: float = 600) -> Optional[dict]:
        """The run's summary, or None if it raised (its traceback is on stderr) or is still going."""
        self.thread.join(timeout=timeout_s)
        return self.result.get("summary")


class RunWatcher:
    """Follows a run from its heartbeats in storage (what `eft status` reads too)."""

    def __init__(self, store: Store, run_uri: str, alive=lambda: True, poll_s: float = 0.5):
        # Each poll lists and reads the run's records: on a 2-core box, against a Python S3
        # stand-in, polling every 0.2 s took CPU from the very steps being watched.
        self.store, self.run_uri, self.alive, self.poll_s = store, run_uri, alive, poll_s

    def heartbeats(self) -> list[dict]:
        if not self.store.exists(join(self.run_uri, "heartbeats")):
            return []
        return load_heartbeats(self.store, self.run_uri)

    def wait_step(self, at_least: int, world_size: Optional[int] = None, after: float = 0.0,
                  timeout_s: float = 300) -> int:
        """Block until a worker group (of `world_size`, started after `after`, if given) has
        reached step `at_least`; returns the step it is at."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and self.alive():
            beats = [b for b in self.heartbeats() if b["started_at"] > after
                     and (world_size is None or b.get("world_size") == world_size)]
            step = max([b.get("last_step") or 0 for b in beats] or [0])
            if step >= at_least:
                return step
            time.sleep(self.poll_s)
        ended = "" if self.alive() else " (the run ended)"
        raise TimeoutError(f"{self.run_uri}: no step {at_least} (world size {world_size}) within {timeout_s}s{ended}")

    def events(self) -> list[dict]:
        return load_events(self.store, self.run_uri)

    def wait_jit_checkpoint(self, after: float, timeout_s: float = 60) -> int:
        """Block until the run has recorded a pre-emption notice (one recorded after `after`)
        and its just-in-time checkpoint is complete in storage; returns that checkpoint's step:
        the late save's (`preemption_checkpoint` event), or the notice's own step when the
        notice fell back to saving at once. TimeoutError, saying what is missing, if not
        within `timeout_s`."""
        deadline = time.time() + timeout_s
        notice = step = None
        while time.time() < deadline and self.alive():
            events = [e for e in self.events() if e["time"] > after]
            notice = notice or next((e for e in events if e["kind"] == "preemption_notice"), None)
            if notice is not None and notice.get("plan") == "now":
                step = notice["step"]
            elif notice is not None:
                late = next((e for e in events if e["kind"] == "preemption_checkpoint"), None)
                step = late["step"] if late else None
            if step is not None and is_complete(self.store, join(self.run_uri, checkpoint_dir_name(step))):
                return step
            time.sleep(self.poll_s)
        missing = ("no pre-emption notice recorded" if notice is None
                   else f"the notice at step {notice['step']} but no complete just-in-time checkpoint"
                   + (f" (step {step})" if step is not None else ""))
        ended = "" if self.alive() else " (the run ended)"
        raise TimeoutError(f"{self.run_uri}: {missing} within {timeout_s}s of the notice{ended}")

    def recovery_after(self, lost_at: float) -> Optional[float]:
        """Seconds from a node loss to the first step of the next worker group."""
        firsts = [b["first_step_at"] for b in self.heartbeats() if b["started_at"] > lost_at and b.get("first_step_at")]
        return round(min(firsts) - lost_at, 2) if firsts else None


@dataclass(frozen=True)
class Reclaim:
    """One node lost in a schedule, then its capacity back."""
    kind: str  # "notice": drained, gone just before its deadline; "kill": gone at once
    at_step: int  # the run's step at which it comes (or at once, if the run is past it)
    deadline_s: Optional[float]  # a notice's warning
    return_after_steps: int  # steps trained at the smaller size before a node joins again


def build_reclaim_schedule(seed: int, steps: int, notices: int = 2, kills: int = 1, deadline_s: float = 30.0,
                           return_after_steps: tuple[int, int] = (10, 30)) -> list[Reclaim]:
    """`notices` + `kills` reclaims in a seeded order, one per equal slice of the run's first
    two thirds, each at a seeded step in the first half of its slice: a notice's deadline, the
    restart and the node's return then fit before the next one on a box that takes ~0.5 s a
    step, and the last third runs at full size."""
    rng = random.Random(seed)
    kinds = ["notice"] * notices + ["kill"] * kills
    rng.shuffle(kinds)
    span = (2 * steps // 3) // max(len(kinds), 1)
    if span < 8:
        raise ValueError(f"{steps} steps are too few for {len(kinds)} reclaims")
    return [Reclaim(kind, at_step=i * span + rng.randint(span // 8, span // 2),
                    deadline_s=deadline_s if kind == "notice" else None,
                    return_after_steps=rng.randint(*return_after_steps))
            for i, kind in enumerate(kinds)]


def play_reclaims(cluster: LocalCluster, run: RunWatcher, schedule: list[Reclaim], seed: int) -> list[dict]:
    """Play `schedule` on a running job: for each reclaim, at its step, lose a seeded node (a
    notice: drain it, remove it a second before its deadline, as a reclaimed spot node goes;
    a kill: remove it outright), wait for training at the smaller size, then add a node and
    wait for the group to grow back. Returns when each happened, and the seconds from each loss
    and each return to the first step after it."""
    rng = random.Random(seed)
    played = []
    for reclaim in schedule:
        run.wait_step(reclaim.at_step)
        world = len(cluster.nodes)
        node = rng.choice(cluster.nodes)
        noticed_at = None
        if reclaim.kind == "notice":
            noticed_at = time.time()
            cluster.preempt(node, deadline_s=reclaim.deadline_s)
            time.sleep(max(reclaim.deadline_s - 1.0, 0.0))
        lost_at = time.time()
        cluster.remove(node, graceful=reclaim.kind == "notice")
        shrunk = run.wait_step(1, world_size=world - 1, after=lost_at)
        run.wait_step(shrunk + reclaim.return_after_steps, world_size=world - 1)
        returned_at = time.time()
        cluster.add_node()
        run.wait_step(1, world_size=world, after=returned_at)
        played.append({"kind": reclaim.kind, "at_step": reclaim.at_step, "noticed_at": noticed_at,
                       "lost_at": lost_at, "returned_at": returned_at,
                       "loss_to_first_step_s": run.recovery_after(lost_at),
                       "return_to_first_step_s": run.recovery_after(returned_at)})
    return played
