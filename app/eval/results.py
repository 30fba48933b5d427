"""Where eval results live, and reading them back.

`<run>/eval/<label>/` (label `base`, `step-000120`, `export-step-000120`, ...) holds one directory
per eval set, `<set>/predictions.jsonl` (one line per record) and `<set>/results.json` (the score,
its interval, the set's fingerprint, the checkpoint and the decoding settings); `harness/` with
lm-evaluation-harness's own results JSON (`results.json`) and its per-sample lines
(`samples_<task>.jsonl`); and `summary.json`, every set's and task's score, rebuilt from what is
there after each of them. A set's results.json is written last: a set without it is an evaluation
that never finished, and readers skip it. Scoring one set never touches another's directory.
Results of eft before named sets (`<label>/results.json`) read as the set `default`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

from app.config import DEFAULT_SET, HARNESS_DIR
from app.storage import Store, StorageError, join

log = logging.getLogger(__name__)

EVAL_DIR = "eval"
RESULTS = "results.json"
PREDICTIONS = "predictions.jsonl"
SUMMARY = "summary.json"


def step_label(step: int) -> str:
    return f"step-{step:06d}"


def eval_uri(run_uri: str, label: str, set_name: Optional[str] = None) -> str:
    return join(run_uri, EVAL_DIR, label, set_name) if set_name else join(run_uri, EVAL_DIR, label)


def save_results(store: Store, run_uri: str, label: str, set_name: str, predictions: list[dict],
                 results: dict) -> str:
    """Committed or absent: an earlier result of the set under the label goes first (its
    results.json with it), the predictions next, results.json last."""
    out = eval_uri(run_uri, label, set_name)
    if store.list_files(out):
        store.delete_prefix(out)
    store.write_text(join(out, PREDICTIONS), "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in predictions))
    store.write_json(join(out, RESULTS), results)
    return out


def read_json_or_none(store: Store, uri: str) -> Optional[dict]:
    try:
        return store.read_json(uri)
    except (StorageError, OSError, ValueError):
        return None  # unfinished (not written yet) or unreadable: not a result


def load_label_results(store: Store, run_uri: str, label: str) -> list[dict]:
    """Every finished set of one label, by set name."""
    base = eval_uri(run_uri, label)
    found = []
    legacy = read_json_or_none(store, join(base, RESULTS))
    if legacy is not None:
        found.append({**legacy, "set": legacy.get("set", DEFAULT_SET)})
    try:
        names = [n for n in store.list_dirs(base) if n != HARNESS_DIR]
    except (StorageError, OSError):
        names = []
    for name in names:
        results = read_json_or_none(store, join(base, name, RESULTS))
        if results is not None and not (legacy is not None and name == DEFAULT_SET):
            found.append({**results, "set": results.get("set", name)})
    return sorted(found, key=lambda r: r["set"])


def load_results(store: Store, run_uri: str) -> list[dict]:
    """Every finished set evaluation of the run: base first, then by step (exports after their
    step), each label's sets by name."""
    try:
        labels = store.list_dirs(join(run_uri, EVAL_DIR))
    except (StorageError, OSError):
        return []
    found = [r for label in labels for r in load_label_results(store, run_uri, label)]
    return sorted(found, key=lambda r: (r.get("step") is not None, r.get("step") or 0,
                                        r["label"].startswith("export"), r["label"], r["set"]))


def load_harness(store: Store, run_uri: str, label: str) -> Optional[dict]:
    """lm-eval's results JSON of a label, or None."""
    return read_json_or_none(store, join(eval_uri(run_uri, label), HARNESS_DIR, RESULTS))


def load_summaries(store: Store, run_uri: str) -> list[dict]:
    """Every label's summary.json, in load_results' order."""
    try:
        labels = store.list_dirs(join(run_uri, EVAL_DIR))
    except (StorageError, OSError):
        return []
    found = [s for s in (read_json_or_none(store, join(run_uri, EVAL_DIR, label, SUMMARY)) for label in labels) if s]
    return sorted(found, key=lambda s: (s.get("step") is not None, s.get("step") or 0,
                                        s["label"].startswith("export"), s["label"]))


def harness_scores(results: dict) -> dict[str, dict]:
    """One score per task of lm-eval's results JSON: its first metric (acc before acc_norm, as the
    task lists them; the metrics are those lm-eval says which way is better for), with lm-eval's
    standard error; groups included."""
    out = {}
    for task, metrics in (results.get("results") or {}).items():
        known = (results.get("higher_is_better") or {}).get(task)
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if (name in ("alias", "sample_len", "sample_count") or name.endswith("_stderr")
                    or (known and name not in known) or not isinstance(value, (int, float))):
                continue
            stderr = metrics.get(f"{name}_stderr,{filt}")
            out[task] = {"metric": name if filt in ("", "none") else f"{name},{filt}", "score": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                         "n": (results.get("n-samples") or {}).get(task, {}).get("effective")}
            break
    return out


def write_summary(store: Store, run_uri: str, label: str) -> dict:
    """`<label>/summary.json` from what is under the label now: every finished set, and the harness."""
    sets = load_label_results(store, run_uri, label)
    harness = load_harness(store, run_uri, label)
    step = next((r.get("step") for r in sets), (harness or {}).get("eft", {}).get("step"))
    summary = {
        "label": label, "step": step, "run_uri": run_uri,
        "sets": {r["set"]: {"metric": r["metric"], "score": r["score"], "interval": r["interval"], "n": r["n"],
                            "uri": r["eval_set"]["uri"], "fingerprint": r["eval_set"]["fingerprint"]}
                 for r in sets},
        "harness": harness_scores(harness) if harness else {},
        "updated_at": time.time(),
    }
    store.write_json(join(eval_uri(run_uri, label), SUMMARY), summary)
    return summary


def load_predictions(store: Store, run_uri: str, label: str, set_name: str = DEFAULT_SET,
                     limit: Optional[int] = None) -> list[dict]:
    base = eval_uri(run_uri, label)
    uri = join(base, set_name, PREDICTIONS)
    if set_name == DEFAULT_SET and not store.exists(uri) and store.exists(join(base, PREDICTIONS)):
        uri = join(base, PREDICTIONS)  # written before named sets
    rows = [json.loads(line) for line in store.read_text(uri).splitlines() if line.strip()]
    return rows[:limit] if limit is not None else rows
