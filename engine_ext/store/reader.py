"""Fetch, verify and decode published versions (routes through them: :mod:`.route`).

Trust comes before use, and every size is bounded before it is spent (TUF's order):

1. a manifest's raw bytes are verified against the trusted keys (:mod:`engine_ext.store.signing`)
   before they are parsed, and ``LATEST`` before it is followed (signed, unexpired, naming
   its manifest by SHA-256);
2. a route (a chain of deltas, or an anchor and a chain) is checked link by link before any
   blob is read (:mod:`.route`);
3. each blob is read into a buffer of its declared size and checked against its
   SHA-256 from the manifest; nothing is decoded before that, and decoding is bounded by
   the declared counts, by the served model's size and by a ratio to the payload (a
   decode bomb is refused before it allocates).

Corrupt, truncated or hostile input fails fast with an :mod:`engine_ext.errors` exception.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from .. import settings
from ..errors import IntegrityError, ManifestError, ModelMismatchError, NotFoundError
from ..format import cell_reads, cells, chunks, tables
from ..format import fingerprint as fpr
from ..format.bulk import collector_paused
from ..format.cells import CELL_RECORD, CODER_INDEX, MODE_INDEX
from ..format.delta import TensorDelta
from ..format.entries import NONE
from ..format.latest import LATEST_KEY, MAX_LATEST_BYTES, Latest
from ..format.manifest import MAX_MANIFEST_BYTES, CellChunks, Manifest, TableRef
from ..format.pieces import PIECES, pieces_sha256
from ..format.tensor_records import TableEntries
from . import Store, split_uri
from .decoding import Bases, decode_parts
from .signing import MAX_SIGNATURE_BYTES, SIG_SUFFIX, SignatureError, Trust, sha256_hex

FETCH_CHUNK = 16 << 20  # blobs above this are fetched as parallel ranges
MAX_DECODE_RATIO = 256  # decoded bytes per payload byte (a real delta stays far below; a bomb does not)
DECODE_SLACK = 16 << 20  # decoded bytes allowed on top of the ratio (tiny tensors, dense flags)


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
    return Link(key, open_manifest(store, raw), sha256_hex(raw), signed)


def open_manifest(store: Store, raw: bytes, workers: int = 8) -> Manifest:
    """A manifest from its (already trusted) bytes, with every tensor entry: a manifest's tensor
    tables (format 7 and 10) and name index (10) are read from its blobs by range, each checked against
    its SHA-256 and count (:func:`engine_ext.format.tables.resolve`). Cell tables are read only for the
    tensors fetched (:func:`load_cells`)."""
    m = Manifest.from_json(raw)
    if not m.resolved:
        _resolve_whole(store, m, workers)
    return m


def _resolve_whole(store: Store, m: Manifest, workers: int) -> int:
    """Read and check every tensor table of ``m`` and its name index; returns the bytes read."""
    refs = [*m.tables, *([m.index] if m.index is not None else [])]
    got, read = _read_ranges(store, m, [(r.blob, r.offset, r.length) for r in refs], workers)
    index = None if m.index is None else bytes(got[(m.index.blob, m.index.offset)])
    tables.resolve(m, [bytes(got[(r.blob, r.offset)]) for r in m.tables], index)
    return read


def open_held(store: Store, raw: bytes, names, workers: int = 8) -> tuple[Manifest, int]:
    """A manifest from its (already trusted) bytes with the entries of ``names`` only (a rank's own
    tensors), and the bytes read for them: a format-10 manifest's name index, then only the tensor
    tables that hold those names (:func:`engine_ext.format.tables.lookup`, :func:`~engine_ext.format.tables.select`).
    The checks over every tensor (fingerprints of the whole model, the served tensor set) are the
    driver's, which reads the whole (:func:`open_manifest`). Other formats are read whole."""
    m = Manifest.from_json(raw)
    if m.resolved:
        return m, 0
    if m.index is None:  # format 7: no index, every table read
        return m, _resolve_whole(store, m, workers)
    got, read = _read_ranges(store, m, [(m.index.blob, m.index.offset, m.index.length)], workers)
    places, found = tables.lookup(m, bytes(got[(m.index.blob, m.index.offset)]), names)
    refs = [m.tables[i] for i in places]
    got, n = _read_ranges(store, m, [(r.blob, r.offset, r.length) for r in refs], workers)
    tables.select(m, places, {i: bytes(got[(r.blob, r.offset)]) for i, r in zip(places, refs)}, names, found)
    return m, read + n


def load_cells(store: Store, m: Manifest, names=None, workers: int = 8) -> int:
    """Read the cell tables (format 7) of the cut tensors in ``names`` (None: all) whose chunks are not
    read yet, and (format 12) the cell sections that hold the cells wanted of those in cell sections (a
    rank of tensor parallelism: its own share's), close ones together
    (:func:`engine_ext.format.cell_reads.set_cells` checks them all). Returns the bytes read. On a rank's own
    manifest (``m.held``), a :data:`Selection` keeps only the chunks of the cells it selects (every record
    read is still checked)."""
    cut = cell_reads.CutTensors.of(m, names, keep=m.held is not None and isinstance(names, dict))
    if not len(cut):
        return 0
    wanted = cell_reads.sections_wanted(cut)
    refs = [r for r in cut.tables if r is not None] + list(wanted.values())
    got, read = _read_ranges(store, m, [(r.blob, r.offset, r.length) for r in refs], workers)
    cell_reads.set_cells(
        m,
        cut,
        [None if r is None else bytes(got[(r.blob, r.offset)]) for r in cut.tables],
        {place: bytes(got[(r.blob, r.offset)]) for place, r in wanted.items()},
    )
    return read


def read_manifest(store: Store, key: str, trust: Trust | None = None) -> Manifest:
    return read_link(store, key, trust).manifest


def read_latest(store: Store, trust: Trust | None = None, allow_expired: bool = False) -> Latest:
    """The LATEST pointer, its signature verified and its expiry checked (a stale pointer is a
    frozen store: refused; ``allow_expired`` only for a publisher resuming its own store)."""
    trust = trust or Trust.from_settings()
    latest, signatures = Latest.from_json(store.read(LATEST_KEY, max_bytes=MAX_LATEST_BYTES))
    if trust.verify(latest.signed_bytes(), signatures, store.key_uri(LATEST_KEY)):
        if latest.expires_unix is None or (latest.expires_unix < time.time() and not allow_expired):
            raise SignatureError(
                f"{store.key_uri(LATEST_KEY)} has expired (the publisher stopped refreshing it, "
                "or an old pointer is being replayed)"
            )
        if latest.sha256 is None:
            raise SignatureError(f"{store.key_uri(LATEST_KEY)} does not name its manifest by SHA-256")
    return latest


def check_expected(m: Manifest, expected: dict | None, where: str) -> None:
    """Refuse (:class:`~engine_ext.errors.ModelMismatchError`: a version of another model, layout
    or dtype) a manifest holding a tensor that ``expected`` {name: (shape, dtype name)} does not,
    or holds with another shape or dtype: checked from the manifest alone, before any blob is
    read. Every tensor that differs is named, with what each side holds."""
    if expected is None:
        return
    m.require_resolved()
    missing, differ, dtype_only = [], [], False
    c = m.columns()  # no entry object made: the driver checks 140 k of them per K2 version
    for name, shape, dtype in zip(c.names, c.shape_tuples(), c.dtype_names()):
        want = expected.get(name)
        if want is None:
            missing.append(name)
        elif tuple(want[0]) != shape or want[1] != dtype:
            differ.append(f"{name!r} is {list(shape)}/{dtype}, the served model has {list(want[0])}/{want[1]}")
            dtype_only |= tuple(want[0]) == shape
    if missing or differ:
        why = ([f"{len(missing)} tensor(s) not in the served model: {missing[:5]}"] if missing else []) + (
            [f"{len(differ)} tensor(s) differ: " + "; ".join(differ[:5])] if differ else []
        )
        hint = " (publish in the served dtype: DeltaPublisher(dtype=...), engine-ext --dtype)" if dtype_only else ""
        raise ModelMismatchError(f"{where}: " + "; ".join(why) + hint)


def fetch_blobs(store: Store, m: Manifest, workers: int = 8) -> list[bytearray]:
    """Every blob of ``m``, read into a buffer of its declared size (ranges in parallel for big
    ones, no joined copy) and verified by size and SHA-256 before anything uses it: flat, or a
    pieces digest (format 8) over its segments, hashed in parallel, whose bounds the manifest's
    byte ranges give (its cell tables are read first, each checked against its own SHA-256)."""
    if any(b.digest == PIECES for b in m.blobs):
        load_cells(store, m, None, workers)
    bounds = [m.segment_bounds(i) if b.digest == PIECES else None for i, b in enumerate(m.blobs)]
    per_blob = max(1, workers // max(1, len(m.blobs)))

    def one(ib):
        i, b = ib
        buf = bytearray(b.size)
        if b.size > FETCH_CHUNK:
            ranges = [(o, min(FETCH_CHUNK, b.size - o)) for o in range(0, b.size, FETCH_CHUNK)]

            def part(r):
                buf[r[0] : r[0] + r[1]] = store.read_range(b.key, r[0], r[1])

            with ThreadPoolExecutor(min(workers, len(ranges))) as pool:
                list(pool.map(part, ranges))
        else:
            data = store.read(b.key, max_bytes=b.size)
            if len(data) != b.size:
                raise IntegrityError(f"{store.key_uri(b.key)}: {len(data)} bytes, manifest says {b.size}")
            buf[:] = data
        got = hashlib.sha256(buf).hexdigest() if bounds[i] is None else pieces_sha256(buf, bounds[i], per_blob)
        if got != b.sha256:
            raise IntegrityError(f"{store.key_uri(b.key)}: SHA-256 mismatch (corrupt blob)")
        return buf

    with ThreadPoolExecutor(max(1, min(workers, len(m.blobs)))) as pool:
        return list(pool.map(one, enumerate(m.blobs)))


Selection = dict  # tensor name -> the grid cells wanted (a set), or None for the whole tensor
GAP = 64 << 10  # ranges of one blob closer than this are fetched as one (if at most 1/8 of it is read in vain)


Boxes = tuple  # what a reader holds of a tensor: ((start, stop), ...) boxes; () none of it


def select_cells(m: Manifest, held: Mapping[str, Boxes | None]) -> tuple[Selection, list[str]]:
    """What of ``m``'s changed tensors a reader holding ``held`` {name: its boxes, or None for the whole
    tensor} needs: a :data:`Selection` {name: the grid cells that meet its boxes (a frozenset, maybe empty: it
    holds the tensor but none of its changes), or None for every cell (not cut, held whole, or a box of
    every element)}, a tensor held none of (``()``) left out; and the changed tensors ``held`` does not name.
    Over the manifest's columns, with no entry object made: a TP rank of K2 selects from 140 k tensors per
    version, whose cells are found once per distinct (grid, shape, boxes object: ``held``'s values are alive
    meanwhile, and a reader's equal box lists are best one object)."""
    c = m.columns()
    grid, shape = c.grid.tolist(), c.shape.tolist()
    out: Selection = {}
    unknown: list[str] = []
    memo: dict = {}
    by_content: dict = {}
    for i in np.flatnonzero(c.nnz).tolist():
        name = c.names[i]
        if name not in held:
            unknown.append(name)
            continue
        boxes = held[name]
        if boxes is None or (boxes and grid[i] == NONE):
            out[name] = None
        elif boxes:
            key = (grid[i], shape[i], id(boxes))  # a rank's box lists are shared objects (RankUpdater.boxes)
            got = memo.get(key, _UNKNOWN)
            if got is _UNKNOWN:
                got = memo[key] = _meeting(c, grid[i], shape[i], boxes, by_content)
            out[name] = got
    return out, unknown


def _meeting(c, grid: int, shape: int, boxes: Boxes, memo: dict) -> frozenset | None:
    """The cells of grid ``grid`` over shape ``shape`` (codes in columns ``c``) that meet ``boxes``, or None for
    every cell (a box of every element); once per distinct content."""
    key = (grid, shape, boxes)
    got = memo.get(key, _UNKNOWN)
    if got is _UNKNOWN:
        size, cuts = tuple(c.shapes[shape]), c.grids[grid]
        every = any(tuple(a) == (0,) * len(size) and tuple(z) == size for a, z in boxes)
        got = memo[key] = (
            None if every else frozenset().union(*(chunks.cells_meeting(cuts, size, a, z) for a, z in boxes))
        )
    return got


_UNKNOWN = object()


class Plan(NamedTuple):
    """The parts a reader fetches, as arrays in the manifest's order (a cut tensor's in cell order): where each
    one's bytes lie, their SHA-256 and how they decode. Fetching needs no object per part; the decode makes a
    :class:`_Part` per part of a tensor as it decodes it. A K2 TP rank fetches 141,000 parts per version (as
    objects, made before the fetch, they were 0.1 s per 16 layers)."""

    rows: np.ndarray  # int64: the part's tensor's place in the manifest's tensors
    cells: np.ndarray  # int64: its cell of the tensor's grid; -1: the whole tensor
    records: np.ndarray  # CELL_RECORD: blob, offset, segment lengths, coder and mode codes, SHA-256, nnz

    def __len__(self) -> int:
        return len(self.rows)

    def ranges(self) -> list[tuple[int, int, int]]:
        """(blob, offset, length) of each part."""
        r = self.records
        length = r["positions_length"] + r["values_length"]
        return list(zip(r["blob"].tolist(), r["offset"].tolist(), length.tolist()))

    def digests(self) -> dict[tuple[int, int], tuple[bytes, int]]:
        """{(blob, offset): (the part's SHA-256, its tensor's row)}."""
        r = self.records
        return dict(zip(zip(r["blob"].tolist(), r["offset"].tolist()), zip(r["sha256"].tolist(), self.rows.tolist())))


@collector_paused()
def plan(m: Manifest, selection: Selection | None) -> Plan:
    """The parts of the changed tensors in ``selection`` (None: all; a cut tensor's cells: those selected),
    from the manifest's columns and each cut tensor's cell records (read by :func:`load_cells`; inline chunks:
    made records here), as arrays, with no entry object made."""
    m.require_resolved()
    c = m.columns()
    rows = np.flatnonzero(c.nnz)
    if selection is not None:
        rows = rows[np.fromiter((c.names[i] in selection for i in rows.tolist()), bool, len(rows))]
    cut = c.grid[rows] != NONE
    whole, cut_rows = rows[~cut], rows[cut]
    rec = np.zeros(len(whole), CELL_RECORD)
    for f, col in (("blob", c.blob), ("offset", c.offset), ("positions_length", c.plen), ("values_length", c.vlen)):
        rec[f] = col[whole]
    rec["sha256"], rec["nnz"] = c.sha[whole], c.nnz[whole]
    for f, col, vocab, index in (
        ("positions_coder", c.pcoder, c.pcoders, CODER_INDEX),
        ("values_coder", c.vcoder, c.vcoders, CODER_INDEX),
        ("mode", c.mode, c.modes, MODE_INDEX),
    ):
        rec[f] = np.array([index[v] for v in vocab] or [0], np.int64)[col[whole]]
    parts_rows, parts_cells, parts_rec = [whole], [np.full(len(whole), -1, np.int64)], [rec]
    read = m.tensors.read_chunks if isinstance(m.tensors, TableEntries) else {}
    spans: dict[int, list] = {}  # id of a records array -> [array, rows, starts, stops]
    for i in cut_rows.tolist():
        got = read.get(i)  # read from its table (maybe no record kept: empty), else inline or not read
        arr, start, stop = _cell_records(c.names[i], c.chunk_lists[i] if got is None else got)
        one = spans.setdefault(id(arr), [arr, [], [], []])
        one[1].append(i)
        one[2].append(start)
        one[3].append(stop)
    for arr, owners, starts, stops in spans.values():
        n = np.array(stops, np.int64) - starts
        at = np.repeat(np.array(starts, np.int64) - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        parts_rows.append(np.repeat(np.array(owners, np.int64), n))
        parts_cells.append(arr["cell"][at].astype(np.int64))
        parts_rec.append(arr[at])
    rows_, cells_, rec = np.concatenate(parts_rows), np.concatenate(parts_cells), np.concatenate(parts_rec)
    if selection is not None:  # cut tensors' cells not selected left out, per distinct cell set (shared sets)
        sets, code = cell_reads.set_codes([selection[c.names[i]] for i in cut_rows.tolist()])
        of_row = np.full(len(c), -1, np.int64)
        of_row[cut_rows] = code
        keep = cell_reads.in_sets(sets, np.where(cells_ >= 0, of_row[rows_], -1), cells_)
        rows_, cells_, rec = rows_[keep], cells_[keep], rec[keep]
    order = np.lexsort((cells_, rows_))
    return Plan(rows_[order], cells_[order], rec[order])


def _cell_records(name: str, chunks_: CellChunks | list | None) -> tuple[np.ndarray, int, int]:
    """A cut tensor's chunks as (a records array, its first row, the row after its last): read from a table
    (:class:`CellChunks`), or inline (format 3: made records here, checked as the manifest's were)."""
    if chunks_ is None:
        raise ManifestError(f"tensor {name!r}: its cell table was not read (load_cells)")
    if isinstance(chunks_, CellChunks):
        return chunks_.span
    rec = cells.records(sorted(chunks_, key=_cell), lambda j: f"tensor {name!r} chunk {j}")
    return rec, 0, len(rec)


_cell = attrgetter("cell")


def fetch_selected(
    store: Store, m: Manifest, selection: Selection | None = None, workers: int = 8, bases: Bases | None = None
) -> tuple[list[TensorDelta], int]:
    """Fetch, verify and decode the selected tensors (or cells of them) by byte ranges: close
    ranges of a blob are read together; every part is checked against its SHA-256 from the
    manifest before it is decoded. Returns the decoded tensors and the bytes read."""
    cell_bytes = load_cells(store, m, selection, workers)
    parts = plan(m, selection)
    digests = parts.digests()

    def check(key, piece):
        sha, row = digests[key]
        if hashlib.sha256(piece).digest() != sha:
            raise IntegrityError(f"tensor {m.columns().names[row]!r}: SHA-256 mismatch")

    data, read = _read_ranges(store, m, parts.ranges(), workers, check)
    return decode_parts(m, parts, data.__getitem__, workers, bases), read + cell_bytes


@collector_paused()  # a part is a few objects; a collector's pass over a rank's manifest took 0.2 s at 8 K2 layers
def _read_ranges(
    store: Store, m: Manifest, ranges: list[tuple[int, int, int]], workers: int = 8, check=None
) -> tuple[dict[tuple[int, int], memoryview], int]:
    """The bytes of each (blob, offset, length) of ``m``, keyed by (blob, offset), and the bytes read:
    close ranges of a blob are read as one request, in parallel; ``check(key, bytes)`` runs on each as
    it arrives (in the reading thread)."""
    by_blob: dict[int, list[tuple[int, int]]] = {}
    for b, offset, length in ranges:
        by_blob.setdefault(b, []).append((offset, length))
    spans = []  # (blob, start, end, [(offset, length)])
    for b, rs in by_blob.items():
        rs.sort()
        cur, useful, wasted = [rs[0]], rs[0][1], 0
        for r in rs[1:]:
            gap = r[0] - (cur[-1][0] + cur[-1][1])
            if gap <= GAP and 8 * (wasted + gap) <= useful + r[1]:  # at most 1/8 read in vain, one request less
                cur.append(r)
                useful, wasted = useful + r[1], wasted + gap
            else:
                spans.append((b, cur[0][0], cur[-1][0] + cur[-1][1], cur))
                cur, useful, wasted = [r], r[1], 0
        spans.append((b, cur[0][0], cur[-1][0] + cur[-1][1], cur))
    data: dict[tuple[int, int], memoryview] = {}

    def one(span):
        b, start, end, rs = span
        raw = memoryview(store.read_range(m.blobs[b].key, start, end - start))
        if len(raw) != end - start:
            raise IntegrityError(
                f"{store.key_uri(m.blobs[b].key)}: {len(raw)} bytes at {start}, asked for {end - start}"
            )
        for offset, length in rs:
            piece = raw[offset - start : offset - start + length]
            if check is not None:
                check((b, offset), piece)
            data[(b, offset)] = piece

    with ThreadPoolExecutor(max(1, min(workers, len(spans) or 1))) as pool:
        list(pool.map(one, spans))
    return data, sum(end - start for _, start, end, _ in spans)


def check_decode_budget(m: Manifest, limit: int | None = None) -> None:
    """Refuse, from the manifest alone, a decode that would take more than ``limit`` bytes (default
    ``ENGINE_EXT_MAX_DECODED_BYTES``) or far more than the payload could honestly expand to."""
    m.require_resolved()
    c = m.columns()
    total = int((c.nnz * (8 + c.itemsizes())).sum())
    limit = settings.current().max_decoded_bytes if limit is None else limit
    if total > limit:
        raise ManifestError(f"decoding would take {total} bytes, over the {limit}-byte limit for this model")
    if total > MAX_DECODE_RATIO * m.payload_bytes + DECODE_SLACK:
        raise ManifestError(
            f"decoding would take {total} bytes from a {m.payload_bytes}-byte payload "
            f"(over {MAX_DECODE_RATIO}x: a decode bomb)"
        )


def decode_manifest(
    m: Manifest, blobs: list, workers: int = 8, limit: int | None = None, bases: Bases | None = None
) -> list[TensorDelta]:
    """Decode every changed tensor from whole (verified) blobs."""
    check_decode_budget(m, limit)

    def table(r: TableRef) -> bytes:
        return bytes(memoryview(blobs[r.blob])[r.offset : r.offset + r.length])

    cut = cell_reads.CutTensors.of(m)
    sections = {place: table(r) for place, r in cell_reads.sections_wanted(cut).items()}
    cell_reads.set_cells(m, cut, [None if r is None else table(r) for r in cut.tables], sections)
    parts = plan(m, None)
    digests = parts.digests()
    lengths = {(b, o): n for b, o, n in parts.ranges()}

    def data_of(key):
        b, offset = key
        piece = memoryview(blobs[b])[offset : offset + lengths[key]]
        sha, row = digests[key]
        if hashlib.sha256(piece).digest() != sha:
            raise IntegrityError(f"tensor {m.columns().names[row]!r}: SHA-256 mismatch")
        return piece

    return decode_parts(m, parts, data_of, workers, bases)


def _decoded(store: Store, m: Manifest, key: str, tensors: list[TensorDelta]) -> DecodedDelta:
    return DecodedDelta(
        kind=m.kind,
        model=m.model,
        base_version=m.base_version,
        version=m.version,
        base_fingerprint=fpr.parse(m.base_fingerprint) if m.base_fingerprint else None,
        fingerprint=fpr.parse(m.fingerprint),
        tensors=tensors,
        payload_bytes=m.payload_bytes,
        manifests=[store.key_uri(key)],
        tensor_fingerprints={t.name: fpr.parse(t.fingerprint) for t in m.tensors},
        tensor_base_fingerprints={t.name: fpr.parse(t.base_fingerprint) for t in m.tensors if t.base_fingerprint},
    )


def load_delta(
    manifest_uri: str,
    *,
    expected: dict | None = None,
    names: set[str] | None = None,
    workers: int = 8,
    trust: Trust | None = None,
    bases: Bases | None = None,
    **store_options,
) -> DecodedDelta:
    """Fetch, verify and decode one published version (delta or anchor).

    With ``names``, only those tensors are fetched (by byte range, each checked against
    its own SHA-256) and decoded: what a rank holding part of the model needs.
    """
    store, key = split_uri(manifest_uri, **store_options)
    m = read_manifest(store, key, trust)
    check_expected(m, expected, manifest_uri)
    check_decode_budget(m)
    if names is None:
        return _decoded(store, m, key, decode_manifest(m, fetch_blobs(store, m, workers), workers, bases=bases))
    return _decoded(store, m, key, fetch_selected(store, m, {n: None for n in names}, workers, bases)[0])
