"""Conversation formats (`chat`, `sharegpt`): real chat templates on the tiny tokenizer, checked
against transformers' own `apply_chat_template`; then one prepare run on the local engine.

No Ray here: the parse and tokenize functions are the ones both engines run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from app.batch import IGNORE_INDEX
from app.config import ConfigError, build_config, dump_config
from app.data.chat import ChatFormat
from app.data.engines import (
    PrepareError, TokenizeDocuments, TokenizerSpec, build_document_table, encode_chat_texts, encode_chat_with_backend,
    export_backend, load_backend
)
from app.data.formats import Skip
from app.data.manifest import load_manifest, shard_uris
from app.data.prepare import prepare_dataset
from app.dev.tiny import build_corpus, build_tiny_tokenizer
from app.storage import Store

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Each template: its special tokens, the end-of-turn marker after an assistant reply, whether the
# template strips the content, and whether it takes a system message.
STYLES = {
    "qwen2.5-instruct": (["<|im_start|>", "<|im_end|>"], "<|im_end|>", False, True),
    "llama-3-instruct": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>", True, True),
    "gemma-it": (["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", True, False),
    "chatml-generation": (["<|im_start|>", "<|im_end|>"], "<|im_end|>", False, True),
}
SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "An ordered, mutable sequence of items."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": " An immutable one. "},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome; ask again any time."},
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The tiny BPE tokenizer, saved once (each template test loads its own copy)."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(build_corpus(max_docs=200)).save_pretrained(path)
    return path


def load_styled(base_dir: Path, style: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    tok.add_tokens(STYLES[style][0], special_tokens=True)
    tok.chat_template = (TEMPLATES / f"{style}.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def styled(base_dir):
    return {style: load_styled(base_dir, style) for style in STYLES}


def chat_format(tok, fmt: str = "chat", **kwargs) -> ChatFormat:
    return ChatFormat(fmt, tok.chat_template, tok.special_tokens_map, **kwargs)


def tokenize(tok, chat: ChatFormat, records: list, seq_len=None, overlong="split"):
    """Records → the tokenize stage's table, through the same functions as prepare (Rust backend)."""
    parsed = [chat.document(r) for r in records]
    table = build_document_table(["a.jsonl"] * len(parsed), list(range(1, len(parsed) + 1)), parsed)
    spec = TokenizerSpec("unused", None, "us-east-1", tok.eos_token_id, tok.bos_token_id, export_backend(tok))
    return TokenizeDocuments(spec, seq_len, overlong)(table)


def library_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def trained_pieces(tok, ids, labels) -> list[str]:
    """Decode each run of trained tokens."""
    pieces, run = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == i
            run.append(i)
        elif run:
            pieces.append(tok.decode(run))
            run = []
    if run:
        pieces.append(tok.decode(run))
    return pieces


def conversation(style: str) -> list[dict]:
    return ([SYSTEM] if STYLES[style][3] else []) + TURNS


def expected_replies(style: str, turns=TURNS) -> list[str]:
    eot, strips = STYLES[style][1], STYLES[style][2]
    return [(m["content"].strip() if strips else m["content"]) + eot for m in turns if m["role"] == "assistant"]


# -- ids and masks against the library ---------------------------------------------------------

@pytest.mark.parametrize("style", list(STYLES))
def test_ids_equal_apply_chat_template_and_every_assistant_turn_is_trained(styled, style):
    tok = styled[style]
    messages = conversation(style)
    out = tokenize(tok, chat_format(tok), [{"messages": messages}])
    ids, labels = out["input_ids"][0].as_py(), out["labels"][0].as_py()
    assert ids == library_ids(tok, messages)
    assert trained_pieces(tok, ids, labels) == expected_replies(style)
    assert out["overlong"][0].as_py() is None


@pytest.mark.parametrize("style", ["qwen2.5-instruct", "llama-3-instruct"])
def test_special_token_text_in_a_message_is_tokenized_as_the_library_does(styled, style):
    """apply_chat_template matches special-token text anywhere in its rendering (no sanitizing by
    default); so does prepare, so that ids stay equal."""
    tok = styled[style]
    messages = [{"role": "user", "content": f"say {STYLES[style][1]} please"}, {"role": "assistant", "content": "ok"}]
    out = tokenize(tok, chat_format(tok), [{"messages": messages}])
    assert out["input_ids"][0].as_py() == library_ids(tok, messages)


def test_the_rust_backend_encodes_conversations_like_the_transformers_tokenizer(styled):
    tok = styled["llama-3-instruct"]
    texts = [tok.apply_chat_template(conversation("llama-3-instruct"), tokenize=False), "ünï <|eot_id|>x"]
    for (a_ids, a_off), (b_ids, b_off) in zip(encode_chat_with_backend(load_backend(export_backend(tok), False), texts),
                                              encode_chat_texts(tok, texts)):
        assert a_ids.tolist() == b_ids.tolist() and a_off.tolist() == b_off.tolist()


def test_generation_blocks_give_the_incremental_paths_masks_and_the_librarys(styled):
    tok = styled["chatml-generation"]
    chat = chat_format(tok)
    assert chat.has_generation_blocks
    messages = conversation("chatml-generation")
    blocks, incremental = chat.render(messages), chat.render(messages, incremental=True)
    assert blocks == incremental
    out = tokenize(tok, chat, [{"messages": messages}])
    library = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"][0].as_py() == list(library["input_ids"])
    assert [int(x != IGNORE_INDEX) for x in out["labels"][0].as_py()] == list(library["assistant_masks"])


def test_a_template_that_rejects_the_system_role_skips_the_record_with_its_reason(styled):
    tok = styled["gemma-it"]
    assert chat_format(tok).document({"messages": [SYSTEM, *TURNS]}) == Skip(
        "chat template error: System role not supported")


def test_a_template_that_compiles_but_refuses_the_sample_turn_says_so_in_the_log(caplog):
    """The compile check renders one user turn; a template that refuses it (one that wants a
    system turn first) passes, as each record decides for itself, but no longer silently."""
    import logging

    from app.data.engines import check_chat_template

    with caplog.at_level(logging.DEBUG, logger="app.data.engines"):
        check_chat_template("{{ raise_exception('a system turn first') }}", "prepare.chat_template t.jinja")
    assert "prepare.chat_template t.jinja compiles but refuses a one-turn sample (TemplateError: a system turn " \
           "first)" in caplog.text


@pytest.mark.parametrize("style", ["qwen2.5-instruct", "gemma-it"])
def test_train_on_last_assistant_and_all(styled, style):
    tok = styled[style]
    messages = conversation(style)
    last = tokenize(tok, chat_format(tok, train_on="last_assistant"), [{"messages": messages}])
    ids, labels = last["input_ids"][0].as_py(), last["labels"][0].as_py()
    assert trained_pieces(tok, ids, labels) == expected_replies(style)[-1:]
    everything = tokenize(tok, chat_format(tok, train_on="all"), [{"messages": messages}])
    assert everything["labels"][0].as_py() == everything["input_ids"][0].as_py() == ids


def test_tool_messages_pass_through_a_template_that_has_them(styled):
    tok = styled["qwen2.5-instruct"]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    out = tokenize(tok, chat_format(tok), [{"messages": messages}])
    ids, labels = out["input_ids"][0].as_py(), out["labels"][0].as_py()
    assert ids == library_ids(tok, messages)
    assert trained_pieces(tok, ids, labels) == ["Checking.<|im_end|>", "It is sunny.<|im_end|>"]


# -- records --------------------------------------------------------------------------------

def test_null_message_keys_are_absent_as_in_the_library(styled):
    """Parquet rows give every struct key, null where a message has none (here Qwen's tool_calls)."""
    tok = styled["qwen2.5-instruct"]
    with_nulls = [{**m, "tool_calls": None, "name": None} for m in TURNS]
    assert chat_format(tok).document({"messages": with_nulls}) == chat_format(tok).document({"messages": TURNS})
    assert chat_format(tok).document({"messages": with_nulls}).text == tok.apply_chat_template(with_nulls,
                                                                                              tokenize=False)


def test_sharegpt_maps_roles_and_the_mapping_can_be_overridden(styled):
    tok = styled["qwen2.5-instruct"]
    record = {"conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello."}]}
    as_chat = chat_format(tok).document({"messages": [SYSTEM, {"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello."}]})
    assert chat_format(tok, "sharegpt").document(record) == as_chat
    custom = {"conv": [{"from": "asker", "value": "Hi"}, {"from": "bot", "value": "Hello."}]}
    fmt = chat_format(tok, "sharegpt", conversations_field="conv", sharegpt_roles={"asker": "user", "bot": "assistant"})
    assert fmt.document(custom).text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n")
    assert fmt.document(record) == Skip("missing field 'conv'")
    assert fmt.document({"conv": record["conversations"]}) == Skip("unknown role 'system'")


@pytest.mark.parametrize("record, reason", [
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "Yo"}]},
     "content is not a string"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "Yo"}]},
     "content is not a string"),
    ({"messages": "Hi"}, "field 'messages' is not a list"),
    ({"messages": ["Hi"]}, "message is not an object"),
    ({"text": "Hi"}, "missing field 'messages'"),
    (["not", "an", "object"], "not an object"),
])
def test_bad_conversations_are_skipped_with_their_reason(styled, record, reason):
    assert chat_format(styled["qwen2.5-instruct"]).document(record) == Skip(reason)


# -- over-long conversations ----------------------------------------------------------------------

def test_overlong_conversations_drop_truncate_or_split(styled):
    tok = styled["llama-3-instruct"]
    chat = chat_format(tok)
    messages = conversation("llama-3-instruct")
    full = library_ids(tok, messages)
    # Where each assistant turn ends (its <|eot_id|>), in tokens.
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    ends = [i + 1 for i, t in enumerate(full) if t == eot][2::2]  # eots after system, user, assistant, user, ...
    assert len(ends) == 3 and ends[-1] == len(full)
    seq_len = ends[1] + 1  # the first two assistant turns fit, the third does not
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    records = [{"messages": messages}, {"messages": short}]
    short_ids = library_ids(tok, short)

    dropped = tokenize(tok, chat, records, seq_len, "drop")
    assert dropped["input_ids"].to_pylist() == [[], short_ids]
    assert dropped["overlong"].to_pylist() == ["dropped", None]

    truncated = tokenize(tok, chat, records, seq_len, "truncate")
    ids, labels = truncated["input_ids"][0].as_py(), truncated["labels"][0].as_py()
    assert ids == full[:ends[1]]
    assert trained_pieces(tok, ids, labels) == expected_replies("llama-3-instruct")[:2]
    assert truncated["overlong"].to_pylist() == ["truncated", None]

    split = tokenize(tok, chat, records, seq_len, "split")
    assert split["input_ids"][0].as_py() == full and split["overlong"].to_pylist() == ["split", None]

    # No assistant turn fits: truncate drops it; in last_assistant mode only the last turn counts.
    assert tokenize(tok, chat, records, ends[0] - 1, "truncate")["overlong"].to_pylist() == ["dropped", None]
    last_only = chat_format(tok, train_on="last_assistant")
    assert tokenize(tok, last_only, records, seq_len, "truncate")["overlong"].to_pylist() == ["dropped", None]


def test_overlong_text_documents_keep_their_default_split_and_can_be_dropped_or_truncated(styled):
    from app.data.formats import Document

    tok = styled["qwen2.5-instruct"]
    table = build_document_table(["a"] * 2, [1, 2], [Document("word " * 40), Document("short")])
    spec = TokenizerSpec("unused", None, "us-east-1", tok.eos_token_id, tok.bos_token_id, export_backend(tok))
    split = TokenizeDocuments(spec, 16, "split")(table)
    assert split["overlong"].to_pylist() == ["split", None] and len(split["input_ids"][0]) > 16
    assert TokenizeDocuments(spec, 16, "drop")(table)["input_ids"][0].as_py() == []
    truncated = TokenizeDocuments(spec, 16, "truncate")(table)
    assert truncated["input_ids"][0].as_py() == split["input_ids"][0].as_py()[:16]
    assert truncated["input_ids"][1].as_py() == split["input_ids"][1].as_py()


# -- config -------------------------------------------------------------------------------

def make_config(data_uri: str, input_uri: str, model_uri: str, seq_len: int = 256, **prepare):
    return build_config({
        "name": "t", "model": {"uri": model_uri}, "data": {"uri": data_uri, "seq_len": seq_len},
        "prepare": {"input_uri": input_uri, "engine": "local", "local_threads": 2, "tokenize_batch_size": 4,
                    "format": "chat", **prepare},
        "storage": {"root_uri": "s3://eft/runs"}, "training": {"max_steps": 1},
    })


def test_config_defaults_and_rejections():
    cfg = make_config("/d", "/i", "/m")
    assert (cfg.prepare.train_on, cfg.prepare.overlong_mode, cfg.prepare.messages_field) == ("assistant", "drop",
                                                                                             "messages")
    assert make_config("/d", "/i", "/m", format="text").prepare.overlong_mode == "split"
    assert make_config("/d", "/i", "/m", format="instruction").prepare.overlong_mode == "split"
    with pytest.raises(ConfigError, match="prepare.train_on"):
        make_config("/d", "/i", "/m", train_on="users")
    with pytest.raises(ConfigError, match="prepare.sharegpt_roles.bot"):
        make_config("/d", "/i", "/m", sharegpt_roles={"bot": "robot"})


# -- end to end: prepare on the local engine through S3 ------------------------------------------

MODEL_URI = "s3://eft/models/tiny-chat"


@pytest.fixture(scope="module")
def chat_model(s3, base_dir):
    """The tiny tokenizer with Qwen's template saved in its dir (chat_template.jinja), on S3, and the
    same tokenizer without a template."""
    store = Store()
    tok = load_styled(base_dir, "qwen2.5-instruct")
    tok_dir = base_dir.parent / "qwen-tok"
    tok.save_pretrained(str(tok_dir))
    store.upload_dir(str(tok_dir), MODEL_URI)
    store.upload_dir(str(base_dir), MODEL_URI + "-plain")
    return store, tok


CHAT_INPUT = "s3://eft/raw/chat/part-0.jsonl"
CONVERSATIONS = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."},
                  {"role": "user", "content": "More?"}, {"role": "assistant", "content": f"No more {i}."}]
                 for i in range(6)]


@pytest.fixture(scope="module")
def chat_input(chat_model) -> str:
    """6 good conversations, one with no reply, one over-long, one with a non-string content."""
    store, _ = chat_model
    long = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
    lines = [json.dumps({"messages": c}) for c in CONVERSATIONS[:3]]
    lines += [json.dumps({"messages": [{"role": "user", "content": "no reply"}]}), json.dumps({"messages": long}),
              '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}']
    lines += [json.dumps({"messages": c}) for c in CONVERSATIONS[3:]]
    store.write_text(CHAT_INPUT, "\n".join(lines) + "\n")
    return CHAT_INPUT


def test_prepare_a_chat_jsonl_on_the_local_engine(chat_model, chat_input):
    store, tok = chat_model
    convs = CONVERSATIONS
    cfg = make_config("s3://eft/data/chat", "s3://eft/raw/chat/part-0.jsonl", MODEL_URI)
    manifest = prepare_dataset(cfg, store)
    records = manifest["records"]
    assert (records["read"], records["used"], records["skipped"]) == (9, 6, 2)
    assert records["skipped_by_reason"] == {"no assistant turn": 1, "content is not a string": 1}
    assert [e["line"] for e in records["skipped_examples"]] == [4, 6]
    assert records["overlong"] == {"split": 0, "truncated": 0, "dropped": 1}
    assert manifest["stats"]["engine"] == "local"

    ids, labels = [], []
    for uri in shard_uris(cfg.data.uri, load_manifest(store, cfg.data.uri), "train"):
        fs, path = store.resolve(uri)
        table = pq.read_table(path, filesystem=fs)
        ids += np.ravel(table["input_ids"].to_pylist()).tolist()
        labels += np.ravel(table["labels"].to_pylist()).tolist()
    expected_ids = [t for c in convs for t in library_ids(tok, c)]
    n = manifest["splits"]["train"]["tokens"]
    assert n == len(expected_ids) and ids[:n] == expected_ids
    assert set(ids[n:]) <= {tok.pad_token_id} and set(labels[n:]) <= {IGNORE_INDEX}
    expected_pieces = [p for i in range(6) for p in (f"Answer {i}.<|im_end|>", f"No more {i}.<|im_end|>")]
    assert trained_pieces(tok, ids[:n], labels[:n]) == expected_pieces


def test_a_model_without_a_chat_template_fails_naming_the_key(chat_model, chat_input):
    store, _ = chat_model
    cfg = make_config("s3://eft/data/chat-none", "s3://eft/raw/chat/part-0.jsonl", MODEL_URI + "-plain")
    with pytest.raises(PrepareError, match=r"^tokenizer at s3://eft/models/tiny-chat-plain has no chat template: "
                                           r"set prepare.chat_template") as err:
        prepare_dataset(cfg, store)
    assert "\n" not in str(err.value)
    assert not store.exists("s3://eft/data/chat-none/manifest.json")


def test_prepare_chat_template_brings_a_template_to_a_base_model(chat_model, chat_input):
    store, tok = chat_model
    store.write_text("s3://eft/templates/llama3.jinja", (TEMPLATES / "llama-3-instruct.jinja").read_text())
    # The plain tokenizer has none of Llama 3's special tokens: its header text is plain text, and
    # the ids are still the library's.
    cfg = make_config("s3://eft/data/chat-own", "s3://eft/raw/chat/part-0.jsonl", MODEL_URI + "-plain",
                      chat_template="s3://eft/templates/llama3.jinja", overwrite=True)
    manifest = prepare_dataset(cfg, store)
    assert manifest["records"]["used"] == 6


def test_a_chat_template_that_is_not_valid_jinja_fails_naming_the_file_and_line(chat_model):
    """At load, before the lease or any record: one line naming the template file and the line of
    its syntax error (the input named here does not exist: reading it would be another error)."""
    store, _ = chat_model
    broken = "s3://eft/templates/broken.jinja"
    store.write_text(broken, "{% for message in messages %}\n{{ message['content'] }}\n{% if message %}\n{% endfor %}\n")
    cfg = make_config("s3://eft/data/chat-broken", "s3://eft/raw/chat/none.jsonl", MODEL_URI + "-plain",
                      chat_template=broken)
    with pytest.raises(PrepareError) as err:
        prepare_dataset(cfg, store)
    assert str(err.value).startswith(f"prepare.chat_template {broken}: not valid Jinja at line 4: Encountered "
                                     f"unknown tag 'endfor'.") and "\n" not in str(err.value)
    assert store.list_files("s3://eft/data/chat-broken") == []


def test_the_ray_engine_gives_the_local_engines_chat_dataset(chat_model, chat_input, ray_cluster):
    """The one Ray run here (seconds of start-up): the ChatFormat travels to the read tasks and the
    overlong mode to the tokenizer actors; the shards are byte-identical to the local engine's."""
    store, _ = chat_model
    local = make_config("s3://eft/data/chat-local", "s3://eft/raw/chat/part-0.jsonl", MODEL_URI, overlong="truncate")
    ray = make_config("s3://eft/data/chat-ray", "s3://eft/raw/chat/part-0.jsonl", MODEL_URI, overlong="truncate",
                      engine="ray", num_tokenizer_actors=1)
    manifests = [prepare_dataset(cfg, store) for cfg in (local, ray)]
    assert manifests[0]["records"] == manifests[1]["records"]
    assert manifests[1]["stats"]["engine"] == "ray"
    shards = [[store.read_bytes(uri) for uri in shard_uris(cfg.data.uri, m, "train")]
              for cfg, m in zip((local, ray), manifests)]
    assert shards[0] == shards[1] and shards[0]


# -- eft prepare --preview ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
PREVIEWED = [[{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "An ordered sequence."}],
             [{"role": "user", "content": "Only a question"}],
             [{"role": "user", "content": "And a tuple?"}, {"role": "assistant", "content": "An immutable one."},
              {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Any time."}],
             [{"role": "user", "content": "Never previewed?"}, {"role": "assistant", "content": "Beyond N."}]]
COUNTS = re.compile(r"^(\d+) tokens: (\d+) trained, (\d+) masked", re.M)


def eft(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def prepared_documents(store, cfg, lengths: list[int]) -> list[tuple[int, int, int]]:
    """Prepare `cfg` for real; per document (of the given token lengths, in order) its token count,
    trained and masked counts as they are in the shards."""
    manifest = prepare_dataset(cfg, store)
    labels = []
    for uri in shard_uris(cfg.data.uri, manifest, "train"):
        fs, path = store.resolve(uri)
        labels += np.ravel(pq.read_table(path, filesystem=fs)["labels"].to_pylist()).tolist()
    out, start = [], 0
    for n in lengths:
        trained = sum(label != IGNORE_INDEX for label in labels[start:start + n])
        out.append((n, trained, n - trained))
        start += n
    return out


def test_prepare_preview_shows_records_as_prepare_tokenizes_them_and_writes_nothing(chat_model, tmp_path):
    store, tok = chat_model
    lines = [json.dumps({"messages": m}) for m in PREVIEWED]
    store.write_text("s3://eft/raw/preview/part-0.jsonl", "\n".join(lines) + "\n")
    cfg = make_config("s3://eft/data/preview", "s3://eft/raw/preview/part-0.jsonl", MODEL_URI)
    cfg_path = tmp_path / "preview.yaml"
    cfg_path.write_text(dump_config(cfg))

    shown = eft("prepare", str(cfg_path), "--preview", "3")
    assert shown.returncode == 0, shown.stderr[-2000:]
    out = shown.stdout
    used = [PREVIEWED[0], PREVIEWED[2]]
    for messages in used:  # the text as the model sees it, whole and unwrapped
        assert tok.apply_chat_template(messages, tokenize=False).rstrip("\n") in out
    assert "Beyond N." not in out and "Never previewed?" not in out
    assert "part-0.jsonl:2" in out and "skipped: no assistant turn" in out
    assert "part-0.jsonl:1" in out and "part-0.jsonl:3" in out
    assert store.list_files(cfg.data.uri) == []
    assert "Ray" not in shown.stderr

    # The counts are those of the documents prepare writes for the same records.
    store.write_text("s3://eft/raw/preview-head/part-0.jsonl", "\n".join(lines[:3]) + "\n")
    expected = prepared_documents(store, make_config("s3://eft/data/preview-head", "s3://eft/raw/preview-head/",
                                                     MODEL_URI), [len(library_ids(tok, m)) for m in used])
    assert [tuple(map(int, c)) for c in COUNTS.findall(out)] == expected
    assert all(trained and masked for _, trained, masked in expected)


def test_prepare_preview_fails_like_prepare_on_a_bad_config(chat_model, tmp_path):
    cfg = make_config("s3://eft/data/preview-none", "s3://eft/raw/preview/part-0.jsonl", MODEL_URI + "-plain")
    cfg_path = tmp_path / "preview.yaml"
    cfg_path.write_text(dump_config(cfg))
    failed = eft("prepare", str(cfg_path), "--preview", "2")
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.strip().splitlines() == [
        "eft: error: tokenizer at s3://eft/models/tiny-chat-plain has no chat template: set prepare.chat_template "
        "to a Jinja file for format 'chat'"]


def test_preview_of_text_instruction_and_sharegpt_records_matches_prepare(chat_model):
    """The library side of --preview (no subprocess): every format, JSONL and Parquet, overlong."""
    import pyarrow as pa

    from app.data.preview import decode_runs, preview_records

    store, tok = chat_model
    store.write_text("s3://eft/raw/preview-text/a.jsonl",
                     "\n".join(json.dumps({"text": t}) for t in ["A first document.", "", "A second one."]) + "\n")
    text_cfg = make_config("s3://eft/data/preview-text", "s3://eft/raw/preview-text/a.jsonl", MODEL_URI, format="text")
    _, records = preview_records(text_cfg, 5, store)
    assert [(r.line, r.reason) for r in records] == [(1, None), (2, "empty text"), (3, None)]
    # bos and eos as prepare adds them (bos trained here: the text format has no prompt).
    assert decode_runs(tok, records[0].input_ids, records[0].labels) == [("<s>A first document.</s>", True)]
    used = [records[0], records[2]]
    expected = prepared_documents(store, text_cfg, [len(r.input_ids) for r in used])
    assert [(len(r.labels), r.trained, r.masked) for r in used] == expected

    rows = pa.table({"instruction": ["Say hi.", "Say bye.", ""], "response": ["Hi!", "Bye!", "x"]})
    fs, path = store.resolve("s3://eft/raw/preview-instr/a.parquet")
    with fs.open_output_stream(path) as f:
        pq.write_table(rows, f)
    instr_cfg = make_config("s3://eft/data/preview-instr", "s3://eft/raw/preview-instr/a.parquet", MODEL_URI,
                            format="instruction", input_format="parquet")
    _, records = preview_records(instr_cfg, 3, store)
    assert [(r.line, r.reason) for r in records] == [(1, None), (2, None), (3, "empty instruction")]
    expected = prepared_documents(store, instr_cfg, [len(r.input_ids) for r in records[:2]])
    assert [(len(r.labels), r.trained, r.masked) for r in records[:2]] == expected
    assert all(r.masked for r in records[:2])

    share = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                for m in conv]} for conv in (PREVIEWED[0], [{"role": "user", "content": "w " * 400},
                                                                             {"role": "assistant", "content": "ok"}])]
    store.write_text("s3://eft/raw/preview-share/a.jsonl", "\n".join(map(json.dumps, share)) + "\n")
    share_cfg = make_config("s3://eft/data/preview-share", "s3://eft/raw/preview-share/a.jsonl", MODEL_URI,
                            format="sharegpt", seq_len=128)
    _, records = preview_records(share_cfg, 2, store)
    assert records[0].input_ids == library_ids(tok, PREVIEWED[0])
    assert records[1].overlong == "dropped" and records[1].input_ids == [] and len(records[1].full_ids) > 128
    assert store.list_files("s3://eft/data/preview-share") == []
