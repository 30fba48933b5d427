"""The `prepare` stage: raw JSONL/Parquet → packed Parquet shards + manifest.json.

Input files are read and parsed into blocks of documents, the blocks are tokenized, and the
driver consumes the tokenized documents in input order while later blocks are still being
tokenized: it assigns each one to train or validation by a stable hash of its source position,
packs each split into `seq_len` rows and writes Parquet shards. Block boundaries never show in
the output: documents are packed as one stream, in input order.

Two engines run the read/parse/tokenize part, with the same functions and the same output:
- "ray": Ray Data reads and parses the files in tasks, which cut them into blocks of a few
  tokenizer batches, and an actor pool tokenizes them (the tokenizer loaded once per actor).
  It scales past one machine but costs seconds of start-up and some per-block overhead.
- "local": the driver parses the files itself and a thread per core tokenizes the blocks (the
  Rust tokenizer releases the GIL). No start-up cost: the right choice for anything one
  machine tokenizes in minutes, which `prepare.engine: auto` takes to mean local_max_input_mb.

The dataset is committed-or-absent: shards go under a fresh `shards-<id>/` prefix and
`manifest.json`, written last, is the commit. Readers only ever follow the manifest, so a
crashed or failed run leaves at most an unreferenced prefix, which the next run deletes.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import posixpath
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app.config import JobConfig
from app.data.chat import ChatFormat, span_token_mask, tokens_before
from app.data.formats import Document, Parsed, Skip, build_document, parse_json_line, parse_jsonl_block
# DatasetError, load_manifest and shard_uris stay importable from here for code written before app.data.manifest.
from app.data.manifest import (  # noqa: F401
    FORMAT_VERSION, SHARDS_PREFIX, DatasetError, commit_manifest, delete_unreferenced_shards, load_manifest, manifest_uri,
    read_committed_manifest, referenced_shard_dirs, shard_uris,
)
from app.data.packing import IGNORE_INDEX, Packer, encode_documents, encode_texts, source_key, validation_mask
from app.storage import Store, StorageError, join

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
MAX_SKIPPED_EXAMPLES = 100
ERROR_EXAMPLES = 3
LOG_EVERY_S = 10.0
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
])
TOKENIZED_SCHEMA = pa.schema([
    ("source", pa.string()), ("line", pa.int64()), ("reason", pa.string()),
    ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    # What happened to a document longer than seq_len: "split", "truncated" or "dropped" (no tokens).
    ("overlong", pa.string()),
])
OVERLONG_OUTCOMES = ("split", "truncated", "dropped")
SHARD_SCHEMA = pa.schema([
    ("row_id", pa.int64()), ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    # 0, 1, ... from every document start (and row start, and the padding): see app/data/packing.py.
    # Datasets prepared before it have no such column and no manifest["position_ids"].
    ("position_ids", pa.list_(pa.int32())),
])


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


# -- parse and tokenize (both engines: in Ray tasks and actors, or in this process) ---------

def build_document_table(sources: list[str], lines: list[int], parsed: list[Parsed]) -> pa.Table:
    """Per-row source, line and Document or Skip → a DOCUMENT_SCHEMA table."""
    return pa.table({
        "source": sources, "line": lines,
        "text": [p.text if isinstance(p, Document) else None for p in parsed],
        "prompt": [p.prompt if isinstance(p, Document) else None for p in parsed],
        "reason": [p.reason if isinstance(p, Skip) else None for p in parsed],
        "spans": [list(p.spans) if isinstance(p, Document) and p.spans is not None else None for p in parsed],
        "turn_ends": [list(p.turn_ends) if isinstance(p, Document) and p.turn_ends is not None else None
                      for p in parsed],
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
        long_plain = plain[doc_lengths > self.seq_len] if self.seq_len else plain[:0]
        if not len(chat) and (self.overlong == "split" or not len(long_plain)):
            # The plain-text fast path: whole batches of documents as flat arrays.
            overlong[long_plain] = "split"
        else:
            ids, labels, lengths = self.per_document(batch, plain, chat, ids, labels, lengths, overlong)
        return pa.table({
            "source": batch["source"], "line": batch["line"], "reason": batch["reason"],
            "input_ids": build_list_array(ids, lengths), "labels": build_list_array(labels, lengths),
            "overlong": pa.array(overlong.tolist(), pa.string()),
        }, schema=TOKENIZED_SCHEMA)

    def per_document(self, batch: pa.Table, plain: np.ndarray, chat: np.ndarray, ids: np.ndarray,
                     labels: np.ndarray, lengths: np.ndarray, overlong: np.ndarray):
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
                cuts = [tokens_before(offsets, end) for end in ends]
                docs[row] = (doc_ids, doc_labels, cuts)
        out_ids, out_labels = [], []
        lengths = np.zeros(len(lengths), dtype=np.int64)
        for row in sorted(docs):
            doc_ids, doc_labels, cuts = docs[row]
            if self.seq_len and len(doc_ids) > self.seq_len:
                doc_ids, doc_labels, overlong[row] = self.fit(doc_ids, doc_labels, cuts)
            out_ids.append(doc_ids)
            out_labels.append(doc_labels)
            lengths[row] = len(doc_ids)
        empty = np.zeros(0, dtype=np.int32)
        return (np.concatenate(out_ids) if out_ids else empty, np.concatenate(out_labels) if out_labels else empty,
                lengths)

    def fit(self, ids: np.ndarray, labels: np.ndarray, cuts: Optional[list[int]]):
        """One over-long document → (ids, labels, outcome) under self.overlong."""
        if self.overlong == "split":
            return ids, labels, "split"
        if self.overlong == "truncate":
            fitting = [c for c in cuts if c <= self.seq_len] if cuts is not None else [self.seq_len]
            cut = max(fitting, default=0)
            if cut and np.any(labels[:cut] != IGNORE_INDEX):
                return ids[:cut], labels[:cut], "truncated"
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty.copy(), "dropped"


def load_tokenizer(store: Store, tokenizer_uri: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(store.cache_locally(tokenizer_uri)))


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
    if chat is not None:
        fields["chat"] = chat
    return fields


def is_chat_format(cfg: JobConfig) -> bool:
    return cfg.prepare.format in ("chat", "sharegpt")


def load_chat_format(cfg: JobConfig, store: Store, tokenizer) -> Optional[ChatFormat]:
    """The chat template (prepare.chat_template, else the tokenizer's own) and how to read the
    records; None for the other formats. Fails in one line, before any work, without a template."""
    if not is_chat_format(cfg):
        return None
    p = cfg.prepare
    template = read_chat_template(cfg, store, tokenizer)
    if not template:
        raise PrepareError(f"tokenizer at {cfg.tokenizer_uri} has no chat template: set prepare.chat_template "
                           f"to a Jinja file for format {p.format!r}")
    return ChatFormat(p.format, template, tokenizer.special_tokens_map, train_on=p.train_on,
                      messages_field=p.messages_field, conversations_field=p.conversations_field,
                      sharegpt_roles=p.sharegpt_roles)


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


# -- driver side: bad records, splits, shards ----------------------------------------------

class BadRecords:
    """Counts skipped records by reason, keeps the first examples, enforces the limit."""

    def __init__(self, limit: int, input_uri: str):
        self.limit = limit
        self.input_uri = input_uri
        self.by_reason: Counter = Counter()
        self.examples: list[dict] = []

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    def add(self, source: str, line: int, reason: str) -> None:
        self.by_reason[reason] += 1
        if len(self.examples) < MAX_SKIPPED_EXAMPLES:
            self.examples.append({"source": source, "line": int(line), "reason": reason})
        if self.count > self.limit:
            first = "; ".join(f"{e['source']}:{e['line']} {e['reason']}" for e in self.examples[:ERROR_EXAMPLES])
            raise PrepareError(f"more than prepare.max_bad_records={self.limit} bad records in "
                               f"{self.input_uri}; first: {first}")


def build_shard_table(ids: np.ndarray, labels: np.ndarray, positions: np.ndarray, row_id_start: int) -> pa.Table:
    n_rows, seq_len = ids.shape
    lengths = np.full(n_rows, seq_len, dtype=np.int64)
    return pa.table({
        "row_id": pa.array(np.arange(row_id_start, row_id_start + n_rows, dtype=np.int64)),
        "input_ids": build_list_array(ids.ravel(), lengths),
        "labels": build_list_array(labels.ravel(), lengths),
        "position_ids": build_list_array(positions.ravel(), lengths),
    }, schema=SHARD_SCHEMA)


class ShardWriter:
    """Packed rows of one split → `<shard_dir>/<split>-NNNNN.parquet` of `rows_per_shard` rows."""

    def __init__(self, fs: pafs.FileSystem, data_path: str, shard_dir: str, split: str, rows_per_shard: int,
                 seq_len: int):
        if rows_per_shard * seq_len >= 2**31:
            # list<int32> columns carry int32 offsets.
            raise PrepareError(f"prepare.rows_per_shard ({rows_per_shard}) x data.seq_len ({seq_len}) "
                               f"must stay under 2**31 tokens per shard")
        self.fs, self.data_path, self.shard_dir = fs, data_path, shard_dir
        self.split, self.rows_per_shard = split, rows_per_shard
        self.shards: list[dict] = []
        self.rows = 0
        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._positions: list[np.ndarray] = []
        self._buffered = 0

    def add(self, ids: np.ndarray, labels: np.ndarray, positions: np.ndarray) -> None:
        if len(ids):
            self._ids.append(ids)
            self._labels.append(labels)
            self._positions.append(positions)
            self._buffered += len(ids)
        while self._buffered >= self.rows_per_shard:
            self._write(self.rows_per_shard)

    def finish(self) -> None:
        if self._buffered:
            self._write(self._buffered)

    def _write(self, n_rows: int) -> None:
        ids, labels, positions = (np.concatenate(self._ids), np.concatenate(self._labels),
                                  np.concatenate(self._positions))
        self._ids, self._labels, self._positions = [ids[n_rows:]], [labels[n_rows:]], [positions[n_rows:]]
        self._buffered -= n_rows
        rel = f"{self.shard_dir}/{self.split}-{len(self.shards):05d}.parquet"
        path = f"{self.data_path}/{rel}"
        if isinstance(self.fs, pafs.LocalFileSystem):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_output_stream(path) as out:
            pq.write_table(build_shard_table(ids[:n_rows], labels[:n_rows], positions[:n_rows], self.rows), out)
        self.shards.append({"path": rel, "rows": n_rows, "row_id_start": self.rows})
        self.rows += n_rows


class SplitBuilder:
    """Packs one split's documents and streams the rows to its ShardWriter."""

    def __init__(self, seq_len: int, pad_id: int, writer: ShardWriter):
        self.packer = Packer(seq_len, pad_id)
        self.writer = writer
        self.tokens = 0
        self.label_tokens = 0

    def add(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> None:
        self.packer.add(ids, labels, lengths)
        self.tokens += len(ids)
        self.label_tokens += int(np.count_nonzero(labels != IGNORE_INDEX))
        self.writer.add(*self.packer.pop_rows())

    def finish(self) -> dict:
        self.writer.add(*self.packer.finish())
        self.writer.finish()
        return {"rows": self.writer.rows, "tokens": self.tokens, "label_tokens": self.label_tokens,
                "shards": self.writer.shards}


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


def flatten_tokens(batch: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch's token lists → (flat input_ids, flat labels, per-document lengths)."""
    ids_col, labels_col = batch["input_ids"].combine_chunks(), batch["labels"].combine_chunks()
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    return (ids_col.flatten().to_numpy(zero_copy_only=False),
            labels_col.flatten().to_numpy(zero_copy_only=False), lengths)


class DocumentConsumer:
    """Driver loop body: one tokenized batch → bad records, split assignment, packing."""

    def __init__(self, cfg: JobConfig, splits: dict[str, SplitBuilder], bad: BadRecords):
        self.fraction = cfg.data.validation_fraction
        # A mixture's rows come numbered by source (app/data/mixing.py).
        self.number_rows = cfg.prepare.input_format == "parquet" and cfg.prepare.inputs is None
        self.splits, self.bad = splits, bad
        self.read = 0
        self.used = 0
        self.overlong: Counter = Counter({outcome: 0 for outcome in OVERLONG_OUTCOMES})
        self.row_counters: Counter = Counter()
        self.source_keys: dict[str, int] = {}

    def add_batch(self, batch: pa.Table) -> None:
        names, codes = encode_sources(batch["source"])
        lines = (number_parquet_rows([names[c] for c in codes], self.row_counters) if self.number_rows
                 else batch["line"].to_numpy(zero_copy_only=False))
        ok = pc.is_null(batch["reason"]).to_numpy(zero_copy_only=False)
        self.read += batch.num_rows
        self.record_bad(batch["reason"], names, codes, lines, ok)
        self.overlong.update(o for o in batch["overlong"].to_pylist() if o is not None)
        # A dropped over-long document is not bad (it is counted apart), but it is not used either.
        ok &= ~pc.fill_null(pc.equal(batch["overlong"], "dropped"), False).to_numpy(zero_copy_only=False)
        self.used += int(ok.sum())
        is_val = validation_mask(self.lookup_source_keys(names)[codes], lines, self.fraction)
        ids, labels, lengths = flatten_tokens(batch)
        for name, doc_mask in (("train", ok & ~is_val), ("validation", ok & is_val)):
            token_mask = np.repeat(doc_mask, lengths)
            self.splits[name].add(ids[token_mask], labels[token_mask], lengths[doc_mask])

    def record_bad(self, reasons: pa.ChunkedArray, names: list[str], codes: np.ndarray,
                   lines: np.ndarray, ok: np.ndarray) -> None:
        bad_rows = np.flatnonzero(~ok)
        for i, reason in zip(bad_rows, reasons.take(pa.array(bad_rows)).to_pylist()):
            self.bad.add(names[codes[i]], int(lines[i]), reason)

    def lookup_source_keys(self, names: list[str]) -> np.ndarray:
        for name in names:
            if name not in self.source_keys:
                self.source_keys[name] = source_key(name)
        return np.array([self.source_keys[n] for n in names], dtype=np.uint64)


# -- tokenizer facts ------------------------------------------------------------------------

def fingerprint_tokenizer(tokenizer, local_dir: Path) -> str:
    path = Path(local_dir) / "tokenizer.json"
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))
    return hashlib.sha256(vocab.encode()).hexdigest()


def describe_tokenizer(cfg: JobConfig, store: Store, tokenizer) -> dict:
    local_dir = store.cache_locally(cfg.tokenizer_uri)
    if tokenizer.eos_token_id is None:
        raise PrepareError(f"tokenizer at {cfg.tokenizer_uri} has no eos token (needed between documents)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"uri": cfg.tokenizer_uri, "fingerprint": fingerprint_tokenizer(tokenizer, local_dir),
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad,
            "bos_token_id": tokenizer.bos_token_id}


def tokenizer_spec(cfg: JobConfig, store: Store, tokenizer, facts: dict) -> TokenizerSpec:
    return TokenizerSpec(cfg.tokenizer_uri, store.endpoint, store.region, facts["eos_token_id"],
                         facts["bos_token_id"], export_backend(tokenizer))


# -- commit protocol ------------------------------------------------------------------------

def check_not_prepared(cfg: JobConfig, store: Store) -> None:
    if store.exists(manifest_uri(cfg.data.uri)) and not cfg.prepare.overwrite:
        raise PrepareError(f"dataset already prepared at {cfg.data.uri} (set prepare.overwrite=true)")


# -- the job --------------------------------------------------------------------------------

def build_manifest(cfg: JobConfig, tokenizer: dict, inputs: Optional[InputFiles], splits: dict[str, dict],
                   consumer: DocumentConsumer, bad: BadRecords, engine: str, wall_s: float, mixture=None) -> dict:
    tokens = sum(s["tokens"] for s in splits.values())
    if mixture is not None:
        source = mixture.manifest_source()
        read = sum(s["records"] for s in source["inputs"])  # each record once, however often it is picked
    else:
        source = {"input_uri": cfg.prepare.input_uri, "input_format": cfg.prepare.input_format,
                  "format": cfg.prepare.format, "files": [relative_source(f, inputs.base) for f in inputs.paths],
                  "bytes": inputs.total_bytes}
        read = consumer.read
    return {
        "format_version": FORMAT_VERSION,
        "seq_len": cfg.data.seq_len,
        # Shards carry a position_ids column (document starts); older datasets lack this key.
        "position_ids": True,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "tokenizer": tokenizer,
        "source": source,
        "splits": splits,
        "records": {"read": read, "used": consumer.used, "skipped": bad.count,
                    "skipped_by_reason": dict(bad.by_reason), "skipped_examples": bad.examples,
                    # Documents longer than seq_len, by what prepare.overlong did with them.
                    "overlong": dict(consumer.overlong)},
        "stats": {"engine": engine, "wall_s": round(wall_s, 3),
                  "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0},
    }


def stream_documents(batches: Iterable[pa.Table], consumer: DocumentConsumer, total_bytes: int) -> None:
    started = last_log = time.monotonic()
    for batch in batches:
        consumer.add_batch(batch)
        if time.monotonic() - last_log > LOG_EVERY_S:
            last_log = time.monotonic()
            tokens = sum(split.tokens for split in consumer.splits.values())
            log.info("prepare: %d records read (%d skipped), %d train rows written, %.0f tokens/s, input %.0f MB",
                     consumer.read, consumer.bad.count, consumer.splits["train"].writer.rows,
                     tokens / (last_log - started), total_bytes / 1e6)


def write_dataset(cfg: JobConfig, store: Store, inputs: Optional[InputFiles], engine: str, shard_dir: str, pad_id: int,
                  tokenizer: TokenizerSpec, chat: Optional[ChatFormat] = None, mixture=None,
                  ) -> tuple[dict[str, dict], DocumentConsumer, BadRecords]:
    data_fs, data_path = store.resolve(cfg.data.uri)
    splits = {name: SplitBuilder(cfg.data.seq_len, pad_id,
                                 ShardWriter(data_fs, data_path, shard_dir, name, cfg.prepare.rows_per_shard,
                                             cfg.data.seq_len))
              for name in SPLITS}
    bad = BadRecords(cfg.prepare.max_bad_records, input_label(cfg))
    consumer = DocumentConsumer(cfg, splits, bad)
    if mixture is not None:
        stream_documents(mixture.tokenized(tokenizer), consumer, mixture.total_bytes)
        return {name: split.finish() for name, split in splits.items()}, consumer, bad
    tokenized = (iter_local_tokenized if engine == "local" else iter_ray_tokenized)(cfg, inputs, tokenizer, chat)
    stream_documents(tokenized, consumer, inputs.total_bytes)
    return {name: split.finish() for name, split in splits.items()}, consumer, bad


def input_label(cfg: JobConfig) -> str:
    """The input as errors name it: input_uri, or the mixture's source URIs."""
    p = cfg.prepare
    return p.input_uri if p.inputs is None else "prepare.inputs (" + ", ".join(s.uri for s in p.inputs) + ")"


def prepare_dataset(cfg: JobConfig, store: Optional[Store] = None) -> dict:
    """Run the prepare job for `cfg` and commit `<data.uri>/manifest.json`; returns the manifest."""
    if cfg.prepare is None:
        raise PrepareError("config has no `prepare` section (set prepare.input_uri)")
    store = store or Store.from_config(cfg.storage)
    started = time.monotonic()
    check_not_prepared(cfg, store)
    hf_tokenizer = load_tokenizer(store, cfg.tokenizer_uri)
    if cfg.prepare.inputs is not None:
        return prepare_mixture(cfg, store, hf_tokenizer, started)
    chat = load_chat_format(cfg, store, hf_tokenizer)
    delete_unreferenced_shards(store, cfg.data.uri, referenced_shard_dirs(read_committed_manifest(store, cfg.data.uri)))
    inputs = list_input_files(store, cfg.prepare.input_uri, cfg.prepare.input_format)
    tokenizer = describe_tokenizer(cfg, store, hf_tokenizer)
    spec = tokenizer_spec(cfg, store, hf_tokenizer, tokenizer)
    engine = choose_engine(cfg, inputs)
    shard_dir = f"{SHARDS_PREFIX}{uuid.uuid4().hex[:12]}"
    log.info("prepare: %d %s file(s), %.1f MB, from %s → %s/%s on the %s engine%s", len(inputs.paths),
             cfg.prepare.input_format, inputs.total_bytes / 1e6, cfg.prepare.input_uri, cfg.data.uri, shard_dir,
             engine, f" ({local_thread_count(cfg)} threads)" if engine == "local"
             else f" ({cfg.prepare.num_tokenizer_actors} tokenizer actors)")
    try:
        splits, consumer, bad = write_dataset(cfg, store, inputs, engine, shard_dir, tokenizer["pad_token_id"], spec,
                                              chat)
        if not splits["train"]["rows"]:
            raise PrepareError(f"no training rows from {cfg.prepare.input_uri} ({consumer.read} records read, "
                               f"{bad.count} skipped, {consumer.used} used, "
                               f"{splits['validation']['rows']} validation rows)")
    except BaseException:
        store.delete_prefix(join(cfg.data.uri, shard_dir))
        raise
    manifest = build_manifest(cfg, tokenizer, inputs, splits, consumer, bad, engine, time.monotonic() - started)
    commit_manifest(store, cfg.data.uri, manifest)
    log.info("prepare: committed %s: %d train / %d validation rows, %d tokens, %d records skipped",
             cfg.data.uri, splits["train"]["rows"], splits["validation"]["rows"],
             sum(s["tokens"] for s in splits.values()), bad.count)
    return manifest


def prepare_mixture(cfg: JobConfig, store: Store, hf_tokenizer, started: float) -> dict:
    """prepare_dataset for `prepare.inputs` (app/data/mixing.py): planned, then packed as one input."""
    from app.data.mixing import Mixture

    delete_unreferenced_shards(store, cfg.data.uri, referenced_shard_dirs(read_committed_manifest(store, cfg.data.uri)))
    mixture = Mixture(cfg, store, hf_tokenizer)
    tokenizer = describe_tokenizer(cfg, store, hf_tokenizer)
    spec = tokenizer_spec(cfg, store, hf_tokenizer, tokenizer)
    shard_dir = f"{SHARDS_PREFIX}{uuid.uuid4().hex[:12]}"
    log.info("prepare: mixing %s documents from %d sources (%s) → %s/%s on the local engine",
             sum(mixture.counts), len(mixture.sources), ", ".join(
                 f"{s.spec.uri}: {k} of {n}" for s, k, n in zip(mixture.sources, mixture.counts, mixture.available)),
             cfg.data.uri, shard_dir)
    try:
        splits, consumer, bad = write_dataset(cfg, store, None, "local", shard_dir, tokenizer["pad_token_id"], spec,
                                              mixture=mixture)
        if not splits["train"]["rows"]:
            raise PrepareError(f"no training rows from {input_label(cfg)} ({consumer.used} documents used, "
                               f"{splits['validation']['rows']} validation rows)")
    except BaseException:
        store.delete_prefix(join(cfg.data.uri, shard_dir))
        raise
    manifest = build_manifest(cfg, tokenizer, None, splits, consumer, bad, "local", time.monotonic() - started,
                              mixture)
    commit_manifest(store, cfg.data.uri, manifest)
    log.info("prepare: committed %s: %d train / %d validation rows, %d tokens, %d records skipped",
             cfg.data.uri, splits["train"]["rows"], splits["validation"]["rows"],
             sum(s["tokens"] for s in splits.values()), bad.count)
    return manifest
