"""Preference objectives (DPO with its sigmoid and IPO losses, SimPO, ORPO) from each sequence's
summed log-probability of its completion tokens, and the per-token log-probs they start from.

A packed preference row holds whole pairs, each a chosen document then its rejected one, with
`position_ids` restarting at every document so that attention never crosses one (the SFT packing
of app/data/packing.py). `segments` ([batch, seq], long) gives every labelled position the index
of its sequence in the micro-batch, `2 * pair` for a chosen completion and `2 * pair + 1` for a
rejected one, and -1 to every other position: one forward of the packed rows gives every
sequence's log-prob by a segment sum.

The per-token log-probs come two ways, as the SFT loss does (app/model/loss.py):
- `token_logps_from_logits`: from the model's full logits;
- `chunked_token_logps`: from the output layer's input and weight, `chunk_tokens` positions at a
  time. Unlike the SFT loss, the objective is not a sum over tokens, so the gradient of a token
  is known only once every sequence's log-prob is: the backward pass computes each chunk's logits
  again instead of keeping them, so one chunk's logits exist at a time in either pass.

The objectives follow TRL's definitions (`DPOTrainer.dpo_loss`, `CPOTrainer.cpo_loss` for SimPO,
`ORPOTrainer.odds_ratio_loss`) per pair, and are summed by the caller and divided by the global
batch's pair count: step k's gradient is then the same function of the same pairs at any world
size. ORPO's SFT term is each pair's mean NLL over its chosen tokens (TRL averages over all the
batch's chosen tokens, which would weigh a pair by its length and by its micro-batch).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from app.batch import IGNORE_INDEX as IGNORE
from app.config import OBJECTIVE_DEFAULTS

OBJECTIVES = ("dpo", "simpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo")


# -- per-token log-probs -----------------------------------------------------------------------

def token_logps_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[batch, seq] log p(labels[:, t] | tokens before t), in fp32, aligned with `labels`; 0 where
    a label is IGNORE (and at t = 0, which nothing predicts)."""
    targets = labels[:, 1:]
    valid = targets != IGNORE
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    return F.pad(torch.where(valid, picked, 0.0), (1, 0))


def chunked_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """`token_logps_from_logits(hidden @ weight.T, labels)` one chunk of logits at a time (the
    logits in `dtype`, the softmax in fp32, as the full path under autocast)."""
    # Position t predicts label t+1; shifting the targets keeps the hidden states contiguous.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    logps = ChunkedTokenLogps.apply(flat, weight, targets, chunk_tokens, dtype)
    return F.pad(logps.view(labels.shape)[:, :-1], (1, 0))


def chunk_logps(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    """(log p of each target or 0, the chunk's log-softmax in fp32, valid mask, safe targets)."""
    logits = (h @ w.t()).float()
    valid = t != IGNORE
    safe = torch.where(valid, t, 0)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, safe[:, None]).squeeze(1)
    return torch.where(valid, picked, 0.0), logp, valid, safe


class ChunkedTokenLogps(torch.autograd.Function):
    """Forward: each position's log-prob of its target, chunk by chunk, keeping no logits.
    Backward: d logp_t / d logits_t = onehot(target_t) - softmax_t, scaled by the upstream
    gradient of that token, with each chunk's logits computed again."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, dtype: torch.dtype):
        out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # forward runs without grad
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                out[start:end] = chunk_logps(hidden[start:end].to(dtype), w, targets[start:end])[0]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype, w = ctx.dtype, weight.to(ctx.dtype)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                end = start + ctx.chunk_tokens
                h = hidden[start:end].to(dtype)
                _, logp, valid, safe = chunk_logps(h, w, targets[start:end])
                g = torch.where(valid, grad_out[start:end].float(), 0.0)
                grad = logp.exp_().mul_(-g[:, None])  # d logp / d logits = onehot - softmax, times g
                grad.scatter_add_(1, safe[:, None], g[:, None])
                grad = grad.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = grad @ w
                if grad_w is not None:
                    grad_w += (grad.t() @ h).to(grad_w.dtype)
                del grad, logp
        return grad_h, grad_w, None, None, None


# -- per-sequence sums ---------------------------------------------------------------------------

def pair_segments(labels: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed preference rows ([batch, seq] labels and position_ids) → (`segments`, pairs per row).

    A row's documents are numbered by their starts (position 0); its labelled documents are its
    pairs' halves in order, chosen then rejected, and anything after them is padding. Sequence
    numbers run on across the rows of the batch."""
    doc = np.cumsum(positions == 0, axis=1) - 1
    labelled = labels != IGNORE
    halves = np.where(labelled, doc, -1).max(axis=1, initial=-1) + 1
    if (halves % 2).any():
        row = int(np.flatnonzero(halves % 2)[0])
        raise ValueError(f"row {row} of the batch holds {int(halves[row])} labelled documents: not whole "
                         f"preference pairs (was the dataset prepared with prepare.format: preference?)")
    pairs = halves // 2
    offsets = 2 * (np.cumsum(pairs) - pairs)
    return np.where(labelled, doc + offsets[:, None], -1).astype(np.int64), pairs


def sequence_logps(token_logps: torch.Tensor, segments: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """[num_sequences]: each sequence's summed log-prob over its positions in `segments`."""
    # Positions of no sequence go to one extra bucket, dropped after: a boolean mask would make
    # the device sync to learn its size.
    index = torch.where(segments >= 0, segments, num_sequences).reshape(-1)
    total = token_logps.new_zeros(num_sequences + 1)
    return total.index_add(0, index, token_logps.reshape(-1))[:num_sequences]


def sequence_tokens(segments: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """[num_sequences]: how many labelled positions each sequence has (its completion length)."""
    index = torch.where(segments >= 0, segments, num_sequences).reshape(-1)
    counts = torch.zeros(num_sequences + 1, dtype=torch.long, device=segments.device)
    return counts.index_add(0, index, torch.ones_like(index))[:num_sequences]


# -- the objectives ------------------------------------------------------------------------------

class PairLosses(NamedTuple):
    """Per pair: the loss, and the implicit rewards the metrics report."""

    losses: torch.Tensor
    rewards_chosen: torch.Tensor
    rewards_rejected: torch.Tensor


def build_pair_losses(objective: str, chosen: torch.Tensor, rejected: torch.Tensor, *, chosen_tokens: torch.Tensor,
                      rejected_tokens: torch.Tensor, ref_chosen: Optional[torch.Tensor] = None,
                      ref_rejected: Optional[torch.Tensor] = None, beta: Optional[float] = None,
                      loss: str = "sigmoid", label_smoothing: float = 0.0, simpo_gamma: Optional[float] = None,
                      orpo_lambda: Optional[float] = None) -> PairLosses:
    """Per-pair losses from summed completion log-probs ([pairs] each) and completion lengths.
    `beta`, `simpo_gamma` and `orpo_lambda` left None take the objective's defaults, the config's
    (app.config.OBJECTIVE_DEFAULTS).

    - dpo, sigmoid: -log σ(β((π_c - ref_c) - (π_r - ref_r))), with conservative label smoothing;
    - dpo, ipo: ((π_c - ref_c) - (π_r - ref_r) - 1/(2β))², on length-averaged log-probs (as TRL);
    - simpo: -log σ(β(avg π_c - avg π_r) - γ), no reference;
    - orpo: mean NLL of the chosen completion - λ log σ(log odds_c - log odds_r), where
      odds = p / (1 - p) of the length-averaged log-prob p, no reference.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"training.objective {objective!r}: one of sft, {', '.join(OBJECTIVES)}")
    defaults = OBJECTIVE_DEFAULTS[objective]
    beta = defaults["beta"] if beta is None else beta
    if objective == "dpo":
        if ref_chosen is None or ref_rejected is None:
            raise ValueError("training.objective dpo needs the reference log-probs")
        if loss == "ipo":
            chosen_ratio = (chosen - ref_chosen) / chosen_tokens
            rejected_ratio = (rejected - ref_rejected) / rejected_tokens
            losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
        elif loss == "sigmoid":
            chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
            logits = beta * (chosen_ratio - rejected_ratio)
            losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
        else:
            raise ValueError(f"preference.loss {loss!r}: one of {', '.join(DPO_LOSSES)}")
        return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    avg_chosen, avg_rejected = chosen / chosen_tokens, rejected / rejected_tokens
    if objective == "simpo":
        gamma = defaults["simpo_gamma"] if simpo_gamma is None else simpo_gamma
        logits = beta * (avg_chosen - avg_rejected) - gamma
        losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    else:
        lam = defaults["orpo_lambda"] if orpo_lambda is None else orpo_lambda
        # log(p / (1 - p)) with log p = avg: avg - log(1 - exp(avg)), stable for avg near 0.
        log_odds = (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))
        losses = -avg_chosen - lam * F.logsigmoid(log_odds)
    return PairLosses(losses, beta * avg_chosen.detach(), beta * avg_rejected.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Mächler 2012).

    A completion the model is sure of has a mean log-prob of exactly 0 (a one-token answer at
    probability 1 in fp32), where log(1 - exp(0)) is -inf and its gradient, through either branch
    of the `where`, is inf times 0: NaN in every weight. x is clamped to at most -eps of its dtype
    first: 1 - p below eps is finer than the dtype tells p from 1, and the gradient, 1/x near 0,
    stays below 1/eps instead of overflowing. The clamp passes no gradient to a log-prob above
    it, which cannot rise any further."""
    x = x.clamp(max=-torch.finfo(x.dtype).eps)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def sum_pair_metrics(pair: PairLosses, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics' sums over these pairs (detached): the caller adds them up over the global batch
    and divides by its pair count, as it does the loss."""
    margin = pair.rewards_chosen - pair.rewards_rejected
    return {"rewards_chosen": pair.rewards_chosen.sum(), "rewards_rejected": pair.rewards_rejected.sum(),
            "reward_margin": margin.sum(), "reward_accuracy": (margin > 0).float().sum(),
            "logps_chosen": chosen.detach().sum(), "logps_rejected": rejected.detach().sum()}
