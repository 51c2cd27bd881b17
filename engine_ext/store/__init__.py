"""Object stores for published versions: one small interface, several real backends.

A store is rooted at the "directory" of a run (``s3://bucket/run1``, ``/data/run1``,
``https://host/run1``, ``hf://buckets/ns/name/run1``); keys are relative ``/``-separated
names under that root (``v00000003.json``, ``LATEST``). Every failure surfaces as an
``engine_ext.errors`` exception whose message names the URI, so callers need to know only
``NotFoundError`` (object absent), ``IntegrityError`` (object shorter than the bytes asked
for) and ``SourceError`` (everything else: network, auth, misconfiguration).

Publishing relies on three properties of every writable backend: ``write`` is atomic per
object (readers see the old or the new bytes, never a prefix); ``create`` writes an
object only if it does not exist yet (``ConflictError`` otherwise), so that a published
version is never written twice; and ``write_if`` replaces ``LATEST`` only if what it
holds still allows it (compare-and-swap), so that it only moves forward. Local
directories and S3 (``If-None-Match``/``If-Match``) give all three atomically; an HTTP PUT
server does as far as it honours those headers; Hugging Face Buckets offer no conditional
write, so there they are a check before the write (docs/RELIABILITY.md).
``publish_version`` builds the all-or-nothing version on top of them by ordering the writes.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Mapping

from .. import settings
from ..errors import ConflictError, FetchTimeoutError, ForbiddenSourceError, IntegrityError, NotFoundError, SourceError
from ..format.manifest import LATEST_KEY, MAX_LATEST_BYTES

__all__ = [
    "Store", "LocalStore", "HttpStore", "S3Store", "HfBucketStore",
    "open_store", "split_uri", "publish_version", "LATEST_KEY",
]

_TMP_PREFIX = ".engine-ext-tmp-"  # temp files of in-progress local writes; never listed


def _check_key(key: str, root: str) -> str:
    """Refuse keys that could escape the root (a hostile manifest may name ``../x``)."""
    if not isinstance(key, str) or not key:
        raise ForbiddenSourceError(f"empty or non-string key {key!r} under {root}")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise ForbiddenSourceError(f"refused key {key!r} under {root}: keys are relative names without '..', '.', '//' or '\\'")
    return key


def _check_prefix(prefix: str, root: str) -> str:
    if prefix and (prefix.startswith("/") or ".." in prefix.split("/") or "\\" in prefix):
        raise ForbiddenSourceError(f"refused list prefix {prefix!r} under {root}")
    return prefix


def _check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"byte range needs start >= 0 and length >= 0, got start={start} length={length}")


def _short(uri: str, start: int, want: int, got: int) -> IntegrityError:
    return IntegrityError(f"short read of {uri}: asked {want} bytes at offset {start}, object holds {got}")


class ReadCut(SourceError):
    """The connection dropped in the middle of a body (a cut read): retried by the store."""


def _too_large(uri: str, size: int, limit: int) -> SourceError:
    return SourceError(f"{uri} is {size} bytes, over the limit of {limit} bytes for this read")


class Store:
    """Interface of a store rooted at ``uri``. Subclasses implement the primitives."""

    uri: str
    #: default cap on ``read`` (whole objects are held in memory); None = no cap
    max_object_bytes: int | None = None
    #: ``time.monotonic()`` after which every read fails with FetchTimeoutError (None: no deadline);
    #: a reader sets it for the whole of one update, so a slow source cannot stretch it
    deadline: float | None = None
    #: a read cut mid-body (:class:`ReadCut`) is tried again this many times, after ``backoff`` * 2^k
    #: seconds, while the deadline allows; then it fails (502)
    retries: int = 3
    backoff: float = 0.25

    def _retry_cuts(self, what: str, read):
        """``read()``, again after a :class:`ReadCut` (the network's own retries stop at the headers)."""
        for attempt in range(self.retries + 1):
            try:
                return read()
            except ReadCut:
                pause = min(self.backoff * 2 ** attempt, 10.0)
                left = self.remaining(what)
                if attempt == self.retries or (left is not None and pause >= left):
                    raise
                time.sleep(pause)

    def remaining(self, what: str) -> float | None:
        """Seconds left before the deadline (None: no deadline); FetchTimeoutError once it passed."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FetchTimeoutError(f"{what}: the update's fetch deadline passed (ENGINE_EXT_FETCH_TIMEOUT)")
        return left

    def key_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{_check_key(key, self.uri)}"

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """Whole object. ``max_bytes`` (default ``max_object_bytes``) refuses bigger objects."""
        raise NotImplementedError

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``start``, or IntegrityError if the object is shorter."""
        raise NotImplementedError

    def read_ranges(self, key: str, ranges: list[tuple[int, int]], workers: int = 8) -> list[bytes]:
        """Several ``(start, length)`` ranges of one object, fetched in parallel, in order."""
        ranges = list(ranges)
        for s, n in ranges:
            _check_range(s, n)
        if len(ranges) <= 1 or workers <= 1:
            return [self.read_range(key, s, n) for s, n in ranges]
        with ThreadPoolExecutor(max_workers=min(workers, len(ranges))) as pool:
            return list(pool.map(lambda r: self.read_range(key, r[0], r[1]), ranges))

    def write(self, key: str, data: bytes) -> None:
        """Atomic per object: readers see the old bytes or the new ones, never a prefix."""
        raise SourceError(f"{self.uri} is read-only")

    def write_file(self, key: str, path: str | os.PathLike) -> None:
        """Write a (large) local file; backends that can stream override this."""
        with open(path, "rb") as f:
            self.write(key, f.read())

    def create(self, key: str, data: bytes) -> None:
        """Write ``key`` only if it does not exist yet (:class:`ConflictError` otherwise): a version's
        objects are written with it, so that nothing published is ever written twice. This default,
        for backends with no conditional write, checks before it writes (not atomic against a racer)."""
        if self.exists(key):
            raise ConflictError(f"{self.key_uri(key)} already exists")
        self.write(key, data)

    def create_file(self, key: str, path: str | os.PathLike) -> None:
        """:meth:`create` from a (large) local file."""
        if self.exists(key):
            raise ConflictError(f"{self.key_uri(key)} already exists")
        self.write_file(key, path)

    def write_if(self, key: str, data: bytes, check: Callable[[bytes | None], None],
                 max_bytes: int = MAX_LATEST_BYTES) -> None:
        """Replace the small object ``key`` (``LATEST``) with ``data`` if ``check(what it holds now, or
        None)`` does not raise, and only if it did not change between that read and the write. This
        default, for backends with no compare-and-swap, reads then writes (not atomic against a racer)."""
        check(self._read_or_none(key, max_bytes))
        self.write(key, data)

    def _read_or_none(self, key: str, max_bytes: int) -> bytes | None:
        try:
            return self.read(key, max_bytes=max_bytes)
        except NotFoundError:
            return None

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def size(self, key: str) -> int:
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with ``prefix`` (a string prefix, as in S3, not a directory)."""
        raise NotImplementedError(f"{self.uri}: this store cannot list objects")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


# --------------------------------------------------------------------------- local


class LocalStore(Store):
    """A directory. Writes go to a temp file in the target's directory, are fsynced, then
    ``os.replace``d over the target (atomic on POSIX), and the directory is fsynced so the
    rename survives a crash. ``create`` hard-links the temp file to the target instead
    (``link`` fails if the target exists: exclusive and atomic, the ``O_EXCL`` of a complete
    file); ``write_if`` holds an ``flock`` on a lock file beside the target while it reads,
    checks and replaces (processes on one host, or a shared filesystem with working locks)."""

    def __init__(self, root: str, *, file_uri: bool = False, max_object_bytes: int | None = None):
        self.path = os.path.abspath(root)
        self.file_uri = file_uri
        self.uri = "file://" + urllib.parse.quote(self.path) if file_uri else self.path
        self.max_object_bytes = max_object_bytes

    def _p(self, key: str) -> str:
        return os.path.join(self.path, *_check_key(key, self.uri).split("/"))

    def key_uri(self, key: str) -> str:
        _check_key(key, self.uri)
        return f"{self.uri.removesuffix('/')}/{urllib.parse.quote(key)}" if self.file_uri else self._p(key)

    def _open(self, key: str):
        """Open a key for reading: a regular file below the root, reached without symlinks.

        ``O_NOFOLLOW`` refuses a link as the last component and the real path must stay
        below the root's (no linked directory on the way); ``O_NONBLOCK`` keeps a FIFO from
        hanging the open, and anything but a regular file is refused. Errors name the key,
        not the local path.
        """
        path = self._p(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFoundError(f"not found: {key}") from None
        except OSError as e:
            if e.errno == 40:  # ELOOP: the key is a symlink
                raise ForbiddenSourceError(f"refused {key}: a symbolic link") from None
            raise SourceError(f"cannot read {key}: {e.strerror}") from None
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise NotFoundError(f"not found: {key} (a directory)")
            if not stat.S_ISREG(mode):
                raise ForbiddenSourceError(f"refused {key}: not a regular file")
            root = os.path.realpath(self.path)
            if not os.path.realpath(path).startswith(root.rstrip(os.sep) + os.sep):
                raise ForbiddenSourceError(f"refused {key}: reached through a symbolic link out of the store")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        limit = max_bytes if max_bytes is not None else self.max_object_bytes
        with self._open(key) as f:
            if limit is None:
                return f.read()
            data = f.read(limit + 1)  # never more, whatever st_size says
            if len(data) > limit:
                raise _too_large(key, len(data), limit)
            return data

    def read_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        with self._open(key) as f:
            return self._pread(f, key, start, length)

    def _pread(self, f, key: str, start: int, length: int) -> bytes:
        self.remaining(f"reading {key}")
        data = os.pread(f.fileno(), length, start) if length else b""
        if len(data) != length:
            raise _short(key, start, length, os.fstat(f.fileno()).st_size)
        return data

    def read_ranges(self, key: str, ranges: list[tuple[int, int]], workers: int = 8) -> list[bytes]:
        # One open file, pread from threads (pread releases the GIL, needs no shared offset).
        ranges = list(ranges)
        for s, n in ranges:
            _check_range(s, n)
        with self._open(key) as f:
            if len(ranges) <= 1 or workers <= 1:
                return [self._pread(f, key, s, n) for s, n in ranges]
            with ThreadPoolExecutor(max_workers=min(workers, len(ranges))) as pool:
                return list(pool.map(lambda r: self._pread(f, key, r[0], r[1]), ranges))

    def _atomic(self, key: str, fill, exclusive: bool = False) -> None:
        dest = self._p(key)
        d = os.path.dirname(dest)
        try:
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=d)
        except OSError as e:
            raise SourceError(f"cannot write {self.key_uri(key)}: {e}") from e
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; published files are meant to be served
            if exclusive:
                try:
                    os.link(tmp, dest)  # fails if dest exists: never replaces a published object
                except FileExistsError:
                    raise ConflictError(f"{self.key_uri(key)} already exists") from None
                os.unlink(tmp)
            else:
                os.replace(tmp, dest)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise SourceError(f"cannot write {self.key_uri(key)}: {e}") from e
            raise
        try:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass  # some filesystems refuse fsync on directories; the data itself is synced

    def write(self, key: str, data: bytes) -> None:
        self._atomic(key, lambda f: f.write(data))

    def write_file(self, key: str, path: str | os.PathLike) -> None:
        with open(path, "rb") as src:
            self._atomic(key, lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def create(self, key: str, data: bytes) -> None:
        self._atomic(key, lambda f: f.write(data), exclusive=True)

    def create_file(self, key: str, path: str | os.PathLike) -> None:
        with open(path, "rb") as src:
            self._atomic(key, lambda f: shutil.copyfileobj(src, f, 1 << 20), exclusive=True)

    def write_if(self, key: str, data: bytes, check: Callable[[bytes | None], None],
                 max_bytes: int = MAX_LATEST_BYTES) -> None:
        import fcntl

        dest = self._p(key)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd = os.open(os.path.join(os.path.dirname(dest), f"{_TMP_PREFIX}{os.path.basename(dest)}.lock"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SourceError(f"cannot lock {self.key_uri(key)}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            super().write_if(key, data, check, max_bytes)
        finally:
            os.close(fd)  # releases the lock

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._p(key))

    def size(self, key: str) -> int:
        with self._open(key) as f:
            return os.fstat(f.fileno()).st_size

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix, self.uri)
        # Walk only below the deepest directory the prefix names.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.path, *base.split("/")) if base else self.path
        out = []
        for dirpath, _dirs, files in os.walk(top):
            rel = os.path.relpath(dirpath, self.path)
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


# --------------------------------------------------------------------------- HTTP

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HttpStore(Store):
    """Read-only store over plain HTTP(S) (any static file server, CDN, presigned base URL).

    ``requests.Session`` with connect/read timeouts and urllib3 ``Retry`` (exponential
    backoff on connection errors and 429/5xx, honouring Retry-After). Ranges use
    ``Range:`` and check the 206's ``Content-Range``; a server that ignores Range and
    answers 200 is read only up to the end of the wanted range, then the connection is
    dropped, so memory stays bounded by what was asked for. Bodies are read as they
    arrive (never decompressed), so the store's deadline holds against a trickling
    server. Redirects are followed only below the store's root (:meth:`_may_redirect`),
    and ``token`` (or ``ENGINE_EXT_HTTP_TOKEN``) is sent as ``Authorization: Bearer``
    only to URLs below the root. ``writable=True`` enables ``write`` by HTTP PUT;
    atomicity then is the server's to guarantee.
    """

    MAX_REDIRECTS = 5

    def __init__(self, root: str, *, token: str | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 60.0, retries: int = 5, backoff: float = 0.25,
                 max_object_bytes: int | None = None, writable: bool = False, pool_size: int = 32):
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        parts = urllib.parse.urlsplit(root)
        if parts.query or parts.fragment:
            raise SourceError(f"HTTP store root {root!r} must not carry a query or fragment")
        self.uri = root.rstrip("/")
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_object_bytes = max_object_bytes
        self.writable = writable
        self.retries, self.backoff = retries, backoff
        self.session = requests.Session()
        retry = Retry(total=retries, connect=retries, read=retries, status=retries, other=0, redirect=0,
                      backoff_factor=backoff, backoff_max=10.0,
                      status_forcelist=(429, 500, 502, 503, 504),
                      allowed_methods=frozenset({"GET", "HEAD", "PUT"}),
                      raise_on_status=False, respect_retry_after_header=True)
        adapter = HTTPAdapter(max_retries=retry, pool_connections=4, pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        # No transparent gzip: Content-Length and byte ranges must refer to the stored bytes.
        self.session.headers["Accept-Encoding"] = "identity"
        self.session.trust_env = False  # no proxies or .netrc credentials picked up from the environment
        token = token if token is not None else settings.current().http_token
        self._auth = f"Bearer {token}" if token else None

    def key_uri(self, key: str) -> str:
        return f"{self.uri}/{urllib.parse.quote(_check_key(key, self.uri))}"

    def _url(self, key: str) -> str:
        """The HTTP URL of a key (differs from ``key_uri`` for hf:// stores)."""
        return self.key_uri(key)

    def _base(self) -> str:
        """The HTTP URL every object of this store lies under."""
        return self.uri

    def _below_base(self, url: str) -> bool:
        u, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(self._base())
        return (u.scheme, u.netloc) == (b.scheme, b.netloc) and u.path.startswith(b.path.rstrip("/") + "/")

    def _may_redirect(self, url: str) -> bool:
        """Whether to follow a redirect to ``url``: only below the store's root."""
        return self._below_base(url)

    def _timeout(self, what: str) -> tuple[float, float]:
        left = self.remaining(what)
        return (self.connect_timeout, self.read_timeout if left is None else min(self.read_timeout, left))

    def _request(self, method: str, key: str, **kw):
        import requests

        url = self._url(key)
        headers = dict(kw.pop("headers", None) or {})
        for _ in range(self.MAX_REDIRECTS + 1):
            hdrs = dict(headers, Authorization=self._auth) if self._auth and self._below_base(url) else headers
            try:
                r = self.session.request(method, url, timeout=self._timeout(f"{method} {self.key_uri(key)}"),
                                         allow_redirects=False, headers=hdrs, **kw)
            except requests.RequestException as e:
                raise SourceError(f"{method} {self.key_uri(key)} failed after {self.retries} retries: "
                                  f"{type(e).__name__}: {str(e)[:300]}") from e
            if not r.is_redirect:
                return r
            target = urllib.parse.urljoin(url, r.headers.get("Location", ""))
            r.close()
            if not self._may_redirect(target):
                raise ForbiddenSourceError(f"{method} {self.key_uri(key)}: redirect out of the store refused")
            url = target
        raise SourceError(f"{method} {self.key_uri(key)}: more than {self.MAX_REDIRECTS} redirects")

    def _fail(self, r, what: str, key: str):
        url = self.key_uri(key)
        code = r.status_code
        r.close()
        if code == 404 or code == 410:
            return NotFoundError(f"not found: {url} (HTTP {code})")
        if code == 416:
            return IntegrityError(f"{what} {url}: range not satisfiable (HTTP 416), object is shorter than asked")
        if code in (401, 403):
            return SourceError(f"{what} {url}: access denied (HTTP {code}); check the token")
        return SourceError(f"{what} {url}: HTTP {code} {(r.reason or '')[:100]}".rstrip())

    def _stream(self, r, url: str, until: int | None):
        """Read the body as it arrives (raw bytes, never decompressed), checking the deadline
        between reads; stop once ``until`` bytes are in (None: the whole body)."""
        import requests
        from urllib3.exceptions import HTTPError

        buf = bytearray()
        try:
            while until is None or len(buf) < until:
                self.remaining(f"reading {url}")
                chunk = r.raw.read1(1 << 20, decode_content=False)
                if not chunk:
                    break
                buf += chunk
                yield buf
        except (requests.RequestException, HTTPError, OSError) as e:
            raise ReadCut(f"reading {url} failed mid-body: {type(e).__name__}: {str(e)[:300]}") from e
        finally:
            r.close()

    def _body(self, r, limit: int | None, url: str) -> bytes:
        n = r.headers.get("Content-Length")
        if n is not None and not n.isdigit():
            r.close()
            raise SourceError(f"reading {url}: bad Content-Length")
        if limit is not None and n is not None and int(n) > limit:
            r.close()
            raise _too_large(url, int(n), limit)
        buf = bytearray()
        for buf in self._stream(r, url, None):
            if limit is not None and len(buf) > limit:
                r.close()
                raise _too_large(url, len(buf), limit)
        if n is not None and len(buf) != int(n):
            raise ReadCut(f"reading {url}: got {len(buf)} bytes, Content-Length said {n}")
        return bytes(buf)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        return self._retry_cuts(f"GET {self.key_uri(key)}", lambda: self._read(key, max_bytes))

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        r = self._request("GET", key, stream=True)
        if r.status_code != 200:
            raise self._fail(r, "GET", key)
        limit = max_bytes if max_bytes is not None else self.max_object_bytes
        return self._body(r, limit, self.key_uri(key))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        if length == 0:
            return b""
        return self._retry_cuts(f"GET {self.key_uri(key)}", lambda: self._read_range(key, start, length))

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        url = self.key_uri(key)
        end = start + length - 1
        r = self._request("GET", key, stream=True, headers={"Range": f"bytes={start}-{end}"})
        if r.status_code == 206:
            m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
            if not m or int(m.group(1)) != start:
                r.close()
                raise SourceError(f"GET {url}: bad Content-Range for bytes={start}-{end}")
            got_end = int(m.group(2))
            if got_end < end:
                r.close()
                raise _short(url, start, length, got_end + 1)
            data = self._body(r, length, url)
            if len(data) != length:
                raise _short(url, start, length, start + len(data))
            return data
        if r.status_code == 200:  # Range ignored: skip to start, keep length bytes, hang up
            buf = bytearray()
            for buf in self._stream(r, url, start + length):
                pass
            if len(buf) < start + length:
                raise _short(url, start, length, len(buf))
            return bytes(buf[start:start + length])
        raise self._fail(r, "GET", key)

    def exists(self, key: str) -> bool:
        r = self._request("HEAD", key)
        if r.status_code == 200:
            return True
        err = self._fail(r, "HEAD", key)
        if isinstance(err, NotFoundError):
            return False
        raise err

    def size(self, key: str) -> int:
        r = self._request("HEAD", key)
        if r.status_code != 200:
            raise self._fail(r, "HEAD", key)
        if "Content-Length" in r.headers:
            return int(r.headers["Content-Length"])
        # No length on HEAD (some CDNs): ask for one byte and read the total from Content-Range.
        r = self._request("GET", key, stream=True, headers={"Range": "bytes=0-0"})
        m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
        r.close()
        if r.status_code == 206 and m and m.group(3) != "*":
            return int(m.group(3))
        raise SourceError(f"{self.key_uri(key)}: server reports no object size")

    def write(self, key: str, data: bytes, headers: dict | None = None) -> None:
        """HTTP PUT; ``headers`` carry the conditions of :meth:`create` and :meth:`write_if`
        (412 Precondition Failed: :class:`ConflictError`)."""
        if not self.writable:
            raise SourceError(f"{self.uri} is a read-only HTTP store; publish to a local dir or s3:// "
                              "and serve that (or open it with writable=True for an HTTP PUT server)")
        r = self._request("PUT", key, data=data, headers=headers)
        if r.status_code == 412:
            r.close()
            raise ConflictError(f"PUT {self.key_uri(key)}: precondition failed ({(headers or {})}): it changed or exists")
        if r.status_code not in (200, 201, 204):
            raise self._fail(r, "PUT", key)
        r.close()

    def create(self, key: str, data: bytes) -> None:
        self.write(key, data, headers={"If-None-Match": "*"})

    def write_if(self, key: str, data: bytes, check: Callable[[bytes | None], None],
                 max_bytes: int = MAX_LATEST_BYTES) -> None:
        """GET (with its ETag), check, then PUT with ``If-Match`` (or ``If-None-Match: *`` where there
        was nothing); a server that sends no ETag gets a plain PUT (not atomic against a racer)."""
        r = self._request("GET", key, stream=True)
        if r.status_code == 200:
            etag = r.headers.get("ETag")
            current = self._body(r, max_bytes, self.key_uri(key))
        elif r.status_code in (404, 410):
            r.close()
            etag, current = None, None
        else:
            raise self._fail(r, "GET", key)
        check(current)
        self.write(key, data, headers={"If-Match": etag} if etag else ({"If-None-Match": "*"} if current is None else None))


# --------------------------------------------------------------------------- S3

_S3_CLIENTS: dict[tuple, object] = {}
_S3_LOCK = threading.Lock()


def _s3_client(endpoint_url, region, addressing_style, connect_timeout, read_timeout, retries, pool_size):
    """boto3 clients are thread-safe and slow to build: share one per configuration."""
    # Credentials are resolved when a client is built: key on the env that feeds them too.
    creds = tuple(os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"))
    key = (endpoint_url, region, addressing_style, connect_timeout, read_timeout, retries, pool_size, os.getpid(), creds)
    with _S3_LOCK:
        if key not in _S3_CLIENTS:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise SourceError("s3:// stores need boto3: pip install 'engine-ext[s3]'") from None
            cfg = Config(region_name=region, connect_timeout=connect_timeout, read_timeout=read_timeout,
                         retries={"max_attempts": retries + 1, "mode": "standard"},
                         max_pool_connections=pool_size, s3={"addressing_style": addressing_style})
            _S3_CLIENTS[key] = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)
        return _S3_CLIENTS[key]


class S3Store(Store):
    """``s3://bucket/prefix`` through boto3 (AWS, R2, MinIO, GCS interop, moto).

    Endpoint: option ``endpoint_url``, else env ``ENGINE_EXT_S3_ENDPOINT``, else
    ``AWS_ENDPOINT_URL``; custom endpoints default to path-style addressing. PutObject is
    atomic per object, which is all ``publish_version`` needs. Credentials come from the
    usual boto3 chain (env, profile, instance role).
    """

    def __init__(self, root: str, *, endpoint_url: str | None = None, region: str | None = None,
                 addressing_style: str | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 60.0, retries: int = 5, pool_size: int = 32,
                 max_object_bytes: int | None = None, multipart_threshold: int = 64 << 20,
                 multipart_chunksize: int = 64 << 20):
        parts = urllib.parse.urlsplit(root)
        if parts.scheme != "s3" or not parts.netloc:
            raise SourceError(f"not an s3://bucket[/prefix] URI: {root!r}")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.uri = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint_url = (endpoint_url or settings.current().s3_endpoint
                             or os.environ.get("AWS_ENDPOINT_URL") or None)
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        style = addressing_style or ("path" if self.endpoint_url else "auto")
        self.client = _s3_client(self.endpoint_url, region, style, connect_timeout, read_timeout, retries, pool_size)
        self.retries = retries
        self.max_object_bytes = max_object_bytes
        self.multipart = (multipart_threshold, multipart_chunksize)
        self.list_page_size = 1000

    def _k(self, key: str) -> str:
        _check_key(key, self.uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str | None, fn, **kw):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        where = self.key_uri(key) if key is not None else self.uri
        self.remaining(f"{what} {where}")
        try:
            return fn(**kw)
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            msg = f"{what} {where}: {code or status} {err.get('Message', '')}".rstrip()
            if code == "NoSuchBucket":
                raise SourceError(f"{msg} (bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'})") from e
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                raise NotFoundError(f"not found: {where}") from e
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                raise ConflictError(f"{what} {where}: it exists or changed meanwhile ({code or status})") from e
            if code == "InvalidRange" or status == 416:
                raise IntegrityError(f"{what} {where}: range not satisfiable, object is shorter than asked") from e
            raise SourceError(msg) from e
        except (BotoCoreError, Boto3Error) as e:  # no connection, no credentials, failed upload
            raise SourceError(f"{what} {where} failed (endpoint {self.endpoint_url or 'AWS'}): {e}") from e

    def _read_body(self, resp, where: str, limit: int | None = None) -> bytes:
        """The body in chunks, checking the deadline between them; never more than ``limit`` + 1 bytes."""
        from botocore.exceptions import BotoCoreError

        buf = bytearray()
        try:
            with resp["Body"] as body:
                while True:
                    self.remaining(f"reading {where}")
                    chunk = body.read(1 << 20)
                    if not chunk:
                        return bytes(buf)
                    buf += chunk
                    if limit is not None and len(buf) > limit:
                        raise _too_large(where, len(buf), limit)
        except (BotoCoreError, OSError) as e:
            raise ReadCut(f"reading {where} failed mid-body: {e}") from e

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        return self._retry_cuts(f"GetObject {self.key_uri(key)}", lambda: self._read(key, max_bytes))

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        resp = self._call("GetObject", key, self.client.get_object, Bucket=self.bucket, Key=self._k(key))
        limit = max_bytes if max_bytes is not None else self.max_object_bytes
        if limit is not None and resp["ContentLength"] > limit:
            resp["Body"].close()
            raise _too_large(self.key_uri(key), resp["ContentLength"], limit)
        return self._read_body(resp, self.key_uri(key), limit)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        if length == 0:
            return b""
        return self._retry_cuts(f"GetObject {self.key_uri(key)}", lambda: self._read_range(key, start, length))

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        end = start + length - 1
        resp = self._call("GetObject", key, self.client.get_object, Bucket=self.bucket,
                          Key=self._k(key), Range=f"bytes={start}-{end}")
        m = _CONTENT_RANGE.fullmatch(resp.get("ContentRange", "") or "")
        if m and int(m.group(2)) < end:
            resp["Body"].close()
            raise _short(self.key_uri(key), start, length, int(m.group(2)) + 1)
        data = self._read_body(resp, self.key_uri(key), length)
        if len(data) != length:
            raise _short(self.key_uri(key), start, length, start + len(data))
        return data

    def write(self, key: str, data: bytes) -> None:
        self._call("PutObject", key, self.client.put_object, Bucket=self.bucket, Key=self._k(key), Body=data)

    def create(self, key: str, data: bytes) -> None:
        """PutObject with ``If-None-Match: *`` (S3's conditional write: 412 if the key exists)."""
        self._call("PutObject", key, self.client.put_object, Bucket=self.bucket, Key=self._k(key), Body=data,
                   IfNoneMatch="*")

    def create_file(self, key: str, path: str | os.PathLike) -> None:
        """Conditional PutObject up to ``multipart_threshold``; above it a check before the multipart
        upload (boto3's transfer manager sends no ``If-None-Match``). Publishers write blobs under
        content-addressed keys, so even a racer that slips in writes the same bytes."""
        if os.path.getsize(path) <= self.multipart[0]:
            with open(path, "rb") as f:
                return self.create(key, f.read())
        if self.exists(key):
            raise ConflictError(f"{self.key_uri(key)} already exists")
        self.write_file(key, path)

    def write_if(self, key: str, data: bytes, check: Callable[[bytes | None], None],
                 max_bytes: int = MAX_LATEST_BYTES) -> None:
        """GetObject (bytes and ETag), check, then PutObject with ``If-Match`` (``If-None-Match: *``
        where there was nothing); when another writer got in between, read and check again."""
        for _ in range(8):
            try:
                resp = self._call("GetObject", key, self.client.get_object, Bucket=self.bucket, Key=self._k(key))
                current, cond = self._read_body(resp, self.key_uri(key), max_bytes), {"IfMatch": resp["ETag"]}
            except NotFoundError:
                current, cond = None, {"IfNoneMatch": "*"}
            check(current)
            try:
                self._call("PutObject", key, self.client.put_object, Bucket=self.bucket, Key=self._k(key), Body=data, **cond)
                return
            except ConflictError:
                continue  # it moved between our read and our write: look again
        raise ConflictError(f"{self.key_uri(key)} kept changing while it was being replaced")

    def write_file(self, key: str, path: str | os.PathLike) -> None:
        """Streams from disk; multipart above ``multipart_threshold`` (S3 completes a
        multipart upload atomically, so readers still never see a partial object)."""
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=self.multipart[0], multipart_chunksize=self.multipart[1])
        self._call("Upload", key, self.client.upload_file, Filename=os.fspath(path), Bucket=self.bucket,
                   Key=self._k(key), Config=cfg)

    def _head(self, key: str) -> dict:
        return self._call("HeadObject", key, self.client.head_object, Bucket=self.bucket, Key=self._k(key))

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
            return True
        except NotFoundError:
            return False

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix, self.uri)
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base + prefix, PaginationConfig={"PageSize": self.list_page_size})
        keys = self._call("ListObjectsV2", None, lambda: [o["Key"] for p in pages for o in p.get("Contents", [])])
        return sorted(k[len(base):] for k in keys)


# --------------------------------------------------------------------------- Hugging Face buckets


class HfBucketStore(HttpStore):
    """``hf://buckets/<namespace>/<name>[/prefix]``: Hugging Face Storage Buckets.

    UNTESTED against the real Hub (no network here). Reads are plain HTTP GET/Range on
    ``{endpoint}/buckets/<id>/resolve/<path>`` with the HF token, the URL that
    ``huggingface_hub.HfFileSystem`` (2.4) uses for bucket files; they go through the
    tested ``HttpStore`` code. Writes and listings call ``huggingface_hub``
    (``HfApi.batch_bucket_files``, ``HfApi.list_bucket_tree``), imported lazily; a
    version without the bucket API gets a clear error. Per-object write atomicity is
    the Hub's (not verified here).
    """

    def __init__(self, root: str, *, token: str | None = None, endpoint: str | None = None, **http_options):
        m = re.fullmatch(r"hf://buckets/([^/]+)/([^/]+)(?:/(.*))?", root.rstrip("/"))
        if not m:
            raise SourceError(f"not an hf://buckets/<namespace>/<name>[/prefix] URI: {root!r}")
        self.bucket_id = f"{m.group(1)}/{m.group(2)}"
        self.prefix = (m.group(3) or "").strip("/")
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        if token is None:
            token = os.environ.get("HF_TOKEN")
            if token is None:
                try:
                    from huggingface_hub import get_token
                    token = get_token()
                except ImportError:
                    pass
        self.hf_token = token
        base = f"{self.endpoint}/buckets/{self.bucket_id}/resolve" + (f"/{urllib.parse.quote(self.prefix)}" if self.prefix else "")
        super().__init__(base, token=token or "", **http_options)
        self.http_uri = self.uri
        self.uri = f"hf://buckets/{self.bucket_id}" + (f"/{self.prefix}" if self.prefix else "")

    def key_uri(self, key: str) -> str:
        return f"{self.uri}/{_check_key(key, self.uri)}"

    def _url(self, key: str) -> str:
        return f"{self.http_uri}/{urllib.parse.quote(_check_key(key, self.uri))}"

    def _base(self) -> str:
        return self.http_uri

    def _may_redirect(self, url: str) -> bool:
        """The Hub answers ``resolve`` with a redirect to its CDN: follow HTTPS redirects
        anywhere (the token goes only below this bucket's URL; contents are verified by
        SHA-256 from the signed manifest anyway)."""
        return urllib.parse.urlsplit(url).scheme == "https" or self._below_base(url)

    def _api(self, needs: str):
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise SourceError(f"{self.uri}: writing/listing HF buckets needs huggingface_hub: pip install 'engine-ext[hf]'") from None
        api = HfApi(endpoint=self.endpoint, token=self.hf_token)
        if not hasattr(api, needs):
            import huggingface_hub
            raise SourceError(f"{self.uri}: huggingface_hub {huggingface_hub.__version__} has no bucket API ({needs}); upgrade it")
        return api

    def _path(self, key: str) -> str:
        _check_key(key, self.uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _hub(self, what: str, key: str | None, fn):
        try:
            return fn()
        except Exception as e:  # huggingface_hub raises HfHubHTTPError subclasses, OSError, ValueError
            where = self.key_uri(key) if key else self.uri
            if type(e).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                raise NotFoundError(f"not found: {where}") from e
            raise SourceError(f"{what} {where} failed: {type(e).__name__}: {e}") from e

    # No conditional writes in the bucket API: check, then write (the Store defaults; not atomic).
    create, create_file, write_if = Store.create, Store.create_file, Store.write_if

    def write(self, key: str, data: bytes) -> None:
        api = self._api("batch_bucket_files")
        self._hub("upload", key, lambda: api.batch_bucket_files(self.bucket_id, add=[(data, self._path(key))]))

    def write_file(self, key: str, path: str | os.PathLike) -> None:
        api = self._api("batch_bucket_files")
        self._hub("upload", key, lambda: api.batch_bucket_files(self.bucket_id, add=[(os.fspath(path), self._path(key))]))

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix, self.uri)
        api = self._api("list_bucket_tree")
        base = f"{self.prefix}/" if self.prefix else ""
        entries = self._hub("list", None, lambda: list(api.list_bucket_tree(self.bucket_id, base or None, recursive=True)))
        return sorted(e.path[len(base):] for e in entries
                      if getattr(e, "type", "file") == "file" and e.path.startswith(base + prefix))


# --------------------------------------------------------------------------- entry points


def open_store(root: str | os.PathLike, **options) -> Store:
    """Store for a root URI: local path, ``file://``, ``http(s)://``, ``s3://``, ``hf://buckets/``.

    ``options`` go to the backend's constructor (e.g. ``endpoint_url=`` for S3,
    ``token=`` for HTTP); an option a backend does not know is a TypeError.
    """
    root = os.fspath(root)
    scheme = urllib.parse.urlsplit(root).scheme.lower() if "://" in root else ""
    if scheme == "":
        return LocalStore(root, **options)
    if scheme == "file":
        p = urllib.parse.urlsplit(root)
        if p.netloc not in ("", "localhost"):
            raise SourceError(f"file:// URI with a remote host is not supported: {root!r}")
        return LocalStore(urllib.parse.unquote(p.path) or "/", file_uri=True, **options)
    if scheme in ("http", "https"):
        return HttpStore(root, **options)
    if scheme == "s3":
        return S3Store(root, **options)
    if scheme == "hf":
        return HfBucketStore(root, **options)
    raise SourceError(f"unsupported store URI {root!r}: use a local path, file://, http(s)://, s3:// or hf://buckets/")


def split_uri(object_uri: str | os.PathLike, **options) -> tuple[Store, str]:
    """``"s3://b/run1/v00000003.json"`` -> (store at ``s3://b/run1``, ``"v00000003.json"``).

    The key is the last path component; this inverts ``Store.key_uri`` for every scheme.
    """
    uri = os.fspath(object_uri)
    if "://" not in uri:
        head, _, key = uri.rpartition("/")
        return open_store(head or ("/" if uri.startswith("/") else "."), **options), _check_key(key, uri)
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    head, _, key = rest.rpartition("/")
    root_parts = {"s3": 1, "http": 1, "https": 1, "hf": 3, "file": 0}.get(scheme, 1)
    if not key or len([p for p in head.split("/") if p]) < root_parts:
        raise SourceError(f"cannot split {uri!r} into a store root and an object key")
    if scheme in ("http", "https", "file"):
        if "?" in key or "#" in key:
            raise SourceError(f"cannot split {uri!r}: object URIs with a query or fragment are not supported")
        key = urllib.parse.unquote(key)
    return open_store(f"{scheme}://{head or '/'}", **options), _check_key(key, uri)


def publish_version(store: Store, blobs: Mapping[str, bytes | os.PathLike] | Iterable[tuple[str, bytes | os.PathLike]],
                    manifest_key: str, manifest_bytes: bytes, latest_bytes: bytes, version: int,
                    latest_key: str = LATEST_KEY, workers: int = 4, signature: bytes | None = None) -> str:
    """Publish one version all-or-nothing and write-once: every blob, the manifest's signature, the
    manifest, then LATEST.

    Blobs, signature and manifest are *created* (:meth:`Store.create`: never over an existing
    object), so a version is written once: a second publisher of the same version (a restarted
    trainer that did not resume, two trainers on one store) gets :class:`ConflictError` naming
    the version and the store, and its half-written objects stay invisible (no manifest names
    them, or no LATEST names the manifest). LATEST moves only forward (:meth:`Store.write_if`):
    it is left alone, with ConflictError, when it already names a newer version, or ``version``
    with other weights. Each
    step starts only after the previous one succeeded, so a publisher killed at any point
    leaves LATEST on the old version. Blob values are bytes or a local file path (streamed).
    Returns the manifest URI.
    """
    items = list(blobs.items() if isinstance(blobs, Mapping) else blobs)
    keys = [k for k, _ in items]
    if len(set(keys)) != len(keys) or manifest_key in keys or latest_key in keys or manifest_key == latest_key:
        raise ValueError(f"publish_version: blob keys must be unique and differ from {manifest_key!r} and {latest_key!r}")

    def put(item):
        key, value = item
        if isinstance(value, (bytes, bytearray, memoryview)):
            store.create(key, bytes(value))
        else:
            store.create_file(key, value)

    def forward_only(current: bytes | None) -> None:
        """LATEST moves to a newer version, or to a second manifest of its own version with the
        same weights (the delta published beside an anchor)."""
        if current is None:
            return
        from ..format.manifest import Latest

        held, new = Latest.from_json(current)[0], Latest.from_json(latest_bytes)[0]
        if held.version > version or (held.version == version and held.fingerprint != new.fingerprint):
            raise ConflictError(f"LATEST names v{held.version}, not older than v{version}")

    try:
        if items:
            with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
                list(pool.map(put, items))  # re-raises the first failure after all finish
        if signature is not None:
            store.create(manifest_key + ".sig", signature)
        store.create(manifest_key, manifest_bytes)
        store.write_if(latest_key, latest_bytes, forward_only)
    except ConflictError as e:
        raise ConflictError(f"version {version} cannot be published to {store.uri}: {e}; another publisher wrote "
                            "this version or a newer one (resume after the store's LATEST: DeltaPublisher(resume=...))") from e
    return store.key_uri(manifest_key)
