"""Row-seeded dropout (app/model/dropout.py), in one process: a row's mask follows the row, not
its slot, and activation checkpointing recomputes the same masks. The 3 → 2 worker run with
dropout is in test_train.py (it shares that file's dataset)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from numerics import assert_close

from app.config import LoraConfig
from app.model.architecture import build_peft_config
from app.model.build import apply_activation_checkpointing
from app.model.dropout import RowDropout, apply_row_dropout

P = 0.1


def two_dropouts() -> nn.Module:
    return nn.Sequential(nn.Dropout(P), nn.Identity(), nn.Dropout(P))


def masks(model: nn.Module, seeds, row_ids: list[int], step: int, shape=(16, 32), module: int = 0) -> torch.Tensor:
    """Each row's keep mask in dropout `module`, read off a forward of ones."""
    dropout = [m for m in model.modules() if isinstance(m, RowDropout)][module]
    with seeds.rows(row_ids, step):
        out = dropout(torch.ones(len(row_ids), *shape))
    return out != 0


def test_a_row_gets_the_same_mask_in_any_slot_and_micro_batch():
    model = two_dropouts().train()
    seeds = apply_row_dropout(model, seed=7)
    assert [type(m).__name__ for m in model] == ["RowDropout", "Identity", "RowDropout"]

    whole = masks(model, seeds, [10, 11, 12, 13], step=3)
    # Other slots, other micro-batch sizes, other neighbours (a padding row among them).
    split = torch.cat([masks(model, seeds, [12], step=3), masks(model, seeds, [13, -1, 10, 11], step=3)])
    assert torch.equal(split[0], whole[2]) and torch.equal(split[1], whole[3])
    assert torch.equal(split[3], whole[0]) and torch.equal(split[4], whole[1])
    # Another copy of the model (another rank, another world size) agrees.
    again = two_dropouts().train()
    assert torch.equal(masks(again, apply_row_dropout(again, seed=7), [11], step=3)[0], whole[1])
    reseeded = two_dropouts().train()

    assert not torch.equal(whole[0], whole[1])  # rows differ
    assert not torch.equal(masks(model, seeds, [10], step=4)[0], whole[0])  # steps differ
    assert not torch.equal(masks(model, seeds, [10], step=3, module=1)[0], whole[0])  # modules differ
    assert not torch.equal(masks(reseeded, apply_row_dropout(reseeded, seed=8), [10], step=3)[0], whole[0])  # seeds

    big = masks(model, seeds, list(range(64)), step=0, shape=(64, 128))
    assert 1 - big.float().mean().item() == pytest.approx(P, abs=0.005)
    with seeds.rows([0], 0):
        kept = model[0](torch.ones(1, 4096))
    assert torch.equal(kept.unique(), torch.tensor([0.0, 1 / (1 - P)]))  # inverted scaling, as nn.Dropout

    model.eval()
    x = torch.randn(2, 8)
    assert torch.equal(model(x), x)  # no keys needed outside training
    model.train()
    with pytest.raises(RuntimeError, match=r"dropout 0: a training forward outside RowSeeds.rows\(\)"):
        model(x)
    with seeds.rows([1, 2, 3], 0), pytest.raises(RuntimeError, match=r"dropout 0: input batch \(2, 8\)"):
        model(x)


def tiny_lora_llama(attention_dropout: float = 0.0) -> nn.Module:
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         attention_dropout=attention_dropout, use_cache=False)
    lora = LoraConfig(r=4, alpha=8, dropout=P, target_modules=["q_proj", "v_proj", "up_proj"])
    model = get_peft_model(LlamaForCausalLM(config), build_peft_config(lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # PEFT starts B at 0, which would hide lora_A's input (the dropout)
    return model.train()


def adapter_grads(model: nn.Module, seeds, row_ids: list[int], step: int) -> dict[str, torch.Tensor]:
    tokens = torch.arange(len(row_ids) * 16).reshape(len(row_ids), 16) % 64
    model.zero_grad()
    with seeds.rows(row_ids, step):
        model(input_ids=tokens, labels=tokens).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_activation_checkpointing_recomputes_the_same_masks_and_attention_dropout_is_off(caplog):
    plain, checkpointed = tiny_lora_llama(attention_dropout=P), tiny_lora_llama(attention_dropout=P)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed)  # the training path's own (non-reentrant)
    with caplog.at_level(logging.WARNING, logger="app.model.dropout"):
        plain_seeds = apply_row_dropout(plain, seed=0, note=True)
    assert "attention dropout (attention_dropout=0.1 in the model config) is turned off" in caplog.text
    checkpointed_seeds = apply_row_dropout(checkpointed, seed=0)
    assert plain_seeds.modules == checkpointed_seeds.modules == 2 * 3  # every LoRA layer's lora_dropout

    rng = torch.get_rng_state()
    want = adapter_grads(plain, plain_seeds, [5, 9], step=1)
    got = adapter_grads(checkpointed, checkpointed_seeds, [5, 9], step=1)
    # Nothing in the training step drew from the global RNG: attention dropout is off, the rest row-seeded.
    assert torch.equal(torch.get_rng_state(), rng)
    assert want.keys() == got.keys()
    for name in want:
        assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    # The masks matter to these gradients: another step draws others.
    other = adapter_grads(plain, plain_seeds, [5, 9], step=2)
    assert any(not torch.allclose(other[n], want[n], rtol=1e-3) for n in want)
