"""The demo's pre-trained chat base (app/dev/tiny.py): it learns (held-out loss well below uniform, and
below the same model at random init), it is built once (a second seeding neither retrains nor
rewrites it; a new bucket gets it from the disk cache), and its conversations render through its
own ChatML template. A small recipe keeps this fast; the demo test checks the real one's numbers."""

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
