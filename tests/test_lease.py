"""Dataset leases on a local filesystem (the S3 side runs through `eft prepare` in
tests/test_prepare.py and `eft train` in tests/test_preflight.py): one holder at a time, renewals
that fence out a taker-over, expired leases taken over. No Ray, no S3."""

from __future__ import annotations

import json

import pytest

from app.data.lease import Lease, LeaseError, build_owner, check_no_live_readers, hold_prepare_lease, hold_reader_lease
from app.storage import Store


def test_one_holder_at_a_time_renewals_extend_and_release_frees(tmp_path):
    store, data_uri = Store(), str(tmp_path / "data")
    with hold_prepare_lease(store, data_uri) as first:
        held = json.loads((tmp_path / "data" / "_lease.json").read_text())
        assert held["owner"] == first.owner and held["owner"]["role"] == "prepare"
        with pytest.raises(LeaseError, match=rf"^dataset {data_uri}: held by prepare \(pid {first.owner['pid']} on "):
            hold_prepare_lease(store, data_uri).start()
        version = first.version
        first.renew()
        renewed = json.loads((tmp_path / "data" / "_lease.json").read_text())
        assert first.version != version and renewed["expires_at"] >= held["expires_at"]
        assert renewed["created_at"] == held["created_at"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == [".lock"]  # released; one lock file per directory
    with hold_prepare_lease(store, data_uri):
        pass


def test_an_expired_lease_is_taken_over_and_the_old_holder_is_fenced_out(tmp_path):
    store, data_uri = Store(), str(tmp_path / "data")
    stalled = Lease(store, str(tmp_path / "data" / "_lease.json"), build_owner("prepare"), label="dataset", ttl_s=-1)
    stalled.take()
    with hold_prepare_lease(store, data_uri) as successor:
        with pytest.raises(LeaseError, match=rf"lost to prepare \(pid {successor.owner['pid']} "):
            stalled.check()
        stalled.stop()  # must not delete the successor's lease
        assert json.loads((tmp_path / "data" / "_lease.json").read_text())["owner"] == successor.owner


def test_live_readers_hold_back_an_overwrite_and_expired_ones_do_not(tmp_path):
    store, data_uri = Store(), str(tmp_path / "data")
    reader = hold_reader_lease(store, data_uri, "/runs/one")
    with pytest.raises(LeaseError, match=rf"^{data_uri}: read by the live run /runs/one \(pid "):
        check_no_live_readers(store, data_uri)
    reader.stop()
    Lease(store, str(tmp_path / "data" / "_readers" / "gone.json"), build_owner("train", run_uri="/runs/gone"),
          label="reader", ttl_s=-1).take()
    check_no_live_readers(store, data_uri)
    assert not (tmp_path / "data" / "_readers" / "gone.json").exists()
