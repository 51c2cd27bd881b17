"""Tables: a manifest's tensor entries and cut tensors' chunk lists in a blob (docs/FORMAT.md, "Tables").

A model of very many tensors (a 1T MoE: ~140,000 tensors, over a million grid cells) would
list ~450 MB inline; in tables its signed manifest stays small. A cell table is one fixed
little-endian record per chunk (:data:`CELL_RECORD`, 75 bytes against ~220 in JSON), read
only by the ranks that fetch the tensor. Tensor tables were compact JSON arrays of the inline
entries, which every reader read and parsed (format 7: 6.6 s of one core at Kimi-K2 size).
Format 10 writes them as fixed binary records (:mod:`engine_ext.format.tensor_records`) of at most
:data:`PER_TABLE` tensors each, names and shapes beside them, behind a *name index*
(:data:`INDEX_RECORD`: each name's 64-bit key, sorted, and where its record lies): a rank
looks its own names up and reads only the tables that hold them (:func:`lookup`,
:func:`select`); a reader of the whole (the driver, once per version) reads all and checks
that the index is exactly the one its entries give (:func:`resolve`). Each table is a byte
range of a blob named by a :class:`~engine_ext.format.manifest.TableRef` and checked against
its SHA-256 and count before it is parsed; the entries are then checked as inline ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable

import numpy as np

from ..errors import ManifestError
from . import cells, entries
from . import fingerprint as fpr
from .bulk import LastKept
from .bulk import collector_paused as _collector_paused
from .cells import CELL_RECORD
from .manifest import (
    CELL_RECORD_BYTES,
    CELL_SECTIONS,
    INDEX_RECORD_BYTES,
    MAX_TENSOR_TABLES,
    REQUIRED_TENSOR_FIELDS,
    CellSections,
    Manifest,
    TableRef,
    TensorEntry,
    parse_checked,
    tensor_from_json,
)
from .tensor_records import (
    SECTION_RECORD,
    read_tensor_tables,
    sections_trailer,
    table_bytes,
    tensor_records,
    verify_table,
)

assert CELL_RECORD.itemsize == CELL_RECORD_BYTES  # what the manifest's checks count with

INDEX_RECORD = np.dtype([("key", "<u8"), ("table", "<u2"), ("row", "<u2")])  # sorted by key, table, row
assert INDEX_RECORD.itemsize == INDEX_RECORD_BYTES
PER_TABLE = 64  # tensors per table: what a rank reads in vain around its own (~10 KB at K2 names)


def tabulate(
    m: Manifest,
    put: Callable[[bytes], tuple[int, int]],
    per_table: int | None = None,
    binary: bool = True,
    records: np.ndarray | None = None,
    name_keys: np.ndarray | None = None,
    columns: entries.Columns | None = None,
    shares: int = 0,
    dims: list[int | None] | None = None,
) -> Manifest:
    """A (finished, validated) manifest in tables: every cut tensor's chunks in a cell table, then the
    tensor entries in tables of ``per_table`` (default: :data:`PER_TABLE`, more where the tables would
    exceed MAX_TENSOR_TABLES) and their name index (format 10; ``binary=False``: JSON tables, format 7, no
    index, kept for tests of old readers), each handed to ``put(bytes) -> (blob, offset)`` (which
    appends it to a blob the returned manifest lists). ``records``: the cell records of ``m``'s chunks, as
    its ``validate()`` returned them (else made here); ``name_keys``: its tensors' name keys, in order (else
    made here); ``columns``: its entries' columns, as its validation made them (else made here). ``shares``
    and ``dims`` (binary only): cell sections for the readers of ``shares``-way tensor parallelism, format 12
    (:func:`binary_tables`; format 10 where ``dims`` names no cut tensor). ``m`` is unchanged."""
    ref = _writer(put)
    if dims is None or not any(d is not None and t.chunks is not None for d, t in zip(dims, m.tensors)):
        shares = 0
    per = per_table or (max(PER_TABLE, -(-len(m.tensors) // MAX_TENSOR_TABLES)) if binary else 4096)
    starts = range(0, len(m.tensors), per)
    if binary:
        tables = binary_tables(m.tensors, put, per, records, columns, shares, dims)
        keys = fpr.name_keys([t.name for t in m.tensors]) if name_keys is None else name_keys
        index = ref(index_records(keys, [r.count for r in tables]), len(m.tensors))
    else:
        table_refs = _cell_tables(m.tensors, ref, records)[0]
        rows = [_json_row(t, c) for t, c in zip(m.tensors, table_refs)]
        tables, index = (
            [
                ref(json.dumps(rows[i : i + per], separators=(",", ":")).encode(), len(rows[i : i + per]))
                for i in starts
            ],
            None,
        )
    out = dataclasses.replace(m, tensors=[], tables=tables, index=index)
    # binary: 10, the newest, whatever m holds (no scan of its million chunks for ctx-rans); JSON: 7, or 8
    # with a pieces digest, 9 with ctx-rans
    out.format_version = out.lowest_version() if binary else max(m.lowest_version(), out.lowest_version())
    if binary and shares >= 2:
        out.format_version = CELL_SECTIONS
    return out


def _writer(put: Callable[[bytes], tuple[int, int]]) -> Callable[[bytes, int], TableRef]:
    """``ref(raw, count)``: ``raw`` handed to ``put`` and referenced where it landed, with its SHA-256."""

    def ref(raw: bytes, count: int) -> TableRef:
        blob, offset = put(raw)
        return TableRef(blob, offset, len(raw), hashlib.sha256(raw).hexdigest(), count)

    return ref


def _cell_tables(
    tensors: list[TensorEntry],
    ref: Callable[[bytes, int], TableRef],
    records: np.ndarray | None,
    shared: list[bool] | None = None,
) -> tuple[list[TableRef | CellSections | None], np.ndarray, list[int], list[int]]:
    """Every cut tensor's chunks as a cell table (``records``: all of theirs, in order, as validation made
    them; else made here), but those ``shared`` out into cell sections (:func:`_cell_sections`); a tensor
    already in a cell table keeps its reference, the others get None. Returns the references, the records,
    the cut tensors' places and where each one's records begin (and the last end)."""
    cut = [i for i, t in enumerate(tensors) if t.chunks is not None]
    if records is None:
        records = cells.records([c for i in cut for c in tensors[i].chunks], lambda i: f"chunk {i}")
    raw = records.tobytes()  # every record at once, then each tensor's range
    at = np.cumsum([0] + [len(tensors[i].chunks) for i in cut]).tolist()
    out: list[TableRef | CellSections | None] = [t.cells for t in tensors]
    size = CELL_RECORD.itemsize
    for i, a, b in zip(cut, at, at[1:]):
        if not (shared and shared[i]):
            out[i] = ref(raw[a * size : b * size], b - a)
    return out, records, cut, at


def _cell_sections(
    tensors: list[TensorEntry],
    records: np.ndarray,
    cut: list[int],
    at: list[int],
    dims: list[int | None],
    per_table: int,
    shares: int,
    ref: Callable[[bytes, int], TableRef],
) -> dict[int, list[TableRef]]:
    """The chunks of the cut tensors ``dims`` gives a dimension for, in cell sections (format 12): each
    chunk, as a SECTION_RECORD (its tensor's row in its table first), in the section of its table and of the
    share its cell starts in along that dimension; share 1's sections of every table first, then share 2's
    (a rank of tensor parallelism reads one range), each sorted by row and cell. Returns each table's
    references, share 1 first (a share with no record: count 0)."""
    mine = [(i, a, b) for i, a, b in zip(cut, at, at[1:]) if dims[i] is not None]
    if not mine:
        return {}
    lengths = np.array([b - a for _, a, b in mine], np.int64)
    idx = np.repeat(np.array([a for _, a, _ in mine], np.int64) - np.cumsum(lengths) + lengths, lengths)
    idx += np.arange(len(idx))
    owner = np.repeat(np.array([i for i, _, _ in mine], np.int64), lengths)
    owners = cells.Owners.of_entries([tensors[i] for i, _, _ in mine])
    dim = np.array([dims[i] for i, _, _ in mine], np.int64)
    share = owners.cell_shares(
        dim,
        np.full(len(mine), shares, np.int64),
        np.repeat(np.arange(len(mine)), lengths),
        records["cell"][idx].astype(np.int64),
    )
    sec = np.zeros(len(idx), SECTION_RECORD)
    sec["row"] = owner % per_table
    for f in CELL_RECORD.names:
        sec[f] = records[f][idx]
    table = owner // per_table
    order = np.lexsort((sec["cell"], sec["row"], table, share))
    sec, table, share = sec[order], table[order], share[order]
    raw, size = sec.tobytes(), SECTION_RECORD.itemsize
    empty = TableRef(0, 0, 0, "0" * 64, 0)
    out = {int(tb): [empty] * shares for tb in np.unique(table).tolist()}
    group = share * (int(table.max()) + 1) + table
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]).tolist()
    for a, b in zip(starts, starts[1:] + [len(sec)]):
        out[int(table[a])][int(share[a]) - 1] = ref(raw[a * size : b * size], b - a)
    return out


def binary_tables(
    tensors: list[TensorEntry],
    put: Callable[[bytes], tuple[int, int]],
    per_table: int = PER_TABLE,
    records: np.ndarray | None = None,
    columns: entries.Columns | None = None,
    shares: int = 0,
    dims: list[int | None] | None = None,
) -> list[TableRef]:
    """``tensors`` (validated) as format-10 tables handed to ``put(bytes) -> (blob, offset)``: their cell
    tables (``records``: as for :func:`tabulate`), then tensor tables of ``per_table`` tensors each, in
    order (``columns``: theirs, as validation made them; else made here). Without their name index: the
    caller writes it over every table of the version (:func:`index_records`), as a sharded version's rank 0
    does over its ranks' tables. ``shares`` of 2 or more: format 12's; the chunks of each cut tensor that
    ``dims`` gives a dimension for (the one the engines shard it along) go into cell sections
    (:func:`_cell_sections`) instead of a cell table of its own, and every table ends in its sections'
    references (none: no sections)."""
    ref = _writer(put)
    sectioned = shares >= 2 and dims is not None
    shared = [sectioned and dims[i] is not None and t.chunks is not None for i, t in enumerate(tensors)]
    cell_refs, records, cut, at = _cell_tables(tensors, ref, records, shared)
    sections = _cell_sections(tensors, records, cut, at, dims, per_table, shares, ref) if sectioned else {}
    for i in np.flatnonzero(shared).tolist():
        dim = dims[i]
        cell_refs[i] = CellSections((), -1, -1, dim, len(tensors[i].chunks))
    c = entries.Columns.of_entries(tensors) if columns is None else columns
    rec = tensor_records(c, cell_refs)
    out = []
    for number, a in enumerate(range(0, len(c), per_table)):
        b = min(a + per_table, len(c))
        trailer = sections_trailer(sections.get(number, [])) if sectioned else b""
        out.append(ref(table_bytes(c, rec, a, b, trailer), b - a))
    return out


def _json_row(t: TensorEntry, cells: TableRef | None) -> dict:
    """A tensor entry as a format-7 JSON table row (``asdict`` without its deep copies), defaults left out."""

    def row(x) -> dict:
        return dict(vars(x), positions=vars(x.positions), values=vars(x.values))

    r = row(t)
    if cells is not None:
        r["chunks"], r["cells"] = None, vars(cells)
    default = row(TensorEntry("", "", [], 0, ""))
    return {k: v for k, v in r.items() if k in REQUIRED_TENSOR_FIELDS or v != default[k]}


def name_index(groups: list[list[str]]) -> bytes:
    """The name index of tensor tables holding ``groups`` of names (in table order): see :func:`index_records`."""
    return index_records(fpr.name_keys([n for g in groups for n in g]), [len(g) for g in groups])


def index_records(keys: np.ndarray, counts: list[int]) -> bytes:
    """The name index of tensor tables of ``counts`` tensors each (in table order) whose names have
    ``keys`` (uint64, in table then row order): one :data:`INDEX_RECORD` per tensor, sorted by (key,
    table, row), a name's key being its 64-bit :func:`~engine_ext.format.fingerprint.name_key`."""
    counts_ = np.asarray(counts, np.int64)
    if len(keys) != int(counts_.sum()):
        raise ValueError(f"{len(keys)} name keys for tables of {int(counts_.sum())} tensors")
    table = np.repeat(np.arange(len(counts_)), counts_)
    row = np.arange(len(keys)) - np.repeat(np.cumsum(counts_) - counts_, counts_)
    order = np.lexsort((row, table, keys))
    rec = np.zeros(len(keys), INDEX_RECORD)
    rec["key"], rec["table"], rec["row"] = keys[order], table[order], row[order]
    return rec.tobytes()


def lookup(m: Manifest, raw: bytes, names) -> tuple[dict[int, list[int]], frozenset]:
    """Where the name index (its bytes checked against the manifest's reference) places ``names``:
    ({tensor table: [rows]}, the names it places). Names it does not hold are tensors this version
    does not list."""
    verify_table(m.index, raw, "the name index")
    idx = np.frombuffer(raw, INDEX_RECORD)
    keys, table, row = idx["key"], idx["table"].astype(np.int64), idx["row"].astype(np.int64)
    counts = np.array([r.count for r in m.tables], np.int64)
    if (
        (keys[1:] < keys[:-1]).any()
        or (table >= len(counts)).any()
        or (row >= counts[np.minimum(table, len(counts) - 1)]).any()
    ):
        raise ManifestError("the name index is not sorted, or places a name beyond its tables")
    names = frozenset(names)
    by_key, want = _held_keys(names)
    lo, hi = np.searchsorted(keys, want, "left"), np.searchsorted(keys, want, "right")
    present = hi > lo
    # every index record of a wanted key (a key two names share has a record each), as arrays: a TP rank's
    # 140 k names at once
    n = hi[present] - lo[present]
    hits = np.repeat(lo[present] - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    place = np.unique(table[hits] * (1 << 16) + row[hits])  # sorted by table, then row; each once
    tables_at, firsts = np.unique(place >> 16, return_index=True)
    rows = np.split(place & 0xFFFF, firsts[1:])
    out = {int(t): r.tolist() for t, r in zip(tables_at.tolist(), rows)}
    found = names if present.all() else frozenset(by_key[k] for k in want[present].tolist())
    return out, found


_HELD = LastKept()  # the last lookup's names -> ({key: name}, the keys sorted)


def _held_keys(names: frozenset) -> tuple[dict[int, str], np.ndarray]:
    """Each name by its key, and the keys sorted: kept from the last lookup of the same names, since a rank
    looks up the same names every version (a TP rank of K2: 140 k of them, 0.37 s of SHA-256s)."""
    kept = _HELD.get(names)
    if kept is not None:
        return kept
    by_key = {fpr.name_key(n): n for n in names}
    want = np.array(sorted(by_key), np.uint64)
    want.flags.writeable = False
    _HELD.put(names, (by_key, want))
    return by_key, want


def select(m: Manifest, places: dict[int, list[int]], tables: dict[int, bytes], names, found: frozenset) -> None:
    """Take a format-10 manifest's entries of ``names`` only (a rank's own) from the tables the index
    placed them in (``places``, ``found``: :func:`lookup`), each table checked as :func:`read_tensor_tables`
    does and each entry as inline ones; the manifest is then partial (``m.held``): checks over every tensor
    refuse it. A name the index placed on a record of another name is refused (the index and its tables
    disagree)."""
    names = frozenset(names)
    with _collector_paused():
        order = list(places)
        got = parse_checked(
            lambda: read_tensor_tables(
                [m.tables[i] for i in order],
                [tables[i] for i in order],
                order,
                [places[i] for i in order],
                names,
                m.format_version >= CELL_SECTIONS,
            )
        )
        if missed := found - set(got.columns.names):
            raise ManifestError(f"the name index places {sorted(missed)[:3]} on records of other names")
        m.tensors, m.held = got, names
        try:
            parse_checked(m.validate)
        except ManifestError:
            m.tensors, m.held = [], None
            raise


def resolve(m: Manifest, tables: list[bytes], index: bytes | None = None) -> None:
    """Take a manifest's tensor entries from the bytes of its tensor tables (in the order of
    ``m.tables``), each checked against its SHA-256 and count (format 10: and its name ``index``,
    which must be exactly the one these tables give), then validate the whole as inline."""
    if m.resolved:
        return
    if len(tables) != len(m.tables):
        raise ManifestError(f"{len(tables)} tensor tables given, the manifest lists {len(m.tables)}")
    with _collector_paused():
        _resolve(m, tables, index)


def _resolve(m: Manifest, tables: list[bytes], index: bytes | None) -> None:
    keys = None
    if m.index is None:  # format 7: JSON tables
        tensors = []
        for i, (ref, raw) in enumerate(zip(m.tables, tables)):
            tensors += parse_checked(lambda: [tensor_from_json(t) for t in read_table(ref, raw, f"tensor table {i}")])  # noqa: B023 - called at once
    else:
        if index is None:
            raise ManifestError("a format-10 manifest's name index was not given")
        sectioned = m.format_version >= CELL_SECTIONS
        tensors = parse_checked(
            lambda: read_tensor_tables(m.tables, tables, list(range(len(tables))), None, None, sectioned)
        )
        verify_table(m.index, index, "the name index")
        keys = tensors.name_keys()  # once: the index, then the fingerprints
        if index != index_records(keys, [r.count for r in m.tables]):
            raise ManifestError("the name index is not the one its tensor tables give")
    m.tensors = tensors
    try:
        parse_checked(lambda: m.validate(keys))
    except ManifestError:
        m.tensors = []
        raise


def read_table(ref: TableRef, raw: bytes, where: str) -> list:
    """A table's entries: its bytes checked against its length and SHA-256, then a JSON array of
    ``count`` objects."""
    verify_table(ref, raw, where)
    try:
        rows = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON: {str(e)[:200]}") from None
    if not isinstance(rows, list) or len(rows) != ref.count or not all(isinstance(r, dict) for r in rows):
        raise ManifestError(f"{where}: not a list of {ref.count} objects")
    return rows
