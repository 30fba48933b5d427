"""What one micro-batch contributes to a step, by `training.objective`: the summed loss, the sums
behind its metrics, and how many units the step's loss is divided by once summed over the global
batch (label tokens for `sft`, pairs for the preference objectives, completion tokens for `grpo`). The loop does the rest the
same way for all of them: one all-reduce of the units, `loss * world / units` backward, and the
sums reduced on logging steps only.

The preference objectives read packed pair rows (app/model/preference.py) and take their
reference log-probs from the micro-batch (`precomputed`: the column `eft prepare` stored), from
the same model with its LoRA adapters disabled (`live`), or need none (SimPO, ORPO).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from app.batch import IGNORE_INDEX as IGNORE
from app.config import JobConfig
from app.model.loss import loss_sum, token_logps
from app.model.preference import (
    build_pair_losses, pair_segments, sequence_logps, sequence_tokens, sum_pair_metrics,
)
from app.rl.loss import grpo_token_loss

# The preference objectives' metrics, in the order their sums travel in one tensor.
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
                "logps_rejected")


def label_tokens(labels: np.ndarray) -> int:
    """The positions a [batch, seq] micro-batch trains: labels past the first (which nothing predicts)."""
    return int((labels[:, 1:] != IGNORE).sum())


class SftObjective:
    """Next-token cross-entropy, normalized by the global batch's label tokens."""

    metric_names: tuple[str, ...] = ()

    def units(self, labels: np.ndarray, positions: Optional[np.ndarray]) -> int:
        return label_tokens(labels)

    def forward(self, model, inputs: np.ndarray, labels: np.ndarray, positions: Optional[np.ndarray],
                ref: Optional[np.ndarray], device, autocast_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, p = as_tensors(inputs, labels, positions, device)
        return loss_sum(model, x, y, autocast_dtype, p), torch.zeros(0, dtype=torch.float64, device=device)


class PreferenceObjective:
    """DPO, SimPO or ORPO on packed pairs, normalized by the global batch's pairs."""

    metric_names = PAIR_METRICS

    def __init__(self, cfg: JobConfig):
        self.objective, self.settings, self.reference = cfg.training.objective, cfg.preference, cfg.reference_mode

    def units(self, labels: np.ndarray, positions: Optional[np.ndarray]) -> int:
        return int(pair_segments(labels, positions)[1].sum())

    def forward(self, model, inputs: np.ndarray, labels: np.ndarray, positions: Optional[np.ndarray],
                ref: Optional[np.ndarray], device, autocast_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The pairs come from the host arrays: no device sync.
        segments_np, pairs = pair_segments(labels, positions)
        x, y, positions = as_tensors(inputs, labels, positions, device)
        n = 2 * int(pairs.sum())
        if n == 0:  # padding slots only: a zero that still runs the forward (FSDP2 gathers in it)
            return token_logps(model, x, y, autocast_dtype, positions).sum() * 0.0, x.new_zeros(
                len(PAIR_METRICS), dtype=torch.float64)
        segments = torch.as_tensor(segments_np, device=x.device)
        ref_logps = None
        if self.reference == "live":
            ref_logps = self.live_reference(model, x, y, positions, segments, n, autocast_dtype)
        elif self.reference == "precomputed":
            if ref is None or len(ref) != n:
                raise ValueError(f"the micro-batch holds {n} sequences but {0 if ref is None else len(ref)} "
                                 f"precomputed reference log-probs")
            ref_logps = torch.as_tensor(ref, dtype=torch.float32, device=x.device)
        logps = sequence_logps(token_logps(model, x, y, autocast_dtype, positions), segments, n)
        tokens = sequence_tokens(segments, n).float()
        s = self.settings
        pair = build_pair_losses(
            self.objective, logps[0::2], logps[1::2], chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2],
            ref_chosen=None if ref_logps is None else ref_logps[0::2],
            ref_rejected=None if ref_logps is None else ref_logps[1::2], beta=s.beta, loss=s.loss,
            label_smoothing=s.label_smoothing, simpo_gamma=s.simpo_gamma, orpo_lambda=s.orpo_lambda)
        sums = sum_pair_metrics(pair, logps[0::2], logps[1::2])
        return pair.losses.sum(), torch.stack([sums[k].double() for k in PAIR_METRICS])

    @torch.no_grad()
    def live_reference(self, model, x, y, positions, segments, n: int, autocast_dtype) -> torch.Tensor:
        """The sequences' log-probs under the model with its adapters disabled (PEFT's
        `disable_adapter`), in eval mode as the precomputed pass runs the base."""
        peft_model = getattr(model, "module", model)  # DDP holds the PEFT model as .module
        was_training = model.training
        model.eval()
        try:
            with peft_model.disable_adapter():
                return sequence_logps(token_logps(model, x, y, autocast_dtype, positions), segments, n)
        finally:
            model.train(was_training)


class GrpoObjective:
    """GRPO's clipped surrogate (and β·k3) over the completion tokens of packed rollouts, normalized
    by the global batch's completion tokens. The micro-batch carries each token's advantage where
    the preference objectives carry reference log-probs. On-policy (`rl.updates_per_batch` 1) the
    old log-probs are this forward's own, detached: the trainer's numbers, never the sampler's."""

    metric_names = ("clip_frac", "kl")

    def __init__(self, cfg: JobConfig, reference=None):
        self.rl = cfg.rl
        self.reference = reference  # a full fine-tune's frozen copy of the base; LoRA: None

    def units(self, labels: np.ndarray, positions: Optional[np.ndarray]) -> int:
        return label_tokens(labels)

    def forward(self, model, inputs: np.ndarray, labels: np.ndarray, positions: Optional[np.ndarray],
                ref: Optional[np.ndarray], device, autocast_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, p = as_tensors(inputs, labels, positions, device)
        logp = token_logps(model, x, y, autocast_dtype, p)
        mask = y != IGNORE
        mask[:, 0] = False  # nothing predicts a row's first token (label_tokens skips it too)
        advantages = torch.as_tensor(ref, dtype=torch.float32, device=x.device)
        ref_logp = self.live_reference(model, x, y, p, autocast_dtype) if self.rl.kl_beta else None
        out = grpo_token_loss(logp, logp.detach(), advantages, mask, 1.0, clip_low=self.rl.clip_low,
                              clip_high=self.rl.clip_high, ref_logp=ref_logp, kl_beta=self.rl.kl_beta)
        return out.loss, torch.stack([out.clipped_tokens.double(), out.kl_sum.double()])

    @torch.no_grad()
    def live_reference(self, model, x, y, positions, autocast_dtype) -> torch.Tensor:
        """The tokens' log-probs under the base: the model with its LoRA adapters disabled, or a
        full fine-tune's frozen copy."""
        if self.reference is not None:
            return token_logps(self.reference, x, y, autocast_dtype, positions)
        peft_model = getattr(model, "module", model)
        was_training = model.training
        model.eval()
        try:
            with peft_model.disable_adapter():
                return token_logps(model, x, y, autocast_dtype, positions)
        finally:
            model.train(was_training)


def as_tensors(inputs: np.ndarray, labels: np.ndarray, positions: Optional[np.ndarray], device):
    x = torch.as_tensor(inputs, dtype=torch.long, device=device)
    y = torch.as_tensor(labels, dtype=torch.long, device=device)
    return x, y, None if positions is None else torch.as_tensor(positions, dtype=torch.long, device=device)


def build_objective(cfg: JobConfig, reference=None):
    if cfg.training.objective == "grpo":
        return GrpoObjective(cfg, reference)
    return SftObjective() if cfg.training.objective == "sft" else PreferenceObjective(cfg)


def summarize(objective, loss_sum_value: float, units: float, metric_sums: list[float], prefix: str = "") -> dict:
    """The logged values: the mean loss per unit and each metric's mean per pair."""
    out = {f"{prefix}loss": loss_sum_value / max(units, 1.0)}
    out.update({f"{prefix}{name}": value / max(units, 1.0) for name, value in zip(objective.metric_names,
                                                                                  metric_sums)})
    return out
