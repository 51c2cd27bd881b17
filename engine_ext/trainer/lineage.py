"""What a publisher continues from: the store's LATEST, the next free version, LATEST's weights.

Trainers restart from their checkpoints all the time (preemption, OOM, a new run resuming
an old one). A new publisher on a store that already holds versions must neither write
them again (versions are write-once: :func:`engine_ext.store.publish_version`) nor go
back, or the servers that follow the store would freeze on the version they hold. So it
reads the store first (:func:`read_head`): the signed ``LATEST`` and the highest version
any object of the store names (a crashed publisher may have left the blobs or the
signature of a version it never finished: that number is burnt). It continues after
both. Its first version is a delta against LATEST where it can prove that it holds
LATEST's bits: :func:`rebuild` reads LATEST's newest anchor and the chain from it, every
manifest verified against the trusted keys (the publisher's own among them) and bound to
the next by SHA-256, every blob checked, and every rebuilt tensor's fingerprint checked
against LATEST's manifest. Otherwise (no anchor, other tensors, a signature it does not
trust) it publishes an anchor. :class:`Resumed` says which, and why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..format import fingerprint as fpr
from ..store import reader, route
from ..format.dtypes import dtype_by_name
from ..errors import IntegrityError, NotFoundError
from ..format.manifest import ANCHOR, Latest, manifest_key
from ..store.signing import Trust
from ..store import Store

_VERSION_KEY = re.compile(r"v(\d{8,})\.")


@dataclass(frozen=True)
class Head:
    """A store as a publisher finds it: its verified ``LATEST`` (None: nothing published yet)
    and the first version number that no object of the store names."""

    latest: Latest | None
    next_version: int


@dataclass(frozen=True)
class Resumed:
    """What a publisher did on a store that already held versions (``DeltaPublisher.resumed``)."""

    latest_version: int  # the version LATEST named
    first_version: int  # the publisher's first version
    kind: str  # "delta": against LATEST's rebuilt weights; "anchor": a full version
    reason: str

    def __str__(self) -> str:
        what = (f"a delta against v{self.latest_version}" if self.kind == "delta" else "an anchor")
        return f"resumed after v{self.latest_version}: v{self.first_version} is {what} ({self.reason})"


def highest_version(store: Store) -> int | None:
    """The highest version number any object of the store names (None: none, or it cannot list)."""
    try:
        keys = store.list("v")
    except NotImplementedError:
        return None
    return max((int(m.group(1)) for k in keys if (m := _VERSION_KEY.match(k))), default=None)


@dataclass(frozen=True)
class Rebuilt:
    """LATEST's weights as :func:`rebuild` proved them: LATEST's manifest, the SHA-256 of every
    manifest of that version that holds these weights (the delta and, when the version was also
    anchored, its anchor: the next delta binds to both, like a live publisher's), and the
    tensors, on the CPU."""

    target: reader.Link
    manifests: list[str]
    weights: dict[str, torch.Tensor]


def read_head(store: Store, trust: Trust) -> Head:
    """LATEST (verified; an expired pointer still tells where the store stands) and the next free version."""
    try:
        latest = reader.read_latest(store, trust, allow_expired=True)
    except NotFoundError:
        latest = None
    used = [v for v in (latest.version if latest else None, highest_version(store)) if v is not None]
    return Head(latest, max(used) + 1 if used else 0)


def rebuild(store: Store, latest: Latest, trust: Trust) -> Rebuilt:
    """LATEST's weights, rebuilt from the store and proven.

    Reads the newest anchor at or below LATEST and the delta chain from it (none: LATEST's
    version was anchored, and its anchor must name the same weights), each manifest
    verified and bound to the next (:func:`engine_ext.store.route.chain_back`), each blob checked
    by SHA-256, then checks every rebuilt tensor's fingerprint against LATEST's manifest.
    Raises a :class:`~engine_ext.errors.DeltaError` when no such route exists or a check fails.
    """
    def read(key: str) -> reader.Link:
        return reader.read_link(store, key, trust)

    target = read(latest.manifest)
    if latest.sha256 is not None and target.sha256 != latest.sha256:
        raise IntegrityError(f"{store.key_uri(latest.manifest)} is not the manifest LATEST names (SHA-256 differs)")
    tm = target.manifest
    if tm.kind == ANCHOR:
        chain = [target]
    else:
        if tm.anchor_version is None:
            raise NotFoundError(f"{store.key_uri(target.key)} names no anchor to rebuild from")
        anchor = read(manifest_key(tm.anchor_version, ANCHOR))
        if anchor.manifest.version == tm.version:  # the version was anchored: its anchor holds LATEST's weights whole
            route.check_same_weights(anchor, target, store.uri)
            chain = [anchor]
        else:
            rest = route.chain_back(store, target, anchor.manifest.version, read, route.MAX_CHAIN)
            if rest is None:
                raise NotFoundError(f"no chain of at most {route.MAX_CHAIN} links leads from {anchor.key} to {target.key}")
            route.check_link(anchor, rest[0], store.uri)
            chain = [anchor] + rest
    bases = reader.TensorBases({})
    for link in chain:
        bases.advance(reader.decode_manifest(link.manifest, reader.fetch_blobs(store, link.manifest), bases=bases))
    out = {}
    for t in tm.tensors:
        w = bases.tensors.get(t.name)
        if w is None and t.numel == 0:
            w = torch.empty(t.shape, dtype=dtype_by_name(t.dtype).torch)
        if w is None or fpr.tensor_fingerprint(w) != fpr.parse(t.fingerprint):
            raise IntegrityError(f"{t.name}: the weights rebuilt from {store.uri} do not have the fingerprint "
                                 f"{store.key_uri(target.key)} promises")
        out[t.name] = w
    same = [link.sha256 for link in chain if link.manifest.version == tm.version and link is not target]
    return Rebuilt(target, [target.sha256] + same, out)


__all__ = ["Head", "Rebuilt", "Resumed", "highest_version", "read_head", "rebuild"]
