"""Each rank reads the weight bytes it owns, straight from the model's URI.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the tensors' bytes, row-major. Under FSDP2 a rank owns a run of
dim-0 rows of each parameter, and rows of a row-major tensor are one contiguous byte range: so a
rank fetches its slice of each tensor with one ranged read, and the ranks of a node read disjoint
ranges. Nothing downloads a full copy of the weights unless a rank needs all of them (DDP: then once
per node, into the node-local cache, and its ranks read from there).

A node keeps the ranges its ranks have read (SliceCache): a restart on a node that survived reads
them from its disk, not from storage, as long as the world size (so the ranges) is the same.

LoRA adapters are in no checkpoint: their init is a function of (seed, parameter name) alone, so
every rank draws the same full tensor and keeps its slice, at any world size, with no broadcast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union
from urllib.parse import quote

import torch
import torch.nn as nn

from app.compat import local_shape_and_offset
from app.model.architecture import ModelError
from app.storage import Store, default_cache_root, ensure_private_dir, is_s3, join, s3_endpoint

log = logging.getLogger("eft.weights")

INDEX = "model.safetensors.index.json"
# The files a model directory's weights may live in: left out of the node-local copy of the small
# files (config, tokenizer) when every rank reads its own slices.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# Ranged reads in flight per rank: a store answers many GETs at once far faster than in turn.
READ_THREADS = 8
# Reads done but not yet placed, at most: bounds the host memory a slow placement can pile up.
READ_AHEAD = 2 * READ_THREADS


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie: `offset` is absolute in the file."""

    uri: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def read_rows(self, store: Union[Store, SliceCache], start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of dim 0 (the whole tensor for a 0-d one), as stored."""
        if not self.shape:
            data = store.read_range(self.uri, self.offset, self.dtype.itemsize)
            return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(())
        if count == 0:
            return torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        data = store.read_range(self.uri, self.offset + start * self.row_bytes, count * self.row_bytes)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(count, *self.shape[1:])


class SliceCache:
    """The byte ranges of one model (at one listing) this node has read, one file per
    (file, offset, length) on local disk. Any local rank that asks for a range read before gets it
    from here; a range never read (another world size cuts other slices) comes from storage and is
    kept. A slice file is written whole and renamed into place, so a killed writer leaves no slice
    that looks complete; one whose size is not its length is read again from storage."""

    def __init__(self, store: Store, model_uri: str, directory: Path):
        self.store, self.model_uri, self.directory = store, model_uri.rstrip("/"), directory
        self._write_failed = False

    def path(self, uri: str, offset: int, length: int) -> Path:
        name = quote(uri[len(self.model_uri):].lstrip("/"), safe="")
        return self.directory / f"{name}@{offset}+{length}"

    def read_range(self, uri: str, offset: int, length: int) -> bytes:
        path = self.path(uri, offset, length)
        try:
            with open(path, "rb") as f:
                data = f.read(length + 1)
            if len(data) == length:
                self.store.count_cached(length)
                return data
        except OSError:  # absent, or a disk that fails: storage has the bytes
            pass
        data = self.store.read_range(uri, offset, length)
        self.save(path, data)
        return data

    def save(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as err:
            # A full or read-only disk costs the next start its cache hits, never this load.
            tmp.unlink(missing_ok=True)
            if not self._write_failed:
                self._write_failed = True
                log.warning("cannot keep weight slices in %s (%s); reading them from storage", self.directory, err)


def open_slice_cache(store: Store, uri: str, cache_root: Optional[Path] = None) -> Union[Store, SliceCache]:
    """What the ranks read `uri`'s weights through: the node's SliceCache for a remote model (the
    store itself for a local one, which is on disk already).

    Disk bound: one directory per (endpoint, URI) holds the slices of the model's current listing
    only; opening it drops those of any other listing (weights replaced at the same URI). Within a
    listing, each world size seen adds at most one more copy of the weights, cut differently."""
    if not is_s3(uri):
        return store
    root = ensure_private_dir(default_cache_root()) if cache_root is None else Path(cache_root)
    model_dir = root / "slices" / hashlib.sha256(f"{s3_endpoint(store.endpoint)}|{uri}".encode()).hexdigest()[:24]
    key = store.version_key(uri, store.list_versions(uri))
    directory = model_dir / key
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("cannot keep weight slices in %s (%s); reading them from storage", directory, err)
        return store
    for stale in model_dir.iterdir():
        if stale.name != key:
            shutil.rmtree(stale, ignore_errors=True)
    return SliceCache(store, uri, directory)


def list_safetensors(store: Store, uri: str) -> Optional[dict[str, int]]:
    """{file: size} of a model dir's safetensors files (the index's, when it is sharded); None if
    it has none."""
    sizes = store.list_file_sizes(uri)
    if INDEX in sizes:
        weight_map = store.read_json(join(uri, INDEX)).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{join(uri, INDEX)}: no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if f not in sizes]
        if missing:
            raise ModelError(f"{join(uri, INDEX)}: names {missing[0]}, which is not in {uri}")
        return {f: sizes[f] for f in files}
    files = {f: size for f, size in sorted(sizes.items()) if f.endswith(".safetensors") and "/" not in f}
    return files or None


def read_header(store: Union[Store, SliceCache], uri: str, file_size: int) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header alone (two small ranged reads)."""
    (length,) = struct.unpack("<Q", store.read_range(uri, 0, 8))
    if length > file_size - 8:
        raise ModelError(f"{uri}: not a safetensors file (header length {length} past the end)")
    header = json.loads(store.read_range(uri, 8, length))
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ModelError(f"{uri}: tensor {name} has dtype {info['dtype']}, which eft cannot load")
        begin, _ = info["data_offsets"]
        tensors[name] = StoredTensor(uri, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + begin)
    return tensors


def read_safetensors_index(store: Union[Store, SliceCache], uri: str, files: dict[str, int]) -> dict[str, StoredTensor]:
    """Every tensor of the model dir at `uri` (`files` from list_safetensors), by name: where its
    bytes lie."""
    index: dict[str, StoredTensor] = {}
    for name, size in files.items():
        index.update(read_header(store, join(uri, name), size))
    return index


def checkpoint_name(param_name: str) -> str:
    """A (PEFT-wrapped) model's parameter name → the name its tensor has in the HF checkpoint."""
    name = param_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def init_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One LoRA parameter's init, full size in fp32: PEFT's own rule (A: kaiming-uniform with
    a=sqrt(5), B: zeros), drawn from a generator seeded by (seed, name) alone, so every rank and
    every world size draws the same values."""
    weight = torch.zeros(shape, dtype=torch.float32)
    if ".lora_A." in name:
        generator = torch.Generator().manual_seed(name_seed(seed, name))
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    elif ".lora_B." not in name:
        raise ModelError(f"{name}: an adapter parameter eft has no init for (only lora_A / lora_B)")
    return weight


def is_adapter(name: str) -> bool:
    return ".lora_" in name


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Overwrite a fully materialized PEFT model's adapters with the deterministic init."""
    for name, param in model.named_parameters():
        if is_adapter(name):
            param.copy_(init_adapter(name, tuple(param.shape), seed))


def local_slice(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the tensor this rank holds, its shape, its offset in the global tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, tuple(param.shape), (0,) * param.dim()
    shape, offset = local_shape_and_offset(param)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ModelError(f"local shard {tuple(local.shape)} is not the placement's {tuple(shape)}")
    return local, tuple(shape), tuple(offset)


def narrow_to(tensor: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...], first_dim: int = 0) -> torch.Tensor:
    """This rank's part of `tensor`. Rows read from storage already cover dim 0 (first_dim=1); a
    shard on another dim (not FSDP2's default) is cut here."""
    for dim in range(first_dim, len(shape)):
        tensor = tensor.narrow(dim, offset[dim], shape[dim])
    return tensor


@torch.no_grad()
def load_owned_weights(model: nn.Module, store: Store, uri: str, files: dict[str, int], buffers: dict,
                       device: torch.device, seed: int, cache_root: Optional[Path] = None) -> None:
    """Materialize `model` (meta device, FSDP2-sharded or not) on `device`; fill each parameter's
    local part from the bytes at `uri` this rank owns (through the node's SliceCache under
    `cache_root`), adapters from their deterministic init, and buffers from `buffers`
    (non-persistent ones, such as rotary frequencies, are in no file)."""
    model.to_empty(device=device)
    for name, buf in model.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name].to(device=device, dtype=buf.dtype))
    reader = open_slice_cache(store, uri, cache_root)
    index = read_safetensors_index(reader, uri, files)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    # A tied head is in no file: it reads its source's bytes (from_pretrained's values; the meta
    # build does not tie, so it stays a separate parameter, as the broadcast path left it).
    tied = inner.get_expanded_tied_weights_keys(all_submodels=True) if hasattr(
        inner, "get_expanded_tied_weights_keys") else {}
    jobs = []
    for name, param in model.named_parameters():
        local, shape, offset = local_slice(param)
        if is_adapter(name):
            local.copy_(narrow_to(init_adapter(name, tuple(param.shape), seed), shape, offset))
            continue
        stored = index.get(checkpoint_name(name)) or index.get(tied.get(checkpoint_name(name), ""))
        if stored is None:
            raise ModelError(f"{uri}: no tensor {checkpoint_name(name)} in its safetensors files")
        if stored.shape != tuple(param.shape):
            raise ModelError(f"{uri}: tensor {checkpoint_name(name)} has shape {list(stored.shape)}, "
                               f"the model wants {list(param.shape)}")
        jobs.append((local, shape, offset, stored))

    def fetch(job):
        local, shape, offset, stored = job
        start, count = (offset[0], shape[0]) if shape else (0, 1)
        return stored.read_rows(reader, start, count)

    def place(job, rows):
        local, shape, offset, _ = job
        # Cast as from_pretrained does (e.g. stored bf16 → fp32 masters on CPU).
        local.copy_(narrow_to(rows.result(), shape, offset, first_dim=1).to(dtype=local.dtype))

    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="eft-weights") as pool:
        pending: deque = deque()
        for job in jobs:
            pending.append((job, pool.submit(fetch, job)))
            if len(pending) > READ_AHEAD:
                place(*pending.popleft())
        while pending:
            place(*pending.popleft())


def load_mode(parallelism: str, safetensors: Optional[dict[str, int]]) -> str:
    """How the weights reach the ranks: `ranged` (each rank reads its slices from storage),
    `node_cache` (DDP: every rank needs all of it; one download per node, ranks read that copy),
    `rank0_broadcast` (no safetensors files: rank 0 loads .bin weights and broadcasts them)."""
    if safetensors is None:
        return "rank0_broadcast"
    return "ranged" if parallelism == "fsdp" else "node_cache"


def describe_stored_weights(store: Store, model_uri: str, parallelism: str) -> tuple[str, int]:
    """(how the ranks load the weights at `model_uri`, the weights' bytes in storage): what the
    `weights_loaded` event reports beside the bytes each rank read."""
    files = list_safetensors(store, model_uri)
    weights = sum(files.values()) if files else \
        sum(size for name, size in store.list_file_sizes(model_uri).items() if name.endswith(WEIGHT_SUFFIXES))
    return load_mode(parallelism, files), weights
