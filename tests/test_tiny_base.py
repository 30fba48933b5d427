"""The demo's pre-trained chat base (app/dev/tiny.py): it learns (held-out loss well below uniform, and
below the same model at random init), it is built once (a second seeding neither retrains nor
rewrites it; a new bucket gets it from the disk cache), and its conversations render through its
own ChatML template. A small recipe keeps this fast; the demo test checks the real one's numbers. The
real recipe's base ships in the package (app/dev/tiny_chat_base/): it is that recipe's, it loads and
has learnt, and seeding uploads it without pre-training."""

from __future__ import annotations

import json
import math

import pytest

from app.dev import tiny
from app.storage import Store

SMALL = dict(hidden_size=64, num_layers=2, intermediate_size=128, vocab_size=384, steps=60, batch_size=8)


def test_the_pretrained_base_learns_and_is_built_once(tmp_path, monkeypatch):
    texts = tiny.build_corpus(max_docs=300)
    store, cache = Store(), tmp_path / "cache"
    first = tiny.save_pretrained_base(store, str(tmp_path / "bucket1" / "base"), texts=texts, cache_dir=cache,
                                      recipe=SMALL)
    assert first["source"] == "trained" and first["steps"] == 60
    uniform = math.log(384 + len(tiny.CHAT_TOKENS))
    assert first["uniform_loss"] == pytest.approx(uniform, abs=1e-3)
    assert first["held_out_loss_before"] == pytest.approx(uniform, abs=0.1)  # random init: uniform
    assert first["held_out_loss_after"] < uniform - 1.0, first
    weights = tmp_path / "bucket1" / "base" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    def no_retraining(*args, **kwargs):
        raise AssertionError("pre-trained again")

    monkeypatch.setattr(tiny, "pretrain", no_retraining)
    again = tiny.save_pretrained_base(store, str(tmp_path / "bucket1" / "base"), texts=texts, cache_dir=cache,
                                      recipe=SMALL)
    assert again == {**first, "source": "bucket"} and weights.stat().st_mtime_ns == stamp
    # A new bucket (a new stack: the emulator is in memory) gets the same weights from the disk cache.
    fresh = tiny.save_pretrained_base(store, str(tmp_path / "bucket2" / "base"), texts=texts, cache_dir=cache,
                                      recipe=SMALL)
    assert fresh == {**first, "source": "disk cache"}
    assert (tmp_path / "bucket2" / "base" / "model.safetensors").read_bytes() == weights.read_bytes()
    # Another recipe is another model: not served from this cache.
    with pytest.raises(AssertionError, match="pre-trained again"):
        tiny.save_pretrained_base(store, str(tmp_path / "bucket1" / "base"), texts=texts, cache_dir=cache,
                                  recipe={**SMALL, "steps": 61})

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "bucket2" / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bucket2" / "base")
    assert json.loads((tmp_path / "bucket2" / "base" / "pretrain.json").read_text())["key"] == first["key"]
    assert list(model.generation_config.eos_token_id) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    messages = [{"role": "user", "content": "What is a list?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and len(tok) == 384 + 2


def test_the_chat_corpus_is_conversations_from_the_docs():
    records = tiny.build_chat_corpus()
    assert len(records) > 100
    roles = [[m["role"] for m in r["messages"]] for r in records]
    assert any(r[0] == "system" for r in roles) and any(r.count("assistant") == 2 for r in roles)
    assert all(r[-1] == "assistant" for r in roles)
    questions = [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]
    assert 'What is the "assert" statement?' in questions and "Tell me more." in questions
    replies = [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant"]
    assert all(60 <= len(c) <= 330 and c.endswith((".", '."', ".)")) for c in replies)
    assert "Assert statements are a convenient way to insert debugging assertions into a program." in replies


def test_the_shipped_base_is_the_default_recipes_and_has_learnt():
    report = json.loads((tiny.SHIPPED_BASE / tiny.PRETRAIN_REPORT).read_text())
    assert report["key"] == tiny.pretrain_key(tiny.build_corpus(), tiny.PRETRAIN), \
        "app/dev/tiny_chat_base/ is not the default recipe's on this Python: rebuild it with `make tiny-base`"
    assert report["steps"] == tiny.PRETRAIN["steps"]
    uniform = math.log(tiny.PRETRAIN["vocab_size"] + len(tiny.CHAT_TOKENS))
    assert report["uniform_loss"] == pytest.approx(uniform, abs=1e-3)
    assert report["held_out_loss_after"] < uniform - 2.0, report
    # Small enough to keep in git: about 3 MB, nearly all of it the fp32 weights.
    assert sum(p.stat().st_size for p in tiny.SHIPPED_BASE.iterdir()) < 5_000_000

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.SHIPPED_BASE)
    model = AutoModelForCausalLM.from_pretrained(tiny.SHIPPED_BASE)
    assert len(tok) == tiny.PRETRAIN["vocab_size"] + 2 and model.config.vocab_size == len(tok)
    assert 0.7e6 < model.num_parameters() < 0.9e6
    assert list(model.generation_config.eos_token_id) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    messages = [{"role": "user", "content": "What is a list?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    # The weights loaded are the trained ones: the docs' prose is far from a uniform guess.
    ids = torch.tensor([tok(" ".join(tiny.build_corpus(max_docs=4)))["input_ids"][:128]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < uniform - 2.0, loss


def test_the_default_recipe_uploads_the_shipped_base_without_pre_training(tmp_path, monkeypatch):
    def no_pretraining(*args, **kwargs):
        raise AssertionError("pre-trained")

    monkeypatch.setattr(tiny, "pretrain", no_pretraining)
    shipped = json.loads((tiny.SHIPPED_BASE / tiny.PRETRAIN_REPORT).read_text())
    store, uri, cache = Store(), str(tmp_path / "bucket" / "base"), tmp_path / "cache"
    report = tiny.save_pretrained_base(store, uri, cache_dir=cache)
    assert report == {**shipped, "source": "shipped"}
    uploaded = tmp_path / "bucket" / "base"
    assert (uploaded / "model.safetensors").read_bytes() == (tiny.SHIPPED_BASE / "model.safetensors").read_bytes()
    assert (uploaded / "config.json").is_file() and not cache.exists()  # the disk cache is not needed
    assert tiny.save_pretrained_base(store, uri, cache_dir=cache) == {**shipped, "source": "bucket"}


def test_a_shipped_base_of_another_fingerprint_is_not_used(tmp_path, monkeypatch):
    """A shipped base whose key is not the recipe's (another Python's pydoc topics, say) is passed
    over for the disk cache (or a pre-train), as before there was one."""
    import shutil

    real, stale, cache = tiny.SHIPPED_BASE, tmp_path / "tiny_chat_base", tmp_path / "cache"
    report = json.loads((real / tiny.PRETRAIN_REPORT).read_text())
    shutil.copytree(real, stale)
    (stale / tiny.PRETRAIN_REPORT).write_text(json.dumps({**report, "key": "not-this-recipe"}))
    shutil.copytree(real, cache / f"tiny-chat-base-{report['key']}")
    monkeypatch.setattr(tiny, "SHIPPED_BASE", stale)
    got = tiny.save_pretrained_base(Store(), str(tmp_path / "bucket" / "base"), cache_dir=cache)
    assert got == {**report, "source": "disk cache"}
