"""Leases on a dataset prefix: who may write it, and who is reading it (the lease itself:
app.lease).

`eft prepare` holds `<data.uri>/_lease.json` while it runs: one writer at a time. Of two prepares
started together exactly one wins; the other fails in one line naming the URI, the owner and the
expiry. A crashed holder's lease expires and the next prepare takes it over. A holder that finds
its lease taken over stops before it commits.

A training run holds a reader lease, `<data.uri>/_readers/<id>.json`, renewed the same way for as
long as its driver runs. A prepare that would replace a committed dataset refuses while a live
reader holds one, since it would delete the shards that run streams from.
"""

from __future__ import annotations

import logging

from app.lease import Lease, LeaseError, build_owner, describe_owner, is_live, lease_uri, parse_lease
from app.storage import Store, join

log = logging.getLogger(__name__)

READERS_DIR = "_readers"

__all__ = ["Lease", "LeaseError", "READERS_DIR", "build_owner", "check_no_live_readers", "check_not_being_prepared",
           "hold_prepare_lease", "hold_reader_lease", "lease_uri", "live_readers"]


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
