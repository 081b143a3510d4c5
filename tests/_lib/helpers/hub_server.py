"""A loopback Hugging Face Hub for upload tests: a real HTTP server on 127.0.0.1 (random port).

Speaks the part of the Hub protocol huggingface_hub 2.x uses to create repos, commit files (regular
and LFS), read repo info and download (docs/FACTS.md, The Hub protocol), storing files in a temporary folder with real
oids (sha256 for LFS objects, git blob sha1 for regular files). Faults are injected per endpoint,
consumed in order::

    server.inject("commit", status=500, times=1)      # a 500 on the next commit
    server.inject("lfs_put", drop=True)                 # connection dropped mid-upload
    server.inject("commit", delay=3.0)                  # answers after 3 s (beyond a client timeout)
    server.inject("create_repo", status=500, echo_auth=True)  # error body echoes the Authorization header
    server.inject("commit", status=500, apply=True)     # the commit lands, then the answer is a 500
    server.inject("commit", status=429, retry_after="0")

Endpoints: create_repo, validate_yaml, preupload, lfs_batch, lfs_put, lfs_verify, commit,
model_info, tree, resolve, whoami, page (``GET /{repo}``: the card rendered as HTML).
``server.requests`` logs (endpoint, method, path, status). A commit naming a ``parentCommit`` that is
no longer the head gets 412, as on the Hub. validate-yaml checks the card for real
(``hub_card_check.py``). ``HubServer(tokens={...})`` answers 401 to any other token, ``role="read"``
makes whoami report a read-only token. Clients need HF_ENDPOINT=server.url, HF_HUB_DISABLE_XET=1
and a token (``server.tokens_seen``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".png", ".pt", ".model", ".pth", ".h5")
LFS_MIN_SIZE = 10 * 1024 * 1024


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Fault:
    status: int | None = None
    drop: bool = False
    delay: float = 0.0
    echo_auth: bool = False
    apply: bool = False             # handle the request, then answer ``status`` instead
    retry_after: str | None = None  # Retry-After header of a 429
    before: Any = None              # called with (server, route args) before the request is handled


@dataclass
class _File:
    size: int
    lfs_oid: str | None  # sha256 of the content for LFS files
    blob_oid: str        # git sha1 of the stored blob (regular) or of the LFS pointer


class _Repo:
    def __init__(self, repo_id: str, private: bool) -> None:
        self.repo_id, self.private = repo_id, private
        self.files: dict[str, _File] = {}
        self.commits: list[str] = ["0" * 40]

    @property
    def sha(self) -> str:
        return self.commits[-1]


class HubServer:
    """Start with ``HubServer().start()`` (or as a context manager); ``stop()`` removes its files."""

    def __init__(self, user: str = "tester", tokens: set[str] | None = None, role: str = "write") -> None:
        self.user, self.tokens, self.role = user, tokens, role
        self.root = Path(tempfile.mkdtemp(prefix="fake-hub-"))
        (self.root / "lfs").mkdir()
        (self.root / "blobs").mkdir()
        self.repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str, str, int]] = []
        self.tokens_seen: set[str] = set()
        self.lfs_puts: dict[str, int] = {}
        self.card_checks: list[tuple[str, list[str]]] = []  # (README content, errors) per validate-yaml call
        self.in_flight = 0
        self._faults: dict[str, list[_Fault]] = {}
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None

    # --- control -----------------------------------------------------------------------------
    def start(self) -> "HubServer":
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True, name="fake-hub").start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def inject(self, endpoint: str, *, status: int | None = None, drop: bool = False, delay: float = 0.0,
               times: int = 1, echo_auth: bool = False, apply: bool = False, retry_after: str | None = "0",
               before=None) -> None:
        """Queues ``times`` faults for ``endpoint`` (consumed one per request, in order)."""
        if status is None and not drop and not delay and before is None:
            raise ValueError("a fault needs status, drop, delay or before")
        with self._lock:
            self._faults.setdefault(endpoint, []).extend(
                _Fault(status, drop, delay, echo_auth, apply, retry_after, before) for _ in range(times))

    def commit_files(self, repo_id: str, files: dict[str, bytes]) -> None:
        """Commits ``files`` (regular ones) to ``repo_id`` directly: someone else's commit."""
        lines = [{"key": "file", "value": {"path": p, "content": base64.b64encode(d).decode(), "encoding": "base64"}}
                 for p, d in files.items()]
        status, _ = self._commit(self.repos[repo_id], lines)
        assert status == 200, status

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Returns once no request is being handled (a delayed one the client gave up on included)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)

    def commits(self, repo_id: str) -> int:
        """Commits made to ``repo_id`` since it was created."""
        return len(self.repos[repo_id].commits) - 1

    def pending_faults(self) -> dict[str, int]:
        with self._lock:
            return {k: len(v) for k, v in self._faults.items() if v}

    def _take_fault(self, endpoint: str) -> _Fault | None:
        with self._lock:
            queue = self._faults.get(endpoint)
            return queue.pop(0) if queue else None

    def count(self, endpoint: str, status: int | None = None) -> int:
        return sum(1 for e, _, _, s in self.requests if e == endpoint and (status is None or s == status))

    # --- storage -----------------------------------------------------------------------------
    def file_bytes(self, repo_id: str, path: str) -> bytes:
        f = self.repos[repo_id].files[path]
        return (self.root / "lfs" / f.lfs_oid).read_bytes() if f.lfs_oid else (self.root / "blobs" / f.blob_oid).read_bytes()

    def all_stored_bytes(self):
        """(label, bytes) of every stored object: for checks such as 'the token is nowhere'."""
        for p in sorted((self.root / "lfs").iterdir()) + sorted((self.root / "blobs").iterdir()):
            yield p.name, p.read_bytes()

    def _store_regular(self, data: bytes) -> str:
        oid = git_blob_sha1(data)
        (self.root / "blobs" / oid).write_bytes(data)
        return oid

    def _commit(self, repo: _Repo, lines: list[dict]) -> tuple[int, dict]:
        changes: dict[str, _File | None] = {}
        parent = None
        for item in lines:
            key, value = item.get("key"), item.get("value", {})
            if key == "header":
                parent = value.get("parentCommit")
            elif key == "file":
                data = base64.b64decode(value["content"])
                changes[value["path"]] = _File(len(data), None, self._store_regular(data))
            elif key == "lfsFile":
                oid = value["oid"]
                if not (self.root / "lfs" / oid).is_file():
                    return 422, {"error": f"LFS object {oid} of {value['path']} was never uploaded"}
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {value['size']}\n"
                changes[value["path"]] = _File(int(value["size"]), oid, git_blob_sha1(pointer.encode()))
            elif key in ("deletedFile", "deletedFolder"):
                changes[value["path"]] = None
        with self._lock:
            if parent and parent != repo.sha:
                return 412, {"error": "A commit has happened since. Please refresh and try again."}
            for path, f in changes.items():
                if f is None:
                    repo.files = {p: v for p, v in repo.files.items() if p != path and not p.startswith(path + "/")}
                else:
                    repo.files[path] = f
            sha = hashlib.sha1(json.dumps([repo.sha, sorted((p, f.blob_oid) for p, f in repo.files.items())]).encode()
                               ).hexdigest()
            repo.commits.append(sha)
        return 200, {"commitUrl": f"{self.url}/{repo.repo_id}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}


def _card_data(readme: bytes) -> dict | None:
    text = readme.decode("utf-8", "replace")
    if not text.startswith("---\n"):
        return None
    try:
        import yaml
    except ImportError:
        return None
    return yaml.safe_load(text.split("---\n", 2)[1])


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:  # quiet
        pass

    # --- plumbing ----------------------------------------------------------------------------
    def _body(self, limit: int | None = None) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
                if limit is not None and len(out) >= limit:
                    return bytes(out)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n if limit is None else min(n, limit))

    def _send(self, status: int, payload=None, headers: dict | None = None, body: bytes | None = None,
              head: bool = False) -> None:
        override = getattr(self, "_answer_override", None)
        if override is not None:  # the request was handled; the client hears a failure
            self._answer_override = None
            return self._send_fault(override, "", "POST")
        if body is None:
            body = json.dumps(payload if payload is not None else {}).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self._status = status  # what the server answered, even when the client has gone
        try:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            self.close_connection = True

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._status = -1

    def _route(self, method: str):
        path = urlparse(self.path).path
        routes = [
            ("POST", r"/api/repos/create", "create_repo"),
            ("POST", r"/api/validate-yaml", "validate_yaml"),
            ("GET", r"/api/whoami-v2", "whoami"),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)", "preupload"),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)", "commit"),
            ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
            ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?", "model_info"),
            ("POST", r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", "lfs_batch"),
            ("PUT", r"/_lfs/(?P<oid>[0-9a-f]{64})", "lfs_put"),
            ("POST", r"/_lfs/(?P<oid>[0-9a-f]{64})/verify", "lfs_verify"),
            ("GET", r"/(?P<repo>[^/]+/[^/]+)", "page"),
            ("GET", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
            ("HEAD", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
        ]
        for m, pattern, name in routes:
            match = re.fullmatch(pattern, path)
            if m == method and match:
                return name, {k: unquote(v) if v else v for k, v in match.groupdict().items()}
        return None, {}

    def _handle(self, method: str) -> None:
        self._status, self._answer_override = 0, None
        with self.hub._lock:
            self.hub.in_flight += 1
        endpoint, args = self._route(method)
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            self.hub.tokens_seen.add(auth[len("Bearer "):])
        try:
            if endpoint is None:
                self._send(404, {"error": f"no route {method} {self.path}"})
                return
            if self.hub.tokens is not None and endpoint not in ("lfs_put", "page") \
                    and auth[len("Bearer "):] not in self.hub.tokens:
                if method in ("POST", "PUT"):
                    self._body()
                self._send(401, {"error": "Invalid credentials in Authorization header"}, head=method == "HEAD")
                return
            fault = self.hub._take_fault(endpoint)
            if fault is not None and fault.before is not None:
                fault.before(self.hub, args)
            if fault is not None and fault.delay:
                time.sleep(fault.delay)
            if fault is not None and fault.drop:
                if endpoint == "lfs_put":
                    self._body(limit=max(1, int(self.headers.get("Content-Length") or 2) // 2))
                self._drop()
                return
            if fault is not None and fault.status and fault.apply:
                self._answer_override = fault
            elif fault is not None and fault.status:
                if method in ("POST", "PUT"):
                    self._body()
                self._send_fault(fault, auth, method)
                return
            getattr(self, f"_ep_{endpoint}")(args, method)
        finally:
            with self.hub._lock:
                self.hub.requests.append((endpoint or "?", method, self.path, self._status))
                self.hub.in_flight -= 1

    def _send_fault(self, fault: _Fault, auth: str, method: str) -> None:
        body = {"error": "injected fault"}
        if fault.echo_auth:
            body["error"] += f" (request had Authorization: {auth})"
        headers = {"Retry-After": fault.retry_after} if fault.status == 429 and fault.retry_after is not None else {}
        self._send(fault.status, body, headers, head=method == "HEAD")

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def _repo(self, repo_id: str) -> _Repo | None:
        return self.hub.repos.get(repo_id)

    def _not_found(self, head: bool = False, code: str = "RepoNotFound") -> None:
        self._send(404, {"error": code}, {"X-Error-Code": code}, head=head)

    # --- endpoints -----------------------------------------------------------------------------
    def _ep_whoami(self, args, method) -> None:
        self._send(200, {"type": "user", "name": self.hub.user, "fullname": "Test User", "orgs": [],
                         "auth": {"type": "access_token",
                                  "accessToken": {"displayName": "test", "role": self.hub.role}}})

    def _ep_create_repo(self, args, method) -> None:
        req = json.loads(self._body() or b"{}")
        repo_id = f"{req.get('organization') or self.hub.user}/{req['name']}"
        url = f"{self.hub.url}/{repo_id}"
        with self.hub._lock:
            if repo_id in self.hub.repos:
                self._send(409, {"error": "You already created this model repo", "url": url})
                return
            private = req.get("visibility", "private" if req.get("private") else "public") == "private"
            self.hub.repos[repo_id] = _Repo(repo_id, private)
        self._send(200, {"url": url, "name": repo_id})

    def _ep_validate_yaml(self, args, method) -> None:
        from .hub_card_check import validate_card

        req = json.loads(self._body() or b"{}")
        errors, warnings = validate_card(req.get("content", ""), req.get("repoType") or "model")
        with self.hub._lock:
            self.hub.card_checks.append((req.get("content", ""), errors))
        warn = [{"message": w} for w in warnings]
        if errors:
            self._send(400, {"errors": [{"message": e} for e in errors], "warnings": warn})
            return
        self._send(200, {"warnings": warn, "errors": []})

    def _ep_page(self, args, method) -> None:
        from .hub_card_check import render_card

        repo = self._repo(args["repo"])
        if repo is None or "README.md" not in repo.files:
            return self._not_found()
        html = render_card(self.hub.file_bytes(repo.repo_id, "README.md").decode(), repo.repo_id, self.hub.url)
        self._send(200, headers={"Content-Type": "text/html; charset=utf-8"}, body=html.encode())

    def _ep_preupload(self, args, method) -> None:
        req = json.loads(self._body() or b"{}")
        repo = self._repo(args["repo"])
        if repo is None:
            return self._not_found()
        files = []
        for f in req.get("files", []):
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE
            stored = repo.files.get(f["path"])
            oid = None
            if stored is not None:
                oid = stored.lfs_oid if stored.lfs_oid else stored.blob_oid
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": oid})
        self._send(200, {"files": files, "commitOid": repo.sha})

    def _ep_lfs_batch(self, args, method) -> None:
        req = json.loads(self._body() or b"{}")
        if self._repo(args["repo"]) is None:
            return self._not_found()
        objects = []
        for obj in req.get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if not (self.hub.root / "lfs" / obj["oid"]).is_file():  # stored objects need no upload
                entry["actions"] = {"upload": {"href": f"{self.hub.url}/_lfs/{obj['oid']}"},
                                    "verify": {"href": f"{self.hub.url}/_lfs/{obj['oid']}/verify"}}
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects})

    def _ep_lfs_put(self, args, method) -> None:
        data = self._body()
        oid = args["oid"]
        if hashlib.sha256(data).hexdigest() != oid:
            self._send(400, {"error": "sha256 mismatch"})
            return
        tmp = self.hub.root / "lfs" / f".{oid}.{threading.get_ident()}"
        tmp.write_bytes(data)
        tmp.replace(self.hub.root / "lfs" / oid)
        with self.hub._lock:
            self.hub.lfs_puts[oid] = self.hub.lfs_puts.get(oid, 0) + 1
        self._send(200, {})

    def _ep_lfs_verify(self, args, method) -> None:
        self._body()
        ok = (self.hub.root / "lfs" / args["oid"]).is_file()
        self._send(200 if ok else 404, {} if ok else {"error": "object not found"})

    def _ep_commit(self, args, method) -> None:
        raw = self._body()
        repo = self._repo(args["repo"])
        if repo is None:
            return self._not_found()
        lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        status, payload = self.hub._commit(repo, lines)
        self._send(status, payload)

    def _ep_model_info(self, args, method) -> None:
        repo = self._repo(args["repo"])
        if repo is None:
            return self._not_found()
        card = _card_data(self.hub.file_bytes(repo.repo_id, "README.md")) if "README.md" in repo.files else None
        self._send(200, {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": repo.private,
                         "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                         "tags": (card or {}).get("tags", []), "cardData": card,
                         "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z"})

    def _ep_tree(self, args, method) -> None:
        repo = self._repo(args["repo"])
        if repo is None:
            return self._not_found()
        prefix = (args.get("path") or "").strip("/")
        out = []
        for p, f in sorted(repo.files.items()):
            if prefix and not p.startswith(prefix + "/"):
                continue
            entry = {"type": "file", "path": p, "size": f.size, "oid": f.blob_oid}
            if f.lfs_oid:
                entry["lfs"] = {"oid": f.lfs_oid, "size": f.size, "pointerSize": 130}
            out.append(entry)
        self._send(200, out)

    def _ep_resolve(self, args, method) -> None:
        head = method == "HEAD"
        repo = self._repo(args["repo"])
        if repo is None:
            return self._not_found(head)
        if args["rev"] not in ("main", *repo.commits):
            return self._not_found(head, "RevisionNotFound")
        f = repo.files.get(args["path"])
        if f is None:
            return self._not_found(head, "EntryNotFound")
        data = self.hub.file_bytes(repo.repo_id, args["path"])
        etag = f.lfs_oid or f.blob_oid
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        if f.lfs_oid:
            headers.update({"X-Linked-Etag": f'"{f.lfs_oid}"', "X-Linked-Size": str(f.size)})
        self._send(200, headers=headers, body=data, head=head)

