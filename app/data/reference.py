"""DPO's reference log-probs, computed once per (dataset, reference model) as a Ray Data
batch-inference pass, so training holds one model and a pair's reference costs nothing per step.

Each train and validation shard of a prepared preference dataset is scored by an actor of a pool
(`preference.reference_num_actors`, each loading the reference model once, on a GPU when the
workers have them): every packed row gets `ref_logps`, the summed log-prob of each of its
documents' completion tokens (chosen, rejected, chosen, ...) under the reference model, the same
per-sequence sums training takes of the policy (app/model/preference.py). The scored shard is
written whole, with that column, to `<data.uri>/reference-<key>/`, the key naming the dataset's
shards and the reference model (its URI, config and weight files' contents). The manifest's `reference`
entry, written last, is the commit; a shard already written under the key is not scored again, so
a pre-empted pass resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.config import JobConfig
from app.data.manifest import commit_manifest, load_manifest
from app.storage import Store, boto3_config, is_s3, join

log = logging.getLogger(__name__)

REFERENCE_PREFIX = "reference-"
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


class ReferenceLogpsError(RuntimeError):
    """The dataset's reference log-probs are missing or for another model: one line."""


def needs_reference(cfg: JobConfig) -> bool:
    return cfg.training.objective == "dpo" and cfg.reference_mode == "precomputed"


def reference_identity(store: Store, model_uri: str) -> dict:
    """The reference model as the stored log-probs name it: its URI and a fingerprint of its
    config and of its weight files' contents, so a model replaced at the same URI is told apart.
    Names and sizes were not enough: a fine-tune written over its base has the same sizes, and
    the base's stale log-probs were reused."""
    digest = hashlib.sha256(store.read_bytes(join(model_uri, "config.json")))
    for name, version in sorted(list_weight_versions(store, model_uri).items()):
        digest.update(f"{name}:{version}\n".encode())
    return {"uri": model_uri, "fingerprint": digest.hexdigest()}


def list_weight_versions(store: Store, model_uri: str) -> dict[str, str]:
    """{weight file: what its content is}: on S3 the object's ETag, from the listing (an MD5 of
    the content, or of its parts for a multipart upload: a re-upload in other parts differs too,
    which only costs a needless re-scoring); on a filesystem the sha256 of the file, as no
    listing there says more than sizes and times."""
    if is_s3(model_uri):
        return list_s3_etags(store, model_uri, WEIGHT_SUFFIXES)
    _, root = store.resolve(model_uri)
    versions = {}
    for name in store.list_files(model_uri):
        if name.endswith(WEIGHT_SUFFIXES):
            digest = hashlib.sha256()
            with open(os.path.join(root, name), "rb") as f:
                for chunk in iter(lambda: f.read(8 << 20), b""):
                    digest.update(chunk)
            versions[name] = digest.hexdigest()
    return versions


def list_s3_etags(store: Store, uri: str, suffixes: tuple[str, ...] = ("",)) -> dict[str, str]:
    """{path under `uri`: ETag} of the objects whose names end in `suffixes` (default: all), or
    {its name: ETag} when `uri` is one object; directory markers are not objects here. app.storage
    lists through pyarrow, whose file infos carry no ETag: this lists through boto3 with the store's
    endpoint, region and retry settings, on the store's own boto3 session (never boto3's shared
    default one, which is not thread-safe: app.storage.Store.boto3_client)."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    prefix = key.strip("/") + "/" if key.strip("/") else ""
    client = store.boto3_client("patient", boto3_config())
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        for item in page.get("Contents", []):
            if item["Key"].endswith("/"):  # a directory marker (pyarrow leaves them)
                continue
            if item["Key"] == key:
                name = key.rsplit("/", 1)[-1]
            elif item["Key"].startswith(prefix):
                name = item["Key"][len(prefix):]
            else:  # a sibling that shares the prefix: s3://b/data-2 beside s3://b/data
                continue
            if name.endswith(suffixes):
                found[name] = item["ETag"]
    return found


def reference_key(manifest: dict, identity: dict) -> str:
    shards = json.dumps({split: [s["path"] for s in part["shards"]] for split, part in manifest["splits"].items()},
                        sort_keys=True)
    return hashlib.sha256((shards + identity["fingerprint"]).encode()).hexdigest()[:16]


def check_reference(cfg: JobConfig, store: Store, manifest: dict) -> None:
    """Before Ray starts: a DPO run on precomputed reference log-probs has them, for its model."""
    if not needs_reference(cfg):
        return
    stored = manifest.get("reference")
    if stored is None:
        raise ReferenceLogpsError(f"data.uri {cfg.data.uri} has no reference log-probs for preference.reference "
                                  f"precomputed: run `eft prepare` on this config (training.objective dpo) to "
                                  f"compute them")
    identity = reference_identity(store, cfg.model.uri)
    if stored["model"] != identity:
        theirs = stored["model"]
        of = (f"the model that was at model.uri {cfg.model.uri} then (fingerprint {theirs['fingerprint'][:12]}; its "
              f"config or weights have changed since: {identity['fingerprint'][:12]})"
              if theirs["uri"] == cfg.model.uri else
              f"{theirs['uri']} (fingerprint {theirs['fingerprint'][:12]}), not of model.uri {cfg.model.uri} "
              f"({identity['fingerprint'][:12]})")
        raise ReferenceLogpsError(f"data.uri {cfg.data.uri} holds reference log-probs of {of}: run `eft prepare` on "
                                  f"this config to compute them")


class ScoreReference:
    """Ray Data actor: loads the reference model once, then scores whole shards, one per row of
    its input (split, source URI, target URI)."""

    def __init__(self, endpoint, region, model_uri: str, micro_batch: int, chunk_tokens: int, use_gpu: bool):
        import torch
        from transformers import AutoModelForCausalLM

        from app.model.loss import apply_loss

        self.store = Store(endpoint, region)
        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        # bf16 on GPU as training computes; fp32 on CPU (exact against the live reference in tests).
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        local = self.store.cache_locally(model_uri)
        model = AutoModelForCausalLM.from_pretrained(str(local), dtype=dtype, use_safetensors=True)
        apply_loss(model, "chunked", chunk_tokens)  # one chunk of logits at a time
        self.model = model.to(self.device).eval()
        self.micro_batch = micro_batch

    def __call__(self, batch: dict) -> dict:
        out = {"target": [], "rows": [], "seconds": [], "scored": []}
        for source, target in zip(batch["source"], batch["target"]):
            started = time.monotonic()
            scored = not self.store.exists(target)  # written by an earlier, pre-empted pass: kept
            if scored:
                fs, path = self.store.resolve(source)
                table = pq.read_table(path, filesystem=fs)
                refs = self.score(table)
                table = table.append_column("ref_logps", pa.array(refs, pa.list_(pa.float32())))
                buffer = io.BytesIO()
                pq.write_table(table, buffer)
                self.store.write_bytes(target, buffer.getvalue())
                rows = table.num_rows
            else:
                rows = pq.ParquetFile(io.BytesIO(self.store.read_bytes(target))).metadata.num_rows
            out["target"].append(target)
            out["rows"].append(rows)
            out["seconds"].append(time.monotonic() - started)
            out["scored"].append(scored)
        return {key: np.asarray(value) for key, value in out.items()}

    def score(self, table: pa.Table) -> list[np.ndarray]:
        import torch

        from app.model.loss import token_logps
        from app.model.preference import pair_segments, sequence_logps

        ids, labels, positions = (np.stack(table[c].to_numpy(zero_copy_only=False))
                                  for c in ("input_ids", "labels", "position_ids"))
        refs: list[np.ndarray] = []
        with torch.no_grad():
            for i in range(0, len(ids), self.micro_batch):
                y = labels[i:i + self.micro_batch]
                segments, pairs = pair_segments(y, positions[i:i + self.micro_batch])
                n = 2 * int(pairs.sum())
                as_long = (lambda a: torch.as_tensor(a, dtype=torch.long, device=self.device))
                per_token = token_logps(self.model, as_long(ids[i:i + self.micro_batch]), as_long(y), None,
                                        as_long(positions[i:i + self.micro_batch]))
                sums = sequence_logps(per_token, as_long(segments), n).float().cpu().numpy()
                refs += np.split(sums, np.cumsum(2 * pairs)[:-1])
        return refs


def add_reference(cfg: JobConfig, store: Store, lease=None) -> dict:
    """Score the committed preference dataset at `data.uri` with the reference model (`model.uri`)
    unless its manifest already has that model's log-probs; commit them; return the manifest."""
    manifest = load_manifest(store, cfg.data.uri)
    identity = reference_identity(store, cfg.model.uri)
    if manifest.get("reference", {}).get("model") == identity:
        log.info("prepare: %s already has reference log-probs of %s", cfg.data.uri, cfg.model.uri)
        return manifest
    if manifest["source"].get("format") != "preference":
        raise ReferenceLogpsError(f"data.uri {cfg.data.uri} was prepared as {manifest['source'].get('format')!r}, "
                                  f"not preference pairs: set prepare.format: preference and prepare it again")
    key = reference_key(manifest, identity)
    prefix = f"{REFERENCE_PREFIX}{key}"
    items, layout = [], {}
    for split, part in manifest["splits"].items():
        layout[split] = {"shards": []}
        for shard in part["shards"]:
            name = f"{prefix}/{shard['path'].rsplit('/', 1)[1]}"
            items.append({"source": join(cfg.data.uri, shard["path"]), "target": join(cfg.data.uri, name)})
            layout[split]["shards"].append({**shard, "path": name})
    started = time.monotonic()
    results = run_reference_pass(cfg, store, items)
    if lease is not None:
        lease.check()  # a pass whose dataset lease was taken over commits nothing
    rows = int(sum(results["rows"]))
    manifest["reference"] = {
        "model": identity, "key": key, "splits": layout,
        "stats": {"rows": rows, "shards_scored": int(np.sum(results["scored"])), "shards": len(items),
                  "wall_s": round(time.monotonic() - started, 3)},
    }
    commit_manifest(store, cfg.data.uri, manifest)
    for name in store.list_dirs(cfg.data.uri):  # earlier datasets' or models' log-probs
        if name.startswith(REFERENCE_PREFIX) and name != prefix:
            store.delete_prefix(join(cfg.data.uri, name))
    log.info("prepare: reference log-probs of %s for %d rows of %s committed (%d of %d shards scored now, %.1f s)",
             cfg.model.uri, rows, cfg.data.uri, manifest["reference"]["stats"]["shards_scored"], len(items),
             time.monotonic() - started)
    return manifest


def run_reference_pass(cfg: JobConfig, store: Store, items: list[dict]) -> dict:
    from app.cluster import init_ray, map_on_actor_pool

    init_ray(num_cpus=os.cpu_count())  # a Ray of its own only when none is joined or running
    p, use_gpu = cfg.preference, cfg.scaling.use_gpu
    # One shard a block; a shard scored before an actor was lost is kept (ScoreReference skips it).
    batches = map_on_actor_pool(
        [pa.Table.from_pylist([item]) for item in items], ScoreReference,
        (store.endpoint, store.region, cfg.model.uri, p.reference_micro_batch_size, cfg.training.loss_chunk_tokens,
         use_gpu),
        key="target", size=p.reference_num_actors, batch_format="numpy", num_gpus=1 if use_gpu else 0,
        what="reference pass", size_key="preference.reference_num_actors")
    results: dict = {"target": [], "rows": [], "scored": []}
    for batch in batches:
        for key in results:
            results[key] += batch[key].tolist()
    return results
