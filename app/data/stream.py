"""Prepared shards → the rows each worker consumes, in an order fixed by the seed alone.

The data order is a pure function of (manifest, seed), never of the world size or of which
worker asked for a block first (Ray Data's `streaming_split` hands blocks out first come,
first served, so it cannot give a reproducible trajectory):

* Epochs follow each other into one endless sequence of rows; a global position `p` is
  epoch `p // N`, offset `p % N` (N = train rows). Epoch e visits the shards in a permuted
  order and each shard's rows in a permuted order, both drawn from (seed, epoch[, shard]).
* Optimizer step k consumes positions [k*G, (k+1)*G) (G = global batch), so the rows of a
  step are the same at every world size; worker r of W takes slots [r*G//W, (r+1)*G//W).
* The data position is one integer: rows consumed. Resuming at any world size skips exactly
  those rows; rows a worker had prefetched but not consumed are simply read again.

Each worker streams its share with Ray Data (`read_parquet` of the shards still ahead, in
epoch order, and a filter that drops other workers' rows before they leave the read task). Under
torchrun there is no Ray cluster to run read tasks on: the same shards are read in the same order
by pyarrow in the rank's own process (`reader="direct"`), through the same filter and the same
reorder buffer, so a rank gets exactly the rows it would get from Ray Data at that world size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from app.batch import IGNORE_INDEX as IGNORE, BatchPlan

log = logging.getLogger(__name__)
READ_CPUS = 0.25
READ_CONCURRENCY = 2


@dataclass(frozen=True)
class DataOrder:
    """The deterministic visiting order of a split's rows. Small and picklable."""

    shard_starts: tuple[int, ...]  # row_id_start of each shard, in manifest order
    shard_rows: tuple[int, ...]
    seed: int

    @classmethod
    def from_manifest(cls, manifest: dict, seed: int, split: str = "train") -> "DataOrder":
        shards = manifest["splits"][split]["shards"]
        return cls(tuple(s["row_id_start"] for s in shards), tuple(s["rows"] for s in shards), seed)

    @property
    def num_rows(self) -> int:
        return int(sum(self.shard_rows))

    def shard_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shard_rows))

    def row_perm(self, epoch: int, shard: int) -> np.ndarray:
        """Position within the shard's visit → row index within the shard."""
        return np.random.default_rng([self.seed, epoch, shard, 1]).permutation(self.shard_rows[shard])

    def epoch_row_ids(self, epoch: int) -> np.ndarray:
        """All row_ids of an epoch, in visiting order."""
        parts = [self.shard_starts[s] + self.row_perm(epoch, s) for s in self.shard_order(epoch)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def row_ids_at(self, start: int, stop: int) -> np.ndarray:
        """row_ids at global positions [start, stop) — what steps start//G .. consumed."""
        n = self.num_rows
        out, pos = [], start
        while pos < stop:
            epoch, offset = divmod(pos, n)
            take = min(stop - pos, n - offset)
            out.append(self.epoch_row_ids(epoch)[offset:offset + take])
            pos += take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def epoch_positions(self, epoch: int, row_ids: np.ndarray) -> np.ndarray:
        """Inverse of the visiting order: the within-epoch position of each row_id."""
        starts = np.asarray(self.shard_starts)
        shard = np.searchsorted(starts, row_ids, side="right") - 1
        order = self.shard_order(epoch)
        rank_of_shard = np.empty_like(order)
        rank_of_shard[order] = np.arange(len(order))
        visit_offset = np.zeros(len(order), dtype=np.int64)
        visit_offset[order] = np.concatenate([[0], np.cumsum(np.asarray(self.shard_rows)[order])[:-1]])
        positions = np.empty(len(row_ids), dtype=np.int64)
        for s in np.unique(shard):
            mask = shard == s
            inverse = np.empty(self.shard_rows[s], dtype=np.int64)
            inverse[self.row_perm(epoch, s)] = np.arange(self.shard_rows[s])
            positions[mask] = visit_offset[s] + inverse[row_ids[mask] - self.shard_starts[s]]
        return positions


@dataclass(frozen=True)
class RankSlice:
    """Which global positions one worker consumes: slot ((p - origin) mod G) in
    [rank*G//W, (rank+1)*G//W), so ranks take floor or ceil of G/W rows when W does not divide G.
    `origin` is where the current run's steps started counting (rows consumed at resume), so a
    global batch changed between runs still splits into whole steps."""

    rank: int
    world_size: int
    global_batch: int
    origin: int = 0

    @property
    def bounds(self) -> tuple[int, int]:
        return BatchPlan(self.global_batch, self.world_size, 1).bounds(self.rank)

    @property
    def rows_per_step(self) -> int:
        lo, hi = self.bounds
        return hi - lo

    def owns(self, positions: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds
        slot = (positions - self.origin) % self.global_batch
        return (slot >= lo) & (slot < hi)


class _KeepRankRows:
    """Ray Data map_batches fn: keep only this worker's rows at positions >= start."""

    def __init__(self, order: DataOrder, epoch: int, rank_slice: RankSlice, start: int):
        self.order, self.epoch, self.slice, self.start = order, epoch, rank_slice, start

    def __call__(self, batch: dict) -> dict:
        row_ids = np.asarray(batch["row_id"], dtype=np.int64)
        positions = self.epoch * self.order.num_rows + self.order.epoch_positions(self.epoch, row_ids)
        keep = self.slice.owns(positions) & (positions >= self.start)
        return {key: np.asarray(value)[keep] for key, value in batch.items()}


def _stack(column) -> np.ndarray:
    if isinstance(column, np.ndarray) and column.dtype != object:
        return column
    return np.stack([np.asarray(x) for x in column])


def document_isolation(cfg, manifest: dict, note: bool = True) -> bool:
    """Whether training passes position_ids, keeping attention inside each packed document. A
    dataset prepared before shards carried them trains as before, across documents, with a note."""
    if cfg.data.cross_document_attention:
        return False
    if manifest.get("position_ids"):
        return True
    if note:
        log.warning("note: %s was prepared without position_ids, so packed documents attend across their "
                    "boundaries; prepare it again to keep them apart (data.cross_document_attention: true "
                    "silences this note)", cfg.data.uri)
    return False


def read_columns(position_ids: bool, ref_logps: bool = False) -> list[str]:
    return (["row_id", "input_ids", "labels"] + (["position_ids"] if position_ids else [])
            + (["ref_logps"] if ref_logps else []))


def read_ray_data(paths: list[str], filesystem, columns: list[str], keep: "_KeepRankRows",
                  prefetch_batches: int) -> Iterator[dict]:
    """The shards' rows this rank keeps, as numpy batches, from Ray Data's read tasks."""
    import ray

    configure_data_context()
    # Few, light read tasks per worker: every worker runs its own pipeline, and a burst of
    # task processes costs more than it gains on the CPUs the trainer leaves free.
    ds = ray.data.read_parquet(paths, filesystem=filesystem, columns=columns, num_cpus=READ_CPUS,
                               concurrency=READ_CONCURRENCY)
    ds = ds.map_batches(keep, batch_format="numpy", batch_size=None, num_cpus=READ_CPUS,
                        compute=ray.data.TaskPoolStrategy(size=READ_CONCURRENCY))
    yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=prefetch_batches)


def read_direct(paths: list[str], filesystem, columns: list[str], keep: "_KeepRankRows",
                prefetch_batches: int = 0) -> Iterator[dict]:
    """The same rows without a Ray cluster (torchrun): each shard read by pyarrow in this process,
    one at a time, through the same filter. The caller's prefetch thread overlaps it with steps."""
    import pyarrow.parquet as pq

    for path in paths:
        kept = keep(numpy_batch(pq.read_table(path, columns=columns, filesystem=filesystem), columns))
        if len(kept["row_id"]):  # a shard of other ranks' rows only: nothing to hand on
            yield kept


def iter_rank_rows(order: DataOrder, shard_uris: list[str], filesystem, rank_slice: RankSlice,
                   start: int, prefetch_batches: int = 2, position_ids: bool = False, ref_logps: bool = False,
                   on_epoch_start: Optional[Callable[[float], None]] = None, reader: str = "ray") -> Iterator[tuple]:
    """Yield (row_id, input_ids, labels, position_ids or None) for this worker, from global position
    `start` on, forever. `position_ids`: read that column (the shards must have it). `ref_logps`:
    read the precomputed reference log-probs too (one per document of the row), as a fifth item.
    `on_epoch_start`: called with the seconds each epoch's pipeline took from its start to its
    first row (the cost of an epoch opening, measured even where a step never waited for it).
    `reader`: "ray" (Ray Data) or "direct" (pyarrow in this process, for torchrun): the same rows."""
    read = {"ray": read_ray_data, "direct": read_direct}[reader]
    n = order.num_rows
    epoch = start // n
    while True:
        opened = time.monotonic()
        offset = max(start - epoch * n, 0)
        expected = order.epoch_row_ids(epoch)
        positions = epoch * n + np.arange(n)
        expected = expected[rank_slice.owns(positions) & (positions >= start)]
        shard_seq = order.shard_order(epoch)
        ends = np.cumsum(np.asarray(order.shard_rows)[shard_seq])
        first = int(np.searchsorted(ends, offset, side="right"))  # shards wholly consumed are not read
        paths = [shard_uris[s] for s in shard_seq[first:]]
        keep = _KeepRankRows(order, epoch, rank_slice, start)
        buffered: dict[int, tuple] = {}
        nxt = 0
        for batch in read(paths, filesystem, read_columns(position_ids, ref_logps), keep, prefetch_batches):
            ids, inputs, labels = batch["row_id"], _stack(batch["input_ids"]), _stack(batch["labels"])
            positions = _stack(batch["position_ids"]) if position_ids else None
            for i, rid in enumerate(ids.tolist()):
                row = (inputs[i], labels[i], None if positions is None else positions[i])
                buffered[rid] = row + (np.asarray(batch["ref_logps"][i], dtype=np.float32),) if ref_logps else row
            while nxt < len(expected) and int(expected[nxt]) in buffered:
                if nxt == 0 and on_epoch_start is not None:
                    on_epoch_start(time.monotonic() - opened)
                rid = int(expected[nxt])
                yield (rid, *buffered.pop(rid))
                nxt += 1
        if nxt != len(expected):
            raise RuntimeError(f"epoch {epoch}: stream ended after {nxt} of {len(expected)} rows "
                               f"(dataset changed under the run?)")
        epoch += 1


def opens_epoch(start_row: int, rows: int, epoch_rows: int) -> bool:
    """Whether the global rows [start_row, start_row + rows) include an epoch's first row: a step
    that waits for a new pipeline to start."""
    return start_row % epoch_rows == 0 or start_row // epoch_rows != (start_row + rows - 1) // epoch_rows


# Trimmed micro-batches keep a width that is a multiple of this: few distinct shapes for the kernels.
TRIM_WIDTH_STEP = 8


def trim_micro_batch(micro: tuple, step: int = TRIM_WIDTH_STEP) -> tuple:
    """A micro-batch cut after its longest row's last trained token, rounded up to a multiple of
    `step` (at most the rows' width). What follows a row's last label changes none of its loss
    (attention is causal), so this is exact; it is what makes unpacked rows cheap."""
    row_ids, inputs, labels, positions, *rest = micro
    labelled = labels != IGNORE
    width = labels.shape[1]
    if labelled.any():
        last = width - int(np.argmax(labelled[:, ::-1], axis=1)[labelled.any(axis=1)].min())
        width = min(width, -(-last // step) * step)
    else:
        width = min(width, step)
    return (row_ids, inputs[:, :width], labels[:, :width], None if positions is None else positions[:, :width], *rest)


def iter_step_batches(rows: Iterator[tuple], rows_per_step: int, micro_batch: int, accum: int, trim: bool = False,
                      ) -> Iterator[list[tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]]]:
    """One optimizer step's micro-batches at a time: `accum` × (row_ids, input_ids [B, T],
    labels [B, T], position_ids [B, T] or None[, the rows' reference log-probs end to end]). Slots
    past this rank's `rows_per_step` rows are padding: row_id -1 and no labels (so no pairs), so
    they add nothing to the loss or the gradient. `trim` (a dataset prepared without packing): each
    micro-batch ends after its longest row's last trained token (trim_micro_batch)."""
    slots = accum * micro_batch
    while True:
        chunk = [next(rows) for _ in range(rows_per_step)]
        extra = slots - rows_per_step
        ids = np.array([c[0] for c in chunk] + [-1] * extra, dtype=np.int64)
        inputs = np.stack([c[1] for c in chunk] + [chunk[0][1]] * extra)
        labels = np.stack([c[2] for c in chunk] + [np.full_like(chunk[0][2], IGNORE)] * extra)
        has_positions = len(chunk[0]) > 3 and chunk[0][3] is not None
        positions = np.stack([c[3] for c in chunk] + [chunk[0][3]] * extra) if has_positions else None
        micro = [(ids[i:i + micro_batch], inputs[i:i + micro_batch], labels[i:i + micro_batch],
                  None if positions is None else positions[i:i + micro_batch])
                 for i in range(0, slots, micro_batch)]
        if len(chunk[0]) > 4:
            refs = [c[4] for c in chunk] + [np.zeros(0, np.float32)] * extra
            micro = [m + (np.concatenate(refs[i:i + micro_batch]),) for m, i in zip(micro, range(0, slots, micro_batch))]
        yield [trim_micro_batch(m) for m in micro] if trim else micro


def prefetch_in_background(iterator: Iterator, depth: int) -> Iterator:
    """Pull from `iterator` on a thread, `depth` items ahead, starting now. Started before the
    model is built, the data pipeline's start-up (worker processes, first reads) overlaps it."""
    import queue
    import threading

    items: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    done = object()

    def pump() -> None:
        try:
            for item in iterator:
                items.put(item)
        except BaseException as err:  # handed to the consumer, raised there
            items.put(err)
        items.put(done)

    threading.Thread(target=pump, name="eft-prefetch", daemon=True).start()

    def drain() -> Iterator:
        while True:
            item = items.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    return drain()


def configure_data_context() -> None:
    import ray

    ctx = ray.data.DataContext.get_current()
    # Blocks in input order: the reorder buffer then holds one shard, and limits are stable.
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    # The v2 Parquet reader provisions 32 footer-reader actors per read: seconds of process
    # start-up per dataset, and every worker builds one per epoch. The v1 reader starts in ms.
    ctx.use_datasource_v2 = False


def load_split_rows(shard_uris: list[str], filesystem, limit: Optional[int] = None,
                    position_ids: bool = False, ref_logps: bool = False, reader: str = "ray") -> dict[str, np.ndarray]:
    """A small split (validation) read whole, in row_id order (with position_ids and the reference
    log-probs if asked: those as a list of per-row arrays). `reader` as for `iter_rank_rows`: the
    first `limit` rows in shard order either way."""
    columns = read_columns(position_ids, ref_logps)
    if not shard_uris:
        return {"row_id": np.zeros(0, np.int64), **{c: np.zeros((0, 0), np.int32) for c in columns[1:]}}
    if reader == "direct":
        parts = list(_read_whole(shard_uris, filesystem, columns, limit))
    else:
        import ray

        configure_data_context()
        ds = ray.data.read_parquet(shard_uris, filesystem=filesystem, columns=columns,
                                   num_cpus=READ_CPUS, concurrency=READ_CONCURRENCY)
        if limit is not None:
            ds = ds.limit(limit)
        parts = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    row_id = np.concatenate([p["row_id"] for p in parts])
    order = np.argsort(row_id, kind="stable")
    out = {"row_id": row_id[order],
           **{c: np.concatenate([_stack(p[c]) for p in parts])[order] for c in columns[1:] if c != "ref_logps"}}
    if ref_logps:
        refs = [np.asarray(r, dtype=np.float32) for p in parts for r in p["ref_logps"]]
        out["ref_logps"] = [refs[i] for i in order]
    return out


def _read_whole(shard_uris: list[str], filesystem, columns: list[str], limit: Optional[int]) -> Iterator[dict]:
    """Shards in order, as numpy batches, up to `limit` rows (Ray Data's `limit` with order kept)."""
    import pyarrow.parquet as pq

    left = limit
    for path in shard_uris:
        if left is not None and left <= 0:
            return
        table = pq.read_table(path, columns=columns, filesystem=filesystem)
        if left is not None:
            table = table.slice(0, left)
            left -= table.num_rows
        yield numpy_batch(table, columns)


def numpy_batch(table, columns: list[str]) -> dict:
    """An Arrow table as the numpy batch Ray Data's `batch_format="numpy"` gives (list columns as
    object arrays of rows, which `_stack` turns into 2-D)."""
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in columns}
