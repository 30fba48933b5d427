"""A run's records beside its checkpoints and metrics: events (`<run>/events/`, one object
each: what happened and when) and heartbeats (`<run>/heartbeats/<attempt>.json`: how far each
worker-group attempt got). The summary's interruption accounting and `eft status` read them."""

from __future__ import annotations

import logging
import threading
import time
import uuid

from app.storage import Store, StorageError, join

log = logging.getLogger("eft.records")


def record_event(store: Store, run_uri: str, kind: str, wait_s: float = 10.0, **fields) -> str:
    """One object per event (S3 has no append): `<run>/events/<time>-<id>.json`. Returns the id.
    Events are the run's diary, not its state: a write storage refuses (past the store's own
    retries) is a warning, never an error that stops the group; and the caller waits at most
    `wait_s` for it, the write going on in the background after that, so an outage never holds
    up the pre-emption path, where rank 0 records the notice before the just-in-time checkpoint."""
    now = time.time()
    event_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:8]}"
    uri = join(run_uri, "events", f"{event_id}.json")

    def write() -> None:
        try:
            store.write_json(uri, {"kind": kind, "time": now, "id": event_id, **fields})
        except Exception as err:  # on its own thread: nothing above it to catch it
            log.warning("event %s not recorded at %s (%s: %s); going on", kind, uri, type(err).__name__, err)

    writer = threading.Thread(target=write, name="eft-event", daemon=True)
    writer.start()
    writer.join(wait_s)
    if writer.is_alive():
        log.warning("event %s: storage has not taken %s after %.0f s; still trying in the background",
                    kind, uri, wait_s)
    return event_id


def load_events(store: Store, run_uri: str) -> list[dict]:
    events = [store.read_json(join(run_uri, "events", f)) for f in store.list_files(join(run_uri, "events"))]
    return sorted(events, key=lambda e: e["time"])


class Heartbeat:
    """Rank 0's progress marker for one worker-group attempt: `<run>/heartbeats/<attempt>.json`
    with the first and the last step it reached and when. Interruption accounting (steps
    recomputed, seconds to recover) is read from these. Written at most every `interval_s`, on a
    background thread: the other ranks wait at the next collective for whatever rank 0 does in
    the step, so a storage round trip here would slow every rank."""

    def __init__(self, store: Store, run_uri: str, attempt: str, enabled: bool, interval_s: float = 1.0, **fields):
        from app.observe.sinks import BackgroundWriter

        self.store, self.enabled, self.interval_s = store, enabled, interval_s
        self.uri = join(run_uri, "heartbeats", f"{attempt}.json")
        self.state = {"attempt": attempt, "started_at": time.time(), "first_batch_at": None, "first_step": None,
                      "first_step_at": None, "last_step": None, "last_step_at": None, **fields}
        self._written = 0.0
        self._writer = BackgroundWriter("heartbeat write") if enabled else None

    def mark_first_batch(self) -> None:
        """When this start's first batch was in hand: the end of a restart's data phase."""
        if self.enabled and self.state["first_batch_at"] is None:
            self.state["first_batch_at"] = time.time()

    def beat(self, step: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self.state["first_step"] is None:
            self.state.update(first_step=step, first_step_at=now)
            force = True
        self.state.update(last_step=step, last_step_at=now)
        if force or now - self._written >= self.interval_s:
            snapshot = dict(self.state)
            self._writer.submit(self.uri, lambda: self.store.write_json(self.uri, snapshot))
            self._written = now

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the last heartbeat write; on a timeout, a warning (a heartbeat is advisory)."""
        if self._writer is None or self._writer.drain(timeout_s):
            return True
        log.warning("heartbeat %s still not written after %.0f s; going on without it", self.uri, timeout_s)
        return False


def load_heartbeats(store: Store, run_uri: str) -> list[dict]:
    """Read while the run writes them: one caught mid-overwrite is skipped, not fatal."""
    root = join(run_uri, "heartbeats")
    beats = []
    for name in store.list_files(root):
        try:
            beats.append(store.read_json(join(root, name)))
        except StorageError:
            continue
    return sorted(beats, key=lambda b: b["started_at"])


def record_weights_loaded(store: Store, cfg, rank: int, bytes_read: int, seconds: float,
                          bytes_cached: int = 0) -> None:
    """Gather what each rank read from storage and from its node's cache (and on which node) to
    rank 0, which records one `weights_loaded` event: bytes read per node are what `eft report`
    and the tests check."""
    import ray
    import torch.distributed as dist

    from app.model.weights import describe_stored_weights

    mine = {"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "bytes_read": int(bytes_read),
            "bytes_cached": int(bytes_cached), "seconds": round(seconds, 3)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank != 0:
        return
    per_node: dict[str, int] = {}
    cached_per_node: dict[str, int] = {}
    for entry in ranks:
        per_node[entry["node_id"]] = per_node.get(entry["node_id"], 0) + entry["bytes_read"]
        cached_per_node[entry["node_id"]] = cached_per_node.get(entry["node_id"], 0) + entry["bytes_cached"]
    mode, weights = describe_stored_weights(store, cfg.model.uri, cfg.training.parallelism)
    record_event(store, cfg.run_uri, "weights_loaded", mode=mode,
                 model_uri=cfg.model.uri, weights_bytes=weights, bytes_per_node=per_node,
                 cached_per_node=cached_per_node, ranks=ranks,
                 seconds=max(r["seconds"] for r in ranks))
