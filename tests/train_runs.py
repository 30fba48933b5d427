"""The training run several test modules share (tests/conftest.py's `straight_run`): its config,
base model, dataset and eval set. tests/test_train.py asserts what the run did; tests/test_trust.py
plants pickles in a copy of it and resumes it with other identities and data, last."""

from __future__ import annotations

import json

from app.config import build_config
from app.storage import Store

BASE = "s3://eft/models/tiny-train"
DATA = "s3://eft/data/train-tests"
ROOT = "s3://eft/runs-tests"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EVAL_SET = "s3://eft/eval-sets/train-tests.jsonl"
CHOICE_SET = "s3://eft/eval-sets/train-tests-choices.jsonl"


def make_cfg(name: str, **sections):
    tree = {
        "name": name,
        "model": {"uri": BASE},
        # Dropout on: every trajectory test (resume, 3 → 2 → 1 workers, DDP = FSDP2) holds with
        # it, as the masks are keyed on rows, not ranks (app/model/dropout.py).
        "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ALL_LINEAR},
        "data": {"uri": DATA, "seq_len": 64, "validation_fraction": 0.05},
        "prepare": {"input_uri": "s3://eft/raw/train-tests.jsonl"},
        # A constant LR: a run extended from 6 to 12 steps must follow the 12-step run exactly.
        "training": {"max_steps": 12, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-2,
                     "schedule": "constant", "eval_every_steps": 6, "trace_rows": True},
        "checkpoint": {"save_every_steps": 6, "num_to_keep": 2},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": ROOT},
    }
    for key, value in sections.items():
        if value is None:
            tree[key] = None
        else:
            tree[key] = {**(tree.get(key) or {}), **value}
    return build_config(tree)


def write_eval_set() -> str:
    """Twelve prompts cut from the corpus, each answered by how its text goes on."""
    from app.dev.tiny import build_corpus

    records = [{"prompt": t[:48], "answer": t[48:60]} for t in build_corpus(max_docs=12)]
    Store().write_text(EVAL_SET, "".join(json.dumps(r) + "\n" for r in records))
    return EVAL_SET


def write_choice_set() -> str:
    """Six prompts cut from the corpus, each with its own continuation and another text's."""
    from app.dev.tiny import build_corpus

    texts = build_corpus(max_docs=12)[:6]
    records = [{"prompt": t[:48], "choices": [t[48:60], texts[(i + 1) % 6][48:60]], "answer": 0}
               for i, t in enumerate(texts)]
    Store().write_text(CHOICE_SET, "".join(json.dumps(r) + "\n" for r in records))
    return CHOICE_SET


def straight_config():
    """The reference run: 12 steps on 2 workers, its checkpoints scored on two eval sets: the
    generation set (`default`) and a multiple-choice one (`choices`)."""
    return make_cfg("straight", eval={"uri": write_eval_set(), "sets": {"choices": {"uri": write_choice_set()}},
                                      "every_checkpoints": 1, "max_new_tokens": 8, "batch_size": 4})
