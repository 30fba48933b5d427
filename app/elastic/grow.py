"""Grow without losing work: a checkpoint at the next step boundary before Ray Train restarts
the worker group bigger.

Ray Train V2 grows an elastic run by shutting the group down and starting a bigger one, which
resumes from the latest checkpoint: up to `checkpoint.save_every_steps` steps are done again.
Its controller calls `before_controller_execute_resize_decision` first (app/elastic/controller.py).
There the driver side (`checkpoint_before_grow`) writes a request object under the run and
waits, bounded, for the workers to answer it. The worker side (`GrowRequests`) watches for it:
rank 0 polls storage on a thread, and every step one broadcast from rank 0 hands all ranks the
same answer, so they save together at the same step. After the save the group stops stepping
until Ray tears it down: nothing done before the grow is thrown away.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable, Optional

from app.storage import Store, join

log = logging.getLogger("eft.grow")

REQUEST_FILE = "control/checkpoint-request.json"


def done_uri(run_uri: str, request_id: str) -> str:
    return join(run_uri, "control", f"checkpoint-done-{request_id}.json")


def checkpoint_before_grow(store: Store, run_uri: str, from_workers: int, to_workers: int, timeout_s: float,
                           record: Callable[..., None], poll_s: float = 0.25) -> dict:
    """Driver side: ask the running group for a checkpoint and wait until it is up (or
    `timeout_s` passes: the grow then goes ahead from the latest checkpoint, as before)."""
    request_id, started = uuid.uuid4().hex[:12], time.monotonic()
    request_uri = join(run_uri, REQUEST_FILE)
    store.write_json(request_uri, {"id": request_id, "time": time.time(), "from_workers": from_workers,
                                   "to_workers": to_workers})
    done = None
    try:
        while time.monotonic() - started < timeout_s:
            if store.exists(done_uri(run_uri, request_id)):
                done = store.read_json(done_uri(run_uri, request_id))
                break
            time.sleep(poll_s)
    finally:
        store.delete_prefix(request_uri)
    result = {"request": request_id, "from_workers": from_workers, "to_workers": to_workers,
              "waited_s": round(time.monotonic() - started, 2), "step": done["step"] if done else None}
    if done is None:
        log.warning("grow %d → %d: no checkpoint within %.0f s; growing from the latest one", from_workers,
                    to_workers, timeout_s)
    record("grow_checkpoint" if done else "grow_checkpoint_timeout", **result)
    return result


class GrowRequests:
    """Worker side, on every rank of an elastic run. `broadcast` hands every rank rank 0's value
    (a barrier, like Ray's pre-emption check); `sleep` is injected for tests."""

    def __init__(self, store: Store, run_uri: str, rank: int, broadcast: Callable, poll_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.store, self.run_uri, self.rank, self.broadcast, self.sleep = store, run_uri, rank, broadcast, sleep
        self.served: set = set()
        self._latest: Optional[dict] = None
        self._stop = threading.Event()
        self._thread = None
        if rank == 0:
            self._thread = threading.Thread(target=self._poll, args=(poll_s,), name="eft-grow-requests",
                                            daemon=True)
            self._thread.start()

    def _poll(self, poll_s: float) -> None:
        uri = join(self.run_uri, REQUEST_FILE)
        while not self._stop.wait(poll_s):
            try:
                request = self.store.read_json(uri) if self.store.exists(uri) else None
                # A request already answered (by this group, or one before a restart) stays
                # answered: its done object outlives the group.
                if request and (request["id"] in self.served or
                                self.store.exists(done_uri(self.run_uri, request["id"]))):
                    request = None
                self._latest = request
            except Exception as err:  # storage trouble: the grow just costs the old recompute
                log.debug("grow request poll: %s", err)

    def after_step(self, step: int) -> Optional[dict]:
        """Every rank, every step: the request to save for now, the same on every rank, or None."""
        mine = self._latest if self.rank == 0 else None
        request = self.broadcast(mine)
        if request is None or request["id"] in self.served:
            return None
        self.served.add(request["id"])
        return request

    def acknowledge_when_up(self, request: dict, step: int, timeout_s: float, poll_s: float = 0.25) -> None:
        """Rank 0: tell the driver once this step's checkpoint is complete in storage, from a
        thread started before the save. The save's report to Ray can block (Ray's result queue
        holds one report, and the controller drains it only after the grow callback returns),
        but the checkpoint is whole in storage before that, and the restart resumes from it."""
        if self.rank != 0:
            return
        from app.elastic.checkpoint import checkpoint_dir_name, is_complete

        self._latest = None
        ckpt_uri = join(self.run_uri, checkpoint_dir_name(step))

        def wait_then_tell() -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    if is_complete(self.store, ckpt_uri):
                        self.store.write_json(done_uri(self.run_uri, request["id"]),
                                              {"id": request["id"], "step": step, "time": time.time()})
                        log.info("grow %s → %s workers: checkpoint at step %d is up; waiting for the restart",
                                 request.get("from_workers"), request.get("to_workers"), step)
                        return
                except Exception as err:  # storage trouble: the driver's wait is bounded
                    log.debug("grow checkpoint check: %s", err)
                time.sleep(poll_s)

        threading.Thread(target=wait_then_tell, name="eft-grow-ack", daemon=True).start()

    def drain(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Take no step until Ray tears the group down; past `timeout_s` (the driver gave up,
        or the grow did not happen) training goes on."""
        waited = 0.0
        while waited < timeout_s:
            self.sleep(poll_s)
            waited += poll_s
        log.warning("grow requested but the group was not restarted within %.0f s; training on", timeout_s)

    def stop(self) -> None:
        self._stop.set()


def build_grow_requests(store: Store, run_uri: str, rank: int) -> GrowRequests:
    import ray.train.collective

    return GrowRequests(store, run_uri, rank, broadcast=ray.train.collective.broadcast_from_rank_zero)
