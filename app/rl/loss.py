"""GRPO's objective: group-relative advantages and a token-level clipped surrogate.

Pure torch, no Ray: the trainer's step feeds it the policy's log-probs of each completion token,
the log-probs the same policy gave them before the update (recomputed by the trainer, never taken
from the generation engine, whose numerics differ), and optionally the reference's.

- **Advantages** (`group_advantages`): a completion's reward minus its group's mean, divided by
  the group's standard deviation (`scale="group"`, as DeepSeekMath's GRPO and TRL) or not
  (`scale="none"`, Dr. GRPO: the division favours groups whose rewards barely differ). A group
  whose rewards are all equal (all right, all wrong) has no signal; it is counted, and with
  `filter_zero_std` left out of the step and of its denominator.
- **Surrogate** (`grpo_token_loss`): per token, −min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A)
  with ρ = π/π_old; DAPO's asymmetric clip (0.2 / 0.28) is allowed. Plus β·k3, the unbiased,
  always-positive estimator of KL(π ‖ π_ref): exp(ref − logp) − (ref − logp) − 1.
- **Normalization**: the sum over the global batch's completion tokens (every micro-batch on
  every rank) divides each micro-batch's sum, as SFT divides by the global batch's label tokens:
  the same at any world size and accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

# TRL's and verl's guard for a group whose rewards barely differ.
STD_EPS = 1e-4


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor  # [groups * group_size], float32
    zero_std: torch.Tensor  # [groups], bool: every completion of the group got the same reward
    keep: torch.Tensor  # [groups * group_size], bool: in the step (False for a filtered group)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: Literal["group", "none"] = "group",
                     filter_zero_std: bool = False) -> Advantages:
    """`rewards`: [groups * group_size], a group's completions next to each other."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not whole groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    # The sample standard deviation (unbiased), as TRL's GRPOTrainer takes it.
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
    zero_std = (grouped == grouped[:, :1]).all(dim=1)
    values = centred / (std + STD_EPS) if scale == "group" else centred
    keep = ~zero_std if filter_zero_std else torch.ones_like(zero_std)
    return Advantages(values=values.reshape(-1).float(), zero_std=zero_std,
                      keep=keep.repeat_interleave(group_size))


@dataclass(frozen=True)
class TokenLoss:
    loss: torch.Tensor  # scalar: this micro-batch's share of the step's loss
    clipped_tokens: torch.Tensor  # scalar: completion tokens where the clip bound the objective
    kl_sum: torch.Tensor  # scalar: the sum of k3 over the completion tokens (0 without a reference)


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    num_tokens: float | torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    ref_logp: Optional[torch.Tensor] = None, kl_beta: float = 0.0) -> TokenLoss:
    """The clipped surrogate (and β·k3) summed over the tokens where `mask` is set, divided by
    `num_tokens`, the global batch's count of such tokens. `logp`, `old_logp`, `ref_logp`, `mask`:
    [rows, tokens] (a token's log-prob where it is a completion token; anything elsewhere);
    `advantages`: [rows, tokens] (each completion's advantage over its tokens) or [rows]."""
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logp)
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl_sum = logp.new_zeros(())
    if ref_logp is not None and kl_beta:
        delta = ref_logp.detach() - logp
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * k3
        kl_sum = (k3 * mask).sum().detach()
    loss = (per_token * mask).sum() / num_tokens
    clipped_tokens = ((clipped < unclipped).to(logp.dtype) * mask).sum().detach()
    return TokenLoss(loss=loss, clipped_tokens=clipped_tokens, kl_sum=kl_sum)
