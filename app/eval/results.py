"""Where eval results live, and reading them back.

`<run>/eval/<label>/` (label `base`, `step-000120`, `export-step-000120`, ...) holds
`predictions.jsonl` (one line per record) and `results.json` (the score, its interval, the set's
fingerprint, the checkpoint and the decoding settings). results.json is written last: a label
without it is an evaluation that never finished, and readers skip it.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from app.storage import Store, StorageError, join

log = logging.getLogger(__name__)

EVAL_DIR = "eval"
RESULTS = "results.json"
PREDICTIONS = "predictions.jsonl"


def step_label(step: int) -> str:
    return f"step-{step:06d}"


def eval_uri(run_uri: str, label: str) -> str:
    return join(run_uri, EVAL_DIR, label)


def save_results(store: Store, run_uri: str, label: str, predictions: list[dict], results: dict) -> str:
    """Committed or absent: an earlier result under the label goes first (its results.json with it),
    the predictions next, results.json last."""
    out = eval_uri(run_uri, label)
    if store.list_files(out):
        store.delete_prefix(out)
    store.write_text(join(out, PREDICTIONS), "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in predictions))
    store.write_json(join(out, RESULTS), results)
    return out


def load_results(store: Store, run_uri: str) -> list[dict]:
    """Every finished evaluation of the run: base first, then by step (exports after their step)."""
    found = []
    try:
        labels = store.list_dirs(join(run_uri, EVAL_DIR))
    except (StorageError, OSError):
        return []
    for label in labels:
        try:
            found.append(store.read_json(join(run_uri, EVAL_DIR, label, RESULTS)))
        except (StorageError, OSError, ValueError):
            continue  # unfinished (no results.json yet) or unreadable: not a result
    return sorted(found, key=lambda r: (r.get("step") is not None, r.get("step") or 0,
                                        r["label"].startswith("export"), r["label"]))


def load_predictions(store: Store, run_uri: str, label: str, limit: Optional[int] = None) -> list[dict]:
    text = store.read_text(join(eval_uri(run_uri, label), PREDICTIONS))
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows[:limit] if limit is not None else rows
