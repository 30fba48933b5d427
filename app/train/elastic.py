"""Driver-side help for elastic runs: tell Ray Train about node changes as soon as they happen.

Ray Train V2's elastic policy sizes a (re)started worker group from the resources reserved
for it by Ray Data's AutoscalingCoordinator, and that actor refreshes its view of the
cluster's nodes on a 20 s tick. After a node is lost, Train can therefore retry the old
size, wait out `worker_group_start_timeout_s` for a worker that cannot be placed, and only
then settle for fewer; a returning node likewise goes unseen for up to a tick. Two fixes:
* a controller callback asks the coordinator to recompute right before Train acts on a
  failure, so the restart is sized on the nodes alive now (shrinking after a loss);
* a driver thread polls the GCS node table (cheap) and asks for a recompute when the set of
  live nodes changes, so a returning node is seen at Train's next resize check (growing).
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("eft.elastic")
COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # (name, namespace) in Ray 2.60


def live_node_ids() -> frozenset:
    import ray

    return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def refresh_autoscaling_view(timeout_s: float = 10.0) -> bool:
    """Make the coordinator re-read the cluster now. False when there is none (yet), or this
    Ray has no such actor: then Train simply keeps its own pace."""
    import ray

    name, namespace = COORDINATOR
    try:
        coordinator = ray.get_actor(name, namespace=namespace)
        ray.get(coordinator.get_reserved_resources.remote("eft-node-watcher", recompute=True), timeout=timeout_s)
        return True
    except Exception as err:  # an internal of Ray's: never let it break a training run
        log.debug("could not refresh the autoscaling coordinator: %s", err)
        return False


def build_refresh_callback():
    """A Ray Train controller callback (a developer API of Ray Train V2), or None if this Ray
    has no such hook."""
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback
    except ImportError:
        return None

    class RefreshBeforeRestart(ControllerCallback):
        def before_controller_execute_failure_decision(self, failure_decision) -> None:
            refresh_autoscaling_view()

    return RefreshBeforeRestart()


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
            except Exception:  # the GCS may be briefly unreachable; try again next tick
                continue
            if now != known:
                log.info("cluster nodes changed (%d → %d live); refreshing Ray Train's view",
                         len(known), len(now))
                known = now
                self.changes += 1
                refresh_autoscaling_view()
