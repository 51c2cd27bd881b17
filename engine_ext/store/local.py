"""A local directory (or ``file://``) as a store: atomic, fsynced writes; exclusive creates."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import ConflictError, ForbiddenSourceError, NotFoundError, SourceError
from ..format.latest import MAX_LATEST_BYTES
from .base import _TMP_PREFIX, Store, _check_key, _check_prefix, _check_range, _short, _too_large


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
            # never more than the limit, whatever st_size says; no buffer of the limit's size for a small file
            size = os.fstat(f.fileno()).st_size
            data = f.read(min(limit, size) + 1)
            if len(data) > size:  # it grew meanwhile: the rest, still bounded
                data += f.read(limit + 1 - len(data))
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
        self._sync_dir(d)

    @staticmethod
    def _fsync(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @classmethod
    def _sync_dir(cls, d: str) -> None:
        """fsync a directory, so that a new name in it survives a crash."""
        try:
            cls._fsync(d)
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
        """A file on this store's filesystem (spooled in :meth:`spool_dir`) is synced and hard-linked
        under its key: published without copying a byte; any other file is copied."""
        dest = self._p(key)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            same_fs = os.stat(path).st_dev == os.stat(os.path.dirname(dest)).st_dev
        except OSError as e:
            raise SourceError(f"cannot write {self.key_uri(key)}: {e}") from e
        if not same_fs:
            with open(path, "rb") as src:
                return self._atomic(key, lambda f: shutil.copyfileobj(src, f, 1 << 20), exclusive=True)
        try:
            self._fsync(path)
            os.chmod(path, 0o644)
            os.link(path, dest)  # fails if dest exists: never replaces a published object
        except FileExistsError:
            raise ConflictError(f"{self.key_uri(key)} already exists") from None
        except OSError as e:
            raise SourceError(f"cannot write {self.key_uri(key)}: {e}") from e
        self._sync_dir(os.path.dirname(dest))

    def spool_dir(self) -> str:
        os.makedirs(self.path, exist_ok=True)
        return self.path

    def write_if(
        self, key: str, data: bytes, check: Callable[[bytes | None], None], max_bytes: int = MAX_LATEST_BYTES
    ) -> None:
        import fcntl

        dest = self._p(key)
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd = os.open(
                os.path.join(os.path.dirname(dest), f"{_TMP_PREFIX}{os.path.basename(dest)}.lock"),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                0o644,
            )
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
        for dirpath, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith(_TMP_PREFIX)]  # a publisher's spool
            rel = os.path.relpath(dirpath, self.path)
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)
