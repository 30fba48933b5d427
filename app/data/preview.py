"""`eft prepare CONFIG --preview N`: the first N records as prepare turns them into tokens, shown, not written.

Nothing here has rules of its own: the records are read by the parse functions both engines run
(parse_jsonl_files, parse_parquet_rows), checked and rendered by the same build_document /
ChatFormat, and tokenized by the same TokenizeDocuments, with the config's seq_len and overlong
mode; so the ids and labels shown are the ones prepare packs for those records. Only the head of
the input is read (the first N non-blank JSONL lines, the first N Parquet rows); nothing is written
and Ray is not started. Config problems (no template, unreadable input) fail as prepare fails.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.batch import IGNORE_INDEX
from app.config import JobConfig
from app.data.chat import ChatFormat
from app.data.engines import (
    InputFiles, PrepareError, TokenizeDocuments, document_fields, list_input_files, load_chat_format, load_tokenizer,
    number_parquet_rows, parse_jsonl_files, parse_parquet_rows
)
from app.data.prepare import describe_tokenizer, tokenizer_spec
from app.hub import resolve_model
from app.storage import Store

READ_CHUNK = 1 << 20
TRAINED_STYLE = "bold green"
MASKED_STYLE = "dim"


class PreviewRecord(NamedTuple):
    source: str
    line: int  # 1-based line (JSONL) or row (Parquet) in `source`
    reason: Optional[str]  # why prepare skips it; None for a used record
    input_ids: list[int]  # what prepare packs for it (empty when skipped or dropped)
    labels: list[int]
    overlong: Optional[str]  # "split", "truncated" or "dropped" when longer than data.seq_len
    full_ids: list[int]  # the whole document's tokens (differ from input_ids when truncated or dropped)
    full_labels: list[int]
    chosen_tokens: Optional[int] = None  # a preference pair: input_ids is chosen + rejected, this many chosen

    @property
    def trained(self) -> int:
        return int(np.count_nonzero(np.asarray(self.labels, dtype=np.int64) != IGNORE_INDEX))

    @property
    def masked(self) -> int:
        return len(self.labels) - self.trained


def read_head_lines(inputs: InputFiles, path: str, count: int) -> bytes:
    """The start of a JSONL file through its `count`-th non-blank line (the whole file if shorter)."""
    buf = b""
    try:
        with inputs.fs.open_input_stream(path) as stream:
            while True:
                chunk = stream.read(READ_CHUNK)
                buf += chunk
                lines = buf.split(b"\n")
                complete = lines if not chunk else lines[:-1]
                seen = 0
                for i, line in enumerate(complete):
                    seen += bool(line.strip())
                    if seen == count:
                        return b"\n".join(lines[:i + 1])
                if not chunk:
                    return buf
    except OSError as err:
        raise PrepareError(f"cannot read input file {path}: {err}") from None


def head_documents(cfg: JobConfig, inputs: InputFiles, count: int, chat: Optional[ChatFormat]) -> pa.Table:
    """The first `count` records of the inputs, in prepare's order, as a DOCUMENT_SCHEMA table."""
    fields, tables, have = document_fields(cfg, chat), [], 0
    for path in inputs.paths:
        if have >= count:
            break
        want = count - have
        if cfg.prepare.input_format == "jsonl":
            batch = {"bytes": [read_head_lines(inputs, path, want)], "path": [path]}
            tables += list(parse_jsonl_files(batch, inputs.base, fields, want))
        else:
            try:
                with inputs.fs.open_input_file(path) as source:
                    for rows in pq.ParquetFile(source).iter_batches(want):
                        table = pa.Table.from_batches([rows]).append_column("path", pa.array([path] * rows.num_rows))
                        table = parse_parquet_rows(table, inputs.base, fields)
                        # Numbered as prepare's driver numbers them: rows of each file from 1.
                        lines = number_parquet_rows(table["source"].to_pylist(), Counter())
                        tables.append(table.set_column(table.schema.get_field_index("line"), "line", pa.array(lines)))
                        break
            except pa.ArrowInvalid as err:
                raise PrepareError(f"input file {path} is not valid Parquet: {err}") from None
            except OSError as err:
                raise PrepareError(f"cannot read input file {path}: {err}") from None
        have = sum(t.num_rows for t in tables)
    return pa.concat_tables(tables).slice(0, count) if tables else None


def preview_records(cfg: JobConfig, count: int, store: Optional[Store] = None):
    """(tokenizer, [PreviewRecord]) for the first `count` records of cfg's input. Reads only."""
    if cfg.prepare is None:
        raise PrepareError("config has no `prepare` section (set prepare.input_uri)")
    if count < 1:
        raise PrepareError(f"--preview needs a positive number of records, got {count}")
    if cfg.prepare.inputs is not None:
        raise PrepareError("--preview takes a single prepare.input_uri; preview each of prepare.inputs on its own")
    store = store or Store.from_config(cfg.storage)
    # A hub id: its pinned mirror, made now if there is none (the prepare that follows needs it);
    # the dataset is still not written.
    cfg, _ = resolve_model(cfg, store)
    tokenizer = load_tokenizer(store, cfg.tokenizer_uri)
    chat = load_chat_format(cfg, store, tokenizer)
    inputs = list_input_files(store, cfg.prepare.input_uri, cfg.prepare.input_format)
    spec = tokenizer_spec(cfg, store, tokenizer, describe_tokenizer(cfg, store, tokenizer))
    documents = head_documents(cfg, inputs, count, chat)
    if documents is None or not documents.num_rows:
        return tokenizer, []
    tokenized = TokenizeDocuments(spec, cfg.data.seq_len, cfg.prepare.overlong_mode)(documents)
    whole = tokenized
    if any(o in ("truncated", "dropped") for o in tokenized["overlong"].to_pylist()):
        whole = TokenizeDocuments(spec, None, "split")(documents)  # the same documents, uncut
    records = [
        PreviewRecord(source, line, reason, ids, labels, overlong, full_ids, full_labels, chosen)
        for source, line, reason, ids, labels, overlong, chosen, full_ids, full_labels in zip(
            *(tokenized[c].to_pylist() for c in ("source", "line", "reason", "input_ids", "labels", "overlong",
                                                 "chosen_tokens")),
            whole["input_ids"].to_pylist(), whole["labels"].to_pylist())
    ]
    return tokenizer, records


def first_trained(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


# -- rendering -----------------------------------------------------------------------------------

def tokenizer_has_template(tokenizer, cfg: JobConfig) -> bool:
    return bool(cfg.prepare.chat_template or tokenizer.chat_template)


def render_pair(console, tokenizer, record: PreviewRecord) -> None:
    """A preference pair: the prompt once (the chosen document up to its first trained token), then
    each completion from its first trained token, with its trained spans."""
    from rich.text import Text

    cut = record.chosen_tokens
    halves = {"chosen": (record.input_ids[:cut], record.labels[:cut]),
              "rejected": (record.input_ids[cut:], record.labels[cut:])}
    trained = {name: sum(label != IGNORE_INDEX for label in labels) for name, (_, labels) in halves.items()}
    console.print(Text(f"{len(record.input_ids)} tokens in one row: chosen {cut} ({trained['chosen']} trained), "
                       f"rejected {len(record.input_ids) - cut} ({trained['rejected']} trained)"))
    ids, labels = halves["chosen"]
    start = first_trained(labels)
    text = Text("prompt: ", style="bold")
    for piece, _ in decode_runs(tokenizer, ids[:start], labels[:start]):
        text.append(piece, style=MASKED_STYLE)
    console.print(text, soft_wrap=True)
    for name, (ids, labels) in halves.items():
        begin = first_trained(labels)
        text = Text(f"{name}: ", style="bold")
        for piece, is_trained in decode_runs(tokenizer, ids[begin:], labels[begin:]):
            text.append(piece, style=TRAINED_STYLE if is_trained else MASKED_STYLE)
        console.print(text, soft_wrap=True)


def decode_runs(tokenizer, ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """The tokens decoded as the model sees them, cut into (text, trained) runs. Each run is the
    growth of the decoded prefix, so runs join to decode(ids) (a sentencepiece space or a character
    split over tokens stays whole); a run that does not extend the prefix is decoded alone."""
    runs: list[tuple[str, bool]] = []
    start, decoded = 0, ""
    for end in range(1, len(ids) + 1):
        trained = labels[start] != IGNORE_INDEX
        if end < len(ids) and (labels[end] != IGNORE_INDEX) == trained:
            continue
        text = tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        piece = text[len(decoded):] if text.startswith(decoded) else tokenizer.decode(
            ids[start:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        runs.append((piece, trained))
        start, decoded = end, text
    return runs


def render_preview(console, tokenizer, records: list[PreviewRecord], cfg: JobConfig) -> None:
    from rich.text import Text

    p = cfg.prepare
    console.print(Text.assemble(
        f"preview of {len(records)} record(s) of {p.input_uri} (format {p.format}, seq_len {cfg.data.seq_len}): ",
        ("trained", TRAINED_STYLE), " / ", ("masked", MASKED_STYLE), "; nothing is written"))
    if p.format == "preference":
        console.print(Text("pairs of plain strings are rendered by the chat template as one user turn (the prompt) "
                           "and one assistant turn (each completion)" if tokenizer_has_template(tokenizer, cfg)
                           else "pairs of plain strings are the prompt's text followed by each completion's"))
    for record in records:
        console.rule(Text(f"{record.source}:{record.line}"))
        if record.reason is not None:
            console.print(Text(f"skipped: {record.reason}"))
            continue
        if record.chosen_tokens is not None:
            render_pair(console, tokenizer, record)
            continue
        counts = f"{len(record.labels)} tokens: {record.trained} trained, {record.masked} masked"
        if record.overlong == "dropped":
            console.print(Text(f"{counts} (dropped: {len(record.full_ids)} tokens, longer than data.seq_len "
                               f"{cfg.data.seq_len}; prepare.overlong is {p.overlong_mode})"))
        elif record.overlong == "truncated":
            console.print(Text(f"{counts} (truncated from {len(record.full_ids)} tokens to fit data.seq_len "
                               f"{cfg.data.seq_len})"))
        elif record.overlong == "split":
            console.print(Text(f"{counts} (longer than data.seq_len {cfg.data.seq_len}: continues in the next row)"))
        else:
            console.print(Text(counts))
        shown_ids, shown_labels = record.input_ids, record.labels
        if record.overlong == "dropped":
            shown_ids, shown_labels = record.full_ids, [IGNORE_INDEX] * len(record.full_ids)
        text = Text()
        for piece, trained in decode_runs(tokenizer, shown_ids, shown_labels):
            text.append(piece, style=TRAINED_STYLE if trained else MASKED_STYLE)
        console.print(text, soft_wrap=True)
    used = [r for r in records if r.reason is None and r.overlong != "dropped"]
    console.rule()
    console.print(Text(f"{len(records)} record(s): {len(used)} used, "
                       f"{sum(r.reason is not None for r in records)} skipped, "
                       f"{sum(r.overlong == 'dropped' for r in records)} dropped as over-long; "
                       f"{sum(r.trained for r in used)} trained and {sum(r.masked for r in used)} masked tokens"))
