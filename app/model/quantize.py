"""QLoRA: the frozen base's linear weights held in 4-bit NF4 (torchao's NF4Tensor); the LoRA
adapters train on top in the compute dtype.

Which weights: every nn.Linear inside the decoder blocks (attention and MLP projections,
adapted or not). Embeddings, norms and the LM head stay in the storage dtype, as in QLoRA:
they are a small share of a large model and the most sensitive to rounding.

The forward needs no module of ours: NF4Tensor routes F.linear to torchao's linear_nf4, an
autograd Function that dequantizes to the input's dtype and gives a gradient for the input
only. PEFT's LoRA Linear calls base_layer(x) = F.linear(x, W), so it trains unchanged.

Blocks: NF4 scales each run of BLOCK_SIZE (64) values by its absmax, and quantizes those
scales again in runs of a scaler block (QLoRA's double quantization, 256 by default) centred
on their mean over the whole tensor. A tensor's element count must split into whole blocks
and its block count into whole scaler blocks; under FSDP2 each rank's dim-0 chunk must too,
since torchao splits every inner tensor into as many equal chunks. So the scaler block is
chosen per tensor: the largest power of two <= 256 dividing the blocks of one rank's chunk.
For real models (dims multiples of 1024) that is always 256, at any power-of-two world size;
only toy shapes (the tests' hidden 64) get a smaller one. A weight whose elements do not split
into blocks of 64 stays in the storage dtype, logged.

Loading: the scaler mean is a function of the whole tensor, so every rank quantizes the full
tensor and keeps its own dim-0 chunk (as torchtune's load_from_full_model_state_dict does);
quantizing a shard on its own would centre its scalers on a mean the other ranks do not share,
and FSDP2's all-gather keeps one rank's mean for the gathered whole.

Memory: 4 bits per value, plus one int8 scaler per 64 values and one compute-dtype factor per
scaler block: at (64, 256) about 0.516 bytes per parameter, 1/3.9 of bf16 and 1/7.8 of fp32.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.nn as nn

from app.compat import dtensor_like, local_tensor
from app.model.architecture import decoder_blocks
log = logging.getLogger(__name__)

BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256


def nf4_bytes_per_param(block_size: int = BLOCK_SIZE, scaler_block_size: int = SCALER_BLOCK_SIZE,
                        factor_bytes: int = 2) -> float:
    """Bytes per quantized parameter: the 4-bit codes, an int8 scaler per block and one factor
    (in the weight's dtype) per scaler block. For the memory plan."""
    return 0.5 + 1 / block_size + factor_bytes / (block_size * scaler_block_size)


def choose_scaler_block(shape: torch.Size, shards: int) -> Optional[int]:
    """The scaler block for a weight of `shape` split over `shards` dim-0 chunks, or None if it
    cannot be quantized that way (see the module docstring)."""
    rows, numel = shape[0], math.prod(shape)
    # Each rank's chunk is whole rows holding whole blocks: no block straddles two ranks.
    if rows % shards or (numel // shards) % BLOCK_SIZE:
        return None
    return math.gcd(SCALER_BLOCK_SIZE, numel // shards // BLOCK_SIZE)


def find_base_linears(model: nn.Module, blocks: list[nn.Module]) -> dict[str, nn.Linear]:
    """{parameter name of the weight in `model`: its nn.Linear} for the frozen linears inside
    the decoder `blocks`; LoRA's own adapter linears are not part of the base."""
    wanted = {id(m) for block in blocks for m in block.modules() if isinstance(m, nn.Linear)}
    found = {}
    for name, module in model.named_modules():
        if id(module) in wanted and not any(part.startswith("lora_") for part in name.split(".")):
            found[f"{name}.weight"] = module
    return found


def apply_quantization(model: nn.Module, lora_cfg, shards: int, note: bool) -> dict[str, int]:
    """`lora.quantize_base` on a model built on the meta device, before FSDP2 / DDP wrap it:
    {weight name: scaler block} of the weights now NF4 ({} when off). `shards` is the number of
    dim-0 chunks each weight is split into (the world size under FSDP2, else 1)."""
    if lora_cfg is None or lora_cfg.quantize_base is None:
        return {}
    return apply_nf4(model, decoder_blocks(model), shards, note)


def apply_nf4(model: nn.Module, blocks: list[nn.Module], shards: int, note: bool) -> dict[str, int]:
    """Swap the base linears' weights for NF4 parameters of the same shape (on the meta device:
    values come at load time). Returns {weight name: scaler block} of those swapped."""
    swapped, kept = {}, []
    for name, linear in find_base_linears(model, blocks).items():
        scaler_block = choose_scaler_block(linear.weight.shape, shards)
        if scaler_block is None:
            kept.append(f"{name} {tuple(linear.weight.shape)}")
            continue
        linear.weight = nn.Parameter(to_nf4(torch.empty_like(linear.weight), scaler_block), requires_grad=False)
        swapped[name] = scaler_block
    if kept and note:
        log.warning("lora.quantize_base nf4: %d linear weight(s) cannot be split into blocks of %d over %d "
                    "shard(s) and stay unquantized: %s", len(kept), BLOCK_SIZE, shards, ", ".join(kept))
    return swapped


def to_nf4(tensor: torch.Tensor, scaler_block: int):
    from torchao.quantization import to_nf4 as torchao_to_nf4

    return torchao_to_nf4(tensor.contiguous(), block_size=BLOCK_SIZE, scaler_block_size=scaler_block)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (FSDP2), or the tensor itself."""
    return local_tensor(tensor)


def is_nf4(tensor: torch.Tensor) -> bool:
    from torchao.quantization import NF4Tensor

    return isinstance(local_part(tensor), NF4Tensor)


def held_bytes(tensor: torch.Tensor) -> int:
    """Bytes of memory this rank holds for a weight (its shard under FSDP2), counted from the
    storages behind it: an NF4 weight's codes, scales and table, or a plain tensor's data."""
    local = local_part(tensor)
    if is_nf4(local):
        names, _ = local.__tensor_flatten__()
        return sum(getattr(local, n).untyped_storage().nbytes() for n in names)
    return local.untyped_storage().nbytes()


def place_nf4(linear: nn.Linear, full: torch.Tensor, scaler_block: int) -> None:
    """Quantize the full weight `full` and put this rank's part of it into `linear`: the dim-0
    chunk of its DTensor shard under FSDP2, else all of it."""
    from torch.distributed.tensor import DTensor

    current = linear.weight
    quantized = to_nf4(full.to(device=current.device, dtype=current.dtype), scaler_block)
    if isinstance(current, DTensor):
        mesh = current.device_mesh
        chunk = torch.chunk(quantized, mesh.size(), dim=0)[mesh.get_local_rank()]
        # A fresh copy: the full quantized tensor is freed (a chunk's inner tensors are views of
        # it), and FSDP2's all-gather, which views each inner tensor as bytes, gets dense ones.
        local = quantized.new_zeros(chunk.size())
        local.copy_(chunk)
        # Built from its parts rather than by DTensor.from_local, which views the local tensor
        # in ways NF4 does not implement; the spec is the one fully_shard gave the weight.
        linear.weight = nn.Parameter(dtensor_like(local, current), requires_grad=False)
    else:
        linear.weight = nn.Parameter(quantized, requires_grad=False)


def load_nf4_from_rank0(model: nn.Module, swapped: dict[str, int], source: Optional[dict],
                        device: torch.device) -> None:
    """Fill the NF4 weights named in `swapped` from rank 0's full state dict `source` (None on
    the other ranks): one tensor at a time is broadcast, and every rank quantizes it whole."""
    import torch.distributed as dist

    modules = dict(model.named_modules())
    for name in sorted(swapped):
        linear = modules[name.rsplit(".", 1)[0]]
        full = source[name].to(device) if source is not None else \
            torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(full, src=0)
        place_nf4(linear, full, swapped[name])
        del full
    if not dist.is_initialized() or dist.get_rank() == 0:
        weights = [modules[name.rsplit(".", 1)[0]].weight for name in swapped]
        held, values = sum(held_bytes(w) for w in weights), sum(local_part(w).numel() for w in weights)
        log.info("lora.quantize_base nf4: %d linear weights, %.1f MB on this rank (%.3f bytes per value)",
                 len(weights), held / 2**20, held / max(values, 1))
