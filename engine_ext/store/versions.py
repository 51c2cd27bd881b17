"""Publishing one version to a store: all or nothing, write-once, one set of weights per version
number, LATEST last and forward only."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from ..errors import ConflictError
from ..format.latest import LATEST_KEY, Latest
from .base import Store

MAX_CLAIM_BYTES = 256


def claim_key(version: int) -> str:
    """The object that binds a version number to one set of weights (:func:`claim_version`)."""
    return f"v{version:08d}.claim"


def claim_body(fingerprint: str) -> bytes:
    """What a version's claim holds: the fingerprint of its weights and a newline."""
    return f"{fingerprint}\n".encode()


def claim_version(store: Store, version: int, fingerprint: str) -> None:
    """Bind ``version`` to the weights of ``fingerprint``, or raise :class:`ConflictError`.

    A version has up to two manifests under two keys (``vN.json``, ``vN.anchor.json``), each
    created write-once; without a claim, a racing publisher could win one key with other weights
    while its rival wins the other, and vN would name two models (a follower rebuilding from the
    anchor then finds no chain to the delta). The claim is created once with the fingerprint; the
    anchor and delta of one version (the same weights) pass it, and so does a retry of a create
    that succeeded before its answer was cut."""
    body = claim_body(fingerprint)
    key = claim_key(version)
    try:
        store.create(key, body)
    except ConflictError:
        held = store.read(key, MAX_CLAIM_BYTES)
        if held != body:
            raise ConflictError(
                f"{store.key_uri(key)}: v{version} is already claimed by other weights "
                f"({held[:80]!r}, not {fingerprint})"
            ) from None


def publish_version(
    store: Store,
    blobs: Mapping[str, bytes | os.PathLike] | Iterable[tuple[str, bytes | os.PathLike]],
    manifest_key: str,
    manifest_bytes: bytes,
    latest_bytes: bytes,
    version: int,
    latest_key: str = LATEST_KEY,
    workers: int = 4,
    signature: bytes | None = None,
) -> str:
    """Publish one version all-or-nothing and write-once: every blob, the version's claim
    (:func:`claim_version`: LATEST's fingerprint), the manifest's signature, the manifest, then LATEST.

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
        raise ValueError(
            f"publish_version: blob keys must be unique and differ from {manifest_key!r} and {latest_key!r}"
        )

    new = Latest.from_json(latest_bytes)[0]  # the pointer this version moves LATEST to: its weights' fingerprint

    def forward_only(current: bytes | None) -> None:
        """LATEST moves to a newer version, or to a second manifest of its own version with the
        same weights (the delta published beside an anchor)."""
        if current is None:
            return
        held = Latest.from_json(current)[0]
        if held.version > version or (held.version == version and held.fingerprint != new.fingerprint):
            raise ConflictError(f"LATEST names v{held.version}, not older than v{version}")

    try:
        _create_all(store, items, workers)
        claim_version(store, version, new.fingerprint)
        if signature is not None:
            store.create(manifest_key + ".sig", signature)
        store.create(manifest_key, manifest_bytes)
        store.write_if(latest_key, latest_bytes, forward_only)
    except ConflictError as e:
        raise ConflictError(
            f"version {version} cannot be published to {store.uri}: {e}; another publisher wrote "
            "this version or a newer one (resume after the store's LATEST: DeltaPublisher(resume=...))"
        ) from e
    return store.key_uri(manifest_key)


def publish_catch_up(
    store: Store,
    blobs: Iterable[tuple[str, bytes | os.PathLike]],
    manifest_key: str,
    manifest_bytes: bytes,
    version: int,
    fingerprint: str,
    signature: bytes | None = None,
    workers: int = 4,
) -> str:
    """Publish a catch-up delta (format 11, :func:`engine_ext.format.manifest.catch_up_key`): its blobs,
    then the check that ``version`` is claimed by the weights it rebuilds (``fingerprint``; a catch-up
    never claims a version, it only shortcuts one already published), its signature and its manifest,
    each created write-once. LATEST is not touched: it names the version's own manifest, which the
    catch-up stands for. Returns the manifest URI."""
    items = list(blobs)
    held = store.read(claim_key(version), MAX_CLAIM_BYTES)
    if held != claim_body(fingerprint):
        raise ConflictError(f"{store.key_uri(claim_key(version))}: v{version} holds other weights than the catch-up's")
    _create_all(store, items, workers)
    if signature is not None:
        store.create(manifest_key + ".sig", signature)
    store.create(manifest_key, manifest_bytes)
    return store.key_uri(manifest_key)


def _create_all(store: Store, items: list[tuple[str, bytes | os.PathLike]], workers: int) -> None:
    """Create every (key, bytes or local file) write-once, in parallel; re-raises the first failure after all finish."""

    def put(item):
        key, value = item
        if isinstance(value, (bytes, bytearray, memoryview)):
            store.create(key, bytes(value))
        else:
            store.create_file(key, value)

    if items:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
            list(pool.map(put, items))
