"""Raw record → document, or the reason it is skipped. Pure functions, no Ray, no tokenizer.

A document is a `Document(text, prompt)`: for the "text" format `prompt` is None and the
whole `text` is trained on; for the "instruction" format `prompt` is the instruction (masked
out of the loss) and `text` the response. A "preference" record is one pair: the chosen
document, whose `rejected` is the rejected one, both with the same prompt. Skip reasons are
short, fixed strings so the manifest can count them by reason.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional, Union


class Document(NamedTuple):
    text: str
    prompt: Optional[str] = None
    # Chat formats (app/data/chat.py): `text` is the rendered conversation, `spans` the flat
    # (start, end) character pairs to train and `turn_ends` where each assistant turn ends.
    spans: Optional[tuple[int, ...]] = None
    turn_ends: Optional[tuple[int, ...]] = None
    # Preference pairs: this document is the chosen one, `rejected` the other (same prompt).
    rejected: Optional["Document"] = None


class Skip(NamedTuple):
    reason: str


Parsed = Union[Document, Skip]


def parse_json_line(line: Union[bytes, str]) -> Union[Any, Skip]:
    """One JSONL line → the decoded value, or a Skip."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8-sig")  # tolerate a byte-order mark on the first line
        except UnicodeDecodeError:
            return Skip("not UTF-8")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return Skip("bad JSON")


def read_text_field(record: dict, field: str) -> Union[str, Skip]:
    """A non-empty string field, or why it is unusable (null counts as missing: Parquet has no absent)."""
    value = record.get(field)
    if value is None:
        return Skip(f"missing field {field!r}")
    if not isinstance(value, str):
        return Skip(f"field {field!r} is not a string")
    if not value.strip():
        return Skip(f"empty {field}")
    return value


def build_text_document(record: Any, text_field: str = "text") -> Parsed:
    if not isinstance(record, dict):
        return Skip("not an object")
    text = read_text_field(record, text_field)
    return text if isinstance(text, Skip) else Document(text)


def build_instruction_document(record: Any, prompt_field: str = "instruction",
                               response_field: str = "response") -> Parsed:
    if not isinstance(record, dict):
        return Skip("not an object")
    prompt = read_text_field(record, prompt_field)
    if isinstance(prompt, Skip):
        return prompt
    response = read_text_field(record, response_field)
    return response if isinstance(response, Skip) else Document(response, prompt)


def build_preference_document(record: Any, prompt_field: str = "prompt", chosen_field: str = "chosen",
                              rejected_field: str = "rejected", chat=None) -> Parsed:
    """TRL's preference forms → the chosen Document holding the rejected one:
    - standard, three strings: the prompt then each completion as text (masked prompt, as the
      instruction format), or, when there is a chat template (`chat`), one user turn and one
      assistant turn rendered by it;
    - conversational, three lists of messages: `prompt + chosen` and `prompt + rejected` rendered by
      the chat template; only the completion's assistant turns are trained."""
    if not isinstance(record, dict):
        return Skip("not an object")
    values = [record.get(f) for f in (prompt_field, chosen_field, rejected_field)]
    if all(isinstance(v, list) for v in values):
        if chat is None:
            return Skip("conversational pair without a chat template")
        return chat.pair_document(record, prompt_field, chosen_field, rejected_field)
    if any(isinstance(v, list) for v in values) and not any(v is None for v in values):
        return Skip("prompt, chosen and rejected mix text and messages")
    texts = [read_text_field(record, f) for f in (prompt_field, chosen_field, rejected_field)]
    for text in texts:
        if isinstance(text, Skip):
            return text
    prompt, chosen, rejected = texts
    if chosen == rejected:
        return Skip("chosen equals rejected")
    if chat is not None:
        return chat.pair_document({"prompt": [{"role": "user", "content": prompt}],
                                   "chosen": [{"role": "assistant", "content": chosen}],
                                   "rejected": [{"role": "assistant", "content": rejected}]},
                                  "prompt", "chosen", "rejected")
    return Document(chosen, prompt, rejected=Document(rejected, prompt))


def build_document(record: Any, fmt: str = "text", text_field: str = "text",
                   prompt_field: str = "instruction", response_field: str = "response", chat=None,
                   chosen_field: str = "chosen", rejected_field: str = "rejected") -> Parsed:
    """A decoded record (a JSON value or a Parquet row dict) → Document or Skip. The chat formats
    need `chat`, an app.data.chat.ChatFormat (the template and how to read the records); the
    preference format uses it when there is one."""
    if isinstance(record, Skip):
        return record
    if fmt == "preference":
        return build_preference_document(record, prompt_field, chosen_field, rejected_field, chat)
    if fmt in ("chat", "sharegpt"):
        if chat is None:
            raise ValueError(f"format {fmt!r} needs a ChatFormat")
        return chat.document(record)
    if fmt == "text":
        return build_text_document(record, text_field)
    if fmt == "instruction":
        return build_instruction_document(record, prompt_field, response_field)
    raise ValueError(f"unknown record format {fmt!r} (expected 'text', 'instruction', 'chat', 'sharegpt' or "
                     f"'preference')")


def parse_jsonl_block(lines: list[bytes], fmt: str = "text", text_field: str = "text",
                      prompt_field: str = "instruction", response_field: str = "response",
                      chat=None, **pair_fields: str) -> Optional[list[Parsed]]:
    """Non-blank JSONL lines → one Document or Skip per line, as parse_jsonl_line gives them, decoded
    by Arrow's JSON reader (C++, outside the GIL: several times faster than json.loads per line).

    Returns None when Arrow cannot read the block exactly as json.loads does, and the caller parses
    line by line: Arrow rejects the whole block for any line that is bad JSON or not UTF-8, is not an
    object, repeats a key, or holds a used field that is not a string or null. Only the used fields
    are read (as strings), so other fields may hold anything. Conversations (lists of objects) are
    always parsed line by line, and so are preference pairs (either form may hold messages)."""
    if fmt not in ("text", "instruction"):
        return None
    import pyarrow as pa
    import pyarrow.json as pa_json

    names = [text_field] if fmt == "text" else [prompt_field, response_field]
    schema = pa.schema([(name, pa.string()) for name in dict.fromkeys(names)])
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    data = b"\n".join(lines)
    try:
        table = pa_json.read_json(pa.BufferReader(data), parse_options=options,
                                  read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1))
        # Arrow does not check UTF-8 inside strings; Python's decoding of the columns does.
        columns = {name: table.column(name).to_pylist() for name in schema.names}
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    if table.num_rows != len(lines):
        return None
    # Each row as the record json.loads would give for the used fields (absent reads as null, as it
    # does in read_text_field), through the same rules as the line-by-line path.
    return [build_document(dict(zip(schema.names, row)), fmt, text_field, prompt_field, response_field)
            for row in zip(*columns.values())]


def parse_jsonl_line(line: Union[bytes, str], fmt: str = "text", **fields: str) -> Parsed:
    """One raw JSONL line → Document or Skip."""
    return build_document(parse_json_line(line), fmt, **fields)
