"""Grow without losing work (app/elastic/grow.py), without Ray: the driver's request and bounded
wait, and the workers' side, on the local S3. The real grow on a multi-node cluster is in
tests/test_elastic.py."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from app.elastic import checkpoint as ckpt
from app.elastic.grow import REQUEST_FILE, GrowRequests, checkpoint_before_grow, done_uri
from app.storage import Store, join


@pytest.fixture
def run(s3):
    return Store(), f"s3://eft/test-grow/{uuid.uuid4().hex[:8]}"


def write_complete_checkpoint(store: Store, run_uri: str, step: int) -> None:
    files = {ckpt.TRAIN_STATE: b'{"step": %d}' % step, ckpt.DCP_METADATA: b"meta", "__0_0.distcp": b"x" * 10}
    uri = join(run_uri, ckpt.checkpoint_dir_name(step))
    for name, data in files.items():
        store.write_bytes(join(uri, name), data)
    sidecar = ckpt.build_sidecar({name: len(data) for name, data in files.items()}, step=step, world_size=2)
    store.write_json(join(uri, ckpt.SIDECAR), sidecar)


def test_the_driver_waits_for_the_groups_checkpoint_then_clears_its_request(run):
    store, run_uri = run
    recorded = []
    workers = GrowRequests(store, run_uri, rank=0, broadcast=lambda value: value, poll_s=0.05)

    def group() -> None:  # what rank 0 does at its next step boundaries
        for step in range(1, 200):
            if request := workers.after_step(step):
                workers.acknowledge_when_up(request, step, timeout_s=10, poll_s=0.05)
                time.sleep(0.2)  # the save: the checkpoint is whole only once it is up
                write_complete_checkpoint(store, run_uri, step)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=group)
    thread.start()
    result = checkpoint_before_grow(store, run_uri, 2, 3, timeout_s=30,
                                    record=lambda kind, **f: recorded.append((kind, f)), poll_s=0.05)
    thread.join(10)
    workers.stop()
    assert result["step"] is not None and result["from_workers"] == 2 and result["to_workers"] == 3
    assert ckpt.is_complete(store, join(run_uri, ckpt.checkpoint_dir_name(result["step"])))
    assert recorded == [("grow_checkpoint", result)]
    assert not store.exists(join(run_uri, REQUEST_FILE))


def test_a_group_that_never_answers_costs_the_driver_a_bounded_wait(run):
    store, run_uri = run
    recorded = []
    started = time.monotonic()
    result = checkpoint_before_grow(store, run_uri, 2, 4, timeout_s=0.5,
                                    record=lambda kind, **f: recorded.append(kind), poll_s=0.05)
    assert result["step"] is None and recorded == ["grow_checkpoint_timeout"]
    assert time.monotonic() - started < 5 and not store.exists(join(run_uri, REQUEST_FILE))


def test_every_rank_serves_a_request_once_and_an_answered_one_never_again(run):
    store, run_uri = run
    store.write_json(join(run_uri, REQUEST_FILE), {"id": "r1", "from_workers": 2, "to_workers": 3})
    rank0 = GrowRequests(store, run_uri, rank=0, broadcast=lambda value: value, poll_s=0.05)
    deadline = time.monotonic() + 10
    while rank0._latest is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Rank 1 never reads storage: it gets rank 0's value from the broadcast.
    rank1 = GrowRequests(store, run_uri, rank=1, broadcast=lambda value: {"id": "r1"})
    assert rank0.after_step(5)["id"] == "r1" and rank1.after_step(5)["id"] == "r1"
    assert rank0.after_step(6) is None and rank1.after_step(6) is None
    rank0.stop()
    # The bigger group after the restart finds the request still there, but answered.
    store.write_json(done_uri(run_uri, "r1"), {"id": "r1", "step": 5})
    after_restart = GrowRequests(store, run_uri, rank=0, broadcast=lambda value: value, poll_s=0.05)
    time.sleep(0.5)
    assert after_restart.after_step(6) is None
    after_restart.stop()


def test_the_answer_waits_for_the_whole_checkpoint(run):
    store, run_uri = run
    workers = GrowRequests(store, run_uri, rank=0, broadcast=lambda value: value, poll_s=0.05)
    workers.acknowledge_when_up({"id": "r2"}, step=7, timeout_s=10, poll_s=0.05)
    uri = join(run_uri, ckpt.checkpoint_dir_name(7))
    store.write_bytes(join(uri, ckpt.TRAIN_STATE), b"{}")  # a part of it: no answer yet
    time.sleep(0.4)
    assert not store.exists(done_uri(run_uri, "r2"))
    write_complete_checkpoint(store, run_uri, 7)
    deadline = time.monotonic() + 10
    while not store.exists(done_uri(run_uri, "r2")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.read_json(done_uri(run_uri, "r2"))["step"] == 7
    workers.stop()
