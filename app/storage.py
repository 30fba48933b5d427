"""Every byte to or from storage goes through here: URI → pyarrow filesystem + path.

`s3://bucket/prefix` uses `pyarrow.fs.S3FileSystem` (and boto3 for the preflight check),
`file:///abs` and plain paths use the local filesystem. Credentials come only from the
standard AWS chain; they are never passed explicitly, so a pickled filesystem (sent to Ray
workers, stored by Ray Train) carries none.

Every S3 client retries: a store that drops connections for tens of seconds or answers
`503 SlowDown` must cost time, never a run. Ray Train writes its own files (checkpoints, its
checkpoint-manager snapshot, with no retry of its own and no tolerance for a failed write on its
controller) through the filesystem made here, so the retries live on that filesystem.

That patience is for training. A command a person waits on (`plan`, `status`, `report`, the
preflights) uses an interactive Store (`Store(interactive=True)`): a couple of attempts and short
timeouts, so an unreachable endpoint is one line within seconds, not minutes of backoff. A bucket
name S3 cannot have (`YOUR-BUCKET`) is refused before any request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs

log = logging.getLogger("eft.storage")

# The AWS SDK's "default" strategy: retry n waits 25 ms x 2^n (none before the first), so 13
# attempts outlast an outage of ~100 s, and a throttled request (503 SlowDown) backs off instead
# of failing. Not the "standard" one: pyarrow never refunds its retry quota (500 tokens, 5 per
# retry), so after ~100 retries in the life of a filesystem it stops retrying at all; a long run
# on a store that throttles now and then would lose its retries halfway.
S3_MAX_ATTEMPTS = 13
S3_CONNECT_TIMEOUT_S = 10.0
READ_ATTEMPTS = 6
# Per socket read: how long a request may wait with no byte from the store before it is retried.
# A connection that died mid-request (a reset the client never saw) costs exactly this, so it is
# short: 120 s made a checkpoint upload caught by a 20 s outage take 2 minutes, where 30 s lets
# it resume right after. A healthy store answers within seconds, and a large object streams in
# many reads, each well under it.
S3_REQUEST_TIMEOUT_S = 30.0
# Interactive commands: one retry, and a dead endpoint is given a few seconds per attempt.
INTERACTIVE_ATTEMPTS = 2
INTERACTIVE_CONNECT_TIMEOUT_S = 3.0
INTERACTIVE_REQUEST_TIMEOUT_S = 10.0
# S3's bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, starting and ending
# with a letter or digit, no two dots in a row.
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class StorageError(RuntimeError):
    """A storage problem, reported as one line naming the URI, bucket or endpoint."""


class ObjectNotFound(StorageError):
    """The object (or its bucket) does not exist: the one read failure that says something is
    absent. Any other failure, once retried, is a StorageError of its own kind, never absence."""


def s3_endpoint(explicit: Optional[str] = None) -> Optional[str]:
    return explicit or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def check_bucket_name(uri: str) -> str:
    """The bucket of an s3:// URI, or StorageError naming the URI when S3 cannot have that name."""
    bucket = uri[len("s3://"):].split("/", 1)[0]
    if not BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise StorageError(f"{uri}: {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                           f"'.' and '-', starting and ending with a letter or digit)")
    return bucket


def join(uri: str, *parts: str) -> str:
    out = uri.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


class RetryingS3FileSystem(pafs.S3FileSystem):
    """`S3FileSystem` with eft's retry strategy and timeouts, which survive pickling. pyarrow's
    own pickle leaves the retry strategy out, so the copy Ray Train's controller and workers
    unpickle would be back at 3 attempts: a 20-s outage then fails a checkpoint-manager write
    on the controller, which Ray does not retry (a ControllerError ends the run)."""

    def __init__(self, max_attempts: int = S3_MAX_ATTEMPTS, **kwargs):
        kwargs.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
        kwargs.setdefault("request_timeout", S3_REQUEST_TIMEOUT_S)
        # An object smaller than one part goes up as one PutObject instead of a multipart upload:
        # a third of the requests, so a third of the chances to be throttled.
        kwargs.setdefault("allow_delayed_open", True)
        super().__init__(retry_strategy=pafs.AwsDefaultS3RetryStrategy(max_attempts=max_attempts), **kwargs)
        self._eft_kwargs = dict(kwargs, max_attempts=max_attempts)

    def __reduce__(self):
        return _rebuild_s3, (self._eft_kwargs,)


def _rebuild_s3(kwargs: dict) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(**kwargs)


def boto3_config(**overrides):
    """botocore's config for every boto3 client eft makes: adaptive retries (standard backoff
    plus client-side rate limiting when the store throttles) and bounded connect/read waits."""
    from botocore.config import Config

    settings = {"retries": {"mode": "adaptive", "max_attempts": S3_MAX_ATTEMPTS},
                "connect_timeout": S3_CONNECT_TIMEOUT_S, "read_timeout": S3_REQUEST_TIMEOUT_S, **overrides}
    return Config(**settings)


def resolve(uri: str, endpoint: Optional[str] = None, region: str = "us-east-1",
            interactive: bool = False) -> tuple[pafs.FileSystem, str]:
    """URI → (filesystem, path inside it). `interactive`: a short retry budget (see the module doc)."""
    if is_s3(uri):
        path = uri[len("s3://"):].rstrip("/")
        if not path:
            raise StorageError(f"{uri}: no bucket in URI")
        check_bucket_name(uri)
        ep = s3_endpoint(endpoint)
        kwargs: dict[str, Any] = {"region": region}
        if interactive:
            kwargs.update(max_attempts=INTERACTIVE_ATTEMPTS, connect_timeout=INTERACTIVE_CONNECT_TIMEOUT_S,
                          request_timeout=INTERACTIVE_REQUEST_TIMEOUT_S)
        if ep:
            scheme, _, host = ep.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
            # S3-compatible stores on a custom endpoint rarely speak virtual-host addressing.
            kwargs["force_virtual_addressing"] = False
        return RetryingS3FileSystem(**kwargs), path
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" in uri:
        raise StorageError(f"{uri}: unsupported URI scheme (use s3://, file:// or a path)")
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().absolute())


def _read_whole(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def _read_at(fs, path: str, offset: int, length: int) -> bytes:
    with fs.open_input_file(path) as f:
        return f.read_at(length, offset)


class Store:
    """Storage bound to one endpoint/region (from `StorageConfig`). `interactive`: for commands a
    person waits on, which fail in seconds on an unreachable endpoint instead of riding it out."""

    def __init__(self, endpoint: Optional[str] = None, region: str = "us-east-1", interactive: bool = False):
        self.endpoint = endpoint
        self.region = region
        self.interactive = interactive
        # Bytes this Store has fetched (read_bytes, read_range, cache_locally downloads): what
        # loading a model read is measured on a Store of its own. Bytes a node-local cache served
        # instead are no storage traffic: they are counted apart, in bytes_cached.
        self.bytes_read = 0
        self.bytes_cached = 0
        self._count_lock = threading.Lock()
        self._init_boto3()

    def _init_boto3(self) -> None:
        # A boto3 Session is not thread-safe, and boto3.client() builds every client on one
        # default session shared by the whole process: the lease's renewal thread, Ray's upload
        # threads and the training thread built clients on it at once. Each Store has a session
        # of its own, used under a lock, and keeps the clients it built (a client is thread-safe).
        self._boto3_lock = threading.Lock()
        self._boto3_session = None
        self._boto3_clients: dict = {}

    def __getstate__(self) -> dict:
        skip = {"_count_lock", "_boto3_lock", "_boto3_session", "_boto3_clients"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._count_lock = threading.Lock()
        self._init_boto3()

    def boto3_client(self, kind: str, config):
        """This Store's S3 client of one `kind` (its retry budget: "preflight", "short",
        "patient"), built once on the Store's own boto3 session."""
        with self._boto3_lock:
            client = self._boto3_clients.get(kind)
            if client is None:
                import boto3

                if self._boto3_session is None:
                    self._boto3_session = boto3.session.Session()
                client = self._boto3_session.client("s3", endpoint_url=s3_endpoint(self.endpoint),
                                                    region_name=self.region, config=config)
                self._boto3_clients[kind] = client
            return client

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_read += n

    def count_cached(self, n: int) -> None:
        with self._count_lock:
            self.bytes_cached += n

    @classmethod
    def from_config(cls, storage_cfg, interactive: bool = False) -> "Store":
        return cls(storage_cfg.s3_endpoint, storage_cfg.s3_region, interactive=interactive)

    def resolve(self, uri: str) -> tuple[pafs.FileSystem, str]:
        return resolve(uri, self.endpoint, self.region, self.interactive)

    # -- preflight ----------------------------------------------------------------
    def check_reachable(self, uri: str) -> None:
        """Fail fast, in one line, on an unreachable endpoint, a missing bucket or bad credentials."""
        if not is_s3(uri):
            return
        import botocore.exceptions as bexc

        bucket = check_bucket_name(uri)
        where = s3_endpoint(self.endpoint) or "the default AWS endpoint"
        # Preflight answers fast: a few attempts, not the long patience of a running job.
        client = self.boto3_client("preflight", boto3_config(
            connect_timeout=INTERACTIVE_CONNECT_TIMEOUT_S, read_timeout=INTERACTIVE_REQUEST_TIMEOUT_S,
            retries={"mode": "standard", "max_attempts": INTERACTIVE_ATTEMPTS}))
        try:
            client.head_bucket(Bucket=bucket)
        except (bexc.ConnectionError, bexc.HTTPClientError) as err:  # refused, unresolvable, timed out
            raise StorageError(f"cannot reach S3 endpoint {where} (for {uri}): {type(err).__name__}") from None
        except bexc.NoCredentialsError:
            raise StorageError(f"no AWS credentials found for s3://{bucket} at {where}") from None
        except bexc.ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise StorageError(f"bucket s3://{bucket} does not exist at {where}") from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StorageError(f"access denied to bucket s3://{bucket} at {where} (check credentials)") from None
            raise StorageError(f"s3://{bucket} at {where}: {code or err}") from None

    # -- small objects ------------------------------------------------------------
    def exists(self, uri: str) -> bool:
        fs, path = self.resolve(uri)
        return fs.get_file_info(path).type != pafs.FileType.NotFound

    def read_bytes(self, uri: str, attempts: Optional[int] = None) -> bytes:
        """One object whole; ObjectNotFound when it (or its bucket) does not exist. `attempts`:
        how many times a failed read is tried (default: READ_ATTEMPTS on S3, once on an
        interactive Store, whose pyarrow client still retries on its own)."""
        data = self._read_retrying(uri, lambda fs, path: _read_whole(fs, path), attempts)
        self._count(len(data))
        return data

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        """`length` bytes of one object from `offset`: one ranged GET on S3."""
        data = self._read_retrying(uri, lambda fs, path: _read_at(fs, path, offset, length))
        self._count(len(data))
        if len(data) != length:
            raise StorageError(f"{uri}: {len(data)} bytes at offset {offset}, expected {length} (object truncated?)")
        return data

    def _read_retrying(self, uri: str, read, attempts: Optional[int] = None) -> bytes:
        fs, path = self.resolve(uri)
        if attempts is None:
            attempts = READ_ATTEMPTS if is_s3(uri) and not self.interactive else 1
        for attempt in range(attempts):
            try:
                return read(fs, path)
            except FileNotFoundError:
                raise ObjectNotFound(f"{uri}: not found") from None
            except OSError:
                # The SDK reads a GET's body into a buffer the object's size: a throttled GET of an
                # object shorter than S3's error XML (an event, a small JSON) overflows it and fails
                # as INTERNAL_FAILURE, which the SDK does not retry. So reads retry here as well.
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2 * 2 ** attempt)

    def write_bytes(self, uri: str, data: bytes) -> None:
        """One object, all or nothing: S3 PUT is atomic; locally we write a temp file and rename."""
        fs, path = self.resolve(uri)
        if isinstance(fs, pafs.LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return
        with fs.open_output_stream(path) as f:
            f.write(data)

    def write_stream(self, uri: str, chunks) -> int:
        """An object written from an iterable of byte chunks, never held whole in memory (S3: a
        multipart upload through the retrying filesystem; locally a temp file, then a rename).
        An iterable that fails midway leaves no object behind. Returns the bytes written."""
        fs, path = self.resolve(uri)
        written = 0
        if isinstance(fs, pafs.LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    for chunk in chunks:
                        f.write(chunk)
                        written += len(chunk)
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return written
        stream = fs.open_output_stream(path)
        try:
            for chunk in chunks:
                stream.write(chunk)
                written += len(chunk)
        except BaseException:
            # pyarrow's S3 stream has no abort: closing completes the upload, so the cut-off
            # object is deleted right after (and whoever writes it keeps a marker of its own).
            with contextlib.suppress(Exception):
                stream.close()
                fs.delete_file(path)
            raise
        stream.close()
        return written

    def read_text(self, uri: str) -> str:
        return self.read_bytes(uri).decode()

    def write_text(self, uri: str, text: str) -> None:
        self.write_bytes(uri, text.encode())

    def read_json(self, uri: str) -> Any:
        try:
            return json.loads(self.read_bytes(uri))
        except json.JSONDecodeError as err:
            raise StorageError(f"{uri}: not valid JSON ({err})") from None

    def write_json(self, uri: str, obj: Any) -> None:
        self.write_bytes(uri, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())

    # -- conditional writes (leases) -----------------------------------------------
    def read_versioned(self, uri: str, patient: bool = False) -> Optional[tuple[bytes, str]]:
        """(content, version) of one object, None if absent. The version is S3's ETag, or a hash
        of the content on a local filesystem: what `write_if` compares against. `patient`: the
        full retry budget of a training write (a check right before a commit rides out the same
        outage the commit would), unless this Store is interactive."""
        if is_s3(uri):
            client, bucket, key = self._s3_object(uri, patient=patient)
            try:
                got = client.get_object(Bucket=bucket, Key=key)
            except client.exceptions.NoSuchKey:
                return None
            return got["Body"].read(), got["ETag"]
        path = Path(self.resolve(uri)[1])
        with self._local_lock(path):
            return self._read_local_versioned(path)

    def write_if(self, uri: str, data: bytes, version: Optional[str]) -> Optional[str]:
        """Write one object only if it is absent (`version` None) or still at `version`; returns
        the new version, or None when another writer got there first. On S3 this is a conditional
        PUT (If-None-Match / If-Match), so of two racing writers exactly one wins."""
        if is_s3(uri):
            client, bucket, key = self._s3_object(uri)
            condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
            try:
                return client.put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
            except client.exceptions.ClientError as err:
                # 412: the condition failed; 404: If-Match on a deleted object; 409: a concurrent
                # conditional write to the same key.
                if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (404, 409, 412):
                    return None
                raise
        path = Path(self.resolve(uri)[1])
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._local_lock(path):
            current = self._read_local_versioned(path)
            if (current[1] if current else None) != version:
                return None
            self.write_bytes(uri, data)
            return hashlib.sha256(data).hexdigest()

    def delete_if(self, uri: str, version: str) -> bool:
        """Delete one object only if it is still at `version`."""
        if is_s3(uri):
            client, bucket, key = self._s3_object(uri)
            try:
                client.delete_object(Bucket=bucket, Key=key, IfMatch=version)
                return True
            except client.exceptions.ClientError as err:
                if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (404, 409, 412):
                    return False
                raise
        path = Path(self.resolve(uri)[1])
        with self._local_lock(path):
            current = self._read_local_versioned(path)
            if not current or current[1] != version:
                return False
            path.unlink()
            return True

    def _s3_object(self, uri: str, patient: bool = False):
        bucket, _, key = uri[len("s3://"):].partition("/")
        # Fewer attempts than other writes: a lease write that waited out the full backoff could
        # outlive the lease it renews; the holder tries again at its next renewal instead.
        if patient and not self.interactive:
            client = self.boto3_client("patient", boto3_config())
        else:
            client = self.boto3_client("short", boto3_config(read_timeout=30,
                                                             retries={"mode": "standard", "max_attempts": 5}))
        return client, bucket, key

    @staticmethod
    @contextlib.contextmanager
    def _local_lock(path: Path):
        # Local compare-and-swap: every conditional writer in the directory holds its one lock
        # file (a file, not the directory itself: NFS emulates flock with locks that need one).
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    @staticmethod
    def _read_local_versioned(path: Path) -> Optional[tuple[bytes, str]]:
        if not path.is_file():
            return None
        data = path.read_bytes()
        return data, hashlib.sha256(data).hexdigest()

    # -- trees --------------------------------------------------------------------
    def list_files(self, uri: str, recursive: bool = True) -> list[str]:
        """Relative paths of the files under a prefix (empty if absent)."""
        fs, path = self.resolve(uri)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=recursive, allow_not_found=True))
        except FileNotFoundError:
            return []
        return sorted(i.path[len(path):].lstrip("/") for i in infos if i.type == pafs.FileType.File)

    def list_file_sizes(self, uri: str) -> dict[str, int]:
        """{relative path: size in bytes} of the files under a prefix (empty if absent)."""
        return {name: size for name, (size, _) in self.list_file_stats(uri).items()}

    def list_file_stats(self, uri: str) -> dict[str, tuple[int, Optional[float]]]:
        """{relative path: (size in bytes, modified time in epoch seconds or None)} of the files
        under a prefix (empty if absent). On S3 the time is when the store took the object, to
        the second: the time of a commit by the store's clock, not the writer's."""
        fs, path = self.resolve(uri)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            return {}
        return {i.path[len(path):].lstrip("/"): (i.size, i.mtime_ns / 1e9 if i.mtime_ns is not None else None)
                for i in infos if i.type == pafs.FileType.File}

    def list_dirs(self, uri: str) -> list[str]:
        fs, path = self.resolve(uri)
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def delete_prefix(self, uri: str) -> None:
        fs, path = self.resolve(uri)
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif fs.get_file_info(path).type == pafs.FileType.File:
            fs.delete_file(path)

    def upload_dir(self, local_dir: str | Path, uri: str, last: tuple[str, ...] = ()) -> None:
        """Upload a local tree; the files named in `last` go up after everything else, so a
        reader that keys on them (a manifest, a config.json) never sees a partial tree."""
        fs, path = self.resolve(uri)
        local_dir = Path(local_dir)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.relative_to(local_dir).as_posix() in last)
        local = pafs.LocalFileSystem()
        if not isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(path, recursive=True)
        for src in files:
            rel = src.relative_to(local_dir).as_posix()
            dest = f"{path}/{rel}"
            if isinstance(fs, pafs.LocalFileSystem):
                Path(dest).parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(str(src), dest, source_filesystem=local, destination_filesystem=fs)

    def download_dir(self, uri: str, local_dir: str | Path) -> None:
        fs, path = self.resolve(uri)
        if fs.get_file_info(path).type != pafs.FileType.Directory and not self.list_files(uri):
            raise StorageError(f"{uri}: not found")
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        pafs.copy_files(path, str(local_dir), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(),
                        use_threads=True)

    def list_versions(self, uri: str) -> list[tuple[str, int, int]]:
        """Sorted (path, size, mtime_ns) of the files under a prefix (empty if absent): what a
        node-local copy of them is keyed on."""
        fs, path = self.resolve(uri)
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        return sorted((i.path, i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File)

    def version_key(self, uri: str, listing: list[tuple[str, int, int]]) -> str:
        """A local cache's name for the files at `uri` as `listing` saw them. Keyed on the listing
        (names, sizes, mtimes) as well as endpoint and URI: new weights at the same URI are
        fetched anew, never served from a stale copy."""
        return hashlib.sha256(f"{s3_endpoint(self.endpoint)}|{uri}|{listing}".encode()).hexdigest()[:24]

    def cache_locally(self, uri: str, cache_root: Optional[str | Path] = None,
                      skip_suffixes: tuple[str, ...] = ()) -> Path:
        """A local copy of a remote tree, downloaded once per node (file lock + atomic rename).
        Files whose names end in one of `skip_suffixes` are left out (a model's weights, when each
        rank reads its own slices of them from storage)."""
        if not is_s3(uri):
            _, path = self.resolve(uri)
            return Path(path)
        if cache_root is None:
            root = ensure_private_dir(default_cache_root())
        else:
            root = Path(cache_root)
            root.mkdir(parents=True, exist_ok=True)
        fs, path = self.resolve(uri)
        listing = self.list_versions(uri)
        if not listing:
            raise StorageError(f"{uri}: not found")
        listing = [entry for entry in listing if not entry[0].endswith(skip_suffixes)] if skip_suffixes else listing
        key = self.version_key(uri, listing)
        final = root / key
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (final / ".complete").exists():
                self.count_cached(sum(entry[1] for entry in listing))
                return final
            staging = root / f"{key}.partial-{uuid.uuid4().hex[:8]}"
            if skip_suffixes:
                self._download_files(fs, path, [entry[0] for entry in listing], staging)
            else:
                self.download_dir(uri, staging)
            self._count(sum(entry[1] for entry in listing))
            (staging / ".complete").write_text(uri)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        return final

    @staticmethod
    def _download_files(fs: pafs.FileSystem, root: str, paths: list[str], local_dir: Path) -> None:
        local = pafs.LocalFileSystem()
        for src in paths:
            dest = local_dir / src[len(root):].lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(src, str(dest), source_filesystem=fs, destination_filesystem=local)


def default_cache_root() -> Path:
    """Per user: in a shared /tmp, a fixed name would let another user own the directory first."""
    return Path(tempfile.gettempdir()) / f"eft-cache-{os.getuid()}"


def ensure_private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter (0700), created if absent.

    In a shared, sticky /tmp anyone can create the name first: a symlink to a directory they
    control, or a directory of their own, would have us load model files they can swap. So an
    existing entry is judged with lstat (never following a link): a link or one owned by someone
    else is refused; our own with a looser mode is removed and made again, since others may have
    written into it while it was open to them."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise StorageError(f"cache directory {path} is not a plain directory (a symlink or file?); "
                               "remove it or set TMPDIR") from None
        if info.st_uid != os.getuid():
            raise StorageError(f"cache directory {path} is owned by uid {info.st_uid}, not this user "
                               f"({os.getuid()}); remove it or set TMPDIR") from None
        if stat.S_IMODE(info.st_mode) & 0o077:
            log.warning("cache directory %s was open to other users (mode %o); emptying it", path,
                        stat.S_IMODE(info.st_mode))
            shutil.rmtree(path)
            os.mkdir(path, 0o700)
    return path
