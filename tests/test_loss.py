"""The chunked loss equals the full-logits loss: value and every gradient, through a real tiny HF
Llama (full fine-tune with tied and untied heads, PEFT LoRA), with masked labels, a padding row,
packed documents and chunk sizes that do and do not divide the tokens; and a 2-process FSDP2
(gloo) training run follows the same trajectory with either loss."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from numerics import assert_close

from app.batch import IGNORE_INDEX as IGNORE
from app.model.loss import LossConfigError, apply_loss, check_loss_setup, loss_sum

VOCAB, SEQ = 96, 24


def build_llama(tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, initializer_range=0.2)
    return LlamaForCausalLM(config)


def add_lora(model):
    from peft import get_peft_model

    from app.config import LoraConfig
    from app.model.architecture import build_peft_config

    torch.manual_seed(1)
    model = get_peft_model(model, build_peft_config(LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])))
    for name, p in model.named_parameters():  # B starts at zero: give the adapters a gradient path both ways
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def make_batch(seed: int = 0):
    """3 rows: a prompt-masked row of two packed documents, a fully labelled row, a padding row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :7] = IGNORE
    labels[2] = IGNORE
    positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).repeat(3, 1)
    return ids, labels, positions


def loss_and_grads(model, batch, autocast_dtype=None):
    ids, labels, positions = batch
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, ids, labels, autocast_dtype, positions)
    (loss * 0.37).backward()  # an upstream scale, as the loop's 1/global-tokens
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("variant", ["full-ft", "full-ft-tied", "lora"])
def test_chunked_loss_and_gradients_equal_the_full_path(variant):
    reference = build_llama(tie=variant == "full-ft-tied")
    if variant == "lora":
        reference = add_lora(reference)
    batch = make_batch()
    want_loss, want_grads = loss_and_grads(reference, batch)
    assert want_grads and all(g is not None for g in want_grads.values())
    # 3 x 24 = 72 positions: chunks of 8 divide them, 7 leave a ragged last chunk, 4096 is one chunk.
    for chunk in (8, 7, 4096):
        model = copy.deepcopy(reference)
        apply_loss(model, "chunked", chunk)
        assert list(model.state_dict()) == list(reference.state_dict())
        loss, grads = loss_and_grads(model, batch)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
        assert set(grads) == set(want_grads)
        for name, want in want_grads.items():
            assert_close(grads[name], want, rtol=1e-4, atol=1e-5, msg=f"{name}, chunk {chunk}")
        with torch.no_grad():  # evaluate's path: no gradients are built
            assert float(loss_sum(model, *batch[:2], None, batch[2])) == pytest.approx(float(want_loss), rel=1e-6)


def test_chunked_loss_under_bf16_autocast_is_as_accurate_as_the_full_path():
    """The DDP path: fp32 weights under bf16 autocast. Logits in bf16 and softmax in fp32 as in the
    full path, so the two differ by bf16 rounding only: each is as far from the fp32 gradients."""
    reference = build_llama()
    batch = make_batch(seed=1)
    _, exact = loss_and_grads(reference, batch)
    want_loss, want_grads = loss_and_grads(reference, batch, torch.bfloat16)
    model = copy.deepcopy(reference)
    apply_loss(model, "chunked", 16)
    loss, grads = loss_and_grads(model, batch, torch.bfloat16)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-3)

    def error(got: torch.Tensor, name: str) -> float:
        return float((got - exact[name]).norm() / exact[name].norm())

    for name, want in want_grads.items():
        assert grads[name].dtype == want.dtype
        assert error(grads[name], name) <= 1.25 * error(want, name) + 1e-3, name


def test_loss_settings_that_cannot_work_are_rejected_in_one_line():
    from app.config import ConfigError, build_config

    tree = {"name": "x", "model": {"uri": "s3://b/m"}, "data": {"uri": "s3://b/d", "seq_len": 64},
            "training": {"max_steps": 1, "loss": "liger"}, "storage": {"root_uri": "s3://b/runs"}}
    with pytest.raises(ConfigError, match=r"^config: training.loss liger needs scaling.use_gpu: true") as err:
        build_config(tree)
    assert "\n" not in str(err.value)
    tree["training"]["loss"] = "chunked"
    tree["lora"] = {"target_modules": ["q_proj", "lm_head"]}
    with pytest.raises(LossConfigError, match=r"^training.loss chunked: lora.target_modules adapts lm_head"):
        check_loss_setup(build_config(tree))
    gemma_like = build_llama().config
    gemma_like.final_logit_softcapping = 30.0
    tree["lora"] = None
    with pytest.raises(LossConfigError, match=r"^training.loss chunked: the model's final_logit_softcapping"):
        check_loss_setup(build_config(tree), gemma_like)


def _train_both_losses(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank of a 2-process FSDP2 run: the same 4 AdamW steps with each loss, LoRA and full."""
    import torch.distributed as dist

    from app.model.build import Precision, apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for variant in ("full-ft", "lora"):
        for mode in ("full", "chunked"):
            model = build_llama(seed=3)
            if variant == "lora":
                model = add_lora(model)
            apply_fsdp(model, Precision(torch.float32, None, None))
            apply_loss(model, mode, 20)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            losses = []
            for step in range(4):
                ids, labels, positions = make_batch(seed=rank)  # one batch per rank, overfitted
                tokens = torch.tensor(float((labels[:, 1:] != IGNORE).sum()))
                dist.all_reduce(tokens)
                loss = loss_sum(model, ids, labels, None, positions)
                (loss * world / tokens).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(float(total / tokens))
            results[f"{variant}/{mode}"] = losses
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def test_fsdp_training_follows_the_same_trajectory_with_either_loss(tmp_path, rank_processes):
    out = tmp_path / "losses.json"
    rank_processes.spawn(_train_both_losses, args=(2, str(tmp_path / "init"), str(out)), nprocs=2)
    losses = json.loads(out.read_text())
    for variant in ("full-ft", "lora"):
        full, chunked = losses[f"{variant}/full"], losses[f"{variant}/chunked"]
        assert full[-1] < full[0] - 0.1, variant  # the run learns: the comparison is not of flat lines
        assert chunked == pytest.approx(full, rel=1e-5), variant
