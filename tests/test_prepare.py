"""The prepare stage end to end: a real S3 endpoint, a real Ray cluster, a real tokenizer.

The ray engine's run is the reference; the local engine must give the same shards, byte for byte."""

from __future__ import annotations

import copy
import json
from collections import Counter
from unittest.mock import ANY

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.batch import IGNORE_INDEX
from app.cli import main
from app.config import JobConfig, build_config, dump_config
from app.data.engines import (
    BATCHES_PER_BLOCK, DOCUMENT_SCHEMA, InputFiles, PrepareError, TokenizeDocuments, TokenizerSpec, cgroup_cpu_limit,
    choose_engine, encode_with_backend, export_backend, load_backend, load_tokenizer
)
from app.data.lease import READERS_DIR, Lease, LeaseError, build_owner, hold_prepare_lease, hold_reader_lease, lease_uri
from app.data.manifest import DatasetError, load_manifest, shard_uris
from app.data.packing import encode_texts
from app.data.prepare import prepare_dataset
from app.dev.tiny import build_corpus, save_tiny_base
from app.storage import Store, join

BASE_URI = "s3://eft/models/tiny-prepare"
SEQ_LEN = 64
# (1-based line, raw line) for the bad lines spliced into a JSONL file.
BAD_LINES = [(3, '{"text": "unterminated'), (6, '{"body": "no text field"}'), (9, '{"text": "   "}')]
SHARD_SCHEMA = pa.schema([("row_id", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                          ("labels", pa.list_(pa.int32())), ("position_ids", pa.list_(pa.int32()))])
EXPECTED_SKIPS = [
    {"source": "part-1.jsonl", "line": 3, "reason": "bad JSON"},
    {"source": "part-1.jsonl", "line": 6, "reason": "missing field 'text'"},
    {"source": "part-1.jsonl", "line": 9, "reason": "empty text"},
]


@pytest.fixture(scope="module")
def store(s3):
    return Store()


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(max_docs=60)


@pytest.fixture(scope="module")
def tokenizer(store):
    from transformers import AutoTokenizer

    save_tiny_base(store, BASE_URI, texts=build_corpus(max_docs=200), hidden_size=16, intermediate_size=32)
    return AutoTokenizer.from_pretrained(str(store.cache_locally(BASE_URI)))


def make_config(data_uri: str, input_uri: str, **prepare) -> JobConfig:
    return build_config({
        "name": "t", "model": {"uri": BASE_URI},
        "data": {"uri": data_uri, "seq_len": SEQ_LEN, "validation_fraction": 0.2},
        "prepare": {"input_uri": input_uri, "rows_per_shard": 32, "num_tokenizer_actors": 1,
                    "tokenize_batch_size": 16, **prepare},
        "storage": {"root_uri": "s3://eft/runs"}, "training": {"max_steps": 1},
    })


def write_jsonl_with_bad_lines(store: Store, uri: str, docs: list[str]) -> None:
    lines = [json.dumps({"text": d}) for d in docs]
    # A blank line (line 5) is not a record, but it still counts for line numbers.
    for number, raw in sorted([*BAD_LINES, (5, "")]):
        lines.insert(number - 1, raw)
    store.write_text(uri, "\n".join(lines) + "\n")


def read_shards(store: Store, data_uri: str, manifest: dict, split: str) -> list[pa.Table]:
    tables = []
    for uri in shard_uris(data_uri, manifest, split):
        fs, path = store.resolve(uri)
        tables.append(pq.read_table(path, filesystem=fs))
    return tables


def read_split(store: Store, data_uri: str, manifest: dict, split: str) -> pa.Table:
    return pa.concat_tables(read_shards(store, data_uri, manifest, split))


def split_stream(table: pa.Table, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A split's rows back to back → (ids, labels) up to `tokens`, then (ids, labels) of the padding."""
    ids = np.asarray(table["input_ids"].to_pylist(), dtype=np.int64).ravel()
    labels = np.asarray(table["labels"].to_pylist(), dtype=np.int64).ravel()
    return ids[:tokens], labels[:tokens], ids[tokens:], labels[tokens:]


def decode_documents(tokenizer, ids: np.ndarray) -> list[str]:
    """Cut a packed stream at eos and decode each document (dropping its bos)."""
    docs, start = [], 0
    for end in np.flatnonzero(ids == tokenizer.eos_token_id):
        body = ids[start:end]
        assert body[0] == tokenizer.bos_token_id
        docs.append(tokenizer.decode(body[1:].tolist()))
        start = end + 1
    assert start == len(ids), "stream must end with an eos"
    return docs


def assert_subsequence(part: list[str], whole: list[str]) -> None:
    it = iter(whole)
    assert all(any(doc == w for w in it) for doc in part), "documents out of order"


@pytest.fixture(scope="module")
def text_docs(corpus):
    return {"part-0.jsonl": corpus[:25], "part-1.jsonl": corpus[25:45]}


@pytest.fixture(scope="module")
def prepared(store, tokenizer, text_docs, ray_cluster):
    """One text run over two JSONL files (plus a file that is not input); its shard tables are
    read right away so later tests can compare after an overwrite deletes them."""
    data_uri = "s3://eft/data/text"
    write_jsonl_with_bad_lines(store, "s3://eft/raw/text/part-1.jsonl", text_docs["part-1.jsonl"])
    store.write_text("s3://eft/raw/text/part-0.jsonl", "".join(json.dumps({"text": d}) + "\n"
                                                              for d in text_docs["part-0.jsonl"]))
    store.write_text("s3://eft/raw/text/notes.txt", "not an input file\n")
    cfg = make_config(data_uri, "s3://eft/raw/text/", engine="ray")
    manifest = prepare_dataset(cfg, store)
    shards = {split: read_shards(store, data_uri, manifest, split) for split in ("train", "validation")}
    return cfg, manifest, shards


def test_manifest_describes_the_dataset(store, tokenizer, prepared, text_docs):
    cfg, manifest, _ = prepared
    assert load_manifest(store, cfg.data.uri) == manifest
    assert manifest["format_version"] == 1 and manifest["seq_len"] == SEQ_LEN
    tok = manifest["tokenizer"]
    assert tok["uri"] == BASE_URI and len(tok["fingerprint"]) == 64
    assert (tok["eos_token_id"], tok["pad_token_id"], tok["bos_token_id"]) == (
        tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id)
    assert tok["vocab_size"] == len(tokenizer)
    assert manifest["source"] == {"input_uri": "s3://eft/raw/text/", "input_format": "jsonl", "format": "text",
                                  "files": ["part-0.jsonl", "part-1.jsonl"],
                                  "bytes": sum(len(store.read_bytes(f"s3://eft/raw/text/{name}"))
                                               for name in ("part-0.jsonl", "part-1.jsonl"))}
    n_docs = sum(len(d) for d in text_docs.values())
    records = manifest["records"]
    assert (records["read"], records["used"], records["skipped"]) == (n_docs + 3, n_docs, 3)
    assert records["skipped_by_reason"] == {"bad JSON": 1, "missing field 'text'": 1, "empty text": 1}
    assert records["skipped_examples"] == EXPECTED_SKIPS
    assert manifest["stats"]["wall_s"] > 0 and manifest["stats"]["tokens_per_s"] > 0
    assert manifest["stats"]["engine"] == "ray"


def test_shards_have_contiguous_row_ids_and_the_declared_schema(prepared):
    cfg, manifest, shards = prepared
    for split in ("train", "validation"):
        info = manifest["splits"][split]
        assert info["rows"] > 0
        start = 0
        for shard, table in zip(info["shards"], shards[split], strict=True):
            assert shard["path"].startswith("shards-") and shard["path"].endswith(".parquet")
            assert table.schema.equals(SHARD_SCHEMA)
            assert shard["row_id_start"] == start and shard["rows"] == table.num_rows <= 32
            assert table["row_id"].to_pylist() == list(range(start, start + table.num_rows))
            assert all(len(r) == SEQ_LEN for r in table["input_ids"].to_pylist())
            start += table.num_rows
        assert start == info["rows"]
    assert len(manifest["splits"]["train"]["shards"]) > 1


def test_rows_decode_back_to_the_corpus(tokenizer, prepared, text_docs):
    _, manifest, shards = prepared
    corpus = text_docs["part-0.jsonl"] + text_docs["part-1.jsonl"]
    decoded = {}
    for split in ("train", "validation"):
        info = manifest["splits"][split]
        ids, labels, pad_ids, pad_labels = split_stream(pa.concat_tables(shards[split]), info["tokens"])
        assert (ids == labels).all() and info["label_tokens"] == info["tokens"]
        assert (pad_ids == tokenizer.pad_token_id).all() and (pad_labels == IGNORE_INDEX).all()
        assert len(pad_ids) < SEQ_LEN
        decoded[split] = decode_documents(tokenizer, ids)
        assert_subsequence(decoded[split], corpus)
    assert decoded["validation"], "a 0.2 validation fraction of 45 documents should hold some"
    assert Counter(decoded["train"] + decoded["validation"]) == Counter(corpus)
    expected_tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 2 for d in corpus)
    assert manifest["splits"]["train"]["tokens"] + manifest["splits"]["validation"]["tokens"] == expected_tokens


def test_shards_carry_position_ids_restarting_at_each_document(tokenizer, prepared):
    """Read back: position_ids count from 0 at every document's bos, at every row start (a document
    continued from the row before) and at the padding, and +1 everywhere else."""
    _, manifest, shards = prepared
    assert manifest["position_ids"] is True
    for split in ("train", "validation"):
        table = pa.concat_tables(shards[split])
        ids = np.asarray(table["input_ids"].to_pylist())
        positions = np.asarray(table["position_ids"].to_pylist())
        flat_starts = (ids == tokenizer.bos_token_id).ravel()
        flat_starts[manifest["splits"][split]["tokens"]] = True  # the padding (the last row has some)
        starts = flat_starts.reshape(ids.shape)
        starts[:, 0] = True
        assert (positions[starts] == 0).all()
        assert (positions[:, 1:][~starts[:, 1:]] == positions[:, :-1][~starts[:, 1:]] + 1).all()
        # Both cases occur: documents starting inside rows, and rows opening on a continued document.
        assert starts[:, 1:].any() and (ids[:, 0] != tokenizer.bos_token_id).any()


def shard_layout(split: dict) -> list[tuple[int, int]]:
    return [(shard["rows"], shard["row_id_start"]) for shard in split["shards"]]


def assert_same_dataset(store: Store, data_uri: str, manifest: dict, first: dict, first_shards: dict) -> None:
    assert manifest["records"] == first["records"]
    for split in ("train", "validation"):
        old, new = first["splits"][split], manifest["splits"][split]
        assert (new["tokens"], new["label_tokens"], shard_layout(new)) == (
            old["tokens"], old["label_tokens"], shard_layout(old))
        for old_table, new_table in zip(first_shards[split], read_shards(store, data_uri, manifest, split),
                                        strict=True):
            assert new_table.equals(old_table)


def test_files_cut_into_many_blocks_over_two_actors_give_the_same_dataset(store, prepared, text_docs):
    """Block boundaries and the number of tokenizer actors never show in the output: with 2-document
    tokenizer batches every file spans several blocks, spread over two actors, and the shards, line
    numbers of skipped records and the validation split come out as in `prepared` (one block per file)."""
    _, first, first_shards = prepared
    assert BATCHES_PER_BLOCK * 2 < min(len(docs) for docs in text_docs.values())
    data_uri = "s3://eft/data/text-blocks"
    cfg = make_config(data_uri, "s3://eft/raw/text/", tokenize_batch_size=2, num_tokenizer_actors=2, engine="ray")
    assert_same_dataset(store, data_uri, prepare_dataset(cfg, store), first, first_shards)


def test_the_local_engine_gives_the_ray_engines_dataset_and_auto_picks_it_for_small_inputs(store, prepared):
    """Tokenizing in this process on 3 threads, 2-document blocks finishing out of order, changes
    nothing in the shards, the skipped records' line numbers or the split."""
    _, first, first_shards = prepared
    data_uri = "s3://eft/data/text-local"
    cfg = make_config(data_uri, "s3://eft/raw/text/", tokenize_batch_size=2, local_threads=3)
    assert cfg.prepare.engine == "auto"
    manifest = prepare_dataset(cfg, store)
    assert manifest["stats"]["engine"] == "local"
    assert_same_dataset(store, data_uri, manifest, first, first_shards)


def test_the_local_engine_on_the_transformers_tokenizer_gives_the_same_dataset(store, prepared, monkeypatch):
    """A tokenizer class that keeps the transformers encode path (export_backend says None): each of
    the 3 threads loads its own, and the shards still match."""
    import app.data.prepare as P

    _, first, first_shards = prepared
    monkeypatch.setattr(P, "export_backend", lambda tokenizer: None)
    data_uri = "s3://eft/data/text-local-transformers"
    cfg = make_config(data_uri, "s3://eft/raw/text/", tokenize_batch_size=2, local_threads=3, engine="local")
    assert_same_dataset(store, data_uri, prepare_dataset(cfg, store), first, first_shards)


def test_auto_picks_the_engine_by_input_size():
    def engine(total_bytes: int, **prepare) -> str:
        return choose_engine(make_config("s3://b/d", "s3://b/raw", **prepare), InputFiles(None, "", ["x"], total_bytes))

    assert engine(256 * 2**20) == "local" and engine(256 * 2**20 + 1) == "ray"
    assert engine(10**6, local_max_input_mb=0.5) == "ray" and engine(0, local_max_input_mb=0) == "local"
    assert engine(10**12, engine="local") == "local" and engine(1, engine="ray") == "ray"


def test_the_local_engine_counts_the_containers_cpu_quota(tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    v2.mkdir()
    assert cgroup_cpu_limit(v2) is None
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2) is None
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(v2) == 2.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 4.0


def test_a_second_prepare_of_the_same_recipe_does_nothing_and_another_is_refused_naming_the_difference(
        store, prepared, text_docs):
    """Same input, settings and tokenizer: nothing to do, nothing written (not even the lease), on
    either engine (how a dataset is made is not what it holds). A changed setting, an input file
    added or changed: refused in one line naming it, before any input is read, nothing written."""
    cfg, first, _ = prepared
    listing = store.list_versions(cfg.data.uri)
    again = prepare_dataset(cfg, store)
    assert again.pop("unchanged") is True and again == first
    local = make_config(cfg.data.uri, "s3://eft/raw/text/", engine="local", local_threads=1, tokenize_batch_size=3)
    assert prepare_dataset(local, store)["unchanged"] is True
    assert store.list_versions(cfg.data.uri) == listing

    def refused(config, change: str) -> None:
        with pytest.raises(PrepareError) as err:
            prepare_dataset(config, store)
        assert str(err.value) == (f"dataset already prepared at {cfg.data.uri} from another recipe: {change} "
                                  f"(set prepare.overwrite=true to replace it)")
        assert store.list_versions(cfg.data.uri) == listing

    refused(make_config(cfg.data.uri, "s3://eft/raw/text/", engine="ray", rows_per_shard=16),
            "prepare.rows_per_shard 32 → 16")
    refused(make_config(cfg.data.uri, "s3://eft/raw/text/", engine="ray", overlong="drop"),
            "prepare.overlong None → 'drop'")
    original = store.read_bytes("s3://eft/raw/text/part-0.jsonl")
    store.write_text("s3://eft/raw/text/part-2.jsonl", json.dumps({"text": "one more"}) + "\n")
    try:
        refused(cfg, "input s3://eft/raw/text/ changed: part-2.jsonl (added)")
    finally:
        store.delete_prefix("s3://eft/raw/text/part-2.jsonl")
    store.write_bytes("s3://eft/raw/text/part-0.jsonl", original + b'{"text": "changed"}\n')
    try:
        refused(cfg, "input s3://eft/raw/text/ changed: part-0.jsonl (changed)")
    finally:
        store.write_bytes("s3://eft/raw/text/part-0.jsonl", original)
    # The same bytes written again are the same input (S3's ETag is their MD5).
    assert prepare_dataset(cfg, store)["unchanged"] is True


def test_a_setting_newer_than_the_dataset_counts_as_its_default():
    """A dataset prepared before a setting existed was shaped as its default shapes rows: the same
    recipe; set otherwise, the difference is named."""
    from app.data.prepare import describe_recipe_change

    old = {"settings": {"data.seq_len": 64, "prepare.rows_per_shard": 32}, "inputs": {}, "chat_template_sha256": None,
           "tokenizer": "t"}
    new = {**old, "settings": {**old["settings"], "prepare.packing": True}}
    assert describe_recipe_change(old, new) == ""
    unpacked = {**old, "settings": {**old["settings"], "prepare.packing": False}}
    assert describe_recipe_change(old, unpacked) == "prepare.packing True → False"


def test_a_dataset_without_a_recorded_recipe_is_refused_unless_overwritten(store, tokenizer, text_docs):
    data_uri = "s3://eft/data/no-recipe"
    store.write_text("s3://eft/raw/no-recipe.jsonl", "".join(json.dumps({"text": d}) + "\n"
                                                            for d in text_docs["part-0.jsonl"]))
    cfg = make_config(data_uri, "s3://eft/raw/no-recipe.jsonl", engine="local")
    manifest = prepare_dataset(cfg, store)
    assert manifest["recipe"]["inputs"] == {"s3://eft/raw/no-recipe.jsonl": {"no-recipe.jsonl": ANY}}
    store.write_json(f"{data_uri}/manifest.json", {k: v for k, v in manifest.items() if k != "recipe"})
    with pytest.raises(PrepareError, match=rf"^dataset already prepared at {data_uri} by an earlier eft, which "
                                           r"recorded no recipe to compare with \(set prepare.overwrite=true\)$"):
        prepare_dataset(cfg, store)
    overwrite = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"overwrite": True})})
    assert "unchanged" not in prepare_dataset(overwrite, store)
    assert prepare_dataset(cfg, store)["unchanged"] is True


def test_overwrite_is_deterministic_and_removes_old_shards(store, prepared):
    cfg, first, first_shards = prepared
    store.write_text(f"{cfg.data.uri}/shards-crashed/train-00000.parquet", "left by a crashed run")
    overwrite = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"overwrite": True})})
    second = prepare_dataset(overwrite, store)
    assert load_manifest(store, cfg.data.uri) == second
    for split in ("train", "validation"):
        old, new = first["splits"][split], second["splits"][split]
        assert [s["path"] for s in old["shards"]] != [s["path"] for s in new["shards"]]
        assert [(s["rows"], s["row_id_start"]) for s in old["shards"]] == [
            (s["rows"], s["row_id_start"]) for s in new["shards"]]
        for old_table, new_table in zip(first_shards[split], read_shards(store, cfg.data.uri, second, split),
                                        strict=True):
            assert new_table.equals(old_table)
    new_dir = second["splits"]["train"]["shards"][0]["path"].split("/")[0]
    assert [d for d in store.list_dirs(cfg.data.uri) if d.startswith("shards-")] == [new_dir]


@pytest.mark.parametrize("engine", ["ray", "local"])
def test_too_many_bad_records_fail_naming_the_first_and_commit_nothing(store, tokenizer, text_docs, ray_cluster,
                                                                       engine):
    data_uri = f"s3://eft/data/too-bad-{engine}"
    write_jsonl_with_bad_lines(store, "s3://eft/raw/too-bad/part-1.jsonl", text_docs["part-1.jsonl"][:6])
    cfg = make_config(data_uri, "s3://eft/raw/too-bad/part-1.jsonl", max_bad_records=2, engine=engine)
    with pytest.raises(PrepareError, match=r"max_bad_records=2 .*first: part-1.jsonl:3 bad JSON; "
                                           r"part-1.jsonl:6 missing field 'text'"):
        prepare_dataset(cfg, store)
    assert not store.exists(f"{data_uri}/manifest.json")
    assert store.list_files(data_uri) == []
    with pytest.raises(DatasetError, match=rf"no committed dataset at {data_uri}: manifest.json missing"):
        load_manifest(store, data_uri)


def test_missing_input_fails_naming_the_uri(store, tokenizer):
    cfg = make_config("s3://eft/data/none", "s3://eft/raw/does-not-exist/")
    with pytest.raises(PrepareError, match=r"no jsonl input files .* at s3://eft/raw/does-not-exist/"):
        prepare_dataset(cfg, store)


def test_parquet_instruction_input_masks_prompts(store, tokenizer, corpus, ray_cluster):
    """Parquet input and the instruction format in one run (each Ray run costs seconds here)."""
    pairs = [(d[:60], d[60:].strip()) for d in corpus[45:57]]
    table = pa.table({"question": [p for p, _ in pairs], "answer": [r for _, r in pairs]})
    orphan = pa.table({"question": ["orphan"], "answer": pa.array([None], pa.string())})
    table = pa.concat_tables([table.slice(0, 4), orphan, table.slice(4)])  # row 5 has a null answer
    fs, path = store.resolve("s3://eft/raw/pq/data.parquet")
    with fs.open_output_stream(path) as out:
        pq.write_table(table, out, row_group_size=5)
    cfg = make_config("s3://eft/data/pq", "s3://eft/raw/pq", input_format="parquet", format="instruction",
                      prompt_field="question", response_field="answer", engine="ray")
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"validation_fraction": 0.0})})
    manifest = prepare_dataset(cfg, store)
    assert manifest["source"]["files"] == ["data.parquet"]
    assert manifest["records"]["skipped_examples"] == [{"source": "data.parquet", "line": 5,
                                                       "reason": "missing field 'answer'"}]
    assert manifest["splits"]["validation"] == {"rows": 0, "tokens": 0, "label_tokens": 0, "shards": []}
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected_ids, expected_labels = [], []
    for prompt, response in pairs:
        p, r = encode(prompt), encode(response)
        expected_ids += [tokenizer.bos_token_id, *p, *r, tokenizer.eos_token_id]
        expected_labels += [IGNORE_INDEX] * (1 + len(p)) + [*r, tokenizer.eos_token_id]
    train = manifest["splits"]["train"]
    ids, labels, _, _ = split_stream(read_split(store, cfg.data.uri, manifest, "train"), train["tokens"])
    assert ids.tolist() == expected_ids
    assert labels.tolist() == expected_labels
    assert train["label_tokens"] == sum(1 for x in expected_labels if x != IGNORE_INDEX) < train["tokens"]
    # The local engine numbers Parquet rows the same way across its own (3-row) blocks.
    local = cfg.model_copy(update={"data": cfg.data.model_copy(update={"uri": "s3://eft/data/pq-local"}),
                                   "prepare": cfg.prepare.model_copy(update={"engine": "local",
                                                                             "tokenize_batch_size": 3})})
    local_manifest = prepare_dataset(local, store)
    assert local_manifest["records"] == manifest["records"]
    assert read_split(store, local.data.uri, local_manifest, "train").equals(
        read_split(store, cfg.data.uri, manifest, "train"))


def test_the_local_engine_names_an_input_file_that_is_not_parquet(store, tokenizer):
    store.write_text("s3://eft/raw/bad-pq/ok-name.parquet", "not parquet at all")
    cfg = make_config("s3://eft/data/bad-pq", "s3://eft/raw/bad-pq/", input_format="parquet")
    with pytest.raises(PrepareError, match=r"^input file eft/raw/bad-pq/ok-name.parquet is not valid Parquet"):
        prepare_dataset(cfg, store)
    assert store.list_files("s3://eft/data/bad-pq") == []


# -- the tokenizer in the actors ----------------------------------------------------------

TRICKY_TEXTS = ["Plain prose.", "a literal </s> and <s> stay text", "  spaces around  ", "tabs\tand\nnewlines",
                "ünïcödé — “quotes” 😀", ""]


def test_the_rust_backend_encodes_like_the_transformers_tokenizer(tokenizer):
    backend = load_backend(export_backend(tokenizer))
    assert encode_with_backend(backend, TRICKY_TEXTS) == encode_texts(tokenizer, TRICKY_TEXTS)


def test_the_backend_drops_truncation_and_padding_set_on_the_tokenizer(store, tokenizer):
    configured = load_tokenizer(store, BASE_URI)
    configured.backend_tokenizer.enable_truncation(max_length=4)
    configured.backend_tokenizer.enable_padding(length=64)
    backend = load_backend(export_backend(configured))
    assert encode_with_backend(backend, TRICKY_TEXTS) == encode_texts(tokenizer, TRICKY_TEXTS)


def test_a_tokenizer_class_with_its_own_encode_path_is_not_exported(tokenizer):
    custom = copy.copy(tokenizer)
    custom.__class__ = type("Custom", (type(tokenizer),), {"_encode_plus": lambda self, *args, **kwargs: None})
    assert export_backend(custom) is None


def test_tokenizer_actors_encode_alike_with_the_backend_or_transformers(store, tokenizer, corpus):
    """An actor given no backend (export_backend said None) loads the transformers tokenizer from the
    URI instead; both give the same table, prompts, literal special tokens and skipped rows included."""
    batch = pa.table({"source": ["a.jsonl"] * 4, "line": [1, 2, 3, 4],
                      "text": [corpus[0], None, corpus[1], "</s> is text here"],
                      "prompt": [None, None, "a prompt with <s>", None], "reason": [None, "bad JSON", None, None],
                      "spans": [None] * 4, "turn_ends": [None] * 4,
                      **{name: [None] * 4 for name in ("rejected_text", "rejected_prompt", "rejected_spans")}},
                     schema=DOCUMENT_SCHEMA)
    spec = TokenizerSpec(BASE_URI, store.endpoint, store.region, tokenizer.eos_token_id, tokenizer.bos_token_id,
                         backend_json=None)
    with_transformers = TokenizeDocuments(spec)(batch)
    with_backend = TokenizeDocuments(spec._replace(backend_json=export_backend(tokenizer)))(batch)
    assert with_backend.equals(with_transformers)
    assert with_backend["input_ids"][1].as_py() == [] and len(with_backend["input_ids"][2].as_py()) > 2


def test_a_tokenizer_uri_without_a_tokenizer_is_named_in_one_line(store, tokenizer, text_docs):
    """A model dir with no tokenizer files: our line names the URI, not transformers' first line."""
    store.write_bytes("s3://eft/models/no-tokenizer/config.json", store.read_bytes(f"{BASE_URI}/config.json"))
    store.write_text("s3://eft/raw/tok/part-0.jsonl", "".join(json.dumps({"text": d}) + "\n"
                                                           for d in text_docs["part-0.jsonl"]))
    for uri, what in (("s3://eft/models/no-tokenizer", "no tokenizer there"),
                      ("s3://eft/models/nothing-here", "nothing there")):
        cfg = make_config("s3://eft/data/no-tokenizer", "s3://eft/raw/tok/part-0.jsonl", tokenizer_uri=uri,
                          engine="local")
        with pytest.raises(PrepareError) as info:
            prepare_dataset(cfg, store)
        message = str(info.value)
        assert message.startswith(f"tokenizer URI {uri}: {what} (") and "prepare.tokenizer_uri" in message
        assert "\n" not in message
    assert store.list_files("s3://eft/data/no-tokenizer") == []  # not even the lease is left


def write_job(tmp_path, cfg) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(dump_config(cfg))
    return str(path)


def test_a_second_prepare_of_a_dataset_fails_naming_the_holder_and_expiry(store, tokenizer, text_docs, tmp_path,
                                                                         capsys):
    data_uri = "s3://eft/data/leased"
    store.write_text("s3://eft/raw/leased/part-0.jsonl", "".join(json.dumps({"text": d}) + "\n"
                                                              for d in text_docs["part-0.jsonl"]))
    cfg = make_config(data_uri, "s3://eft/raw/leased/part-0.jsonl", engine="local")
    with hold_prepare_lease(store, data_uri) as first:
        assert main(["prepare", write_job(tmp_path, cfg)]) == 1
        message = capsys.readouterr().err.strip().splitlines()[-1]
        held = json.loads(store.read_bytes(lease_uri(data_uri)))
        assert message == (f"eft: error: dataset {data_uri}: held by prepare (pid {first.owner['pid']} on "
                           f"{first.owner['host']}, since {first.owner['started_at']}) until {held['expires_at']}, "
                           f"epoch 1 (lease {lease_uri(data_uri)}; wait for it to finish, or for the lease to expire)")
        # A run does not start on a dataset being written either; its reader lease is withdrawn.
        with pytest.raises(LeaseError, match=rf"^{data_uri}: being prepared by prepare \(pid "):
            hold_reader_lease(store, data_uri, "s3://eft/runs/eager")
        assert store.list_files(join(data_uri, READERS_DIR)) == []
        # The create is conditional: of two writers of an absent lease, exactly one wins.
        assert store.write_if(join(data_uri, "race.json"), b"a", None) is not None
        assert store.write_if(join(data_uri, "race.json"), b"b", None) is None
        store.delete_prefix(join(data_uri, "race.json"))
    assert store.list_files(data_uri) == []  # released
    assert prepare_dataset(cfg, store)["splits"]["train"]["rows"] > 0
    assert not store.exists(lease_uri(data_uri))


def test_an_expired_lease_is_taken_over_and_its_holder_cannot_commit(store, tokenizer, text_docs):
    data_uri = "s3://eft/data/lease-expired"
    store.write_text("s3://eft/raw/lease-expired.jsonl", "".join(json.dumps({"text": d}) + "\n"
                                                              for d in text_docs["part-0.jsonl"]))
    # What a prepare that stalled past its lease leaves behind: a lease already expired.
    stalled = Lease(store, lease_uri(data_uri), build_owner("prepare"), label=f"dataset {data_uri}", ttl_s=-60)
    stalled.take()
    cfg = make_config(data_uri, "s3://eft/raw/lease-expired.jsonl", engine="local")
    assert prepare_dataset(cfg, store)["splits"]["train"]["rows"] > 0
    # Should the stalled one wake up, its pre-commit check tells it the lease is gone.
    with pytest.raises(LeaseError, match=rf"^dataset {data_uri}: lease {lease_uri(data_uri)} removed by someone"):
        stalled.check()


def test_an_overwrite_waits_for_the_live_run_that_reads_the_dataset(store, tokenizer, text_docs, tmp_path, capsys):
    data_uri = "s3://eft/data/read-by-a-run"
    store.write_text("s3://eft/raw/read-by-a-run.jsonl", "".join(json.dumps({"text": d}) + "\n"
                                                              for d in text_docs["part-0.jsonl"]))
    cfg = make_config(data_uri, "s3://eft/raw/read-by-a-run.jsonl", engine="local")
    first = prepare_dataset(cfg, store)
    before = store.list_files(data_uri)
    overwrite = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"overwrite": True})})
    # A driver that died long ago left an expired reader lease: it holds nothing back.
    dead = Lease(store, join(data_uri, READERS_DIR, "dead.json"), build_owner("train", run_uri="s3://eft/runs/dead"),
                 label="reader", ttl_s=-60)
    dead.take()
    reader = hold_reader_lease(store, data_uri, "s3://eft/runs/reading")  # what run_training holds
    try:
        assert main(["prepare", write_job(tmp_path, overwrite)]) == 1
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert message.startswith(f"eft: error: {data_uri}: read by the live run s3://eft/runs/reading (pid "), message
        assert "would delete the shards it streams" in message
        assert load_manifest(store, data_uri) == first
        assert set(before) <= set(store.list_files(data_uri))  # every shard the run reads is still there
    finally:
        reader.stop()
    assert store.list_files(join(data_uri, READERS_DIR)) == []  # the dead reader was cleared, the live one released
    second = prepare_dataset(overwrite, store)
    assert second["splits"]["train"]["shards"][0]["path"] != first["splits"]["train"]["shards"][0]["path"]
