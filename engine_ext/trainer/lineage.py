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

import math
import re
from dataclasses import dataclass

import torch

from ..errors import IntegrityError, ModelMismatchError, NotFoundError, PartlyHeldError
from ..format import chunks
from ..format import fingerprint as fpr
from ..format.delta import ABS
from ..format.dtypes import DType, apply_step, dtype_by_name
from ..format.latest import Latest
from ..format.manifest import ANCHOR, manifest_key
from ..store import Store, decoding, reader, route
from ..store.signing import Trust

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
        what = f"a delta against v{self.latest_version}" if self.kind == "delta" else "an anchor"
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
    target, chain = _route(store, latest, trust)
    bases = decoding.TensorBases({})
    for link in chain:
        bases.advance(reader.decode_manifest(link.manifest, reader.fetch_blobs(store, link.manifest), bases=bases))
    tm, out = target.manifest, {}
    for t in tm.tensors:
        w = bases.tensors.get(t.name)
        if w is None and t.numel == 0:
            w = torch.empty(t.shape, dtype=dtype_by_name(t.dtype).torch)
        if w is None or fpr.tensor_fingerprint(w) != fpr.parse(t.fingerprint):
            raise IntegrityError(
                f"{t.name}: the weights rebuilt from {store.uri} do not have the fingerprint "
                f"{store.key_uri(target.key)} promises"
            )
        out[t.name] = w
    return Rebuilt(target, _same_version(target, chain), out)


def _same_version(target: reader.Link, chain: list[reader.Link]) -> list[str]:
    """SHA-256 of LATEST's manifest and of the others of its version in ``chain`` (its anchor)."""
    return [target.sha256] + [
        link.sha256 for link in chain if link.manifest.version == target.manifest.version and link is not target
    ]


def _route(store: Store, latest: Latest, trust: Trust) -> tuple[reader.Link, list[reader.Link]]:
    """LATEST's manifest and the verified links that rebuild it: the newest anchor at or below it
    and the delta chain from it (the anchor alone when LATEST's version was anchored)."""

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
                raise NotFoundError(
                    f"no chain of at most {route.MAX_CHAIN} links leads from {anchor.key} to {target.key}"
                )
            route.check_link(anchor, rest[0], store.uri)
            chain = [anchor] + rest
    return target, chain


@dataclass(frozen=True)
class Span:
    """Rows ``[start, stop)`` of a tensor of ``shape`` in the served ``dtype``: what one rank of a
    sharded trainer publishes of it."""

    shape: tuple
    dtype: DType
    start: int
    stop: int

    @property
    def flat(self) -> tuple[int, int]:
        """The rows as a range of flat (row-major) indices."""
        row = math.prod(self.shape[1:])
        return self.start * row, self.stop * row


class RowBases(decoding.Bases):
    """LATEST's weights restricted to some rows of each tensor, rebuilt link by link: the base that
    context-coded parts decode against, and what :meth:`advance` applies each link to."""

    def __init__(self, spans: dict[str, Span]):
        self.spans = spans
        self.held: dict[str, torch.Tensor] = {}  # name -> the rows' flat raw bits

    def bits(self, name, start, stop):
        s, t = self.spans.get(name), self.held.get(name)
        if t is None or start[0] >= s.stop or stop[0] <= s.start:
            return None
        if start[0] < s.start or stop[0] > s.stop:
            raise PartlyHeldError(
                f"{name}: a cell of rows {start[0]}..{stop[0]} crosses the rows {s.start}..{s.stop} "
                "this rank rebuilds (a context-coded cell of another layout)"
            )
        rows = t.view(s.stop - s.start, *s.shape[1:])[start[0] - s.start : stop[0] - s.start]
        columns = (slice(None),) + tuple(slice(a, b) for a, b in zip(start[1:], stop[1:]))
        return rows[columns].contiguous().reshape(-1).numpy()

    def advance(self, tensors):
        for td in tensors:
            self.apply(td)

    def apply(self, td) -> None:
        """``td``'s elements inside the rows, applied (an absolute part that covers them all starts them)."""
        s = self.spans[td.name]
        lo, hi = s.flat
        if td.positions is None:
            pos, vals = None, td.values[lo:hi]
        else:
            i0, i1 = (int(i) for i in torch.searchsorted(td.positions, torch.tensor([lo, hi], dtype=torch.int64)))
            pos, vals = td.positions[i0:i1] - lo, td.values[i0:i1]
        cur = self.held.get(td.name)
        if cur is None:
            if td.mode != ABS or (pos is not None and len(pos) != hi - lo):
                raise IntegrityError(
                    f"{td.name}: the route's first link does not hold every element of rows "
                    f"{s.start}..{s.stop} (not an anchor of them)"
                )
            self.held[td.name] = vals.clone()
            return
        at = slice(None) if pos is None else pos
        cur[at] = vals if td.mode == ABS else apply_step(cur[at], vals, td.dtype.is_float)


@dataclass(frozen=True)
class RebuiltRows:
    """Some rows of LATEST's weights as :func:`rebuild_rows` rebuilt them: LATEST's manifest, the
    SHA-256 of its version's manifests, each tensor's rows (flat raw bits) and their partial
    fingerprints (over the rows' global indices: the ranks' partials sum to the tensor's)."""

    target: reader.Link
    manifests: list[str]
    bits: dict[str, torch.Tensor]
    fingerprints: dict[str, int]


def rebuild_rows(
    store: Store, latest: Latest, trust: Trust, spans: dict[str, Span], batch_bytes: int = 256 << 20
) -> RebuiltRows:
    """The rows ``spans`` names of LATEST's weights, rebuilt from the store: a sharded trainer's
    rank resuming with a delta. The route is :func:`rebuild`'s (every manifest verified and bound
    to the next); each link is read for the cells that meet the rows only (every part checked by
    SHA-256), a batch of tensors at a time, so a rank holds its rows plus a batch. The rows'
    fingerprints are partial: only the sum over every rank proves them against LATEST, which the
    caller checks. Raises a DeltaError where a tensor is missing or differs in shape or dtype."""
    target, chain = _route(store, latest, trust)
    entries = {t.name: t for t in target.manifest.tensors}
    for name, s in spans.items():
        t = entries.get(name)
        if t is None or tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype.name:
            raise ModelMismatchError(
                f"{name}: LATEST holds {None if t is None else (tuple(t.shape), t.dtype)}, this rank "
                f"publishes {(tuple(s.shape), s.dtype.name)}"
            )
    batches: list[list[str]] = [[]]  # tensor names, about batch_bytes of bases each
    size = 0
    for name, s in spans.items():
        n = (s.flat[1] - s.flat[0]) * (8 + s.dtype.itemsize)
        if batches[-1] and size + n > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += n
    rows = RowBases(spans)
    for link in chain:
        m = link.manifest
        have = {t.name: t for t in m.tensors}
        for names in batches:
            selection = {}
            for name in names:
                t, s = have.get(name), spans[name]
                if t is None:
                    raise IntegrityError(f"{store.key_uri(link.key)} does not list {name}")
                selection[name] = (
                    None
                    if t.grid is None
                    else {
                        i
                        for i, box in enumerate(t.boxes())
                        if chunks.meets(box, (s.start,) + (0,) * (len(s.shape) - 1), (s.stop, *s.shape[1:]))
                    }
                )
            tensors, _ = reader.fetch_selected(store, m, selection, bases=rows)
            rows.advance(tensors)
    missing = [n for n in spans if n not in rows.held and spans[n].flat[1] > spans[n].flat[0]]
    if missing:
        raise IntegrityError(f"the route to {store.key_uri(target.key)} holds no anchor of {missing[:5]}")
    bits = {
        n: rows.held[n].view(s.dtype.int_view) if n in rows.held else torch.empty(0, dtype=s.dtype.int_view)
        for n, s in spans.items()
    }
    return RebuiltRows(
        target,
        _same_version(target, chain),
        bits,
        {n: fpr.range_fingerprint(b, spans[n].flat[0]) for n, b in bits.items()},
    )


__all__ = [
    "Head",
    "Rebuilt",
    "RebuiltRows",
    "Resumed",
    "RowBases",
    "Span",
    "highest_version",
    "read_head",
    "rebuild",
    "rebuild_rows",
]
