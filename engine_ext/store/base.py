"""The store interface every backend implements, and the checks they share.

A store is rooted at the "directory" of a run (``s3://bucket/run1``, ``/data/run1``,
``https://host/run1``, ``hf://buckets/ns/name/run1``); keys are relative ``/``-separated
names under that root (``v00000003.json``, ``LATEST``). Every failure surfaces as an
``engine_ext.errors`` exception whose message names the URI, so callers need to know only
``NotFoundError`` (object absent), ``IntegrityError`` (object shorter than the bytes asked
for), ``ConflictError`` (a write-once object exists, or LATEST moved) and ``SourceError``
(everything else: network, auth, misconfiguration).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConflictError, FetchTimeoutError, ForbiddenSourceError, IntegrityError, NotFoundError, SourceError
from ..format.latest import MAX_LATEST_BYTES

_TMP_PREFIX = ".engine-ext-tmp-"  # temp files of in-progress local writes; never listed


def _check_key(key: str, root: str) -> str:
    """Refuse keys that could escape the root (a hostile manifest may name ``../x``)."""
    if not isinstance(key, str) or not key:
        raise ForbiddenSourceError(f"empty or non-string key {key!r} under {root}")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise ForbiddenSourceError(
            f"refused key {key!r} under {root}: keys are relative names without '..', '.', '//' or '\\'"
        )
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
                pause = min(self.backoff * 2**attempt, 10.0)
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

    def spool_dir(self) -> str | None:
        """Where a publisher spools a version's blobs before :meth:`create_file`: a directory on
        the store's own filesystem where that lets it take a file without copying it (a local
        store links it), else None (the system's temp directory)."""
        return None

    def write_if(
        self, key: str, data: bytes, check: Callable[[bytes | None], None], max_bytes: int = MAX_LATEST_BYTES
    ) -> None:
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


@dataclass(frozen=True)
class Connection:
    """How a network store (HTTP, S3) reaches its server: timeouts in seconds, how many times a failed request is
    sent again, and how many connections it keeps open (each concurrent range read takes one). ``open_store``
    takes each field by name (``open_store(uri, retries=1)``): :meth:`take`."""

    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    retries: int = 5
    pool_size: int = 32

    @classmethod
    def take(cls, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with the fields of a connection named in them folded into ``connection``."""
        names = {f.name for f in fields(cls)}
        rest = {k: v for k, v in options.items() if k not in names}
        given = {k: v for k, v in options.items() if k in names}
        if given:
            rest["connection"] = cls(**given)
        return rest


class NetworkStore(Store):
    """A store whose reads are requests over the network (HTTP, S3): a read cut mid-body is sent
    again (:meth:`Store._retry_cuts`). Subclasses implement one request each: :meth:`_read` and
    :meth:`_read_range`, and name it in ``read_request`` (what errors call the read)."""

    read_request = "GET"

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        return self._retry_cuts(f"{self.read_request} {self.key_uri(key)}", lambda: self._read(key, max_bytes))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        if length == 0:
            return b""
        return self._retry_cuts(
            f"{self.read_request} {self.key_uri(key)}", lambda: self._read_range(key, start, length)
        )

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        """One request for the whole object (``max_bytes``: as in :meth:`Store.read`); ReadCut where the body is cut."""
        raise NotImplementedError

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        """One request for ``length`` > 0 bytes at ``start``; ReadCut where the body is cut."""
        raise NotImplementedError


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
