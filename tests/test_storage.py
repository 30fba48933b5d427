"""One storage module for every URI: local paths and a real S3 endpoint, same behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.storage import Store, StorageError, join, resolve


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "s3":
        request.getfixturevalue("s3")
        return f"s3://eft/storage-tests/{tmp_path.name}"
    return str(tmp_path / "store")


def test_round_trip_list_and_delete(root):
    store = Store()
    store.write_json(join(root, "a", "x.json"), {"k": 1})
    store.write_text(join(root, "a", "b", "y.txt"), "hello")
    assert store.read_json(join(root, "a", "x.json")) == {"k": 1}
    assert store.list_files(join(root, "a")) == ["b/y.txt", "x.json"]
    assert store.list_dirs(join(root, "a")) == ["b"]
    assert store.exists(join(root, "a", "b", "y.txt")) and not store.exists(join(root, "nope"))
    store.delete_prefix(join(root, "a", "b"))
    assert store.list_files(join(root, "a")) == ["x.json"]
    with pytest.raises(StorageError, match="nope.json: not found"):
        store.read_bytes(join(root, "nope.json"))


def test_upload_puts_named_files_last_and_download_round_trips(root, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name in ["config.json", "a.bin", "sub/b.bin"]:
        (src / name).write_text(name)
    store = Store()
    order = []
    real_copy = __import__("pyarrow.fs", fromlist=["copy_files"]).copy_files

    def spy(source, dest, **kw):
        order.append(dest.rsplit("/", 1)[-1])
        return real_copy(source, dest, **kw)

    import pyarrow.fs as pafs

    pafs.copy_files, saved = spy, pafs.copy_files
    try:
        store.upload_dir(src, join(root, "m"), last=("config.json",))
    finally:
        pafs.copy_files = saved
    assert order[-1] == "config.json" and len(order) == 3
    out = tmp_path / "out"
    store.download_dir(join(root, "m"), out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        ["a.bin", "config.json", "sub/b.bin"]


def test_cache_downloads_once_and_refreshes_when_the_tree_changes(s3, tmp_path):
    store = Store()
    uri = f"s3://eft/cache-tests/{tmp_path.name}"
    store.write_text(join(uri, "config.json"), "{}")
    first = store.cache_locally(uri, cache_root=tmp_path / "cache")
    (first / "marker").write_text("still here")
    assert store.cache_locally(uri, cache_root=tmp_path / "cache") == first
    assert (first / "marker").exists()
    store.write_text(join(uri, "weights.safetensors"), "new")
    second = store.cache_locally(uri, cache_root=tmp_path / "cache")
    assert second != first and (second / "weights.safetensors").read_text() == "new"


def test_preflight_names_the_endpoint_or_bucket(s3):
    with pytest.raises(StorageError, match="bucket s3://missing-bucket does not exist at http://127.0.0.1"):
        Store().check_reachable("s3://missing-bucket/x")
    with pytest.raises(StorageError, match="cannot reach S3 endpoint http://127.0.0.1:9"):
        Store(endpoint="http://127.0.0.1:9").check_reachable("s3://eft/x")
    Store().check_reachable("s3://eft/x")


def test_resolve_rejects_unknown_schemes_and_bucketless_uris():
    with pytest.raises(StorageError, match="gs://b/x: unsupported URI scheme"):
        resolve("gs://b/x")
    with pytest.raises(StorageError, match="no bucket"):
        resolve("s3://")
    fs, path = resolve("file:///tmp/x")
    assert path == "/tmp/x" and type(fs).__name__ == "LocalFileSystem"


# -- faults: retries, degraded writes, metric segments, the private cache -------------------


def test_s3_writes_ride_out_an_outage_even_after_pickling(s3, caplog):
    """The filesystem Ray Train unpickles on its controller and workers keeps eft's retries:
    a write started while the store refuses connections lands once it is back; so do reads."""
    import pickle
    import time

    import pyarrow.fs as pafs

    from app.dev.faults import TcpProxy

    with TcpProxy(s3.endpoint) as proxy:
        store = Store(endpoint=proxy.endpoint)
        fs, path = store.resolve("s3://eft/storage-tests/outage/snapshot.json")
        fs = pickle.loads(pickle.dumps(fs))
        bare = pafs.S3FileSystem(endpoint_override=proxy.endpoint.split("://")[1], scheme="http",
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
        proxy.refuse_for(4)
        with pytest.raises(OSError):  # the outage is real: one attempt fails
            bare.get_file_info(path)
        with fs.open_output_stream(path) as f:
            f.write(b'{"ok": 1}')
        assert Store().read_json("s3://eft/storage-tests/outage/snapshot.json") == {"ok": 1}

        # The driver's reads for the summary (a HEAD, a LIST, GETs) wait out an outage as well.
        from app.observe.metrics import MetricsLog, load_metrics

        run = "s3://eft/storage-tests/outage/run"
        log = MetricsLog(store, run, enabled=True)
        log.load(up_to_step=0)
        log.append({"step": 1, "loss": 2.0})
        assert log.flush()
        proxy.refuse_for(3)
        assert load_metrics(store, run) == [{"step": 1, "loss": 2.0}]

        # An event written while storage is away: the caller goes on after `wait_s`, the write
        # goes on in the background and lands once the store is back.
        from app.observe.records import load_events, record_event

        proxy.refuse_for(600)
        with caplog.at_level("WARNING", logger="eft.records"):
            event_id = record_event(store, run, "preemption_notice", wait_s=0.2, step=1)
        assert any(f"event preemption_notice: storage has not taken {join(run, 'events', event_id)}.json" in
                   r.getMessage() for r in caplog.records)
        proxy.restore()
        deadline = time.monotonic() + 120
        while not load_events(Store(), run) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [e["id"] for e in load_events(Store(), run)] == [event_id]


def test_throttled_requests_are_retried_by_pyarrow_and_boto3(s3):
    """A store answering 503 SlowDown to 30% of the requests: every write and read still lands."""
    import boto3

    from app.dev.faults import SlowDownProxy
    from app.storage import boto3_config

    with SlowDownProxy(s3.endpoint, fraction=0.3, seed=1) as proxy:
        store = Store(endpoint=proxy.endpoint)
        for i in range(8):
            store.write_json(f"s3://eft/storage-tests/slow/{i}.json", {"i": i})
        assert [store.read_json(f"s3://eft/storage-tests/slow/{i}.json")["i"] for i in range(8)] == list(range(8))
        client = boto3.client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1", config=boto3_config())
        for i in range(8):
            client.put_object(Bucket="eft", Key=f"storage-tests/slow-boto/{i}", Body=b"x" * i)
        assert [client.get_object(Bucket="eft", Key=f"storage-tests/slow-boto/{i}")["Body"].read()
                for i in range(8)] == [b"x" * i for i in range(8)]
        assert proxy.log.count(503) >= 8  # the faults happened, and were absorbed


def test_event_heartbeat_and_metrics_writes_degrade_to_a_warning(tmp_path, caplog):
    """Storage refusing writes (here: the run's path is under a file) costs warnings, not the
    run; the metric rows stay queued and go up whole once storage takes them again."""
    from app.observe.metrics import MetricsLog, load_metrics
    from app.observe.records import Heartbeat, load_events, record_event

    blocker = tmp_path / "runs"
    blocker.write_text("not a directory")
    run = str(blocker / "r1")
    store = Store()
    with caplog.at_level("WARNING"):
        event_id = record_event(store, run, "preemption_notice", step=3)
        beat = Heartbeat(store, run, event_id, enabled=True, interval_s=0)
        beat.beat(1)
        assert beat.flush() is True  # it ran, and failed: a warning, not a wait
        log = MetricsLog(store, run, enabled=True, upload_interval_s=float("inf"))
        log.load(up_to_step=0)
        for step in range(1, 6):
            log.append({"step": step, "loss": 1.0 / step})
        assert log.flush(timeout_s=30) is False
    messages = [r.getMessage() for r in caplog.records]
    assert any("event preemption_notice not recorded at " + join(run, "events") in m for m in messages)
    assert any("heartbeat write failed" in m for m in messages)
    assert any(f"metrics: 5 rows in 1 segments not uploaded to {join(run, 'metrics')}" in m for m in messages)
    assert log.unsent_rows == 5

    blocker.unlink()  # storage is back
    log.append({"step": 6, "loss": 1 / 6})
    assert log.flush() is True and log.unsent_rows == 0
    assert [r["step"] for r in load_metrics(store, run)] == [1, 2, 3, 4, 5, 6]
    assert load_events(store, run) == []


def test_metric_segments_hold_each_row_once_and_readers_keep_the_committed_trajectory(s3):
    import json

    from app.observe.metrics import METRICS_DIR, METRICS_FILE, MetricsLog, load_metrics

    store = Store()
    run = f"s3://eft/storage-tests/segments-{__import__('uuid').uuid4().hex[:6]}"

    def attempt(resumed_from: int, last: int, tag: str, tail_rows: int = 1000) -> MetricsLog:
        log = MetricsLog(store, run, enabled=True, upload_interval_s=0, tail_rows=tail_rows)
        log.load(up_to_step=resumed_from)
        for step in range(resumed_from + 1, last + 1):
            log.append({"step": step, "attempt": tag})
        assert log.flush()
        return log

    # An old run's single file (steps 1-2), then three attempts: 0→10 (checkpoint at 6), a
    # crash, 6→12 (no checkpoint reached), another crash, 6→8.
    store.write_text(join(run, METRICS_FILE), '{"step": 1, "attempt": "old"}\n{"step": 2, "attempt": "old"}\n')
    first = attempt(2, 10, "a", tail_rows=4)
    assert [r["step"] for r in first.records] == [7, 8, 9, 10]  # a bounded tail in memory
    assert first.latest() == {"step": 10, "attempt": "a"}
    attempt(6, 12, "b")
    attempt(6, 8, "c")
    rows = load_metrics(store, run)
    assert [(r["step"], r["attempt"]) for r in rows] == \
        [(1, "old"), (2, "old"), *[(s, "a") for s in range(3, 7)], (7, "c"), (8, "c")]
    # Append-only: every row logged is in exactly one object, and no object holds anything else.
    logged = [{"step": s, "attempt": a} for a, steps in (("a", range(3, 11)), ("b", range(7, 13)), ("c", range(7, 9)))
              for s in steps]
    sizes = store.list_file_sizes(join(run, METRICS_DIR))
    assert len(sizes) == len(logged)
    assert sum(sizes.values()) == sum(len(json.dumps(r) + "\n") for r in logged)


def test_default_cache_dir_is_private_to_the_user(s3, tmp_path, monkeypatch):
    import os
    import stat
    import tempfile

    from app.storage import default_cache_root, ensure_private_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = default_cache_root()
    assert root == tmp_path / f"eft-cache-{os.getuid()}"
    uri = f"s3://eft/cache-tests/private-{tmp_path.name}"
    Store().write_text(join(uri, "config.json"), "{}")
    local = Store().cache_locally(uri)
    assert local.parent == root and stat.S_IMODE(root.stat().st_mode) == 0o700

    # Ours but left open to others: emptied (anyone could have planted files) and closed.
    root.chmod(0o777)
    (root / "planted").write_text("x")
    ensure_private_dir(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and not (root / "planted").exists()

    # Someone else's name in a shared /tmp: a link to their directory, or their own directory.
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(StorageError, match=f"cache directory {link} is not a plain directory"):
        ensure_private_dir(link)
    if os.getuid() == 0:
        os.chown(elsewhere, 4321, 4321)
        foreign = elsewhere
    else:
        foreign = Path("/")  # root's; never ours here
    with pytest.raises(StorageError, match=f"cache directory {foreign} is owned by uid"):
        ensure_private_dir(foreign)


def test_tensorboard_event_files_go_up_once_each_and_read_back_in_order(s3, tmp_path):
    """A new event file per upload (here: per step), each uploaded once; TensorBoard's own reader
    sees every step in order, and a resumed attempt's purge drops the steps it redoes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from app.observe.sinks import TensorBoardSink

    class CountingStore(Store):
        put = 0

        def write_bytes(self, uri, data):
            CountingStore.put += len(data)
            super().write_bytes(uri, data)

    store, run = CountingStore(), f"s3://eft/storage-tests/tb-{tmp_path.name}"
    sink = TensorBoardSink(store, run, resumed_from_step=0, upload_interval_s=0)
    for step in range(1, 13):
        sink.log({"step": step, "loss": float(step)})
    assert sink.finish()
    assert not sink.local.exists()  # all of it uploaded: nothing left in the temp directory
    sink = TensorBoardSink(store, run, resumed_from_step=8, upload_interval_s=0)  # crashed after 12, resumed at 8
    for step in range(9, 15):
        sink.log({"step": step, "loss": 100.0 + step})
    assert sink.finish()
    sizes = store.list_file_sizes(join(run, "tensorboard"))
    assert len(sizes) == 12 + 6 + 2 and CountingStore.put == sum(sizes.values())
    store.download_dir(join(run, "tensorboard"), tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(s, float(s)) for s in range(1, 9)] + [(s, 100.0 + s) for s in range(9, 15)]


def test_a_ranged_file_reads_what_the_file_holds_wherever_reads_fall():
    """Random seeks and reads of any length, past the end too, against the bytes themselves:
    whatever the read-ahead window holds or fetches, the answer is the file's. Reads in file
    order fetch each byte once, in a few requests; reads apart fetch little more than asked."""
    import random

    import pyarrow as pa

    from app.elastic.checkpoint import RangedFile

    rng = random.Random(0)
    content = bytes(rng.getrandbits(8) for _ in range(100_000))
    f = RangedFile(pa.BufferReader(content), min_ahead=512, max_ahead=8192)
    for _ in range(2000):
        pos, n = rng.randrange(0, 100_500), rng.choice([1, 4, 30, 1000, 1024, 3000, 12_000])
        assert f.seek(pos) == pos
        assert f.read(n) == content[pos:pos + n], (pos, n)
        assert f.tell() == max(min(pos + n, 100_000), pos)
        assert bytes(f.read_range(pos, n)) == content[pos:pos + n], (pos, n)
    assert f.seek(-22, 2) == 100_000 - 22 and f.read() == content[-22:]

    f = RangedFile(pa.BufferReader(content), min_ahead=512, max_ahead=8192)
    assert b"".join(iter(lambda: f.read(100), b"")) == content
    assert f.bytes_read == 100_000 and f.requests <= 100_000 // 8192 + 6  # the window grew to 8 KB
    f = RangedFile(pa.BufferReader(content), min_ahead=512, max_ahead=8192)
    for pos in range(0, 100_000, 10_000):  # 10 small records far apart: a small request each
        assert bytes(f.read_range(pos, 100)) == content[pos:pos + 100]
    assert (f.requests, f.bytes_read) == (10, 10 * 512)


def test_a_checkpoint_in_storage_is_read_by_ranges_of_what_is_loaded(s3, monkeypatch, tmp_path):
    """Restore reads a checkpoint straight from the bucket: the records it loads and no others,
    small ones many to a request, and the values exactly as saved. (No node downloads a
    checkpoint whole, and no local copy can be rewritten under a rank still reading it.)"""
    import ray.train
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from app.elastic import checkpoint as ckpt

    torch.manual_seed(0)
    saved = {"small": {f"t{i}": torch.randn(1000) for i in range(200)}, "big": torch.randn(500_000)}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    store = Store()
    uri = "s3://eft/ranged-restore/checkpoint-000010"
    store.upload_dir(tmp_path / "ckpt", uri)
    total = sum(p.stat().st_size for p in (tmp_path / "ckpt").iterdir())
    fs, path = store.resolve(uri)
    monkeypatch.setattr(ckpt, "READ_AHEAD_MAX_BYTES", 256 << 10)

    def load(target: dict):
        reader = ckpt.build_checkpoint_reader(ray.train.Checkpoint(path, filesystem=fs), store)
        dcp.load(target, storage_reader=reader, no_dist=True)
        return reader

    everything = {"small": {k: torch.zeros(1000) for k in saved["small"]}, "big": torch.zeros(500_000)}
    reader = load(everything)
    assert torch.equal(everything["big"], saved["big"])
    assert all(torch.equal(everything["small"][k], v) for k, v in saved["small"].items())
    assert total <= reader.bytes_read < total * 1.1
    # 201 records of 4-2,000 KB in a 3 MB file, read in order: the window grows to 256 KB, so a
    # request per window, not one per record.
    assert reader.requests < 30

    only_small = {"small": {k: torch.zeros(1000) for k in saved["small"]}}
    reader = load(only_small)
    assert all(torch.equal(only_small["small"][k], v) for k, v in saved["small"].items())
    assert reader.bytes_read < total / 2  # the big record stayed in the bucket

    local = tmp_path / "ckpt"
    assert isinstance(ckpt.build_checkpoint_reader(ray.train.Checkpoint(str(local)), store), FileSystemReader)


def test_s3_clients_are_built_on_each_stores_own_session_not_on_boto3s_shared_one(s3, monkeypatch):
    """The lease's renewal thread, Ray's upload threads and the training thread all make S3
    requests through boto3. boto3.client() builds every client on one process-wide default
    session, which is not thread-safe; a Store builds its clients on a session of its own, and
    the reference log-probs' ETag listing uses the store's."""
    import threading

    import boto3

    from app.data.reference import list_s3_etags

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    store, uri, failures = Store(), "s3://eft/storage-tests/sessions/object", []

    def work(i: int) -> None:
        try:
            assert store.write_if(f"{uri}-{i}", b"x" * i, None)
            assert store.read_versioned(f"{uri}-{i}", patient=True)[0] == b"x" * i
            store.check_reachable(uri)
            assert f"object-{i}" in list_s3_etags(store, "s3://eft/storage-tests/sessions", (f"-{i}",))
        except Exception as err:  # handed to the test's thread
            failures.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert boto3.DEFAULT_SESSION is None  # nothing was built on the shared session
