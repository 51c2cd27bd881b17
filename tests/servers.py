"""Real loopback servers for tests: a static HTTP file server with Range (and optional
PUT, auth, injected failures), and an S3-compatible ``moto_server`` subprocess.

Both bind 127.0.0.1 only, on a free port, and are stopped in ``finally`` (the HTTP
server by shutting its thread down, moto by its PID). Use the context managers
directly, or the pytest fixtures ``http_server`` / ``s3_server`` / ``s3_bucket`` from
``conftest.py``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

# Dummy credentials: moto accepts any; real ones must never be used against it.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- HTTP


@dataclass
class HttpServer:
    """Handle of a running test HTTP server. The switches can be flipped between requests."""

    root: Path
    url: str = ""
    honor_range: bool = True  # False: ignore Range and answer 200 with the whole file
    require_token: str | None = None  # answer 401 unless "Authorization: Bearer <token>"
    allow_put: bool = False  # accept PUT (written atomically: temp file + os.replace)
    fail_next: int = 0  # answer the next N requests with fail_status
    fail_status: int = 503
    delay: float = 0.0  # seconds to sleep before answering GET/HEAD (to observe overlap)
    trickle: float = 0.0  # seconds between single body bytes (a slow-loris source)
    cut_next: int = 0  # the next N GET bodies stop half way and the connection is dropped (a read cut mid-body)
    redirects: dict = field(default_factory=dict)  # request path -> Location (answered with 302)
    inflight: int = 0
    max_inflight: int = 0  # most GET/HEAD requests served at once since the last reset
    requests: list = field(default_factory=list)  # (method, path, headers) of every request
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.honor_range, self.require_token, self.allow_put = True, None, False
            self.fail_next, self.fail_status, self.cut_next = 0, 503, 0
            self.delay, self.max_inflight, self.trickle = 0.0, 0, 0.0
            self.redirects.clear()
            self.requests.clear()


def _etag(path_or_file) -> str:
    """A strong ETag: the SHA-256 of the file's bytes. Given an open file, of that file (its position is
    kept), so that an answer's ETag, length and body describe one state of an object that a PUT may be
    replacing meanwhile. Cached per file state (device, inode, mtime, size: a PUT replaces the inode), so
    that range reads of a big blob (bench/k2_step.py) do not hash it whole on every request."""
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "rb") as f:
            return _etag(f)
    st = os.fstat(path_or_file.fileno())
    return _etag_of(path_or_file, (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))


_ETAGS: dict = {}


def _etag_of(f, state: tuple) -> str:
    import hashlib

    if state not in _ETAGS:
        at = f.tell()
        f.seek(0)
        _ETAGS[state] = '"' + hashlib.sha256(f.read()).hexdigest()[:32] + '"'
        f.seek(at)
    return _ETAGS[state]


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single-range ``Range`` support (SimpleHTTPRequestHandler has none)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
    disable_nagle_algorithm = True  # TCP_NODELAY, as real servers set: else a small answer waits ~40 ms for an ACK

    def log_message(self, *args):  # keep test output quiet
        pass

    @property
    def state(self) -> HttpServer:
        return self.server.state

    def _gate(self) -> bool:
        st = self.state
        with st.lock:
            fail = st.fail_next > 0
            if fail:
                st.fail_next -= 1
        if fail:
            self.send_error(st.fail_status)  # also closes the connection
            return False
        if st.require_token and self.headers.get("Authorization") != f"Bearer {st.require_token}":
            self.send_error(401)
            return False
        return True

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        st = self.state
        with st.lock:
            st.requests.append((self.command, self.path, dict(self.headers)))
            st.inflight += 1
            st.max_inflight = max(st.max_inflight, st.inflight)
        try:
            if st.delay:
                time.sleep(st.delay)
            self._serve_file(body)
        finally:
            with st.lock:
                st.inflight -= 1

    def _serve_file(self, body: bool) -> None:
        if not self._gate():
            return
        target = self.state.redirects.get(self.path)
        if target is not None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = self.translate_path(self.path)
        try:  # one open file for the ETag, the length and the body: a PUT replacing it meanwhile changes none
            f = open(path, "rb") if os.path.isfile(path) else None
        except OSError:
            f = None
        if f is None:
            self.send_error(404)
            return
        with f:
            self._send_file(f, body)

    def _send_file(self, f, body: bool) -> None:
        size = os.fstat(f.fileno()).st_size
        start, end, status = 0, size - 1, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", (self.headers.get("Range") or "").strip())
        if m and (m[1] or m[2]) and self.state.honor_range:
            if m[1]:
                start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
            else:
                start, end = max(0, size - int(m[2])), size - 1
            if start >= size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", _etag(f))
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not body:
            return
        with self.state.lock:
            cut = self.state.cut_next > 0
            if cut:
                self.state.cut_next -= 1
        try:
            f.seek(start)
            left = end - start + 1
            if cut:  # promise the whole range, send half of it, hang up
                self.wfile.write(f.read(left // 2))
                self.wfile.flush()
                self.close_connection = True
                return
            while left > 0:
                chunk = f.read(1 if self.state.trickle else min(left, 1 << 16))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)
                if self.state.trickle:
                    self.wfile.flush()
                    time.sleep(self.state.trickle)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client hung up early (e.g. after its range)

    def do_PUT(self):
        with self.state.lock:
            self.state.requests.append((self.command, self.path, dict(self.headers)))
        if not self._gate():
            return
        if not self.state.allow_put:
            self.send_error(405)
            return
        n = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(n)
        dest = self.translate_path(self.path)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with self.state.lock:  # conditional PUT (RFC 9110): If-None-Match: * creates, If-Match replaces that ETag only
            exists = os.path.isfile(dest)
            if (self.headers.get("If-None-Match") == "*" and exists) or (
                    "If-Match" in self.headers and (not exists or _etag(dest) != self.headers["If-Match"])):
                self.send_error(412)
                return
            fd, tmp = tempfile.mkstemp(prefix=".put-", dir=os.path.dirname(dest))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _QuietServer(ThreadingHTTPServer):
    """A client hanging up mid-answer (a reader that got its range, a refused redirect) is normal here."""

    def handle_error(self, request, client_address):
        import sys as _sys

        if not isinstance(_sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


@contextmanager
def serve_http(root: str | os.PathLike):
    """Serve ``root`` on http://127.0.0.1:<free port>; yields an ``HttpServer`` handle."""
    state = HttpServer(root=Path(root))
    httpd = _QuietServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(root)))
    httpd.daemon_threads = True
    httpd.state = state
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


# --------------------------------------------------------------------------- S3


@dataclass
class S3Server:
    endpoint_url: str
    pid: int
    env: dict  # dummy credentials + ENGINE_EXT_S3_ENDPOINT, for in-process use or subprocesses
    log_path: str

    def make_bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket (unique name by default) and return its name."""
        import boto3

        name = name or f"t-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name


@contextmanager
def serve_s3(timeout: float = 60.0):
    """Start ``python -m moto.server`` on 127.0.0.1:<free port>; yields an ``S3Server``."""
    log_dir = tempfile.mkdtemp(prefix="moto-log-")
    log_path = os.path.join(log_dir, "moto.log")
    env = {**os.environ, **S3_ENV}
    proc = None
    try:
        for _attempt in range(3):  # the free port may be taken between probe and bind
            port = free_port()
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=log, stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    requests.get(url + "/moto-api/", timeout=2)
                    break
                except requests.ConnectionError:
                    time.sleep(0.1)
            if proc.poll() is None and time.monotonic() < deadline:
                break
            _stop(proc)
            proc = None
        if proc is None:
            raise RuntimeError(f"moto_server did not start; log: {open(log_path).read()[-2000:]}")
        yield S3Server(url, proc.pid, {**S3_ENV, "ENGINE_EXT_S3_ENDPOINT": url}, log_path)
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(log_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a child we started, by its PID: SIGTERM, then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
