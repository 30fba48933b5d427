"""Model FLOPs utilization: the model's FLOPs per token, declared here, over the device's peak.

FLOPs per trained token (the PaLM appendix B convention; activation recompute is not counted,
so this is MFU, not hardware FLOPs utilization):
* full fine-tuning: 6·N (forward 2N, backward 4N: gradients for activations and weights);
* LoRA: 4·N for the frozen base (forward 2N, activation gradients 2N, no weight gradients)
  plus 6·N_adapter for the adapters;
* plus attention scores and values, which have no parameters: 12·L·d·T per token
  (L layers, width d, sequence length T; forward 4·L·d·T, backward twice that).
"""

from __future__ import annotations

from typing import Optional

# Dense bf16 tensor-core peaks (FLOP/s), without sparsity, from the vendors' data sheets.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def flops_per_token(n_params: int, n_trainable: int, n_layers: int, hidden: int, seq_len: int,
                    lora: bool) -> float:
    attention = 12 * n_layers * hidden * seq_len
    if lora:
        return 4 * (n_params - n_trainable) + 6 * n_trainable + attention
    return 6 * n_params + attention


def model_flops_per_token(model, seq_len: int, lora: bool, n_params: int, n_trainable: int) -> float:
    """From a Hugging Face causal LM's config. N excludes the input embedding, a lookup, unless
    it is tied to the output head, which is a matmul."""
    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 and PEFT expose the HF config
    config = getattr(inner, "config", None) or inner.get_base_model().config
    embed = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    return flops_per_token(n_params - embed, n_trainable, config.num_hidden_layers, config.hidden_size, seq_len, lora)


def peak_flops(device) -> Optional[float]:
    """The device's dense bf16 peak, or None where there is no honest number (CPU, unknown GPU)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(tokens_per_s: float, flops_per_tok: float, peak_per_device: Optional[float], devices: int) -> Optional[float]:
    if not peak_per_device:
        return None
    return tokens_per_s * flops_per_tok / (peak_per_device * devices)
