"""Fetch, verify and decode published versions; resolve chains and anchors.

Trust comes before use, and every size is bounded before it is spent (TUF's order):

1. a manifest's raw bytes are verified against the trusted keys (:mod:`engine_ext.signing`)
   before they are parsed, and ``LATEST`` before it is followed (signed, unexpired, naming
   its manifest by SHA-256);
2. a route (a chain of deltas, or an anchor and a chain) is checked link by link, each
   delta naming its base manifest by SHA-256, and against :class:`Limits` (links,
   manifest bytes, payload bytes) before any blob is read;
3. each blob is read into a buffer of its declared size and checked against its
   SHA-256 from the manifest; nothing is decoded before that, and decoding is bounded by
   the declared counts, by the served model's size and by a ratio to the payload (a
   decode bomb is refused before it allocates).

Corrupt, truncated or hostile input fails fast with an :mod:`engine_ext.errors` exception.
"""
from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import codec
from . import fingerprint as fpr
from . import settings
from .delta import TensorDelta, compose
from .dtypes import dtype_by_name
from .errors import BaseMismatchError, IntegrityError, ManifestError, NotFoundError
from .format import ANCHOR, LATEST_KEY, MAX_LATEST_BYTES, MAX_MANIFEST_BYTES, Latest, Manifest, manifest_key
from .signing import MAX_SIGNATURE_BYTES, SIG_SUFFIX, SignatureError, Trust, sha256_hex
from .store import Store, open_store, split_uri

FETCH_CHUNK = 16 << 20  # blobs above this are fetched as parallel ranges
MAX_CHAIN = 256  # links in one route; anchors keep real routes far shorter
MAX_DECODE_RATIO = 256  # decoded bytes per payload byte (a real delta stays far below; a bomb does not)
DECODE_SLACK = 16 << 20  # decoded bytes allowed on top of the ratio (tiny tensors, dense flags)


@dataclass(frozen=True)
class Limits:
    """What reading one update may cost, fixed before anything is fetched."""

    manifest_bytes: int = MAX_MANIFEST_BYTES
    chain: int = MAX_CHAIN
    payload_bytes: int | None = None  # all blobs of the route
    decoded_bytes: int | None = None  # per manifest

    @classmethod
    def for_model(cls, tensors: dict) -> "Limits":
        """Limits relative to the served model ``{name: (shape, dtype name)}``: a manifest of
        at most ~2 KiB per tensor, a route's payload at most twice the model's bytes (an anchor
        is one model), decoding at most every element of it once."""
        numel = {n: math.prod(s) for n, (s, _) in tensors.items()}
        model_bytes = sum(numel[n] * dtype_by_name(d).itemsize for n, (_, d) in tensors.items())
        decoded = sum(numel[n] * (8 + dtype_by_name(d).itemsize) for n, (_, d) in tensors.items())
        return cls(manifest_bytes=min(MAX_MANIFEST_BYTES, (64 << 10) + 2048 * len(tensors)),
                   payload_bytes=2 * model_bytes + (16 << 20),
                   decoded_bytes=min(settings.current().max_decoded_bytes, decoded + (1 << 20)))


@dataclass
class Link:
    """One manifest of a route, verified: where it is, what it says, the SHA-256 of its bytes."""

    key: str
    manifest: Manifest
    sha256: str
    signed: int  # valid trusted signatures (0: unsigned, accepted only with ENGINE_EXT_ALLOW_UNSIGNED)


@dataclass
class DecodedDelta:
    kind: str
    model: str
    base_version: int | None
    version: int
    base_fingerprint: int | None
    fingerprint: int
    tensors: list[TensorDelta]
    payload_bytes: int
    manifests: list[str] = field(default_factory=list)
    tensor_fingerprints: dict[str, int] = field(default_factory=dict)  # every tensor's result fp
    tensor_base_fingerprints: dict[str, int] = field(default_factory=dict)

    @property
    def nnz(self) -> int:
        return sum(t.nnz for t in self.tensors)


def read_link(store: Store, key: str, trust: Trust | None = None, max_bytes: int = MAX_MANIFEST_BYTES) -> Link:
    """A manifest, verified against the trusted keys before it is parsed."""
    trust = trust or Trust.from_settings()
    raw = store.read(key, max_bytes=max_bytes)
    sig = None
    if trust.keys:
        try:
            sig = store.read(key + SIG_SUFFIX, max_bytes=MAX_SIGNATURE_BYTES)
        except NotFoundError:
            pass
    signed = trust.verify_detached(raw, sig, store.key_uri(key))
    return Link(key, Manifest.from_json(raw), sha256_hex(raw), signed)


def read_manifest(store: Store, key: str, trust: Trust | None = None) -> Manifest:
    return read_link(store, key, trust).manifest


def read_latest(store: Store, trust: Trust | None = None) -> Latest:
    """The LATEST pointer, its signature verified and its expiry checked (a stale pointer is a
    frozen store: refused)."""
    trust = trust or Trust.from_settings()
    latest, signatures = Latest.from_json(store.read(LATEST_KEY, max_bytes=MAX_LATEST_BYTES))
    if trust.verify(latest.signed_bytes(), signatures, store.key_uri(LATEST_KEY)):
        if latest.expires_unix is None or latest.expires_unix < time.time():
            raise SignatureError(f"{store.key_uri(LATEST_KEY)} has expired (the publisher stopped refreshing it, "
                                 "or an old pointer is being replayed)")
        if latest.sha256 is None:
            raise SignatureError(f"{store.key_uri(LATEST_KEY)} does not name its manifest by SHA-256")
    return latest


def check_expected(m: Manifest, expected: dict | None, where: str) -> None:
    """Refuse (as a delta for another model) a manifest whose tensors differ from ``expected``
    {name: (shape, dtype name)}: checked from the manifest alone, before any blob is read."""
    if expected is None:
        return
    for t in m.tensors:
        want = expected.get(t.name)
        if want is None:
            raise BaseMismatchError(f"{where}: tensor {t.name!r} is not in the served model")
        shape, dtype = want
        if tuple(shape) != tuple(t.shape) or dtype != t.dtype:
            raise BaseMismatchError(f"{where}: tensor {t.name!r} is {list(t.shape)}/{t.dtype}, "
                                    f"the served model has {list(shape)}/{dtype}")


def fetch_blobs(store: Store, m: Manifest, workers: int = 8) -> list[bytearray]:
    """Every blob of ``m``, read into a buffer of its declared size (ranges in parallel for big
    ones, no joined copy) and verified by size and SHA-256 before anything uses it."""
    def one(b):
        buf = bytearray(b.size)
        if b.size > FETCH_CHUNK:
            ranges = [(o, min(FETCH_CHUNK, b.size - o)) for o in range(0, b.size, FETCH_CHUNK)]

            def part(r):
                buf[r[0]:r[0] + r[1]] = store.read_range(b.key, r[0], r[1])

            with ThreadPoolExecutor(min(workers, len(ranges))) as pool:
                list(pool.map(part, ranges))
        else:
            data = store.read(b.key, max_bytes=b.size)
            if len(data) != b.size:
                raise IntegrityError(f"{store.key_uri(b.key)}: {len(data)} bytes, manifest says {b.size}")
            buf[:] = data
        if hashlib.sha256(buf).hexdigest() != b.sha256:
            raise IntegrityError(f"{store.key_uri(b.key)}: SHA-256 mismatch (corrupt blob)")
        return buf

    with ThreadPoolExecutor(max(1, min(workers, len(m.blobs)))) as pool:
        return list(pool.map(one, m.blobs))


def fetch_tensor_ranges(store: Store, m: Manifest, names: set[str], workers: int = 8) -> dict[str, bytes]:
    """Only the named tensors' bytes, by byte range (verified per tensor when decoded)."""
    wanted = [t for t in m.tensors if t.nnz and t.name in names]
    def one(t):
        return t.name, store.read_range(m.blobs[t.blob].key, t.offset, t.length)
    with ThreadPoolExecutor(max(1, min(workers, len(wanted) or 1))) as pool:
        return dict(pool.map(one, wanted))


def check_decode_budget(m: Manifest, limit: int | None = None) -> None:
    """Refuse, from the manifest alone, a decode that would take more than ``limit`` bytes (default
    ``ENGINE_EXT_MAX_DECODED_BYTES``) or far more than the payload could honestly expand to."""
    total = sum(t.nnz * (8 + dtype_by_name(t.dtype).itemsize) for t in m.tensors)
    limit = settings.current().max_decoded_bytes if limit is None else limit
    if total > limit:
        raise ManifestError(f"decoding would take {total} bytes, over the {limit}-byte limit for this model")
    if total > MAX_DECODE_RATIO * m.payload_bytes + DECODE_SLACK:
        raise ManifestError(f"decoding would take {total} bytes from a {m.payload_bytes}-byte payload "
                            f"(over {MAX_DECODE_RATIO}x: a decode bomb)")


def decode_manifest(m: Manifest, blobs: list | dict[str, bytes], workers: int = 8,
                    names: set[str] | None = None, limit: int | None = None) -> list[TensorDelta]:
    """Decode every changed tensor (or those in ``names``) from whole blobs or per-tensor bytes."""
    check_decode_budget(m, limit)

    def one(t):
        dt = dtype_by_name(t.dtype)
        if isinstance(blobs, dict):
            data = memoryview(blobs[t.name])
            if len(data) != t.length:
                raise IntegrityError(f"tensor {t.name!r}: {len(data)} bytes, manifest says {t.length}")
        else:
            data = memoryview(blobs[t.blob])[t.offset : t.offset + t.length]
        if hashlib.sha256(data).hexdigest() != t.sha256:
            raise IntegrityError(f"tensor {t.name!r}: SHA-256 mismatch")
        p = t.positions.length
        try:
            pos = codec.decode_positions(t.positions.coder, bytes(data[:p]), t.nnz, t.numel)
            vals = codec.decode_values(t.values.coder, bytes(data[p:]), t.nnz, dt)
        except IntegrityError as e:
            raise IntegrityError(f"tensor {t.name!r}: {e}") from None
        base = fpr.parse(t.base_fingerprint) if t.base_fingerprint else None
        return TensorDelta(t.name, dt, tuple(t.shape), t.values.mode, pos, vals, base, fpr.parse(t.fingerprint))

    changed = [t for t in m.tensors if t.nnz and (names is None or t.name in names)]
    with ThreadPoolExecutor(max(1, min(workers, len(changed) or 1))) as pool:
        return list(pool.map(one, changed))


def _decoded(store: Store, m: Manifest, key: str, tensors: list[TensorDelta]) -> DecodedDelta:
    return DecodedDelta(
        kind=m.kind, model=m.model, base_version=m.base_version, version=m.version,
        base_fingerprint=fpr.parse(m.base_fingerprint) if m.base_fingerprint else None,
        fingerprint=fpr.parse(m.fingerprint), tensors=tensors, payload_bytes=m.payload_bytes,
        manifests=[store.key_uri(key)],
        tensor_fingerprints={t.name: fpr.parse(t.fingerprint) for t in m.tensors},
        tensor_base_fingerprints={t.name: fpr.parse(t.base_fingerprint) for t in m.tensors if t.base_fingerprint},
    )


def load_delta(manifest_uri: str, *, expected: dict | None = None, names: set[str] | None = None,
               workers: int = 8, trust: Trust | None = None, **store_options) -> DecodedDelta:
    """Fetch, verify and decode one published version (delta or anchor).

    With ``names``, only those tensors are fetched (by byte range, each checked against
    its own SHA-256) and decoded: what a rank holding part of the model needs.
    """
    store, key = split_uri(manifest_uri, **store_options)
    m = read_manifest(store, key, trust)
    check_expected(m, expected, manifest_uri)
    check_decode_budget(m)
    data = fetch_blobs(store, m, workers) if names is None else fetch_tensor_ranges(store, m, names, workers)
    return _decoded(store, m, key, decode_manifest(m, data, workers, names))


class DowngradeError(BaseMismatchError):
    """The target is older than the served version; going back must be asked for explicitly."""

    reason = "downgrade"


def _check_link(prev: Link, cur: Link, where: str) -> None:
    """``cur`` (a delta) continues ``prev``: same version and fingerprint, and (format 2) names
    ``prev``'s bytes among its base manifests, so no other manifest with the same fingerprint
    can stand in for it (mix-and-match)."""
    m = cur.manifest
    if prev.manifest.fingerprint != m.base_fingerprint or prev.manifest.version != m.base_version:
        raise IntegrityError(f"{where}: {prev.key} does not lead to {cur.key}: versions or fingerprints differ")
    if m.format_version >= 2 and prev.sha256 not in m.base_manifests:
        raise IntegrityError(f"{where}: {cur.key} is not bound to {prev.key} (its base manifests are others)")


def _chain_back(store: Store, target: Link, stop_version: int, read, limit: int) -> list[Link] | None:
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
        _check_link(prev, cur, store.uri)
        chain.insert(0, prev)
        cur = prev
    if cur.manifest.kind == ANCHOR and cur.manifest.version != stop_version:
        return None
    return chain


def plan(source: str, have_version: int | None = None, have_fingerprint: int | None = None, *,
         have_manifests: tuple[str, ...] = (), trust: Trust | None = None, limits: Limits = Limits(),
         allow_older: bool = False, deadline: float | None = None, **store_options) -> tuple[Store, list[Link]]:
    """The verified links to fetch to go from what is held to the target, fewest bytes first.

    ``source`` is a manifest URI (``.../v00000042.json``) or a store root (its signed LATEST).
    Candidates: the delta chain from ``have_version``; the newest anchor at or below the
    target plus the chain from it. Every manifest is verified before it is parsed, every
    link checked against the next, the first delta against what is held (its fingerprint
    and version, and, when known, ``have_manifests``: the SHA-256 of the manifests that
    produced the held weights). An empty route means the target is what is held. Raises
    BaseMismatchError when no route leads there, DowngradeError for an older target unless
    ``allow_older``. ``deadline`` (``time.monotonic()``) bounds every read of the store.
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
    if have_version is not None and have_fingerprint is not None and tm.version == have_version:
        if fpr.parse(tm.fingerprint) != have_fingerprint:
            raise BaseMismatchError(f"{store.key_uri(key)} is version {tm.version} with another fingerprint than the "
                                    "served one")
        return store, []  # already held: nothing to fetch
    if have_version is not None and tm.version < have_version and not allow_older:
        raise DowngradeError(f"{store.key_uri(key)} is version {tm.version}, older than the served version "
                             f"{have_version}; send \"rollback\": true to go back explicitly")
    candidates = []
    if tm.kind == ANCHOR:
        candidates.append([target])
    elif have_version is not None or have_fingerprint is not None:
        if have_version is None and fpr.parse(tm.base_fingerprint) == have_fingerprint:
            candidates.append([target])
        elif have_version is not None and have_version < tm.version:
            chain = _chain_back(store, target, have_version, read, limits.chain)
            if chain:
                candidates.append(chain)
    if tm.kind != ANCHOR and tm.anchor_version is not None:
        try:
            anchor = read(manifest_key(tm.anchor_version, ANCHOR))
            rest = [] if anchor.manifest.version == tm.version else _chain_back(
                store, target, anchor.manifest.version, read, limits.chain)
            if rest is not None:
                if rest:
                    _check_link(anchor, rest[0], store.uri)
                candidates.append([anchor] + rest)
        except NotFoundError:
            pass
    if not candidates:
        raise BaseMismatchError(
            f"{store.key_uri(key)} applies to version {tm.base_version} (fingerprint {tm.base_fingerprint}); "
            f"held: version {have_version}, fingerprint {fpr.fmt(have_fingerprint) if have_fingerprint is not None else None}; "
            f"no delta chain (of at most {limits.chain} links) or anchor leads there")
    best = min(candidates, key=lambda c: sum(link.manifest.payload_bytes for link in c))
    first = best[0]
    if first.manifest.kind != ANCHOR:
        if have_fingerprint is not None and fpr.parse(first.manifest.base_fingerprint) != have_fingerprint:
            raise BaseMismatchError(f"{store.key_uri(first.key)} applies to fingerprint {first.manifest.base_fingerprint}, "
                                    f"held {fpr.fmt(have_fingerprint)}")
        if have_manifests and first.manifest.format_version >= 2 and not set(first.manifest.base_manifests) & set(have_manifests):
            raise IntegrityError(f"{store.key_uri(first.key)} is not bound to the manifest the served weights came from")
    payload = sum(link.manifest.payload_bytes for link in best)
    if limits.payload_bytes is not None and payload > limits.payload_bytes:
        raise ManifestError(f"the update would fetch {payload} bytes, over the {limits.payload_bytes}-byte limit "
                            "for this model (twice its size)")
    return store, best


def fetch_planned(store: Store, chain: list[Link], workers: int = 8, limits: Limits = Limits()) -> DecodedDelta:
    """Fetch, verify and decode every link of a :func:`plan`, composed into one delta."""
    for link in chain:  # every decode budget checked before the first byte of any blob
        check_decode_budget(link.manifest, limits.decoded_bytes)
    decoded = [_decoded(store, link.manifest, link.key,
                        decode_manifest(link.manifest, fetch_blobs(store, link.manifest, workers), workers,
                                        limit=limits.decoded_bytes))
               for link in chain]
    if len(decoded) == 1:
        return decoded[0]
    by_name: dict[str, list[TensorDelta]] = {}
    for d in decoded:
        for t in d.tensors:
            by_name.setdefault(t.name, []).append(t)
    tensors = [part for parts in by_name.values() for part in compose(parts)]
    first, last = decoded[0], decoded[-1]
    return DecodedDelta(
        kind=first.kind, model=last.model, base_version=first.base_version,
        version=last.version, base_fingerprint=first.base_fingerprint, fingerprint=last.fingerprint,
        tensors=tensors, payload_bytes=sum(d.payload_bytes for d in decoded),
        manifests=[u for d in decoded for u in d.manifests],
        tensor_fingerprints=last.tensor_fingerprints, tensor_base_fingerprints=first.tensor_base_fingerprints)


def resolve(source: str, have_version: int | None = None, have_fingerprint: int | None = None, *,
            expected: dict | None = None, workers: int = 8, trust: Trust | None = None,
            allow_older: bool = True, **store_options) -> DecodedDelta:
    """Everything needed to go from the held version to ``source``'s, composed into one delta
    (:func:`plan`, each manifest checked against ``expected``, then :func:`fetch_planned`)."""
    store, chain = plan(source, have_version, have_fingerprint, trust=trust, allow_older=allow_older, **store_options)
    for link in chain:
        check_expected(link.manifest, expected, store.key_uri(link.key))
    return fetch_planned(store, chain, workers)
