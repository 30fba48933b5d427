"""Driver-side help for elastic runs: tell Ray Train about node changes as soon as they happen.

Ray Train V2's elastic policy sizes a (re)started worker group from the resources reserved
for it by Ray Data's AutoscalingCoordinator, and that actor refreshes its view of the
cluster's nodes on a 20 s tick. After a node is lost, Train can therefore retry the old
size, wait out `worker_group_start_timeout_s` for a worker that cannot be placed, and only
then settle for fewer; a returning node likewise goes unseen for up to a tick. Two fixes:
* a controller callback asks the coordinator to recompute right before Train acts on a
  failure, so the restart is sized on the nodes alive now (shrinking after a loss). A node
  killed outright is still listed alive until the GCS's health checks give up on it, while
  its peers' collectives fail at once; so the callback first looks for listed-alive nodes
  whose raylet no longer accepts a connection and waits (bounded) until the GCS declares
  them dead, or the restart would be sized on them and wait out the start timeout;
* a driver thread polls the GCS node table (cheap) and asks for a recompute when the set of
  live nodes changes, so a returning node is seen at Train's next resize check (growing).
The same callback records, as run events, each worker-group launch (its size and what the
live nodes hold then) and each failure decision: the evidence that a restart was sized on the
live nodes and waited out no start timeout.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from app.compat import (RAY_PREEMPTION_WATCHER_ENV, build_preemption_callback, controller_callback_base,
                        controller_state_name, refresh_autoscaling_coordinator, resources_per_worker)

log = logging.getLogger("eft.elastic")

# How long a controller callback waits for the run lease. The callbacks run on Ray Train's
# controller loop, which decides nothing (no poll of the workers, no restart) while one runs; a
# patient read rides out an outage for minutes. At the bound the lease counts as unknown, not
# lost: the decision goes ahead as Ray would take it, and an event is not recorded. A lost run
# is still stopped: its workers check the lease, patiently, before every commit and at start.
LEASE_READ_BOUND_S = 10.0


def live_node_ids() -> frozenset:
    import ray

    return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def refresh_autoscaling_view(timeout_s: float = 10.0) -> bool:
    """Make the coordinator re-read the cluster now. False when there is none (yet), or this
    Ray has no such actor: then Train simply keeps its own pace."""
    try:
        return refresh_autoscaling_coordinator("eft-node-watcher", timeout_s)
    except Exception as err:  # an internal of Ray's: never let it break a training run
        log.debug("could not refresh the autoscaling coordinator: %s", err)
        return False


def unreachable_nodes(connect_timeout_s: float = 1.0) -> frozenset:
    """Nodes the GCS lists alive whose raylet refuses (or does not answer) a TCP connection:
    gone, but not declared dead yet."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerPort")]

    def refuses(node) -> bool:
        try:
            socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]),
                                     timeout=connect_timeout_s).close()
            return False
        except OSError:
            return True

    if not nodes:
        return frozenset()
    with ThreadPoolExecutor(max_workers=min(len(nodes), 32)) as pool:
        return frozenset(n["NodeID"] for n, gone in zip(nodes, pool.map(refuses, nodes)) if gone)


def wait_until_declared_dead(node_ids: frozenset, timeout_s: float = 30.0) -> bool:
    """Block until the GCS no longer lists `node_ids` alive (its health checks catch up with
    a killed node within their window), at most `timeout_s`. Returns whether they are gone."""
    import time

    deadline = time.monotonic() + timeout_s
    while node_ids & live_node_ids():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def settle_node_view() -> None:
    """Before a restart is sized: let the GCS catch up with nodes that are already gone."""
    try:
        gone = unreachable_nodes()
        if gone:
            log.info("%d node(s) listed alive do not answer; waiting for the GCS to declare them dead", len(gone))
            if not wait_until_declared_dead(gone):
                log.warning("the GCS still lists %d unreachable node(s) alive; restarting anyway", len(gone))
    except Exception as err:  # best effort: never let it break a training run
        log.debug("could not check node liveness: %s", err)


def live_worker_capacity(resources_per_worker: dict) -> int:
    """How many workers of `resources_per_worker` the live nodes hold in total (each node's
    resources divided per worker, as Train's elastic policy counts them), busy or not."""
    import ray

    need = {k: v for k, v in resources_per_worker.items() if v > 0}
    if not need:
        return 0
    return sum(int(min(node["Resources"].get(k, 0.0) // v for k, v in need.items()))
               for node in ray.nodes() if node.get("Alive"))


class ControllerEvents:
    """Run events written from Ray Train's controller (`<run>/events/`, like the workers'):
    each worker-group launch with the size chosen and what the live nodes hold, and each
    failure with the decision taken, the error, and the controller states before and after.
    A launch that fails (a worker-group start timeout, say) shows as a failure out of
    SCHEDULING. Recording never raises: it must not affect the run."""

    def __init__(self, store, run_uri: str, cfg=None, fence=None):
        self.store, self.run_uri, self.cfg, self.fence = store, run_uri, cfg, fence

    @classmethod
    def from_run_context(cls, train_run_context) -> "Optional[ControllerEvents]":
        from app.config import JobConfig
        from app.lease import Fence
        from app.storage import Store

        config = train_run_context.train_loop_config or {}
        if config.get("cfg") is None:
            return None
        cfg = JobConfig.model_validate(config["cfg"])
        return cls(Store.from_config(cfg.storage), cfg.run_uri, cfg, Fence.from_dict(config.get("fence")))

    def record(self, kind: str, **fields) -> None:
        from app.observe.records import record_event

        try:
            if self.fence is not None:  # a controller whose driver lost the run records nothing
                self.fence.check(self.store, timeout_s=LEASE_READ_BOUND_S)
            record_event(self.store, self.run_uri, kind, **fields)
        except Exception as err:  # storage trouble must not fail the controller
            log.warning("could not record %s: %s", kind, err)


def describe_error(error) -> dict:
    """The error class, the class of what a ControllerError wraps, and the first line."""
    inner = getattr(error, "controller_failure", None)
    lines = str(inner if inner is not None else error).strip().splitlines()
    return {"error": type(error).__name__, "cause": type(inner).__name__ if inner is not None else None,
            "message": lines[0][:300] if lines else ""}


def build_refresh_callback():
    """A Ray Train controller callback (a developer API of Ray Train V2) that refreshes the
    autoscaling view before each failure decision is carried out and records the controller's
    launches and failures as run events; None if this Ray has no such hook."""
    ControllerCallback = controller_callback_base()
    if ControllerCallback is None:
        return None

    class RefreshBeforeRestart(ControllerCallback):
        def __init__(self):
            self.events: Optional[ControllerEvents] = None
            self.resources_per_worker: dict = {}
            self.pending_decision: Optional[str] = None
            # The size of the group running now; None while none runs (before the first start,
            # after a failure): a grow can only checkpoint a group that is still up.
            self.running_workers: Optional[int] = None

        def after_controller_start(self, train_run_context) -> None:
            try:
                self.events = ControllerEvents.from_run_context(train_run_context)
                scaling = train_run_context.scaling_config
                self.resources_per_worker = resources_per_worker(scaling)
            except Exception as err:
                log.warning("controller events off: %s", err)

        def on_controller_start_worker_group(self, *, scaling_config, num_workers: int):
            self.running_workers = num_workers
            if self.events is not None:
                try:
                    capacity = live_worker_capacity(self.resources_per_worker)
                except Exception as err:  # a count for the event only: it must not stop a start
                    log.debug("live worker capacity unknown (%s: %s)", type(err).__name__, err)
                    capacity = None
                self.events.record("worker_group_launch", num_workers=num_workers, live_capacity=capacity,
                                   max_workers=scaling_config.max_workers)
            return None

        def before_controller_execute_resize_decision(self, resize_decision) -> None:
            """Before Ray Train shuts a healthy group down to start a bigger one: a checkpoint
            at the group's next step boundary, so the bigger group recomputes nothing."""
            to_workers, running = getattr(resize_decision, "num_workers", None), self.running_workers
            events = self.events
            if events is None or not events.cfg.checkpoint.before_grow or running is None or \
                    to_workers is None or to_workers <= running:
                return
            from app.elastic.grow import checkpoint_before_grow

            try:
                checkpoint_before_grow(events.store, events.run_uri, running, to_workers,
                                       events.cfg.checkpoint.before_grow_timeout_s, record=events.record)
            except Exception as err:  # the grow goes ahead from the latest checkpoint, as before
                log.warning("grow %d → %d: no checkpoint asked for (%s)", running, to_workers, err)

        def before_controller_execute_failure_decision(self, failure_decision) -> None:
            self.running_workers = None
            self.pending_decision = getattr(failure_decision, "value", str(failure_decision))
            settle_node_view()
            refresh_autoscaling_view()

        def after_controller_state_update(self, previous_state, current_state) -> None:
            decision, self.pending_decision = self.pending_decision, None
            if decision is None or self.events is None:
                return
            # RETRY → RESTARTING / RESCHEDULING (with the error); RAISE → SHUTTING_DOWN → ERRORED.
            error = getattr(current_state, "training_failed_error", None) or getattr(
                getattr(current_state, "next_state", None), "training_failed_error", None)
            self.events.record("worker_group_failure", decision=decision,
                               from_state=controller_state_name(previous_state),
                               to_state=controller_state_name(current_state),
                               **(describe_error(error) if error is not None else {}))

    return RefreshBeforeRestart()


def build_fence_callback():
    """A controller callback that ends the run, without a retry, once the driver's run lease has
    a new holder: before each worker-group start and before each failure decision it checks the
    fence (the lease epoch the run was started with, app.lease.Fence). A group whose workers
    found the lease lost at a commit fails, and this turns Ray Train's retry into the end of the
    run: a restarted group of a driver that lost its run would only fail at its first commit
    again, holding nodes the new holder needs. A lease not read within LEASE_READ_BOUND_S (an
    outage) does not hold the decision up: it goes ahead as Ray takes it. None if this Ray has
    no controller callbacks."""
    ControllerCallback = controller_callback_base()
    if ControllerCallback is None:
        return None

    class StopWhenLeaseLost(ControllerCallback):
        def __init__(self):
            self.store, self.fence = None, None

        def after_controller_start(self, train_run_context) -> None:
            # The same store and fence the controller's events are recorded with.
            events = ControllerEvents.from_run_context(train_run_context)
            if events is not None:
                self.store, self.fence = events.store, events.fence

        def _check(self) -> None:
            from ray.train import ControllerError

            from app.lease import LeaseError

            if self.fence is None:
                return
            try:
                self.fence.check(self.store, timeout_s=LEASE_READ_BOUND_S)
            except LeaseError as lost:
                log.error("%s", lost)
                raise ControllerError(lost) from None
            except Exception as err:  # storage trouble, or no answer within the bound: decide as Ray would have
                log.warning("run lease not checked (%s: %s)", type(err).__name__, err)

        def before_controller_execute_resize_decision(self, resize_decision) -> None:
            self._check()

        def before_controller_execute_failure_decision(self, failure_decision) -> None:
            self._check()

    return StopWhenLeaseLost()


# Set beside RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 when eft turned Ray's watcher off for its own.
OWN_WATCHER_ENV = "EFT_OWN_PREEMPTION_WATCHER"


def build_controller_callbacks(elastic: bool, fenced: bool = False) -> list:
    """The callbacks eft gives Ray Train's controller: the refresh-and-record callback for an
    elastic run, the run-lease check (`fenced`: the run holds a lease), and Ray's pre-emption
    watcher run on a thread of the controller (it is what `ray.train.get_preemption_info` reads;
    see app.compat.build_preemption_callback). Ray's own watcher is turned off in its place,
    through Ray Train's documented switch, which the driver propagates to the controller. A user
    who turned the watcher off keeps it off."""
    import os

    callbacks = [build_refresh_callback()] if elastic else []
    if fenced:
        callbacks.append(build_fence_callback())
    # The switch is set to 0 in this process (and so in its children) when eft puts its own
    # watcher in Ray's place; only a 0 that eft did not set is the user's. Without the marker a
    # second run from the same driver process, or a process it starts, went without a watcher.
    turned_off = os.environ.get(RAY_PREEMPTION_WATCHER_ENV, "1").strip().lower() in ("0", "false")
    if not turned_off or os.environ.get(OWN_WATCHER_ENV) == "1":
        watcher = build_preemption_callback()
        if watcher is not None:
            os.environ[RAY_PREEMPTION_WATCHER_ENV] = "0"
            os.environ[OWN_WATCHER_ENV] = "1"
            callbacks.append(watcher)
    return [c for c in callbacks if c is not None]


class NodeWatcher:
    """A daemon thread on the driver; `stop()` ends it."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.changes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eft-node-watcher", daemon=True)

    def start(self) -> "NodeWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            known = live_node_ids()
        except Exception as err:
            log.debug("node watcher not started: %s", err)
            return
        while not self._stop.wait(self.interval_s):
            try:
                now = live_node_ids()
            except Exception as err:  # the GCS may be briefly unreachable; try again next tick
                log.debug("node watcher: no node list this tick (%s: %s)", type(err).__name__, err)
                continue
            if now != known:
                log.info("cluster nodes changed (%d → %d live); refreshing Ray Train's view",
                         len(known), len(now))
                known = now
                self.changes += 1
                refresh_autoscaling_view()
