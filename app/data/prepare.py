"""The `prepare` stage: raw JSONL/Parquet → packed Parquet shards + manifest.json.

Input files are read and parsed into blocks of documents, the blocks are tokenized, and the
driver consumes the tokenized documents in input order while later blocks are still being
tokenized: it assigns each one to train or validation by a stable hash of its source position,
packs each split into `seq_len` rows and writes Parquet shards. Block boundaries never show in
the output: documents are packed as one stream, in input order.

Two engines run the read/parse/tokenize part with the same functions and the same output: Ray
Data across the cluster, or threads in this process (app/data/engines.py).

The dataset is committed-or-absent: shards go under a fresh `shards-<id>/` prefix and
`manifest.json`, written last, is the commit. Readers only ever follow the manifest, so a
crashed or failed run leaves at most an unreferenced prefix, which the next run deletes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import posixpath
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app.batch import IGNORE_INDEX
from app.config import JobConfig, PrepareConfig
from app.data.chat import ChatFormat
from app.data.engines import (
    OVERLONG_OUTCOMES, PAIR_TOO_LONG, InputFiles, PrepareError, TokenizerSpec, build_list_array, check_chat_template, choose_engine,
    encode_sources, export_backend, iter_local_tokenized, iter_ray_tokenized, list_input_files, load_chat_format,
    load_tokenizer, local_thread_count, number_parquet_rows, relative_source,
)
from app.data.lease import Lease, check_no_live_readers, hold_prepare_lease
from app.data.manifest import (
    FORMAT_VERSION, SHARDS_PREFIX, commit_manifest, delete_unreferenced_shards, read_committed_manifest,
    referenced_shard_dirs,
)
from app.data.packing import Packer, source_key, validation_mask
from app.data.reference import add_reference, list_s3_etags, needs_reference
from app.model.architecture import check_seq_len, load_model_config
from app.hub import resolve_model
from app.storage import Store, StorageError, is_s3, join

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
MAX_SKIPPED_EXAMPLES = 100
ERROR_EXAMPLES = 3
LOG_EVERY_S = 10.0
SHARD_SCHEMA = pa.schema([
    ("row_id", pa.int64()), ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    # 0, 1, ... from every document start (and row start, and the padding): see app/data/packing.py.
    # Datasets prepared before it have no such column and no manifest["position_ids"].
    ("position_ids", pa.list_(pa.int32())),
])


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
        if self.count - self.by_reason[PAIR_TOO_LONG] > self.limit:
            counted = [e for e in self.examples if e["reason"] != PAIR_TOO_LONG]
            first = "; ".join(f"{e['source']}:{e['line']} {e['reason']}" for e in counted[:ERROR_EXAMPLES])
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

    def __init__(self, seq_len: int, pad_id: int, writer: ShardWriter, packing: bool = True):
        self.packer = Packer(seq_len, pad_id, packing)
        self.writer = writer
        self.tokens = 0
        self.label_tokens = 0
        self.pairs = 0

    def add(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, docs_per_unit: int = 1) -> None:
        """Documents of `lengths`; with docs_per_unit > 1, units of that many that stay in one row."""
        if docs_per_unit > 1:
            self.packer.add_units(ids, labels, lengths, docs_per_unit)
            self.pairs += len(lengths) // docs_per_unit
        else:
            self.packer.add(ids, labels, lengths)
        self.tokens += len(ids)
        self.label_tokens += int(np.count_nonzero(labels != IGNORE_INDEX))
        self.writer.add(*self.packer.pop_rows())

    def finish(self) -> dict:
        self.writer.add(*self.packer.finish())
        self.writer.finish()
        out = {"rows": self.writer.rows, "tokens": self.tokens, "label_tokens": self.label_tokens}
        if self.pairs:
            out["pairs"] = self.pairs
        return {**out, "shards": self.writer.shards}


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
        pairs = pc.is_valid(batch["chosen_tokens"]).to_numpy(zero_copy_only=False) & ok
        chosen = batch["chosen_tokens"].to_numpy(zero_copy_only=False)
        for name, doc_mask in (("train", ok & ~is_val), ("validation", ok & is_val)):
            token_mask = np.repeat(doc_mask, lengths)
            if pairs.any():
                # Each pair record is two documents, chosen then rejected, kept in one row.
                first = chosen[doc_mask].astype(np.int64)
                halves = np.stack([first, lengths[doc_mask] - first], axis=1).ravel()
                self.splits[name].add(ids[token_mask], labels[token_mask], halves, docs_per_unit=2)
            else:
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

# Settings that change how a dataset is made, not what it holds (both engines, every block size and
# thread count give the same shards), and `overwrite` itself: left out of a dataset's recipe.
HOW_NOT_WHAT = ("overwrite", "engine", "local_max_input_mb", "local_threads", "num_tokenizer_actors",
                "tokenize_batch_size")


def build_recipe(cfg: JobConfig, store: Store, tokenizer) -> dict:
    """What a prepared dataset is a function of, as its manifest records it (`recipe`): the settings
    that shape the rows, every file under the input URIs with its version (list_input_versions),
    the chat template's text and the tokenizer's fingerprint. A second `eft prepare` of the same
    recipe has nothing to do."""
    p = cfg.prepare
    settings = {"data.seq_len": cfg.data.seq_len, **{f"prepare.{k}": v for k, v in p.model_dump(mode="json", exclude=set(HOW_NOT_WHAT)).items()}}
    template = getattr(tokenizer, "chat_template", None)
    if p.chat_template:
        template = store.read_text(p.chat_template)
    sources = [p.input_uri] if p.input_uri is not None else [source.uri for source in p.inputs]
    local_dir = store.cache_locally(cfg.tokenizer_uri)
    return {"settings": settings,
            "inputs": {uri: list_input_versions(store, uri) for uri in sources},
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "tokenizer": fingerprint_tokenizer(tokenizer, local_dir)}


def list_input_versions(store: Store, uri: str) -> dict[str, str]:
    """{file under `uri` (or the file itself): its version}: on S3 the object's ETag (its content's
    MD5; S3's modification times are whole seconds), on a filesystem "size:mtime_ns"."""
    if is_s3(uri):
        return list_s3_etags(store, uri)
    fs, path = store.resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return {posixpath.basename(path): f"{info.size}:{info.mtime_ns}"}
    prefix = path.rstrip("/") + "/"
    return {name[len(prefix):]: f"{size}:{mtime_ns}" for name, size, mtime_ns in store.list_versions(uri)}


def describe_recipe_change(old: dict, new: dict) -> str:
    """What differs between a committed dataset's recipe and this prepare's, in a few words."""
    # A setting newer than the dataset's eft, left at its default, shapes rows as before it existed.
    settings = {**{f"prepare.{k}": f.get_default(call_default_factory=True) for k, f in PrepareConfig.model_fields.items()},
                **old["settings"]}
    changed = [f"{key} {settings.get(key)!r} → {value!r}" for key, value in new["settings"].items()
               if settings.get(key) != value]
    changed += [f"{key} set before" for key in old["settings"] if key not in new["settings"]]
    for uri, files in new["inputs"].items():
        before = old["inputs"].get(uri)
        if before is None:
            changed.append(f"input {uri} is new")
            continue
        names = sorted({*before, *files})
        differ = [n for n in names if before.get(n) != files.get(n)]
        if differ:
            what = ", ".join(f"{n} ({'added' if n not in before else 'removed' if n not in files else 'changed'})"
                             for n in differ[:3])
            changed.append(f"input {uri} changed: {what}" + (f" and {len(differ) - 3} more" if len(differ) > 3 else ""))
    changed += [f"input {uri} no longer used" for uri in old["inputs"] if uri not in new["inputs"]]
    if old.get("chat_template_sha256") != new["chat_template_sha256"]:
        changed.append("the chat template changed")
    if old.get("tokenizer") != new["tokenizer"]:
        changed.append(f"the tokenizer at {new['settings'].get('prepare.tokenizer_uri') or 'model.uri'} changed")
    return "; ".join(changed)


def check_prepared(cfg: JobConfig, store: Store, recipe: dict) -> Optional[dict]:
    """The dataset committed at data.uri when it was prepared from this very recipe (nothing to
    do), None when there is none or prepare.overwrite is set; a dataset of another recipe is
    refused in one line naming what differs."""
    if cfg.prepare.overwrite:
        return None
    committed = read_committed_manifest(store, cfg.data.uri)
    if committed is None:
        return None
    old = committed.get("recipe")
    if not isinstance(old, dict):
        raise PrepareError(f"dataset already prepared at {cfg.data.uri} by an earlier eft, which recorded no recipe "
                           f"to compare with (set prepare.overwrite=true)")
    change = describe_recipe_change(old, recipe)
    if change:
        raise PrepareError(f"dataset already prepared at {cfg.data.uri} from another recipe: {change} "
                           f"(set prepare.overwrite=true to replace it)")
    return committed


# -- the job --------------------------------------------------------------------------------

def build_manifest(cfg: JobConfig, tokenizer: dict, inputs: Optional[InputFiles], splits: dict[str, dict],
                   consumer: DocumentConsumer, bad: BadRecords, engine: str, wall_s: float, mixture=None,
                   recipe: Optional[dict] = None) -> dict:
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
        # false: one document (or pair) per row, the rest padding; training trims it per micro-batch.
        "packing": cfg.prepare.packing,
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
        # What the dataset is a function of: a second prepare of the same recipe has nothing to do.
        "recipe": recipe,
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
                                             cfg.data.seq_len), cfg.prepare.packing)
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
    if cfg.prepare.format == "prompts":  # not packed: app.rl.prompts.prepare_prompts writes them
        raise PrepareError("prepare.format prompts: a GRPO prompt set is written by app.rl.prompts.prepare_prompts")
    store = store or Store.from_config(cfg.storage)
    cfg, _ = resolve_model(cfg, store)  # a hub id: its pinned mirror (tokenizer, reference model)
    preflight(cfg, store)
    started = time.monotonic()
    hf_tokenizer = load_tokenizer(store, cfg.tokenizer_uri)
    recipe = build_recipe(cfg, store, hf_tokenizer)
    # A run of the same recipe again (a pipeline re-run, a notebook cell run twice) has nothing to
    # do and writes nothing, not even the lease; another recipe is refused before any input is read.
    committed = check_prepared(cfg, store, recipe)
    if committed is not None and not needs_reference(cfg):
        return report_unchanged(cfg, committed)
    # One writer per dataset prefix: without the lease, two prepares would each delete the
    # other's in-progress shards as unreferenced.
    with hold_prepare_lease(store, cfg.data.uri) as lease:
        committed = check_prepared(cfg, store, recipe)  # again: another prepare may have committed since
        if committed is not None:
            if not needs_reference(cfg):
                return report_unchanged(cfg, committed)
            # Prepared already: DPO's reference pass is what is left (or was cut off), and it resumes,
            # or is reused when committed for the same model.
            log.info("prepare: %s is prepared; computing its reference log-probs", cfg.data.uri)
            return add_reference(cfg, store, lease)
        if read_committed_manifest(store, cfg.data.uri) is not None:
            check_no_live_readers(store, cfg.data.uri)
        if cfg.prepare.inputs is not None:
            return prepare_mixture(cfg, store, hf_tokenizer, started, lease, recipe)
        manifest = prepare_single(cfg, store, hf_tokenizer, started, lease, recipe)
        return add_reference(cfg, store, lease) if needs_reference(cfg) else manifest


def report_unchanged(cfg: JobConfig, committed: dict) -> dict:
    """The committed manifest, marked `unchanged` (in the returned copy only) for the CLI's line."""
    log.info("prepare: %s is already prepared from the same input, settings and tokenizer; nothing to do",
             cfg.data.uri)
    return {**committed, "unchanged": True}


def preflight(cfg: JobConfig, store: Store) -> None:
    """What can be checked before the lease is taken and any input is read, each failure one line
    within seconds: every location reachable (a short retry budget: a person is waiting), a chat
    template file that compiles, and data.seq_len within the model's positions (the check `eft
    train` makes, when the model is already there to read)."""
    quick = Store(store.endpoint, store.region, interactive=True)
    p = cfg.prepare
    sources = [p.input_uri] if p.input_uri is not None else [source.uri for source in p.inputs]
    for uri in dict.fromkeys([cfg.data.uri, cfg.tokenizer_uri, cfg.model.uri, *sources,
                              *([p.chat_template] if p.chat_template else [])]):
        quick.check_reachable(uri)
    if p.chat_template:
        try:
            template = quick.read_text(p.chat_template)
        except (StorageError, OSError, UnicodeDecodeError) as err:
            raise PrepareError(f"cannot read prepare.chat_template {p.chat_template}: {err}") from None
        check_chat_template(template, f"prepare.chat_template {p.chat_template}")
    if quick.exists(join(cfg.model.uri, "config.json")):
        check_seq_len(cfg.data.seq_len, load_model_config(quick, cfg.model.uri), cfg.model.uri)
    else:
        log.info("prepare: no config.json at model.uri %s yet; eft train checks data.seq_len against the model",
                 cfg.model.uri)


def prepare_single(cfg: JobConfig, store: Store, hf_tokenizer, started: float, lease: Lease,
                   recipe: dict) -> dict:
    """prepare_dataset for one `prepare.input_uri`, under the dataset's lease."""
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
        lease.check()  # a prepare whose lease was taken over must not commit over its successor
    except BaseException:
        store.delete_prefix(join(cfg.data.uri, shard_dir))
        raise
    manifest = build_manifest(cfg, tokenizer, inputs, splits, consumer, bad, engine, time.monotonic() - started,
                              recipe=recipe)
    commit_manifest(store, cfg.data.uri, manifest)
    log.info("prepare: committed %s: %d train / %d validation rows, %d tokens, %d records skipped",
             cfg.data.uri, splits["train"]["rows"], splits["validation"]["rows"],
             sum(s["tokens"] for s in splits.values()), bad.count)
    return manifest


def prepare_mixture(cfg: JobConfig, store: Store, hf_tokenizer, started: float, lease: Lease,
                    recipe: dict) -> dict:
    """prepare_dataset for `prepare.inputs` (app/data/mixing.py): planned, then packed as one input,
    under the dataset's lease."""
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
        lease.check()
    except BaseException:
        store.delete_prefix(join(cfg.data.uri, shard_dir))
        raise
    manifest = build_manifest(cfg, tokenizer, None, splits, consumer, bad, "local", time.monotonic() - started,
                              mixture, recipe=recipe)
    commit_manifest(store, cfg.data.uri, manifest)
    log.info("prepare: committed %s: %d train / %d validation rows, %d tokens, %d records skipped",
             cfg.data.uri, splits["train"]["rows"], splits["validation"]["rows"],
             sum(s["tokens"] for s in splits.values()), bad.count)
    return manifest
