"""Colocated rollouts (`rl.rollout: colocated`): each training worker samples its share of a step's
prompts with the policy it trains, scores them and packs them into the step's micro-batches.

A step takes prompts `[step·P, (step+1)·P)` of the seeded order (app/rl/prompts.py), P =
`rl.prompts_per_step`; prompt j goes to rank j mod world, with its whole group, so advantages
need nothing from other ranks. Completion i of a prompt is drawn from the seed (run seed, step,
prompt id, i) (app/rl/sampling.py): the step's completions are the same at any world size.

What leaves the step, per rank: the same number of micro-batches on every rank (FSDP2 gathers in
every forward); each is `(row_ids, input_ids, labels, position_ids, advantages)`. Each prompt's
group is packed on its own (`pack_group`), at the row width that takes it in the fewest positions,
and cut into micro-batches of at most `training.micro_batch_size × data.seq_len` tokens that never
mix groups. A group's arrays, and so its forward and its gradient, are therefore bit for bit the
same whichever rank holds it at whatever world size: with the gradient summed in float64
(app.model.sharding.Float64GradSum), a step is the same function of the same rollouts at any world
size, not just up to the order of the sums. A rank with fewer micro-batches than another forwards
one-row label-free padding micro-batches, whose gradient is exactly 0. A group whose reward raised
is left out whole, never scored 0. The step's rollout statistics come back summed over ranks (two
small collectives; the rollout is on the host anyway).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from app.batch import IGNORE_INDEX
from app.config import JobConfig
from app.data.packing import place_units
from app.model.loss import computing_logits
from app.rl.loss import group_advantages
from app.rl.prompts import PromptOrder, PromptSet
from app.rl.rewards import RewardErrors, build_reward_fn
from app.rl.rollouts import pack_rollouts
from app.rl.sampling import completion_seed, sample_completions

# The summed statistics of a step, in the order they travel in one tensor (per reward: its sum after).
SUM_STATS = ("completions", "reward_sum", "reward_sq_sum", "correct", "groups", "groups_passed", "groups_zero_std",
             "groups_errored", "completion_tokens", "truncated", "trained_completions", "trained_tokens")
MAX_STATS = ("micro_batches", "completion_len_max")
WIDTH_STEP = 8  # the row widths a group is packed at: multiples of this, up to data.seq_len


@dataclass
class RolloutStep:
    micro: list  # [(row_ids, input_ids, labels, position_ids, advantages)], the same count on every rank
    sums: dict  # SUM_STATS and reward_<name>_sum, over every rank
    maxima: dict  # MAX_STATS, over every rank
    samples: list  # this rank's (prompt id, sample index, completion tokens, reward or None)


def prompt_text(record: dict) -> str:
    """The prompt as a reward reads it: the string, or the conversation's last turn."""
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    return record["messages"][-1]["content"]


class ColocatedRollouts:
    """Builds each step's micro-batches on this rank from its share of the step's prompts."""

    def __init__(self, cfg: JobConfig, prompts: PromptSet, tokenizer, stop_ids: list[int], pad_id: int, rank: int,
                 world: int, device, autocast_dtype=None):
        self.cfg, self.rl = cfg, cfg.rl
        self.prompts, self.order = prompts, PromptOrder(len(prompts), cfg.training.seed)
        self.tokenizer, self.stop_ids, self.pad_id = tokenizer, set(stop_ids), pad_id
        self.rank, self.world, self.device, self.autocast_dtype = rank, world, device, autocast_dtype
        self.errors = RewardErrors(self.rl.max_reward_errors)
        self.reward_names = self.rl.reward_names()
        self.score = build_reward_fn(self.rl.weighted_rewards(), self.rl.normalize, self.rl.answer_regex, self.errors)

    def my_prompts(self, step: int) -> list[int]:
        """Indices into the prompt set of this rank's share of step `step`."""
        first = step * self.rl.prompts_per_step
        return [self.order.index(first + j) for j in range(self.rl.prompts_per_step) if j % self.world == self.rank]

    def build(self, model, step: int) -> RolloutStep:
        rl, g = self.rl, self.rl.group_size
        mine = self.my_prompts(step)
        prompt_ids = [self.prompts.tokens[i] for i in mine for _ in range(g)]
        seeds = [completion_seed(self.cfg.training.seed, step, self.prompts.ids[i], k) for i in mine for k in range(g)]
        completions = self.sample(model, prompt_ids, seeds, step)
        sums = dict.fromkeys(SUM_STATS, 0.0) | {f"reward_{n}_sum": 0.0 for n in self.reward_names}
        rewards, errored, correct = [], [], []
        for gi, i in enumerate(mine):
            # The record as a reward gets it, with its prompt id (what a failed reward's line names).
            record = {"prompt_id": self.prompts.ids[i], **self.prompts.records[i]}
            scored = [self.score(prompt_text(record), self.decode(c), record)
                      for c in completions.tokens[gi * g:(gi + 1) * g]]
            errored.append(any(s.total is None for s in scored))
            rewards += [0.0 if s.total is None else s.total for s in scored]
            # Accuracy and pass@G read the first reward: a completion is right when it scores 1 or more.
            correct += [(s.parts.get(self.reward_names[0]) or 0.0) >= 1.0 for s in scored]
            if not errored[-1]:
                for s in scored:
                    for name in self.reward_names:
                        sums[f"reward_{name}_sum"] += s.parts[name]
        lengths = [len(c) for c in completions.tokens]
        keep = np.ones(len(prompt_ids), dtype=bool)
        advantages = np.zeros(len(prompt_ids), dtype=np.float32)
        if mine:
            adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), g, rl.scale_rewards, rl.filter_zero_std)
            advantages = adv.values.numpy()
            keep &= adv.keep.numpy()
            keep &= ~np.repeat(np.array(errored), g)
            zero_std = adv.zero_std.numpy() & ~np.array(errored)
            scored_rewards = np.array(rewards)[~np.repeat(np.array(errored), g)]
            groups_correct = np.array(correct).reshape(-1, g)
            sums.update(completions=float(len(scored_rewards)), reward_sum=float(scored_rewards.sum()),
                        reward_sq_sum=float((scored_rewards ** 2).sum()),
                        correct=float(np.array(correct)[~np.repeat(np.array(errored), g)].sum()),
                        groups=float(len(mine) - sum(errored)),
                        groups_passed=float((groups_correct.any(axis=1) & ~np.array(errored)).sum()),
                        groups_zero_std=float(zero_std.sum()), groups_errored=float(sum(errored)),
                        completion_tokens=float(sum(lengths)), truncated=float(sum(completions.truncated)))
        if rl.mask_truncated:
            keep &= ~np.array(completions.truncated, dtype=bool)
        groups = []
        for gi in range(len(mine)):
            kept = [k for k in range(gi * g, (gi + 1) * g) if keep[k]]
            groups.append(pack_group([prompt_ids[k] for k in kept], [completions.tokens[k] for k in kept],
                                     advantages[kept], self.cfg.data.seq_len, self.pad_id))
        sums["trained_completions"] = float(keep.sum())
        sums["trained_tokens"] = float(sum(p.completion_tokens() for p in groups))
        micro = self.micro_batches(groups, step)
        maxima = {"micro_batches": float(len(micro)), "completion_len_max": float(max(lengths, default=0))}
        sums, maxima = self.reduce(sums, maxima)
        micro += self.padding(int(maxima["micro_batches"]) - len(micro), step)
        samples = [(self.prompts.ids[i], k, completions.tokens[gi * g + k],
                    None if errored[gi] else rewards[gi * g + k]) for gi, i in enumerate(mine) for k in range(g)]
        return RolloutStep(micro=micro, sums=sums, maxima=maxima, samples=samples)

    def sample(self, model, prompt_ids: list[list[int]], seeds: list[int], step: int):
        """The completions, every rank forwarding until the last is done (a rank without prompts
        samples one throw-away row: FSDP2 needs its shards in each forward)."""
        module = getattr(model, "module", model)  # DDP's forward would sync buffers per call
        was_training = module.training
        module.eval()
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                    else contextlib.nullcontext())
        try:
            with autocast, computing_logits(model):
                out = sample_completions(module, prompt_ids or [[self.pad_id]], seeds or [0],
                                         max_new_tokens=self.rl.max_new_tokens, stop_token_ids=self.stop_ids,
                                         pad_token_id=self.pad_id, temperature=self.rl.temperature,
                                         top_p=self.rl.top_p, lockstep=True)
        finally:
            module.train(was_training)
        if not prompt_ids:
            return type(out)(tokens=[], truncated=[])
        return out

    def decode(self, tokens: list[int]) -> str:
        if tokens and tokens[-1] in self.stop_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def reduce(self, sums: dict, maxima: dict) -> tuple[dict, dict]:
        if not (dist.is_available() and dist.is_initialized()):
            return sums, maxima
        s = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
        m = torch.tensor(list(maxima.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(s, op=dist.ReduceOp.SUM)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return dict(zip(sums, s.tolist())), dict(zip(maxima, m.tolist()))

    def micro_batches(self, groups: list, step: int) -> list:
        """This rank's groups, each cut into micro-batches of at most micro_batch_size × seq_len
        tokens at its own width. Row ids key dropout masks (app/model/dropout.py): by (step, the
        group's slot in the step, row), so a group's masks do not depend on the rank holding it."""
        tokens = self.cfg.training.micro_batch_size * self.cfg.data.seq_len
        slots = [j for j in range(self.rl.prompts_per_step) if j % self.world == self.rank]
        out = []
        for packed, slot in zip(groups, slots):
            rows, width = packed.rows.input_ids.shape
            chunk = max(tokens // max(width, 1), 1)
            row_ids = (step * 1_000_003 + slot * 1_009 + np.arange(rows)).astype(np.int64)
            out += [(row_ids[i:i + chunk], packed.rows.input_ids[i:i + chunk], packed.rows.labels[i:i + chunk],
                     packed.rows.position_ids[i:i + chunk], packed.advantages[i:i + chunk])
                    for i in range(0, rows, chunk)]
        return out

    def padding(self, n: int, step: int) -> list:
        """`n` one-row label-free micro-batches (their gradient is exactly 0), with row ids past the
        step's groups' own."""
        first = step * 1_000_003 + (self.rl.prompts_per_step + self.rank) * 1_009
        return [(np.array([first + i], np.int64), np.full((1, WIDTH_STEP), self.pad_id, np.int64),
                 np.full((1, WIDTH_STEP), IGNORE_INDEX, np.int64), np.arange(WIDTH_STEP, dtype=np.int64)[None],
                 np.zeros((1, WIDTH_STEP), np.float32)) for i in range(n)]


def pack_group(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, seq_len: int,
               pad_id: int):
    """One group's rollouts packed whole (app.rl.rollouts.pack_rollouts) at the width, a multiple of
    WIDTH_STEP up to `seq_len`, that takes the fewest positions: rows of similar completions go one
    to a row at about their length rather than several to a row of `seq_len` with its end padded. A
    function of the group alone, so the same at any world size."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    if not lengths:
        return pack_rollouts([], [], advantages, seq_len, pad_id)
    narrowest = min(-(-max(lengths) // WIDTH_STEP) * WIDTH_STEP, seq_len)
    widths = sorted({*range(narrowest, seq_len + 1, WIDTH_STEP), seq_len})
    width = min(widths, key=lambda w: (rows_needed(lengths, w) * w, w))
    return pack_rollouts(prompts, completions, advantages, width, pad_id)


def rows_needed(lengths: list[int], width: int) -> int:
    """Rows the packer (app.data.packing.place_units) fills with these documents, in order, each
    kept whole in one row of `width`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-int(place_units(lengths, width).sum() + lengths.sum()) // width)


def summarize_rollouts(sums: dict, maxima: dict, reward_names: list[str], group_size: int) -> dict:
    """The logged rollout metrics of one or more steps' summed statistics."""
    n = max(sums["completions"], 1.0)
    mean = sums["reward_sum"] / n
    out = {"reward_mean": mean, "reward_std": math.sqrt(max(sums["reward_sq_sum"] / n - mean * mean, 0.0)),
           "accuracy": sums["correct"] / n, "pass_at_g": sums["groups_passed"] / max(sums["groups"], 1.0),
           "frac_zero_std": sums["groups_zero_std"] / max(sums["groups"], 1.0),
           "reward_errors": sums["groups_errored"],
           "completion_len_mean": sums["completion_tokens"] / max(sums["groups"] + sums["groups_errored"], 1.0)
           / group_size,
           "completion_len_max": maxima["completion_len_max"],
           "truncated_frac": sums["truncated"] / max((sums["groups"] + sums["groups_errored"]) * group_size, 1.0)}
    if len(reward_names) > 1:
        out.update({reward_metric(name): sums[f"reward_{name}_sum"] / n for name in reward_names})
    return out


def reward_metric(name: str) -> str:
    """A reward's metric key: `reward_<name>`, a `module:function` by its function's name (sinks
    such as MLflow take letters, digits and `_` only)."""
    return "reward_" + re.sub(r"\W", "_", name.rsplit(":", 1)[-1])
