"""The run lease (app.lease) on both storage kinds, S3 (moto's server: conditional PUTs with
If-None-Match / If-Match) and a local directory (flock): one driver per run, epochs that only go
up, a wait bounded in time, fencing of a holder that lost the run, and a summary that says two
drivers overlapped rather than inventing a restart. No Ray: the drivers' side runs through
`eft train` in tests/test_train.py."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from app.lease import Fence, LeaseError, build_run_lease, describe_run_lease, read_lease
from app.observe.summary import build_interruptions, build_overlaps
from app.storage import Store, join


@pytest.fixture(params=["s3", "local"])
def run_uri(request, tmp_path):
    if request.param == "s3":
        request.getfixturevalue("s3")
        return f"s3://eft/runs-lease/{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "runs" / "leased")


def test_one_driver_per_run_and_the_epoch_only_goes_up(run_uri):
    store = Store()
    first = build_run_lease(store, run_uri).start()
    assert first.epoch == 1
    second = build_run_lease(store, run_uri)
    with pytest.raises(LeaseError) as refused:
        second.start()
    held = read_lease(store, join(run_uri, "_lease.json"))
    owner = first.owner
    # One line: the run, the holder (host, pid, start time), the expiry and the epoch.
    assert str(refused.value) == (
        f"run {run_uri}: held by eft train (pid {owner['pid']} on {owner['host']}, since {owner['started_at']}) "
        f"until {held['expires_at']}, epoch 1 (lease {join(run_uri, '_lease.json')}; wait for it to finish, "
        f"or for the lease to expire)")
    assert describe_run_lease(store, run_uri)["epoch"] == 1
    first.stop()
    # Released, not deleted: the epoch survives for the next driver, and nobody holds the run.
    released = read_lease(store, join(run_uri, "_lease.json"))
    assert released["released"] and released["epoch"] == 1 and describe_run_lease(store, run_uri) is None
    second.start()
    assert second.epoch == 2 and read_lease(store, join(run_uri, "_lease.json"))["owner"] == second.owner
    second.stop()


def test_a_dead_drivers_lease_is_waited_for_and_taken_over_with_the_next_epoch(run_uri):
    store = Store()
    dead = build_run_lease(store, run_uri, ttl_s=1.5)
    dead.take()  # taken and never renewed: its driver died
    waiting = build_run_lease(store, run_uri)
    with pytest.raises(LeaseError, match=r"held by .* \[waited 0 s\]$"):
        waiting.wait_and_take(0.2, poll_s=0.05)
    waiting.start(wait_s=30)
    assert waiting.epoch == 2
    # The dead driver's workers, still running somewhere, are fenced out; the new ones are not.
    with pytest.raises(LeaseError, match=rf"^run {run_uri}: lease lost to eft train \(pid \d+ on .*\), epoch 2; "
                                         r"this holder \(epoch 1\) commits nothing more$"):
        dead.fence().check(store)
    waiting.fence().check(store)
    # Its driver too, if it wakes up: a renewal is a PUT conditional on what it last wrote.
    with pytest.raises(LeaseError, match=r"lost to .*, epoch 2 \(this holder's epoch was 1\)"):
        dead.check()
    dead.stop()  # must not release the new holder's lease
    assert read_lease(store, join(run_uri, "_lease.json"))["owner"] == waiting.owner
    waiting.stop()


def test_an_expired_lease_nobody_took_is_still_its_holders(run_uri):
    """A driver paused past its lifetime with nobody waiting: its workers may still commit,
    since nobody else writes the run; it renews again when it wakes."""
    store = Store()
    slow = build_run_lease(store, run_uri, ttl_s=0.01)
    slow.take()
    fence = Fence.from_dict(json.loads(json.dumps(slow.fence().to_dict())))  # as the workers get it
    fence.check(store)
    slow.check()
    slow.stop()


def test_overlapping_attempts_are_said_not_counted_as_a_restart():
    """Two groups stepping at once (two drivers before the lease): no negative recovery."""
    events = [{"kind": "worker_group_start", "time": 100.0, "id": "a", "world_size": 2, "resumed_from_step": None},
              {"kind": "worker_group_start", "time": 108.0, "id": "b", "world_size": 2, "resumed_from_step": None}]
    beats = [{"attempt": "a", "first_step": 1, "first_step_at": 102.0, "last_step": 40, "last_step_at": 130.0},
             {"attempt": "b", "first_step": 1, "first_step_at": 110.0, "last_step": 40, "last_step_at": 138.0}]
    assert build_interruptions(events, beats) == []
    (overlap,) = build_overlaps(events, beats)
    assert overlap == {"attempts": ["a", "b"], "overlap_s": 20.0, "steps_before": [1, 40], "steps_after": [1, 40]}
    # One after the other, as a restart: counted, with a recovery that is never negative.
    beats[1].update(first_step_at=135.0, last_step_at=150.0)
    (restart,) = build_interruptions(events, beats)
    assert restart["recovery_s"] == 5.0 and build_overlaps(events, beats) == []


def test_the_lease_lifetime_is_a_config_key_with_a_floor():
    from app.config import ConfigError, build_config

    base = {"name": "x", "model": {"uri": "/m"}, "data": {"uri": "/d", "seq_len": 8},
            "storage": {"root_uri": "/r"}, "training": {"max_steps": 1}}
    assert build_config(base).fault_tolerance.run_lease_ttl_s == 120.0
    with pytest.raises(ConfigError, match=re.escape("fault_tolerance.run_lease_ttl_s")):
        build_config({**base, "fault_tolerance": {"run_lease_ttl_s": 1}})


def test_a_driver_that_never_started_leaves_no_lease_behind(run_uri):
    """Refused by the cluster (no token, say) after it took the lease: a new run's lease goes
    altogether; a run with history keeps its epoch."""
    store, uri = Store(), join(run_uri, "_lease.json")
    build_run_lease(store, run_uri).start().stop(discard=True)
    assert store.read_versioned(uri) is None
    build_run_lease(store, run_uri).start().stop()
    again = build_run_lease(store, run_uri).start()
    again.stop(discard=True)
    assert again.epoch == 2 and read_lease(store, uri)["released"] and read_lease(store, uri)["epoch"] == 2


def test_checks_before_a_commit_ride_out_an_outage_the_lease_outlives(s3):
    """Storage refuses every connection for 16 s, longer than a lease write's short budget
    (5 attempts, at most 15 s of backoff): a worker's fence check and the driver's check before
    its summary wait for the store, as the commit after them would; a driver whose lease
    expires during the outage commits nothing, whatever the store says afterwards."""
    import threading
    import time

    from app.dev.faults import TcpProxy

    run_uri = f"s3://eft/runs-lease/{uuid.uuid4().hex[:8]}"
    with TcpProxy(s3.endpoint) as proxy:
        store = Store(endpoint=proxy.endpoint)
        kept = build_run_lease(store, run_uri, ttl_s=60)
        kept.take()
        short = build_run_lease(store, f"{run_uri}-short", ttl_s=8)
        short.take()
        outcomes: dict = {}

        def attempt(name, check):
            started = time.monotonic()
            try:
                check()
                outcomes[name] = ("ok", time.monotonic() - started)
            except LeaseError as err:
                outcomes[name] = (str(err), time.monotonic() - started)

        checks = {"fence": lambda: kept.fence().check(store), "driver": kept.check, "expired": short.check}
        threads = [threading.Thread(target=attempt, args=item) for item in checks.items()]
        proxy.refuse_for(16)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert outcomes["fence"][0] == "ok" and outcomes["fence"][1] >= 15, outcomes
    assert outcomes["driver"][0] == "ok" and outcomes["driver"][1] >= 15, outcomes
    message, waited_s = outcomes["expired"]
    assert message.startswith(f"run {run_uri}-short: could not renew lease ") and waited_s < 10, outcomes
    assert message.endswith("this holder commits nothing more"), message
