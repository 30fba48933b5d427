"""`PreemptionWatcher`: what the training loop does about a spot reclaim notice.

A notice (Ray Train's `get_preemption_info()`: the nodes going and their deadline) used to
trigger a checkpoint at the notice step, after which training went on until the node left,
and every step in between was recomputed after the restart. Now, with a deadline, training
goes on and the just-in-time checkpoint is taken as late as is safe: at the last step
boundary after which another step plus a save would no longer fit before the deadline with a
margin. After that save no step is taken (the group drains) until the node is gone or the
deadline has passed; then every rank raises `PreemptionDrained` and Ray Train restarts the
group from that checkpoint, so nothing done before the node went is thrown away.

A notice without a deadline, or one too close for even one save, falls back to saving at
once and training on (the old behaviour); the event says so.

An epoch's first rows come from a new Ray Data pipeline, started on the prefetch thread a few
steps ahead; its start-up takes CPU and the GIL from the steps it overlaps (one took 10 s against
0.3 s steps on a 2-core box, and the late save then missed its deadline). So when the next step
overlaps an epoch opening it is counted as long as the slowest opening seen in this group: the
group's first data wait (its pipeline's cold start), a step that overlapped a later opening, or
an opening's own time from its pipeline's start to its first row (the group's first opening may
be hidden behind the model's set-up, so that no step waited for it).

Every rank calls `after_step` every step with the same arguments (Ray's call is itself a
barrier that hands every rank rank 0's notice), so all of them save and drain together.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("eft.preemption")

SAVE_LATE = "late"  # a deadline with room: train on, save at the last safe step, then drain
SAVE_NOW = "now"  # no deadline, or too close for a late save: save at once and train on


class PreemptionDrained(RuntimeError):
    """Raised by every surviving rank once its just-in-time checkpoint is up and the node has
    gone (or its deadline passed): the group ends, and Ray Train restarts it from that checkpoint."""


@dataclass(frozen=True)
class SaveDecision:
    """What the loop does at this step boundary: save (now), and whether to drain after."""
    drain: bool
    reason: str


def should_save_now(left_s: float, step_s: float, save_s: float, margin_s: float) -> bool:
    """Whether this is the last step boundary at which a save still fits before the deadline:
    one more step (`step_s`) then the save (`save_s`) would leave less than `margin_s`."""
    return left_s - step_s - save_s < margin_s


def initial_save_estimate(state_bytes: int, fixed_s: float = 3.0, bytes_per_s: float = 50e6) -> float:
    """Seconds a save may take before one has been timed: a fixed cost (DCP planning, the
    report barrier, PUT latencies) plus this rank's state at a modest single-stream upload
    rate. Deliberately pessimistic: too high only means the save comes a little early and the
    group idles a little longer; too low risks a checkpoint cut off by the deadline."""
    return fixed_s + state_bytes / bytes_per_s


class PreemptionWatcher:
    """Owns the notice logic of one worker-group attempt.

    `get_info` returns Ray's PreemptionInfo or None (a barrier: every rank, every step);
    `agree(flags)` makes every rank take the same decisions (elementwise, any rank's True
    wins); `record(kind, **fields)` writes a run event (rank 0 only);
    `node_alive(node_id)` tells whether a node is still up; `clock` is wall time, as the
    deadline is (epoch ms). Injected so the rule can be tested without Ray."""

    def __init__(self, *, get_info: Callable[[], object], agree: Callable[[list[bool]], list[bool]],
                 record: Callable[..., None], node_alive: Callable[[str], bool],
                 initial_save_s: float, min_margin_s: float = 2.0, drain_grace_s: float = 30.0,
                 poll_s: float = 0.5, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.get_info, self.agree, self.record, self.node_alive = get_info, agree, record, node_alive
        self.save_s = initial_save_s
        self.save_timed = False
        self.min_margin_s, self.drain_grace_s, self.poll_s = min_margin_s, drain_grace_s, poll_s
        self.clock, self.sleep = clock, sleep
        self.seen: set = set()
        self.pending = None  # the notice whose late save is still to come
        self.draining = None  # the notice whose late save was taken
        self.noticed_step: Optional[int] = None
        self.step_times: collections.deque = collections.deque(maxlen=8)
        self.epoch_start_s = 0.0  # the slowest epoch opening seen (see record_epoch_start)
        self.next_opens_epoch = False
        self._last_call = clock()
        self._saving_s = 0.0

    @property
    def step_s(self) -> float:
        # The slowest recent step: a step after the notice may be slower than the average.
        return max(self.step_times, default=0.0)

    def next_step_s(self) -> float:
        """What the next step may take: an epoch opening's if it overlaps one."""
        return max(self.step_s, self.epoch_start_s) if self.next_opens_epoch else self.step_s

    def record_epoch_start(self, seconds: float) -> None:
        """What an epoch opening cost: the group's first data wait, or a step that overlapped one."""
        self.epoch_start_s = max(self.epoch_start_s, seconds)

    def margin_s(self) -> float:
        # Clock skew between nodes, the decision's own collective, and save-time jitter. At
        # least a step: step times vary (logging, eval) and being early costs only idle
        # seconds while the group drains, being late costs every step since the last save.
        return max(self.min_margin_s, self.step_s)

    @property
    def save_pending(self) -> bool:
        """A notice's late save is still to come. Until it is, every save waits for its upload:
        a background upload slows the very steps whose times place the late save (one step after
        an asynchronous save took 4 s where steps took 0.2 s on a 2-core box, and the late save
        missed its deadline), and a save that waits is a timed one, so the late save's estimate
        is measured rather than guessed."""
        return self.pending is not None

    def record_save(self, seconds: float, uploaded: bool) -> None:
        """How long the last save blocked. `uploaded`: it waited for the upload too (a
        synchronous save), so it is the full cost; an asynchronous save's blocked time is only
        a lower bound on it."""
        self._saving_s += seconds
        if uploaded:
            self.save_s, self.save_timed = seconds, True
        else:
            self.save_s = max(self.save_s, seconds)

    def after_step(self, step: int, save_due: bool = False, epoch_opening: tuple[bool, bool] = (False, False),
                   ) -> Optional[SaveDecision]:
        """Called by every rank after each optimizer step: None, or a just-in-time save to take now.
        `save_due`: a periodic save comes at this boundary anyway. While a late save is pending it
        costs its own time before the next step, so it becomes the late save when what is left
        after it would not fit another step and save. `epoch_opening`: whether the step just taken,
        and the next one, overlap an epoch's pipeline start (see the module's note)."""
        now = self.clock()
        self.step_times.append(max(now - self._last_call - self._saving_s, 0.0))
        if epoch_opening[0]:
            self.record_epoch_start(self.step_times[-1])
        self.next_opens_epoch = epoch_opening[1]
        self._last_call, self._saving_s = now, 0.0
        info = self.get_info()
        if info is None:
            return None
        key = tuple(info.preempted_node_ids)
        if key not in self.seen:
            self.seen.add(key)
            return self._on_notice(info, step, now)
        if self.pending is None:
            return None
        if info.deadline_ms is not None:  # a later notice may bring the deadline forward
            self.pending = info
        left = self.pending.deadline_ms / 1000 - now
        _, save_now = self._decide(left - (self.save_s if save_due else 0.0))
        return self._save_late(step) if save_now else None

    def _decide(self, left_s: float) -> tuple[bool, bool]:
        """(too close for any save, last safe boundary for a late one), the same on every rank:
        one collective, any rank's True wins, so the most cautious clock decides."""
        too_short = left_s - self.save_s < self.margin_s()
        save_now = should_save_now(left_s, self.next_step_s(), self.save_s, self.margin_s())
        return tuple(self.agree([too_short, save_now]))

    def _on_notice(self, info, step: int, now: float) -> Optional[SaveDecision]:
        left = None if info.deadline_ms is None else info.deadline_ms / 1000 - now
        fields = dict(step=step, deadline_ms=info.deadline_ms, nodes=list(info.preempted_node_ids),
                      ranks=list(info.preempted_ranks), seconds_left=None if left is None else round(left, 2),
                      save_estimate_s=round(self.save_s, 2), save_timed=self.save_timed,
                      step_s=round(self.step_s, 3), next_step_s=round(self.next_step_s(), 3),
                      margin_s=round(self.margin_s(), 2))
        # Same on every rank: Ray hands every rank rank 0's notice.
        too_short, save_now = (True, True) if left is None else self._decide(left)
        if not too_short:
            self.record("preemption_notice", plan=SAVE_LATE, **fields)
            self.pending, self.noticed_step = info, step
            if save_now:
                return self._save_late(step)
            log.info("pre-emption notice at step %d: %.1f s to the deadline, a save takes ~%.1f s; "
                     "training on, checkpoint at the last safe step", step, left, self.save_s)
            return None
        reason = "no deadline" if left is None else (
            f"deadline in {left:.1f} s, under a save (~{self.save_s:.1f} s) + margin {self.margin_s():.1f} s")
        self.record("preemption_notice", plan=SAVE_NOW, fallback=reason, **fields)
        log.warning("pre-emption notice at step %d: %s; checkpoint now and training on", step, reason)
        return SaveDecision(drain=False, reason=reason)

    def _save_late(self, step: int) -> SaveDecision:
        self.draining = self.pending
        self.pending = None
        left = self.draining.deadline_ms / 1000 - self.clock()
        return SaveDecision(drain=True, reason=f"{left:.1f} s to the deadline")

    def drain(self, step: int) -> None:
        """After the late save: take no more steps; wait until every node of the notice is gone
        or the deadline (+ grace) has passed, then raise `PreemptionDrained`. Ray Train itself
        tears the group down at the deadline; the grace only bounds the wait if it does not."""
        info = self.draining
        deadline = info.deadline_ms / 1000
        nodes = list(info.preempted_node_ids)
        left = deadline - self.clock()
        self.record("preemption_checkpoint", step=step, notice_step=self.noticed_step,
                    seconds_left=round(left, 2), save_s=round(self.save_s, 2))
        self.record("draining", step=step, nodes=nodes, seconds_left=round(left, 2))
        log.info("just-in-time checkpoint at step %d (notice at step %s), %.1f s before the deadline; "
                 "draining until the node goes", step, self.noticed_step, left)
        give_up_at = deadline + self.drain_grace_s
        while self.clock() < give_up_at and any(self.node_alive(n) for n in nodes):
            self.sleep(self.poll_s)
        gone = not any(self.node_alive(n) for n in nodes)
        raise PreemptionDrained(f"drained after the just-in-time checkpoint at step {step}: "
                                f"{'the pre-empted node is gone' if gone else 'the deadline passed'}; "
                                f"restarting from it")


def build_preemption_watcher(store, run_uri: str, rank: int, device, state_bytes: int,
                             min_margin_s: float = 2.0) -> PreemptionWatcher:
    """The watcher on Ray: its notices from Ray Train, the decision agreed by one all-reduce
    (MAX of two flags; only while a notice is pending), events written by rank 0, node liveness
    from the GCS."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from app.observe.records import record_event

    def agree(flags: list[bool]) -> list[bool]:
        if not dist.is_initialized():
            return list(flags)
        value = torch.tensor([float(f) for f in flags], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return [bool(v) for v in value.tolist()]

    def record(kind: str, **fields) -> None:
        if rank == 0:
            record_event(store, run_uri, kind, **fields)

    def node_alive(node_id: str) -> bool:
        try:
            return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())
        except Exception as err:  # the GCS briefly unreachable: keep waiting, the deadline bounds it
            log.debug("node %s: liveness unknown (%s: %s); taken as alive", node_id[:12], type(err).__name__, err)
            return True

    return PreemptionWatcher(get_info=ray.train.get_preemption_info, agree=agree, record=record,
                             node_alive=node_alive, initial_save_s=initial_save_estimate(state_bytes),
                             min_margin_s=min_margin_s)


def state_bytes(params, optimizer_slots: int = 2) -> int:
    """This rank's share of what a checkpoint writes: the trainable parameters and AdamW's two
    fp32 moments per element (local shards under FSDP2)."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * (local.element_size() + 4 * optimizer_slots)
    return total
