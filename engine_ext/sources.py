"""The allow-list of stores a server may read updates from (``ENGINE_EXT_SOURCES``).

Checked before anything is fetched: a request's URL must lie under one of the
configured prefixes after normalisation (local paths through ``realpath``; remote
URIs must not contain ``.``/``..`` segments in any encoding, nor credentials).
"""
from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import unquote, urlsplit

from . import settings
from .errors import ForbiddenSourceError

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def _normalise(uri: str) -> tuple[str, str, str]:
    """(scheme, authority, path) with the path made canonical.

    Local paths go through ``realpath`` (symlinks and ``..`` resolved); remote URIs
    must not contain ``..`` or ``.`` segments at all (raw or percent-encoded), since
    servers resolve them differently.
    """
    if not isinstance(uri, str) or not uri or "\x00" in uri:
        raise ForbiddenSourceError("empty or invalid source")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if not _SCHEME_RE.match(uri):
        return "file", "", os.path.realpath(os.path.expanduser(uri))
    parts = urlsplit(uri)
    path = parts.path or "/"
    segs = unquote(path).split("/")
    if any(s in ("..", ".") for s in segs) or "\\" in unquote(path):
        raise ForbiddenSourceError(f"source {uri!r} contains '.' or '..' path segments")
    authority = (parts.hostname or "").lower() + (f":{parts.port}" if parts.port else "")
    if parts.username or parts.password:
        raise ForbiddenSourceError(f"source {uri!r} carries credentials in the URI")
    return parts.scheme.lower(), authority, posixpath.normpath(unquote(path))


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix if prefix == "/" else prefix + "/")


class Sources:
    """The allow-list of manifest sources (``ENGINE_EXT_SOURCES``, comma-separated)."""

    def __init__(self, prefixes: list[str]):
        self.raw = [p.strip() for p in prefixes if p.strip()]
        self.prefixes = [_normalise(p) for p in self.raw]

    @classmethod
    def from_settings(cls, s: "settings.Settings | None" = None) -> "Sources":
        return cls(list((s or settings.current()).sources))

    def check(self, uri: str) -> str:
        """Return ``uri`` if it lies under an allowed prefix, else raise (HTTP 403)."""
        if not self.prefixes:
            raise ForbiddenSourceError("no sources allowed: set ENGINE_EXT_SOURCES to the store prefixes this server may read")
        scheme, auth, path = _normalise(uri)
        for s, a, p in self.prefixes:
            if s == scheme and a == auth and _under(path, p):
                return path if scheme == "file" else uri
        raise ForbiddenSourceError(f"source {uri!r} is not under an allowed prefix (ENGINE_EXT_SOURCES={','.join(self.raw)})")
