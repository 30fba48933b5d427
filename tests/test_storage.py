"""One storage module for every URI: local paths and a real S3 endpoint, same behaviour."""

from __future__ import annotations

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
