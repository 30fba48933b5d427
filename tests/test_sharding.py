"""Sharding and compilation on 2 gloo processes, pure torch (Ray adds nothing here): LoRA adapters
left replicated under FSDP2 follow the trajectory of adapters sharded with their block, with one
gradient all-reduce per optimizer step instead of one reduction per block; compiled decoder blocks
equal eager ones, under FSDP2 with LoRA and under DDP with a full fine-tune.

One spawn runs every variant (3 steps of 2 micro-batches each, the loop's step in miniature, on a
2-layer hidden-64 Llama built by app.model.build.build_model); the tests read its results.
Compilation runs on the "aot_eager" backend (dynamo + AOTAutograd, the same wiring as inductor
without its C++ codegen, which takes minutes on a 2-core box)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from numerics import assert_close

SEQ, ACCUM, STEPS, VOCAB = 32, 2, 3, 300
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]}
VARIANTS = {
    "sharded": {"lora": {**LORA, "fsdp_adapters": "sharded"}, "training": {"parallelism": "fsdp"}},
    "replicated": {"lora": LORA, "training": {"parallelism": "fsdp"}},
    "replicated_compiled": {"lora": LORA, "training": {"parallelism": "fsdp", "compile": True}},
    # bf16 compute: FSDP2 casts what it shards; the replicated adapters compute in bf16 under autocast.
    "sharded_bf16": {"lora": {**LORA, "fsdp_adapters": "sharded"},
                     "training": {"parallelism": "fsdp", "mixed_precision": "bf16"}},
    "replicated_bf16": {"lora": LORA, "training": {"parallelism": "fsdp", "mixed_precision": "bf16"}},
    "ddp_full": {"lora": None, "training": {"parallelism": "ddp"}},
    "ddp_full_compiled": {"lora": None, "training": {"parallelism": "ddp", "compile": True}},
}


def build_cfg(model_dir: Path, lora, training: dict):
    from app.config import build_config

    return build_config({
        "name": "sharding", "model": {"uri": str(model_dir)}, "lora": lora,
        "data": {"uri": str(model_dir / "no-data"), "seq_len": SEQ},
        "training": {"max_steps": STEPS, "global_batch_size": 2 * ACCUM, "micro_batch_size": 1, **training},
        "storage": {"root_uri": str(model_dir / "no-runs")},
    })


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_variant(cfg, model_dir: Path, rank: int, world: int) -> dict:
    """The loop's step: micro-batches with the gradient sync on the last only, the replicated
    gradients' all-reduce, clipping, AdamW; losses normalized by the global batch's label tokens."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from app.compat import compiled_graph_count, is_compiled_module, reset_compile_state
    from app.dev.collectives import count_collectives
    from app.model.build import build_model, resolve_precision, trainable_parameters
    from app.model.sharding import all_reduce_gradients, forward_autocast_dtype, replicated_parameters
    from app.storage import Store
    from app.model.loss import loss_sum
    from app.train.loop import all_reduce_sum, grad_sync_context

    reset_compile_state()
    model = build_model(cfg, Store(), torch.device("cpu"), rank, world)
    params, replicated = trainable_parameters(model), replicated_parameters(model)
    autocast = forward_autocast_dtype(model, resolve_precision(cfg, torch.device("cpu")).param_dtype)
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95))
    rows = torch.randint(3, VOCAB, (STEPS, world * ACCUM, SEQ), generator=torch.Generator().manual_seed(0))
    global_tokens = world * ACCUM * (SEQ - 1)
    out = {"losses": [], "replicated": len(replicated), "state_keys": sorted(model.state_dict()), "autocast": autocast}
    adapter = next((m for n, m in model.named_modules() if n.endswith("lora_A.default")), None)
    if adapter is not None:  # the dtype the adapters compute in
        adapter.register_forward_hook(lambda m, args, result: out.update(adapter_dtype=result.dtype))
    for step in range(STEPS):
        counting = count_collectives() if step == 1 else contextlib.nullcontext()
        with counting as calls:
            total = torch.zeros((), dtype=torch.float64)
            for i in range(ACCUM):
                x = rows[step, rank * ACCUM + i].unsqueeze(0)
                with grad_sync_context(model, enabled=i == ACCUM - 1):
                    loss = loss_sum(model, x, x, autocast)
                    (loss * world / global_tokens).backward()
                total += loss.detach().double()
            all_reduce_gradients(replicated, world)
            if step == 0:
                out["grads"] = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step == 1:
            out["collectives"] = dict(calls)
        out["losses"].append(float(all_reduce_sum(total) / global_tokens))
    out["params"] = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    # FSDP2 subclasses each block (FSDPLlamaDecoderLayer): match the block class in the MRO.
    blocks = [m for m in model.modules() if any(c is LlamaDecoderLayer for c in type(m).__mro__)]
    out["blocks"] = len(blocks)
    out["blocks_compiled"] = sum(is_compiled_module(b) for b in blocks)
    out["graphs"] = compiled_graph_count()
    return out


def _worker(rank: int, world: int, model_dir: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from app.model import sharding

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sharding.COMPILE_BACKEND = "aot_eager"
    try:
        results = {name: run_variant(build_cfg(Path(model_dir), **v), Path(model_dir), rank, world)
                   for name, v in VARIANTS.items()}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory, rank_processes):
    import torch

    from app.dev.local import find_free_port
    from app.dev.tiny import build_tiny_model, build_tiny_tokenizer

    model_dir = tmp_path_factory.mktemp("sharding-model")
    tokenizer = build_tiny_tokenizer([f"a tiny corpus line {i} of {i * 7}" for i in range(200)], vocab_size=VOCAB)
    assert len(tokenizer) <= VOCAB
    build_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(model_dir)
    out = model_dir / "results.pt"
    rank_processes.spawn(_worker, args=(2, str(model_dir), find_free_port(), str(out)), nprocs=2)
    return torch.load(out, weights_only=False)


def assert_same_run(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=rtol)
    for kind in ("grads", "params"):
        assert set(got[kind]) == set(want[kind]) and got[kind], kind
        # AdamW steps sharded DTensors and plain tensors by different kernels (per tensor vs
        # foreach): the last bits differ, and m / sqrt(v) at lr 1e-2 grows them to ~1e-5 relative
        # in 3 steps. A wrong gradient (a missing average) moves weights by lr itself: 1e-2.
        widen = 10 if kind == "params" else 1
        for name, value in want[kind].items():
            assert_close(got[kind][name], value, rtol=rtol * widen, atol=atol * widen, msg=f"{kind} {name}")


def test_replicated_adapters_follow_the_sharded_trajectory(results):
    """The same losses, gradients (after the sync) and weights after 3 steps as the adapters
    sharded by FSDP2: the once-per-step all-reduce averages exactly as FSDP2's reduce-scatter did."""
    assert results["replicated"]["replicated"] == 2 * 7 * 2  # lora_A and lora_B of 7 projections, 2 blocks
    assert results["sharded"]["replicated"] == 0
    assert results["replicated"]["state_keys"] == results["sharded"]["state_keys"]
    assert_same_run(results["replicated"], results["sharded"])


def test_replicated_adapters_compute_in_bf16_like_sharded_ones(results):
    """Under bf16 FSDP2 casts the adapters it shards; replicated ones stay fp32 masters and the forward
    autocasts, so they compute in bf16 too, on the same trajectory up to bf16 rounding."""
    import torch

    sharded, replicated = results["sharded_bf16"], results["replicated_bf16"]
    assert sharded["autocast"] is None and replicated["autocast"] is torch.bfloat16
    assert sharded["adapter_dtype"] == replicated["adapter_dtype"] == torch.bfloat16
    assert results["replicated"]["adapter_dtype"] == torch.float32
    assert all(p.dtype == torch.float32 for p in replicated["params"].values())
    assert replicated["losses"] == pytest.approx(sharded["losses"], rel=2e-2)


def test_replicated_adapters_reduce_once_per_step(results):
    """Per optimizer step: adapters sharded with their blocks cost one gradient reduction per block
    (gloo runs FSDP2's reduce-scatter as an all-reduce) plus the all-reduce of the sharded gradients'
    norm; replicated, one all-reduce of one bucket. The base is all-gathered as before."""
    sharded, replicated = results["sharded"]["collectives"], results["replicated"]["collectives"]
    blocks = results["replicated"]["blocks"]

    def reductions(calls: dict) -> int:
        return sum(n for op, n in calls.items() if op != "all_gather")

    assert reductions(sharded) == blocks + 1
    assert reductions(replicated) == 1
    assert replicated["all_gather"] == sharded["all_gather"] == ACCUM * (2 * blocks + 1)


def test_compiled_blocks_equal_eager_under_fsdp_lora_and_ddp_full(results):
    for compiled, eager in (("replicated_compiled", "replicated"), ("ddp_full_compiled", "ddp_full")):
        got = results[compiled]
        assert got["blocks_compiled"] == got["blocks"] == 2, compiled
        assert got["graphs"] >= 1, compiled  # dynamo really traced the blocks
        assert results[eager]["blocks_compiled"] == 0 and results[eager]["graphs"] == 0
        assert got["state_keys"] == results[eager]["state_keys"]  # checkpoints and exports see no change
        assert_same_run(got, results[eager], rtol=1e-4, atol=1e-6)
