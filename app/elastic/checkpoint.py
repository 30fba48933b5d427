"""Checkpoints: the app state ↔ torch.distributed.checkpoint (DCP), and which ones are complete.

Layout of one checkpoint directory (`<run>/checkpoint-<step:08d>/`, written by every rank
through Ray Train, which merges the ranks' files into one directory):
  .metadata, __<rank>_0.distcp   DCP of {"model": trainable params, "optim": optimizer}
  train_state.json               step, rows consumed, seed, world size, dataset (rank 0)
  checkpoint.json                the sidecar (rank 0, written last): every other file's name and
                                 size across all ranks, step, world size, dataset, run identity,
                                 and the run lease's epoch of the driver whose group saved it
For LoRA the model entry holds the adapters only: the frozen base is reloaded from its URI.

The sidecar is the commit. Each rank uploads its own files (`commit_checkpoint`, Ray Train's
upload hook, in the background with checkpoint.async_upload); rank 0 keeps the sidecar out of
the directory that goes up, then checks the run lease (app.lease.Fence) and only then puts the
sidecar up, so an upload that outlived its driver's
hold on the run (a paused driver, taken over meanwhile) is never completed. The check is a read
before a write, so a takeover landing between the two still lets one sidecar through: on
resume, a checkpoint whose sidecar names an epoch older than one that had already begun when
the sidecar landed is set aside (`judge_checkpoints`), whatever its step, unless the driver that
began that epoch saw it complete right before its takeover (`list_committed`: the lease keeps
them as the epoch's `sealed`), so a store's one-second dates never set aside every checkpoint.

A bucket is a trust boundary: DCP's `.metadata` is a pickle, so whoever can write the bucket can
run code in whoever unpickles it. Loading a checkpoint into training or export does (DCP has no
other format); everything that only looks at a run (status, report, the completeness check, resume
selection) reads the JSON sidecar and file listings, and never unpickles anything.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app.lease import EpochStart, Fence, lease_uri, list_epochs, read_lease
from app.storage import Store, StorageError, join

log = logging.getLogger("eft.checkpoint")

TRAIN_STATE = "train_state.json"
SIDECAR = "checkpoint.json"
DCP_METADATA = ".metadata"
SIDECAR_VERSION = 1
CHECKPOINT_PREFIX = "checkpoint-"
# A store dates an object to the second (S3's Last-Modified), so a sidecar that landed within a
# second after a takeover can read as a moment before it. A commit this close to the start of an
# epoch that took the run over counts as after it: setting a good checkpoint aside costs some
# steps, resuming from a fenced-out driver's mixes two drivers' runs. After a release (the
# driver ended, its uploads done) there is nothing to fence, and no slack: a driver's last
# checkpoint stays usable however soon the next one starts. (Holders and the store keep NTP
# time, app.lease.)
COMMIT_TIME_SLACK_S = 1.0


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
    it lists is in storage with exactly the size it had when saved. The ranks upload their files
    in no fixed order, so until the last byte of the last rank is up some listed file is
    missing or short, and an upload cut off halfway never passes. Nothing here unpickles."""
    return inspect_checkpoint(store, ckpt_uri)[0]


def inspect_checkpoint(store: Store, ckpt_uri: str) -> tuple[Optional[str], Optional[dict], Optional[float]]:
    """(why it is incomplete or None, its sidecar, when storage took the sidecar: the commit's
    time in epoch seconds, None if the store gives none)."""
    stats = store.list_file_stats(ckpt_uri)
    if SIDECAR not in stats:
        return f"no {SIDECAR} (an upload cut off, or saved by an eft without sidecars)", None, None
    try:
        sidecar = load_sidecar(store, ckpt_uri)
    except StorageError as err:
        return str(err), None, None
    files = sidecar["files"]
    for needed in (TRAIN_STATE, DCP_METADATA):
        if needed not in files:
            return f"{SIDECAR} lists no {needed}", sidecar, None
    for name, size in files.items():
        if name not in stats:
            return f"{name} is missing", sidecar, None
        if stats[name][0] != size:
            return f"{name} is {stats[name][0]} bytes, {SIDECAR} says {size}", sidecar, None
    return None, sidecar, stats[SIDECAR][1]


def _utc(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds")


def check_commit_epoch(sidecar: dict, committed_at: Optional[float], epochs: dict[int, EpochStart],
                       name: str = "") -> Optional[str]:
    """None unless the checkpoint `name` was committed by a driver that had already lost the
    run: its sidecar names a lease epoch older than one that began before storage took the
    sidecar (or within COMMIT_TIME_SLACK_S after, for an epoch that took the run over), and that
    epoch's taker did not see it complete, with this commit time, right before it took over
    (`sealed`). `epochs`: app.lease.list_epochs."""
    epoch = sidecar.get("lease_epoch")
    if epoch is None or committed_at is None:
        return None  # an unfenced run (no lease), or a store that dates nothing: nothing to judge by
    newer = [(start, e) for e, start in epochs.items() if e > int(epoch)]
    if not newer:
        return None
    # The earliest newer epoch decides: one committed before it began was before all the others.
    first, by = min(newer, key=lambda pair: (pair[0].began, pair[1]))
    if committed_at + (COMMIT_TIME_SLACK_S if first.took_over else 0.0) <= first.began:
        return None
    if name in first.sealed and first.sealed[name] == committed_at:
        return None
    return (f"committed by lease epoch {epoch} at {_utc(committed_at)}, after epoch {by} took the run over at "
            f"{_utc(first.began)}: a driver that had lost the run")


def list_committed(store: Store, run_uri: str, newest: int = 8) -> dict[str, Optional[float]]:
    """{name: commit time} of the complete checkpoints among a run's `newest` checkpoint
    directories: what a driver taking the run lease over seals (app.lease.Lease's `seal`).
    Only the newest matter: the older ones landed long before any takeover."""
    names = sorted(d for d in store.list_dirs(run_uri) if d.startswith(CHECKPOINT_PREFIX))[-newest:]
    committed = {}
    for name in names:
        incomplete, _, committed_at = inspect_checkpoint(store, join(run_uri, name))
        if incomplete is None:
            committed[name] = committed_at
    return committed


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


@dataclass(frozen=True)
class Verdict:
    uri: str
    incomplete: Optional[str] = None  # why it is not complete
    fenced_out: Optional[str] = None  # why it was committed by a driver that had lost the run

    @property
    def usable(self) -> bool:
        return self.incomplete is None and self.fenced_out is None


def judge_checkpoints(store: Store, run_uri: str) -> list[Verdict]:
    """Every checkpoint directory of a run, oldest first, judged: complete, and committed while
    its driver held the run (against the epochs' starts the run lease keeps)."""
    names = [d for d in store.list_dirs(run_uri) if d.startswith(CHECKPOINT_PREFIX)]
    verdicts, epochs = [], None
    for uri in [join(run_uri, d) for d in sorted(names)]:
        incomplete, sidecar, committed_at = inspect_checkpoint(store, uri)
        fenced_out = None
        if incomplete is None and sidecar.get("lease_epoch") is not None:
            if epochs is None:  # read once, and only for a run whose checkpoints carry epochs
                epochs = list_epochs(read_lease(store, lease_uri(run_uri)))
            fenced_out = check_commit_epoch(sidecar, committed_at, epochs, name=uri.rsplit("/", 1)[-1])
        verdicts.append(Verdict(uri, incomplete, fenced_out))
    return verdicts


def list_checkpoints(store: Store, run_uri: str) -> list[str]:
    """URIs of the checkpoints of a run that may be resumed from, oldest first: complete, and
    not committed by a driver that had lost the run."""
    return [v.uri for v in judge_checkpoints(store, run_uri) if v.usable]


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


def commit_checkpoint(store: Store, local_dir: Path, ckpt_uri: str, fence: Optional[Fence] = None,
                      sidecar: Optional[Path] = None) -> None:
    """One rank's part of a checkpoint into storage: its directory, copied as Ray Train's own
    upload copies it; then, for rank 0 (`sidecar`: the sidecar's local file, kept outside the
    directory), the run lease checked and the sidecar put up, the commit. The check comes after
    the upload, not only before the save: with checkpoint.async_upload the upload runs in the
    background for as long as it takes, and the driver may lose the run meanwhile. A lost lease
    raises LeaseError and leaves the sidecar behind: what went up is an incomplete checkpoint."""
    import pyarrow.fs as pafs

    from app.compat import copy_checkpoint_files

    fs, path = store.resolve(ckpt_uri)
    fs.create_dir(path, recursive=True)
    copy_checkpoint_files(str(local_dir), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    if sidecar is not None:
        commit_sidecar(store, ckpt_uri, fence, sidecar)


def commit_sidecar(store: Store, ckpt_uri: str, fence: Optional[Fence], sidecar: Path) -> None:
    """The commit itself: the run lease checked, then the sidecar put up, last."""
    if fence is not None:
        fence.check(store)
    store.write_bytes(join(ckpt_uri, SIDECAR), Path(sidecar).read_bytes())


def save(cfg, store: Store, model, optimizer, *, step: int, rows_consumed: int, world_size: int,
         metrics: Optional[dict], rank: int, lineage: Optional[dict] = None, wait_for_upload: bool = False,
         fence: Optional[Fence] = None, validate: bool = False, direct: bool = False) -> None:
    """Every rank writes its DCP shards to a local dir; Ray Train uploads and merges them into
    `<run>/checkpoint-<step>/` and registers the checkpoint only once every rank's part is up.
    Rank 0 adds train_state.json and, last, the sidecar listing every rank's files (a collective:
    every rank calls this). `lineage` ({"dataset", "identity"}, see app.elastic.resume) goes into the
    sidecar, and its dataset into train_state.json too. `wait_for_upload` overrides
    `checkpoint.async_upload` (a just-in-time save must be up before the group drains).
    `fence`: the run lease's epoch of the driver whose group saves it (app.lease): recorded in the
    sidecar, and checked right before the sidecar goes up (`commit_checkpoint`). `validate`:
    Ray Train runs the trainer's validation function (app.eval.during) on it, off the steps' path.
    `direct` (torchrun, where Ray Train's local mode uploads nothing): the ranks commit it
    themselves, the same files in the same layout (`commit_directly`)."""
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
    sidecar_file = None
    if rank == 0:
        sidecar = build_sidecar(files, step=step, world_size=world_size, lineage=lineage)
        if fence is not None:
            sidecar["lease_epoch"] = fence.epoch
        # Beside the directory, not in it: the directory goes up first, the sidecar last.
        sidecar_file = local.parent / f"{local.name}.{SIDECAR}"
        sidecar_file.write_text(json.dumps(sidecar, indent=2) + "\n")
    if direct:
        commit_directly(cfg, store, local, join(cfg.run_uri, checkpoint_dir_name(step)), fence, sidecar_file, rank)
        return
    mode = CheckpointUploadMode.ASYNC if cfg.checkpoint.async_upload and not wait_for_upload else CheckpointUploadMode.SYNC

    def upload(checkpoint, dir_name: str):
        # Ray Train's documented upload hook (in its upload thread when ASYNC): the same copy its
        # own does, into the same directory, with the lease checked before the sidecar. Ray
        # retries a failed upload, so the sidecar's file goes only once it is up.
        ckpt_uri = join(cfg.run_uri, dir_name)
        commit_checkpoint(store, Path(checkpoint.path), ckpt_uri, fence, sidecar=sidecar_file)
        if sidecar_file is not None:
            sidecar_file.unlink(missing_ok=True)
        fs, path = store.resolve(ckpt_uri)
        return Checkpoint(path, filesystem=fs)

    ray.train.report(dict(metrics or {"step": step}), checkpoint=Checkpoint.from_directory(str(local)),
                     checkpoint_dir_name=checkpoint_dir_name(step), checkpoint_upload_mode=mode,
                     delete_local_checkpoint_after_upload=True, checkpoint_upload_fn=upload, validation=validate)
    if mode == CheckpointUploadMode.SYNC:
        shutil.rmtree(local, ignore_errors=True)


def commit_directly(cfg, store: Store, local: Path, ckpt_uri: str, fence: Optional[Fence], sidecar_file: Optional[Path],
                    rank: int) -> None:
    """Without Ray Train's upload (torchrun): every rank copies its part up, all wait for all, then
    rank 0 commits the sidecar (the lease checked first) and keeps the newest
    `checkpoint.num_to_keep`, as Ray Train's checkpoint manager does. Synchronous: the step waits."""
    import torch.distributed as dist

    try:
        commit_checkpoint(store, local, ckpt_uri)
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            commit_sidecar(store, ckpt_uri, fence, sidecar_file)
            sidecar_file.unlink(missing_ok=True)
            prune_checkpoints(store, cfg.run_uri, cfg.checkpoint.num_to_keep)
        if dist.is_initialized():
            dist.barrier()  # no rank steps on before the checkpoint is committed
    finally:
        shutil.rmtree(local, ignore_errors=True)


def prune_checkpoints(store: Store, run_uri: str, num_to_keep: Optional[int]) -> None:
    """Delete the usable checkpoints older than the newest `num_to_keep` (None keeps all)."""
    if not num_to_keep:
        return
    for uri in list_checkpoints(store, run_uri)[:-num_to_keep]:
        store.delete_prefix(uri)


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


def choose_resume_checkpoint(store: Store, run_uri: str, registered_path: Optional[str]) -> tuple[str, Optional[str]]:
    """What to resume from: ("registered", None) for Ray Train's registered checkpoint (its
    path: `registered_path`), ("storage", uri) for a newer usable one in storage, ("none", None)
    for the start. With async uploads a checkpoint can be fully up when its node dies but not yet
    registered by Ray's controller (which learns of it on its next poll); resuming from it saves
    the steps since the registered one (a just-in-time checkpoint is the typical case). A
    checkpoint committed by a driver that had lost the run is never chosen, registered or not:
    the lost driver's own controller may have registered it."""
    verdicts = judge_checkpoints(store, run_uri)
    usable = [v.uri for v in verdicts if v.usable]
    registered_step = step_of(registered_path) if registered_path is not None else -1
    for verdict in verdicts:
        if verdict.fenced_out is not None:
            log.warning("not resuming from %s: %s", verdict.uri, verdict.fenced_out)
            if step_of(verdict.uri) == registered_step:
                registered_path, registered_step = None, -1
    if usable and step_of(usable[-1]) > registered_step:
        return "storage", usable[-1]
    return ("registered", None) if registered_path is not None else ("none", None)


def select_resume_checkpoint(registered, store: Store, run_uri: str, rank: int):
    """The checkpoint to resume from (`choose_resume_checkpoint`). Rank 0 decides and
    broadcasts, so every rank loads the same one."""
    import ray.train
    import torch.distributed as dist

    choice = [None]
    if rank == 0:
        choice[0] = choose_resume_checkpoint(store, run_uri, registered.path if registered is not None else None)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    kind, uri = choice[0]
    if kind == "registered":
        return registered
    if kind == "none":
        return None
    fs, path = store.resolve(uri)
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
