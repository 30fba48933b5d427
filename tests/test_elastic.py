"""Spot pre-emption on a real multi-node Ray cluster (one machine, `ray.cluster_utils.Cluster`):
a drain notice with a deadline → a just-in-time checkpoint as late as is safe, then the group
drains; the node goes → the run continues on 2 workers from that checkpoint; a node comes back
→ it grows to 3; a node is killed without notice → the run resumes from the last periodic
checkpoint on 2. The committed trajectory consumes every row of each
epoch exactly once, with the rows per step and the losses of an uninterrupted run.

The run is DPO on packed preference pairs with precomputed reference log-probs: the objective
eft adds on top of SFT's step (the reference column travels through every restart, and the loss
is normalized per pair over the global batch at 3 and 2 workers alike). SFT's own N → M exactness
is test_train.py's 3 → 2 → 1 run."""

from __future__ import annotations

import json
import os
import math
from types import SimpleNamespace

import pytest

from app.data.stream import DataOrder
from app.elastic.preemption import PreemptionDrained, PreemptionWatcher
from app.observe.metrics import load_metrics
from app.observe.records import load_events
from app.observe.summary import build_interruptions
from app.storage import Store

STEPS = 140  # the scenario's default (tests/scenarios/spot.py)
RUN = "s3://eft/runs-spot/spot"


@pytest.fixture(scope="module")
def spot_result(spot_scenarios):
    """The DPO part of tests/scenarios/spot.py (conftest.py's `spot_scenarios`, which also takes
    GRPO's run through a node's life on the same cluster afterwards)."""
    proc, out = spot_scenarios["proc"], spot_scenarios["dpo"]
    assert out.exists(), proc.stderr[-4000:]
    # Beside this session's Ray, the scenario's processes still ask their own cluster's state API
    # (Ray Train's placement-group cleaner among them: app/cluster.py's state_api_env).
    assert "Found multiple active Ray instances" not in proc.stderr
    return json.loads(out.read_text()), spot_scenarios["dpo_manifest"]


def test_spot_reclaim_saves_late_drains_and_recomputes_nothing(spot_result):
    """The notice leaves several steps before the deadline: training goes on, the just-in-time
    checkpoint comes after the notice step and is up before the deadline, no step is taken
    after it, and the restart resumes from it: nothing done before the node went is redone."""
    log, _ = spot_result
    summary = log["summary"]
    assert log["drain_accepted"] and summary["status"] == "succeeded" and summary["steps"] == STEPS
    first = summary["interruptions"][0]
    assert first["cause"] == "preemption" and first["steps_lost"] == 0 and first["steps_recomputed"] <= 1, first
    (notice,) = summary["preemption_notices"]
    assert 8 <= notice["step"] < STEPS and notice["plan"] == "late"  # mid-run, with room for a late save
    (late,) = summary["preemption_checkpoints"]
    assert late["notice_step"] == notice["step"] < late["step"] == log["jit_checkpoint_step"]
    assert late["time"] < notice["deadline_ms"] / 1000 and late["seconds_left"] > 0
    events = load_events(Store(), RUN)
    assert [e["step"] for e in events if e["kind"] == "draining"] == [late["step"]]
    assert first["step_at_notice"] == notice["step"]
    assert first["jit_checkpoint_step"] == first["resumed_from_step"] == late["step"]
    assert first["last_step_before"] == late["step"]  # drained: not one step after the save
    print(f"notice at step {notice['step']}, late save at step {late['step']} {late['seconds_left']} s before "
          f"the deadline (for information)")
    assert first["world_size_before"] == 3 and first["world_size_after"] == 2


def test_run_shrinks_grows_back_and_survives_a_hard_kill(spot_result):
    log, _ = spot_result
    summary = log["summary"]
    assert summary["world_sizes"] == [3, 2, 3, 2]
    assert [i["cause"] for i in summary["interruptions"]] == ["preemption", "resize", "worker_failure"]
    assert all(i["steps_recomputed"] <= 10 for i in summary["interruptions"])  # ≤ the checkpoint interval
    # The grow: a checkpoint at the next step boundary before Ray restarts the group bigger, the
    # group stops stepping until then, and the bigger group resumes from it.
    grow = summary["interruptions"][1]
    (saved,) = [e for e in load_events(Store(), RUN) if e["kind"] == "grow_checkpoint"]
    assert (saved["from_workers"], saved["to_workers"]) == (2, 3)
    assert grow["resumed_from_step"] == saved["step"] == grow["last_step_before"], (grow, saved)
    assert grow["steps_recomputed"] <= 1 and grow["steps_lost"] == 0
    # Every restart's phases add up to its recovery time.
    for item in summary["interruptions"]:
        assert sum(item["phases"].values()) == pytest.approx(item["recovery_s"], abs=0.05), item
    kill = summary["interruptions"][2]
    # No notice, so no just-in-time save: it resumes from the last checkpoint before the kill.
    assert kill["step_at_notice"] is None and kill["resumed_from_step"] <= kill["last_step_before"]


def test_restarts_after_node_loss_are_sized_on_the_live_nodes(spot_result):
    """Each restart after a node loss launches straight away on the nodes still alive: the
    controller's events show one launch per worker group that ran, each sized on what the
    live nodes held, and no launch that failed, so no worker-group start timeout was waited
    out. (How many seconds recovery takes is measured by bench/elastic_recovery.py.)"""
    log, _ = spot_result
    print(f"recovery seconds (for information): {log['recovery_s']}")
    events = load_events(Store(), RUN)
    controller = [e for e in events if e["kind"] in ("worker_group_launch", "worker_group_failure")]
    launches = [e for e in controller if e["kind"] == "worker_group_launch"]
    failures = [e for e in controller if e["kind"] == "worker_group_failure"]
    assert [e["num_workers"] for e in launches] == log["summary"]["world_sizes"] == [3, 2, 3, 2], controller
    for launch in launches:
        assert launch["num_workers"] == min(launch["max_workers"], launch["live_capacity"]), launch
    # Each node loss: one failure, retried, then a launch on the 2 nodes left, with nothing in
    # between. A restart sized on stale capacity would show a launch of 3 failing out of
    # SCHEDULING (a start timeout) before the launch of 2.
    assert [(e["kind"], e.get("num_workers")) for e in controller] == [
        ("worker_group_launch", 3), ("worker_group_failure", None), ("worker_group_launch", 2),
        ("worker_group_launch", 3), ("worker_group_failure", None), ("worker_group_launch", 2)], controller
    assert [f["decision"] for f in failures] == ["RETRY", "RETRY"]
    assert all(f["from_state"] != "SCHEDULING" and f["to_state"] == "RESTARTING" for f in failures), failures
    assert not [f for f in failures if "Startup" in f["error"] or "Startup" in str(f["cause"])], failures
    # The launches bracket the node losses: the preempted node removed, the other one killed.
    assert launches[0]["time"] < log["removed_at"] < failures[0]["time"] < launches[1]["time"]
    assert launches[2]["time"] < log["killed_at"] < failures[1]["time"] < launches[3]["time"]


def test_committed_trajectory_is_exactly_once_and_matches_the_uninterrupted_run(spot_result):
    log, manifest = spot_result
    store = Store()
    metrics = load_metrics(store, RUN)
    reference = load_metrics(store, "s3://eft/runs-spot/spot-reference")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    order = DataOrder.from_manifest(manifest, seed=0)
    n = order.num_rows
    consumed = [r for m in metrics for r in m["row_ids"]]
    for epoch in range(len(consumed) // n + 1):
        part = consumed[epoch * n:(epoch + 1) * n]
        assert len(part) == len(set(part)), f"a row repeats within epoch {epoch}"
    assert sorted(consumed[:n]) == list(range(n))
    full, rest = divmod(STEPS * 12, n)
    assert full >= 1 and log["summary"]["rows_consumed_per_epoch"] == [n] * full + [rest] * bool(rest)
    # The uninterrupted reference runs just past the last restart (tests/scenarios/spot.py): every
    # restart, and steps on 2 workers after the last one, are inside the compared prefix.
    last = log["summary"]["interruptions"][-1]
    assert len(reference) == log["reference_summary"]["steps"] == min(STEPS, last["last_step_before"] + 5)
    assert last["resumed_from_step"] < len(reference)
    drift = max(abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(metrics, reference))
    print(f"max relative loss drift vs the uninterrupted run: {drift:.2e} over {len(reference)} steps")
    for got, want in zip(metrics, reference):
        assert got["row_ids"] == want["row_ids"]
        # Only the summation order differs at 2 vs 3 workers: measured drift ~1e-7 over 100-150 steps
        # at lr 3e-3 (at lr 1e-2 training is chaotic enough to amplify it to ~1e-2).
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]
    assert metrics[len(reference) - 1]["loss"] == pytest.approx(log["reference_summary"]["final_train_loss"],
                                                                rel=1e-4)


# --- the rule and the accounting alone: no Ray, a simulated clock ------------------------------


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def notice(deadline_s, nodes=("node-c",)):
    return SimpleNamespace(preempted_node_ids=list(nodes), preempted_ranks=[2],
                           deadline_ms=None if deadline_s is None else int(deadline_s * 1000))


def build_watcher(clock: FakeClock, infos: dict, gone_at: float = math.inf, save_s: float = 3.0):
    """A watcher whose notice, per step, comes from `infos` ({from step: info}); the node goes
    at `gone_at`. Returns it with the events it records and the flags each collective saw."""
    events, collectives, state = [], [], {"step": 0}

    def get_info():
        return next((infos[s] for s in sorted(infos, reverse=True) if state["step"] >= s), None)

    def agree(flags):
        collectives.append((state["step"], list(flags)))
        return list(flags)

    watcher = PreemptionWatcher(get_info=get_info, agree=agree,
                                record=lambda kind, **fields: events.append({"kind": kind, **fields}),
                                node_alive=lambda node: clock() < gone_at, initial_save_s=save_s,
                                clock=clock, sleep=clock.sleep)
    return watcher, events, collectives, state


def run_steps(watcher, clock, state, steps, step_s=1.0, first=1):
    """Steps of `step_s` until the watcher asks for a save: (step, decision), or (None, None)."""
    for step in range(first, first + steps):
        clock.now += step_s
        state["step"] = step
        decision = watcher.after_step(step)
        if decision is not None:
            return step, decision
    return None, None


def test_watcher_saves_at_the_last_safe_step_then_drains_until_the_node_goes():
    clock = FakeClock()
    # Steps of 1 s; the notice is seen after step 5 (t=1005) with the deadline at t=1025.
    watcher, events, collectives, state = build_watcher(clock, {5: notice(1025.0)}, gone_at=1024.5)
    assert run_steps(watcher, clock, state, 5) == (None, None) and watcher.save_pending
    # The saves between the notice and the late one wait for their uploads (save_pending).
    watcher.record_save(4.0, uploaded=True)
    assert watcher.save_s == 4.0 and watcher.save_timed
    watcher.record_save(3.0, uploaded=True)
    step, decision = run_steps(watcher, clock, state, 40, first=6)
    assert not watcher.save_pending
    # Save when one more step (1 s) + the save (3 s) would leave under the margin (2 s): the
    # first boundary with less than 6 s left is step 20 (t=1020, 5 s left).
    assert (step, decision.drain) == (20, True)
    assert [e["kind"] for e in events] == ["preemption_notice"] and events[0]["plan"] == "late"
    assert events[0]["step"] == 5 and events[0]["seconds_left"] == 20
    # One collective per step while the notice is pending, none before it.
    assert [s for s, _ in collectives] == list(range(5, 21))
    clock.now += 3.0  # the save, as estimated: up 2 s before the deadline
    watcher.record_save(3.0, uploaded=True)
    with pytest.raises(PreemptionDrained, match="node is gone"):
        watcher.drain(step)
    assert clock() == pytest.approx(1024.5, abs=0.5)  # waited for the node, not the deadline + grace
    checkpoint, draining = events[1:]
    assert checkpoint["kind"] == "preemption_checkpoint" and checkpoint["step"] == 20
    assert checkpoint["notice_step"] == 5 and checkpoint["seconds_left"] == 2.0
    assert draining["kind"] == "draining" and draining["nodes"] == ["node-c"]


def test_a_periodic_save_that_leaves_no_room_after_it_becomes_the_late_save():
    """Steps of 1 s, a save of 3 s, a margin of 2 s, the deadline 20 s after the notice: alone,
    the late save comes at step 20 (above). A periodic save due at step 18 (7 s left) would
    leave 4 s, under another step + save + margin: that save is the late one, then the drain."""
    clock = FakeClock()
    watcher, events, _, state = build_watcher(clock, {5: notice(1025.0)}, gone_at=1024.5)
    assert run_steps(watcher, clock, state, 12) == (None, None)  # steps 1-12
    for step in (13, 14, 15, 16, 17):
        clock.now += 1.0
        state["step"] = step
        assert watcher.after_step(step, save_due=False) is None
    clock.now += 1.0
    state["step"] = 18
    decision = watcher.after_step(18, save_due=True)
    assert decision is not None and decision.drain and not watcher.save_pending


def test_a_step_that_opens_an_epoch_is_counted_as_long_as_the_slowest_epoch_opening():
    """Steps of 1 s, a save of 3 s, the deadline 20 s after the notice: alone the late save comes
    at step 20 (above). The group's first step waited 9 s for its pipeline; step 13 overlaps an
    epoch opening, so after step 12 (13 s left) it and the save would leave 1 s, under the
    margin: the late save comes before it, not after a stall that could run past the deadline."""
    clock = FakeClock()
    watcher, events, _, state = build_watcher(clock, {5: notice(1025.0)}, gone_at=1024.5)
    watcher.record_epoch_start(9.0)  # the group's first data wait
    for step in range(1, 13):
        clock.now += 1.0
        state["step"] = step
        decision = watcher.after_step(step, epoch_opening=(step == 3, step == 12))
        assert (decision is not None) == (step == 12), step
    assert watcher.epoch_start_s == 9.0  # step 3's opening took 1 s: it does not lower it
    assert decision.drain and events[0]["plan"] == "late" and events[0]["next_step_s"] == 1.0


def test_watcher_falls_back_to_saving_at_once_when_the_deadline_is_too_close():
    for deadline, reason in ((1008.0, "deadline in 3.0 s"), (None, "no deadline")):
        clock = FakeClock()
        watcher, events, _, state = build_watcher(clock, {5: notice(deadline)})
        step, decision = run_steps(watcher, clock, state, 40)
        assert (step, decision.drain) == (5, False), deadline  # at the notice step, training on
        assert events[0]["plan"] == "now" and events[0]["fallback"].startswith(reason)
        assert run_steps(watcher, clock, state, 40) == (None, None)  # once per notice


def test_watcher_agrees_with_the_most_cautious_rank_and_learns_the_save_time():
    clock = FakeClock()
    watcher, events, collectives, state = build_watcher(clock, {5: notice(1060.0)})
    watcher.agree = lambda flags: [False, True]  # another rank's clock says: now
    step, decision = run_steps(watcher, clock, state, 40)
    assert (step, decision.drain) == (5, True)
    # A timed save of 30 s: a notice 31 s ahead no longer leaves room, so it falls back.
    clock = FakeClock()
    watcher, events, _, state = build_watcher(clock, {5: notice(1036.0)})
    watcher.record_save(30.0, uploaded=True)
    assert run_steps(watcher, clock, state, 40)[0] == 5 and events[0]["plan"] == "now"
    # An asynchronous save's blocked time only raises the estimate, never lowers it.
    watcher.record_save(0.5, uploaded=False)
    assert watcher.save_s == 30.0


def test_interruption_accounting_counts_steps_done_but_not_in_the_checkpoint():
    def start(t, world, resumed, attempt):
        return {"kind": "worker_group_start", "time": t, "id": attempt, "world_size": world,
                "resumed_from_step": resumed}

    def beat(attempt, started, first, last):
        return {"attempt": attempt, "started_at": started, "first_step": first, "first_step_at": started + 5,
                "last_step": last, "last_step_at": started + 50}

    events = [start(0, 3, None, "a"), {"kind": "preemption_notice", "time": 20, "step": 10},
              {"kind": "preemption_checkpoint", "time": 30, "step": 15},
              start(100, 2, 15, "b"),  # late save, drained: resumes from the last step reached
              {"kind": "preemption_notice", "time": 120, "step": 30},
              start(200, 2, 30, "c"),  # saved at the notice, trained on to 36: 6 redone
              start(300, 2, 40, "d")]  # a kill at 47 after the save at 40; the run stopped at 42
    beats = [beat("a", 0, 1, 15), beat("b", 100, 16, 36), beat("c", 200, 31, 47), beat("d", 300, 41, 42)]
    late, at_notice, kill = build_interruptions(events, beats)
    assert (late["cause"], late["jit_checkpoint_step"], late["steps_lost"], late["steps_recomputed"]) == \
        ("preemption", 15, 0, 0)
    assert (at_notice["step_at_notice"], at_notice["steps_lost"], at_notice["steps_recomputed"]) == (30, 6, 6)
    assert (kill["cause"], kill["steps_lost"], kill["steps_recomputed"]) == ("worker_failure", 7, 2)


def test_a_reclaim_schedule_is_seeded_ordered_and_fits_the_run():
    from app.dev.chaos import build_reclaim_schedule

    schedule = build_reclaim_schedule(seed=7, steps=400, notices=2, kills=1, deadline_s=30.0)
    assert schedule == build_reclaim_schedule(seed=7, steps=400, notices=2, kills=1, deadline_s=30.0)
    assert schedule != build_reclaim_schedule(seed=8, steps=400, notices=2, kills=1, deadline_s=30.0)
    assert sorted(r.kind for r in schedule) == ["kill", "notice", "notice"]
    steps = [r.at_step for r in schedule]
    # Apart enough for a deadline, a restart and a return each, all in the run's first two thirds.
    assert steps == sorted(steps) and min(b - a for a, b in zip(steps, steps[1:])) >= 400 * 2 // 3 // 3 // 2
    assert 0 < steps[0] and steps[-1] < 400 * 2 // 3
    assert all((r.deadline_s == 30.0) == (r.kind == "notice") and 10 <= r.return_after_steps <= 30
               for r in schedule)
    with pytest.raises(ValueError, match="too few"):
        build_reclaim_schedule(seed=0, steps=30, notices=2, kills=1)


def test_every_run_from_one_driver_process_gets_the_watcher_and_a_users_off_switch_holds(monkeypatch):
    """eft turns Ray's own pre-emption watcher off (RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0) to put
    its own in; that 0 must not read as the user's on the next run from the same process, nor in a
    process it starts (a second run had no watcher, so no notice reached it). A 0 the user set
    keeps the watcher off."""
    from app.compat import RAY_PREEMPTION_WATCHER_ENV
    from app.elastic.controller import OWN_WATCHER_ENV, build_controller_callbacks

    def has_watcher() -> bool:
        return any("Preemption" in type(c).__name__ for c in build_controller_callbacks(elastic=False))

    monkeypatch.delenv(RAY_PREEMPTION_WATCHER_ENV, raising=False)
    monkeypatch.delenv(OWN_WATCHER_ENV, raising=False)
    assert has_watcher() and has_watcher()
    assert os.environ[RAY_PREEMPTION_WATCHER_ENV] == "0"  # Ray's own stays off
    monkeypatch.setenv(RAY_PREEMPTION_WATCHER_ENV, "0")
    monkeypatch.delenv(OWN_WATCHER_ENV)
    assert not has_watcher()
