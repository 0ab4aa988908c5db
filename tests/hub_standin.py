"""A local stand-in for the Hugging Face Hub's file routes (`HF_ENDPOINT`), so downloads by
hub id are tested without the internet: it serves directories as model repositories at
one revision, through the routes `huggingface_hub.snapshot_download` calls (repository
info, its file tree, and each file under `resolve/`, HEAD or GET), and records the paths
asked for."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

REVISION = "5d4c2b1a09f8e7d6c5b4a3928170f6e5d4c3b2a1"


class _Hub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, Path]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.asked: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: _Hub

    def log_message(self, *args: object) -> None:   # quiet: the test reads `asked`
        return

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.server.asked.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, route = "/".join(parts[2:4]), parts[4]
            if repo not in self.server.repos:
                return self._missing()
            files = _files(self.server.repos[repo])
            if route == "revision":
                return self._json({"id": repo, "modelId": repo, "sha": REVISION,
                                   "private": False,
                                   "siblings": [{"rfilename": name} for name in files]})
            if route == "tree":
                return self._json([{"type": "file", "path": name, "size": len(data),
                                    "oid": hashlib.sha1(data).hexdigest()}
                                   for name, data in files.items()])
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            files = _files(self.server.repos[repo]) if repo in self.server.repos else {}
            if name not in files:
                return self._missing()
            data = files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", REVISION)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if body:
                self.wfile.write(data)
            return None
        return self._missing()

    def _json(self, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _missing(self) -> None:
        data = b'{"error": "Repository not found"}'
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()
            and not p.name.startswith(".")}


@contextmanager
def hub(repos: dict[str, Path]) -> Iterator[_Hub]:
    """A stand-in hub serving each `repos` id (`org/name`) from its directory, on a free
    local port (`server_address`) until the block ends."""
    server = _Hub(repos)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
