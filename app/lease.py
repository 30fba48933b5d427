"""Leases: one holder of a storage prefix at a time, and fencing for a holder that lost it.

A lease is one JSON object (`_lease.json` under the prefix it guards). It is created with a
conditional PUT (If-None-Match: *), so of two takers started together exactly one wins; the
other fails in one line naming the holder and the expiry. The holder renews it (a PUT
conditional on the ETag it last wrote) every quarter of its lifetime; a crashed holder's lease
expires and the next taker takes it over, again by a conditional PUT on the expired lease's
ETag. On a local filesystem `Store.write_if` does the same under `flock`.

Every take raises the lease's **epoch** by one: the epoch is the holder's generation. A lease
that keeps its epoch across holders is released by marking it expired (`keep_epoch=True`, the
run lease) rather than deleted, so the next holder's epoch is always higher than any before it.

**Fencing.** A holder that stalls (a paused process, a partition) past its lease's lifetime may
wake up after someone else took the lease over. Whatever it still runs (Ray Train's workers
keep training while their driver is paused) carries a `Fence`: the lease's URI, the epoch and
the holder id it was started with. `Fence.check()` reads the lease right before a commit and
refuses unless it still names that holder and epoch. S3 has no write conditional on another
object, so this is a read just before the write: a takeover that lands between the two lets one
last write through, and every later one is refused. So the lease also keeps when each epoch
began, and whether it took the lease over from a holder that had not released it (`epochs`): a
reader can tell that a commit stamped with an older epoch landed after a newer one began, and
set it aside (app.elastic.checkpoint does, for checkpoints).

A store dates a commit to the second, so a commit that landed just before a takeover reads as
one that may have landed just after it, and is set aside too. A taker that knows the commits
(`seal`: the run lease's caller lists the complete checkpoints) lists them right before its
takeover's write and keeps each one's name and commit time with its epoch (`sealed`): those
landed before the epoch began, whatever the clocks say; one rewritten since has another time.
Without that, a holder whose workers went on committing every few hundred milliseconds until the
takeover could leave nothing usable (Ray Train keeps only the newest few checkpoints, and all of
them were within the second before).

Expiry times are wall-clock UTC: holders are assumed to keep NTP time, well within a lifetime.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable, NamedTuple, Optional

from app.storage import Store, join

log = logging.getLogger(__name__)

LEASE_NAME = "_lease.json"
LEASE_TTL_S = 120.0
# The start times of this many epochs are kept in the lease: a run restarts its driver a few
# times, not hundreds; a commit from an epoch older than those is judged by the oldest kept.
EPOCHS_KEPT = 256


class LeaseError(RuntimeError):
    """A prefix is held by someone else, or the lease was lost: one line naming it and the holder."""


class LeaseUnread(RuntimeError):
    """The lease could not be read within a bound: neither held nor lost, as far as anyone knows."""


def lease_uri(prefix_uri: str) -> str:
    return join(prefix_uri, LEASE_NAME)


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def build_owner(role: str, **extra) -> dict:
    """Who holds a lease: a fresh id (the only thing compared) and where it runs (for people)."""
    return {"id": uuid.uuid4().hex, "role": role, "host": socket.gethostname(), "pid": os.getpid(),
            "started_at": now().isoformat(timespec="seconds"), **extra}


def describe_owner(owner: dict) -> str:
    what = owner.get("run_uri") or owner.get("role", "?")
    since = f", since {owner['started_at']}" if owner.get("started_at") else ""
    return f"{what} (pid {owner.get('pid', '?')} on {owner.get('host', '?')}{since})"


def lease_body(owner: dict, ttl_s: float, epoch: int, created_at: Optional[str] = None,
               released: bool = False, epochs: Optional[dict] = None) -> bytes:
    """`epochs`: {epoch (a string, as JSON keys are): {"started_at", "took_over"[, "sealed"]}},
    this one's included (see `carry_epochs`)."""
    start = now()
    expires = start if released else start + dt.timedelta(seconds=ttl_s)
    return json.dumps({"owner": owner, "epoch": epoch, "created_at": created_at or start.isoformat(),
                       "renewed_at": start.isoformat(), "expires_at": expires.isoformat(),
                       "released": released, "epochs": epochs or {}}, indent=2).encode()


class EpochStart(NamedTuple):
    began: float  # epoch seconds
    took_over: bool  # from a holder that had not released the lease, so it may still be committing
    sealed: dict  # {name: commit time} of the commits complete right before this epoch's write


def list_epochs(lease: Optional[dict]) -> dict[int, EpochStart]:
    """{epoch: EpochStart} of a lease. A lease written before epochs were kept gives its current
    epoch alone, from `created_at`, counted as a takeover (the cautious reading)."""
    if not lease:
        return {}
    epochs = {}
    for epoch, entry in (lease.get("epochs") or {}).items():
        try:
            sealed = entry.get("sealed") or {}
            epochs[int(epoch)] = EpochStart(dt.datetime.fromisoformat(entry["started_at"]).timestamp(),
                                            bool(entry.get("took_over", True)),
                                            {str(k): v for k, v in sealed.items()} if isinstance(sealed, dict) else {})
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # a foreign entry: judged by the others
    try:
        current = dt.datetime.fromisoformat(lease["created_at"]).timestamp()
        epochs.setdefault(int(lease.get("epoch", 0)), EpochStart(current, True, {}))
    except (KeyError, TypeError, ValueError):
        pass
    return epochs


def carry_epochs(held: Optional[dict], current: bool, epoch: int, started_at: str,
                 sealed: Optional[dict] = None) -> dict:
    """The epochs a new holder writes: those the lease it takes (`held`; `current`: whether
    there was an object at all) kept, its holder's own from `created_at` if it kept none, then
    this one, the newest EPOCHS_KEPT of them. `took_over`: the lease was there and not released
    (expired, or unreadable), so its holder may still be committing. `sealed`: the commits the
    taker saw complete before its write (kept only for a takeover: a release fences nothing)."""
    epochs: dict[int, dict] = {}
    if held:
        epochs.update({int(k): v for k, v in (held.get("epochs") or {}).items() if str(k).isdigit()})
        if held.get("created_at"):
            epochs.setdefault(int(held.get("epoch", 0)), {"started_at": held["created_at"], "took_over": True})
    took_over = current and not (held and held.get("released"))
    epochs[epoch] = {"started_at": started_at, "took_over": took_over}
    if took_over and sealed:
        epochs[epoch]["sealed"] = dict(sorted(sealed.items()))
    return {str(k): epochs[k] for k in sorted(epochs)[-EPOCHS_KEPT:]}


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
    return lease is not None and not lease.get("released") and \
        dt.datetime.fromisoformat(lease["expires_at"]) > now()


def read_lease(store: Store, uri: str, patient: bool = False) -> Optional[dict]:
    """The lease object at `uri` (parsed), or None if there is none or it is unreadable.
    `patient`: with the store's full retry budget (see `Store.read_versioned`)."""
    current = store.read_versioned(uri, patient=patient)
    return parse_lease(current[0]) if current else None


class Lease:
    """One held lease object. `start()` takes it, a thread renews it, `stop()` releases it.
    `keep_epoch`: release by marking it expired (the epoch survives for the next holder) rather
    than deleting it. `seal`: {name: commit time} of the commits complete under the prefix;
    called right before a takeover's write, its answer kept with the new epoch (see the module's
    docstring)."""

    def __init__(self, store: Store, uri: str, owner: dict, label: str, ttl_s: float = LEASE_TTL_S,
                 keep_epoch: bool = False, seal: Optional[Callable[[], dict]] = None):
        self.store, self.uri, self.owner, self.label, self.ttl_s = store, uri, owner, label, ttl_s
        self.keep_epoch, self.seal = keep_epoch, seal
        self._lock = threading.Lock()  # the renewing thread and a pre-commit check
        self.version: Optional[str] = None
        self.created_at: Optional[str] = None
        self.epoch = 0
        self.lost: Optional[str] = None
        # time.monotonic() when the last write that held the lease was built: its expiry is
        # counted from there, so a write that took long (retried, a slow store) is not counted
        # as renewed any later than the expiry it wrote.
        self.renewed_at = 0.0
        self.epochs: dict = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- taking and keeping it ---------------------------------------------------------
    def take(self) -> None:
        """Create the lease, or take over an expired or released one; LeaseError while another holds it."""
        for _ in range(3):
            current = self.store.read_versioned(self.uri)
            held = parse_lease(current[0]) if current else None
            if is_live(held) and held["owner"]["id"] != self.owner["id"]:
                raise LeaseError(f"{self.label}: held by {describe_owner(held['owner'])} until {held['expires_at']}, "
                                 f"epoch {held.get('epoch', 0)} (lease {self.uri}; wait for it to finish, or for "
                                 f"the lease to expire)")
            if current is not None and not (held and held.get("released")):
                log.warning("lease: taking over %s from %s (expired %s)", self.uri,
                            describe_owner(held["owner"]) if held else "an unreadable lease",
                            held["expires_at"] if held else "?")
            epoch = int(held.get("epoch", 0)) + 1 if held else 1
            # Listed before the epoch's start is stamped: a commit that lands after the listing
            # is judged by the clocks, with their slack.
            sealed = self._list_sealed() if current is not None and not (held and held.get("released")) else None
            started, taken_at = time.monotonic(), now().isoformat()
            epochs = carry_epochs(held, current is not None, epoch, taken_at, sealed=sealed)
            body = lease_body(self.owner, self.ttl_s, epoch, created_at=taken_at, epochs=epochs)
            version = self.store.write_if(self.uri, body, current[1] if current else None)
            if version is None:
                version = self._mine_after_retry()
            if version is not None:
                self.version, self.created_at, self.epoch = version, taken_at, epoch
                self.epochs, self.renewed_at = epochs, started
                return
        raise LeaseError(f"{self.label}: could not take the lease {self.uri} (other writers keep taking it)")

    def _list_sealed(self) -> Optional[dict]:
        if self.seal is None:
            return None
        try:
            return self.seal()
        except Exception as err:  # nothing sealed: the clocks judge, as without a seal
            log.warning("lease: could not list the commits under %s before taking it over (%s: %s); commits "
                        "just before the takeover will be set aside", self.uri, type(err).__name__, err)
            return None

    def wait_and_take(self, wait_s: float, poll_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> None:
        """`take()`, retried while another holds the lease, for at most `wait_s` seconds."""
        deadline, said = clock() + wait_s, False
        while True:
            try:
                return self.take()
            except LeaseError as err:
                if clock() >= deadline:
                    raise LeaseError(f"{err} [waited {wait_s:.0f} s]") from None
                if not said:
                    log.warning("waiting for the lease (at most %.0f s): %s", wait_s, err)
                    said = True
                sleep(min(poll_s, max(deadline - clock(), 0.0)))

    def _mine_after_retry(self) -> Optional[str]:
        """A conditional PUT retried after a lost response fails against our own first write."""
        current = self.store.read_versioned(self.uri)
        held = parse_lease(current[0]) if current else None
        return current[1] if held and held["owner"]["id"] == self.owner["id"] else None

    def renew(self) -> None:
        with self._lock:
            self._renew()

    def _renew(self, released: bool = False) -> None:
        if self.lost:
            raise LeaseError(self.lost)
        started = time.monotonic()  # before the body's expiry is stamped, never after the write
        body = lease_body(self.owner, self.ttl_s, self.epoch, self.created_at, released=released,
                          epochs=self.epochs)
        version = self.store.write_if(self.uri, body, self.version)
        if version is None:
            version = self._mine_after_retry()
        if version is None:
            held = read_lease(self.store, self.uri)
            self.lost = (f"{self.label}: lease {self.uri} lost to {describe_owner(held['owner'])}, epoch "
                         f"{held.get('epoch', 0)} (this holder's epoch was {self.epoch})" if held
                         else f"{self.label}: lease {self.uri} removed by someone else")
            raise LeaseError(self.lost)
        self.version, self.renewed_at = version, started

    def check(self, retry_s: float = 2.0) -> None:
        """Renew now; LeaseError if the lease was taken over (call it right before a commit). A
        store that does not answer is tried again for as long as the lease, by the holder's own
        clock, cannot have expired: a commit after an outage is safe until then, and not after."""
        while True:
            try:
                return self.renew()
            except LeaseError:
                raise
            except Exception as err:  # a storage blip (pyarrow or botocore)
                left_s = self.renewed_at + self.ttl_s - time.monotonic()
                if left_s <= retry_s:
                    raise LeaseError(f"{self.label}: could not renew lease {self.uri} before it expired "
                                     f"({type(err).__name__}: {err}); this holder commits nothing more") from None
                log.warning("lease: renewing %s failed (%s: %s); trying again for %.0f s more", self.uri,
                            type(err).__name__, err, left_s)
                time.sleep(retry_s)

    def fence(self) -> "Fence":
        """What the holder's workers carry to check the lease before their commits."""
        return Fence(self.uri, self.epoch, self.owner["id"], self.label)

    # -- its life in the background ----------------------------------------------------
    def start(self, wait_s: Optional[float] = None) -> "Lease":
        if wait_s:
            self.wait_and_take(wait_s)
        else:
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

    def stop(self, discard: bool = False) -> None:
        """Stop renewing and release the lease if it is still ours. `discard`: the holder wrote
        nothing under it (it failed before it started), so a lease it created (epoch 1) goes
        altogether rather than staying behind as the only object of a run that never ran."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.version is None or self.lost:
            return
        version, self.version = self.version, None  # a second stop() is a no-op
        try:
            if discard and self.epoch == 1:
                self.store.delete_if(self.uri, version)
            elif self.keep_epoch:
                self.version = version
                with self._lock:
                    self._renew(released=True)
                self.version = None
            else:
                self.store.delete_if(self.uri, version)
        except Exception as err:  # it expires on its own
            log.warning("lease: releasing %s failed (%s: %s); it expires within %.0f s", self.uri,
                        type(err).__name__, err, self.ttl_s)

    def __enter__(self) -> "Lease":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Fence:
    """A lease holder's generation, carried by what it runs elsewhere (Ray Train's workers and
    controller): `check()` before a commit raises LeaseError once the lease names another holder
    or epoch. A lease that expired without a new holder is still ours: nobody else writes."""

    def __init__(self, uri: str, epoch: int, owner_id: str, label: str):
        self.uri, self.epoch, self.owner_id, self.label = uri, epoch, owner_id, label

    def to_dict(self) -> dict:
        return {"uri": self.uri, "epoch": self.epoch, "owner_id": self.owner_id, "label": self.label}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> Optional["Fence"]:
        return cls(d["uri"], int(d["epoch"]), d["owner_id"], d["label"]) if d else None

    def check(self, store: Store, timeout_s: Optional[float] = None) -> None:
        """LeaseError once the lease names another holder or epoch. `timeout_s`: give up waiting
        for storage after that long with LeaseUnread (the read goes on in the background and its
        answer is dropped), for a caller that must not stall on an outage (Ray Train's
        controller); without it the read takes the store's whole retry budget."""
        if timeout_s is None:
            # Patient: an outage that the commit after this check would ride out must not end
            # the worker here first (a 20 s one did, with a 5-attempt read).
            return self._judge(read_lease(store, self.uri, patient=True))
        answer: dict = {}

        def read() -> None:
            try:
                answer["lease"] = read_lease(store, self.uri, patient=True)
            except Exception as err:  # handed to the caller below, if it still waits
                answer["error"] = err

        reader = threading.Thread(target=read, name=f"eft-fence {self.uri}", daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            raise LeaseUnread(f"{self.label}: lease {self.uri} not read within {timeout_s:.0f} s (storage slow or "
                              f"away)")
        if "error" in answer:
            raise answer["error"]
        self._judge(answer["lease"])

    def _judge(self, held: Optional[dict]) -> None:
        if held is not None and held["owner"]["id"] == self.owner_id and int(held.get("epoch", 0)) == self.epoch:
            return
        to = (f"{describe_owner(held['owner'])}, epoch {held.get('epoch', 0)}" if held
              else "nobody (the lease was removed)")
        raise LeaseError(f"{self.label}: lease lost to {to}; this holder (epoch {self.epoch}) commits nothing more")


# -- the run's own lease ---------------------------------------------------------------------

def build_run_lease(store: Store, run_uri: str, ttl_s: float = LEASE_TTL_S,
                    seal: Optional[Callable[[], dict]] = None) -> Lease:
    """One writer per run: `eft train` holds `<run>/_lease.json` from before Ray starts to after
    the summary. Its epoch survives release, so every driver of a run has a higher one than the
    drivers before it. `seal`: lists the run's complete checkpoints (see `Lease`)."""
    # "run", not "run_uri": the line names the run once, and the holder as the command it is.
    return Lease(store, lease_uri(run_uri), build_owner("eft train", run=run_uri), label=f"run {run_uri}",
                 ttl_s=ttl_s, keep_epoch=True, seal=seal)


def describe_run_lease(store: Store, run_uri: str) -> Optional[dict]:
    """For `eft status`: the run lease's holder, epoch and expiry while it is live, else None."""
    held = read_lease(store, lease_uri(run_uri))
    if not is_live(held):
        return None
    owner = held["owner"]
    return {"holder": describe_owner(owner), "host": owner.get("host"), "pid": owner.get("pid"),
            "started_at": owner.get("started_at"), "epoch": held.get("epoch", 0), "expires_at": held["expires_at"]}
