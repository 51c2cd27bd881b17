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

One file per backend behind the interface of :mod:`.base` (``local``, ``http``, ``s3``, ``hf``),
found by URI scheme in :data:`BACKENDS` and imported only when a store of that kind is
opened (boto3 and huggingface_hub are extras); :mod:`.versions` publishes a version on top.
"""

from __future__ import annotations

import importlib
import os
import urllib.parse

from ..errors import SourceError
from ..format.latest import LATEST_KEY
from .base import Connection, Store, _check_key
from .versions import publish_catch_up, publish_version

__all__ = [
    "BACKENDS",
    "LATEST_KEY",
    "HfBucketStore",
    "HttpStore",
    "LocalStore",
    "S3Store",
    "Store",
    "open_store",
    "publish_catch_up",
    "publish_version",
    "split_uri",
]

#: URI scheme ("" for a plain path) -> (module of this package, class): one file per backend.
BACKENDS = {
    "": ("local", "LocalStore"),
    "file": ("local", "LocalStore"),
    "http": ("http", "HttpStore"),
    "https": ("http", "HttpStore"),
    "s3": ("s3", "S3Store"),
    "hf": ("hf", "HfBucketStore"),
}


def _backend(scheme: str):
    module, cls = BACKENDS[scheme]
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def __getattr__(name: str):
    """``engine_ext.store.S3Store`` and the like, imported when first asked for."""
    for module, cls in BACKENDS.values():
        if cls == name:
            return getattr(importlib.import_module(f".{module}", __name__), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(root: str | os.PathLike, **options) -> Store:
    """Store for a root URI: local path, ``file://``, ``http(s)://``, ``s3://``, ``hf://buckets/``.

    ``options`` go to the backend's constructor (e.g. ``endpoint_url=`` for S3,
    ``token=`` for HTTP); an option a backend does not know is a TypeError.
    """
    root = os.fspath(root)
    scheme = urllib.parse.urlsplit(root).scheme.lower() if "://" in root else ""
    if scheme == "":
        return _backend("")(root, **options)
    if scheme == "file":
        p = urllib.parse.urlsplit(root)
        if p.netloc not in ("", "localhost"):
            raise SourceError(f"file:// URI with a remote host is not supported: {root!r}")
        return _backend("file")(urllib.parse.unquote(p.path) or "/", file_uri=True, **options)
    if scheme in ("http", "https", "s3", "hf"):  # network stores: connect_timeout=, retries= ... make their Connection
        return _backend(scheme)(root, **Connection.take(options))
    if scheme in BACKENDS:
        return _backend(scheme)(root, **options)
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
