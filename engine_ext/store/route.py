"""Routes through published versions: from what a reader holds to a target version.

A route is a chain of deltas from the held version, or the newest anchor at or below the
target and the chain from it, whichever reads fewer bytes. Every manifest of it is read
and verified (:mod:`.reader`) before it is parsed; each delta names its base manifest by
SHA-256, so links are checked one against the next; and the whole route is held to
:class:`Limits` (links, manifest bytes, payload bytes, decoded bytes) before any blob is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .. import settings
from ..errors import BaseMismatchError, IntegrityError, ManifestError, NotFoundError
from ..format import chunks
from ..format import fingerprint as fpr
from ..format.delta import TensorDelta, compose
from ..format.dtypes import dtype_by_name
from ..format.manifest import ANCHOR, MAX_MANIFEST_BYTES, Manifest, catch_up_key, manifest_key
from . import Store, open_store, split_uri
from .reader import (
    Bases,
    DecodedDelta,
    Link,
    _decoded,
    check_decode_budget,
    check_expected,
    decode_manifest,
    fetch_blobs,
    read_latest,
    read_link,
)
from .signing import Trust

MAX_CHAIN = 256  # links in one route; anchors keep real routes far shorter


@dataclass
class Route:
    """What :func:`plan` found: the store, the verified links to fetch in order (empty: the
    target's weights are what is held), and the target's own link."""

    store: Store
    links: list[Link]
    target: Link


@dataclass(frozen=True)
class Limits:
    """What reading one update may cost, fixed before anything is fetched."""

    manifest_bytes: int = MAX_MANIFEST_BYTES
    chain: int = MAX_CHAIN
    payload_bytes: int | None = None  # all blobs of the route
    decoded_bytes: int | None = None  # per manifest

    @classmethod
    def for_model(cls, tensors: dict) -> Limits:
        """Limits relative to the served model ``{name: (shape, dtype name)}``: a manifest of
        at most ~2 KiB per tensor plus ~400 bytes per grid cell it may be cut into, a route's payload
        at most twice the model's bytes (an anchor is one model), decoding at most every
        element of it once."""
        numel = {n: math.prod(s) for n, (s, _) in tensors.items()}
        model_bytes = sum(numel[n] * dtype_by_name(d).itemsize for n, (_, d) in tensors.items())
        decoded = sum(numel[n] * (8 + dtype_by_name(d).itemsize) for n, (_, d) in tensors.items())
        return cls(
            manifest_bytes=min(MAX_MANIFEST_BYTES, (64 << 10) + (2048 + 400 * chunks.GRID**2) * len(tensors)),
            payload_bytes=2 * model_bytes + (16 << 20),
            decoded_bytes=min(settings.current().max_decoded_bytes, decoded + (1 << 20)),
        )


class DowngradeError(BaseMismatchError):
    """The target is older than the served version; going back must be asked for explicitly."""

    reason = "downgrade"


def held_sha(link: Link) -> str:
    """The SHA-256 of the manifest a reader holds after ``link``: its own, or for a catch-up delta
    (format 11) the one of its version it stands for, which the next delta names as its base."""
    return link.manifest.stands_for or link.sha256


def check_link(prev: Link, cur: Link, where: str) -> None:
    """``cur`` (a delta) continues ``prev``: same version and fingerprint, and (format 2) names
    the manifest ``prev`` leaves held (:func:`held_sha`) among its base manifests, so no other
    manifest with the same fingerprint can stand in for it (mix-and-match)."""
    m = cur.manifest
    if prev.manifest.fingerprint != m.base_fingerprint or prev.manifest.version != m.base_version:
        raise IntegrityError(f"{where}: {prev.key} does not lead to {cur.key}: versions or fingerprints differ")
    if m.format_version >= 2 and held_sha(prev) not in m.base_manifests:
        raise IntegrityError(f"{where}: {cur.key} is not bound to {prev.key} (its base manifests are others)")


def catch_up_chain(
    store: Store, start: int, target: Link, read, limit: int, max_span: int | None = None
) -> list[Link] | None:
    """The links from ``start`` to ``target`` (a delta) in few hops: at each held version ``v``, the
    catch-up delta of the longest span ``s`` (a power of two dividing ``v``, :func:`catch_up_key`) that
    the store holds, else the version's own delta to ``v + 1``: O(log k) links for k versions, as in a
    skip list. A span found absent once is not probed again (a store without catch-ups costs a few
    misses, not one per version). Each link is checked against the next, and the last against the
    target (a catch-up must stand for the target's own manifest). A catch-up is never bigger than the
    links it composes (:mod:`engine_ext.trainer.catch_up` publishes it only then), so this route costs
    at most the chain's bytes. None where the versions between are not consecutive or the route is
    longer than ``limit`` links. ``max_span``: no longer catch-up is taken (a composer's halves)."""
    end = target.manifest.version
    links: list[Link] = []
    absent: set[int] = set()
    cur = start
    while cur < end:
        span = 1 << min((end - cur).bit_length(), (max_span or end).bit_length())
        step = None
        while step is None and (span := span >> 1) >= 2:
            if cur % span or span in absent:
                continue
            try:
                step = read(catch_up_key(cur, cur + span))
            except NotFoundError:
                absent.add(span)
        if step is None:
            try:
                step = read(manifest_key(cur + 1))
            except NotFoundError:
                return None
        m = step.manifest
        if step.key != m.key:  # a manifest published under another version's or catch-up's key
            raise IntegrityError(f"{store.key_uri(step.key)} holds the manifest of {m.key}")
        if m.base_version != cur:
            return None  # versions not consecutive: the planner walks the chain back instead
        if links:
            check_link(links[-1], step, store.uri)
        links.append(step)
        if len(links) > limit:
            return None
        cur = m.version
    if held_sha(links[-1]) != target.sha256:
        raise IntegrityError(
            f"{store.key_uri(links[-1].key)} does not stand for {store.key_uri(target.key)} (its manifests differ)"
        )
    return links


def check_same_weights(anchor: Link, target: Link, where: str) -> None:
    """``anchor`` stands in for ``target``, a delta of the same version: both manifests name the
    same weights (version and fingerprint), so fetching the anchor alone rebuilds the target."""
    a, t = anchor.manifest, target.manifest
    if a.version != t.version or a.fingerprint != t.fingerprint:
        raise IntegrityError(
            f"{where}: {anchor.key} does not hold the weights of {target.key}: versions or fingerprints differ"
        )


def chain_back(store: Store, target: Link, stop_version: int, read, limit: int) -> list[Link] | None:
    """The links from the one based on ``stop_version`` up to ``target``, each checked against
    the next; None if no such chain (or longer than ``limit`` links)."""
    chain = [target]
    cur = target
    while cur.manifest.kind != ANCHOR and cur.manifest.base_version != stop_version:
        if cur.manifest.base_version < stop_version or len(chain) >= limit:
            return None
        try:
            prev = read(manifest_key(cur.manifest.base_version))
        except NotFoundError:
            return None
        check_link(prev, cur, store.uri)
        chain.insert(0, prev)
        cur = prev
    if cur.manifest.kind == ANCHOR and cur.manifest.version != stop_version:
        return None
    return chain


def shortest_chain(store: Store, target: Link, start: int, read, limit: int) -> list[Link] | None:
    """The delta links from version ``start`` to ``target``: through catch-up deltas where the store
    holds them (:func:`catch_up_chain`, never more bytes than the chain), else the chain walked back."""
    if target.manifest.version - start >= 2:
        links = catch_up_chain(store, start, target, read, limit)
        if links is not None:
            return links
    return chain_back(store, target, start, read, limit)


def differing_tensors(m: Manifest, tensor_fps: Mapping[str, int] | None, show: int = 5) -> str:
    """``"; N tensor(s) differ from the delta's base: [...]"``, naming the held tensors whose
    fingerprint is not the delta's per-tensor base (empty without per-tensor fingerprints)."""
    if not tensor_fps:
        return ""
    differ = sorted(t.name for t in m.tensors if fpr.parse(t.base_fingerprint) != tensor_fps.get(t.name))
    return f"; {len(differ)} tensor(s) differ from the delta's base: {differ[:show]}" if differ else ""


def plan(
    source: str,
    have_version: int | None = None,
    have_fingerprint: int | None = None,
    *,
    have_manifests: tuple[str, ...] = (),
    trust: Trust | None = None,
    limits: Limits = Limits(),
    allow_older: bool = False,
    deadline: float | None = None,
    tensor_fps: Mapping[str, int] | None = None,
    expected: dict | None = None,
    **store_options,
) -> Route:
    """The verified links to fetch to go from what is held to the target, fewest bytes first.

    ``source`` is a manifest URI (``.../v00000042.json``) or a store root (its signed LATEST).
    Candidates: the delta chain from ``have_version``; the newest anchor at or below the
    target plus the chain from it (walked only where the anchor alone costs less than the first
    candidate), or the chain alone when the held weights are the anchor's (a server restarted
    from the run's first checkpoint fetches no anchor). Every manifest is
    verified before it is parsed, every link checked against the next, the first delta
    against what is held (its fingerprint and version, and, when known, ``have_manifests``:
    the SHA-256 of the manifests that produced the held weights). No links: the target's
    weights are what is held (a replay, or weights equal by fingerprint). Raises
    BaseMismatchError when no route leads there, DowngradeError for an older target unless
    ``allow_older``. ``deadline`` (``time.monotonic()``) bounds every read of the store.
    ``expected`` ({name: (shape, dtype name)} of the held model): the target is checked against
    it first (:class:`~engine_ext.errors.ModelMismatchError`), so that a version of another model,
    layout or dtype is named as such, not as a wrong base.
    """
    trust = trust or Trust.from_settings()
    if source.endswith(".json"):
        store, key = split_uri(source, **store_options)
        want_sha = None
    else:
        store = open_store(source, **store_options)
    store.deadline = deadline
    if not source.endswith(".json"):
        latest = read_latest(store, trust)
        key, want_sha = latest.manifest, latest.sha256
    seen: dict[str, Link] = {}

    def read(k: str) -> Link:  # both candidate chains walk the same links: read each once
        if k not in seen:
            if len(seen) >= 2 * limits.chain + 2:
                raise ManifestError(f"{store.uri}: reading more than {len(seen)} manifests for one update")
            seen[k] = read_link(store, k, trust, limits.manifest_bytes)
        return seen[k]

    target = read(key)
    if want_sha is not None and target.sha256 != want_sha:
        raise IntegrityError(f"{store.key_uri(key)} is not the manifest LATEST names (SHA-256 differs)")
    tm = target.manifest
    check_expected(tm, expected, store.key_uri(key))
    if have_version is not None and have_fingerprint is not None and tm.version == have_version:
        if fpr.parse(tm.fingerprint) != have_fingerprint:
            raise BaseMismatchError(
                f"{store.key_uri(key)} is version {tm.version} with another fingerprint than the served one"
            )
        return Route(store, [], target)  # already held: nothing to fetch
    if have_version is not None and tm.version < have_version and not allow_older:
        raise DowngradeError(
            f"{store.key_uri(key)} is version {tm.version}, older than the served version "
            f'{have_version}; send "rollback": true to go back explicitly'
        )
    if have_fingerprint is not None and fpr.parse(tm.fingerprint) == have_fingerprint:
        _check_payload([target], limits)  # nothing will be fetched, but a manifest that lies about its size is refused
        return Route(store, [], target)  # the held weights are the target's: nothing to fetch
    candidates = []
    if tm.kind == ANCHOR:
        candidates.append([target])
    elif have_version is not None or have_fingerprint is not None:
        if have_version is None and fpr.parse(tm.base_fingerprint) == have_fingerprint:
            candidates.append([target])
        elif have_version is not None and have_version < tm.version:
            chain = shortest_chain(store, target, have_version, read, limits.chain)
            if chain:
                candidates.append(chain)
    if tm.kind != ANCHOR and tm.anchor_version is not None:
        try:
            anchor = read(manifest_key(tm.anchor_version, ANCHOR))
            holds_anchor = (
                have_fingerprint is not None
                and fpr.parse(anchor.manifest.fingerprint) == have_fingerprint
                and (not have_manifests or anchor.sha256 in have_manifests)
            )
            chain_bytes = min((sum(link.manifest.payload_bytes for link in c) for c in candidates), default=None)
            if anchor.manifest.version == tm.version:
                check_same_weights(anchor, target, store.uri)
                rest = []
            elif not holds_anchor and chain_bytes is not None and anchor.manifest.payload_bytes >= chain_bytes:
                # the anchor alone costs what the chain does: its route is not walked (a replica one version
                # behind reads two manifests, not every one since the anchor: each a request, a big model's
                # each with its tables)
                rest = None
            else:
                rest = shortest_chain(store, target, anchor.manifest.version, read, limits.chain)
            if rest is not None:
                if rest:
                    check_link(anchor, rest[0], store.uri)
                candidates.append(rest if holds_anchor and rest else [anchor] + rest)
        except NotFoundError:
            pass
    if not candidates:
        raise BaseMismatchError(
            f"{store.key_uri(key)} applies to version {tm.base_version} (fingerprint {tm.base_fingerprint}); "
            f"held: version {have_version}, fingerprint {fpr.fmt(have_fingerprint) if have_fingerprint is not None else None}; "
            f"no delta chain (of at most {limits.chain} links) or anchor leads there"
        )
    best = min(candidates, key=lambda c: sum(link.manifest.payload_bytes for link in c))
    first = best[0]
    if first.manifest.kind != ANCHOR:
        if have_fingerprint is not None and fpr.parse(first.manifest.base_fingerprint) != have_fingerprint:
            raise BaseMismatchError(
                f"{store.key_uri(first.key)} applies to fingerprint {first.manifest.base_fingerprint}, "
                f"held {fpr.fmt(have_fingerprint)}{differing_tensors(first.manifest, tensor_fps)}"
            )
        if (
            have_manifests
            and first.manifest.format_version >= 2
            and not set(first.manifest.base_manifests) & set(have_manifests)
        ):
            raise IntegrityError(
                f"{store.key_uri(first.key)} is not bound to the manifest the served weights came from"
            )
    _check_payload(best, limits)
    return Route(store, best, target)


def _check_payload(links: list[Link], limits: Limits) -> None:
    payload = sum(link.manifest.payload_bytes for link in links)
    if limits.payload_bytes is not None and payload > limits.payload_bytes:
        raise ManifestError(
            f"the update would fetch {payload} bytes, over the {limits.payload_bytes}-byte limit "
            "for this model (twice its size)"
        )


def fetch_planned(
    store: Store, chain: list[Link], workers: int = 8, limits: Limits = Limits(), bases: Bases | None = None
) -> DecodedDelta:
    """Fetch, verify and decode every link of a :func:`plan`, composed into one delta
    (context-coded parts against ``bases``, advanced link by link)."""
    for link in chain:  # every decode budget checked before the first byte of any blob
        check_decode_budget(link.manifest, limits.decoded_bytes)
    decoded = []
    for i, link in enumerate(chain):
        tensors = decode_manifest(
            link.manifest, fetch_blobs(store, link.manifest, workers), workers, limit=limits.decoded_bytes, bases=bases
        )
        if bases is not None and i + 1 < len(chain):
            bases.advance(tensors)
        decoded.append(_decoded(store, link.manifest, link.key, tensors))
    if len(decoded) == 1:
        return decoded[0]
    by_name: dict[str, list[TensorDelta]] = {}
    for d in decoded:
        for t in d.tensors:
            by_name.setdefault(t.name, []).append(t)
    tensors = [part for parts in by_name.values() for part in compose(parts)]
    first, last = decoded[0], decoded[-1]
    return DecodedDelta(
        kind=first.kind,
        model=last.model,
        base_version=first.base_version,
        version=last.version,
        base_fingerprint=first.base_fingerprint,
        fingerprint=last.fingerprint,
        tensors=tensors,
        payload_bytes=sum(d.payload_bytes for d in decoded),
        manifests=[u for d in decoded for u in d.manifests],
        tensor_fingerprints=last.tensor_fingerprints,
        tensor_base_fingerprints=first.tensor_base_fingerprints,
    )


def resolve(
    source: str,
    have_version: int | None = None,
    have_fingerprint: int | None = None,
    *,
    expected: dict | None = None,
    workers: int = 8,
    trust: Trust | None = None,
    allow_older: bool = True,
    bases: Bases | None = None,
    **store_options,
) -> DecodedDelta:
    """Everything needed to go from the held version to ``source``'s, composed into one delta
    (:func:`plan`, each manifest checked against ``expected``, then :func:`fetch_planned`)."""
    route = plan(
        source, have_version, have_fingerprint, trust=trust, allow_older=allow_older, expected=expected, **store_options
    )
    for link in route.links:
        check_expected(link.manifest, expected, route.store.key_uri(link.key))
    return fetch_planned(route.store, route.links, workers, bases=bases)
