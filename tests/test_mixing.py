"""Mixing datasets (`prepare.inputs`): deterministic, by weight, with per-source formats, recorded in
the manifest. Local engine, real S3 (moto), the tiny tokenizer."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.batch import IGNORE_INDEX
from app.config import ConfigError, build_config
from app.data.engines import PrepareError
from app.data.manifest import shard_uris
from app.data.prepare import prepare_dataset
from app.dev.tiny import build_corpus, save_tiny_base
from app.storage import Store

BASE_URI = "s3://eft/models/tiny-mix"
SEQ_LEN = 64
A, B, C = "s3://eft/raw/mix/a/", "s3://eft/raw/mix/b/", "s3://eft/raw/mix/c/part-0.jsonl"


@pytest.fixture(scope="module")
def store(s3):
    return Store()


@pytest.fixture(scope="module")
def docs():
    corpus = list(dict.fromkeys(build_corpus(max_docs=200)))  # distinct paragraphs: each traces to one source
    return {"a": corpus[:40], "b": corpus[40:60],
            "c": [{"q": q, "a": a} for q, a in zip(corpus[60:80], corpus[80:100])]}


@pytest.fixture(scope="module")
def tokenizer(store, docs):
    from transformers import AutoTokenizer

    save_tiny_base(store, BASE_URI, texts=build_corpus(max_docs=200), hidden_size=16, intermediate_size=32)
    # a: two files; b: the same relative name as a's first file, another text field; c: instructions.
    lines = lambda recs: "".join(json.dumps(r) + "\n" for r in recs)  # noqa: E731
    store.write_text(A + "part-0.jsonl", lines({"text": d} for d in docs["a"][:25]))
    store.write_text(A + "part-1.jsonl", lines([{"text": d} for d in docs["a"][25:32]] + [{"oops": 1}]
                                               + [{"text": d} for d in docs["a"][32:]]))
    store.write_text(B + "part-0.jsonl", lines({"body": d} for d in docs["b"]))
    store.write_text(C, lines(docs["c"]))
    return AutoTokenizer.from_pretrained(str(store.cache_locally(BASE_URI)))


def make_config(data_uri: str, inputs=None, **prepare):
    section = {"rows_per_shard": 16, "tokenize_batch_size": 8, "local_threads": 2, "engine": "local", **prepare}
    if inputs is not None:
        section["inputs"] = inputs
    return build_config({
        "name": "t", "model": {"uri": BASE_URI}, "data": {"uri": data_uri, "seq_len": SEQ_LEN},
        "prepare": section, "storage": {"root_uri": "s3://eft/runs"}, "training": {"max_steps": 1},
    })


TEXT_SOURCES = [{"uri": A, "weight": 3}, {"uri": B, "weight": 1, "text_field": "body"}]


def shard_bytes(store, cfg, manifest) -> list[bytes]:
    return [store.read_bytes(u) for u in shard_uris(cfg.data.uri, manifest, "train")]


def train_documents(store, cfg, manifest) -> list[tuple[np.ndarray, np.ndarray]]:
    """The train split's packed stream cut back into (ids, labels) per document, at each eos."""
    tables = []
    for uri in shard_uris(cfg.data.uri, manifest, "train"):
        fs, path = store.resolve(uri)
        tables.append(pq.read_table(path, filesystem=fs))
    ids = np.concatenate([np.asarray(t["input_ids"].to_pylist()).ravel() for t in tables])
    labels = np.concatenate([np.asarray(t["labels"].to_pylist()).ravel() for t in tables])
    n = manifest["splits"]["train"]["tokens"]
    ids, labels = ids[:n], labels[:n]
    eos = manifest["tokenizer"]["eos_token_id"]
    cuts = np.flatnonzero(ids == eos) + 1
    assert cuts[-1] == n
    return list(zip(np.split(ids, cuts[:-1]), np.split(labels, cuts[:-1])))


def trace(tokenizer, docs, store, cfg, manifest) -> list[str]:
    """Each packed text document → the source it came from."""
    where = {d: "a" for d in docs["a"]} | {d: "b" for d in docs["b"]}
    return [where[tokenizer.decode(ids.tolist(), skip_special_tokens=True)]
            for ids, _ in train_documents(store, cfg, manifest)]


@pytest.fixture(scope="module")
def mixed(store, tokenizer):
    cfg = make_config("s3://eft/data/mix-0", TEXT_SOURCES)
    return cfg, prepare_dataset(cfg, store)


def test_weights_set_the_proportions_and_the_manifest_records_each_source(store, tokenizer, docs, mixed):
    cfg, manifest = mixed
    src = manifest["source"]
    # a: 40 documents (one bad record), b: 20. Weights 3:1 → the largest mixture is limited by a: 40 + 13.
    assert [s["documents_available"] for s in src["inputs"]] == [40, 20]
    assert [s["documents"] for s in src["inputs"]] == [40, 13]
    assert [s["unique_documents"] for s in src["inputs"]] == [40, 13]
    assert [s["records"] for s in src["inputs"]] == [41, 20] and [s["skipped"] for s in src["inputs"]] == [1, 0]
    assert src["inputs"][0]["files"] == ["part-0.jsonl", "part-1.jsonl"] and src["inputs"][1]["files"] == ["part-0.jsonl"]
    assert all(len(s["fingerprint"]) == 64 for s in src["inputs"])
    assert src["inputs"][0]["fingerprint"] != src["inputs"][1]["fingerprint"]
    assert src["mix"] == {"seed": 0, "replacement": False, "documents": 53, "requested_documents": None}
    assert manifest["records"]["read"] == 61 and manifest["records"]["used"] == 53
    assert manifest["records"]["skipped_examples"] == [{"source": A + "part-1.jsonl", "line": 8,
                                                        "reason": "missing field 'text'"}]
    assert sum(s["tokens"] for s in src["inputs"]) == manifest["splits"]["train"]["tokens"]
    origin = trace(tokenizer, docs, store, cfg, manifest)
    assert Counter(origin) == {"a": 40, "b": 13}
    assert origin != sorted(origin), "sources are interleaved, not concatenated"
    texts = [tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids, _ in train_documents(store, cfg, manifest)]
    assert len(set(texts)) == 53, "without replacement no document repeats"
    # Each source keeps its input order.
    assert [t for t in texts if t in docs["a"]] == docs["a"]
    b_texts = [t for t in texts if t in docs["b"]]
    assert b_texts == sorted(b_texts, key=docs["b"].index)


def test_same_seed_same_shards_another_seed_other_rows(store, tokenizer, docs, mixed):
    cfg, manifest = mixed
    again = make_config("s3://eft/data/mix-0-again", TEXT_SOURCES)
    assert shard_bytes(store, again, prepare_dataset(again, store)) == shard_bytes(store, cfg, manifest)
    other = make_config("s3://eft/data/mix-1", TEXT_SOURCES, mix_seed=1)
    other_manifest = prepare_dataset(other, store)
    assert shard_bytes(store, other, other_manifest) != shard_bytes(store, cfg, manifest)
    picked = lambda c, m: {t for t in trace(tokenizer, docs, store, c, m)}  # noqa: E731
    b_docs = lambda c, m: {tokenizer.decode(i.tolist(), skip_special_tokens=True)  # noqa: E731
                           for i, _ in train_documents(store, c, m)} & set(docs["b"])
    assert picked(other, other_manifest) == {"a", "b"}
    assert b_docs(other, other_manifest) != b_docs(cfg, manifest), "another seed picks other b documents"


def test_with_replacement_repeats_documents_to_the_requested_total(store, tokenizer, docs):
    sources = [{"uri": A, "weight": 1}, {"uri": B, "weight": 1, "text_field": "body"}]
    cfg = make_config("s3://eft/data/mix-repl", sources, mix_replacement=True, mix_documents=100)
    manifest = prepare_dataset(cfg, store)
    assert [s["documents"] for s in manifest["source"]["inputs"]] == [50, 50]
    assert manifest["source"]["inputs"][1]["unique_documents"] <= 20
    assert Counter(trace(tokenizer, docs, store, cfg, manifest)) == {"a": 50, "b": 50}
    # Without replacement the same total cannot be met: one line naming the key and the source.
    cfg = make_config("s3://eft/data/mix-norepl", sources, mix_documents=100)
    with pytest.raises(PrepareError, match=r"prepare.mix_documents 100 needs 50 documents from prepare.inputs\[0\] "
                                           rf"\({A}\), which has 40"):
        prepare_dataset(cfg, store)
    # A total within reach is exact, and with replacement the default total is the sources' sum.
    cfg = make_config("s3://eft/data/mix-norepl", sources, mix_documents=30)
    assert [s["documents"] for s in prepare_dataset(cfg, store)["source"]["inputs"]] == [15, 15]
    cfg = make_config("s3://eft/data/mix-repl-default", sources, mix_replacement=True)
    assert prepare_dataset(cfg, store)["source"]["mix"]["documents"] == 60


def test_each_source_keeps_its_own_format_and_masking(store, tokenizer, docs):
    sources = [{"uri": A}, {"uri": C, "format": "instruction", "prompt_field": "q", "response_field": "a",
                            "weight": 0.5}]
    cfg = make_config("s3://eft/data/mix-formats", sources)
    manifest = prepare_dataset(cfg, store)
    assert [(s["format"], s["documents"]) for s in manifest["source"]["inputs"]] == [("text", 40), ("instruction", 20)]
    responses = {r["a"]: r["q"] for r in docs["c"]}
    kinds = Counter()
    for ids, labels in train_documents(store, cfg, manifest):
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        trained = tokenizer.decode(ids[labels != IGNORE_INDEX].tolist(), skip_special_tokens=True)
        if text in docs["a"]:
            kinds["text"] += 1
            assert trained == text, "a text document is trained whole"
        else:
            kinds["instruction"] += 1
            assert trained in responses, "an instruction document trains its response only"
            assert responses[trained] in text and responses[trained] not in trained
    assert kinds == {"text": 40, "instruction": 20}


def test_one_source_mixture_packs_like_input_uri(store, tokenizer):
    single = make_config("s3://eft/data/mix-single-uri", input_uri=A)
    manifest = prepare_dataset(single, store)
    assert set(manifest["source"]) == {"input_uri", "input_format", "format", "files", "bytes"}
    mixture = make_config("s3://eft/data/mix-single-inputs", [{"uri": A, "weight": 2}])
    assert shard_bytes(store, mixture, prepare_dataset(mixture, store)) == shard_bytes(store, single, manifest)


@pytest.mark.parametrize("prepare, message", [
    ({"input_uri": A, "inputs": [{"uri": B}]}, "prepare: set prepare.input_uri or prepare.inputs, not both"),
    ({}, "prepare: set prepare.input_uri (one source) or prepare.inputs (a mixture)"),
    ({"inputs": []}, "prepare: prepare.inputs is empty"),
    ({"inputs": [{"uri": A, "weight": 0}]}, "prepare.inputs.0.weight: Input should be greater than 0"),
    ({"inputs": [{"uri": A, "weight": -1}]}, "prepare.inputs.0.weight: Input should be greater than 0"),
    ({"inputs": [{"uri": A, "seq_len": 3}]}, "prepare.inputs.0.seq_len: unknown key"),
    ({"inputs": [{"uri": A}], "mix_documents": 0}, "prepare.mix_documents: Input should be greater than 0"),
    ({"inputs": [{"uri": A}], "engine": "ray"}, "prepare: prepare.engine ray does not run prepare.inputs"),
])
def test_bad_mixture_configs_fail_in_one_line_naming_the_key(prepare, message):
    tree = {"name": "t", "model": {"uri": BASE_URI}, "data": {"uri": "s3://eft/data/x"}, "prepare": prepare,
            "storage": {"root_uri": "s3://eft/runs"}, "training": {"max_steps": 1}}
    with pytest.raises(ConfigError) as err:
        build_config(tree)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_source_without_files_is_named(store, tokenizer):
    cfg = make_config("s3://eft/data/mix-missing", [{"uri": A}, {"uri": "s3://eft/raw/mix/nothing/"}])
    with pytest.raises(PrepareError, match=r"^prepare.inputs\[1\]: no jsonl input files \(.jsonl/.json\) at "
                                           r"s3://eft/raw/mix/nothing/$"):
        prepare_dataset(cfg, store)
    assert not store.exists("s3://eft/data/mix-missing/manifest.json")
