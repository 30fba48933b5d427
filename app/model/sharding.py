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

from app.compat import foreach_copy_

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


def forward_autocast_dtype(model: nn.Module, param_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype the forward autocasts to: the compute dtype wherever some trainable weights are
    plain fp32 tensors that no FSDP2 policy casts (DDP, replicated adapters); else none."""
    from torch.distributed.fsdp import FSDPModule

    if param_dtype is None:
        return None
    if not isinstance(model, FSDPModule) or replicated_parameters(model):
        return param_dtype
    return None
