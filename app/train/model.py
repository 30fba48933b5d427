"""Model building: load base + tokenizer, apply LoRA, apply FSDP2 / DDP, precision."""

from __future__ import annotations


def build_peft_config(lora_cfg):
    """Our LoraConfig → PEFT's. Training and export both build it here, so adapters match."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM",
    )
