"""Raw record → document, or the reason it is skipped. Pure functions, no Ray, no tokenizer.

A document is a `Document(text, prompt)`: for the "text" format `prompt` is None and the
whole `text` is trained on; for the "instruction" format `prompt` is the instruction (masked
out of the loss) and `text` the response. Skip reasons are short, fixed strings so the
manifest can count them by reason.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional, Union


class Document(NamedTuple):
    text: str
    prompt: Optional[str] = None


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


def build_document(record: Any, fmt: str = "text", text_field: str = "text",
                   prompt_field: str = "instruction", response_field: str = "response") -> Parsed:
    """A decoded record (a JSON value or a Parquet row dict) → Document or Skip."""
    if isinstance(record, Skip):
        return record
    if fmt == "text":
        return build_text_document(record, text_field)
    if fmt == "instruction":
        return build_instruction_document(record, prompt_field, response_field)
    raise ValueError(f"unknown record format {fmt!r} (expected 'text' or 'instruction')")


def parse_jsonl_line(line: Union[bytes, str], fmt: str = "text", **fields: str) -> Parsed:
    """One raw JSONL line → Document or Skip."""
    return build_document(parse_json_line(line), fmt, **fields)
