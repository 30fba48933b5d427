"""QLoRA (`lora.quantize_base: nf4`): the frozen base's decoder linears held in torchao's NF4.

One process for the numerics, and one real Ray Train run (2 workers, S3) that builds the model
under FSDP2 and DDP, trains under FSDP2, checkpoints and exports."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_dataset
from numerics import assert_close

from app.config import build_config
from app.observe.metrics import load_metrics
from app.storage import Store, join

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = "s3://eft/models/tiny-qlora"
BASE_BF16 = "s3://eft/models/tiny-qlora-bf16"
DATA = "s3://eft/data/qlora-tests"


def lora_tree(**extra) -> dict:
    return {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "quantize_base": "nf4", **extra}


def save_local_base(path: Path, intermediate_size: int = 172) -> Path:
    """A tiny random Llama on disk; 172 is a width whose blocks are not a power of two."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def quantized_reference(base_dir: Path, lora_cfg):
    """Single process: from_pretrained + LoRA (the training init), base linears made NF4."""
    from app.model.build import load_pretrained
    from app.model.quantize import apply_quantization, load_nf4_from_rank0

    model = load_pretrained(base_dir, torch.float32, lora_cfg, seed=0)
    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    swapped = apply_quantization(model, lora_cfg, shards=1, note=False)
    load_nf4_from_rank0(model, swapped, plain, torch.device("cpu"))
    return model, plain, swapped


def test_scaler_blocks_divide_each_shard_or_the_weight_stays_unquantized(caplog):
    from app.model.quantize import apply_nf4, choose_scaler_block, is_nf4, nf4_bytes_per_param

    assert choose_scaler_block(torch.Size([4096, 4096]), 1) == 256  # real widths: QLoRA's own blocks
    assert choose_scaler_block(torch.Size([4096, 4096]), 8) == 256
    assert choose_scaler_block(torch.Size([64, 64]), 1) == 64  # 64 blocks in all
    assert choose_scaler_block(torch.Size([64, 64]), 2) == 32  # 32 per rank
    assert choose_scaler_block(torch.Size([172, 64]), 2) == 2  # 86 blocks per rank
    assert choose_scaler_block(torch.Size([64, 64]), 3) is None  # 64 rows do not split in 3
    assert choose_scaler_block(torch.Size([3, 7]), 1) is None  # 21 values: no block of 64
    assert nf4_bytes_per_param() == pytest.approx(0.5 + 1 / 64 + 2 / (64 * 256))

    with torch.device("meta"):
        block = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))
    with caplog.at_level("WARNING", logger="app.model.quantize"):
        swapped = apply_nf4(block, [block], shards=3, note=True)
    assert swapped == {"0.weight": 32} and is_nf4(block[0].weight) and not is_nf4(block[1].weight)
    assert "1.weight (64, 96)" in caplog.text  # 64 rows do not split over 3 ranks: named, kept


def test_nf4_linears_are_close_to_the_base_and_only_the_adapters_get_gradients(tmp_path):
    """The quantized model's base linears dequantize to within NF4's rounding of the base; its
    forward and LoRA gradients are those of a plain model holding the dequantized weights."""
    from app.config import LoraConfig
    from app.model.build import load_pretrained
    from app.model.quantize import is_nf4

    base_dir = save_local_base(tmp_path / "base")
    lora_cfg = LoraConfig(**lora_tree())
    model, plain, swapped = quantized_reference(base_dir, lora_cfg)
    assert len(swapped) == 2 * 7  # every linear of both blocks, adapted (q, v) or not
    params = dict(model.named_parameters())
    assert all(is_nf4(params[k]) for k in swapped)
    assert not any(is_nf4(p) for k, p in params.items() if k not in swapped)  # embeddings, norms, head
    dequantized = {}
    for name in swapped:
        weight = params[name].get_original_weight()
        rel = float((weight - plain[name]).norm() / plain[name].norm())
        assert 0.01 < rel < 0.15, (name, rel)  # quantized, and within NF4's error
        dequantized[name] = weight

    # The same forward and backward through a plain model holding the dequantized weights.
    twin = load_pretrained(base_dir, torch.float32, lora_cfg, seed=0)
    twin.load_state_dict({**plain, **dequantized})
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, twin):
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01)  # B starts at zero: give A a gradient too
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    twin_params = dict(twin.named_parameters())
    with_grad = [k for k, p in model.named_parameters() if p.grad is not None]
    assert with_grad and all("lora_" in k for k in with_grad)
    assert all(p.requires_grad == ("lora_" in k) for k, p in model.named_parameters())
    for name in with_grad:
        assert float(params[name].grad.abs().sum()) > 0, name
        assert_close(params[name].grad, twin_params[name].grad, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def qlora_data(s3, ray_cluster, tmp_path_factory):
    """The tiny base and its dataset, and the base again in bf16 (as released models are)."""
    from transformers import AutoModelForCausalLM

    cfg = make_cfg("prep", model={"uri": BASE})
    manifest = build_tiny_dataset(cfg, tmp_path_factory.mktemp("raw"), max_docs=150)
    store, work = Store(), tmp_path_factory.mktemp("bf16")
    local = store.cache_locally(BASE)
    AutoModelForCausalLM.from_pretrained(local, dtype=torch.bfloat16).save_pretrained(work)
    for f in local.iterdir():
        if not (work / f.name).exists():
            (work / f.name).write_bytes(f.read_bytes())  # the tokenizer
    store.upload_dir(work, BASE_BF16)
    return manifest


def make_cfg(name: str, **sections):
    tree = {
        "name": name,
        "model": {"uri": BASE_BF16},
        "lora": lora_tree(target_modules=ALL_LINEAR),
        "data": {"uri": DATA, "seq_len": 64},
        "prepare": {"input_uri": "s3://eft/raw/qlora-tests.jsonl"},
        "training": {"max_steps": 6, "global_batch_size": 8, "micro_batch_size": 4, "lr": 3e-2,
                     "schedule": "constant"},
        "checkpoint": {"save_every_steps": 6},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": "s3://eft/runs-qlora"},
    }
    for key, value in sections.items():
        tree[key] = {**(tree.get(key) or {}), **value}
    return build_config(tree)


def _train_and_measure(config: dict) -> None:
    """Worker fn: the training loop, with its model measured first: the bytes each rank holds
    for the base's linear weights, and a forward's loss; and the same for the DDP build."""
    import ray.train

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from app.model.quantize import find_base_linears, held_bytes, local_part
    from app.train import loop

    build = loop.build_model
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))

    def measure(model) -> dict:
        # Found by isinstance: fully_shard swaps each block's class for an FSDP subclass of it.
        blocks = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
        weights = [m.weight for m in find_base_linears(model, blocks).values()]
        with torch.no_grad():
            loss = float(model(input_ids=ids, labels=ids).loss)
        return {"bytes": sum(held_bytes(w) for w in weights), "values": sum(local_part(w).numel() for w in weights),
                "weights": len(weights), "loss": loss}

    def build_and_measure(cfg, *args):
        model = build(cfg, *args)
        ddp = cfg.model_copy(update={"training": cfg.training.model_copy(update={"parallelism": "ddp"})})
        check = {"fsdp": measure(model), "ddp": measure(build(ddp, *args))}
        if ray.train.get_context().get_world_rank() == 0:
            Store().write_json(join(cfg.run_uri, "base-check.json"), check)
        return model

    loop.build_model = build_and_measure
    loop.train_loop_per_worker(config)


def test_qlora_run_learns_checkpoints_adapters_and_exports(qlora_data, tmp_path):
    """2 FSDP2 workers train adapters over an NF4 base: the loss falls, the base's linears take a
    quarter of bf16's bytes, checkpoints hold adapters only, and the export is an adapter PEFT
    loads on the bf16 base plus a bf16 merged model transformers loads."""
    from peft import PeftModel
    from ray import cloudpickle
    from transformers import AutoModelForCausalLM

    from app.export import export_run
    from app.train.launch import run_training

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = make_cfg("qlora")
    summary = run_training(cfg, train_fn=_train_and_measure)
    store = Store()
    assert summary["status"] == "succeeded" and summary["steps"] == 6
    losses = [m["loss"] for m in load_metrics(store, cfg.run_uri)]
    assert summary["final_train_loss"] < summary["first_train_loss"] - 0.3, losses

    # FSDP2 shards the NF4 weights (each rank holds half), DDP replicates them; both hold about a
    # quarter of what bf16 would (4 bits and the block scales) and compute the quantized loss.
    check = store.read_json(join(cfg.run_uri, "base-check.json"))
    reference, _, _ = quantized_reference(store.cache_locally(BASE_BF16), cfg.lora)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = float(reference(input_ids=ids, labels=ids).loss)
    linear_values = 2 * (4 * 64 * 64 + 3 * 64 * 128)  # 2 blocks: attention, MLP
    for parallelism, shards in (("fsdp", 2), ("ddp", 1)):
        got = check[parallelism]
        assert got["weights"] == 14 and got["values"] == linear_values // shards, parallelism
        ratio = got["bytes"] / (2 * got["values"])
        assert 0.25 < ratio < 0.3, (parallelism, ratio)
        # Scaler blocks differ with the shard count: the second-level rounding of the scales.
        assert got["loss"] == pytest.approx(expected, rel=1e-4), parallelism

    meta = pickle.loads(store.read_bytes(join(summary["latest_checkpoint"], ".metadata")))
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)

    out = export_run(cfg, merge=True)
    assert out["merged_dtype"] == "bfloat16"
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    store.download_dir(out["adapter_uri"], adapter_dir)
    store.download_dir(out["merged_uri"], merged_dir)
    base = AutoModelForCausalLM.from_pretrained(store.cache_locally(BASE_BF16), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.bfloat16
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(store.cache_locally(BASE_BF16), dtype=torch.float32)(ids).logits
        want, got = adapted(ids).logits, merged.float()(ids).logits
    # The merge folds the trained adapters into the original (unquantized) base weights.
    assert float((want - plain).abs().max()) > 0.1
    assert float((got - want).abs().max()) < 0.1 * float((want - plain).abs().max())
