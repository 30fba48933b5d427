"""What the two spot rehearsals share (tests/scenarios/spot.py runs both on one multi-node
cluster): the DPO run's base and pairs (tests/test_elastic.py asserts on it) and GRPO's prompt
set and job (tests/test_grpo.py: its straight run on the session's cluster, its reclaimed run in
the scenario). One cluster start and one scenario driver instead of one each."""

from __future__ import annotations

import json

from app.config import build_config
from app.storage import Store

# -- DPO on packed pairs with precomputed reference log-probs (tests/test_elastic.py) ------------
DPO_BASE, DPO_DATA = "s3://eft/models/tiny-spot", "s3://eft/data/spot"
DPO_SEQ_LEN = 96  # as the scenario's: a pair of the pydoc topics' short answers fits

# -- GRPO on the parity prompts (tests/test_grpo.py) ---------------------------------------------
GRPO_MODEL = "s3://eft/models/tiny-grpo"
GRPO_DATA = "s3://eft/data/grpo-parity"
GRPO_RAW = "s3://eft/raw/grpo/parity.jsonl"
GRPO_STEPS = 40  # the straight run's; the reclaimed run needs room for its notice, grow and kill
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_dpo_pairs(tmp_dir) -> dict:
    """The DPO run's tiny base and every pair the pydoc topics give (469 rows, 39 steps an epoch:
    the notice comes with several steps left before the first epoch opening, which the late save
    then comes before, rather than at the notice step itself), prepared with the reference pass.
    Needs the session's S3 and Ray. Returns the manifest."""
    from conftest import build_tiny_preference_dataset

    return build_tiny_preference_dataset(build_config({
        "name": "p", "model": {"uri": DPO_BASE}, "data": {"uri": DPO_DATA, "seq_len": DPO_SEQ_LEN}, "lora": {"r": 8},
        "prepare": {"input_uri": "s3://eft/raw/spot-pairs.jsonl", "format": "preference"},
        "storage": {"root_uri": "s3://eft/runs-spot"}, "training": {"max_steps": 1, "objective": "dpo"}}),
        tmp_dir, per_topic=1000)


def grpo_cfg(name: str, **sections):
    """GRPO's job: 2 workers (FSDP2, LoRA) on the shipped chat base, 4 prompts x 4 completions a
    step; `sections` override keys (None drops a section or a key)."""
    tree = {
        "name": name, "model": {"uri": GRPO_MODEL},
        "lora": {"r": 8, "alpha": 16, "target_modules": ALL_LINEAR},
        "data": {"uri": GRPO_DATA, "seq_len": 64, "validation_fraction": 0.1},
        "prepare": {"input_uri": GRPO_RAW, "format": "prompts"},
        "training": {"objective": "grpo", "max_steps": GRPO_STEPS, "micro_batch_size": 4, "lr": 2e-2,
                     "schedule": "constant", "parallelism": "fsdp"},
        "rl": {"rewards": [{"reward": "exact_match"}, {"reward": "app.dev.tasks:brevity_reward", "weight": 1.0}],
               "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "checkpoint": {"save_every_steps": 6},
        "scaling": {"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        "storage": {"root_uri": "s3://eft/runs-grpo"},
    }
    for key, value in sections.items():
        tree[key] = None if value is None else {k: v for k, v in {**(tree.get(key) or {}), **value}.items()
                                                if v is not None}
    return build_config(tree)


def grpo_spot_cfg():
    """The straight run's job, sampling colocated, elastic between 1 and 2 workers on the
    scenario's nodes: what goes through the notice, the grow and the kill."""
    from app.dev.chaos import elastic_scaling

    return grpo_cfg("grpo-spot", scaling=elastic_scaling(min_workers=1, max_workers=2),
                    checkpoint={"save_every_steps": 4, "preemption_margin_s": 5.0},
                    fault_tolerance={"max_failures": 2})


def prepare_grpo_prompts():
    """The shipped chat base at GRPO_MODEL and 200 parity prompts, two of them bad (no answer, not
    JSON), prepared with `prepare.format: prompts`. Needs the session's S3 and Ray. Returns
    (config, manifest)."""
    from app.dev.tasks import build_task_records
    from app.dev.tiny import SHIPPED_BASE
    from app.rl.prompts import prepare_prompts

    store = Store()
    store.upload_dir(str(SHIPPED_BASE), GRPO_MODEL, last=("config.json",))
    _, records = build_task_records(0, 200, seed=3)
    lines = [json.dumps(r) for r in records]
    lines[5] = json.dumps({"prompt": "no answer here"})
    lines[7] = "{not json"
    store.write_text(GRPO_RAW, "\n".join(lines) + "\n")
    cfg = grpo_cfg("prep")
    return cfg, prepare_prompts(cfg, store)
