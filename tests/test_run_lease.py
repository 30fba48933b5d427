"""The run lease (app.lease) on both storage kinds, S3 (moto's server: conditional PUTs with
If-None-Match / If-Match) and a local directory (flock): one driver per run, epochs that only go
up, a wait bounded in time, fencing of a holder that lost the run, and a summary that says two
drivers overlapped rather than inventing a restart. No Ray: the drivers' side runs through
`eft train` in tests/test_train.py."""

from __future__ import annotations

import json
import re
import threading
import time
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


class SlowWrites(Store):
    """A local store whose conditional writes take `delay_s` to land: a slow store, or a PUT
    retried after a lost answer."""

    def __init__(self):
        super().__init__()
        self.delay_s = 0.0

    def write_if(self, uri, data, version):
        time.sleep(self.delay_s)
        return super().write_if(uri, data, version)


def test_a_slow_renewal_counts_the_lease_from_before_its_write(tmp_path):
    """The expiry a renewal writes is counted from when its body was built, so the holder's
    own count of the time it has left must start there too, not when the write came back:
    else a slow write makes the holder believe it holds the run longer than it does."""
    store = SlowWrites()
    lease = build_run_lease(store, str(tmp_path / "run"), ttl_s=30)
    store.delay_s = 1.0
    before = time.monotonic()
    lease.take()
    assert lease.renewed_at - before < 0.5
    before = time.monotonic()
    lease.renew()
    assert lease.renewed_at - before < 0.5
    store.delay_s = 0.0
    lease.stop()


def save_local_checkpoint(directory, step: int, epoch: int) -> dict:
    """What one rank-0 save leaves on local disk (app.elastic.checkpoint.save, without torch):
    the DCP files and train_state.json, and beside them the sidecar, which names the lease
    epoch. Returns commit_checkpoint's arguments for them."""
    from app.elastic.checkpoint import DCP_METADATA, TRAIN_STATE, build_sidecar, list_local_files

    directory.mkdir(parents=True)
    (directory / DCP_METADATA).write_bytes(b"m" * 32)
    (directory / "__0_0.distcp").write_bytes(bytes([step]) * 4096)
    (directory / TRAIN_STATE).write_text(json.dumps({"step": step, "rows_consumed": 4 * step}))
    sidecar = build_sidecar(list_local_files(directory), step=step, world_size=1)
    beside = directory.parent / f"{directory.name}.checkpoint.json"
    beside.write_text(json.dumps({**sidecar, "lease_epoch": epoch}))
    return {"local_dir": directory, "sidecar": beside}


class HeldUploads(Store):
    """A store that holds back one part of a checkpoint's commit until `release` is set, as an
    upload slower than its driver's hold on the run would: `hold="files"`, the rank's files
    (the upload itself: held as it resolves where they go); `hold="sidecar"`, the sidecar's
    write, after the lease check passed."""

    def __init__(self, hold: str):
        super().__init__()
        self.hold, self.reached, self.release = hold, threading.Event(), threading.Event()

    def _wait(self) -> None:
        self.reached.set()
        assert self.release.wait(60)

    def resolve(self, uri):
        if self.hold == "files" and uri.rstrip("/").rsplit("/", 1)[1].startswith("checkpoint-"):
            self._wait()
        return super().resolve(uri)

    def write_bytes(self, uri, data):
        if self.hold == "sidecar" and uri.endswith("/checkpoint.json"):
            self._wait()
        return super().write_bytes(uri, data)


def test_a_paused_drivers_upload_that_lands_after_a_takeover_is_never_resumed_from(s3, tmp_path):
    """Driver A (epoch 1) is paused past its lease; its workers' uploads go on. Driver B takes
    the run over. A's upload still going when B took over is checked again before its sidecar
    and never committed; a sidecar of A's that had passed the check just before the takeover
    lands after it, and is set aside whatever its step: by B at its resume, by Ray's
    registration of it, and by C, two epochs on. Real leases on moto's S3, no Ray: this is what
    Ray Train's upload hook (`save`'s checkpoint_upload_fn) and rank 0's resume choice run."""
    from app.elastic.checkpoint import choose_resume_checkpoint, commit_checkpoint, judge_checkpoints

    store, run_uri = Store(), f"s3://eft/runs-lease/{uuid.uuid4().hex[:8]}"

    def ckpt(step: int) -> str:
        return join(run_uri, f"checkpoint-{step:08d}")

    a = build_run_lease(store, run_uri, ttl_s=2)
    a.take()  # and never renewed: its driver is paused
    fence_a = Fence.from_dict(a.fence().to_dict())  # as A's workers carry it
    commit_checkpoint(store, ckpt_uri=ckpt(2), fence=fence_a, **save_local_checkpoint(tmp_path / "a2", 2, epoch=1))

    slow_files, slow_sidecar = HeldUploads("files"), HeldUploads("sidecar")
    outcome: dict = {}

    def upload(name, held_store, step):
        try:
            commit_checkpoint(held_store, ckpt_uri=ckpt(step), fence=fence_a,
                              **save_local_checkpoint(tmp_path / name, step, epoch=1))
            outcome[name] = "committed"
        except LeaseError as err:
            outcome[name] = str(err)

    uploads = [threading.Thread(target=upload, args=("a4", slow_files, 4)),
               threading.Thread(target=upload, args=("a6", slow_sidecar, 6))]
    for thread in uploads:
        thread.start()
    assert slow_files.reached.wait(30) and slow_sidecar.reached.wait(30)  # a6 passed its check: A held the run
    b = build_run_lease(store, run_uri)
    b.wait_and_take(30, poll_s=0.2)
    assert b.epoch == 2
    slow_files.release.set()
    slow_sidecar.release.set()
    for thread in uploads:
        thread.join(60)

    assert outcome["a4"] == (f"run {run_uri}: lease lost to {describe_owner_of(b)}, epoch 2; this holder (epoch 1) "
                             f"commits nothing more")
    assert outcome["a6"] == "committed"  # the one write a read-before-write fence lets through
    verdicts = {v.uri: v for v in judge_checkpoints(store, run_uri)}
    assert verdicts[ckpt(2)].usable
    assert verdicts[ckpt(4)].incomplete.startswith("no checkpoint.json")
    assert re.fullmatch(r"committed by lease epoch 1 at \S+, after epoch 2 took the run over at \S+: a driver "
                        r"that had lost the run", verdicts[ckpt(6)].fenced_out), verdicts[ckpt(6)]
    # B resumes from A's last checkpoint committed while A held the run, even with A's step 6
    # registered (A's controller may have registered it).
    registered = store.resolve(ckpt(6))[1]
    assert choose_resume_checkpoint(store, run_uri, None) == ("storage", ckpt(2))
    assert choose_resume_checkpoint(store, run_uri, registered) == ("storage", ckpt(2))

    # B trains on from step 2 and commits step 4 (over A's leftovers); then C takes over.
    commit_checkpoint(store, ckpt_uri=ckpt(4), fence=b.fence(), **save_local_checkpoint(tmp_path / "b4", 4, epoch=2))
    assert choose_resume_checkpoint(store, run_uri, registered) == ("storage", ckpt(4))
    b.stop()
    c = build_run_lease(store, run_uri).start()
    # C began right after B's release, B's last commit a moment before: a release fences nothing.
    kept = read_lease(store, join(run_uri, "_lease.json"))["epochs"]
    assert c.epoch == 3 and [(e, kept[e]["took_over"]) for e in sorted(kept)] == [("1", False), ("2", True),
                                                                                   ("3", False)]
    assert choose_resume_checkpoint(store, run_uri, None) == ("storage", ckpt(4))
    from app.elastic.checkpoint import list_checkpoints

    assert list_checkpoints(store, run_uri) == [ckpt(2), ckpt(4)]
    c.stop()


def test_checkpoints_the_taker_saw_complete_stay_usable_however_close_to_the_takeover(s3, tmp_path):
    """A's driver is gone; its workers commit until the very takeover (a store dates commits to
    the second, and Ray Train keeps only the newest few). B lists the complete checkpoints right
    before its takeover's write and keeps them with its epoch: those stay usable even within the
    slack, where the clocks alone set them aside; one that landed after B's write is still set
    aside, and so is a sealed one rewritten since (its commit time changed)."""
    from app.elastic import checkpoint as ckpt_mod
    from app.lease import EpochStart

    store, run_uri = Store(), f"s3://eft/runs-lease/{uuid.uuid4().hex[:8]}"

    def ckpt(step: int) -> str:
        return join(run_uri, f"checkpoint-{step:08d}")

    a = build_run_lease(store, run_uri, ttl_s=0.5)
    a.take()  # never renewed
    fence_a = Fence.from_dict(a.fence().to_dict())
    time.sleep(0.6)  # expired, not taken over: A's workers still commit
    commit_checkpoint = ckpt_mod.commit_checkpoint
    commit_checkpoint(store, ckpt_uri=ckpt(2), fence=fence_a, **save_local_checkpoint(tmp_path / "a2", 2, epoch=1))
    commit_checkpoint(store, ckpt_uri=ckpt(4), fence=fence_a, **save_local_checkpoint(tmp_path / "a4", 4, epoch=1))

    b = build_run_lease(store, run_uri, seal=lambda: ckpt_mod.list_committed(store, run_uri))
    b.take()
    assert b.epoch == 2
    # A commit that passed A's fence just before B's write, and landed just after it.
    commit_checkpoint(store, ckpt_uri=ckpt(6), **save_local_checkpoint(tmp_path / "a6", 6, epoch=1))
    lease = read_lease(store, join(run_uri, "_lease.json"))
    assert sorted(lease["epochs"]["2"]["sealed"]) == ["checkpoint-00000002", "checkpoint-00000004"]
    verdicts = {v.uri: v for v in ckpt_mod.judge_checkpoints(store, run_uri)}
    assert verdicts[ckpt(2)].usable and verdicts[ckpt(4)].usable
    assert verdicts[ckpt(6)].fenced_out, verdicts[ckpt(6)]
    assert ckpt_mod.choose_resume_checkpoint(store, run_uri, None) == ("storage", ckpt(4))

    # Within the slack the clocks alone set a commit aside; the seal keeps it, for that commit time.
    _, sidecar, committed_at = ckpt_mod.inspect_checkpoint(store, ckpt(4))
    began = committed_at + ckpt_mod.COMMIT_TIME_SLACK_S / 2
    unsealed = {2: EpochStart(began, True, {})}
    sealed = {2: EpochStart(began, True, {"checkpoint-00000004": committed_at})}
    assert ckpt_mod.check_commit_epoch(sidecar, committed_at, unsealed, name="checkpoint-00000004")
    assert ckpt_mod.check_commit_epoch(sidecar, committed_at, sealed, name="checkpoint-00000004") is None
    # A sealed name whose sidecar was written again after the listing is judged by the clocks.
    assert ckpt_mod.check_commit_epoch(sidecar, committed_at + 0.25, sealed, name="checkpoint-00000004")


def describe_owner_of(lease) -> str:
    from app.lease import describe_owner

    return describe_owner(lease.owner)


def test_controller_reads_of_the_lease_are_bounded_in_time(monkeypatch):
    """Ray Train's controller decides nothing while a callback runs. A store that takes the
    connection and never answers holds the lease check for at most the bound: the failure
    decision goes ahead as Ray takes it, and the event is not recorded, instead of waiting out
    a patient read's retries (13 attempts of 30 s)."""
    import socket

    from app.elastic import controller

    monkeypatch.setattr(controller, "LEASE_READ_BOUND_S", 1.0, raising=False)  # a shorter wait, same path
    # Credentials, so that the request is sent (without any, botocore gives up before it).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        store = Store(endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}")
        fence = Fence("s3://eft/runs-lease/silent/_lease.json", 1, "someone", "run s3://eft/runs-lease/silent")
        callback = controller.build_fence_callback()
        callback.store, callback.fence = store, fence
        events = controller.ControllerEvents(store, "s3://eft/runs-lease/silent", fence=fence)
        took: dict = {}

        def decide():
            started = time.monotonic()
            callback.before_controller_execute_failure_decision("RETRY")  # no ControllerError: Ray's decision
            took["decision"] = time.monotonic() - started
            started = time.monotonic()
            events.record("worker_group_failure", decision="RETRY")
            took["event"] = time.monotonic() - started

        thread = threading.Thread(target=decide, daemon=True)
        thread.start()
        thread.join(20)
    assert not thread.is_alive() and took["decision"] < 5 and took["event"] < 5, took
