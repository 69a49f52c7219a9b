"""A test stand-in for the Hugging Face hub: a local HTTP server answering the few routes huggingface_hub
calls, from folders on disk. It is NOT the hub (the development machines cannot reach it): it serves one
commit per repository and implements only what edgerun's pull and huggingface_hub's downloads read.

Routes (shapes as huggingface_hub parses them, read from its source):
  GET  /api/models/ORG/REPO[/revision/REV][?blobs=true]  {"id", "sha", "siblings": [{"rfilename", and with
       blobs=true "size", "blobId" and, for LFS files, "lfs": {"size", "sha256", "pointerSize"}}]}
  HEAD /ORG/REPO/resolve/REV/PATH   ETag (the git blob id, or the sha256 for an LFS file), X-Repo-Commit,
       X-Linked-Etag / X-Linked-Size for LFS files, Content-Length, Accept-Ranges
  GET  the same                     a small file itself; an LFS file (weights) answers 302 to
       /cdn/ORG/REPO/PATH as the hub redirects to its CDN; `Range: bytes=N-` answered 206 with Content-Range
Errors carry the hub's X-Error-Code (RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound) and
X-Error-Message headers. A gated repo lists its files to anyone and serves them to `Authorization: Bearer
<token>` with its token.

Test knobs: `corrupt` (repo/path -> flip one byte of the body), `stall` (repo/path -> bytes sent before the
body blocks until `release` is set, to kill a client mid-download), `log` (every request: method, path, Range),
`served` (every file body sent: repo/path and the Range asked).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".gguf", ".safetensors", ".npz")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    folder: Path
    gated_token: str | None = None          # set: the repo is gated; this token is let in
    commit: str = ""

    def files(self) -> dict[str, Path]:
        return {p.relative_to(self.folder).as_posix(): p for p in sorted(self.folder.rglob("*")) if p.is_file()}

    def __post_init__(self):
        h = hashlib.sha1()
        for name, p in self.files().items():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
        self.commit = h.hexdigest()        # a stable 40-hex "commit" over the folder's content


@dataclass
class StandIn:
    repos: dict[str, Repo] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    stall: dict[str, int] = field(default_factory=dict)
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)
    served: list[tuple[str, str | None]] = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, folder: Path, gated_token: str | None = None) -> Repo:
        self.repos[repo_id] = Repo(Path(folder), gated_token)
        return self.repos[repo_id]

    def downloads(self) -> list[tuple[str, str | None]]:
        """(repo/path, Range header) of every file body served."""
        return list(self.served)


def _meta(data: bytes, name: str) -> dict:
    blob = git_blob_id(data)
    d = {"rfilename": name, "size": len(data), "blobId": blob}
    if name.endswith(LFS_SUFFIXES):
        d["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
    return d


def make_handler(hub: StandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):     # quiet
            pass

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo(self, repo_id: str, rev: str | None, files: bool = False) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            # as on the hub, a gated repo's metadata is public; its files need a token that was let in
            if files and repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to "
                                              "it and be authenticated to access it. Please log in.")
                return None
            if rev not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def do_HEAD(self):
            self._serve(head=True)

        def do_GET(self):
            self._serve(head=False)

        def _serve(self, head: bool) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = "/".join(parts[2:4])
                rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else None
                repo = self._repo(repo_id, rev)
                if repo is None:
                    return
                blobs = parse_qs(url.query).get("blobs") == ["True"] or parse_qs(url.query).get("blobs") == ["true"]
                sib = [_meta(p.read_bytes(), n) if blobs else {"rfilename": n} for n, p in repo.files().items()]
                body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                                   "gated": "manual" if repo.gated_token else False, "siblings": sib}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                return
            cdn = parts[0] == "cdn" and len(parts) >= 4
            if cdn or (len(parts) >= 5 and parts[2] == "resolve"):
                if cdn:
                    repo_id, rev, name = "/".join(parts[1:3]), None, "/".join(parts[3:])
                else:
                    repo_id, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo = self._repo(repo_id, rev, files=True)
                if repo is None:
                    return
                f = repo.files().get(name)
                if f is None:
                    self._error(404, "EntryNotFound", f"{name} does not exist on \"{rev}\"")
                    return
                data = f.read_bytes()
                meta = _meta(data, name)
                key = f"{repo_id}/{name}"
                if key in hub.corrupt:
                    i = len(data) // 2
                    data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and rng.endswith("-"):
                    start = int(rng[6:-1])
                body = data[start:]
                redirect = "lfs" in meta and not cdn
                self.send_response(302 if redirect else 206 if start else 200)
                if redirect:
                    self.send_header("Location", f"{hub.url}/cdn/{repo_id}/{name}")
                self.send_header("Content-Length", "0" if redirect else str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("X-Repo-Commit", repo.commit)
                if "lfs" in meta:
                    self.send_header("ETag", f'"{meta["lfs"]["sha256"]}"')
                    self.send_header("X-Linked-Etag", f'"{meta["lfs"]["sha256"]}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                else:
                    self.send_header("ETag", f'"{meta["blobId"]}"')
                if start and not redirect:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head or redirect:
                    return
                hub.served.append((key, rng))
                cut = hub.stall.get(key)
                if cut is not None and not hub.release.is_set():
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    hub.stalled.set()
                    hub.release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(body)
                return
            self._error(404, "EntryNotFound", f"no route {path}")

    return Handler


class Server:
    """The stand-in on 127.0.0.1, a random port, in a thread: `with Server(hub) as url:`."""

    def __init__(self, hub: StandIn, port: int = 0):
        self.hub = hub
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(hub))
        self.httpd.daemon_threads = True
        hub.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.hub.url

    def __exit__(self, *exc) -> None:
        self.hub.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def main(argv: list[str] | None = None) -> None:
    """By hand: `python tests/hubstandin.py [--port N] [--token T] ORG/REPO=FOLDER ...` serves those folders
    until interrupted; point HF_ENDPOINT at the URL it prints. A repo given as ORG/REPO=FOLDER:gated is gated
    and served only with --token."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(description="a local stand-in for the Hugging Face hub (tests only)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token", default="hf_standin_token")
    ap.add_argument("repos", nargs="+", metavar="ORG/REPO=FOLDER[:gated]")
    args = ap.parse_args(argv)
    hub = StandIn()
    for spec in args.repos:
        repo_id, _, folder = spec.partition("=")
        gated = folder.endswith(":gated")
        folder = folder[:-len(":gated")] if gated else folder
        if repo_id.count("/") != 1 or not Path(folder).is_dir():
            ap.error(f"{spec}: expected ORG/REPO=FOLDER with an existing folder")
        hub.add(repo_id, Path(folder), gated_token=args.token if gated else None)
    with Server(hub, args.port) as url:
        print(f"hub stand-in at {url}: HF_ENDPOINT={url}", flush=True)
        for repo_id, repo in hub.repos.items():
            print(f"  {repo_id} (commit {repo.commit[:12]}{', gated' if repo.gated_token else ''})", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
