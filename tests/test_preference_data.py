"""Preference pairs (`prepare.format: preference`): TRL's standard and conversational records,
rendered and tokenized by the same code as `chat` (ids checked against transformers'
`apply_chat_template`), packed two documents to a pair that never leave their row, and scored by
the objectives from one forward of the packed rows; the reference pass's log-probs equal the live
reference's, and at the start (policy = reference) DPO's loss is ln 2. No Ray here."""

from __future__ import annotations

import json
import math
import tempfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from app.batch import IGNORE_INDEX
from app.config import ConfigError, build_config
from app.data.chat import ChatFormat
from app.data.engines import TokenizeDocuments, TokenizerSpec, build_document_table, export_backend
from app.data.formats import Skip, build_document
from app.data.manifest import load_manifest, shard_uris
from app.data.packing import Packer
from app.data.prepare import prepare_dataset
from app.data.preview import preview_records
from app.dev.tiny import add_chat_template, build_corpus, build_preference_corpus, build_tiny_model, \
    build_tiny_tokenizer
from app.model.preference import pair_segments
from app.storage import Store

MODEL = "s3://eft/models/tiny-pref"
RAW = "s3://eft/raw/pref/pairs.jsonl"
PAIR = {"prompt": [{"role": "user", "content": "What is a list?"}],
        "chosen": [{"role": "assistant", "content": "An ordered, mutable sequence."}],
        "rejected": [{"role": "assistant", "content": "A kind of loop."}]}


@pytest.fixture(scope="module")
def tok():
    return add_chat_template(build_tiny_tokenizer(build_corpus(max_docs=200)))


def tokenize(tok, records: list, chat=True, seq_len=256):
    fmt = ChatFormat("preference", tok.chat_template, tok.special_tokens_map) if chat else None
    parsed = [build_document(r, "preference", prompt_field="prompt", chat=fmt) for r in records]
    table = build_document_table(["a.jsonl"] * len(parsed), list(range(1, len(parsed) + 1)), parsed)
    spec = TokenizerSpec("unused", None, "us-east-1", tok.eos_token_id, tok.bos_token_id, export_backend(tok))
    return TokenizeDocuments(spec, seq_len, "drop")(table).to_pylist()


def library_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])


def halves(row: dict):
    cut = row["chosen_tokens"]
    return (row["input_ids"][:cut], row["labels"][:cut]), (row["input_ids"][cut:], row["labels"][cut:])


# -- records → pairs -----------------------------------------------------------------------------

def test_conversational_pairs_are_the_librarys_ids_and_train_only_the_completion(tok):
    multi_turn = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "What is a list?"}],
                  "chosen": PAIR["chosen"], "rejected": PAIR["rejected"]}
    for record in (PAIR, multi_turn):
        (c_ids, c_labels), (r_ids, r_labels) = halves(tokenize(tok, [record])[0])
        assert c_ids == library_ids(tok, record["prompt"] + record["chosen"])
        assert r_ids == library_ids(tok, record["prompt"] + record["rejected"])
        # The prompt's own assistant turn ("Hello.") is context, not trained.
        assert trained_text(tok, c_ids, c_labels) == "An ordered, mutable sequence.<|im_end|>"
        assert trained_text(tok, r_ids, r_labels) == "A kind of loop.<|im_end|>"


def test_standard_pairs_use_the_template_when_there_is_one_else_prompt_text_then_completion(tok):
    record = {"prompt": "What is a list?", "chosen": "An ordered sequence.", "rejected": "A loop."}
    (c_ids, c_labels), _ = halves(tokenize(tok, [record])[0])
    assert c_ids == library_ids(tok, [{"role": "user", "content": record["prompt"]},
                                      {"role": "assistant", "content": record["chosen"]}])
    assert trained_text(tok, c_ids, c_labels) == "An ordered sequence.<|im_end|>"
    (c_ids, c_labels), (r_ids, r_labels) = halves(tokenize(tok, [record], chat=False)[0])
    prompt = tok(record["prompt"], add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    assert c_ids == bos + prompt + tok(record["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert trained_text(tok, c_ids, c_labels) == "An ordered sequence.</s>"
    assert trained_text(tok, r_ids, r_labels) == "A loop.</s>"


@pytest.mark.parametrize("record, reason", [
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "empty chosen"),
    ({"prompt": "q", "chosen": "a", "rejected": " "}, "empty rejected"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "chosen equals rejected"),
    ({**PAIR, "rejected": PAIR["chosen"]}, "chosen equals rejected"),
    ({**PAIR, "chosen": []}, "empty chosen"),
    ({**PAIR, "chosen": [{"role": "assistant", "content": "  "}]}, "empty rejected".replace("rejected", "chosen")),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
     "prompt, chosen and rejected mix text and messages"),
    ({"prompt": "q", "rejected": "b"}, "missing field 'chosen'"),
    ({"prompt": "q", "chosen": "a " * 300, "rejected": "b"}, "pair longer than seq_len"),
])
def test_bad_pairs_are_counted_skips_with_their_reason(tok, record, reason):
    (row,) = tokenize(tok, [record])
    assert row["reason"] == reason and row["input_ids"] == []


def test_pairs_longer_than_seq_len_are_skips_that_do_not_count_against_the_limit():
    """A long tail of long pairs is data, not damage: counted by reason, but only the other
    reasons trip prepare.max_bad_records (and name the records at fault)."""
    from app.data.engines import PAIR_TOO_LONG, PrepareError
    from app.data.prepare import BadRecords

    bad = BadRecords(limit=1, input_uri="s3://b/pairs.jsonl")
    for line in range(1, 6):
        bad.add("pairs.jsonl", line, PAIR_TOO_LONG)
    bad.add("pairs.jsonl", 6, "empty chosen")
    assert bad.count == 6 and bad.by_reason[PAIR_TOO_LONG] == 5
    with pytest.raises(PrepareError, match=r"max_bad_records=1 .*first: pairs.jsonl:6 empty chosen; pairs.jsonl:7"):
        bad.add("pairs.jsonl", 7, "chosen equals rejected")


def test_a_conversational_pair_needs_a_chat_template(tok):
    assert build_document(PAIR, "preference", prompt_field="prompt") == Skip(
        "conversational pair without a chat template")


def make_cfg(**sections):
    tree = {"name": "p", "model": {"uri": MODEL}, "data": {"uri": "s3://eft/data/pref", "seq_len": 256},
            "prepare": {"input_uri": RAW, "format": "preference", "engine": "local", "local_threads": 1},
            "training": {"max_steps": 1, "objective": "dpo"}, "lora": {"r": 4},
            "storage": {"root_uri": "s3://eft/runs-pref"}}
    for key, value in sections.items():
        tree[key] = None if value is None else {**(tree.get(key) or {}), **value}
    return build_config(tree)


def test_config_defaults_and_one_line_rejections():
    cfg = make_cfg()
    assert (cfg.reference_mode, cfg.preference.beta, cfg.preference.loss, cfg.prepare.prompt_field,
            cfg.prepare.overlong_mode) == ("precomputed", 0.1, "sigmoid", "prompt", "drop")
    assert make_cfg(training={"objective": "simpo"}).reference_mode == "none"
    assert make_cfg(prepare={"format": "instruction"}, training={"objective": "sft"}).prepare.prompt_field == \
        "instruction"
    for sections, key in [
        ({"prepare": {"format": "chat"}}, "prepare.format: preference"),
        ({"preference": {"reference": "live"}, "lora": None}, "preference.reference live needs a lora section"),
        ({"preference": {"reference": "none"}}, "preference.reference none"),
        ({"training": {"objective": "orpo"}, "preference": {"reference": "precomputed"}}, "preference.reference"),
        ({"prepare": {"overlong": "split"}}, "prepare.overlong split"),
        ({"data": {"cross_document_attention": True}}, "data.cross_document_attention"),
        ({"preference": {"loss": "hinge"}}, "preference.loss"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
            make_cfg(**sections)
        assert "\n" not in str(err.value)


def test_each_objective_has_its_own_defaults_a_set_value_wins_and_the_stored_config_shows_them():
    """SimPO shared DPO's β 0.1, at which its held-out loss barely moved; each objective now has
    its papers' values (app.config.OBJECTIVE_DEFAULTS) unless the config sets them."""
    import yaml

    from app.config import dump_config

    shown = {o: make_cfg(training={"objective": o}).preference for o in ("dpo", "simpo", "orpo")}
    assert [(p.beta, p.simpo_gamma, p.orpo_lambda) for p in shown.values()] == [
        (0.1, None, None), (2.0, 1.0, None), (0.1, None, 0.1)]
    assert make_cfg(preference={"loss": "ipo"}).preference.beta == 0.1
    assert make_cfg(prepare={"format": "instruction"}, training={"objective": "sft"}).preference.beta is None
    own = make_cfg(training={"objective": "simpo"}, preference={"beta": 0.5, "simpo_gamma": 0.0}).preference
    assert (own.beta, own.simpo_gamma) == (0.5, 0.0)  # a set 0 is a value, not "unset"
    assert make_cfg(training={"objective": "orpo"}, preference={"orpo_lambda": 0.2}).preference.orpo_lambda == 0.2
    # The config stored with a run (<run>/config.yaml is dump_config's) holds the values used,
    # and loads back to them.
    stored = yaml.safe_load(dump_config(make_cfg(training={"objective": "simpo"})))
    assert (stored["preference"]["beta"], stored["preference"]["simpo_gamma"]) == (2.0, 1.0)
    assert build_config(stored).preference == shown["simpo"]


@pytest.mark.parametrize("where", ["s3", "local"])
def test_weights_rewritten_at_the_same_uri_and_size_are_another_reference(s3, tok, tmp_path, where):
    """The reference log-probs' fingerprint took the weight files' names and sizes: a fine-tune
    written over its base at the same URI kept both, and the base's stale log-probs were reused.
    It takes their contents now (S3's ETags, a local file's sha256)."""
    import re

    from app.data.reference import ReferenceLogpsError, check_reference, reference_identity
    from app.storage import join

    store, local = Store(), tmp_path / "model"
    build_tiny_model(tok).save_pretrained(local, safe_serialization=True)
    uri = "s3://eft/models/tiny-pref-rewritten" if where == "s3" else str(local)
    if where == "s3":
        store.upload_dir(local, uri, last=("config.json",))
    sizes, before = store.list_file_sizes(uri), reference_identity(store, uri)
    assert reference_identity(store, uri) == before  # the same while nothing changes
    weights = bytearray((local / "model.safetensors").read_bytes())
    weights[-4:] = bytes(b ^ 0xFF for b in weights[-4:])  # other weights, the same size
    store.write_bytes(join(uri, "model.safetensors"), bytes(weights))
    assert store.list_file_sizes(uri) == sizes
    after = reference_identity(store, uri)
    assert after["uri"] == before["uri"] and after["fingerprint"] != before["fingerprint"]
    cfg = make_cfg(model={"uri": uri})
    with pytest.raises(ReferenceLogpsError, match=rf"^data.uri \S+ holds reference log-probs of the model that was at "
                                                   rf"model.uri {re.escape(uri)} then .* changed since.* run `eft prepare`"):
        check_reference(cfg, store, {"reference": {"model": before}})
    check_reference(cfg, store, {"reference": {"model": after}})


# -- packing and pairing -------------------------------------------------------------------------

def test_pairs_stay_whole_in_their_row_and_are_numbered_chosen_then_rejected():
    packer = Packer(16, pad_id=0)
    lengths = np.array([5, 4, 6, 6, 3, 2])  # 9 fits; 12 does not fit the 7 left; 5 fits after it
    ids = np.arange(1, lengths.sum() + 1, dtype=np.int32)
    labels = ids.copy()
    labels[np.r_[0, 5, 9, 15, 21, 24]] = IGNORE_INDEX  # each document's first token is context
    packer.add_units(ids, labels, lengths, docs_per_unit=2)
    rows = packer.finish()
    assert rows.input_ids.tolist() == [[*range(1, 10), *[0] * 7], [*range(10, 22), *[0] * 4],
                                       [*range(22, 27), *[0] * 11]]
    segments, pairs = pair_segments(rows.labels, rows.position_ids)
    assert pairs.tolist() == [1, 1, 1]
    assert segments[0].tolist() == [-1, 0, 0, 0, 0, -1, 1, 1, 1] + [-1] * 7
    assert segments[1, :12].tolist() == [-1, 2, 2, 2, 2, 2, -1, 3, 3, 3, 3, 3]
    assert segments[2, :5].tolist() == [-1, 4, 4, -1, 5]
    with pytest.raises(ValueError, match="a unit of 17 tokens"):
        Packer(16, 0).add_units(np.zeros(17, np.int32), np.zeros(17, np.int32), np.array([9, 8]), 2)


# -- prepare through S3, the preview, and the objectives on the prepared rows ---------------------

@pytest.fixture(scope="module")
def prepared(s3, tok, tmp_path_factory):
    """The tiny model with the ChatML template on S3, the pydoc preference corpus (plus two bad
    records) prepared on the local engine."""
    store = Store()
    model = build_tiny_model(tok, max_positions=512)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        store.upload_dir(tmp, MODEL, last=("config.json",))
    records = build_preference_corpus()
    lines = [json.dumps(r) for r in records] + [json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}),
                                                json.dumps({"prompt": "q", "chosen": "a " * 300, "rejected": "b"})]
    store.write_text(RAW, "\n".join(lines) + "\n")
    cfg = make_cfg(training={"objective": "simpo"}, data={"validation_fraction": 0.1})
    return store, cfg, prepare_dataset(cfg, store), records


def read_rows(store, cfg, manifest, split="train"):
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for uri in shard_uris(cfg.data.uri, manifest, split):
        fs, path = store.resolve(uri)
        table = pq.read_table(path, filesystem=fs)
        for key in out:
            out[key] += table[key].to_pylist()
    return {key: np.asarray(value) for key, value in out.items()}


def test_prepare_packs_every_good_pair_whole_and_counts_the_bad(prepared, tok):
    store, cfg, manifest, records = prepared
    assert manifest["source"]["format"] == "preference"
    assert manifest["records"]["skipped_by_reason"] == {"chosen equals rejected": 1, "pair longer than seq_len": 1}
    splits = manifest["splits"]
    assert splits["train"]["pairs"] + splits["validation"]["pairs"] == len(records) == manifest["records"]["used"]
    rows = read_rows(store, cfg, manifest)
    segments, pairs = pair_segments(rows["labels"], rows["position_ids"])
    assert pairs.sum() == splits["train"]["pairs"] and (pairs >= 1).all()
    # The first row's first pair is the first train record, rendered as the library renders it.
    first = next(r for r in records if library_ids(tok, r["prompt"] + r["chosen"]) ==
                 rows["input_ids"][0][:len(library_ids(tok, r["prompt"] + r["chosen"]))].tolist())
    chosen = library_ids(tok, first["prompt"] + first["chosen"])
    rejected = library_ids(tok, first["prompt"] + first["rejected"])
    assert rows["input_ids"][0][len(chosen):len(chosen) + len(rejected)].tolist() == rejected
    assert rows["position_ids"][0][len(chosen)] == 0  # the rejected document starts afresh


def test_without_packing_each_row_holds_one_pair_and_the_same_pairs(prepared):
    """`prepare.packing: false`: the same pairs, one to a row, each row's first token the start of
    its chosen document; the manifest says so, and the recipe tells the two datasets apart."""
    store, cfg, manifest, _ = prepared
    unpacked_cfg = make_cfg(training={"objective": "simpo"}, data={"validation_fraction": 0.1,
                                                                   "uri": "s3://eft/data/pref-unpacked"},
                            prepare={"packing": False})
    unpacked = prepare_dataset(unpacked_cfg, store)
    assert manifest["packing"] is True and unpacked["packing"] is False
    assert unpacked["recipe"]["settings"]["prepare.packing"] is False
    assert unpacked["splits"]["train"]["pairs"] == manifest["splits"]["train"]["pairs"]
    assert unpacked["splits"]["train"]["rows"] == unpacked["splits"]["train"]["pairs"] > manifest["splits"]["train"]["rows"]
    rows, packed = read_rows(store, unpacked_cfg, unpacked), read_rows(store, cfg, manifest)
    _, pairs = pair_segments(rows["labels"], rows["position_ids"])
    assert (pairs == 1).all()
    # Pair by pair, the same tokens in the same order as the packed rows hold them.
    assert (rows["input_ids"][rows["labels"] != IGNORE_INDEX].tolist()
            == packed["input_ids"][packed["labels"] != IGNORE_INDEX].tolist())


def test_preview_shows_the_prompt_once_then_both_completions(prepared):
    from rich.console import Console

    from app.data.preview import render_preview

    store, cfg, _, records = prepared
    tokenizer, previewed = preview_records(cfg, 2, store)
    assert [p.chosen_tokens is not None for p in previewed] == [True, True]
    console = Console(record=True, width=200)
    render_preview(console, tokenizer, previewed, cfg)
    text = console.export_text()
    assert "rendered by the chat template as one user turn" in text
    assert text.count("prompt: ") == 2 and text.count("chosen: ") == 2 and text.count("rejected: ") == 2
    assert records[0]["chosen"][0]["content"][:30] in text.replace("\n", "")


def load_policy(store, lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from app.model.loss import apply_loss

    model = AutoModelForCausalLM.from_pretrained(str(store.cache_locally(MODEL)), dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    apply_loss(model, "chunked", 64)
    return model


def test_live_and_precomputed_references_agree_and_dpo_starts_at_ln2(prepared):
    from app.data.reference import ScoreReference
    from app.train.objective import PreferenceObjective

    store, cfg, manifest, _ = prepared
    rows = read_rows(store, cfg, manifest)
    batch = slice(0, 4)
    ids, labels, positions = rows["input_ids"][batch], rows["labels"][batch], rows["position_ids"][batch]
    scorer = ScoreReference(store.endpoint, store.region, MODEL, micro_batch=3, chunk_tokens=64, use_gpu=False)
    refs = scorer.score(pq.read_table(store.resolve(shard_uris(cfg.data.uri, manifest, "train")[0])[1],
                                      filesystem=store.resolve(cfg.data.uri)[0]).slice(0, 4))
    precomputed = np.concatenate(refs)
    for lora in (True, False):
        for reference in (("live", "precomputed") if lora else ("precomputed",)):
            dpo = PreferenceObjective(make_cfg(preference={"reference": reference}, lora={"r": 4} if lora else None))
            model = load_policy(store, lora)
            loss, metrics = dpo.forward(model, ids, labels, positions, precomputed, torch.device("cpu"), None)
            n = dpo.units(labels, positions)
            # The policy is the reference: every pair's loss is -log σ(0) = ln 2, with zero rewards.
            assert loss.item() / n == pytest.approx(math.log(2), abs=1e-4), (lora, reference)
            assert metrics[:3].abs().max().item() < 1e-3
            loss.backward()  # the chunked log-probs carry a gradient to the trained parameters
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    live = PreferenceObjective(make_cfg(preference={"reference": "live"}))
    segments, pairs = pair_segments(labels, positions)
    model = load_policy(store, lora=True)
    got = live.live_reference(model, *(torch.as_tensor(a) for a in (ids, labels, positions)),
                              torch.as_tensor(segments), 2 * int(pairs.sum()), None)
    np.testing.assert_allclose(got.numpy(), precomputed, rtol=1e-5, atol=1e-5 * np.abs(precomputed).max())
