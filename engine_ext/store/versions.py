"""Publishing one version to a store: all or nothing, write-once, LATEST last and forward only."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping

from ..errors import ConflictError
from ..format.manifest import LATEST_KEY
from .base import Store


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
