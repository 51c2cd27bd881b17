"""Fetch, verify and decode published versions; resolve chains and anchors.

Nothing is decoded before the manifest validated and each blob's size and SHA-256
matched, and every decoder is bounded by counts the manifest declared (and the
caller's expected tensor shapes, when given), so corrupt, truncated or hostile
input fails fast with an :mod:`engine_ext.errors` exception.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import codec
from . import fingerprint as fpr
from . import settings
from .delta import TensorDelta, compose
from .dtypes import dtype_by_name
from .errors import BaseMismatchError, IntegrityError, ManifestError, NotFoundError
from .format import ANCHOR, LATEST_KEY, MAX_MANIFEST_BYTES, Latest, Manifest, manifest_key
from .store import Store, open_store, split_uri

FETCH_CHUNK = 16 << 20  # blobs above this are fetched as parallel ranges
MAX_CHAIN = 10_000


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


def read_manifest(store: Store, key: str) -> Manifest:
    return Manifest.from_json(store.read(key, max_bytes=MAX_MANIFEST_BYTES))


def read_latest(store: Store) -> Latest:
    return Latest.from_json(store.read(LATEST_KEY, max_bytes=1 << 20))


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


def fetch_blobs(store: Store, m: Manifest, workers: int = 8) -> list[bytes]:
    """Every blob of ``m``, verified by size and SHA-256."""
    def one(b):
        if b.size > FETCH_CHUNK:
            ranges = [(o, min(FETCH_CHUNK, b.size - o)) for o in range(0, b.size, FETCH_CHUNK)]
            data = b"".join(store.read_ranges(b.key, ranges, workers=workers))
        else:
            data = store.read(b.key, max_bytes=b.size)
        if len(data) != b.size:
            raise IntegrityError(f"{store.key_uri(b.key)}: {len(data)} bytes, manifest says {b.size}")
        if hashlib.sha256(data).hexdigest() != b.sha256:
            raise IntegrityError(f"{store.key_uri(b.key)}: SHA-256 mismatch (corrupt blob)")
        return data

    with ThreadPoolExecutor(max(1, min(workers, len(m.blobs)))) as pool:
        return list(pool.map(one, m.blobs))


def fetch_tensor_ranges(store: Store, m: Manifest, names: set[str], workers: int = 8) -> dict[str, bytes]:
    """Only the named tensors' bytes, by byte range (verified per tensor when decoded)."""
    wanted = [t for t in m.tensors if t.nnz and t.name in names]
    def one(t):
        return t.name, store.read_range(m.blobs[t.blob].key, t.offset, t.length)
    with ThreadPoolExecutor(max(1, min(workers, len(wanted) or 1))) as pool:
        return dict(pool.map(one, wanted))


def decode_manifest(m: Manifest, blobs: list[bytes] | dict[str, bytes], workers: int = 8,
                    names: set[str] | None = None) -> list[TensorDelta]:
    """Decode every changed tensor (or those in ``names``) from whole blobs or per-tensor bytes."""
    total = sum(t.nnz * (8 + dtype_by_name(t.dtype).itemsize) for t in m.tensors)
    limit = settings.current().max_decoded_bytes
    if total > limit:
        raise ManifestError(f"decoding would take {total} bytes, over the {limit} limit (ENGINE_EXT_MAX_DECODED_BYTES)")

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
               workers: int = 8, **store_options) -> DecodedDelta:
    """Fetch, verify and decode one published version (delta or anchor).

    With ``names``, only those tensors are fetched (by byte range, each checked against
    its own SHA-256) and decoded: what a rank holding part of the model needs.
    """
    store, key = split_uri(manifest_uri, **store_options)
    m = read_manifest(store, key)
    check_expected(m, expected, manifest_uri)
    data = fetch_blobs(store, m, workers) if names is None else fetch_tensor_ranges(store, m, names, workers)
    return _decoded(store, m, key, decode_manifest(m, data, workers, names))


def _chain_back(store: Store, target: Manifest, target_key: str, stop_version: int,
                read=read_manifest) -> list[tuple[str, Manifest]] | None:
    """Manifests from the one based on ``stop_version`` up to ``target``, or None if no such chain."""
    chain = [(target_key, target)]
    cur = target
    while cur.kind != ANCHOR and cur.base_version != stop_version:
        if cur.base_version < stop_version or len(chain) > MAX_CHAIN:
            return None
        key = manifest_key(cur.base_version)
        try:
            prev = read(store, key)
        except NotFoundError:
            return None
        if prev.fingerprint != cur.base_fingerprint or prev.version != cur.base_version:
            raise IntegrityError(f"{store.key_uri(key)} does not lead to {store.key_uri(chain[0][0])}: fingerprints differ")
        chain.insert(0, (key, prev))
        cur = prev
    if cur.kind == ANCHOR and cur.version != stop_version:
        return None
    return chain


def plan(source: str, have_version: int | None = None, have_fingerprint: int | None = None,
         **store_options) -> tuple[Store, list[tuple[str, Manifest]]]:
    """The manifests to fetch to go from what is held to the target, fewest bytes first.

    ``source`` is a manifest URI (``.../v00000042.json``) or a store root (its LATEST).
    Candidates: the delta chain from ``have_version``; the newest anchor at or below the
    target plus the chain from it. Raises BaseMismatchError when neither leads there.
    """
    if source.endswith(".json"):
        store, key = split_uri(source, **store_options)
    else:
        store = open_store(source, **store_options)
        key = read_latest(store).manifest
    seen: dict[str, Manifest] = {}

    def read(store: Store, key: str) -> Manifest:  # both candidate chains walk the same links: read each once
        if key not in seen:
            seen[key] = read_manifest(store, key)
        return seen[key]

    target = read(store, key)
    candidates = []
    if target.kind == ANCHOR:
        candidates.append([(key, target)])
    elif have_version is not None or have_fingerprint is not None:
        if have_version is None and fpr.parse(target.base_fingerprint) == have_fingerprint:
            candidates.append([(key, target)])
        elif have_version is not None and have_version < target.version:
            chain = _chain_back(store, target, key, have_version, read)
            if chain:
                candidates.append(chain)
    if target.kind != ANCHOR and target.anchor_version is not None:
        akey = manifest_key(target.anchor_version, ANCHOR)
        try:
            anchor = read(store, akey)
            rest = [] if anchor.version == target.version else _chain_back(store, target, key, anchor.version, read)
            if rest is not None:
                candidates.append([(akey, anchor)] + rest)
        except NotFoundError:
            pass
    if not candidates:
        raise BaseMismatchError(
            f"{store.key_uri(key)} applies to version {target.base_version} (fingerprint {target.base_fingerprint}); "
            f"held: version {have_version}, fingerprint {fpr.fmt(have_fingerprint) if have_fingerprint is not None else None}; "
            "no delta chain or anchor leads there")
    best = min(candidates, key=lambda c: sum(m.payload_bytes for _, m in c))
    first = best[0][1]
    if first.kind != ANCHOR and have_fingerprint is not None and fpr.parse(first.base_fingerprint) != have_fingerprint:
        raise BaseMismatchError(f"{store.key_uri(best[0][0])} applies to fingerprint {first.base_fingerprint}, held {fpr.fmt(have_fingerprint)}")
    return store, best


def fetch_planned(store: Store, chain: list[tuple[str, Manifest]], workers: int = 8) -> DecodedDelta:
    """Fetch, verify and decode every manifest of a :func:`plan`, composed into one delta."""
    decoded = [_decoded(store, m, key, decode_manifest(m, fetch_blobs(store, m, workers), workers)) for key, m in chain]
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
            expected: dict | None = None, workers: int = 8, **store_options) -> DecodedDelta:
    """Everything needed to go from the held version to ``source``'s, composed into one delta
    (:func:`plan`, each manifest checked against ``expected``, then :func:`fetch_planned`)."""
    store, chain = plan(source, have_version, have_fingerprint, **store_options)
    for key, m in chain:
        check_expected(m, expected, store.key_uri(key))
    return fetch_planned(store, chain, workers)
