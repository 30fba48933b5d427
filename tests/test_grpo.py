"""GRPO on real Ray: `eft prepare` with `prepare.format: prompts` writes the parity prompts with
stable ids; a 2-worker GRPO run (FSDP2, LoRA) whose rollouts a pool of actors samples, one actor
lost mid-rollout, scores and trains, and its reward rises; colocated runs through a notice, a grow
and a hard kill stay on its trajectory; reward errors are counted, then stop the run in one line."""

from __future__ import annotations

import json

import pytest

from spot_runs import GRPO_STEPS as STEPS, grpo_cfg, grpo_spot_cfg

from app.observe.metrics import load_metrics
from app.storage import Store

def assert_on_the_straight_trajectory(got: dict, straight: dict, steps: int) -> None:
    """Steps 1..steps have the straight run's prompts, completion lengths, rewards and losses. Each
    group's gradient is the same bits at any world size and the step's sum is taken in float64
    (app/rl/colocated.py), so the policies stay equal bit for bit: what differs is only the order
    in which the logged float64 sums add the ranks' parts, about 1e-16 of them."""
    for step in range(1, steps + 1):
        a, b = straight[step], got[step]
        assert b["rows_consumed"] == a["rows_consumed"] == 4 * step
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-12), step
        assert b["completion_len_mean"] == a["completion_len_mean"], step
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-9, abs=1e-12), step


@pytest.fixture(scope="module")
def prompt_set(grpo_prompt_set):
    return grpo_prompt_set


def test_grpo_run_on_two_workers_raises_its_reward_through_a_lost_rollout_actor(prompt_set):
    """The straight run: 2 workers (FSDP2, LoRA) whose rollouts 2 actors sample
    (`rl.rollout: actors`), one of them dying mid-rollout after it sampled: Ray restarts it, the
    call it held is sent again and its groups are regenerated whole from their seeds, from the
    policy version it reads back from storage. The reward rises, and the spot test below holds
    colocated runs at world sizes 2, 1, 2 and 1 to this run's trajectory: the placement of the
    sampling changes no step."""
    import time

    import ray

    from app.dev.chaos import BackgroundRun
    from app.observe.records import load_events
    from app.rl.actors import NAMESPACE, POLICY_FILE
    from app.storage import join

    _, manifest = prompt_set
    assert manifest["source"]["format"] == "prompts"
    assert manifest["records"]["skipped"] == 2
    cfg, store = grpo_cfg("grpo", rl={"rollout": "actors", "rollout_actors": 2}), Store()
    run = BackgroundRun(cfg, store)
    # Once policy version 2 is out (steps 1 and 2 done), actor 0's next call dies after sampling.
    deadline = time.monotonic() + 300
    while not store.exists(join(cfg.run_uri, "policy", "00000002", POLICY_FILE)):
        assert run.thread.is_alive() and time.monotonic() < deadline, run.result
        time.sleep(0.2)
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == NAMESPACE and a["name"].startswith(f"eft-rollout-{cfg.name}-"))
    assert len(names) == 2 and names[0].endswith("-0"), names
    ray.get(ray.get_actor(names[0], namespace=NAMESPACE).exit_during_next_generate.remote())
    summary = run.join(900)
    assert summary is not None and summary["status"] == "succeeded" and summary["steps"] == STEPS, summary
    starts = [e for e in load_events(store, cfg.run_uri) if e["kind"] == "rollout_actor_start"]
    assert sorted((e["actor"], e["restarted"]) for e in starts) == [(names[0], False), (names[0], True),
                                                                   (names[1], False)], starts
    # The last two policy versions stay in storage (a restarted actor reads them there): the
    # versions before are deleted as the run goes.
    assert store.list_dirs(join(cfg.run_uri, "policy")) == [f"{v:08d}" for v in (STEPS - 2, STEPS - 1)]
    rows = [r for r in load_metrics(store, cfg.run_uri) if "reward_mean" in r]
    curve = [(r["step"], round(r["reward_mean"], 3)) for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = rows[:3], rows[-3:]
    assert sum(r["reward_mean"] for r in last) / 3 > sum(r["reward_mean"] for r in first) / 3 + 0.1, curve
    # Every metric the issue names is logged, from the rollouts and the update.
    for key in ("reward_std", "reward_exact_match", "reward_brevity_reward", "accuracy", "pass_at_g", "frac_zero_std",
                "completion_len_mean", "completion_len_max", "truncated_frac", "clip_frac", "kl", "rollout_s",
                "update_s", "generated_tokens_per_s"):
        assert key in rows[-1], key
    assert rows[-1]["reward_exact_match"] == 0.0  # the base answers in prose: brevity is what it learns
    assert rows[-1]["rows_consumed"] == 4 * STEPS  # prompts, for GRPO
    # `eft status` shows the rollouts.
    from app.report import build_loss_figure, build_status, build_status_rows, load_run

    run = load_run(Store(), cfg.run_uri)
    status = build_status(run)
    status_rows = dict(build_status_rows(status))
    assert status_rows["reward"].startswith(f"{rows[-1]['reward_mean']:.3f} (std ")
    assert status_rows["step time"].startswith("rollout ")
    # `eft report`'s RL panels: the rewards (each function's among them), then time and length.
    figure = build_loss_figure(run, status)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles[1:] == ["rollout rewards", "rollouts: time and length"], titles
    legend = [t.get_text() for t in figure.axes[1].get_legend().get_texts()]
    assert {"reward (mean)", "reward: exact_match", "reward: brevity_reward", "accuracy", "pass@G"} <= set(legend)


def test_a_grpo_run_through_a_notice_a_grow_and_a_hard_kill_ends_on_the_straight_runs_trajectory(spot_scenarios):
    """The straight run's config, sampling colocated, on a cluster of its own (the spot scenario's,
    after its DPO run: tests/scenarios/spot.py, then reclaim_notice_grow_kill.py on its 2 nodes):
    a pre-emption notice on one of its 2 nodes (the just-in-time checkpoint, then 1 worker), a
    node back (a checkpoint before the grow, then 2), then a node killed outright (1 again, from
    the last checkpoint). The rollouts in flight at each loss are dropped and regenerated by their
    seeds, so every step has the straight run's prompts, completions, rewards and losses, at
    world sizes 2, 1, 2 and 1, as the straight run sampled them on actors."""
    straight = {r["step"]: r for r in load_metrics(Store(), grpo_cfg("grpo").run_uri)}
    cfg = grpo_spot_cfg()
    proc, out = spot_scenarios["proc"], spot_scenarios["grpo"]
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    log = json.loads(out.read_text())
    summary = log["summary"]
    assert "error" not in log and log["drain_accepted"], log
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS, summary
    assert summary["world_sizes"] == [2, 1, 2, 1]
    notice, grow, kill = summary["interruptions"]
    assert notice["cause"] == "preemption" and notice["steps_lost"] == 0, notice
    assert notice["jit_checkpoint_step"] == notice["resumed_from_step"] == log["jit_checkpoint_step"], notice
    assert grow["cause"] == "resize" and grow["steps_lost"] == 0, grow
    assert kill["cause"] == "worker_failure" and kill["steps_lost"] <= 4, kill
    print(f"GRPO through a notice, a grow and a kill (for information): notice after step "
          f"{log['notice_after_step']}, late save at {log['jit_checkpoint_step']}, grown at {log['regrown_step']}, "
          f"the kill's steps redone {kill['steps_recomputed']}, recovery {log['recovery_s']}, {log['wall_s']:.0f} s")
    resized = {r["step"]: r for r in load_metrics(Store(), cfg.run_uri)}
    assert sorted(resized) == list(range(1, STEPS + 1))
    assert {resized[s]["world_size"] for s in range(1, STEPS + 1)} == {1, 2}
    assert_on_the_straight_trajectory(resized, straight, STEPS)


def test_reward_errors_leave_their_groups_out_then_past_the_limit_stop_the_run_in_one_line(prompt_set):
    """A reward that raises on the odd numbers: the steps it fails in train on the other groups and
    count the failed ones (`reward_errors`), never scoring them 0; past `rl.max_reward_errors` the
    run ends on one line naming the reward and the prompt. The run is a full fine-tune with a KL
    term, whose reference is a frozen copy of the base: 0 at step 1, then the policy moves off it."""
    from app.rl.rewards import RewardError
    from app.train.launch import run_training

    cfg = grpo_cfg("grpo-errors", lora=None, training={"max_steps": 4, "lr": 1e-4},
                   scaling={"min_workers": 1, "max_workers": 1},
                   rl={"rewards": None, "reward": "app.dev.tasks:brevity_unless_odd_reward", "max_reward_errors": 12,
                       "kl_beta": 0.1},
                   fault_tolerance={"max_failures": 0}, checkpoint={"save_every_steps": 1})
    with pytest.raises(RewardError) as stopped:
        run_training(cfg)
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith("reward app.dev.tasks:brevity_unless_odd_reward failed 13 times, more than "
                           "rl.max_reward_errors=12; last on record "), line
    assert line.endswith(": ValueError: no score for odd numbers"), line
    rows = [r for r in load_metrics(Store(), cfg.run_uri) if "reward_mean" in r]
    assert rows and all(r["reward_errors"] >= 1 for r in rows), rows
    # Only the groups that scored are in the reward: brevity's values, never a 0 for a failure.
    assert all(0.0 < r["reward_mean"] <= 1.0 for r in rows)
    kl = [r["kl"] for r in rows]
    assert len(kl) >= 2 and kl[0] == 0.0 and all(k > 0 for k in kl[1:]), rows
