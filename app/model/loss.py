"""The training loss: summed next-token cross-entropy over labelled positions, three ways.

- `full`: the model returns logits for the whole micro-batch, then the cross-entropy. Its fp32
  `[tokens, vocab]` logits (and their softmax and gradient) are the largest tensors of a step
  at a 128k vocabulary: about 2 GB per 4096-token sequence, each.
- `chunked` (default): the output layer computes the loss itself, `loss_chunk_tokens` positions
  at a time, and the gradients wrt its input and weight in the same pass (as Liger's fused
  linear cross-entropy does), so one chunk's logits exist at a time, in forward and backward.
- `liger`: the same idea as a Triton kernel (liger-kernel, the `liger` extra; GPU only).

How the hidden states reach the loss: the output layer *instance* gets a new `forward`
(`types.MethodType`; state-dict keys and module tree unchanged) that takes the labels handed to it
just before the model's forward and returns the summed loss as the model's `logits`. So the model's
real forward runs: FSDP2's root unit (embeddings, final norm, output layer) has its weights
all-gathered and cast by its own hooks, PEFT and DDP wrap as before, and the loss is part of the
forward's output, which is what FSDP2's pre-backward hooks and DDP's reducer key on. Calling the
decoder and then the head's weight outside the forward would see FSDP2's shards instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from app.batch import IGNORE_INDEX as IGNORE
from app.model.preference import chunked_token_logps, token_logps_from_logits

# Model config attributes under which the forward transforms the output layer's result before
# returning it (Gemma's soft-capping, Cohere's and Granite's scaling): a loss computed inside the
# output layer would be transformed too, so those models need `training.loss: full`.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class LossConfigError(ValueError):
    """`training.loss` does not fit the model or the machine."""


def check_loss_setup(cfg, model_config=None) -> None:
    """Driver-side preflight of `training.loss` (with the model's transformers config where
    known), each failure one line naming the key."""
    mode = cfg.training.loss
    if mode == "full":
        return
    check_liger_installed(mode)
    check_logits_untransformed(model_config, mode)
    targets = cfg.lora.target_modules if cfg.lora is not None else []
    if isinstance(targets, str):
        targets = [targets]
    if "lm_head" in targets:
        raise LossConfigError(f"training.loss {mode}: lora.target_modules adapts lm_head, which the {mode} loss "
                              f"replaces; set training.loss: full")


def check_liger_installed(mode: str) -> None:
    if mode == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise LossConfigError("training.loss liger: liger-kernel is not installed (pip install 'eft[liger]')")


def check_logits_untransformed(model_config, mode: str) -> None:
    for key in LOGIT_TRANSFORMS:
        value = getattr(model_config, key, None)
        if value not in (None, 1, 1.0):
            raise LossConfigError(f"training.loss {mode}: the model's {key} ({value}) transforms the logits after "
                                  f"the output layer; set training.loss: full")


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside DDP / PEFT wrappers."""
    inner = getattr(model, "module", model)  # DDP
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT


def find_output_layer(model: nn.Module) -> nn.Module:
    return unwrap(model).get_output_embeddings()


def apply_loss(model: nn.Module, mode: str, chunk_tokens: int = 1024) -> None:
    """Make the output layer compute the loss (`chunked`, `liger`); `full` leaves the model as is."""
    if mode == "full":
        return
    head = find_output_layer(model)
    check_liger_installed(mode)
    check_logits_untransformed(getattr(unwrap(model), "config", None), mode)
    if type(head) is not nn.Linear or head.bias is not None:
        raise LossConfigError(f"training.loss {mode}: the output layer is a {type(head).__name__}, not a plain "
                              f"bias-free Linear; set training.loss: full")
    head.eft_loss = mode
    head.eft_chunk_tokens = chunk_tokens
    head.eft_labels = None
    head.eft_per_token = False
    head.eft_logits = False
    head.forward = types.MethodType(loss_forward, head)


@contextlib.contextmanager
def computing_logits(model: nn.Module):
    """The output layer gives logits again, as before `apply_loss`: for sampling from the model
    being trained (GRPO's rollouts)."""
    head = find_output_layer(model)
    if getattr(head, "eft_loss", "full") == "full":
        yield
        return
    head.eft_logits = True
    try:
        yield
    finally:
        head.eft_logits = False


def loss_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer's forward once `apply_loss` has run: hidden states in, summed loss out."""
    if self.eft_logits:  # sampling (computing_logits): the plain layer
        return F.linear(hidden, self.weight)
    labels = self.eft_labels
    if labels is None or labels.shape != hidden.shape[:-1]:
        raise RuntimeError("the output layer computes the loss: call it through loss_sum with the labels")
    # Position t predicts label t+1; the last position predicts nothing. Shifting the targets rather
    # than slicing the hidden states keeps them contiguous: no copy, and grad has their shape.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE).reshape(-1)
    dtype = compute_dtype(hidden, self.weight)
    if self.eft_per_token:
        # The preference objectives: each position's log-prob of its label, chunk by chunk (liger's
        # kernel gives only the summed loss, so `liger` takes this path too).
        return chunked_token_logps(hidden, self.weight, labels, self.eft_chunk_tokens, dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if self.eft_loss == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
        return liger(self.weight.to(dtype), flat.to(dtype), targets)
    return chunked_cross_entropy(flat, self.weight, targets, self.eft_chunk_tokens, dtype)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` would compute the logits in here: autocast's, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """sum over labelled i of CE(hidden[i] @ weight.T, targets[i]), one chunk of logits at a time."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not need_grad:
        with torch.autocast(hidden.device.type, enabled=False):
            total = hidden.new_zeros((), dtype=torch.float32)
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                total += chunk_loss_and_softmax(hidden[start:end].to(dtype), weight.to(dtype),
                                                targets[start:end], want_grad=False)[0]
            return total
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens, dtype)


def chunk_loss_and_softmax(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, want_grad: bool):
    """(summed CE, d CE / d logits in fp32 or None) for one chunk. The log-sum-exp is taken by hand,
    in place in the logits buffer, which then becomes the gradient: a chunk costs one fp32
    [chunk, vocab] buffer (torch.logsumexp and log_softmax would each allocate more of that size)."""
    logits = (h @ w.t()).float()  # as the full path: logits in the compute dtype, softmax in fp32
    valid = t != IGNORE
    safe = torch.where(valid, t, 0)
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    top = logits.amax(dim=-1, keepdim=True)
    exps = logits.sub_(top).exp_()
    sums = exps.sum(dim=-1, keepdim=True)
    lse = (top + sums.log()).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not want_grad:
        return loss, None
    grad = exps.div_(sums)  # softmax
    grad.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
    grad.mul_(valid[:, None])  # unlabelled positions contribute nothing
    return loss, grad


class ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both input gradients chunk by chunk; backward only scales
    them by the upstream gradient (the loss is a scalar, so nothing needs recomputing)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, dtype: torch.dtype):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        grad_h = torch.empty_like(hidden) if want_h else None  # every row is written
        # Accumulated in the weight's own dtype in place: no second [vocab, hidden] buffer.
        grad_w = torch.zeros_like(weight) if want_w else None
        total = hidden.new_zeros((), dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = start + chunk_tokens
                h = hidden[start:end].to(dtype)
                loss, grad = chunk_loss_and_softmax(h, w, targets[start:end], want_grad=True)
                total += loss
                grad = grad.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = grad @ w
                if grad_w is not None:
                    if grad_w.dtype == dtype:
                        grad_w.addmm_(grad.t(), h)
                    else:
                        grad_w += grad.t() @ h
                del grad  # else it lives on while the next chunk's logits are allocated
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # In place: backward runs once per forward, and a second [vocab, hidden] copy is what we avoid.
        if grad_h is not None:
            grad_h.mul_(grad_out.to(grad_h.dtype))
        if grad_w is not None:
            grad_w.mul_(grad_out.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None


@contextlib.contextmanager
def handing_labels(head: nn.Module, labels: torch.Tensor, per_token: bool = False):
    head.eft_labels, head.eft_per_token = labels, per_token
    try:
        yield
    finally:
        head.eft_labels, head.eft_per_token = None, False


def loss_sum(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, autocast_dtype,
             position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Summed next-token cross-entropy over labelled positions (normalized by the caller), by the
    path `apply_loss` set up on the model (`full` when it was not called).

    With `position_ids` (restarting at 0 at each packed document's start) and neither an attention
    mask nor a KV cache, transformers detects the packed documents and builds a block-causal mask
    (masking_utils.find_packed_sequence_indices): no token attends across a document boundary."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    head = find_output_layer(model)
    with torch.autocast(input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        if getattr(head, "eft_loss", "full") == "full":
            logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE, reduction="sum")
        with handing_labels(head, labels):
            loss = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    if loss.dim() != 0:
        raise RuntimeError(f"training.loss {head.eft_loss}: the model's forward did not return the output "
                           f"layer's loss as is; set training.loss: full")
    return loss


def token_logps(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, autocast_dtype,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[batch, seq] fp32 log-prob of each label given the tokens before it (0 where the label is
    IGNORE), by the path `apply_loss` set up: from the full logits (`full`), else chunk by chunk in
    the output layer, so the [tokens, vocab] logits never exist at once. The preference objectives'
    per-sequence sums start here."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    head = find_output_layer(model)
    with torch.autocast(input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        if getattr(head, "eft_loss", "full") == "full":
            logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits
            return token_logps_from_logits(logits, labels)
        with handing_labels(head, labels, per_token=True):
            logps = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    if logps.shape != labels.shape:
        raise RuntimeError(f"training.loss {head.eft_loss}: the model's forward did not return the output "
                           f"layer's log-probs as they are; set training.loss: full")
    return logps
