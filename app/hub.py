"""`hf://ORG/NAME[@REVISION]` → a pinned commit sha → one mirror of the repo in storage.

The driver resolves the revision (branch, tag or sha; `main` by default) to a commit sha and
mirrors the files a run needs, once, to `<model.mirror_uri>/<org>/<name>/<sha>/`. Every later
run, every node and every restart reads that mirror through the ranged per-rank loader: the hub
is contacted by one process, never by a thousand workers. The mirror's marker (`MARKER`) is
written last, so a mirror cut off halfway is never used; it is redone. Only a missing marker
means "no mirror": a read of it that fails otherwise is retried, then is one line, never a
full download.

The hub is an endpoint like any other (HF_ENDPOINT may name a mirror of it), so what it answers
is checked before it is used: the commit sha, which becomes part of a storage path, must be 40
lowercase hex characters; every mirrored file must have the size the hub listed, and the
sha256 of its LFS entry where the listing gives one, or the mirror is not marked complete.

A revision that is already a sha, with its mirror complete, costs no request at all: that is how
a cluster without internet is fed (`eft model pull` elsewhere, then `hf://org/name@<sha>` or the
mirror URI itself). A branch or tag costs one small API call to learn what it points at now.

Safetensors only: pickled weights (`.bin`, `.pt`) run code when loaded, so a repo without
safetensors is refused unless `model.allow_pickle_weights` says otherwise.

The token (`HF_TOKEN` or huggingface_hub's own token file) is read here, on the driver, sent only
to the hub, and never written: not to the config, the mirror, the marker or a log line.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from app.storage import READ_ATTEMPTS, ObjectNotFound, Store, StorageError, join

log = logging.getLogger("eft.hub")

SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
MARKER = "eft-mirror.json"
SHA = re.compile(r"[0-9a-f]{40}")  # always fullmatch: `$` would let a trailing newline through
REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# What a run, prepare, export, eval and serve read from a model dir. Weights: safetensors and
# their index; pickled weights only with model.allow_pickle_weights.
NEEDED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
          "vocab.txt", "chat_template.jinja", "chat_template.json", "*.safetensors", "model.safetensors.index.json")
PICKLED = ("pytorch_model*.bin", "pytorch_model.bin.index.json", "*.pt", "*.pth")
# A hub that cannot be reached is one line within seconds: this is an interactive step.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
DOWNLOAD_ATTEMPTS = 3
RETRY_PAUSE_S = 1.0  # doubled after each cut-off download
CHUNK_BYTES = 8 << 20


class HubError(ValueError):
    """One line, naming the repo (and the endpoint or the key at fault)."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str

    @property
    def org(self) -> str:
        return self.repo_id.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.repo_id.split("/", 1)[1]


def is_hub_uri(uri: str) -> bool:
    return uri.startswith(SCHEME)


def parse_hub_uri(uri: str, key: str = "model.uri") -> HubRef:
    """`hf://org/name[@revision]` → HubRef; HubError naming the key and URI when it is not one."""
    rest = uri[len(SCHEME):] if is_hub_uri(uri) else uri
    repo, _, revision = rest.partition("@")
    parts = repo.strip("/").split("/")
    if len(parts) != 2 or not all(REPO_PART.match(p) for p in parts) or (_ and not revision):
        raise HubError(f"{key} {uri}: not a hub id (hf://ORG/NAME or hf://ORG/NAME@REVISION)")
    return HubRef("/".join(parts), revision or "main")


def hub_endpoint() -> str:
    """The hub's address: HF_ENDPOINT when set (a mirror, a test's loopback hub), read at call
    time so that a long-lived driver follows it."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def shown_endpoint(endpoint: str) -> str:
    """The endpoint as it may be written (marker) or logged: an HF_ENDPOINT with credentials in it
    (`https://user:secret@mirror`) loses them."""
    parsed = urlparse(endpoint)
    if parsed.username is None and parsed.password is None:
        return endpoint
    return parsed._replace(netloc=parsed.hostname + (f":{parsed.port}" if parsed.port else "")).geturl()


def default_mirror_root(root_uri: str) -> str:
    """`<storage.root_uri>/../models-mirror`: beside the runs, in the same bucket. A root that is a
    bare bucket (`s3://b`) has no parent: the mirror goes under it."""
    parsed = urlparse(root_uri)
    path = parsed.path.rstrip("/") if parsed.scheme else root_uri.rstrip("/")
    if parsed.scheme and "/" not in path.strip("/"):
        return join(root_uri, "models-mirror")
    return join(root_uri.rstrip("/").rsplit("/", 1)[0], "models-mirror")


def mirror_uri_of(mirror_root: str, ref: HubRef, sha: str) -> str:
    return join(mirror_root, ref.org, ref.name, sha)


def is_sha(text) -> bool:
    return isinstance(text, str) and SHA.fullmatch(text) is not None


def load_marker(store: Store, mirror_uri: str) -> Optional[dict]:
    """The completion marker of a mirror, or None: a mirror without one is incomplete.

    None only when the marker is missing. Reading it is retried as a training read is, even on
    an interactive Store: its absence starts a full download (or a request to a hub that may be
    out of reach), so a storage blip must not pass for it. A read that still fails is one line."""
    uri = join(mirror_uri, MARKER)
    try:
        data = store.read_bytes(uri, attempts=READ_ATTEMPTS)
    except ObjectNotFound:
        return None
    except (StorageError, OSError) as err:
        raise StorageError(f"{uri}: the mirror's marker could not be read ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); not mirroring again over a blip: "
                           f"try again once storage answers") from None
    try:
        marker = json.loads(data)
    except ValueError:
        marker = None
    if not isinstance(marker, dict):
        # Not written by eft (ours is one PUT, never torn): the mirror is redone, which replaces it.
        log.warning("%s is not a mirror marker (not a JSON object): the mirror counts as incomplete", uri)
        return None
    return marker


def _api(endpoint: str, token: Optional[str]):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token or False)


def _token() -> Optional[str]:
    from huggingface_hub import get_token

    return get_token()


def _explain(err: Exception, ref: HubRef, endpoint: str, mirror_root: str) -> HubError:
    """One line for what the hub said, or for a hub that did not answer."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    repo, endpoint = f"hf://{ref.repo_id}", shown_endpoint(endpoint)
    if isinstance(err, GatedRepoError):
        return HubError(f"{repo} is gated at {endpoint}: accept its licence on {endpoint}/{ref.repo_id} with your "
                        f"account, then set HF_TOKEN to a token of that account (never stored by eft)")
    if isinstance(err, RevisionNotFoundError):
        return HubError(f"{repo}: revision {ref.revision!r} does not exist at {endpoint}")
    if isinstance(err, RepositoryNotFoundError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            return HubError(f"{repo}: access denied at {endpoint} ({status}): a private or gated repo needs HF_TOKEN "
                            f"set to a token with access to it")
        return HubError(f"{repo} does not exist at {endpoint} (or is private: set HF_TOKEN)")
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            return HubError(f"{repo}: access denied at {endpoint} ({status}): set HF_TOKEN to a token with access")
        return HubError(f"{repo}: the hub at {endpoint} answered {status or type(err).__name__}")
    return HubError(f"cannot reach the hub at {endpoint} for {repo} ({type(err).__name__}); offline, mirror it "
                    f"elsewhere with `eft model pull {repo} --to {mirror_root}` and use hf://{ref.repo_id}@<sha> or "
                    f"the mirror's URI")


def resolve_revision(ref: HubRef, endpoint: str, token: Optional[str], mirror_root: str) -> tuple[str, list]:
    """(commit sha, [(file name, size, LFS sha256 or None)]) of the revision: one API call. The
    sha becomes part of a storage path, so anything but 40 lowercase hex characters is refused."""
    try:
        info = _api(endpoint, token).model_info(ref.repo_id, revision=ref.revision, files_metadata=True,
                                                timeout=CONNECT_TIMEOUT_S)
    except Exception as err:  # every failure is one line, naming the repo and the endpoint
        raise _explain(err, ref, endpoint, mirror_root) from None
    if not is_sha(info.sha):
        raise HubError(f"hf://{ref.repo_id}@{ref.revision}: the hub at {shown_endpoint(endpoint)} answered "
                       f"{str(info.sha)[:80]!r} as the commit, not a 40-character lowercase hex sha; nothing mirrored")
    files = [(s.rfilename, s.size, getattr(s.lfs, "sha256", None)) for s in (info.siblings or [])]
    return info.sha, files


def select_files(ref: HubRef, files: list, allow_pickle: bool) -> list:
    """The files of the repo a run needs; HubError when it has no weights eft may load."""
    def matching(patterns):
        return [entry for entry in files if "/" not in entry[0]
                and any(fnmatch.fnmatch(entry[0], p) for p in patterns)]

    needed = matching(NEEDED)
    names = {entry[0] for entry in needed}
    if "config.json" not in names:
        raise HubError(f"hf://{ref.repo_id}@{ref.revision}: no config.json: not a transformers model repo")
    if any(n.endswith(".safetensors") for n in names):
        return needed
    pickled = matching(PICKLED)
    if not pickled:
        raise HubError(f"hf://{ref.repo_id}@{ref.revision}: no safetensors weights")
    if not allow_pickle:
        raise HubError(f"hf://{ref.repo_id}@{ref.revision} has only pickled weights "
                       f"({', '.join(sorted(e[0] for e in pickled))}): loading a pickle runs code; set "
                       f"model.allow_pickle_weights: true to trust this repo anyway")
    log.warning("hf://%s@%s: pickled weights (%s) mirrored because model.allow_pickle_weights is true: loading them "
                "runs whatever code they hold", ref.repo_id, ref.revision, ", ".join(sorted(e[0] for e in pickled)))
    return needed + pickled


def _download_chunks(url: str, headers: dict):
    from huggingface_hub.utils import get_session, hf_raise_for_status

    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as response:
        hf_raise_for_status(response)
        yield from response.iter_bytes(CHUNK_BYTES)


def _hashed(chunks, digest):
    for chunk in chunks:
        digest.update(chunk)
        yield chunk


def copy_file(store: Store, ref: HubRef, sha: str, name: str, dest: str, endpoint: str,
              token: Optional[str]) -> tuple[int, str]:
    """One file of the repo at `sha`, streamed into storage (a multipart upload on S3). A
    download cut off is started again, a few times: the file is rewritten whole. Returns its
    size and sha256, taken from the bytes as they went up."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(ref.repo_id, name, revision=sha, endpoint=endpoint)
    headers = build_hf_headers(token=token or False)
    for attempt in range(DOWNLOAD_ATTEMPTS):
        digest = hashlib.sha256()
        try:
            size = store.write_stream(join(dest, name), _hashed(_download_chunks(url, headers), digest))
            return size, digest.hexdigest()
        except (StorageError, HubError):
            raise
        except Exception as err:
            from huggingface_hub.errors import HfHubHTTPError

            status = getattr(getattr(err, "response", None), "status_code", None)
            if attempt == DOWNLOAD_ATTEMPTS - 1 or (isinstance(err, HfHubHTTPError) and status and status < 500):
                raise _explain(err, ref, endpoint, dest) from None
            log.warning("hf://%s: download of %s cut off (%s); starting it again", ref.repo_id, name,
                        type(err).__name__)
            time.sleep(RETRY_PAUSE_S * 2 ** attempt)
    raise AssertionError("unreachable")


def check_download(name: str, size: int, sha256: str, listed_size: Optional[int],
                   listed_sha256: Optional[str]) -> Optional[str]:
    """None when a mirrored file is what the hub's listing says (its size; its LFS sha256 where
    the listing gives one), else what differs."""
    if listed_size is not None and size != listed_size:
        return f"{name} arrived as {size} bytes, the hub lists {listed_size}"
    if listed_sha256 is not None and sha256 != str(listed_sha256).lower():
        return f"{name} has sha256 {sha256}, the hub's LFS entry says {listed_sha256}"
    return None


def mirror_model(store: Store, uri: str, mirror_root: str, allow_pickle: bool = False) -> dict:
    """Resolve `hf://…` and make sure its mirror is complete; returns the mirror's marker
    (repo, requested revision, sha, files, mirror_uri). Idempotent: a complete mirror is reused."""
    ref = parse_hub_uri(uri)
    store.check_reachable(mirror_root)
    if is_sha(ref.revision):
        done = load_marker(store, mirror_uri_of(mirror_root, ref, ref.revision))
        if done is not None:  # pinned and mirrored: no request to the hub at all
            return {**done, "revision": ref.revision}
    endpoint, token = hub_endpoint(), _token()
    sha, files = resolve_revision(ref, endpoint, token, mirror_root)
    dest = mirror_uri_of(mirror_root, ref, sha)
    done = load_marker(store, dest)
    if done is not None:
        return {**done, "revision": ref.revision}
    wanted = select_files(ref, files, allow_pickle)
    # Files left by a mirror that was cut off are overwritten; the marker goes last.
    started = time.time()
    sizes, digests = {}, {}
    for name, listed_size, listed_sha256 in wanted:
        sizes[name], digests[name] = copy_file(store, ref, sha, name, dest, endpoint, token)
        # A truncated, swapped or corrupted file is a failed mirror: no marker, so never used.
        if problem := check_download(name, sizes[name], digests[name], listed_size, listed_sha256):
            raise HubError(f"hf://{ref.repo_id}@{sha}: {problem} (from {shown_endpoint(endpoint)}); the mirror at "
                           f"{dest} is not marked complete")
    marker = {"repo": ref.repo_id, "revision": ref.revision, "sha": sha, "endpoint": shown_endpoint(endpoint),
              "files": sizes, "sha256": digests, "mirror_uri": dest,
              "mirrored_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "pickled_weights": any(n.endswith((".bin", ".pt", ".pth")) for n in sizes)}
    store.write_json(join(dest, MARKER), marker)
    log.info("hf://%s@%s (%s): mirrored %d files, %.1f MB, to %s in %.1f s", ref.repo_id, ref.revision, sha,
             len(sizes), sum(sizes.values()) / 1e6, dest, time.time() - started)
    return marker


def resolve_model(cfg, store: Store, pinned_uri: Optional[str] = None):
    """The config with `model.uri` at the mirror of its hub id (unchanged for any other URI), and
    the mirror's marker (None when not a hub id). The mirror's path holds the sha, so the run's
    stored config, its identity and its export all pin the exact commit.

    `pinned_uri`: the mirror a run was trained on (its stored config's model.uri). Looking at a
    run (export, eval) uses that commit, complete in storage, without asking the hub where the
    branch points now; training resolves afresh, so that a moved branch is refused on resume."""
    if not is_hub_uri(cfg.model.uri):
        return cfg, None
    root = cfg.model.mirror_uri or default_mirror_root(cfg.storage.root_uri)
    ref = parse_hub_uri(cfg.model.uri)
    marker = None
    if pinned_uri and pinned_uri.rstrip("/").rsplit("/", 1)[0] == join(root, ref.org, ref.name):
        marker = load_marker(store, pinned_uri)
    if marker is None:
        marker = mirror_model(store, cfg.model.uri, root, cfg.model.allow_pickle_weights)
    model = cfg.model.model_copy(update={"uri": marker["mirror_uri"], "mirror_uri": root})
    resolved = cfg.model_copy(update={"model": model})
    log.info("model.uri %s → %s (sha %s)", cfg.model.uri, marker["mirror_uri"], marker["sha"])
    return resolved, marker


def read_model_file(store: Store, uri: str, mirror_root: str, name: str = "config.json") -> tuple[bytes, str]:
    """One small file of a hub model, without mirroring it: `eft plan` needs only config.json and
    may run before anything is uploaded. Read from the complete mirror when there is one (a pinned
    sha mirrored: no request to the hub), else from the hub at the resolved sha. Writes nothing.
    Returns (the bytes, where they were read)."""
    ref = parse_hub_uri(uri)

    def from_mirror(sha: str) -> Optional[tuple[bytes, str]]:
        dest = mirror_uri_of(mirror_root, ref, sha)
        if load_marker(store, dest) is None:  # no bucket yet, or no complete mirror: the hub has it
            return None
        try:
            return store.read_bytes(join(dest, name), attempts=READ_ATTEMPTS), join(dest, name)
        except ObjectNotFound:
            return None  # a mirror without this file: the hub has it
        except OSError as err:
            raise StorageError(f"{join(dest, name)}: could not be read ({type(err).__name__})") from None

    if is_sha(ref.revision) and (found := from_mirror(ref.revision)):
        return found
    endpoint, token = hub_endpoint(), _token()
    sha, files = resolve_revision(ref, endpoint, token, mirror_root)
    if found := from_mirror(sha):
        return found
    if name not in {entry[0] for entry in files}:
        raise HubError(f"hf://{ref.repo_id}@{ref.revision}: no {name} (not a transformers model repo)")
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(ref.repo_id, name, revision=sha, endpoint=endpoint)
    try:
        data = b"".join(_download_chunks(url, build_hf_headers(token=token or False)))
    except Exception as err:  # one line, naming the repo and the endpoint
        raise _explain(err, ref, endpoint, mirror_root) from None
    return data, f"hf://{ref.repo_id}@{sha}/{name}"


def describe_sha_change(old_uri: str, new_uri: str) -> Optional[str]:
    """When two model URIs are mirrors of one repo at two commits, say so with the way back (the
    branch moved since the run began); None for any other pair."""
    old_parent, _, old_sha = str(old_uri).rstrip("/").rpartition("/")
    new_parent, _, new_sha = str(new_uri).rstrip("/").rpartition("/")
    if old_parent != new_parent or not (is_sha(old_sha) and is_sha(new_sha)):
        return None
    repo = "/".join(old_parent.split("/")[-2:])
    return f"the hub commit of {repo} is now {new_sha}, the run's is {old_sha}: pin hf://{repo}@{old_sha} to resume"


def list_mirrors(store: Store, mirror_root: str) -> list[dict]:
    """Every mirror under `mirror_root`: complete ones with their marker, cut-off ones flagged."""
    found = []
    for org in store.list_dirs(mirror_root):
        for name in store.list_dirs(join(mirror_root, org)):
            for sha in store.list_dirs(join(mirror_root, org, name)):
                uri = join(mirror_root, org, name, sha)
                marker = load_marker(store, uri)
                found.append({"repo": f"{org}/{name}", "sha": sha, "mirror_uri": uri, "complete": marker is not None,
                              "files": len((marker or {}).get("files", {})),
                              "bytes": sum((marker or {}).get("files", {}).values()),
                              "revision": (marker or {}).get("revision")})
    return found
