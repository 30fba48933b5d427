"""A stand-in for the Hugging Face Hub on a loopback port: the HTTP API the real
`huggingface_hub` client calls to resolve a revision (`/api/models/<repo>/revision/<rev>`) and
to download a file (`/<repo>/resolve/<rev>/<file>`), for repos a test builds from files on disk.
Point the client at it with HF_ENDPOINT, as moto stands in for S3. It counts every request and
keeps each one's headers, so a test can say the hub was not contacted, or what it was sent.
Its listing gives each file's size and, for safetensors (stored with LFS on the real hub), the
LFS entry's sha256. A test makes it lie, as a broken or hostile endpoint would: `answer_sha`
replaces the commit sha it answers, `listed` overrides fields of a file's listing entry."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubRepo:
    """One model repo: branches → commit shas, each commit's files; gated repos need `token`."""

    def __init__(self, gated_token: str | None = None):
        self.refs: dict[str, str] = {}
        self.commits: dict[str, dict[str, bytes]] = {}
        self.gated_token = gated_token
        self.answer_sha: str | None = None  # what the API answers as the commit, instead of the real one
        self.listed: dict[str, dict] = {}  # file name → listing fields that replace the true ones

    def sibling(self, name: str, body: bytes) -> dict:
        entry = {"rfilename": name, "size": len(body)}
        if name.endswith(".safetensors"):
            entry["lfs"] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest(), "pointerSize": 134}
        override = self.listed.get(name, {})
        if "lfs" in override and "lfs" in entry:
            return {**entry, **override, "lfs": {**entry["lfs"], **override["lfs"]}}
        return {**entry, **override}

    def commit(self, files: dict[str, bytes], branch: str = "main") -> str:
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items()))
                           .encode() + str(len(self.commits)).encode()).hexdigest()
        self.commits[sha] = dict(files)
        self.refs[branch] = sha
        return sha

    def commit_dir(self, directory: Path, branch: str = "main", skip: tuple[str, ...] = ()) -> str:
        return self.commit({p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())
                            if p.is_file() and not p.name.endswith(skip)}, branch)


class HubServer:
    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.requests: Counter = Counter()
        self.seen_headers: list[dict] = []
        self.fail_downloads_after: int | None = None  # cut the connection after N file downloads
        self._downloads = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the test reads counts, not logs
                pass

            def do_HEAD(self):
                self._answer(head=True)

            def do_GET(self):
                self._answer(head=False)

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, head: bool):
                self._send(status, json.dumps({"error": code}).encode(),
                           {"X-Error-Code": code, "Content-Type": "application/json"}, head)

            def _answer(self, head: bool):
                path = unquote(urlparse(self.path).path)
                hub.seen_headers.append(dict(self.headers))
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                if path.startswith("/api/models/"):
                    hub.requests["api"] += 1
                    rest = path[len("/api/models/"):]
                    repo_id, _, revision = rest.partition("/revision/")
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._error(404, "RepoNotFound", head)
                    sha = repo.refs.get(revision or "main") or (revision if revision in repo.commits else None)
                    if sha is None:
                        return self._error(404, "RevisionNotFound", head)
                    files = repo.commits[sha]
                    info = {"id": repo_id, "modelId": repo_id, "sha": repo.answer_sha or sha, "private": False,
                            "gated": "manual" if repo.gated_token else False, "downloads": 0, "likes": 0,
                            "tags": [], "siblings": [repo.sibling(n, b) for n, b in sorted(files.items())]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                parts = path.lstrip("/").split("/")
                if len(parts) >= 5 and parts[2] == "resolve":
                    hub.requests["download"] += 1
                    repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._error(404, "RepoNotFound", head)
                    if repo.gated_token and token != repo.gated_token:
                        return self._error(403 if token else 401, "GatedRepo", head)
                    sha = repo.refs.get(revision) or (revision if revision in repo.commits else None)
                    if sha is None:
                        return self._error(404, "RevisionNotFound", head)
                    if name not in repo.commits[sha]:
                        return self._error(404, "EntryNotFound", head)
                    hub._downloads += 1
                    if hub.fail_downloads_after is not None and hub._downloads > hub.fail_downloads_after:
                        self.close_connection = True
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(repo.commits[sha][name])))
                        self.end_headers()
                        self.wfile.write(repo.commits[sha][name][:10])  # then the connection drops
                        return
                    body = repo.commits[sha][name]
                    return self._send(200, body, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(body).hexdigest()}"',
                                                  "Content-Type": "application/octet-stream"}, head)
                return self._error(404, "EntryNotFound", head)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
