"""A prepared dataset's manifest: `<data.uri>/manifest.json`, the commit of `eft prepare`.

Readers (the training workers, export, reports, the notebook) only need this module, not the
prepare job: where the manifest lives, loading a committed one, its shard URIs. The commit
protocol lives here too: shards go under a fresh `shards-<id>/` prefix, the manifest is written
last, and prefixes no committed manifest references are deleted by the next run.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from app.storage import Store, StorageError, join

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARDS_PREFIX = "shards-"


class DatasetError(RuntimeError):
    """A prepared dataset cannot be used, reported as one line naming its URI."""


# -- reading a committed dataset --------------------------------------------------------

def manifest_uri(data_uri: str) -> str:
    return join(data_uri, MANIFEST_NAME)


def load_manifest(store: Store, data_uri: str) -> dict:
    uri = manifest_uri(data_uri)
    if not store.exists(uri):
        raise DatasetError(f"no committed dataset at {data_uri}: {MANIFEST_NAME} missing (run `eft prepare`)")
    try:
        manifest = json.loads(store.read_bytes(uri))
    except json.JSONDecodeError as err:
        raise DatasetError(f"{uri}: not valid JSON ({err})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetError(f"{uri}: format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}")
    return manifest


def shard_uris(data_uri: str, manifest: dict, split: str) -> list[str]:
    if split not in manifest["splits"]:
        raise DatasetError(f"{data_uri}: no split {split!r} (have {sorted(manifest['splits'])})")
    return [join(data_uri, shard["path"]) for shard in manifest["splits"][split]["shards"]]


def split_shard_uris(data_uri: str, manifest: dict, split: str, reference: bool = False) -> list[str]:
    """The split's shards, or with `reference` their copies that carry the precomputed reference
    log-probs (`ref_logps`, app/data/reference.py): the same rows in the same order."""
    if not reference:
        return shard_uris(data_uri, manifest, split)
    if "reference" not in manifest:
        raise DatasetError(f"{data_uri}: no precomputed reference log-probs (run `eft prepare` with "
                           f"training.objective: dpo)")
    return [join(data_uri, shard["path"]) for shard in manifest["reference"]["splits"][split]["shards"]]


# -- commit protocol ------------------------------------------------------------------------

def referenced_shard_dirs(manifest: Optional[dict]) -> set[str]:
    if not manifest:
        return set()
    return {shard["path"].split("/", 1)[0] for split in manifest.get("splits", {}).values()
            for shard in split.get("shards", [])}


def read_committed_manifest(store: Store, data_uri: str) -> Optional[dict]:
    """The committed manifest of any format version (only its shard paths matter here), None if
    absent; an unreadable one counts as absent, since only an overwrite gets this far."""
    uri = manifest_uri(data_uri)
    try:
        manifest = store.read_json(uri) if store.exists(uri) else None
    except StorageError:
        return None
    return manifest if isinstance(manifest, dict) else None


def delete_unreferenced_shards(store: Store, data_uri: str, keep: set[str]) -> None:
    for name in store.list_dirs(data_uri):
        if name.startswith(SHARDS_PREFIX) and name not in keep:
            log.info("prepare: deleting unreferenced %s", join(data_uri, name))
            store.delete_prefix(join(data_uri, name))


def commit_manifest(store: Store, data_uri: str, manifest: dict) -> None:
    """Write the manifest (the commit), then delete every shard prefix it does not reference."""
    store.write_json(manifest_uri(data_uri), manifest)
    delete_unreferenced_shards(store, data_uri, referenced_shard_dirs(manifest))
