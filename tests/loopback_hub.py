"""A tiny stand-in for the Hugging Face Hub on 127.0.0.1: create-repo, repo info, tree, branch, validate-yaml,
preupload and commit endpoints, enough for ``create_repo`` + ``upload_folder`` through the real client.

Every file is answered as a "regular" (inline base64) upload, so the commit carries the file contents. The server
records each request and each commit and answers 401 to the token ``refused_token``. It stops when the ``with``
block ends or after ``lifetime`` seconds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

_REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create"),
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$"), "info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$"), "branch"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
]


class LoopbackHub:
    """``with LoopbackHub() as hub: os.environ["HF_ENDPOINT"] = hub.url``; then inspect ``hub.commits``."""

    def __init__(self, *, lifetime: float = 120.0, refused_token: str = "hf_refused"):
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> branch -> path -> content
        self.created: dict[str, dict] = {}  # repo -> create-repo request (private, type, ...)
        self.commits: list[dict] = []
        self.requests: list[tuple[str, str]] = []
        self.refused_token = refused_token
        self.lifetime = lifetime
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub._dispatch(self, "GET")

            def do_POST(self):
                hub._dispatch(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.lifetime, self._server.shutdown)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- HTTP plumbing
    def _dispatch(self, handler, method):
        url = urlparse(handler.path)
        path = unquote(url.path)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        with self._lock:
            self.requests.append((method, path))
        if handler.headers.get("Authorization") == f"Bearer {self.refused_token}":
            return self._send(handler, 401, {"error": "Invalid credentials in Authorization header"}, None)
        for route_method, pattern, name in ROUTES:
            match = pattern.match(path)
            if match and route_method == method:
                with self._lock:
                    status, payload, error_code = getattr(self, f"_{name}")(body, **match.groupdict())
                return self._send(handler, status, payload, error_code)
        return self._send(handler, 404, {"error": f"no route {method} {path}"}, None)

    @staticmethod
    def _send(handler, status, payload, error_code):
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if error_code:
            handler.send_header("X-Error-Code", error_code)
            handler.send_header("X-Error-Message", payload.get("error", ""))
        handler.end_headers()
        handler.wfile.write(data)

    # -- endpoints: (status, JSON payload, X-Error-Code)
    def _create(self, body):
        request = json.loads(body)
        repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
        if repo in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}, None
        self.created[repo] = request
        self.repos[repo] = {"main": {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}}
        return 200, {"url": f"{self.url}/{repo}", "name": repo}, None

    def _branch_files(self, repo, rev):
        if repo not in self.repos:
            return None, (404, {"error": "Repository not found"}, "RepoNotFound")
        if rev not in self.repos[repo]:
            return None, (404, {"error": f"Invalid rev id: {rev}"}, "RevisionNotFound")
        return self.repos[repo][rev], None

    def _info(self, body, repo, rev="main"):
        files, error = self._branch_files(repo, rev)
        if error:
            return error
        siblings = [{"rfilename": name} for name in sorted(files)]
        return 200, {"id": repo, "modelId": repo, "sha": self._sha(files), "siblings": siblings, "private": False}, None

    def _tree(self, body, repo, rev, path=None):
        files, error = self._branch_files(repo, rev)
        if error:
            return error
        entries = [
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for name, data in sorted(files.items())
            if not path or name.startswith(path.rstrip("/") + "/")
        ]
        return 200, entries, None

    def _branch(self, body, repo, rev):
        files, error = self._branch_files(repo, "main")
        if error:
            return error
        self.repos[repo].setdefault(rev, dict(files))
        return 200, {}, None

    def _validate_yaml(self, body):
        return 200, {"errors": [], "warnings": []}, None

    def _preupload(self, body, repo, rev):
        files = json.loads(body)["files"]
        modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
        return 200, {"files": modes}, None

    def _commit(self, body, repo, rev):
        files, error = self._branch_files(repo, rev)
        if error:
            return error
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        added, deleted = {}, []
        for line in lines:
            if line["key"] == "file":
                added[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] == "deletedFile":
                deleted.append(line["value"]["path"])
            elif line["key"] != "header":
                return 400, {"error": f"unsupported commit entry {line['key']}"}, None
        for name in deleted:
            files.pop(name, None)
        files.update(added)
        oid = self._sha(files)
        self.commits.append({"repo": repo, "revision": rev, "added": added, "deleted": deleted, "header": lines[0]})
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True}, None

    @staticmethod
    def _sha(files) -> str:
        digest = hashlib.sha1()
        for name, data in sorted(files.items()):
            digest.update(name.encode() + b"\0" + data)
        return digest.hexdigest()
