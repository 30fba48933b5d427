"""How the trainable weights meet the data-parallel ranks, and which blocks are compiled.

LoRA under FSDP2 keeps the adapters replicated: FSDP2 shards only the frozen base. Were the
adapters sharded with their block, every micro-batch would copy, cast and all-gather hundreds
of small tensors beside the base's and reduce-scatter their gradients once per block; replicated,
they cost one all-reduce of one flat bucket per optimizer step (`all_reduce_gradients`). The
price is memory: weights, gradients and AdamW state of the adapters (16 bytes a parameter) on
every rank instead of 1/world of it, which `lora.fsdp_adapters: sharded` trades back.

Replicated adapters are plain tensors that FSDP2 neither casts nor reduces, so under bf16 the
forward runs in autocast (as under DDP) to compute them in the compute dtype.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from app.compat import foreach_add_, foreach_copy_

# inductor needs a C++ (CPU) or Triton (GPU) toolchain and minutes of compile on a small CPU box; the
# CPU tests run the same wiring (dynamo + AOTAutograd) on "aot_eager" by setting this in-process.
COMPILE_BACKEND = "inductor"


def apply_compile(blocks: Iterable[nn.Module], backend: Optional[str] = None) -> None:
    """Compile each decoder block in place (regional compilation, as torchtitan does): identical
    blocks share one compiled graph, so compile time is that of one block, and `Module.compile`
    keeps the parameter names, so checkpoints and exports do not change. Called after activation
    checkpointing and before FSDP2 / DDP, the order torchtitan uses."""
    for block in blocks:
        block.compile(backend=backend or COMPILE_BACKEND)


def adapters_to_replicate(cfg, model: nn.Module) -> frozenset:
    """The LoRA adapters FSDP2 is to leave replicated (`lora.fsdp_adapters: replicated`): the
    trainable parameters of a PEFT model, whose base is frozen."""
    if cfg.lora is None or cfg.lora.fsdp_adapters != "replicated":
        return frozenset()
    return frozenset(p for p in model.parameters() if p.requires_grad)


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters FSDP2 left alone (plain tensors beside its DTensors): the loop reduces
    their gradients itself. Empty under DDP (it reduces everything) and without FSDP2."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return []
    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]


def all_reduce_gradients(params: list[nn.Parameter], world: int) -> None:
    """Average the gradients of `params` over the ranks in one collective, once per optimizer step.

    Each rank's loss is scaled by world / global label tokens, so the average is the gradient of the
    global batch: the same reduction FSDP2 (reduce-scatter) and DDP (all-reduce) apply."""
    if not params or world == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:  # unused on this rank this step: all ranks still send the same bucket
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(world)
    foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])


class Float64GradSum:
    """A step's gradient summed micro-batch by micro-batch in float64, then over the ranks, then
    cast once to the parameters' dtype: GRPO's exact path (app/rl/colocated.py lays each group out
    the same at any world size, so each micro-batch's gradient is bit for bit the same wherever it
    is computed). Summed in fp32, as autograd accumulates, the step's gradient depends on the order
    of the micro-batches and ranks, which the world size changes: a few ulps, which a later
    sampling draw near a boundary turns into another token. In float64 the order moves the sum by
    about 1e-16 of it, below fp32's rounding but for a sum within that of a rounding boundary.

    Only for parameters the loop reduces itself (`replicated_parameters`, or any without FSDP2 at
    world 1): the losses are scaled by 1 / global units, without the world size, and the ranks'
    sums added, not averaged. Costs 8 bytes a trainable parameter (LoRA adapters), no host sync."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.sums: Optional[list[torch.Tensor]] = None

    def add_micro_batch(self) -> None:
        """Move this micro-batch's gradients into the float64 sums."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        wide = [g.to(torch.float64) for g in grads]
        if self.sums is None:
            self.sums = wide
        else:
            foreach_add_(self.sums, wide)
        for p in self.params:
            p.grad = None

    def reduce_into_grads(self, world: int) -> None:
        """The step's gradients, summed over the ranks, as the parameters' `.grad`."""
        if self.sums is None:
            return
        flat = torch.cat([s.reshape(-1) for s in self.sums])
        if world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, v in zip(self.params, flat.split([s.numel() for s in self.sums])):
            p.grad = v.view_as(p).to(p.dtype)
        self.sums = None


def forward_autocast_dtype(model: nn.Module, param_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype the forward autocasts to: the compute dtype wherever some trainable weights are
    plain fp32 tensors that no FSDP2 policy casts (DDP, replicated adapters); else none."""
    from torch.distributed.fsdp import FSDPModule

    if param_dtype is None:
        return None
    if not isinstance(model, FSDPModule) or replicated_parameters(model):
        return param_dtype
    return None
