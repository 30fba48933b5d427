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

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app.storage import Store, StorageError, default_cache_root, ensure_private_dir, join

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
         metrics: Optional[dict], rank: int, lineage: Optional[dict] = None, wait_for_upload: bool = False) -> None:
    """Every rank writes its DCP shards to a local dir; Ray Train uploads and merges them into
    `<run>/checkpoint-<step>/` and registers the checkpoint only once every rank's part is up.
    Rank 0 adds train_state.json and, last, the sidecar listing every rank's files (a collective:
    every rank calls this). `lineage` ({"dataset", "identity"}, see app.train.resume) goes into the
    sidecar, and its dataset into train_state.json too. `wait_for_upload` overrides
    `checkpoint.async_upload` (a just-in-time save must be up before the group drains)."""
    import ray.train
    import torch.distributed.checkpoint as dcp
    from ray.train import Checkpoint
    from ray.train.v2.api.report_config import CheckpointUploadMode

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
        write_sidecar(local, build_sidecar(files, step=step, world_size=world_size, lineage=lineage))
    mode = CheckpointUploadMode.ASYNC if cfg.checkpoint.async_upload and not wait_for_upload else CheckpointUploadMode.SYNC
    ray.train.report(dict(metrics or {"step": step}), checkpoint=Checkpoint.from_directory(str(local)),
                     checkpoint_dir_name=checkpoint_dir_name(step), checkpoint_upload_mode=mode,
                     delete_local_checkpoint_after_upload=True)
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


def fetch_checkpoint(checkpoint, store: Store) -> tuple[Path, bool]:
    """A local copy of a checkpoint's files, downloaded once per node however many of its ranks
    restore, and never rewritten once complete (`Store.cache_locally`: a lock and an atomic
    rename). Ray's own `Checkpoint.as_directory` downloads again into the same directory
    whenever a rank arrives after the first download ended, overwriting files that another
    rank is reading: 3 workers on one node restoring after a kill read a torn `.metadata`.
    Returns (directory, whether it is a copy to remove after the restore)."""
    import pyarrow.fs as pafs

    if isinstance(checkpoint.filesystem, pafs.LocalFileSystem):
        return Path(checkpoint.path), False
    root = ensure_private_dir(default_cache_root()) / "restore"
    return store.cache_locally(f"s3://{checkpoint.path}", cache_root=root), True


def restore(checkpoint, store: Store, model, optimizer, lora: bool) -> RestoredState:
    """Load the latest committed checkpoint into this rank's shards. DCP reshards, so the
    world size may differ from the one that saved it. Collective: every rank calls it."""
    if checkpoint is None:
        return RestoredState()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    local, copied = fetch_checkpoint(checkpoint, store)
    state_file = local / TRAIN_STATE
    if not state_file.exists() or not (local / DCP_METADATA).exists():
        raise RuntimeError(f"checkpoint {checkpoint.path} is incomplete (no {TRAIN_STATE} or .metadata)")
    train_state = json.loads(state_file.read_text())
    app_state = build_app_state(model, optimizer, lora)
    dcp.load(app_state, checkpoint_id=str(local))
    if copied:
        # Every rank of the node has read its shards once all ranks have: the copy can go (a
        # node that restarts many times would otherwise keep a copy of each checkpoint).
        if dist.is_initialized():
            dist.barrier()
        shutil.rmtree(local, ignore_errors=True)
    opts = _state_dict_options(lora)
    set_model_state_dict(model, app_state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, app_state["optim"], options=opts)
    return RestoredState(int(train_state["step"]), int(train_state["rows_consumed"]), True)
