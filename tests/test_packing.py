"""Unit tests for record parsing and packing: pure functions, no Ray, no storage."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.data.formats import Document, Skip, build_document, parse_jsonl_block, parse_jsonl_line
from one_document import build_example, tokenize_document

from app.data.packing import (
    IGNORE_INDEX, Packer, build_examples_flat, flatten_token_lists, pack_examples, source_key, tokenize_documents,
    validation_mask,
)

BOS, EOS, PAD = 0, 1, 2


@pytest.fixture(scope="module")
def tokenizer():
    from app.dev.tiny import build_corpus, build_tiny_tokenizer

    return build_tiny_tokenizer(build_corpus(max_docs=100), vocab_size=300)


# -- formats ----------------------------------------------------------------------------

@pytest.mark.parametrize("line, reason", [
    ('{"text": "hello"', "bad JSON"),
    ("not json at all", "bad JSON"),
    (b'{"text": "\xff\xfe"}', "not UTF-8"),
    ('["a", "b"]', "not an object"),
    ('"just a string"', "not an object"),
    ('{"body": "hello"}', "missing field 'text'"),
    ('{"text": null}', "missing field 'text'"),
    ('{"text": 42}', "field 'text' is not a string"),
    ('{"text": ""}', "empty text"),
    ('{"text": "  \\n\\t "}', "empty text"),
])
def test_bad_text_records_give_their_reason(line, reason):
    assert parse_jsonl_line(line) == Skip(reason)


def test_text_record_becomes_document_with_custom_field():
    assert parse_jsonl_line(b'{"body": "some words", "text": 1}', text_field="body") == Document("some words")


@pytest.mark.parametrize("record, expected", [
    ({"instruction": "Add 2+2.", "response": "4"}, Document("4", "Add 2+2.")),
    ({"instruction": "Add 2+2."}, Skip("missing field 'response'")),
    ({"response": "4"}, Skip("missing field 'instruction'")),
    ({"instruction": " ", "response": "4"}, Skip("empty instruction")),
    ({"instruction": "Add 2+2.", "response": ""}, Skip("empty response")),
    ([1, 2], Skip("not an object")),
])
def test_instruction_records(record, expected):
    assert build_document(record, "instruction") == expected


def test_instruction_record_with_custom_fields():
    line = json.dumps({"q": "Why?", "a": "Because."})
    assert parse_jsonl_line(line, "instruction", prompt_field="q", response_field="a") == Document("Because.", "Why?")


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="unknown record format"):
        build_document({"text": "x"}, "markdown")
    with pytest.raises(ValueError, match="needs a ChatFormat"):  # conversations: tests/test_chat.py
        build_document({"messages": []}, "chat")


# Lines Arrow's JSON reader decodes as json.loads does (with the document or skip each gives) ...
ARROW_READABLE = [
    b'{"text": "plain"}', b'{"text": null}', b'{"body": 1}', b'{"text": ""}', b'{"text": " \\u00a0\\u2003 "}',
    b'{"text": "\\u00e9\\ud83d\\ude00 and </s>"}', b'{"text": "2024-01-01"}', b'{"text": "crlf"}\r',
    b'\xef\xbb\xbf{"text": "a byte-order mark"}', b'{"text": "x", "meta": {"deep": [[1, {"a": null}]], "n": 1.5}}',
    b'{"instruction": "Why?", "response": "Because."}', b'{"instruction": "", "response": "r"}',
    b'{"instruction": "q", "response": null}', b'{"response": "r"}',
]
# ... and lines it cannot, each of which must send its whole block back to json.loads.
ARROW_UNREADABLE = [
    b'{"text": "unterminated', b'{"text": 42}', b'{"text": {"a": 1}}', b'["a", "b"]', b'"just a string"',
    b'{"text": "x", "text": "y"}', b'{"text": "\xff\xfe"}', b'{"text": "a lone \\ud800 surrogate"}',
    b'{"text": NaN}', b'{"text": "a",}',
]


@pytest.mark.parametrize("fmt", ["text", "instruction"])
def test_arrow_parses_a_block_exactly_as_json_loads_or_declines_it(fmt):
    def line_by_line(lines):
        return [parse_jsonl_line(line, fmt) for line in lines]

    readable = ARROW_READABLE[:8] + ARROW_READABLE[9:]  # a byte-order mark is only allowed first
    assert parse_jsonl_block(ARROW_READABLE[8:9] + readable, fmt) == line_by_line(ARROW_READABLE[8:9] + readable)
    for bad in ARROW_UNREADABLE:
        if fmt == "instruction":
            bad = bad.replace(b'"text"', b'"response"')
        assert parse_jsonl_block([readable[0], bad, readable[1]], fmt) is None, bad
    skips = {str(p) for p in line_by_line(readable) if isinstance(p, Skip)}
    assert len(skips) >= 2  # the readable lines do exercise the skip reasons


# -- examples ---------------------------------------------------------------------------

def test_text_example_wraps_tokens_in_bos_and_eos_with_labels_equal():
    ids, labels = build_example([10, 11, 12], eos_id=EOS, bos_id=BOS)
    assert ids.tolist() == [BOS, 10, 11, 12, EOS]
    assert labels.tolist() == ids.tolist()
    assert ids.dtype == np.int32 and labels.dtype == np.int32


def test_text_example_without_bos():
    ids, labels = build_example([10, 11], eos_id=EOS, bos_id=None)
    assert ids.tolist() == [10, 11, EOS]
    assert labels.tolist() == [10, 11, EOS]


def test_instruction_example_masks_bos_and_prompt():
    ids, labels = build_example([20, 21], eos_id=EOS, bos_id=BOS, prompt_ids=[30, 31, 32])
    assert ids.tolist() == [BOS, 30, 31, 32, 20, 21, EOS]
    assert labels.tolist() == [IGNORE_INDEX] * 4 + [20, 21, EOS]


def test_flat_batch_matches_one_by_one():
    bodies = [[5, 6, 7], [8], [9, 10, 11, 12]]
    prompts = [[40], [], [41, 42]]
    body, body_len = flatten_token_lists(bodies)
    prompt, prompt_len = flatten_token_lists(prompts)
    ids, labels, lengths = build_examples_flat(body, body_len, EOS, BOS, prompt, prompt_len)
    singles = [build_example(b, EOS, BOS, p if p else None) for b, p in zip(bodies, prompts)]
    assert lengths.tolist() == [len(s[0]) for s in singles]
    assert ids.tolist() == [t for s in singles for t in s[0].tolist()]
    assert labels.tolist() == [t for s in singles for t in s[1].tolist()]


def test_empty_batch_gives_empty_arrays():
    body, body_len = flatten_token_lists([])
    ids, labels, lengths = build_examples_flat(body, body_len, EOS, BOS)
    assert len(ids) == len(labels) == len(lengths) == 0


def test_tokenize_document_uses_the_tokenizer_specials(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids, labels = tokenize_document(tokenizer, Document(text))
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == [tokenizer.bos_token_id, *body, tokenizer.eos_token_id]
    assert labels.tolist() == ids.tolist()
    assert tokenizer.decode(ids[1:-1]) == text


def test_special_token_text_in_data_is_not_a_special_token(tokenizer):
    ids, _ = tokenize_document(tokenizer, Document(f"one {tokenizer.eos_token} two"))
    assert ids.tolist().count(tokenizer.eos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id


def test_byte_order_mark_is_tolerated():
    assert parse_jsonl_line('\ufeff{"text": "hi"}'.encode()) == Document("hi")


def test_tokenize_instruction_labels_only_the_response(tokenizer):
    doc = Document("It returns None.", "What does print return?")
    ids, labels = tokenize_document(tokenizer, doc)
    n_prompt = len(tokenizer(doc.prompt, add_special_tokens=False)["input_ids"])
    assert (labels[: 1 + n_prompt] == IGNORE_INDEX).all()
    assert tokenizer.decode(labels[1 + n_prompt:-1]) == doc.text
    assert labels[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[1:1 + n_prompt]) == doc.prompt


def test_tokenize_documents_mixes_formats_in_order(tokenizer):
    docs = [Document("alpha beta"), Document("gamma", "delta?"), Document("epsilon")]
    ids, labels, lengths = tokenize_documents(tokenizer, docs)
    offset = 0
    for doc, n in zip(docs, lengths):
        one_ids, one_labels = tokenize_document(tokenizer, doc)
        assert ids[offset:offset + n].tolist() == one_ids.tolist()
        assert labels[offset:offset + n].tolist() == one_labels.tolist()
        offset += n
    assert offset == len(ids)


# -- packing ----------------------------------------------------------------------------

def doc(*tokens):
    return build_example(list(tokens), eos_id=EOS, bos_id=BOS)


def test_packing_puts_eos_between_documents_and_pads_last_row():
    ids, labels, _ = pack_examples([doc(10, 11), doc(12)], seq_len=4, pad_id=PAD)
    assert ids.tolist() == [[BOS, 10, 11, EOS], [BOS, 12, EOS, PAD]]
    assert labels.tolist() == [[BOS, 10, 11, EOS], [BOS, 12, EOS, IGNORE_INDEX]]


def test_long_document_is_split_across_rows_not_dropped():
    long_doc = doc(*range(10, 23))  # 15 tokens with bos/eos
    ids, labels, _ = pack_examples([doc(5), long_doc, doc(6)], seq_len=4, pad_id=PAD)
    flat = ids.ravel().tolist()
    assert ids.shape == (6, 4)
    assert flat[:21] == [BOS, 5, EOS, *long_doc[0].tolist(), BOS, 6, EOS]
    assert flat[21:] == [PAD] * 3
    assert labels.ravel().tolist()[21:] == [IGNORE_INDEX] * 3


def test_exact_fit_has_no_padding_row():
    ids, labels, _ = pack_examples([doc(10, 11), doc(12, 13)], seq_len=4, pad_id=PAD)
    assert ids.shape == (2, 4)
    assert PAD not in ids.ravel().tolist()
    assert IGNORE_INDEX not in labels.ravel().tolist()


def test_instruction_masks_survive_packing():
    example = build_example([20, 21], eos_id=EOS, bos_id=BOS, prompt_ids=[30, 31])
    ids, labels, _ = pack_examples([example, example], seq_len=5, pad_id=PAD)
    assert labels.ravel().tolist()[:6] == [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 20, 21, EOS]
    assert labels.ravel().tolist()[-3:] == [IGNORE_INDEX] * 3
    assert ids.ravel().tolist()[-3:] == [PAD] * 3


def test_packer_streams_the_same_rows_as_one_shot():
    rng = np.random.default_rng(0)
    examples = [doc(*rng.integers(3, 500, size=rng.integers(1, 40)).tolist()) for _ in range(200)]
    expected_ids, expected_labels, expected_positions = pack_examples(examples, seq_len=16, pad_id=PAD)
    packer, got_ids, got_labels, got_positions = Packer(16, PAD), [], [], []
    for start in range(0, len(examples), 7):  # several documents per add, as the driver does
        chunk = examples[start:start + 7]
        packer.add(np.concatenate([e[0] for e in chunk]), np.concatenate([e[1] for e in chunk]),
                   [len(e[0]) for e in chunk])
        rows = packer.pop_rows()
        got_ids.append(rows[0])
        got_labels.append(rows[1])
        got_positions.append(rows.position_ids)
        assert packer.pending_tokens < 16
    final = packer.finish()
    np.testing.assert_array_equal(np.concatenate([*got_ids, final[0]]), expected_ids)
    np.testing.assert_array_equal(np.concatenate([*got_labels, final[1]]), expected_labels)
    np.testing.assert_array_equal(np.concatenate([*got_positions, final.position_ids]), expected_positions)
    assert packer.pending_tokens == 0
    assert sum(len(e[0]) for e in examples) <= expected_ids.size < sum(len(e[0]) for e in examples) + 16


def test_packer_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        Packer(4, PAD).add(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="sum to 3"):
        Packer(4, PAD).add(np.array([1, 2]), np.array([1, 2]), [1, 2])


def test_position_ids_restart_at_documents_rows_and_padding():
    """0, 1, ... from every document start; a document continued into the next row counts from 0
    there; the padding is a segment of its own. A length-1 document is a segment too."""
    ids, _, positions = pack_examples([doc(10, 11), doc(*range(20, 27)), build_example([], eos_id=EOS),
                                       doc(30)], seq_len=6, pad_id=PAD)
    assert ids.tolist() == [[BOS, 10, 11, EOS, BOS, 20], [21, 22, 23, 24, 25, 26],
                            [EOS, EOS, BOS, 30, EOS, PAD]]
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 0]]
    assert positions.dtype == np.int32


def test_position_ids_mark_every_document_start_for_transformers():
    """transformers' packed-sequence detection (a step other than +1 starts a segment) finds exactly
    the documents (and the padding), row by row."""
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    rng = np.random.default_rng(1)
    examples = [doc(*rng.integers(3, 500, size=rng.integers(0, 12)).tolist()) for _ in range(40)]
    ids, _, positions = pack_examples(examples, seq_len=16, pad_id=PAD)
    segments = find_packed_sequence_indices(torch.as_tensor(positions, dtype=torch.long)).numpy()
    # Every document starts with BOS here (pad only at the end): a segment starts exactly there.
    starts = (ids == BOS) | ((ids == PAD) & (np.roll(ids, 1, axis=1) != PAD))
    starts[:, 0] = True
    np.testing.assert_array_equal(segments, np.cumsum(starts, axis=1) - 1)


def add_docs(packer: Packer, docs: list) -> None:
    packer.add(np.concatenate([d[0] for d in docs]), np.concatenate([d[1] for d in docs]), [len(d[0]) for d in docs])


def test_without_packing_every_document_and_pair_starts_a_row_of_its_own():
    """packing off: a document per row, the rest padding (a segment of its own); a long document
    still runs on over rows; a pair (two documents) shares one row; streaming in chunks gives the
    rows of one shot."""
    packer = Packer(4, PAD, packing=False)
    add_docs(packer, [doc(10), doc(*range(20, 25)), doc(12, 13)])
    ids, labels, positions = packer.finish()
    assert ids.tolist() == [[BOS, 10, EOS, PAD], [BOS, 20, 21, 22], [23, 24, EOS, PAD], [BOS, 12, 13, EOS]]
    assert labels.tolist() == [[BOS, 10, EOS, IGNORE_INDEX], [BOS, 20, 21, 22], [23, 24, EOS, IGNORE_INDEX],
                               [BOS, 12, 13, EOS]]
    assert positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]

    pairs = Packer(8, PAD, packing=False)
    chosen, rejected = doc(30), doc(31, 32)
    pairs.add_units(*map(np.concatenate, zip(chosen, rejected, chosen, rejected)), [3, 4, 3, 4], docs_per_unit=2)
    rows = pairs.finish()
    assert rows.input_ids.tolist() == [[BOS, 30, EOS, BOS, 31, 32, EOS, PAD]] * 2
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]] * 2

    rng = np.random.default_rng(2)
    examples = [doc(*rng.integers(3, 500, size=rng.integers(0, 30)).tolist()) for _ in range(60)]
    whole = Packer(16, PAD, packing=False)
    add_docs(whole, examples)
    expected = whole.finish()
    streamed, parts = Packer(16, PAD, packing=False), []
    for start in range(0, len(examples), 7):
        add_docs(streamed, examples[start:start + 7])
        parts.append(streamed.pop_rows())
    parts.append(streamed.finish())
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), expected[k])
    # Every row starts a document (BOS) or continues one that did not fit the row before.
    continued = np.concatenate([[False], (expected.labels[:-1, -1] != IGNORE_INDEX)])
    assert ((expected.input_ids[:, 0] == BOS) | continued).all()
    assert expected.input_ids.shape[0] == sum(-(-len(e[0]) // 16) for e in examples)


def test_nothing_in_gives_no_rows():
    ids, labels, _ = pack_examples([], seq_len=8, pad_id=PAD)
    assert ids.shape == labels.shape == (0, 8)


# -- validation split -------------------------------------------------------------------

def test_validation_mask_is_stable_and_close_to_the_fraction():
    keys = np.full(20_000, source_key("part-0.jsonl"), dtype=np.uint64)
    lines = np.arange(1, 20_001)
    mask = validation_mask(keys, lines, 0.1)
    assert 0.09 < mask.mean() < 0.11
    np.testing.assert_array_equal(mask, validation_mask(keys, lines, 0.1))
    other = validation_mask(np.full(20_000, source_key("part-1.jsonl"), dtype=np.uint64), lines, 0.1)
    assert (mask != other).any()
    assert not validation_mask(keys, lines, 0.0).any()
    assert source_key("a.jsonl") == source_key("a.jsonl") != source_key("b.jsonl")
