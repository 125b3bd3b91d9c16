"""A minimal local stand-in for the Hugging Face Hub's HTTP API, for push/load round trips in tests.

Enough of the API for huggingface_hub 2.4 + transformers 5 `push_to_hub` and `from_pretrained(repo_id)`:

    POST /api/repos/create                              create_repo (409 + url when it exists)
    GET  /api/whoami-v2                                 whoami
    POST /api/validate-yaml                             README.md front matter check before a commit
    GET  /api/models/{repo}[/revision/{rev}]            model_info / repo_info (siblings, sha)
    GET  /api/models/{repo}/tree/{rev}[/{path}]         list_repo_tree
    POST /api/models/{repo}/paths-info/{rev}            get_paths_info
    POST /api/models/{repo}/preupload/{rev}             upload modes: always "regular" (files go base64 in
                                                        the commit: no LFS, no Xet, nothing but this server)
    POST /api/models/{repo}/commit/{rev}                ndjson commit: header, file, deletedFile, deletedFolder
    HEAD/GET /{repo}/resolve/{rev}/{path}               downloads, with X-Repo-Commit, ETag, Content-Length

Errors carry the X-Error-Code header (RepoNotFound, RevisionNotFound, EntryNotFound) that the client maps to
its exceptions. Model repos only. The server binds 127.0.0.1 only; every request is logged in `requests`.

    with FakeHub() as hub:            # hub.url == "http://127.0.0.1:PORT", use as HF_ENDPOINT
        ...
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

MAX_BODY = 512 * 2**20  # bytes: refuse bigger requests instead of buffering without bound
_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_REV = r"(?P<rev>[^/]+)"


def git_blob_sha1(data: bytes) -> str:
    """The object id git (and the Hub, for non-LFS files) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    files: dict[str, bytes]
    message: str
    created: float = field(default_factory=time.time)


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)  # oldest first; "main" is the last one

    def resolve(self, rev: str) -> Commit | None:
        if rev in ("main", "HEAD"):
            return self.commits[-1]
        return next((c for c in self.commits if c.oid == rev), None)


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class FakeHub:
    """In-memory Hub on 127.0.0.1:<free port>. `start()` / `stop()` (or a `with` block)."""

    def __init__(self, user: str = "user"):
        self.user = user
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- repo operations (also usable directly from tests) ----------------------------------------------
    def _repo(self, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def _commit(self, repo: Repo, rev: str) -> Commit:
        commit = repo.resolve(rev)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def create_repo(self, repo_id: str, private: bool = False) -> tuple[Repo, bool]:
        with self._lock:
            if repo_id in self.repos:
                return self.repos[repo_id], False
            repo = Repo(repo_id, private)
            gitattributes = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
            repo.commits.append(Commit(_oid(repo_id, "initial commit"), {".gitattributes": gitattributes},
                                       "initial commit"))
            self.repos[repo_id] = repo
            return repo, True

    def apply_commit(self, repo: Repo, rev: str, lines: list[dict]) -> Commit:
        with self._lock:
            parent = self._commit(repo, rev)
            if rev not in ("main", "HEAD"):
                raise HubError(400, None, "this stand-in commits to main only")
            files = dict(parent.files)
            header = {}
            for item in lines:
                key, value = item.get("key"), item.get("value", {})
                if key == "header":
                    header = value
                    if value.get("parentCommit") not in (None, parent.oid):
                        raise HubError(412, None, "parentCommit is not the head of main")
                elif key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, None, f"unsupported encoding {value.get('encoding')!r}")
                    files[_clean_path(value["path"])] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    path = _clean_path(value["path"])
                    if path not in files:
                        raise HubError(404, "EntryNotFound", "A file with this name doesn't exist")
                    del files[path]
                elif key == "deletedFolder":
                    prefix = _clean_path(value["path"]).rstrip("/") + "/"
                    files = {p: d for p, d in files.items() if not p.startswith(prefix)}
                else:  # lfsFile / copies: never requested, since preupload answers "regular" for every file
                    raise HubError(400, None, f"unsupported commit operation {key!r}")
            message = header.get("summary", "")
            commit = Commit(_oid(parent.oid, message, *sorted(f"{p}:{git_blob_sha1(d)}" for p, d in files.items())),
                            files, message)
            repo.commits.append(commit)
            return commit


def _oid(*parts: str) -> str:
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def _clean_path(path: str) -> str:
    path = path.lstrip("/")
    if not path or any(part in ("", ".", "..") for part in path.split("/")):
        raise HubError(400, None, f"invalid path {path!r}")
    return path


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a connection may sit idle: a stuck client cannot hold a thread forever

    def log_message(self, format, *args):  # quiet: `hub.requests` keeps the log
        pass

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _authorized(self) -> bool:
        return self.headers.get("Authorization", "").startswith("Bearer ")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            while True:  # bounded: MAX_BODY caps the total
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY:
                    raise HubError(413, None, "request body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise HubError(413, None, "request body too large")
        return self.rfile.read(length)

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
        self.send_response(status)
        headers = {"Content-Type": "application/json", **(headers or {})}
        headers.setdefault("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self.hub.requests.append((self.command, self.path, status))

    def _json(self, status: int, obj, headers: dict | None = None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _dispatch(self):
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        try:
            for method, pattern, fn in _ROUTES:
                if method == self.command or (method == "GET" and self.command == "HEAD"):
                    match = re.fullmatch(pattern, path)
                    if match:
                        return fn(self, query=query, **match.groupdict())
            self._body()  # drain, so the connection stays usable
            raise HubError(404, None, f"fake hub: no route for {self.command} {path}")
        except HubError as err:
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send(err.status, json.dumps({"error": err.message}).encode(), headers,
                       head=self.command == "HEAD")

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

    # ---- routes ----------------------------------------------------------------------------------------------
    def whoami(self, query):
        if not self._authorized():
            raise HubError(401, None, "Invalid credentials in Authorization header")
        self._json(200, {"type": "user", "name": self.hub.user, "orgs": [],
                         "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def create_repo(self, query):
        if not self._authorized():
            raise HubError(401, None, "Invalid credentials in Authorization header")
        payload = json.loads(self._body() or b"{}")
        if payload.get("type", "model") != "model":
            raise HubError(400, None, "this stand-in hosts model repos only")
        repo_id = f"{payload.get('organization') or self.hub.user}/{payload['name']}"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo, created = self.hub.create_repo(repo_id, private)
        body = {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id}
        if created:
            self._json(200, body)
        else:
            self._json(409, {**body, "error": "You already created this model repo"})

    def validate_yaml(self, query):
        content = json.loads(self._body()).get("content", "")
        match = re.match(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", content, flags=re.DOTALL)
        errors = []
        if match:
            try:
                import yaml  # a transformers dependency; the client only needs errors/warnings lists back

                if not isinstance(yaml.safe_load(match.group(1)) or {}, dict):
                    errors.append({"message": "metadata is not a mapping"})
            except Exception as err:  # noqa: BLE001 - any YAML error is a validation error
                errors.append({"message": f"invalid YAML: {err}"})
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def model_info(self, repo, query, rev="main"):
        hub_repo = self.hub._repo(repo, self._authorized())
        commit = self.hub._commit(hub_repo, rev)
        self._json(200, {
            "id": repo, "modelId": repo, "author": repo.split("/")[0], "sha": commit.oid,
            "private": hub_repo.private, "gated": False, "disabled": False, "tags": [], "library_name": "transformers",
            "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(commit.created)),
            "siblings": [{"rfilename": p, "size": len(d), "blobId": git_blob_sha1(d)}
                         for p, d in sorted(commit.files.items())],
        })

    def _entries(self, commit: Commit, paths) -> list[dict]:
        out, dirs = [], set()
        for p in paths:
            if p in commit.files:
                data = commit.files[p]
                out.append({"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data)})
            elif any(f.startswith(p.rstrip("/") + "/") for f in commit.files) and p not in dirs:
                dirs.add(p)
                out.append({"type": "directory", "path": p.rstrip("/"), "size": 0, "oid": _oid(p)})
        return out

    def tree(self, repo, rev, query, path=""):
        commit = self.hub._commit(self.hub._repo(repo, self._authorized()), rev)
        prefix = (path or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        names = set()
        for p in commit.files:
            if prefix and not p.startswith(prefix + "/"):
                continue
            rest = p[len(prefix) + 1:] if prefix else p
            names.add(p if recursive or "/" not in rest else f"{prefix + '/' if prefix else ''}{rest.split('/')[0]}")
        if prefix and not names:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}")
        self._json(200, self._entries(commit, sorted(names)))

    def paths_info(self, repo, rev, query):
        commit = self.hub._commit(self.hub._repo(repo, self._authorized()), rev)
        body = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body).get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        self._json(200, self._entries(commit, paths))

    def preupload(self, repo, rev, query):
        hub_repo = self.hub._repo(repo, self._authorized())
        self.hub._commit(hub_repo, rev)
        files = json.loads(self._body())["files"]
        self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                                   for f in files]})

    def commit(self, repo, rev, query):
        if not self._authorized():
            raise HubError(401, None, "Invalid credentials in Authorization header")
        hub_repo = self.hub._repo(repo, True)
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        commit = self.hub.apply_commit(hub_repo, rev, lines)
        self._json(200, {"commitUrl": f"{self.hub.url}/{repo}/commit/{commit.oid}", "commitOid": commit.oid,
                         "pullRequestUrl": None, "success": True})

    def resolve(self, repo, rev, path, query):
        commit = self.hub._commit(self.hub._repo(repo, self._authorized()), rev)
        data = commit.files.get(path)
        if data is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}")
        headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": commit.oid,
                   "ETag": f'"{git_blob_sha1(data)}"', "Accept-Ranges": "bytes"}
        status, body = 200, data
        ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if ranged and self.command == "GET":
            start = min(int(ranged.group(1)), len(data))
            status, body = 206, data[start:]
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._send(status, body, {**headers, "Content-Length": str(len(body))}, head=self.command == "HEAD")


_ROUTES = [
    ("GET", r"/api/whoami-v2", _Handler.whoami),
    ("POST", r"/api/repos/create", _Handler.create_repo),
    ("POST", r"/api/validate-yaml", _Handler.validate_yaml),
    ("GET", rf"/api/models/{_REPO}", _Handler.model_info),
    ("GET", rf"/api/models/{_REPO}/revision/{_REV}", _Handler.model_info),
    ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.*))?", _Handler.tree),
    ("POST", rf"/api/models/{_REPO}/paths-info/{_REV}", _Handler.paths_info),
    ("POST", rf"/api/models/{_REPO}/preupload/{_REV}", _Handler.preupload),
    ("POST", rf"/api/models/{_REPO}/commit/{_REV}", _Handler.commit),
    ("GET", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", _Handler.resolve),
]
