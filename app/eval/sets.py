"""Eval sets: JSONL or Parquet records → validated eval records, or the reason each is skipped.

Two kinds, never mixed in one set:
- generation: `prompt` (a string) or `messages` (a conversation to answer), and `answer`, a string
  or a list of accepted strings;
- multiple choice: `prompt` or `messages`, `choices` (two or more strings) and `answer`, the index
  of the right choice.
A record that fits neither is a counted skip with its line; more than `eval.max_bad_records` of
them is one line naming the first. The set's fingerprint (its files' names and bytes) and the
records read are what results.json quotes, so two scores are known to be on the same set.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from app.config import CHOICE_METRICS, GENERATION_METRICS, ConfigError, EvalConfig
from app.data.chat import read_message_list
from app.data.formats import Skip
from app.storage import Store, StorageError, join

GENERATION = "generation"
MULTIPLE_CHOICE = "multiple_choice"
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


class EvalSetError(ValueError):
    """The eval set cannot be used as configured; one line naming the URI, key or record at fault."""


@dataclass
class EvalRecord:
    index: int  # position among the set's usable records (the predictions' order)
    where: str  # file:line, for messages about it
    kind: str
    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    answers: list[str] = field(default_factory=list)  # generation: every accepted answer
    choices: list[str] = field(default_factory=list)  # multiple choice
    answer_index: Optional[int] = None

    def shown_prompt(self) -> str:
        """The prompt as a person reads it: the string, or the conversation's last turn."""
        return self.prompt if self.prompt is not None else self.messages[-1]["content"]


@dataclass
class EvalSet:
    uri: str
    records: list[EvalRecord]
    kind: str
    fingerprint: str
    skipped: dict[str, int]  # reason → count
    bad_lines: list[str]  # "file:line: reason", the first few
    read: int  # records read, usable or not (before --limit)

    def describe(self) -> dict:
        return {"uri": self.uri, "fingerprint": self.fingerprint, "kind": self.kind, "records": len(self.records),
                "records_read": self.read, "skipped": dict(self.skipped)}


def build_record(raw: Any, index: int, where: str) -> Union[EvalRecord, Skip]:
    """One decoded record → an EvalRecord, or why it cannot be scored."""
    if not isinstance(raw, dict):
        return Skip("not an object")
    prompt, messages = raw.get("prompt"), raw.get("messages")
    if prompt is None and messages is None:
        return Skip("neither prompt nor messages")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            return Skip("prompt is not a non-empty string")
    else:
        messages = read_message_list(raw, "messages")
        if isinstance(messages, Skip):
            return messages
        if not messages:
            return Skip("empty messages")
        if messages[-1]["role"] == "assistant":
            return Skip("messages end with an assistant turn (nothing left to answer)")
    record = EvalRecord(index, where, GENERATION, prompt=prompt, messages=messages if prompt is None else None)
    answer = raw.get("answer")
    if raw.get("choices") is not None:
        choices = raw["choices"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            return Skip("choices is not a list of two or more non-empty strings")
        if answer is None:
            return Skip("choices without an answer index")
        if isinstance(answer, bool) or not isinstance(answer, int):
            return Skip("answer of a multiple-choice record is not an index")
        if not 0 <= answer < len(choices):
            return Skip(f"answer index {answer} out of range for {len(choices)} choices")
        record.kind, record.choices, record.answer_index = MULTIPLE_CHOICE, list(choices), answer
        return record
    if answer is None:
        return Skip("missing answer")
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        return Skip("answer is not a string or a list of strings")
    if any(not a.strip() for a in answers):
        # An empty (or blank) accepted answer is in every prediction: `contains` would score the
        # record right whatever the model says.
        return Skip("an answer is empty")
    record.answers = list(answers)
    return record


def list_set_files(store: Store, uri: str, key: str = "eval.uri") -> list[tuple[str, str]]:
    """(URI, jsonl|parquet) of the set: the file itself, or the files under a prefix in name order."""
    def kind_of(name: str) -> Optional[str]:
        return next((k for suffix, k in SUFFIXES.items() if name.endswith(suffix)), None)

    try:
        if store.exists(uri):
            kind = kind_of(uri)
            if kind is None:
                raise EvalSetError(f"{key} {uri}: not a .jsonl, .json or .parquet file")
            return [(uri, kind)]
        names = sorted(n for n in store.list_files(uri) if kind_of(n))
    except StorageError as err:
        raise EvalSetError(f"{key} {uri}: cannot read ({err})") from None
    if not names:
        raise EvalSetError(f"{key} {uri}: no record set there (a .jsonl or .parquet file, or a prefix of them)")
    return [(join(uri, n), kind_of(n)) for n in names]


def iter_raw_records(data: bytes, kind: str, name: str, key: str = "eval.uri"):
    """(where, decoded record or Skip) of one file's bytes."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(io.BytesIO(data)).to_pylist()
        except Exception as err:  # noqa: BLE001: any unreadable file is one line naming it
            raise EvalSetError(f"{key} {name}: not a readable Parquet file ({type(err).__name__})") from None
        for i, row in enumerate(rows):
            yield f"{name}:row {i}", row
        return
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{name}:{number}", json.loads(line.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            yield f"{name}:{number}", Skip("bad JSON")


def load_eval_set(store: Store, ecfg: EvalConfig, limit: Optional[int] = None) -> EvalSet:
    """Read, validate and fingerprint the set; the first `limit` usable records (all without one).
    Fails in one line, before any model is loaded, on a set that is missing, mixed, over its bad-record
    limit, or whose records do not fit `eval.metric`."""
    key = ecfg._key
    files = list_set_files(store, ecfg.uri, f"{key}.uri")
    digest = hashlib.sha256()
    records: list[EvalRecord] = []
    skipped: dict[str, int] = {}
    bad: list[str] = []
    read = 0
    for uri, kind in files:
        try:
            data = store.read_bytes(uri)
        except StorageError as err:
            raise EvalSetError(f"{key}.uri {uri}: cannot read ({err})") from None
        name = uri.rsplit("/", 1)[-1]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
        for where, raw in iter_raw_records(data, kind, name, f"{key}.uri"):
            read += 1
            record = raw if isinstance(raw, Skip) else build_record(raw, len(records), where)
            if isinstance(record, Skip):
                skipped[record.reason] = skipped.get(record.reason, 0) + 1
                if len(bad) < 20:
                    bad.append(f"{where}: {record.reason}")
                continue
            records.append(record)
    total_skipped = sum(skipped.values())
    if total_skipped > ecfg.max_bad_records:
        raise EvalSetError(f"{key}.uri {ecfg.uri}: {total_skipped} records cannot be scored (more than "
                           f"{key}.max_bad_records {ecfg.max_bad_records}), the first: {bad[0]}")
    if not records:
        raise EvalSetError(f"{key}.uri {ecfg.uri}: no record can be scored"
                           + (f" (the first: {bad[0]})" if bad else " (the set is empty)"))
    kinds = {r.kind for r in records}
    if len(kinds) > 1:
        first_gen = next(r for r in records if r.kind == GENERATION)
        first_mc = next(r for r in records if r.kind == MULTIPLE_CHOICE)
        raise EvalSetError(f"{key}.uri {ecfg.uri}: mixes generation records ({first_gen.where}) and multiple-choice "
                           f"records ({first_mc.where}); keep each kind in a set of its own")
    kind = kinds.pop()
    pick_metric(ecfg, kind)
    if limit is not None:
        records = records[:limit]
    return EvalSet(ecfg.uri, records, kind, digest.hexdigest(), skipped, bad, read)


def pick_metric(ecfg: EvalConfig, kind: str) -> str:
    """eval.metric, or the default for the set's kind; a metric that does not fit is a config error."""
    if ecfg.metric is None:
        return "exact_match" if kind == GENERATION else "acc"
    fits = GENERATION_METRICS if kind == GENERATION else CHOICE_METRICS
    if ecfg.metric not in fits:
        what = "generation records (prompt + answer)" if kind == GENERATION else "multiple-choice records (choices)"
        raise ConfigError(f"{ecfg._key}.metric {ecfg.metric}: {ecfg._key}.uri {ecfg.uri} holds {what}; use one of "
                           f"{', '.join(fits)}")
    return ecfg.metric
