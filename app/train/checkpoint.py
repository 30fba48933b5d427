"""Checkpoints: the app state ↔ torch.distributed.checkpoint (DCP), and which ones are complete.

Layout of one checkpoint directory (`<run>/checkpoint-<step:08d>/`, written by every rank
through Ray Train, which merges the ranks' files into one directory):
  .metadata, __<rank>_0.distcp   DCP of {"model": trainable params, "optim": optimizer}
  train_state.json               step, rows consumed, seed, world size, scheduler (rank 0)
For LoRA the model entry holds the adapters only: the frozen base is reloaded from its URI.
"""

from __future__ import annotations

import pickle
from typing import Optional

from app.storage import Store, join

TRAIN_STATE = "train_state.json"
CHECKPOINT_PREFIX = "checkpoint-"


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def is_complete(store: Store, ckpt_uri: str) -> bool:
    """Complete = train_state.json, DCP metadata, and every file the metadata refers to.
    A checkpoint whose upload was cut off fails this and is never loaded."""
    files = set(store.list_files(ckpt_uri))
    if TRAIN_STATE not in files or ".metadata" not in files:
        return False
    try:
        meta = pickle.loads(store.read_bytes(join(ckpt_uri, ".metadata")))
    except Exception:
        return False
    needed = {info.relative_path for info in (meta.storage_data or {}).values()}
    return needed <= files


def list_checkpoints(store: Store, run_uri: str) -> list[str]:
    """URIs of the complete checkpoints of a run, oldest first."""
    names = [d for d in store.list_dirs(run_uri) if d.startswith(CHECKPOINT_PREFIX)]
    uris = [join(run_uri, d) for d in sorted(names)]
    return [u for u in uris if is_complete(store, u)]


def find_latest_checkpoint(store: Store, run_uri: str) -> Optional[str]:
    found = list_checkpoints(store, run_uri)
    return found[-1] if found else None


def load_train_state(store: Store, ckpt_uri: str) -> dict:
    return store.read_json(join(ckpt_uri, TRAIN_STATE))
