"""A fake Hugging Face hub on 127.0.0.1 for the download tests.

It serves, over real HTTP, the endpoints huggingface_hub 2.4.0 calls for a model download
(read from its source: ``hf_api.py``, ``file_download.py``, ``_snapshot_download.py``,
``utils/_http.py``, ``utils/_pagination.py``):

* ``GET /api/models/{owner}/{name}[/revision/{rev}]``: repo info; ``HfApi.model_info`` reads
  ``id`` and ``sha`` (the revision is URL-quoted with ``safe=''``, so ``refs/pr/1`` arrives as
  one segment).
* ``GET /api/models/{owner}/{name}/tree/{rev}?recursive=...&expand=...``: the file listing,
  paginated with a GitHub-style ``Link: <url>; rel="next"`` header. Entries are
  ``{"type": "file", "path", "size", "oid": <git blob sha1>, "lfs": {"oid": <sha256>, "size",
  "pointerSize"}}`` (``lfs`` only for LFS files) and ``{"type": "directory", "path", "oid"}``.
  No ``xetHash``, so hf_xet is never engaged.
* ``HEAD``/``GET /{owner}/{name}/resolve/{rev}/{path}``: the file. ``get_hf_file_metadata``
  needs ``X-Repo-Commit`` (else FileMetadataError) and an ETag (``X-Linked-Etag`` preferred,
  then ``ETag``: the sha256 for LFS files, the git blob sha1 otherwise) and a size
  (``X-Linked-Size``, else ``Content-Length``). ``http_get`` resumes a broken stream with
  ``Range: bytes=N-`` and expects ``206`` with ``Content-Range`` (a ``200`` makes it restart).
* Optionally (``lfs_redirect=True``) LFS files answer ``/resolve`` with a 302 to
  ``http://localhost:{port}/cdn/{sha256}``, a different origin, as the real hub redirects to
  its CDN: huggingface_hub then takes the metadata from the 302 itself and drops the
  Authorization header for the CDN request.

Errors carry the ``X-Error-Code`` header ``hf_raise_for_status`` maps to exception types
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).

Knobs for tests: :meth:`FakeHub.fail` (answer a status N times), :attr:`FakeHub.drop_after`
(close the connection after N body bytes of a file on its first GET),
:attr:`FakeHub.corrupt` (serve wrong bytes of the right length while the listing keeps the
true hashes), ``token=`` (require ``Authorization: Bearer <token>``). Every request is
recorded (:attr:`FakeHub.requests`, with its Range and Authorization headers) and the body
bytes sent per file are counted (:attr:`FakeHub.bytes_served`).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def git_blob_sha1(data: bytes) -> str:
    """The object id git gives a file's content (what the tree listing calls ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    """One model repo at one commit; ``refs`` maps branch/tag names to that commit."""

    repo_id: str
    files: dict[str, bytes]
    lfs: set[str] = field(default_factory=set)
    sha: str = ""
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False

    @classmethod
    def build(
        cls,
        repo_id: str,
        files: dict[str, bytes],
        *,
        lfs: set[str] | None = None,
        tags: tuple[str, ...] = (),
    ) -> FakeRepo:
        """A repo whose commit sha is derived from its content; LFS = weight-like files by default."""
        if lfs is None:
            lfs = {p for p in files if p.endswith(LFS_SUFFIXES)}
        digest = hashlib.sha1(repr(sorted((p, hashlib.sha256(d).hexdigest()) for p, d in files.items())).encode())
        sha = digest.hexdigest()
        refs = {"main": sha, **{t: sha for t in tags}}
        return cls(repo_id=repo_id, files=dict(files), lfs=set(lfs), sha=sha, refs=refs)

    @classmethod
    def from_dir(cls, repo_id: str, directory: Path, **kwargs: object) -> FakeRepo:
        """A repo holding every file below ``directory``."""
        directory = Path(directory)
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
        return cls.build(repo_id, files, **kwargs)  # type: ignore[arg-type]

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def etag(self, path: str) -> str:
        return self.sha256(path) if path in self.lfs else git_blob_sha1(self.files[path])

    def tree(self) -> list[dict]:
        """The recursive listing the hub's /tree endpoint returns, folders included."""
        entries: list[dict] = []
        folders: set[str] = set()
        for path in sorted(self.files):
            parts = path.split("/")
            for i in range(1, len(parts)):
                folders.add("/".join(parts[:i]))
        for folder in sorted(folders):
            entries.append({"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0})
        for path in sorted(self.files):
            data = self.files[path]
            entry: dict = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
            if path in self.lfs:
                entry["lfs"] = {"oid": self.sha256(path), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries


@dataclass
class Request:
    """One request the fake hub received."""

    method: str
    kind: str  # "info", "tree", "resolve", "cdn", "unknown"
    path: str  # the file path for resolve/cdn, else the URL path
    range: str | None
    authorization: str | None
    revision: str | None = None  # as the client sent it (info/tree/resolve)
    status: int = 0


@dataclass
class _Failure:
    kind: str
    status: int
    remaining: int
    path: str | None
    method: str | None
    skip: int = 0


class _HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # listen backlog (stdlib: 5): the hub client opens up to 8 connections at once


class FakeHub:
    """A threaded HTTP server speaking enough of the hub's API for ``snapshot_download``.

    Use as a context manager; :attr:`url` is the endpoint to pass as ``endpoint=``.
    """

    def __init__(
        self,
        repos: FakeRepo | list[FakeRepo],
        *,
        token: str | None = None,
        page_size: int = 1000,
        lfs_redirect: bool = False,
    ) -> None:
        repos = [repos] if isinstance(repos, FakeRepo) else list(repos)
        self.repos = {r.repo_id: r for r in repos}
        self.token = token
        self.page_size = page_size
        self.lfs_redirect = lfs_redirect
        self.drop_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.requests: list[Request] = []
        self.bytes_served: Counter[str] = Counter()
        self._failures: list[_Failure] = []
        self._dropped: set[str] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = _HubHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- knobs -------------------------------------------------------------------------------

    def fail(
        self,
        kind: str,
        status: int = 503,
        times: int = 1,
        *,
        path: str | None = None,
        method: str | None = None,
        skip: int = 0,
    ) -> None:
        """Answer ``times`` requests of ``kind`` (info/tree/resolve/cdn) with ``status``.

        ``path`` limits it to one file (resolve/cdn), ``method`` to GET or HEAD; the first
        ``skip`` matching requests are let through.
        """
        with self._lock:
            self._failures.append(_Failure(kind, status, times, path, method, skip))

    # --- records -----------------------------------------------------------------------------

    def count(self, kind: str | None = None, *, method: str | None = None, path: str | None = None) -> int:
        with self._lock:
            return sum(
                1
                for r in self.requests
                if (kind is None or r.kind == kind)
                and (method is None or r.method == method)
                and (path is None or r.path == path)
            )

    def ranges(self, path: str) -> list[str | None]:
        """The Range header of every GET of ``path``'s bytes, in order."""
        with self._lock:
            return [r.range for r in self.requests if r.method == "GET" and r.kind in ("resolve", "cdn") and r.path == path]

    def reset_records(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_served.clear()

    # --- internals used by the handler -------------------------------------------------------

    def _take_failure(self, kind: str, method: str, path: str | None) -> int | None:
        with self._lock:
            for f in self._failures:
                if f.remaining > 0 and f.kind == kind and f.path in (None, path) and f.method in (None, method):
                    if f.skip > 0:
                        f.skip -= 1
                        continue
                    f.remaining -= 1
                    return f.status
        return None

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def _should_drop(self, path: str) -> int | None:
        with self._lock:
            if path in self.drop_after and path not in self._dropped:
                self._dropped.add(path)
                return self.drop_after[path]
        return None

    def _served(self, path: str, n: int) -> None:
        with self._lock:
            self.bytes_served[path] += n


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every response has a length
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle + delayed ACK add
    # ~40 ms to every request.
    disable_nagle_algorithm = True
    fake: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass  # keep pytest output clean

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("HEAD")

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    # --- routing -----------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        # Split before unquoting: a quoted revision such as refs%2Fpr%2F1 is one segment.
        segs = [unquote(s) for s in split.path.split("/")[1:]]
        query = parse_qs(split.query)
        kind, repo_id, rev, file_path = "unknown", None, None, None
        if len(segs) >= 3 and segs[0] == "api" and segs[1] == "models":
            repo_id = f"{segs[2]}/{segs[3]}" if len(segs) >= 4 else None
            if len(segs) == 4:
                kind, rev = "info", "main"
            elif len(segs) == 6 and segs[4] == "revision":
                kind, rev = "info", segs[5]
            elif len(segs) >= 6 and segs[4] == "tree":
                kind, rev = "tree", segs[5]
        elif len(segs) >= 5 and segs[2] == "resolve":
            kind, repo_id, rev, file_path = "resolve", f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:])
        elif len(segs) == 2 and segs[0] == "cdn":
            kind, file_path = "cdn", segs[1]  # the sha256; mapped to a path below

        fake = self.fake
        repo = fake.repos.get(repo_id) if repo_id else None
        if kind == "cdn":
            for r in fake.repos.values():
                for p in r.lfs:
                    if r.sha256(p) == file_path:
                        repo, file_path = r, p
        req = Request(
            method, kind, file_path or split.path, self.headers.get("Range"), self.headers.get("Authorization"), rev
        )
        fake._record(req)

        # Injected failures come first: a load balancer's 5xx arrives before any auth check.
        status = fake._take_failure(kind, method, file_path)
        if status is not None:
            req.status = status
            # No X-Error-Code: a bare status, as a proxy or load balancer would answer.
            return self._error(status, None, f"injected {status}", method, repo)

        # The CDN serves signed URLs without the hub's token, as the real one does.
        if fake.token is not None and kind != "cdn":
            auth = self.headers.get("Authorization")
            if auth is None:
                # The hub hides private repos from anonymous callers: 401 + RepoNotFound.
                req.status = 401
                return self._error(401, "RepoNotFound", "Repository not found", method, repo)
            if auth != f"Bearer {fake.token}":
                req.status = 401
                return self._error(401, None, "Invalid credentials in Authorization header", method, repo)

        if repo is None:
            req.status = 404
            return self._error(404, "RepoNotFound", "Repository not found", method, None)
        if kind == "cdn":
            assert file_path is not None
            return self._serve_file(method, repo, file_path, req)
        sha = repo.refs.get(rev or "", rev if rev == repo.sha else None)
        if sha is None:
            req.status = 404
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", method, repo)
        if kind == "info":
            return self._json(
                {
                    "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
                    "id": repo.repo_id,
                    "modelId": repo.repo_id,
                    "sha": sha,
                    "private": repo.private,
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                },
                method,
                req,
            )
        if kind == "tree":
            return self._tree(repo, rev or "main", query, method, req)
        if kind == "resolve":
            assert file_path is not None
            if file_path not in repo.files:
                req.status = 404
                return self._error(404, "EntryNotFound", f"{file_path} does not exist", method, repo)
            if fake.lfs_redirect and file_path in repo.lfs:
                return self._redirect_to_cdn(repo, file_path, method, req)
            return self._serve_file(method, repo, file_path, req)
        req.status = 404
        return self._error(404, None, "Not found", method, None)

    # --- responses ---------------------------------------------------------------------------

    def _tree(self, repo: FakeRepo, rev: str, query: dict[str, list[str]], method: str, req: Request) -> None:
        entries = repo.tree()
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        if not recursive:
            entries = [e for e in entries if "/" not in e["path"]]
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.fake.page_size]
        headers = {}
        if start + self.fake.page_size < len(entries):
            nxt = (
                f"{self.fake.url}/api/models/{repo.repo_id}/tree/{quote(rev, safe='')}"
                f"?recursive={str(recursive).lower()}&cursor={start + self.fake.page_size}"
            )
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._json(page, method, req, headers)

    def _common_file_headers(self, repo: FakeRepo, path: str) -> dict[str, str]:
        headers = {
            "X-Repo-Commit": repo.sha,
            "ETag": f'"{repo.etag(path)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if path in repo.lfs:
            headers["X-Linked-Etag"] = f'"{repo.sha256(path)}"'
            headers["X-Linked-Size"] = str(len(repo.files[path]))
        return headers

    def _redirect_to_cdn(self, repo: FakeRepo, path: str, method: str, req: Request) -> None:
        headers = self._common_file_headers(repo, path)
        headers["Location"] = f"http://localhost:{self.fake.port}/cdn/{repo.sha256(path)}"
        headers["Content-Length"] = "0"
        req.status = 302
        self._send(302, headers, b"", method)

    def _serve_file(self, method: str, repo: FakeRepo, path: str, req: Request) -> None:
        data = repo.files[path]
        if path in self.fake.corrupt:
            # Same length, different bytes: only a hash check can tell.
            data = bytes([data[0] ^ 0xFF]) + data[1:] if data else data
        size = len(data)
        headers = self._common_file_headers(repo, path)
        status, start, end = 200, 0, size - 1
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or int(m.group(1)) >= size:
                req.status = 416
                headers.update({"Content-Range": f"bytes */{size}", "Content-Length": "0"})
                return self._send(416, headers, b"", method)
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        body = data[start : end + 1]
        headers["Content-Length"] = str(len(body))
        req.status = status
        if method == "HEAD":
            return self._send(status, headers, b"", method)
        drop = self.fake._should_drop(path)
        if drop is not None and drop < len(body):
            # Promise the whole body, send part of it, and cut the connection: a network drop.
            self._send_head(status, headers)
            self.wfile.write(body[:drop])
            self.wfile.flush()
            self.fake._served(path, drop)
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self._send(status, headers, body, method)
        self.fake._served(path, len(body))

    def _json(self, doc: object, method: str, req: Request, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(doc).encode()
        req.status = 200
        self._send(200, {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}, body,
                   method)

    def _error(self, status: int, code: str | None, message: str, method: str, repo: FakeRepo | None) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if repo is not None:
            headers["X-Repo-Commit"] = repo.sha
        self._send(status, headers, body, method)

    def _send_head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _send(self, status: int, headers: dict[str, str], body: bytes, method: str) -> None:
        self._send_head(status, headers)
        if method != "HEAD" and body:
            self.wfile.write(body)
