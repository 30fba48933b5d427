"""The data order: a pure function of (manifest, seed), identical at every world size."""

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from app.batch import IGNORE_INDEX, BatchPlan
from app.config import TrainingConfig
from app.data.stream import DataOrder, RankSlice, iter_rank_rows, iter_step_batches
from app.train.loop import lr_at, total_steps

ORDER = DataOrder(shard_starts=(0, 7, 20, 31), shard_rows=(7, 13, 11, 9), seed=3)


def test_each_epoch_visits_every_row_once_in_a_new_order():
    n = ORDER.num_rows
    e0, e1 = ORDER.epoch_row_ids(0), ORDER.epoch_row_ids(1)
    assert sorted(e0.tolist()) == list(range(n)) == sorted(e1.tolist())
    assert e0.tolist() != e1.tolist()
    assert ORDER.row_ids_at(0, 2 * n).tolist() == e0.tolist() + e1.tolist()
    assert ORDER.row_ids_at(n - 3, n + 2).tolist() == e0[-3:].tolist() + e1[:2].tolist()


def test_positions_invert_the_order():
    for epoch in range(3):
        ids = ORDER.epoch_row_ids(epoch)
        assert ORDER.epoch_positions(epoch, ids).tolist() == list(range(ORDER.num_rows))


def test_seed_changes_the_order():
    other = DataOrder(ORDER.shard_starts, ORDER.shard_rows, seed=4)
    assert other.epoch_row_ids(0).tolist() != ORDER.epoch_row_ids(0).tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_rank_slices_partition_every_global_batch(world):
    g = 8
    positions = np.arange(0, 5 * g)
    owners = np.stack([RankSlice(r, world, g).owns(positions) for r in range(world)])
    assert (owners.sum(0) == 1).all()
    for r in range(world):  # each rank owns a contiguous block of floor or ceil G/W slots per step
        slots = positions[owners[r]] % g
        assert set(slots.tolist()) == set(range(r * g // world, (r + 1) * g // world))


def _write_shards(tmp_path, order: DataOrder, seq_len=4):
    uris = []
    for k, (start, rows) in enumerate(zip(order.shard_starts, order.shard_rows)):
        ids = np.arange(start, start + rows)
        tokens = [list(np.full(seq_len, rid, dtype=np.int32)) for rid in ids]
        path = tmp_path / f"train-{k:05d}.parquet"
        pq.write_table(pa.table({"row_id": ids, "input_ids": tokens, "labels": tokens}), path)
        uris.append(str(path))
    return uris


@pytest.mark.parametrize("world,start", [(1, 0), (2, 0), (3, 0), (4, 16), (3, 37)])
def test_ray_data_stream_yields_each_ranks_rows_in_order(ray_cluster, tmp_path, world, start):
    """Through real Ray Data: what rank r reads at step k is exactly its slice of the global batch,
    across an epoch boundary, from any start position (resume), also when W does not divide G
    (ranks take 2 or 3 of 8 rows and pad to the same number of micro-batches)."""
    check_each_ranks_rows(tmp_path, world, start, reader="ray")


@pytest.mark.parametrize("world,start", [(1, 0), (2, 0), (3, 0), (4, 16), (3, 37)])
def test_the_direct_reader_yields_what_ray_data_yields(tmp_path, world, start):
    """torchrun's reader (pyarrow in the rank's process, no Ray) meets the same expectations as
    Ray Data above, case for case: each rank gets the same rows at the same steps."""
    check_each_ranks_rows(tmp_path, world, start, reader="direct")


def check_each_ranks_rows(tmp_path, world: int, start: int, reader: str) -> None:
    g, steps, micro = 8, 8, 2
    uris = _write_shards(tmp_path, ORDER)
    expected = ORDER.row_ids_at(start, start + steps * g).reshape(steps, g)
    accum = BatchPlan(g, world, micro).accum
    seen = []
    for rank in range(world):
        rank_slice = RankSlice(rank, world, g, origin=start)
        lo, hi = rank_slice.bounds
        openings: list[float] = []
        rows = iter_rank_rows(ORDER, uris, pafs.LocalFileSystem(), rank_slice, start=start,
                              on_epoch_start=openings.append, reader=reader)
        batches = iter_step_batches(rows, rank_slice.rows_per_step, micro, accum)
        for k in range(steps):
            step = next(batches)
            assert len(step) == accum and all(len(m[0]) == micro for m in step)
            ids = np.concatenate([m[0] for m in step])
            inputs, labels = np.concatenate([m[1] for m in step]), np.concatenate([m[2] for m in step])
            real = ids >= 0
            assert ids[real].tolist() == expected[k, lo:hi].tolist()
            assert (inputs[real, 0] == ids[real]).all() and (labels[real, -1] == ids[real]).all()
            assert (labels[~real] == IGNORE_INDEX).all()  # padding carries no labels
            seen.extend(ids[real].tolist())
        # One opening per epoch this rank read rows of (what the pre-emption watcher counts on).
        epochs = {p // ORDER.num_rows for k in range(steps) for p in range(start + k * g + lo, start + k * g + hi)}
        assert len(openings) == len(epochs) and all(0 < s < 120 for s in openings), openings
        # Stops this rank's pipeline now, so the ranks' Ray Data executors do not pile up.
        batches.close()
        rows.close()
    assert sorted(seen) == sorted(expected.ravel().tolist())


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    t = TrainingConfig(max_steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, 100, t) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert total_steps(type("C", (), {"training": TrainingConfig(epochs=2, global_batch_size=8)})(), 100) == 25


def test_the_batch_plan_splits_every_step_the_same_way_on_every_rank():
    plan = BatchPlan(10, 3, 2)
    assert [plan.bounds(r) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [plan.rows_per_step(r) for r in range(3)] == [3, 3, 4]
    # Enough micro-batches for the largest share (4 rows): 2 of 2 rows; 2 padding slots in all.
    assert (plan.accum, plan.padding_rows) == (2, 2)
    assert plan.problem(pad_uneven_batches=True) is None
    assert plan.problem(pad_uneven_batches=False) == \
        "training.global_batch_size 10 cannot be split into 3 workers x micro_batch_size 2"
    assert BatchPlan(12, 3, 2).problem(False) is None and BatchPlan(12, 3, 2).accum == 2
    assert "some workers would get no rows" in BatchPlan(2, 3, 1).problem(True)


def test_opens_epoch_marks_the_steps_whose_rows_begin_an_epoch():
    from app.data.stream import opens_epoch

    # 187 rows an epoch, 12 a step: steps start at 0, 12, ..., 180 (crosses 187), 192, ..., 372 (374).
    starts = [s for s in range(0, 400, 12) if opens_epoch(s, 12, 187)]
    assert starts == [0, 180, 372]
    assert opens_epoch(374, 12, 187) and not opens_epoch(375, 12, 187)  # a step starting on the boundary
    assert all(opens_epoch(s, 12, 5) for s in range(0, 60, 12))  # an epoch shorter than a step
