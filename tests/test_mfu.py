"""MFU: the FLOPs per token the code declares, and no made-up peak on a CPU."""

import pytest
import torch

from app.model.mfu import PEAK_BF16_FLOPS, flops_per_token, mfu, model_flops_per_token, peak_flops


def test_full_finetuning_is_6n_plus_attention_and_lora_about_4n():
    n, layers, width, seq = 8_000_000_000, 32, 4096, 4096
    attention = 12 * layers * width * seq
    assert flops_per_token(n, n, layers, width, seq, lora=False) == 6 * n + attention
    lora = flops_per_token(n + 20_000_000, 20_000_000, layers, width, seq, lora=True)
    assert lora == 4 * n + 6 * 20_000_000 + attention
    assert 0.66 < lora / flops_per_token(n, n, layers, width, seq, lora=False) < 0.72  # the attention term is shared


def test_model_flops_come_from_the_hf_config_and_skip_the_embedding_lookup():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    got = model_flops_per_token(model, seq_len=32, lora=False, n_params=n, n_trainable=n)
    assert got == 6 * (n - 1000 * 64) + 12 * 2 * 64 * 32


def test_mfu_is_none_without_an_honest_peak():
    assert peak_flops(torch.device("cpu")) is None
    assert mfu(1e5, 1e9, None, 2) is None
    # 2 H100s at 40% of their bf16 peak.
    assert mfu(0.4 * 2 * 989e12 / 1e9, 1e9, PEAK_BF16_FLOPS["H100"], 2) == pytest.approx(0.4)
