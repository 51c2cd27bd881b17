"""Catch-up deltas (format 11): one signed delta over several versions, for a replica that lags.

Ten RL steps touch far fewer elements than ten times one step's (updates overlap), so a replica
k versions behind should fetch about the union of the changes in O(log k) requests, not k deltas.
A catch-up delta from version ``b`` to ``v`` is an ordinary delta (its base ``b``, its result
``v``'s weights, every tensor's fingerprints) that also names the manifest of ``v`` it stands for
(``stands_for``); after it a reader holds that manifest, so the next delta binds to it as usual.

**Where they lie.** Spans are powers of two, aligned like a skip list: the catch-up of span ``s``
to ``v`` exists only where ``s`` divides ``v``, at :func:`engine_ext.format.manifest.catch_up_key`
``(v - s, v)``. A reader finds them by name (:func:`engine_ext.store.route.catch_up_chain`), with no
listing of the store.

**How they are made: composed from the store, not from weights.** Steps in the ordered bit space
add (:func:`engine_ext.format.delta.compose`): (b2 - b1) + (b1 - b0) = b2 - b0. So a catch-up is
composed from the deltas it spans, read back from the store and verified like any reader's, with
no old version of the model kept in memory: the links are decoded a batch of tensors at a time, so a
composer holds a few hundred MB of changes however big the model. A span ``2s`` catch-up is composed from the two
span-``s`` catch-ups where they exist (two decodes, however long the span), else from the chain.
The composite is coded plain (v1): the context coder (v2) predicts from the base weights, which
a composer reading only the store does not hold, and decoding a context-coded link needs them too,
so a span that holds a context-coded link gets no catch-up (it is skipped, and said so). A
composite that mixes absolute values over relative steps within a tensor would need the base to
be coded in one mode, and is skipped the same way. Whatever is skipped, readers still have the
chain: a catch-up is an optimisation, never a requirement.

**Never worse than the chain.** A catch-up is published only when its payload is smaller than that
of the links it is composed from, so a route through catch-ups never costs more bytes than the
chain it replaces (the route planner relies on it and reads no chain to compare).

**Trust.** Each catch-up is validated, signed and published write-once like any version, without
moving LATEST; the version's claim must name the same weights (:func:`engine_ext.store.publish_catch_up`),
and it is read back and checked against the manifest it stands for before it is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..errors import UnsupportedError
from ..format.delta import ABS, TensorDelta, compose
from ..format.dtypes import apply_step, dtype_by_name
from ..format.manifest import DELTA, catch_up_key, manifest_key
from ..store import Store
from ..store.reader import Link, fetch_selected, read_link
from ..store.route import MAX_CHAIN, catch_up_chain
from ..store.signing import Signer, Trust
from .builder import VersionBuilder
from .delta_pipeline import DeltaEncoder, TensorChange

NewBits = Callable[[str, torch.Tensor], torch.Tensor]  # (name, flat positions) -> a version's raw bits there
DEFAULT_SPANS = (4, 16, 64)  # each a power of two; what ``engine-ext compact`` and the publisher option make
BATCH_CHANGES = 1 << 25  # changes decoded at once while composing (~16 bytes each, positions and values held twice)


@dataclass(frozen=True)
class CatchUp:
    """What :func:`compose_catch_up` did for one span: published (``key``) or skipped (``skipped``: why)."""

    base_version: int
    version: int
    key: str | None
    payload_bytes: int  # the catch-up's (0 where skipped before encoding)
    parts_bytes: int  # of the links it was composed from
    parts: int  # how many links
    seconds: float
    skipped: str | None = None


def check_spans(spans) -> tuple[int, ...]:
    """``spans`` sorted, each a power of two of at least 2 (a span of 1 is the version's own delta)."""
    given = [int(s) for s in spans]
    if any(s < 2 or s & (s - 1) for s in given):
        raise ValueError(f"catch-up spans must be powers of two of at least 2, got {given}")
    return tuple(sorted(set(given)))


def publish_catch_ups(
    store: Store,
    version: int,
    spans=DEFAULT_SPANS,
    *,
    trust: Trust,
    signer: Signer | None,
    workers: int = 8,
    new_bits: NewBits | None = None,
) -> list[CatchUp]:
    """Every catch-up to ``version`` of the given ``spans`` (shortest first: a longer one is composed from
    them) whose base version is published and which is not already in the store."""
    done = []
    for span in check_spans(spans):
        if version % span or version < span:
            continue
        if store.exists(catch_up_key(version - span, version)):
            continue  # already published (write-once)
        done.append(
            compose_catch_up(
                store, version - span, version, trust=trust, signer=signer, workers=workers, new_bits=new_bits
            )
        )
    return done


def compose_catch_up(
    store: Store,
    base_version: int,
    version: int,
    *,
    trust: Trust,
    signer: Signer | None,
    workers: int = 8,
    new_bits: NewBits | None = None,
) -> CatchUp:
    """Compose, sign and publish the catch-up delta from ``base_version`` to ``version`` (module docstring);
    skipped (``CatchUp.skipped``) where it cannot be composed without the weights or would not be smaller.
    ``new_bits(name, flat positions)``: ``version``'s raw bits there, where the caller holds them (a publisher
    right after publishing it): a tensor whose composite mixes absolute values and relative steps is then
    coded as the new bits at all its changes, instead of skipping the span."""
    t0 = time.perf_counter()
    span = version - base_version
    if span < 2 or span & (span - 1) or version % span:
        raise ValueError(
            f"a catch-up spans a power of two of versions and ends at a multiple of it, not v{base_version}..v{version}"
        )

    def read(key: str) -> Link:
        return read_link(store, key, trust)

    target = read(manifest_key(version))
    if target.manifest.kind != DELTA:
        raise UnsupportedError(f"{store.key_uri(target.key)} is not a delta")
    links = catch_up_chain(store, base_version, target, read, MAX_CHAIN, max_span=span // 2) or []
    parts_bytes = sum(link.manifest.payload_bytes for link in links)

    def skipped(why: str, payload: int = 0) -> CatchUp:
        return CatchUp(base_version, version, None, payload, parts_bytes, len(links), time.perf_counter() - t0, why)

    if not links:
        return skipped(f"no chain of consecutive deltas from v{base_version} (not published, or numbered with gaps)")
    if context := [link.key for link in links if link.manifest.step_tables]:
        return skipped(f"{context[0]} is context coded: composing it needs the base weights")
    b = VersionBuilder(
        DELTA,
        target.manifest.model,
        version,
        base_version=base_version,
        anchor_version=target.manifest.anchor_version,
        base_manifests=list(links[0].manifest.base_manifests),  # every manifest of the base version
    )
    b.manifest.stands_for = target.sha256
    try:
        for name, dtype, shape, base_fp, fp, part in _changes(store, links, target, new_bits, workers):
            if part is None:
                b.add_unchanged(name, dtype, shape, fp)
            else:
                b.add_encoded(name, dtype, shape, part.nnz, _encode(part), base_fp, fp)
        b.name_blobs()
    except _NeedsBase as e:
        b.tmp.cleanup()
        return skipped(str(e))
    payload = b.manifest.payload_bytes
    if payload >= parts_bytes:
        b.tmp.cleanup()
        return skipped(f"{payload} bytes, not smaller than its {len(links)} links' {parts_bytes}", payload)
    b.publish(store, signer)
    got = read(catch_up_key(base_version, version))
    if got.manifest.stands_for != target.sha256 or got.manifest.fingerprint != target.manifest.fingerprint:
        raise UnsupportedError(f"{store.key_uri(got.key)} as read back does not rebuild {store.key_uri(target.key)}")
    return CatchUp(
        base_version, version, got.key, got.manifest.payload_bytes, parts_bytes, len(links), time.perf_counter() - t0
    )


class _NeedsBase(Exception):
    """A composite that only the base weights could code (module docstring): the span is skipped."""


def _changes(store: Store, links: list[Link], target: Link, new_bits: NewBits | None, workers: int):
    """Per tensor of the target, in its order: (name, dtype, shape, base fingerprint, fingerprint, its
    composed part or None where its steps cancel or it did not change). The links are decoded a batch of
    tensors at a time (:data:`BATCH_CHANGES` changes over the links at most, or one tensor), so composing
    holds a few hundred MB however big the model."""
    tc, fc = target.manifest.columns(), links[0].manifest.columns()
    base_of = dict(zip(fc.names, fc.base.tolist()))
    changes_of = [dict(zip(c.names, c.nnz.tolist())) for c in (link.manifest.columns() for link in links)]
    rows = list(zip(tc.names, tc.dtype_names(), tc.shape_tuples(), tc.fingerprint.tolist()))
    total = [sum(c.get(name, 0) for c in changes_of) for name in tc.names]  # each tensor's changes over the links
    at = 0
    while at < len(rows):
        end, held = at, 0
        while end < len(rows) and (end == at or held + total[end] <= BATCH_CHANGES):
            held += total[end]
            end += 1
        batch = rows[at:end]
        composed: dict[str, list[TensorDelta]] = {}
        for link, changes in zip(links, changes_of):
            selection = {name: None for name, *_ in batch if changes.get(name, 0)}
            if selection:
                for td in fetch_selected(store, link.manifest, selection, workers)[0]:
                    composed.setdefault(td.name, []).append(td)
        for name, dtype, shape, fp in batch:
            parts = compose(composed.pop(name)) if name in composed else []
            if len(parts) > 1:
                if new_bits is None:
                    raise _NeedsBase(f"tensor {name!r} composes to absolute values beside relative steps")
                positions = torch.sort(torch.cat([p.index() for p in parts])).values  # disjoint (compose)
                parts = [replace(parts[0], mode=ABS, positions=positions, values=new_bits(name, positions))]
            yield name, dtype_by_name(dtype), shape, base_of[name], fp, parts[0] if parts else None
        at = end


def _encode(part: TensorDelta):
    """A composed part coded plain (v1), cut into the publisher's default grid (:meth:`DeltaEncoder.cuts`).
    The plain coder codes a relative part from old and new bits; a composite holds steps, which are the
    steps from zero bits to zero plus the step (exact: the ordered space wraps), so zero stands for the base."""
    zeros = torch.zeros_like(part.values)
    new = part.values if part.mode == ABS else apply_step(zeros, part.values, part.dtype.is_float)
    return DeltaEncoder(mode=part.mode).encode(
        TensorChange(part.name, part.dtype, part.shape, part.index(), zeros, new, 0, 0)
    )
