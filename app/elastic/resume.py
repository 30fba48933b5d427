"""May this run resume from what its name already holds? Checked by the driver before Ray starts.

Every checkpoint's sidecar (and train_state.json) records its lineage: the dataset it trained on
(data.uri and a fingerprint of its manifest) and the run's identity keys. Re-running a name with
a config whose identity differs is refused, naming the keys; a different dataset is refused too,
unless `checkpoint.resume_on_new_data` says to continue on the new data.

Identity keys are the ones that decide what the saved tensors are or what the data position in
them means: the base model, whether LoRA is on and its shape and scale, and the seed that orders
the rows. Everything else (steps, learning rate and schedule, batch sizes, logging, evaluation,
checkpoint cadence, scaling, parallelism, precision, storage) may change on a resume: DCP
reshards, the LR schedule counts steps, and the data position is a row count. lora.quantize_base
counts as precision: the adapters are the same tensors over an NF4 or a bf16 base.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional

import yaml

from app.data.manifest import load_manifest
from app.elastic import checkpoint as ckpt
from app.hub import describe_sha_change, is_hub_uri, resolve_model
from app.storage import Store, join

log = logging.getLogger("eft.resume")

CONFIG_FILE = "config.yaml"
OVERRIDE_KEY = "checkpoint.resume_on_new_data"


class ResumeError(RuntimeError):
    """A run cannot resume with this config, reported as one line naming the keys at fault."""


def dataset_fingerprint(manifest: dict) -> str:
    """sha256 of the manifest in canonical JSON. A manifest is the dataset's commit: every prepare
    writes a new one (new shard prefix, its own row counts), so the fingerprint names exactly the
    rows the data position counts through."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def build_identity(tree: dict) -> dict:
    """The identity keys of a config tree (a `JobConfig` dumped as JSON, or a stored config.yaml)."""
    lora = tree.get("lora")
    return {
        "model.uri": (tree.get("model") or {}).get("uri"),
        # Order of target modules does not change which adapters exist.
        "lora": None if lora is None else {"r": lora.get("r"), "alpha": float(lora.get("alpha", 0)),
                                           "target_modules": sorted(lora.get("target_modules") or [])},
        "training.seed": (tree.get("training") or {}).get("seed", 0),
    }


def build_lineage(cfg, manifest: dict) -> dict:
    """What a checkpoint of `cfg` records about what it was trained from."""
    return {"dataset": {"uri": cfg.data.uri, "fingerprint": dataset_fingerprint(manifest)},
            "identity": build_identity(cfg.model_dump(mode="json"))}


def describe_identity_change(stored: dict, current: dict) -> list[str]:
    changes = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        if old == new:
            continue
        if key == "lora" and old is not None and new is not None:
            changes += [f"lora.{k} {old.get(k)} → {new.get(k)}" for k in sorted(set(old) | set(new))
                        if old.get(k) != new.get(k)]
        elif key == "lora":
            changes.append(f"lora {'r=%s' % old['r'] if old else 'off'} → {'r=%s' % new['r'] if new else 'off'}")
        elif key == "model.uri" and (moved := describe_sha_change(old, new)):
            changes.append(f"{key} {old} → {new} ({moved})")
        else:
            changes.append(f"{key} {old} → {new}")
    return changes


def load_run_config(store: Store, run_uri: str) -> Optional[dict]:
    """The run's stored config.yaml as a plain tree, not a `JobConfig`: a run written by an older
    version must still be readable after the schema has moved on. None if the run has none."""
    uri = join(run_uri, CONFIG_FILE)
    if not store.exists(uri):
        return None
    try:
        tree = yaml.safe_load(store.read_text(uri))
    except yaml.YAMLError as err:
        raise ValueError(f"{uri}: not valid YAML ({str(err).splitlines()[0]})") from None
    return tree if isinstance(tree, dict) else {}


def resolve_run_model(cfg, store: Store):
    """`cfg` with a hub id at the mirror its run was trained on (the commit in the run's stored
    config), for what looks at a run after the fact (export, eval): a branch that moved since must
    not change the base the adapters are applied to. A run not yet trained resolves afresh."""
    if not is_hub_uri(cfg.model.uri):
        return cfg
    stored = load_run_config(store, cfg.run_uri) or {}
    return resolve_model(cfg, store, pinned_uri=(stored.get("model") or {}).get("uri"))[0]


def stored_lineage(store: Store, run_uri: str) -> tuple[Optional[str], Optional[dict]]:
    """(where it was read, lineage) of what a resume would continue: the latest complete
    checkpoint's sidecar; for checkpoints without one (torn, or saved by an eft without sidecars,
    which Ray Train may still hand the workers) the run's stored config.yaml; else nothing."""
    latest = ckpt.find_latest_checkpoint(store, run_uri)
    if latest is not None:
        sidecar = ckpt.load_sidecar(store, latest)
        if "identity" in sidecar:
            return latest, {"dataset": sidecar.get("dataset"), "identity": sidecar["identity"]}
    if not any(d.startswith(ckpt.CHECKPOINT_PREFIX) for d in store.list_dirs(run_uri)):
        return None, None
    tree = load_run_config(store, run_uri)
    if tree is None:
        return None, None
    return join(run_uri, CONFIG_FILE), {"dataset": {"uri": (tree.get("data") or {}).get("uri"), "fingerprint": None},
                                        "identity": build_identity(tree)}


def check_resume(cfg, store: Store, manifest: Optional[dict] = None) -> None:
    """Refuse (ResumeError, one line) to resume `cfg.run_uri` with a config of another identity
    or, without the override, on another dataset. A run with nothing to resume passes."""
    source, stored = stored_lineage(store, cfg.run_uri)
    if stored is None:
        return
    current = build_lineage(cfg, manifest if manifest is not None else load_manifest(store, cfg.data.uri))
    changes = describe_identity_change(stored["identity"] or {}, current["identity"])
    if changes:
        raise ResumeError(f"run {cfg.run_uri} cannot resume with this config: {', '.join(changes)} "
                          f"(per {source}); use a new run name")
    check_same_dataset(cfg, source, stored.get("dataset") or {}, current["dataset"])


def check_same_dataset(cfg, source: str, old: dict, new: dict) -> None:
    if not old.get("uri"):
        return  # nothing recorded to compare with
    if old["uri"] == new["uri"] and old.get("fingerprint") in (None, new["fingerprint"]):
        return  # the same data (a checkpoint without a fingerprint is taken at its URI's word)
    was = f"dataset {short(old['fingerprint'])} at {old['uri']}" if old.get("fingerprint") else old["uri"]
    message = (f"run {cfg.run_uri} was trained on {was} (per {source}), but data.uri {new['uri']} now holds "
               f"dataset {short(new['fingerprint'])}")
    if cfg.checkpoint.resume_on_new_data:
        log.warning("%s; continuing on the new data (%s is true)", message, OVERRIDE_KEY)
        return
    raise ResumeError(f"{message}; set {OVERRIDE_KEY}: true to continue on the new data, or use a new run name")


def short(fingerprint: Optional[str]) -> str:
    return (fingerprint or "unknown")[:12]
