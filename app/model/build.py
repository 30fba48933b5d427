"""Model building: load base + tokenizer, apply LoRA, apply FSDP2 / DDP, precision.

Loading scales: every rank builds the model on the meta device, then fills what it owns
(app/model/weights.py): under FSDP2 each rank reads its own slices of the safetensors files
straight from the model URI; under DDP each node downloads the model once to its node-local
cache and its ranks read it there. Only a model without safetensors files falls back to rank 0
reading it whole and broadcasting it into the shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from app.compat import ddp_ignore
from app.model.architecture import ModelError, build_peft_config, decoder_blocks
from app.model.quantize import apply_quantization, load_nf4_from_rank0
from app.model.sharding import adapters_to_replicate, apply_compile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    storage_dtype: torch.dtype  # dtype of the (frozen) base weights as loaded
    param_dtype: Optional[torch.dtype]  # compute dtype under FSDP2 / autocast; None = as stored
    reduce_dtype: Optional[torch.dtype]


def resolve_precision(cfg, device: torch.device) -> Precision:
    on_gpu = device.type == "cuda"
    mp = cfg.training.mixed_precision
    bf16 = mp == "bf16" or (mp == "auto" and on_gpu)
    if cfg.model.dtype == "auto":
        # A frozen LoRA base can live in bf16; trainable full-FT weights keep fp32 masters.
        storage = torch.bfloat16 if (on_gpu and cfg.lora is not None) else torch.float32
    else:
        storage = getattr(torch, cfg.model.dtype)
    return Precision(storage, torch.bfloat16 if bf16 else None, torch.float32 if bf16 else None)


def check_model_dir(local_dir: Path, uri: str) -> None:
    if not (Path(local_dir) / "config.json").is_file():
        raise ModelError(f"{uri}: not a Hugging Face model dir (no config.json)")
    if not any(Path(local_dir).glob("*.safetensors")) and not any(Path(local_dir).glob("*.bin")):
        raise ModelError(f"{uri}: no weights (*.safetensors) in model dir")


def load_pretrained(local_dir: Path, dtype: torch.dtype, lora_cfg=None, seed: int = 0) -> nn.Module:
    """The plain, fully materialized path: the tests' reference, export's base, and rank 0's
    source when a model has no safetensors files."""
    from transformers import AutoModelForCausalLM

    from app.model.weights import init_adapters

    model = AutoModelForCausalLM.from_pretrained(local_dir, dtype=dtype)
    if lora_cfg is not None:
        from peft import get_peft_model

        model = get_peft_model(model, build_peft_config(lora_cfg))
        init_adapters(model, seed)  # the same values the sharded load draws on each rank
    return model


def build_meta_model(local_dir: Path, dtype: torch.dtype, lora_cfg=None) -> tuple[nn.Module, dict]:
    """Parameters on the meta device (no memory); buffers real, returned to be restored after
    `to_empty` (non-persistent buffers such as rotary frequencies are in no state dict)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(local_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if lora_cfg is not None:
            from peft import get_peft_model

            model = get_peft_model(model, build_peft_config(lora_cfg))
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    return model, buffers


def apply_fsdp(model: nn.Module, precision: Precision, replicate: frozenset = frozenset()) -> None:
    """FSDP2 per decoder block and at the root; `replicate` (LoRA adapters, see app.model.sharding)
    stays out of it: plain tensors on every rank, reduced by the loop once per step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    ignored = set(replicate) or None
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=mp, ignored_params=ignored)
    fully_shard(model, mp_policy=mp, ignored_params=ignored)


def apply_activation_checkpointing(model: nn.Module) -> None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Non-reentrant: works with frozen inputs (LoRA) and with FSDP2's hooks.
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inner.config.use_cache = False


def load_weights_from_rank0(model: nn.Module, source: Optional[nn.Module], buffers: dict,
                            device: torch.device, quantized: Optional[dict] = None) -> None:
    """Materialize `model` on `device` and fill it from rank 0's `source` (None elsewhere): the
    path for weights in .bin files, which cannot be read a slice at a time, and for QLoRA.
    `quantized` names the NF4 weights (see app.model.quantize), which are quantized whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name].to(device=device, dtype=buf.dtype))
    full = source.state_dict() if source is not None else {}
    if quantized:
        load_nf4_from_rank0(model, quantized, full if source is not None else None, device)
        full = {k: v for k, v in full.items() if k not in quantized}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=not quantized))


def build_model(cfg, store, device: torch.device, rank: int, world_size: int, frozen: bool = False) -> nn.Module:
    """Base (+ LoRA) → precision → activation checkpointing → NF4 → compile → FSDP2 or DDP,
    weights loaded. `frozen`: a copy that only forwards without gradients (GRPO's KL reference for
    a full fine-tune): sharded like the policy under FSDP2, plain on each rank under DDP (which
    has no gradients to reduce for it), without activation checkpointing, in eval mode."""
    from app.model.weights import WEIGHT_SUFFIXES, list_safetensors, load_mode, load_owned_weights
    from app.storage import Store

    precision = resolve_precision(cfg, device)
    uri, fsdp = cfg.model.uri, cfg.training.parallelism == "fsdp"
    files = list_safetensors(store, uri)
    # QLoRA quantizes each weight whole on every rank (a rank's own rows alone would centre the
    # codes on the wrong mean), so its weights come whole, broadcast from rank 0.
    nf4 = cfg.lora is not None and cfg.lora.quantize_base is not None
    mode = "rank0_broadcast" if nf4 else load_mode(cfg.training.parallelism, files)
    # Ranged: only the small files (config, tokenizer) come to the node; the weights stay remote.
    local_dir = store.cache_locally(uri, skip_suffixes=WEIGHT_SUFFIXES if mode == "ranged" else ())
    model, buffers = build_meta_model(local_dir, precision.storage_dtype, cfg.lora)
    if frozen:
        model.requires_grad_(False)
    elif cfg.training.activation_checkpointing:
        apply_activation_checkpointing(model)
    quantized = apply_quantization(model, cfg.lora, shards=world_size if fsdp else 1, note=rank == 0)
    if cfg.training.compile:
        apply_compile(decoder_blocks(model))
    if fsdp:
        apply_fsdp(model, precision, replicate=adapters_to_replicate(cfg, model))
    if mode == "ranged":
        load_owned_weights(model, store, uri, files, buffers, device, cfg.training.seed)
    elif mode == "node_cache":
        local = Store()  # reads of the node's own copy: not storage traffic
        load_owned_weights(model, local, str(local_dir), list_safetensors(local, str(local_dir)), buffers, device,
                           cfg.training.seed)
    else:
        check_model_dir(local_dir, uri)
        source = load_pretrained(local_dir, precision.storage_dtype, cfg.lora, cfg.training.seed) if rank == 0 else None
        load_weights_from_rank0(model, source, buffers, device, quantized)
        del source
    if frozen:
        return model.eval()
    if not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        # Every rank quantized the same broadcast weights: DDP need not broadcast the NF4 ones again.
        ddp_ignore(model, list(quantized))
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) — global counts, also under FSDP2 (DTensor.numel is the full size)."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total
