"""Checkpoints: the app state ↔ torch.distributed.checkpoint (DCP), and which ones are complete.

Layout of one checkpoint directory (`<run>/checkpoint-<step:08d>/`, written by every rank
through Ray Train, which merges the ranks' files into one directory):
  .metadata, __<rank>_0.distcp   DCP of {"model": trainable params, "optim": optimizer}
  train_state.json               step, rows consumed, seed, world size, dataset (rank 0)
  checkpoint.json                the sidecar (rank 0, written last): every other file's name and
                                 size across all ranks, step, world size, dataset, run identity
For LoRA the model entry holds the adapters only: the frozen base is reloaded from its URI.

A bucket is a trust boundary: DCP's `.metadata` is a pickle, so whoever can write the bucket can
run code in whoever unpickles it. Loading a checkpoint into training or export does (DCP has no
other format); everything that only looks at a run (status, report, the completeness check, resume
selection) reads the JSON sidecar and file listings, and never unpickles anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app.storage import Store, StorageError, join

TRAIN_STATE = "train_state.json"
SIDECAR = "checkpoint.json"
DCP_METADATA = ".metadata"
SIDECAR_VERSION = 1
CHECKPOINT_PREFIX = "checkpoint-"


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def build_sidecar(files: dict[str, int], *, step: int, world_size: int, lineage: Optional[dict] = None) -> dict:
    """The sidecar of one checkpoint: `files` is {relative path: size in bytes} of every file the
    ranks wrote (the sidecar itself excluded); `lineage` adds what it was trained from."""
    return {"format_version": SIDECAR_VERSION, "step": step, "world_size": world_size,
            "files": dict(sorted(files.items())), **(lineage or {}), "saved_at": time.time()}


def write_sidecar(local_dir: Path, sidecar: dict) -> None:
    (Path(local_dir) / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")


def list_local_files(local_dir: Path) -> dict[str, int]:
    root = Path(local_dir)
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def load_sidecar(store: Store, ckpt_uri: str) -> dict:
    sidecar = store.read_json(join(ckpt_uri, SIDECAR))
    if not isinstance(sidecar, dict) or not isinstance(sidecar.get("files"), dict):
        raise StorageError(f"{join(ckpt_uri, SIDECAR)}: no files listed")
    return sidecar


def check_complete(store: Store, ckpt_uri: str) -> Optional[str]:
    """None if the checkpoint is complete, else why not (a phrase for a one-line message).

    Complete = the sidecar is there, lists train_state.json and the DCP metadata, and every file
    it lists is in storage with exactly the size it had when saved. Ray Train uploads each rank's
    files in no fixed order, so until the last byte of the last rank is up some listed file is
    missing or short, and an upload cut off halfway never passes. Nothing here unpickles."""
    sizes = store.list_file_sizes(ckpt_uri)
    if SIDECAR not in sizes:
        return f"no {SIDECAR} (an upload cut off, or saved by an eft without sidecars)"
    try:
        files = load_sidecar(store, ckpt_uri)["files"]
    except StorageError as err:
        return str(err)
    for needed in (TRAIN_STATE, DCP_METADATA):
        if needed not in files:
            return f"{SIDECAR} lists no {needed}"
    for name, size in files.items():
        if name not in sizes:
            return f"{name} is missing"
        if sizes[name] != size:
            return f"{name} is {sizes[name]} bytes, {SIDECAR} says {size}"
    return None


def is_complete(store: Store, ckpt_uri: str) -> bool:
    return check_complete(store, ckpt_uri) is None


def check_local_copy(local_dir: Path, files: dict[str, int], ckpt_uri: str) -> None:
    """A downloaded checkpoint still matches the sidecar it was judged complete by (nothing was
    replaced in between): checked before DCP unpickles its metadata."""
    have = list_local_files(local_dir)
    for name, size in files.items():
        if have.get(name) != size:
            raise StorageError(f"{ckpt_uri}: {name} changed since it was judged complete ({have.get(name)} "
                               f"bytes downloaded, {SIDECAR} says {size})")


def list_checkpoints(store: Store, run_uri: str) -> list[str]:
    """URIs of the complete checkpoints of a run, oldest first."""
    names = [d for d in store.list_dirs(run_uri) if d.startswith(CHECKPOINT_PREFIX)]
    uris = [join(run_uri, d) for d in sorted(names)]
    return [u for u in uris if is_complete(store, u)]


def find_latest_checkpoint(store: Store, run_uri: str) -> Optional[str]:
    found = list_checkpoints(store, run_uri)
    return found[-1] if found else None


def step_of(ckpt_uri: str) -> int:
    return int(ckpt_uri.rstrip("/").rsplit(CHECKPOINT_PREFIX, 1)[1])


def load_train_state(store: Store, ckpt_uri: str) -> dict:
    return store.read_json(join(ckpt_uri, TRAIN_STATE))


# -- worker side ------------------------------------------------------------------


@dataclass(frozen=True)
class RestoredState:
    step: int = 0
    rows_consumed: int = 0
    restored: bool = False
    bytes_read: int = 0  # this rank's reads from storage (0 for a checkpoint on local disk)


def _state_dict_options(lora: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # For LoRA only the adapters are trainable: the frozen base is never written, and loading
    # leaves it alone (non-strict). Missing adapter keys still fail, inside dcp.load.
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def build_app_state(model, optimizer, lora: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opts = _state_dict_options(lora)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, optimizer, options=opts)}


def save(cfg, store: Store, model, optimizer, *, step: int, rows_consumed: int, world_size: int,
         metrics: Optional[dict], rank: int, lineage: Optional[dict] = None, wait_for_upload: bool = False,
         lease_epoch: Optional[int] = None, validate: bool = False) -> None:
    """Every rank writes its DCP shards to a local dir; Ray Train uploads and merges them into
    `<run>/checkpoint-<step>/` and registers the checkpoint only once every rank's part is up.
    Rank 0 adds train_state.json and, last, the sidecar listing every rank's files (a collective:
    every rank calls this). `lineage` ({"dataset", "identity"}, see app.elastic.resume) goes into the
    sidecar, and its dataset into train_state.json too. `wait_for_upload` overrides
    `checkpoint.async_upload` (a just-in-time save must be up before the group drains).
    `lease_epoch`: the run lease's epoch of the driver whose group saves it (app.lease). `validate`:
    Ray Train runs the trainer's validation function (app.eval.during) on it, off the steps' path."""
    import ray.train
    import torch.distributed.checkpoint as dcp
    from ray.train import Checkpoint
    from ray.train import CheckpointUploadMode

    lineage = lineage or {}
    local = Path(tempfile.mkdtemp(prefix=f"eft-ckpt-{step:08d}-r{rank}-"))
    dcp.save(build_app_state(model, optimizer, cfg.lora is not None), checkpoint_id=str(local))
    if rank == 0:
        (local / TRAIN_STATE).write_text(json.dumps({
            "step": step, "rows_consumed": rows_consumed, "world_size": world_size,
            "seed": cfg.training.seed, "global_batch_size": cfg.training.global_batch_size,
            "lora": cfg.lora is not None, "dataset": lineage.get("dataset"), "saved_at": time.time(),
        }, indent=2))
    files = gather_file_sizes(local, step)
    if rank == 0:
        sidecar = build_sidecar(files, step=step, world_size=world_size, lineage=lineage)
        if lease_epoch is not None:
            sidecar["lease_epoch"] = lease_epoch
        write_sidecar(local, sidecar)
    mode = CheckpointUploadMode.ASYNC if cfg.checkpoint.async_upload and not wait_for_upload else CheckpointUploadMode.SYNC
    ray.train.report(dict(metrics or {"step": step}), checkpoint=Checkpoint.from_directory(str(local)),
                     checkpoint_dir_name=checkpoint_dir_name(step), checkpoint_upload_mode=mode,
                     delete_local_checkpoint_after_upload=True, validation=validate)
    if mode == CheckpointUploadMode.SYNC:
        shutil.rmtree(local, ignore_errors=True)


def gather_file_sizes(local_dir: Path, step: int) -> dict[str, int]:
    """{name: size} of the files every rank wrote for this checkpoint, as Ray Train will merge
    them into one directory. Sizes come from the ranks' own fresh files, never from storage."""
    import torch.distributed as dist

    mine = list_local_files(local_dir)
    if not dist.is_initialized():
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict[str, int] = {}
    for part in parts:
        for name, size in part.items():
            if name in merged:
                raise RuntimeError(f"checkpoint {checkpoint_dir_name(step)}: two ranks wrote {name}")
            merged[name] = size
    return merged


def select_resume_checkpoint(registered, store: Store, run_uri: str, rank: int):
    """The checkpoint to resume from: Ray Train's latest registered one, or a newer complete one
    in storage. With async uploads a checkpoint can be fully up when its node dies but not yet
    registered by Ray's controller (which learns of it on its next poll); resuming from it
    saves the steps since the registered one (a just-in-time checkpoint is the typical case).
    Rank 0 decides and broadcasts, so every rank loads the same one."""
    import ray.train
    import torch.distributed as dist

    choice = [None]
    if rank == 0:
        latest = find_latest_checkpoint(store, run_uri)
        registered_step = step_of(registered.path) if registered is not None else -1
        if latest is not None and step_of(latest) > registered_step:
            choice[0] = latest
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return registered
    fs, path = store.resolve(choice[0])
    return ray.train.Checkpoint(path, filesystem=fs)


def peek_train_state(checkpoint) -> dict:
    """train_state.json of a Ray checkpoint, read without downloading the shards: the data
    position is known (and the stream started) before the model is built."""
    if checkpoint is None:
        return {}
    fs, path = checkpoint.filesystem, checkpoint.path
    try:
        with fs.open_input_stream(f"{path.rstrip('/')}/{TRAIN_STATE}") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise RuntimeError(f"checkpoint {path} is incomplete (no {TRAIN_STATE})") from None


# A GET costs a round trip whatever its size, and DCP reads a LoRA checkpoint as thousands of
# small records in file order: reads that follow each other fetch ahead, in a window that
# doubles up to this size. A read elsewhere in the file starts the window small again.
READ_AHEAD_MIN_BYTES = 64 << 10
READ_AHEAD_MAX_BYTES = 8 << 20


class RangedFile(io.RawIOBase):
    """A remote checkpoint file read by ranged requests (`read_range`), for DCP's reader. Reads
    in file order are served from a read-ahead window that grows while they stay in order, so
    small records cost a request per window; a record read alone costs one request of its own
    size, and little more (a rank reads other ranks' files only for the few records it needs
    from them)."""

    def __init__(self, f, min_ahead: Optional[int] = None, max_ahead: Optional[int] = None):
        super().__init__()
        self._f, self._size, self._pos = f, f.size(), 0
        self._min_ahead = min_ahead or READ_AHEAD_MIN_BYTES
        self._max_ahead = max_ahead or READ_AHEAD_MAX_BYTES
        self._ahead = self._min_ahead
        self._window, self._window_at = b"", 0
        self.bytes_read = 0
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def readinto(self, b) -> int:
        data = self.read_range(self._pos, len(b))
        memoryview(b)[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def read_range(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the file, fewer only past its end."""
        length = max(min(length, self._size - offset), 0)
        if not length:
            return b""
        start = offset - self._window_at
        if 0 <= start and start + length <= len(self._window):
            return self._window[start:start + length]
        window_end = self._window_at + len(self._window)
        in_order = self._window and self._window_at <= offset <= window_end + self._min_ahead
        self._ahead = min(self._ahead * 2, self._max_ahead) if in_order else self._min_ahead
        # What the window holds of the range is not fetched again.
        head = self._window[start:] if self._window and 0 <= start < len(self._window) else b""
        rest_at, rest = offset + len(head), length - len(head)
        if rest >= self._max_ahead:
            # A large record: exactly its bytes, kept nowhere (the BytesIO around it shares them).
            return head + self._fetch(rest_at, rest)
        self._window = self._fetch(rest_at, min(max(rest, self._ahead), self._size - rest_at))
        self._window_at = rest_at
        return head + self._window[:rest]

    def _fetch(self, offset: int, length: int) -> bytes:
        data = self._f.read_at(length, offset) if length else b""
        self.bytes_read += len(data)
        self.requests += 1
        return data


def build_checkpoint_reader(checkpoint, store: Store):
    """DCP's reader for a checkpoint where it lies. In a bucket, each rank reads only the byte
    ranges of the records it loads, straight from storage: no node downloads the checkpoint
    whole (at 70B, full fine-tuning's optimizer state is most of a terabyte), and no local copy
    can be overwritten under a rank still reading it."""
    import pyarrow.fs as pafs
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    from app.compat import record_reader_base

    if isinstance(checkpoint.filesystem, pafs.LocalFileSystem):
        return FileSystemReader(checkpoint.path)
    fs, root = store.resolve(f"s3://{checkpoint.path}")

    # Classes local to this function: `eft status` and `report` import this module, and
    # should not pay for importing torch.

    class _RangedFileSystem(FileSystemBase):
        """Read-only: what FileSystemReader asks of a file system, on pyarrow's."""

        def __init__(self):
            self.files: list[RangedFile] = []

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "rb":
                raise ValueError(f"{path}: a checkpoint in storage is read, never written, by restore")
            with fs.open_input_file(str(path)) as f:
                ranged = RangedFile(f)
                self.files.append(ranged)
                yield ranged

        def concat_path(self, path, suffix):
            return f"{str(path).rstrip('/')}/{suffix}"

        def init_path(self, path):
            return str(path)

        def exists(self, path) -> bool:
            return fs.get_file_info(str(path)).type != pafs.FileType.NotFound

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return True

        def rename(self, path, new_path):
            raise NotImplementedError("read-only")

        def mkdir(self, path):
            raise NotImplementedError("read-only")

        def rm_file(self, path):
            raise NotImplementedError("read-only")

    class _RangedReader(record_reader_base()):
        def __init__(self):
            super().__init__(root)
            self.fs, self.path = _RangedFileSystem(), root

        def read_record(self, file, offset: int, length: int) -> bytes:
            # Each record's range is known: one read of it, then torch.load seeks in memory
            # (through the stream it would seek remotely, end first, then start).
            return file.read_range(offset, length)

        @property
        def bytes_read(self) -> int:
            return sum(f.bytes_read for f in self.fs.files)

        @property
        def requests(self) -> int:
            return sum(f.requests for f in self.fs.files)

    return _RangedReader()


def restore(checkpoint, store: Store, model, optimizer, lora: bool) -> RestoredState:
    """Load the latest committed checkpoint into this rank's shards. DCP reshards, so the
    world size may differ from the one that saved it. Collective: every rank calls it."""
    if checkpoint is None:
        return RestoredState()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    train_state = peek_train_state(checkpoint)
    reader = build_checkpoint_reader(checkpoint, store)
    app_state = build_app_state(model, optimizer, lora)
    dcp.load(app_state, storage_reader=reader)
    opts = _state_dict_options(lora)
    set_model_state_dict(model, app_state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, app_state["optim"], options=opts)
    return RestoredState(int(train_state["step"]), int(train_state["rows_consumed"]), True,
                         bytes_read=getattr(reader, "bytes_read", 0))
