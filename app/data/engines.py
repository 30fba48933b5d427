"""Read, parse and tokenize the raw input for `prepare`: two engines, the same functions, the same output.

- "ray": Ray Data reads and parses the files in tasks, which cut them into blocks of a few
  tokenizer batches, and an actor pool tokenizes them (the tokenizer loaded once per actor).
  It scales past one machine but costs seconds of start-up and some per-block overhead.
- "local": the driver parses the files itself and a thread per core tokenizes the blocks (the
  Rust tokenizer releases the GIL). No start-up cost: the right choice for anything one
  machine tokenizes in minutes, which `prepare.engine: auto` takes to mean local_max_input_mb.

Both yield tokenized documents (TOKENIZED_SCHEMA) in input order; what happens to them next
(splits, packing, shards, the commit) is the prepare job's (app/data/prepare.py).
"""

from __future__ import annotations

import collections
from collections import Counter
import contextlib
import logging
import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app.batch import IGNORE_INDEX
from app.config import JobConfig
from app.data.chat import ChatFormat, span_token_mask, tokens_before
from app.data.formats import Document, Parsed, Skip, build_document, parse_json_line, parse_jsonl_block
from app.data.packing import encode_documents, encode_texts
from app.storage import Store, StorageError

log = logging.getLogger(__name__)

INPUT_EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}

# Ray Data small-cluster footprint: fractional CPUs let the tokenizer actors run beside other work
# on a laptop-sized cluster. Read + parse tasks keep the default 1 CPU (and Ray Data's default
# concurrency): Ray Data fuses read, parse and the re-blocking into one task only when their CPU
# requests and concurrency match, and parsing is cheap next to tokenizing.
TOKENIZER_NUM_CPUS = 0.25
# Tokenizer batches per block. One block is one actor call and one driver step, so blocks must be
# small enough that every actor gets work from a single file and the first tokenized block reaches
# the driver (which packs while the actors go on) early, and large enough to keep the per-block
# overhead of Ray Data and the driver small.
BATCHES_PER_BLOCK = 4
# Ray Data's own default number of read tasks; past it, a read task takes several files.
MAX_READ_TASKS = 200

DOCUMENT_SCHEMA = pa.schema([
    ("source", pa.string()), ("line", pa.int64()), ("text", pa.string()),
    ("prompt", pa.string()), ("reason", pa.string()),
    # Chat formats only (null otherwise): flat (start, end) character pairs to train, and where
    # each assistant turn ends (see app/data/chat.py).
    ("spans", pa.list_(pa.int64())), ("turn_ends", pa.list_(pa.int64())),
    # Preference pairs only (null otherwise): the rejected document; the columns above hold the chosen.
    ("rejected_text", pa.string()), ("rejected_prompt", pa.string()), ("rejected_spans", pa.list_(pa.int64())),
])
TOKENIZED_SCHEMA = pa.schema([
    ("source", pa.string()), ("line", pa.int64()), ("reason", pa.string()),
    ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    # What happened to a document longer than seq_len: "split", "truncated" or "dropped" (no tokens).
    ("overlong", pa.string()),
    # Preference pairs: input_ids holds the chosen document then the rejected one; this many tokens
    # are the chosen's. Null for other formats.
    ("chosen_tokens", pa.int64()),
])
OVERLONG_OUTCOMES = ("split", "truncated", "dropped")
# A skip that is the data's shape, not damage: a long tail of long pairs is normal, so these do
# not count against prepare.max_bad_records (as over-long documents dropped by `overlong: drop`).
PAIR_TOO_LONG = "pair longer than seq_len"


class PrepareError(RuntimeError):
    """A prepare problem, reported as one line naming the URI or record at fault."""


# -- listing inputs ---------------------------------------------------------------------

class InputFiles(NamedTuple):
    fs: pafs.FileSystem
    base: str  # source names in the manifest and in bad-record reports are relative to it
    paths: list[str]  # sorted: the order documents are packed in
    total_bytes: int


def list_input_files(store: Store, input_uri: str, input_format: str) -> InputFiles:
    """A file URI is used as is; a prefix is searched recursively for files with the format's
    extensions."""
    fs, path = store.resolve(input_uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return InputFiles(fs, posixpath.dirname(path), [path], info.size or 0)
    found: list[pafs.FileInfo] = []
    if info.type == pafs.FileType.Directory:
        selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
        found = sorted((i for i in fs.get_file_info(selector)
                        if i.type == pafs.FileType.File and i.path.endswith(INPUT_EXTENSIONS[input_format])),
                       key=lambda i: i.path)
    if not found:
        exts = "/".join(INPUT_EXTENSIONS[input_format])
        raise PrepareError(f"no {input_format} input files ({exts}) at {input_uri}")
    return InputFiles(fs, path, [i.path for i in found], sum(i.size or 0 for i in found))


def relative_source(path: str, base: str) -> str:
    prefix = base.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else posixpath.basename(path)


def number_parquet_rows(sources: list[str], counters: Counter) -> np.ndarray:
    """1-based row numbers within each source file, continuing across batches."""
    lines = np.empty(len(sources), dtype=np.int64)
    for i, source in enumerate(sources):
        counters[source] += 1
        lines[i] = counters[source]
    return lines


def encode_sources(column: pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """A batch's source column → (distinct names, per-row index into them); a batch holds few files."""
    encoded = column.combine_chunks().dictionary_encode()
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False)


# -- parse and tokenize (both engines: in Ray tasks and actors, or in this process) ---------

def build_document_table(sources: list[str], lines: list[int], parsed: list[Parsed]) -> pa.Table:
    """Per-row source, line and Document or Skip → a DOCUMENT_SCHEMA table."""
    rejected = [p.rejected if isinstance(p, Document) else None for p in parsed]
    return pa.table({
        "source": sources, "line": lines,
        "text": [p.text if isinstance(p, Document) else None for p in parsed],
        "prompt": [p.prompt if isinstance(p, Document) else None for p in parsed],
        "reason": [p.reason if isinstance(p, Skip) else None for p in parsed],
        "spans": [list(p.spans) if isinstance(p, Document) and p.spans is not None else None for p in parsed],
        "turn_ends": [list(p.turn_ends) if isinstance(p, Document) and p.turn_ends is not None else None
                      for p in parsed],
        "rejected_text": [r.text if r is not None else None for r in rejected],
        "rejected_prompt": [r.prompt if r is not None else None for r in rejected],
        "rejected_spans": [list(r.spans) if r is not None and r.spans is not None else None for r in rejected],
    }, schema=DOCUMENT_SCHEMA)


def parse_jsonl_files(batch: dict, base: str, fields: dict, rows_per_block: int) -> Iterator[pa.Table]:
    """Whole JSONL files → one row per non-blank line, numbered from 1 (blank lines are not records).
    Yields `rows_per_block` rows at a time, so the first blocks go to the tokenizers while the rest of a
    big file is still being parsed. A block goes through Arrow's JSON reader when it can (see
    parse_jsonl_block), else json.loads line by line: the same documents and skips either way."""
    for data, path in zip(batch["bytes"], batch["path"]):
        source = relative_source(path, base)
        numbered = [(number, line) for number, line in enumerate(data.split(b"\n"), start=1) if line.strip()]
        for start in range(0, len(numbered), rows_per_block):
            block = numbered[start:start + rows_per_block]
            lines = [line for _, line in block]
            parsed = parse_jsonl_block(lines, **fields)
            if parsed is None:
                parsed = [build_document(parse_json_line(line), **fields) for line in lines]
            yield build_document_table([source] * len(block), [number for number, _ in block], parsed)


def parse_parquet_rows(batch: pa.Table, base: str, fields: dict) -> pa.Table:
    """Parquet rows → documents. Row numbers are not known inside a block, so `line` is 0 here
    and the driver numbers rows per file (blocks arrive in order)."""
    records = batch.drop_columns(["path"]).to_pylist()
    sources = [relative_source(p, base) for p in batch["path"].to_pylist()]
    return build_document_table(sources, [0] * len(sources), [build_document(r, **fields) for r in records])


def build_list_array(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))


class TokenizerSpec(NamedTuple):
    """What a tokenizer actor needs: the Rust backend as JSON when it can stand in for the
    transformers tokenizer (see export_backend), else where to load that tokenizer from."""
    uri: str
    endpoint: Optional[str]
    region: str
    eos_token_id: int
    bos_token_id: Optional[int]
    backend_json: Optional[str]


class TokenizeDocuments:
    """Ray Data actor: loads the tokenizer once, then turns document batches into token lists.

    Documents longer than `seq_len` are handled by `overlong`: "split" keeps them whole (the packer
    continues them in the next row), "drop" leaves them out, "truncate" keeps a prefix: whole leading
    turns through the last assistant turn that fits for a conversation, the first seq_len tokens
    otherwise (dropped when nothing trained is left)."""

    def __init__(self, spec: TokenizerSpec, seq_len: Optional[int] = None, overlong: str = "split"):
        if overlong not in ("split", "drop", "truncate"):
            raise ValueError(f"overlong must be split, drop or truncate, got {overlong!r}")
        self.spec, self.seq_len, self.overlong = spec, seq_len, overlong
        if spec.backend_json is not None:
            self.encode = partial(encode_with_backend, load_backend(spec.backend_json))
            self._chat_backend = None  # loaded on the first conversation
        else:
            tokenizer = load_tokenizer(Store(spec.endpoint, spec.region), spec.uri)
            self.encode = partial(encode_texts, tokenizer)
            self.encode_chat = partial(encode_chat_texts, tokenizer)

    def encode_chat(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:  # replaced per instance above
        if self._chat_backend is None:
            self._chat_backend = load_backend(self.spec.backend_json, special_tokens_as_text=False)
        return encode_chat_with_backend(self._chat_backend, texts)

    def __call__(self, batch: pa.Table) -> pa.Table:
        if "rejected_text" in batch.column_names and pc.any(pc.is_valid(batch["rejected_text"])).as_py():
            return self.tokenize_pairs(batch)
        return self.tokenize(batch, self.seq_len, self.overlong)

    def tokenize(self, batch: pa.Table, seq_len: Optional[int], overlong_mode: str) -> pa.Table:
        n = batch.num_rows
        ok = pc.is_null(batch["reason"]).to_numpy(zero_copy_only=False)
        is_chat = np.zeros(n, dtype=bool)
        if "spans" in batch.column_names:  # tables from before the chat formats have no spans column
            is_chat = ok & pc.is_valid(batch["spans"]).to_numpy(zero_copy_only=False)
        plain, chat = np.flatnonzero(ok & ~is_chat), np.flatnonzero(is_chat)
        texts = batch["text"].take(pa.array(plain)).to_pylist()
        prompts = batch["prompt"].take(pa.array(plain)).to_pylist()
        ids, labels, doc_lengths = encode_documents(self.encode, [Document(t, p) for t, p in zip(texts, prompts)],
                                                    self.spec.eos_token_id, self.spec.bos_token_id)
        lengths = np.zeros(n, dtype=np.int64)
        lengths[plain] = doc_lengths
        overlong = np.full(n, None, dtype=object)
        long_plain = plain[doc_lengths > seq_len] if seq_len else plain[:0]
        if not len(chat) and (overlong_mode == "split" or not len(long_plain)):
            # The plain-text fast path: whole batches of documents as flat arrays.
            overlong[long_plain] = "split"
        else:
            ids, labels, lengths = self.per_document(batch, plain, chat, ids, labels, lengths, overlong, seq_len,
                                                     overlong_mode)
        return pa.table({
            "source": batch["source"], "line": batch["line"], "reason": batch["reason"],
            "input_ids": build_list_array(ids, lengths), "labels": build_list_array(labels, lengths),
            "overlong": pa.array(overlong.tolist(), pa.string()), "chosen_tokens": pa.nulls(n, pa.int64()),
        }, schema=TOKENIZED_SCHEMA)

    def tokenize_pairs(self, batch: pa.Table) -> pa.Table:
        """Preference pairs: each half tokenized as a document of its own (uncut), then the pair as
        one row of the table, chosen first. A pair longer than seq_len is a skip (its two documents
        must share a packed row), which BadRecords counts but not against the limit."""
        chosen = self.tokenize(batch, None, "split")
        rejected_view = batch.select(["source", "line", "reason"]).append_column(
            "text", batch["rejected_text"]).append_column("prompt", batch["rejected_prompt"]).append_column(
            "spans", batch["rejected_spans"]).append_column(
            "turn_ends", pa.nulls(batch.num_rows, pa.list_(pa.int64())))  # only truncation reads turn ends
        rejected = self.tokenize(rejected_view, None, "split")
        reasons = batch["reason"].to_pylist()
        ids, labels, lengths, chosen_tokens = [], [], np.zeros(batch.num_rows, dtype=np.int64), []
        columns = [t[c].to_pylist() for t in (chosen, rejected) for c in ("input_ids", "labels")]
        for i, (c_ids, c_labels, r_ids, r_labels) in enumerate(zip(*columns)):
            total = len(c_ids) + len(r_ids)
            if reasons[i] is None and self.seq_len and total > self.seq_len:
                reasons[i] = PAIR_TOO_LONG
            if reasons[i] is not None:
                chosen_tokens.append(None)
                continue
            ids += [c_ids, r_ids]
            labels += [c_labels, r_labels]
            lengths[i] = total
            chosen_tokens.append(len(c_ids))
        flat_ids = np.fromiter((t for part in ids for t in part), dtype=np.int32, count=int(lengths.sum()))
        flat_labels = np.fromiter((t for part in labels for t in part), dtype=np.int32, count=int(lengths.sum()))
        return pa.table({
            "source": batch["source"], "line": batch["line"], "reason": pa.array(reasons, pa.string()),
            "input_ids": build_list_array(flat_ids, lengths), "labels": build_list_array(flat_labels, lengths),
            "overlong": pa.nulls(batch.num_rows, pa.string()), "chosen_tokens": pa.array(chosen_tokens, pa.int64()),
        }, schema=TOKENIZED_SCHEMA)

    def per_document(self, batch: pa.Table, plain: np.ndarray, chat: np.ndarray, ids: np.ndarray,
                     labels: np.ndarray, lengths: np.ndarray, overlong: np.ndarray, seq_len: Optional[int],
                     overlong_mode: str):
        """Conversations and over-long documents one by one → flat (ids, labels, lengths) in row order."""
        docs: dict[int, tuple[np.ndarray, np.ndarray, Optional[list[int]]]] = {}
        bounds = np.cumsum(lengths[plain])
        for row, doc_ids, doc_labels in zip(plain, np.split(ids, bounds[:-1]), np.split(labels, bounds[:-1])):
            docs[row] = (doc_ids, doc_labels, None)
        if len(chat):
            take = pa.array(chat)
            texts = batch["text"].take(take).to_pylist()
            spans = batch["spans"].take(take).to_pylist()
            turn_ends = batch["turn_ends"].take(take).to_pylist()
            for row, (doc_ids, offsets), doc_spans, ends in zip(chat, self.encode_chat(texts), spans, turn_ends):
                pairs = np.asarray(doc_spans, dtype=np.int64).reshape(-1, 2)
                doc_labels = np.where(span_token_mask(offsets, pairs), doc_ids, IGNORE_INDEX).astype(np.int32)
                cuts = [tokens_before(offsets, end) for end in ends or ()]
                docs[row] = (doc_ids, doc_labels, cuts)
        out_ids, out_labels = [], []
        lengths = np.zeros(len(lengths), dtype=np.int64)
        for row in sorted(docs):
            doc_ids, doc_labels, cuts = docs[row]
            if seq_len and len(doc_ids) > seq_len:
                doc_ids, doc_labels, overlong[row] = self.fit(doc_ids, doc_labels, cuts, seq_len, overlong_mode)
            out_ids.append(doc_ids)
            out_labels.append(doc_labels)
            lengths[row] = len(doc_ids)
        empty = np.zeros(0, dtype=np.int32)
        return (np.concatenate(out_ids) if out_ids else empty, np.concatenate(out_labels) if out_labels else empty,
                lengths)

    def fit(self, ids: np.ndarray, labels: np.ndarray, cuts: Optional[list[int]], seq_len: int, overlong_mode: str):
        """One over-long document → (ids, labels, outcome) under `overlong_mode`."""
        if overlong_mode == "split":
            return ids, labels, "split"
        if overlong_mode == "truncate":
            fitting = [c for c in cuts if c <= seq_len] if cuts is not None else [seq_len]
            cut = max(fitting, default=0)
            if cut and np.any(labels[:cut] != IGNORE_INDEX):
                return ids[:cut], labels[:cut], "truncated"
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty.copy(), "dropped"


def load_tokenizer(store: Store, tokenizer_uri: str):
    """The tokenizer at `tokenizer_uri` (prepare.tokenizer_uri, else model.uri); a URI without one
    is one line naming it, not the first line of transformers' several-line guess at why."""
    from transformers import AutoTokenizer

    hint = "set prepare.tokenizer_uri to a dir with tokenizer.json or tokenizer_config.json"
    try:
        local_dir = store.cache_locally(tokenizer_uri)
    except StorageError:
        raise PrepareError(f"tokenizer URI {tokenizer_uri}: nothing there ({hint})") from None
    try:
        return AutoTokenizer.from_pretrained(str(local_dir))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise PrepareError(f"tokenizer URI {tokenizer_uri}: no tokenizer there ({type(err).__name__}; {hint})") from None


# What transformers runs between `tokenizer(texts, ...)` and the Rust tokenizer, in 4.x and 5.x.
ENCODE_PATH = ("__call__", "_call_one", "encode_plus", "_encode_plus", "batch_encode_plus", "_batch_encode_plus")


def export_backend(tokenizer) -> Optional[str]:
    """The Rust tokenizer inside a transformers fast tokenizer, as JSON, or None where it cannot stand
    in for it. Actors that load it skip importing transformers (seconds per actor on a small box).
    For a fast tokenizer whose class keeps the stock encode path, encode_texts is exactly the
    backend's encode_batch without special tokens, truncation or padding, with special-token text
    split (encode_with_backend); a class that changes that path keeps the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or any(
            getattr(cls, name, None) is not getattr(PreTrainedTokenizerFast, name, None) for name in ENCODE_PATH):
        return None
    return tokenizer.backend_tokenizer.to_str()


def load_backend(backend_json: str, special_tokens_as_text: bool = True):
    """The Rust tokenizer for encode_with_backend (data text: special-token text stays text) or, with
    special_tokens_as_text=False, for encode_chat_with_backend (a rendered chat template)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(backend_json)
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = special_tokens_as_text
    return backend


def encode_with_backend(backend, texts: list[str]) -> list[list[int]]:
    """encode_texts on the Rust tokenizer from load_backend."""
    return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]


def encode_chat_with_backend(backend, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """encode_chat_texts on the Rust tokenizer from load_backend(..., special_tokens_as_text=False)."""
    return [(np.asarray(e.ids, dtype=np.int32), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2))
            for e in backend.encode_batch(texts, add_special_tokens=False)]


def encode_chat_texts(tokenizer, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rendered conversations → (ids, [n, 2] character offsets) each, tokenized exactly as
    apply_chat_template(tokenize=True) tokenizes its rendering: no special tokens added, and the
    template's special-token text (and any in the messages) matched as special tokens."""
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    return [(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64).reshape(-1, 2))
            for ids, offsets in zip(out["input_ids"], out["offset_mapping"])]


def document_fields(cfg: JobConfig, chat: Optional[ChatFormat] = None) -> dict:
    p = cfg.prepare
    fields = {"fmt": p.format, "text_field": p.text_field, "prompt_field": p.prompt_field,
              "response_field": p.response_field}
    if p.format == "preference":
        fields.update(chosen_field=p.chosen_field, rejected_field=p.rejected_field)
    if chat is not None:
        fields["chat"] = chat
    return fields


def is_chat_format(cfg: JobConfig) -> bool:
    return cfg.prepare.format in ("chat", "sharegpt")


def load_chat_format(cfg: JobConfig, store: Store, tokenizer) -> Optional[ChatFormat]:
    """The chat template (prepare.chat_template, else the tokenizer's own) and how to read the
    records; None for the other formats. Fails in one line, before any work, without a template.
    Preference pairs use the template when there is one (standard pairs then render as one user turn
    and one assistant turn) and need none for text pairs."""
    p = cfg.prepare
    if p.format == "preference":
        template = read_chat_template(cfg, store, tokenizer)
        if not template:
            return None
        check_chat_template(template, f"prepare.chat_template {p.chat_template}" if p.chat_template else
                            f"the chat template of the tokenizer at {cfg.tokenizer_uri}")
        return ChatFormat(p.format, template, tokenizer.special_tokens_map)
    if not is_chat_format(cfg):
        return None
    template = read_chat_template(cfg, store, tokenizer)
    if not template:
        raise PrepareError(f"tokenizer at {cfg.tokenizer_uri} has no chat template: set prepare.chat_template "
                           f"to a Jinja file for format {p.format!r}")
    check_chat_template(template, f"prepare.chat_template {p.chat_template}" if p.chat_template else
                        f"the chat template of the tokenizer at {cfg.tokenizer_uri}")
    return ChatFormat(p.format, template, tokenizer.special_tokens_map, train_on=p.train_on,
                      messages_field=p.messages_field, conversations_field=p.conversations_field,
                      sharegpt_roles=p.sharegpt_roles)


def check_chat_template(template: str, where: str) -> None:
    """Compile a chat template as transformers will: a syntax error is one line naming `where` and
    the template's line, before any record is read. Whether the template accepts a conversation is
    each record's business (a refusal is a counted skip), so only syntax is checked here."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template(conversations=[[{"role": "user", "content": "ping"}]], chat_template=template,
                              add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as err:
        raise PrepareError(f"{where}: not valid Jinja at line {err.lineno}: {err.message}") from None
    except Exception as err:  # noqa: BLE001: it compiled; whether it takes this sample is not the point
        # A template may refuse a lone user turn (one that wants a system turn first, say):
        # each record's own rendering decides, and a refusal there is a counted skip.
        log.debug("%s compiles but refuses a one-turn sample (%s: %s)", where, type(err).__name__, err)


def read_chat_template(cfg: JobConfig, store: Store, tokenizer) -> Optional[str]:
    """The template conversations are rendered with: prepare.chat_template's file when set, else the
    tokenizer's own (its default one where it has several); None when there is neither. Export
    gives the exported tokenizer this same template."""
    p = cfg.prepare
    if p is not None and p.chat_template:
        try:
            return store.read_text(p.chat_template)
        except (StorageError, OSError, UnicodeDecodeError) as err:
            raise PrepareError(f"cannot read prepare.chat_template {p.chat_template}: {err}") from None
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template or None


# -- the ray engine ----------------------------------------------------------------------------

def read_documents(cfg: JobConfig, inputs: InputFiles, rows_per_block: int, chat: Optional[ChatFormat] = None):
    """The input files as a Ray Dataset of DOCUMENT_SCHEMA blocks of at most `rows_per_block` rows."""
    import ray.data

    fields, base = document_fields(cfg, chat), inputs.base
    if cfg.prepare.input_format == "jsonl":
        # One read task per file (up to MAX_READ_TASKS), each fused with parsing its files and cutting
        # them into blocks: a split read (Ray's default below its target number of blocks) or a fixed
        # batch size would stop the fusion and cost a task, a worker and a copy of the file more.
        ds = ray.data.read_binary_files(inputs.paths, filesystem=inputs.fs, include_paths=True,
                                        override_num_blocks=min(len(inputs.paths), MAX_READ_TASKS))
        ds = ds.map_batches(parse_jsonl_files, batch_size=None, batch_format="numpy",
                            fn_kwargs={"base": base, "fields": fields, "rows_per_block": rows_per_block})
    else:
        ds = ray.data.read_parquet(inputs.paths, filesystem=inputs.fs, include_paths=True)
        ds = ds.map_batches(parse_parquet_rows, batch_format="pyarrow", fn_kwargs={"base": base, "fields": fields})
    # A file's documents come out of one task; cutting them into blocks (in the same task: streaming
    # repartition fuses with the map before it) is what spreads them over the tokenizer actors.
    return ds.repartition(target_num_rows_per_block=rows_per_block)


def build_token_dataset(cfg: JobConfig, inputs: InputFiles, tokenizer: TokenizerSpec,
                        chat: Optional[ChatFormat] = None):
    import ray.data

    p = cfg.prepare
    ds = read_documents(cfg, inputs, BATCHES_PER_BLOCK * p.tokenize_batch_size, chat)
    return ds.map_batches(
        TokenizeDocuments, batch_size=p.tokenize_batch_size, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=p.num_tokenizer_actors), num_cpus=TOKENIZER_NUM_CPUS,
        fn_constructor_args=(tokenizer, cfg.data.seq_len, p.overlong_mode),
    )


def iter_ray_tokenized(cfg: JobConfig, inputs: InputFiles, tokenizer: TokenizerSpec,
                       chat: Optional[ChatFormat] = None) -> Iterator[pa.Table]:
    from app.cluster import init_ray

    init_ray(num_cpus=os.cpu_count())  # a Ray of its own only when none is joined or running
    with preserving_order():
        yield from build_token_dataset(cfg, inputs, tokenizer, chat).iter_batches(batch_format="pyarrow",
                                                                                 batch_size=None)


# -- the local engine --------------------------------------------------------------------------

def read_input_file(inputs: InputFiles, path: str) -> pa.Buffer:
    try:
        with inputs.fs.open_input_stream(path) as stream:
            return stream.read_buffer()
    except OSError as err:
        raise PrepareError(f"cannot read input file {path}: {err}") from None


def iter_local_documents(cfg: JobConfig, inputs: InputFiles, rows_per_block: int,
                         chat: Optional[ChatFormat] = None) -> Iterator[pa.Table]:
    """read_documents' blocks in this process, file by file: the same parse functions, the same rows."""
    fields, base = document_fields(cfg, chat), inputs.base
    for path in inputs.paths:
        if cfg.prepare.input_format == "jsonl":
            batch = {"bytes": [read_input_file(inputs, path).to_pybytes()], "path": [path]}
            yield from parse_jsonl_files(batch, base, fields, rows_per_block)
            continue
        try:
            # Row groups are read as they are needed: a Parquet file is never whole in memory.
            with inputs.fs.open_input_file(path) as source:
                for rows in pq.ParquetFile(source).iter_batches(rows_per_block):
                    table = pa.Table.from_batches([rows]).append_column("path", pa.array([path] * rows.num_rows))
                    yield parse_parquet_rows(table, base, fields)
        except pa.ArrowInvalid as err:
            raise PrepareError(f"input file {path} is not valid Parquet: {err}") from None
        except OSError as err:
            raise PrepareError(f"cannot read input file {path}: {err}") from None


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """The container's CPU quota in cores (cgroup v2 `cpu.max`, else v1 CFS), None if unlimited. In a
    Kubernetes pod the affinity mask is the whole host, so the quota is the real number of cores."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def local_thread_count(cfg: JobConfig) -> int:
    if cfg.prepare.local_threads:
        return cfg.prepare.local_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return max(1, min(cores, int(limit + 0.5))) if limit else cores


def iter_local_tokenized(cfg: JobConfig, inputs: InputFiles, tokenizer: TokenizerSpec,
                         chat: Optional[ChatFormat] = None) -> Iterator[pa.Table]:
    """Blocks tokenized on a thread pool, yielded in input order. The caller's thread parses the next
    blocks and packs the finished ones meanwhile; a bounded look-ahead keeps memory at a few blocks."""
    threads = local_thread_count(cfg)
    # One tokenizer per thread: a transformers tokenizer (the fallback to the Rust backend) sets
    # truncation and padding on its backend in every call, which fails while another thread encodes.
    per_thread = threading.local()

    def tokenize(block: pa.Table) -> pa.Table:
        if not hasattr(per_thread, "tokenize"):
            per_thread.tokenize = TokenizeDocuments(tokenizer, cfg.data.seq_len, cfg.prepare.overlong_mode)
        return per_thread.tokenize(block)

    pending: collections.deque = collections.deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="eft-tokenize") as pool:
        try:
            # The ray engine's block size (1,024 documents by default): each block costs two GIL
            # hand-offs between the parsing and the tokenizing threads.
            for block in iter_local_documents(cfg, inputs, BATCHES_PER_BLOCK * cfg.prepare.tokenize_batch_size, chat):
                pending.append(pool.submit(tokenize, block))
                if len(pending) > 2 * threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def choose_engine(cfg: JobConfig, inputs: InputFiles) -> str:
    p = cfg.prepare
    if p.engine != "auto":
        return p.engine
    return "local" if inputs.total_bytes <= p.local_max_input_mb * 2**20 else "ray"


@contextlib.contextmanager
def preserving_order() -> Iterator[None]:
    """Deterministic output needs blocks in input order; restore the caller's setting after."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    options = ctx.execution_options
    saved = options.preserve_order, ctx.use_datasource_v2
    options.preserve_order = True
    # The v2 Parquet reader starts 32 footer-reader actors per read: seconds on a small box.
    ctx.use_datasource_v2 = False
    try:
        yield
    finally:
        options.preserve_order, ctx.use_datasource_v2 = saved
