"""Weight loading that scales with the cluster: the safetensors ranged reader against
safetensors' own loader on a real S3 endpoint; the LoRA init as a function of (seed, name); a tied
head; the rank-0 fallback for .bin weights; and on a real 2-node Ray cluster, each node reads about
half the weights and the loaded model equals from_pretrained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from app.model.architecture import ModelError
from app.model.weights import init_adapter, list_safetensors, read_header, read_safetensors_index
from app.storage import Store, join



def save_checkpoint(tmp_path: Path, uri: str) -> dict[str, torch.Tensor]:
    """A sharded bf16 checkpoint (index + shards, written by transformers) plus odd tensors
    (fp32, int64, 0-d) in a third file the index also names, uploaded to `uri`."""
    from safetensors.torch import load_file, save_file

    from app.dev.tiny import build_corpus, build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(build_corpus(max_docs=20), vocab_size=300)
    model = build_tiny_model(tok).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    odd = {"extra.scale": torch.tensor(3.5), "extra.ids": torch.arange(10, dtype=torch.int64).reshape(5, 2),
           "extra.cube": torch.randn(3, 4, 5)}
    save_file(odd, tmp_path / "extra.safetensors")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: "extra.safetensors" for name in odd})
    index_path.write_text(json.dumps(index))
    Store().upload_dir(tmp_path, uri)
    return {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_ranged_reader_matches_safetensors_on_s3(s3, tmp_path):
    uri = "s3://eft/models/ranged-reader"
    reference = save_checkpoint(tmp_path, uri)
    store = Store()
    files = list_safetensors(store, uri)
    assert len(files) >= 3 and all(name.endswith(".safetensors") for name in files)
    index = read_safetensors_index(store, uri, files)
    assert set(index) == set(reference)
    assert index["model.embed_tokens.weight"].dtype == torch.bfloat16
    for name, want in reference.items():
        stored = index[name]
        assert stored.dtype == want.dtype and stored.shape == tuple(want.shape), name
        whole = stored.read_rows(store, 0, want.shape[0] if want.dim() else 1)
        assert torch.equal(whole, want), name
    # A slice of rows costs exactly its own bytes: one ranged read, nothing around it.
    embed = index["model.embed_tokens.weight"]
    before = store.bytes_read
    rows = embed.read_rows(store, 7, 5)
    assert torch.equal(rows, reference["model.embed_tokens.weight"][7:12])
    assert store.bytes_read - before == 5 * embed.row_bytes == 5 * 64 * 2
    assert embed.read_rows(store, 3, 0).shape == (0, 64)


def test_a_bad_weights_file_is_named_in_one_line(s3):
    store = Store()
    uri = "s3://eft/models/bad-weights"
    store.write_bytes(join(uri, "model.safetensors"), (10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelError, match=r"s3://eft/models/bad-weights/model.safetensors: not a safetensors"):
        read_header(store, join(uri, "model.safetensors"), 10)
    store.write_json(join(uri, "model.safetensors.index.json"), {"weight_map": {"w": "missing.safetensors"}})
    with pytest.raises(ModelError, match=r"index.json: names missing.safetensors, which is not in"):
        list_safetensors(store, uri)


def test_adapter_init_is_a_function_of_seed_and_name():
    """Every rank and every world size draws the same adapter: A follows PEFT's kaiming-uniform
    (a=sqrt(5), bound 1/sqrt(fan_in)), B is zero, and the values depend on (seed, name) only."""
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    a = init_adapter(name, (8, 64), seed=0)
    assert torch.equal(a, init_adapter(name, (8, 64), seed=0))
    assert not torch.equal(a, init_adapter(name, (8, 64), seed=1))
    assert not torch.equal(a, init_adapter(name.replace("q_proj", "v_proj"), (8, 64), seed=0))
    bound = 1 / math.sqrt(64)
    assert float(a.abs().max()) <= bound and float(a.std()) == pytest.approx(bound / math.sqrt(3), rel=0.15)
    assert not init_adapter(name.replace("lora_A", "lora_B"), (64, 8), seed=0).any()
    with pytest.raises(ModelError, match="lora_magnitude_vector"):
        init_adapter("x.lora_magnitude_vector.default.weight", (8,), seed=0)


def test_each_node_reads_its_share_and_the_model_equals_from_pretrained(s3, tmp_path, run_scenario):
    """2 nodes x 1 FSDP2 worker on a real multi-node Ray cluster: each node reads at most
    1.2 x weights / 2 from storage, and the loaded model (bf16 on S3 → fp32, sharded index, LoRA)
    equals from_pretrained's exactly."""
    from app.config import build_config
    from app.dev.tiny import build_corpus, save_tiny_base
    from app.observe.records import load_events

    base = "s3://eft/models/tiny-multinode"
    save_tiny_base(Store(), base, texts=build_corpus(max_docs=40), hidden_size=256, num_layers=4, num_heads=4,
                   intermediate_size=512)
    cfg = build_config({
        "name": "load-multinode", "model": {"uri": base},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "data": {"uri": "s3://eft/data/unused", "seq_len": 64},
        "training": {"parallelism": "fsdp", "seed": 7, "max_steps": 1}, "storage": {"root_uri": "s3://eft/runs-weights"}})
    proc = run_scenario("weights_load", cfg.model_dump_json(), s3.endpoint, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    check = Store().read_json(join(cfg.run_uri, "load-check.json"))
    assert check["max_abs_diff"] == 0.0 and check["rotary_diff"] == 0.0 and check["lora_a_std"] > 0.01
    (loaded,) = [e for e in load_events(Store(), cfg.run_uri) if e["kind"] == "weights_loaded"]
    assert loaded["mode"] == "ranged" and loaded["weights_bytes"] > 5_000_000
    per_node = loaded["bytes_per_node"]
    assert len(per_node) == 2, loaded["ranks"]
    print(f"bytes read per node: {per_node} of {loaded['weights_bytes']} weight bytes")
    for node, read in per_node.items():
        assert read <= 1.2 * loaded["weights_bytes"] / 2, (node, read, loaded["weights_bytes"])


def test_a_tied_head_reads_the_embedding_it_is_tied_to(tmp_path):
    """A checkpoint of a model with tied embeddings holds no lm_head: the unsharded (DDP) build
    fills it from the embedding's bytes, as from_pretrained ties it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.model.build import build_meta_model
    from app.model.weights import load_owned_weights

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    store = Store()
    model, buffers = build_meta_model(tmp_path, torch.float32)
    load_owned_weights(model, store, str(tmp_path), list_safetensors(store, str(tmp_path)), buffers,
                       torch.device("cpu"), seed=0)
    reference = LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    got = model.state_dict()
    assert set(got) == set(reference)
    for name, want in reference.items():
        assert torch.equal(got[name], want), name


def test_a_model_without_safetensors_falls_back_to_the_rank0_broadcast(tmp_path):
    """.bin weights cannot be read a slice at a time: rank 0 loads them whole and broadcasts them
    into the FSDP2 shards (one process here), with the same LoRA init as every other path."""
    import os

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.config import build_config
    from app.dev.local import find_free_port
    from app.model.build import build_model, load_pretrained
    from app.model.weights import load_mode

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    config.save_pretrained(tmp_path)
    torch.save(LlamaForCausalLM(config).state_dict(), tmp_path / "pytorch_model.bin")
    assert list_safetensors(Store(), str(tmp_path)) is None and load_mode("fsdp", None) == "rank0_broadcast"
    cfg = build_config({"name": "bin", "model": {"uri": str(tmp_path)}, "lora": {"r": 4},
                        "data": {"uri": str(tmp_path / "data"), "seq_len": 64},
                        "training": {"max_steps": 1, "parallelism": "fsdp", "seed": 5},
                        "storage": {"root_uri": str(tmp_path / "runs")}})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = build_model(cfg, Store(), torch.device("cpu"), 0, 1)
        # Adapters may be replicated (plain tensors) under FSDP2: only the sharded ones are gathered.
        got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()
    reference = load_pretrained(tmp_path, torch.float32, cfg.lora, seed=5).state_dict()
    assert set(got) == set(reference)
    assert max(float((got[k] - reference[k]).abs().max()) for k in reference) == 0.0


def load_through_cache(ckpt_dir: Path, uri: str, cache: Path) -> tuple[dict[str, torch.Tensor], Store]:
    """The model at `uri` loaded the ranged way through the slice cache under `cache`, on a Store of
    its own: what the load read from storage is its bytes_read."""
    from app.model.build import build_meta_model
    from app.model.weights import load_owned_weights

    model, buffers = build_meta_model(ckpt_dir, torch.float32)
    files = list_safetensors(Store(), uri)
    store = Store()
    load_owned_weights(model, store, uri, files, buffers, torch.device("cpu"), seed=0, cache_root=cache)
    return model.state_dict(), store


def test_a_second_load_on_the_node_reads_its_slices_from_the_node_cache(s3, tmp_path):
    """The second load reads nothing from storage and gives the same tensors; a torn (short) slice
    file, or a writer's leftover temp file, is never taken for a complete slice: that slice alone
    is read again. Other ranges (another world size) miss and come from storage."""
    from app.model.weights import open_slice_cache, read_safetensors_index

    uri, cache = "s3://eft/models/slice-cache", tmp_path / "cache"
    save_checkpoint(tmp_path / "ckpt", uri)
    first, cold = load_through_cache(tmp_path / "ckpt", uri, cache)
    assert cold.bytes_read > 200_000 and cold.bytes_cached == 0
    second, warm = load_through_cache(tmp_path / "ckpt", uri, cache)
    assert warm.bytes_read == 0 and warm.bytes_cached == cold.bytes_read
    assert set(second) == set(first) and all(torch.equal(second[k], first[k]) for k in first)

    slices = sorted((p for p in cache.rglob("*@*") if not p.name.startswith(".")), key=lambda p: p.stat().st_size)
    torn = slices[-1]
    length = torn.stat().st_size
    torn.write_bytes(torn.read_bytes()[: length // 2])
    (torn.parent / f".{torn.name}.tmp-dead").write_bytes(b"\0" * length)
    third, again = load_through_cache(tmp_path / "ckpt", uri, cache)
    assert again.bytes_read == length and again.bytes_cached == cold.bytes_read - length
    assert all(torch.equal(third[k], first[k]) for k in first)
    assert torn.stat().st_size == length

    store = Store()
    reader = open_slice_cache(store, uri, cache)
    embed = read_safetensors_index(reader, uri, list_safetensors(store, uri))["model.embed_tokens.weight"]
    before = store.bytes_read
    assert torch.equal(embed.read_rows(reader, 0, 7), first["model.embed_tokens.weight"][:7].bfloat16())
    assert store.bytes_read - before == 7 * embed.row_bytes


def test_new_weights_at_the_same_uri_are_not_served_from_the_old_slices(s3, tmp_path):
    """Weights replaced at the same URI (another listing): the next load reads them all from
    storage, gets the new values, and the old listing's slices are dropped from the node's disk."""
    from safetensors.torch import load_file, save_file

    uri, cache = "s3://eft/models/slice-cache-replaced", tmp_path / "cache"
    save_checkpoint(tmp_path / "ckpt", uri)
    old, cold = load_through_cache(tmp_path / "ckpt", uri, cache)
    (shard,) = [p for p in (tmp_path / "ckpt").glob("*.safetensors")
                if "model.embed_tokens.weight" in load_file(p)]
    tensors = load_file(shard)
    tensors["model.embed_tokens.weight"] = -tensors["model.embed_tokens.weight"]
    save_file(tensors, shard, metadata={"format": "pt", "version": "2"})
    Store().upload_dir(tmp_path / "ckpt", uri)
    new, store = load_through_cache(tmp_path / "ckpt", uri, cache)
    assert store.bytes_cached == 0 and abs(store.bytes_read - cold.bytes_read) < 100  # the header grew
    assert torch.equal(new["model.embed_tokens.weight"], -old["model.embed_tokens.weight"])
    (model_dir,) = (cache / "slices").iterdir()
    assert len(list(model_dir.iterdir())) == 1
