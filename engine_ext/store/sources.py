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

from .. import settings
from ..errors import ForbiddenSourceError

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def _show(uri) -> str:
    """A URI for an error message: quoted, and cut short (a hostile request may send megabytes)."""
    text = repr(uri)
    return text if len(text) <= 200 else text[:200] + "...'"


def _normalise(uri: str) -> tuple[str, str, str]:
    """(scheme, authority, path) with the path made canonical; ForbiddenSourceError otherwise.

    Local paths go through ``realpath`` (symlinks and ``..`` resolved). Remote URIs must
    not contain ``.``/``..`` segments (raw or percent-encoded), an encoded slash or a
    backslash (``%2F``/``%5C``: the store would split root and key elsewhere than this check did),
    credentials, a query or a fragment, and must parse (a malformed port or IPv6 host is
    refused, not a server error). Host names compare case-insensitively, S3 bucket names
    exactly (buckets are case-sensitive on some S3-compatible servers).
    """
    if not isinstance(uri, str) or not uri or "\x00" in uri or len(uri) > 4096:
        raise ForbiddenSourceError("empty, overlong or invalid source")
    uri = uri.removeprefix("file://")
    if not _SCHEME_RE.match(uri):
        return "file", "", os.path.realpath(os.path.expanduser(uri))
    if "%2f" in uri.lower() or "%5c" in uri.lower() or "\\" in uri:
        raise ForbiddenSourceError(f"source {_show(uri)} contains an encoded '/' or a '\\'")
    try:
        parts = urlsplit(uri)
        port, host = parts.port, parts.hostname
    except ValueError:
        raise ForbiddenSourceError(f"source {_show(uri)} is not a well-formed URI") from None
    if parts.username or parts.password:
        raise ForbiddenSourceError(f"source {_show(uri)} carries credentials in the URI")
    if parts.query or parts.fragment:
        raise ForbiddenSourceError(f"source {_show(uri)} carries a query or fragment")
    path = parts.path or "/"
    if any(seg in ("..", ".") for seg in unquote(path).split("/")):
        raise ForbiddenSourceError(f"source {_show(uri)} contains '.' or '..' path segments")
    scheme = parts.scheme.lower()
    if scheme == "s3":
        authority = parts.netloc  # the bucket, exactly as the store will use it
    else:
        authority = (host or "") + (f":{port}" if port else "")
    return scheme, authority, posixpath.normpath(unquote(path))


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix if prefix == "/" else prefix + "/")


class Sources:
    """The allow-list of manifest sources (``ENGINE_EXT_SOURCES``, comma-separated). ``origin``
    names where the list came from in refusals (a narrowed list is not the setting)."""

    def __init__(self, prefixes: list[str], origin: str = "ENGINE_EXT_SOURCES"):
        self.raw = [p.strip() for p in prefixes if p.strip()]
        self.prefixes = [_normalise(p) for p in self.raw]
        self.origin = origin

    @classmethod
    def from_settings(cls, s: settings.Settings | None = None) -> Sources:
        s = s or settings.current()
        return cls(list(s.sources) + ([s.follow] if s.follow else []))  # the store pull mode follows is allowed

    def check(self, uri: str) -> str:
        """Return ``uri`` if it lies under an allowed prefix, else raise (HTTP 403)."""
        if not self.prefixes:
            raise ForbiddenSourceError(
                "no sources allowed: set ENGINE_EXT_SOURCES to the store prefixes this server may read"
            )
        scheme, auth, path = _normalise(uri)
        for s, a, p in self.prefixes:
            if s == scheme and a == auth and _under(path, p):
                return path if scheme == "file" else uri
        raise ForbiddenSourceError(f"source {_show(uri)} is not under an allowed prefix ({self.origin})")
