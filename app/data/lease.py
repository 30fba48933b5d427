"""Leases on a dataset prefix: who may write it, and who is reading it.

`eft prepare` holds `<data.uri>/_lease.json` while it runs: one writer at a time. The lease is
created with a conditional PUT (If-None-Match: *), so of two prepares started together exactly
one wins; the other fails in one line naming the URI, the owner and the expiry. The holder renews
it (a PUT conditional on the ETag it last wrote) every quarter of its lifetime and deletes it at
the end; a crashed holder's lease expires and the next prepare takes it over, again by a
conditional PUT on the expired lease's ETag. A holder that finds its lease taken over stops
before it commits.

A training run holds a reader lease, `<data.uri>/_readers/<id>.json`, renewed the same way for as
long as its driver runs. A prepare that would replace a committed dataset refuses while a live
reader holds one, since it would delete the shards that run streams from.

Expiry times are wall-clock UTC: machines that share a dataset are assumed to keep NTP time,
well within the lifetime (LEASE_TTL_S).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import uuid
from typing import Optional

from app.storage import Store, join

log = logging.getLogger(__name__)

LEASE_NAME = "_lease.json"
READERS_DIR = "_readers"
LEASE_TTL_S = 120.0


class LeaseError(RuntimeError):
    """A dataset is held by someone else, reported as one line naming its URI and the holder."""


def lease_uri(data_uri: str) -> str:
    return join(data_uri, LEASE_NAME)


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def build_owner(role: str, **extra) -> dict:
    """Who holds a lease: a fresh id (the only thing compared) and where it runs (for people)."""
    return {"id": uuid.uuid4().hex, "role": role, "host": socket.gethostname(), "pid": os.getpid(), **extra}


def describe_owner(owner: dict) -> str:
    what = owner.get("run_uri") or owner.get("role", "?")
    return f"{what} (pid {owner.get('pid', '?')} on {owner.get('host', '?')})"


def lease_body(owner: dict, ttl_s: float, created_at: Optional[str] = None) -> bytes:
    start = now()
    return json.dumps({"owner": owner, "created_at": created_at or start.isoformat(),
                       "renewed_at": start.isoformat(),
                       "expires_at": (start + dt.timedelta(seconds=ttl_s)).isoformat()}, indent=2).encode()


def parse_lease(data: bytes) -> Optional[dict]:
    """A lease object, or None if it is not one (a torn or foreign object counts as expired)."""
    try:
        lease = json.loads(data)
        dt.datetime.fromisoformat(lease["expires_at"])
        lease["owner"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return lease


def is_live(lease: Optional[dict]) -> bool:
    return lease is not None and dt.datetime.fromisoformat(lease["expires_at"]) > now()


class Lease:
    """One held lease object. `start()` takes it, a thread renews it, `stop()` releases it."""

    def __init__(self, store: Store, uri: str, owner: dict, label: str, ttl_s: float = LEASE_TTL_S):
        self.store, self.uri, self.owner, self.label, self.ttl_s = store, uri, owner, label, ttl_s
        self._lock = threading.Lock()  # the renewing thread and a pre-commit check
        self.version: Optional[str] = None
        self.created_at: Optional[str] = None
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- taking and keeping it ---------------------------------------------------------
    def take(self) -> None:
        """Create the lease, or take over an expired one; LeaseError while another holds it."""
        for _ in range(3):
            current = self.store.read_versioned(self.uri)
            held = parse_lease(current[0]) if current else None
            if is_live(held) and held["owner"]["id"] != self.owner["id"]:
                raise LeaseError(f"{self.label}: held by {describe_owner(held['owner'])} until {held['expires_at']} "
                                 f"(lease {self.uri}; wait for it to finish, or for the lease to expire)")
            if current is not None:
                log.warning("lease: taking over %s from %s (expired %s)", self.uri,
                            describe_owner(held["owner"]) if held else "an unreadable lease",
                            held["expires_at"] if held else "?")
            body = lease_body(self.owner, self.ttl_s)
            version = self.store.write_if(self.uri, body, current[1] if current else None)
            if version is None:
                version = self._mine_after_retry()
            if version is not None:
                self.version, self.created_at = version, json.loads(body)["created_at"]
                return
        raise LeaseError(f"{self.label}: could not take the lease {self.uri} (other writers keep taking it)")

    def _mine_after_retry(self) -> Optional[str]:
        """A conditional PUT retried after a lost response fails against our own first write."""
        current = self.store.read_versioned(self.uri)
        held = parse_lease(current[0]) if current else None
        return current[1] if held and held["owner"]["id"] == self.owner["id"] else None

    def renew(self) -> None:
        with self._lock:
            self._renew()

    def _renew(self) -> None:
        if self.lost:
            raise LeaseError(self.lost)
        version = self.store.write_if(self.uri, lease_body(self.owner, self.ttl_s, self.created_at), self.version)
        if version is None:
            version = self._mine_after_retry()
        if version is None:
            current = self.store.read_versioned(self.uri)
            held = parse_lease(current[0]) if current else None
            self.lost = (f"{self.label}: lease {self.uri} lost to {describe_owner(held['owner'])}" if held
                         else f"{self.label}: lease {self.uri} removed by someone else")
            raise LeaseError(self.lost)
        self.version = version

    def check(self) -> None:
        """Renew now; LeaseError if the lease was taken over (call it right before a commit)."""
        self.renew()

    # -- its life in the background ----------------------------------------------------
    def start(self) -> "Lease":
        self.take()
        self._thread = threading.Thread(target=self._keep, name=f"lease {self.uri}", daemon=True)
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseError as err:
                log.warning("lease: %s", err)
                return
            except Exception as err:  # a storage blip (pyarrow or botocore): the next renewal may pass
                log.warning("lease: renewing %s failed (%s: %s); retrying", self.uri, type(err).__name__, err)

    def stop(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.version is not None and not self.lost:
            try:
                self.store.delete_if(self.uri, self.version)
            except Exception as err:  # it expires on its own
                log.warning("lease: releasing %s failed (%s: %s); it expires within %.0f s", self.uri,
                            type(err).__name__, err, self.ttl_s)

    def __enter__(self) -> "Lease":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the two kinds -------------------------------------------------------------------------

def hold_prepare_lease(store: Store, data_uri: str) -> Lease:
    """The writer's lease on a dataset prefix; use as a context manager."""
    return Lease(store, lease_uri(data_uri), build_owner("prepare"), label=f"dataset {data_uri}")


def hold_reader_lease(store: Store, data_uri: str, run_uri: str) -> Lease:
    """A run's lease as a reader of the dataset (one object per driver). Taken after checking
    that no prepare holds the writer's lease; the prepare checks the readers after taking its
    own, so of a run and a prepare starting together at least one sees the other."""
    owner = build_owner("train", run_uri=run_uri)
    lease = Lease(store, join(data_uri, READERS_DIR, f"{owner['id']}.json"), owner,
                  label=f"reader of dataset {data_uri}")
    try:
        lease.start()
    except LeaseError:
        raise
    except Exception as err:  # a read-only dataset bucket: train anyway, unguarded
        log.warning("dataset %s: cannot record this run as a reader (%s: %s); a prepare with "
                    "prepare.overwrite could replace it under the run", data_uri, type(err).__name__, err)
        return lease
    try:
        check_not_being_prepared(store, data_uri)
    except LeaseError:
        lease.stop()
        raise
    return lease


def check_not_being_prepared(store: Store, data_uri: str) -> None:
    """LeaseError while a prepare holds the dataset's writer lease."""
    try:
        current = store.read_versioned(lease_uri(data_uri))
    except Exception as err:  # read-only access without ListBucket answers 403 for an absent key
        log.warning("dataset %s: cannot read its writer lease (%s); not checking for a prepare in progress",
                    data_uri, type(err).__name__)
        return
    held = parse_lease(current[0]) if current else None
    if is_live(held):
        raise LeaseError(f"{data_uri}: being prepared by {describe_owner(held['owner'])} (lease until "
                         f"{held['expires_at']}); train once it has committed")


def live_readers(store: Store, data_uri: str) -> list[dict]:
    """The reader leases still live; expired ones (a driver that died) are deleted."""
    readers = []
    root = join(data_uri, READERS_DIR)
    for name in store.list_files(root, recursive=False):
        if not name.endswith(".json"):  # a local filesystem's lock file
            continue
        uri = join(root, name)
        current = store.read_versioned(uri)
        held = parse_lease(current[0]) if current else None
        if is_live(held):
            readers.append(held)
        elif current is not None:
            store.delete_if(uri, current[1])
    return readers


def check_no_live_readers(store: Store, data_uri: str) -> None:
    """Before a prepare replaces a committed dataset: no live run may be streaming its shards."""
    readers = live_readers(store, data_uri)
    if readers:
        first = readers[0]
        more = f" and {len(readers) - 1} more" if len(readers) > 1 else ""
        raise LeaseError(f"{data_uri}: read by the live run {describe_owner(first['owner'])}{more} (reader lease until "
                         f"{first['expires_at']}); overwriting would delete the shards it streams, so wait for it to "
                         f"end or prepare into a new data.uri")
