"""GRPO's prompt sets: eval-set records → rendered prompt ids with a stable prompt id, and back.

`eft prepare` with `prepare.format: prompts` reads records in the eval-set format (app/eval/sets.py:
`prompt` or `messages`, `answer`, and any other fields a reward reads), renders each prompt exactly
as eval renders it (app/eval/render.py: the training chat template, through the same code) and
writes each split as one Parquet file of `prompt_id`, `input_ids` and the record as JSON, under a
fresh `shards-<id>/` prefix committed by the manifest as every dataset is. Prompts are not packed:
a step's rollouts are (app/rl/rollouts.py).

A prompt's id is its record's `id` when it has one, else a digest of the record: it keys the
completions' seeds, so it must not depend on where the record sits in the file. Records that
cannot be prompts (no answer, a multiple-choice record, a prompt that leaves no room in
`data.seq_len`) are counted skips, as elsewhere; past `prepare.max_bad_records`, one line.

Prompt sets are small (GSM8K 7.5k, MATH 12k records): each worker reads its split whole and
orders it by the run's seed (`PromptOrder`), so step k has the same prompts at any world size.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.config import JobConfig
from app.data.engines import PrepareError, check_chat_template, load_tokenizer, read_chat_template
from app.data.formats import Skip
from app.data.lease import check_no_live_readers, hold_prepare_lease
from app.data.manifest import (FORMAT_VERSION, SHARDS_PREFIX, DatasetError, commit_manifest, delete_unreferenced_shards,
                               read_committed_manifest, referenced_shard_dirs, shard_uris)
from app.data.packing import source_key, validation_mask
from app.data.prepare import (
    BadRecords, build_recipe, check_prepared, describe_tokenizer, preflight, report_unchanged,
)
from app.eval.render import EvalRenderError, PromptRenderer
from app.eval.sets import MULTIPLE_CHOICE, EvalSetError, build_record, iter_raw_records, list_set_files
from app.hub import resolve_model
from app.storage import Store, StorageError, join

log = logging.getLogger(__name__)

PROMPT_SCHEMA = pa.schema([("prompt_id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("record", pa.string())])
SPLITS = ("train", "validation")


def build_prompt_id(raw: dict) -> str:
    """The record's own `id`, else the first 16 hex digits of its canonical JSON's sha256."""
    own = raw.get("id")
    if isinstance(own, (str, int)) and not isinstance(own, bool) and str(own):
        return str(own)
    canonical = json.dumps(raw, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass
class PromptSet:
    """One split of a prepared prompt set, in file order."""

    ids: list[str]
    tokens: list[list[int]]
    records: list[dict]

    def __len__(self) -> int:
        return len(self.ids)


def prepare_prompts(cfg: JobConfig, store: Store | None = None) -> dict:
    """`eft prepare` for `prepare.format: prompts`: commit `<data.uri>/manifest.json`; returns it."""
    if cfg.prepare is None or cfg.prepare.format != "prompts":
        raise PrepareError("prepare_prompts needs prepare.format: prompts")
    store = store or Store.from_config(cfg.storage)
    cfg, _ = resolve_model(cfg, store)
    preflight(cfg, store)
    started = time.monotonic()
    tokenizer = load_tokenizer(store, cfg.tokenizer_uri)
    recipe = build_recipe(cfg, store, tokenizer)
    committed = check_prepared(cfg, store, recipe)
    if committed is not None:  # the same recipe again: nothing to do or write
        return report_unchanged(cfg, committed)
    with hold_prepare_lease(store, cfg.data.uri) as lease:
        committed = check_prepared(cfg, store, recipe)
        if committed is not None:
            return report_unchanged(cfg, committed)
        if read_committed_manifest(store, cfg.data.uri) is not None:
            check_no_live_readers(store, cfg.data.uri)
        template = read_chat_template(cfg, store, tokenizer)
        if template:
            check_chat_template(template, f"prepare.chat_template {cfg.prepare.chat_template}"
                                if cfg.prepare.chat_template else f"the chat template of {cfg.tokenizer_uri}")
        renderer = PromptRenderer(tokenizer, template, "prompts")
        delete_unreferenced_shards(store, cfg.data.uri,
                                   referenced_shard_dirs(read_committed_manifest(store, cfg.data.uri)))
        splits, files, read, bad = read_prompt_records(cfg, store, renderer)
        if not splits["train"]:
            raise PrepareError(f"no training prompts from {cfg.prepare.input_uri} ({read} records read, "
                               f"{bad.count} skipped, {len(splits['validation'])} validation prompts)")
        shard_dir = f"{SHARDS_PREFIX}{uuid.uuid4().hex[:12]}"
        try:
            described = {name: write_split(store, cfg.data.uri, shard_dir, name, rows) for name, rows in splits.items()}
            lease.check()
        except BaseException:
            store.delete_prefix(join(cfg.data.uri, shard_dir))
            raise
        manifest = {
            "format_version": FORMAT_VERSION,
            "seq_len": cfg.data.seq_len,
            "position_ids": True,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "tokenizer": describe_tokenizer(cfg, store, tokenizer),
            "source": {"input_uri": cfg.prepare.input_uri, "format": "prompts", "files": files,
                       "rendering": renderer.mode},
            "splits": described,
            "stop_token_ids": renderer.stop_ids,
            "records": {"read": read, "used": sum(len(rows) for rows in splits.values()), "skipped": bad.count,
                        "skipped_by_reason": dict(bad.by_reason), "skipped_examples": bad.examples},
            "stats": {"engine": "local", "wall_s": round(time.monotonic() - started, 3)},
            "recipe": recipe,
        }
        commit_manifest(store, cfg.data.uri, manifest)
    log.info("prepare: committed %s: %d train / %d validation prompts (%s), %d records skipped", cfg.data.uri,
             described["train"]["rows"], described["validation"]["rows"], renderer.mode, bad.count)
    return manifest


def read_prompt_records(cfg: JobConfig, store: Store, renderer: PromptRenderer):
    """({split: [(prompt_id, ids, record JSON)]}, the files read, records read, the skips)."""
    p, seq_len = cfg.prepare, cfg.data.seq_len
    bad = BadRecords(p.max_bad_records, p.input_uri)
    try:
        files = list_set_files(store, p.input_uri, key="prepare.input_uri")
    except EvalSetError as err:
        raise PrepareError(str(err)) from None
    splits: dict[str, list] = {name: [] for name in SPLITS}
    seen: dict[str, int] = {}
    read = 0
    for uri, kind in files:
        try:
            data = store.read_bytes(uri)
        except StorageError as err:
            raise PrepareError(f"prepare.input_uri {uri}: cannot read ({err})") from None
        name = uri.rsplit("/", 1)[-1]
        try:
            raws = list(iter_raw_records(data, kind, name, key="prepare.input_uri"))
        except EvalSetError as err:
            raise PrepareError(str(err)) from None
        for index, (where, raw) in enumerate(raws):
            read += 1
            place = where.rsplit(":", 1)[-1]
            line = int(place) if place.isdigit() else index  # JSONL's line number, a Parquet file's row
            skip, ids = check_prompt(raw, where, renderer, seq_len)
            if skip is not None:
                bad.add(name, line, skip)
                continue
            pid = build_prompt_id(raw)
            # Two identical records would share their seeds: the second is told apart by its count.
            seen[pid] = seen.get(pid, 0) + 1
            if seen[pid] > 1:
                pid = f"{pid}#{seen[pid] - 1}"
            held_out = validation_mask(np.array([source_key(name)], dtype=np.uint64), np.array([line]),
                                       cfg.data.validation_fraction)[0]
            splits["validation" if held_out else "train"].append(
                (pid, ids, json.dumps(raw, ensure_ascii=False, sort_keys=True)))
    return splits, [uri.rsplit("/", 1)[-1] for uri, _ in files], read, bad


def check_prompt(raw: Any, where: str, renderer: PromptRenderer, seq_len: int) -> tuple[str | None, list[int]]:
    """(why the record cannot be a prompt, or None; its rendered ids)."""
    if isinstance(raw, Skip):
        return raw.reason, []
    record = build_record(raw, 0, where)
    if isinstance(record, Skip):
        return record.reason, []
    if record.kind == MULTIPLE_CHOICE:
        return "a multiple-choice record (GRPO samples its answer: give answer as a string)", []
    try:
        ids = renderer.ids(record)
    except EvalRenderError as err:
        return str(err).split(": ", 1)[-1], []
    if len(ids) >= seq_len:
        return f"prompt of {len(ids)} tokens leaves no room for a completion in data.seq_len {seq_len}", []
    return None, ids


def write_split(store: Store, data_uri: str, shard_dir: str, split: str, rows: list) -> dict:
    path = f"{shard_dir}/{split}-00000.parquet"
    table = pa.table({"prompt_id": [r[0] for r in rows], "input_ids": [r[1] for r in rows],
                      "record": [r[2] for r in rows]}, schema=PROMPT_SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink)
    store.write_bytes(join(data_uri, path), sink.getvalue())
    lengths = [len(r[1]) for r in rows]
    return {"rows": len(rows), "tokens": int(sum(lengths)), "max_prompt_tokens": max(lengths, default=0),
            "shards": [{"path": path, "rows": len(rows)}]}


def load_prompt_split(store: Store, data_uri: str, manifest: dict, split: str = "train") -> PromptSet:
    """A committed prompt set's split, whole. Records are JSON (never pickle): the bucket is a trust
    boundary."""
    if manifest.get("source", {}).get("format") != "prompts":
        raise DatasetError(f"{data_uri}: not a prompt set (prepared as {manifest.get('source', {}).get('format')!r}; "
                           f"prepare it with prepare.format: prompts)")
    ids, tokens, records = [], [], []
    for uri in shard_uris(data_uri, manifest, split):
        table = pq.read_table(io.BytesIO(store.read_bytes(uri)))
        ids += table.column("prompt_id").to_pylist()
        tokens += table.column("input_ids").to_pylist()
        records += [json.loads(r) for r in table.column("record").to_pylist()]
    return PromptSet(ids, tokens, records)


class PromptOrder:
    """The run's seeded order of a prompt set: prompt position p (prompts consumed before it) is
    record `index(p)`, each epoch a fresh permutation keyed on (seed, epoch)."""

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts <= 0:
            raise ValueError("an empty prompt set")
        self.num_prompts, self.seed = num_prompts, seed
        self._perms: dict[int, np.ndarray] = {}

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_prompts)
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch, 0x9E9]).permutation(self.num_prompts)}
        return int(self._perms[epoch][offset])
