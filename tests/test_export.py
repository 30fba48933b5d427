"""Export against a real S3 endpoint, loaded back with real PEFT / transformers.

Checkpoints are written the way training writes them (DCP of {"model": trainable params,
"optim": optimizer state} plus train_state.json and the checkpoint.json sidecar under
<run>/checkpoint-<step>/), only from one process instead of a Ray worker group.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from numerics import assert_close

from app.config import build_config
from app.dev.tiny import build_corpus, save_tiny_base
from app.elastic.checkpoint import (SIDECAR, build_sidecar, checkpoint_dir_name, find_latest_checkpoint,
                                    list_local_files, write_sidecar)
from app.export import ExportError, export_run
from app.model.architecture import build_peft_config
from app.storage import Store, join

# The test writes checkpoints from one process, which DCP supports but warns about.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

RUNS = "s3://eft/export-test-runs"
PROMPT = "The return statement leaves the current function call"


@pytest.fixture(scope="module")
def base_uri(s3):
    return save_tiny_base(Store(), "s3://eft/models/export-tiny", texts=build_corpus(max_docs=300), vocab_size=384)


def make_cfg(name: str, base_uri: str, lora: bool = True, **sections):
    tree = {
        "name": name,
        "model": {"uri": base_uri},
        "data": {"uri": "s3://eft/data/unused"},
        "training": {"max_steps": 10},
        "storage": {"root_uri": RUNS},
        **sections,
    }
    if lora:
        tree["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    return build_config(tree)


def load_base(base_uri: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Store().cache_locally(base_uri), dtype=torch.float32)


def build_trained_model(cfg, seed: int):
    """The model training would hold at a checkpoint: an optimizer step taken, then its
    trainable weights set to known, non-zero values (LoRA B starts at zero otherwise)."""
    import peft

    model = load_base(cfg.model.uri)
    torch.manual_seed(seed)  # LoRA A is initialized from the global RNG
    if cfg.lora:
        model = peft.get_peft_model(model, build_peft_config(cfg.lora))
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval(), optim


def trainable_weights(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def write_checkpoint(store: Store, run_uri: str, model, optim, step: int, trainable_only: bool) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    state = {
        "model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only)),
        "optim": get_optimizer_state_dict(model, optim),
    }
    uri = join(run_uri, checkpoint_dir_name(step))
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
        Path(tmp, "train_state.json").write_text(json.dumps({"step": step, "rows_consumed": step * 8, "seed": 0}))
        write_sidecar(Path(tmp), build_sidecar(list_local_files(Path(tmp)), step=step, world_size=1))
        store.upload_dir(tmp, uri, last=(SIDECAR,))
    return uri


def download(store: Store, uri: str, dest: Path) -> Path:
    store.download_dir(uri, dest)
    return dest


def logits_of(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def lora_run(base_uri):
    """A LoRA run with a checkpoint at step 7, exported with merge=True."""
    store = Store()
    cfg = make_cfg("lora-run", base_uri)
    model, optim = build_trained_model(cfg, seed=1)
    ckpt = write_checkpoint(store, cfg.run_uri, model, optim, step=7, trainable_only=True)
    summary = export_run(cfg, merge=True, store=store)
    return cfg, model, trainable_weights(model), ckpt, summary


def test_lora_export_summary_and_layout(lora_run):
    cfg, _, _, ckpt, summary = lora_run
    store = Store()
    out = join(cfg.run_uri, "export", "checkpoint-00000007")
    assert summary["checkpoint_uri"] == ckpt and summary["step"] == 7
    assert summary["kinds"] == ["adapter", "merged"]
    assert summary["adapter_uri"] == join(out, "adapter") and summary["merged_uri"] == join(out, "merged")
    assert store.read_json(join(out, "export.json")) == summary
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
        store.list_files(join(out, "adapter")))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(store.list_files(join(out, "merged")))


def test_adapter_loads_with_exactly_the_checkpoint_weights(lora_run, base_uri, tmp_path):
    from peft import PeftModel

    _, _, expected, _, summary = lora_run
    adapter_dir = download(Store(), summary["adapter_uri"], tmp_path / "adapter")
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == base_uri
    loaded = PeftModel.from_pretrained(load_base(base_uri), adapter_dir)
    got = {k: p.detach() for k, p in loaded.named_parameters() if "lora_" in k}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def merge_tolerance(logits: torch.Tensor) -> dict:
    """What fp32 merge rounding warrants: W + s*B@A rounded once, against the un-merged base
    and adapter matmuls summed, differs by a few float32 ulps of the logits' scale (measured
    ~1e-5 absolute on logits of magnitude ~4)."""
    return {"rtol": 1e-5, "atol": 1e-5 * float(logits.abs().max())}


def logits_with_lora_scale(peft_model, tokenizer, factor: float) -> torch.Tensor:
    """The logits a merge with the adapters scaled by `factor` x alpha/r would give."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    assert layers
    try:
        for layer in layers:
            layer.set_scale("default", factor)
        return logits_of(peft_model, tokenizer)
    finally:
        for layer in layers:
            layer.set_scale("default", 1.0)


def greedy(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(out[0, :ids.shape[1]], ids[0])
    return out[0, ids.shape[1]:]


def test_merged_model_matches_peft_logits_and_generates(lora_run, base_uri, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, _, _, summary = lora_run
    store = Store()
    merged_dir = download(store, summary["merged_uri"], tmp_path / "merged")
    adapter_dir = download(store, summary["adapter_uri"], tmp_path / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    peft_model = PeftModel.from_pretrained(load_base(base_uri), adapter_dir).eval()

    want = logits_of(peft_model, tokenizer)
    tol = merge_tolerance(want)
    got = logits_of(merged, tokenizer)
    print(f"merged vs PEFT: max |diff| {float((got - want).abs().max()):.2e}, tolerance atol {tol['atol']:.2e}")
    torch.testing.assert_close(got, want, **tol)
    # The tolerance must reject a wrong merge: no merge at all (the base), or adapters merged
    # at 2x or 0.5x alpha/r. Each is off by far more than the bound allows.
    bound = tol["atol"] + tol["rtol"] * want.abs()
    wrong = {"unmerged base": logits_of(load_base(base_uri).eval(), tokenizer),
             "2x scale": logits_with_lora_scale(peft_model, tokenizer, 2.0),
             "0.5x scale": logits_with_lora_scale(peft_model, tokenizer, 0.5)}
    for name, logits in wrong.items():
        excess = float(((logits - want).abs() / bound).max())
        print(f"{name}: off by {excess:.0f}x the tolerance")
        assert excess > 100, f"a merge with {name} would be within {excess:.1f}x the tolerance"
    torch.testing.assert_close(logits_of(peft_model, tokenizer), want, rtol=0, atol=0)  # scale restored

    # Greedy decoding from the merged model is the PEFT model's, token for token.
    generated = greedy(peft_model, tokenizer)
    assert generated.numel() > 0
    assert greedy(merged, tokenizer).tolist() == generated.tolist()


def test_reexport_without_merge_replaces_the_earlier_export(lora_run):
    cfg, _, _, _, _ = lora_run
    store = Store()
    summary = export_run(cfg, merge=False, store=store)
    assert summary["kinds"] == ["adapter"] and "merged_uri" not in summary
    out = summary["export_uri"]
    assert not store.list_files(join(out, "merged"))
    assert store.read_json(join(out, "export.json"))["kinds"] == ["adapter"]


def test_full_finetune_export_writes_the_trained_model(base_uri, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = Store()
    cfg = make_cfg("full-run", base_uri, lora=False)
    model, optim = build_trained_model(cfg, seed=2)
    write_checkpoint(store, cfg.run_uri, model, optim, step=3, trainable_only=False)

    summary = export_run(cfg, store=store)
    assert summary["kinds"] == ["merged"] and summary["step"] == 3 and "adapter_uri" not in summary
    merged_dir = download(store, summary["merged_uri"], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    for key, value in trainable_weights(model).items():
        assert torch.equal(dict(merged.named_parameters())[key], value), key
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert_close(logits_of(merged, tokenizer), logits_of(model, tokenizer), rtol=0, atol=1e-6)


def test_run_without_checkpoints_is_an_error_naming_the_run(base_uri):
    cfg = make_cfg("never-trained", base_uri)
    with pytest.raises(ExportError, match="never-trained") as info:
        export_run(cfg, store=Store())
    assert "\n" not in str(info.value)


def test_incomplete_checkpoint_is_skipped_and_rejected_when_named(base_uri):
    store = Store()
    cfg = make_cfg("cut-off-run", base_uri)
    model, optim = build_trained_model(cfg, seed=3)
    good = write_checkpoint(store, cfg.run_uri, model, optim, step=5, trainable_only=True)
    bad = write_checkpoint(store, cfg.run_uri, model, optim, step=10, trainable_only=True)
    shard = next(f for f in store.list_files(bad) if f.endswith(".distcp"))
    store.delete_prefix(join(bad, shard))

    assert find_latest_checkpoint(store, cfg.run_uri) == good
    assert export_run(cfg, store=store)["checkpoint_uri"] == good
    with pytest.raises(ExportError, match="checkpoint-00000010") as info:
        export_run(cfg, checkpoint_uri=bad, store=store)
    assert f"{shard} is missing" in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_from_a_different_lora_shape_is_an_error_naming_it(lora_run, base_uri):
    _, _, _, ckpt, _ = lora_run
    cfg = make_cfg("lora-run", base_uri).model_copy(deep=True)
    cfg.lora.r = 8
    with pytest.raises(ExportError, match="checkpoint-00000007") as info:
        export_run(cfg, checkpoint_uri=ckpt, store=Store())
    assert "\n" not in str(info.value)


def test_model_uri_that_is_not_a_model_dir_is_an_error_naming_it(lora_run):
    cfg = lora_run[0].model_copy(deep=True)
    cfg.model.uri = "s3://eft/models/no-such-model"
    with pytest.raises(ExportError, match="s3://eft/models/no-such-model") as info:
        export_run(cfg, store=Store())
    assert "\n" not in str(info.value)


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a list?"},
            {"role": "assistant", "content": "An ordered sequence."}, {"role": "user", "content": "And a tuple?"}]


def test_export_carries_the_chat_template_used_in_training(base_uri, tmp_path):
    """A base without a chat template, trained on conversations rendered by prepare.chat_template:
    both exported trees load a tokenizer that renders (and tokenizes) the training format."""
    from transformers import AutoTokenizer

    from app.data.chat import ChatFormat

    store = Store()
    template = (TEMPLATES / "llama-3-instruct.jinja").read_text()
    store.write_text("s3://eft/templates/export-llama3.jinja", template)
    cfg = make_cfg("chat-run", base_uri, prepare={"input_uri": "s3://eft/raw/unused.jsonl", "format": "chat",
                                                  "chat_template": "s3://eft/templates/export-llama3.jinja"})
    model, optim = build_trained_model(cfg, seed=4)
    write_checkpoint(store, cfg.run_uri, model, optim, step=2, trainable_only=True)
    summary = export_run(cfg, merge=True, store=store)

    base = AutoTokenizer.from_pretrained(Store().cache_locally(base_uri))
    assert not base.chat_template
    # The rendering prepare trained on (its ChatFormat with the override), plus the generation prompt.
    training_text, _ = ChatFormat("chat", template, base.special_tokens_map).render_text(MESSAGES,
                                                                                        add_generation_prompt=True)
    assert training_text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    base.chat_template = template
    training_ids = list(base.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"])
    for kind in ("adapter", "merged"):
        tree = download(store, summary[f"{kind}_uri"], tmp_path / kind)
        assert (tree / "chat_template.jinja").is_file() or "chat_template" in json.loads(
            (tree / "tokenizer_config.json").read_text()), kind
        loaded = AutoTokenizer.from_pretrained(tree)
        assert loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == training_text
        got = loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert list(got) == training_ids, kind


def test_an_unreadable_chat_template_fails_the_export_in_one_line(base_uri):
    cfg = make_cfg("chat-run-missing", base_uri, prepare={"input_uri": "s3://eft/raw/unused.jsonl",
                                                          "format": "chat",
                                                          "chat_template": "s3://eft/templates/missing.jinja"})
    model, optim = build_trained_model(cfg, seed=5)
    write_checkpoint(Store(), cfg.run_uri, model, optim, step=1, trainable_only=True)
    with pytest.raises(ExportError, match="prepare.chat_template s3://eft/templates/missing.jinja") as info:
        export_run(cfg, store=Store())
    assert "\n" not in str(info.value)
    assert not Store().exists(join(cfg.run_uri, "export"))
