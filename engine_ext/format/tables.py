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
from typing import NamedTuple

import numpy as np

from ..errors import ManifestError
from . import cells, entries
from . import fingerprint as fpr
from .bulk import LastKept
from .bulk import collector_paused as _collector_paused
from .cells import CELL_RECORD
from .chunks import cell_shares
from .manifest import (
    CELL_RECORD_BYTES,
    CELL_SECTIONS,
    INDEX_RECORD_BYTES,
    MAX_SHARES,
    MAX_TENSOR_TABLES,
    REQUIRED_TENSOR_FIELDS,
    CellChunks,
    CellSections,
    Manifest,
    TableRef,
    TensorEntry,
    parse_checked,
    tensor_from_json,
)
from .tensor_records import (
    SECTION_PLACE,
    SECTION_RECORD,
    TableEntries,
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


class SectionTable(NamedTuple):
    """The cell sections (format 12) of the tensor tables read, as one :data:`SECTION_PLACE` array (a share with
    no record left out), looked up by (table, share) as arrays: a TP rank of K2 reads 2,200 tables of 8
    shares and uses one or two shares of each (a reference object per section took 0.1 s)."""

    places: np.ndarray  # SECTION_PLACE, sorted by (table, share)
    keys: np.ndarray  # each one's (table, share) as one sorted key

    @classmethod
    def of(cls, places: np.ndarray) -> SectionTable:
        places = places[np.lexsort((places["share"], places["table"]))]
        return cls(places, places["table"] * (MAX_SHARES + 1) + places["share"])

    @classmethod
    def of_refs(cls, refs: dict[int, tuple[TableRef, ...]]) -> SectionTable:
        """From each table's section references (entry objects' CellSections), share 1 first."""
        rows = [
            (tb, k, len(rs), r.blob, r.offset, r.count, bytes.fromhex(r.sha256))
            for tb, rs in refs.items()
            for k, r in enumerate(rs, 1)
            if r.count
        ]
        return cls.of(np.array(rows, SECTION_PLACE))

    def shares(self, tables: np.ndarray) -> np.ndarray:
        """How many shares each of ``tables`` (places in the manifest) is cut for (0: no section with records)."""
        out = np.zeros(int(max(self.places["table"].max(initial=-1), tables.max(initial=-1))) + 1, np.int64)
        out[self.places["table"]] = self.places["shares"]
        return out[tables]

    def ref(self, table: int, share: int) -> TableRef | None:
        """Section ``share`` of ``table``, or None where it holds no record."""
        want = table * (MAX_SHARES + 1) + share
        at = int(np.searchsorted(self.keys, want))
        if at == len(self.keys) or self.keys[at] != want:
            return None
        p = self.places[at]
        n = int(p["count"])
        return TableRef(int(p["blob"]), int(p["offset"]), n * SECTION_RECORD.itemsize, p["sha256"].tobytes().hex(), n)

    def read_whole(self, read) -> np.ndarray:
        """Per table (by its place), whether every section of it with records is among ``read`` {(table, share)}."""
        tables, shares = self.places["table"].tolist(), self.places["share"].tolist()
        got = np.fromiter(((t, k) in read for t, k in zip(tables, shares)), bool, len(tables))
        out = np.ones(int(self.places["table"].max(initial=-1)) + 1, bool)
        np.logical_and.at(out, self.places["table"], got)
        return out


@dataclasses.dataclass(frozen=True)
class CutTensors:
    """Cut tensors whose chunks are still in their cell tables or cell sections, as columns: what
    :func:`set_cells` reads. Made from a manifest's columns (:meth:`of`): a tensor-parallel rank of Kimi-K2
    reads its share of 140 k tensors' chunks per version, with no entry object made."""

    rows: np.ndarray  # their places in the manifest's tensors
    owners: cells.Owners  # names, dtypes, (shape, grid) kinds, changes
    tables: list[TableRef | None]  # each one's own cell table (formats 7 and 10), or None: in cell sections
    table: np.ndarray  # format 12: its tensor table's place in the manifest (-1: a cell table of its own)
    row: np.ndarray  # and its record's row in that table
    dim: np.ndarray  # the dimension its cells are shared out along (0 where not in sections)
    records: np.ndarray  # its records: its cell table's count, or over every section
    sections: SectionTable  # the cell sections of the tables read
    kept: np.ndarray  # per tensor, the cells whose chunks are kept: an index into kept_sets; -1: every cell
    kept_sets: list[frozenset]  # the distinct sets of cells kept

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of(cls, m: Manifest, names=None, keep: bool = False) -> CutTensors:
        """The tensors of ``m`` (those in ``names``; None: all) whose chunks are not read yet. ``keep``: only the
        chunks of the cells ``names`` (a Selection {name: cells or None}) gives are kept, on a rank's own manifest
        only (``m.held``: a tensor-parallel rank of 8 fetches 2 of a K2 expert's 16 cells)."""
        if keep and (m.held is None or not isinstance(names, dict)):
            raise ManifestError("only a rank's own manifest keeps some of a tensor's chunks, by a selection")
        if isinstance(m.tensors, TableEntries):
            got = cls._of_table_entries(m.tensors, names)
        else:
            got = cls._of_entries(m.tensors, names)
        if not keep:
            return got
        sets, codes = set_codes([names.get(n) for n in got.owners.names])
        return dataclasses.replace(got, kept=codes, kept_sets=sets)

    @classmethod
    def _of_entries(cls, tensors: list[TensorEntry], names) -> CutTensors:
        picked = [i for i, t in enumerate(tensors) if t.cells is not None and (names is None or t.name in names)]
        refs = [tensors[i].cells for i in picked]
        in_sections = [r if isinstance(r, CellSections) else None for r in refs]
        return cls(
            np.array(picked, np.int64),
            cells.Owners.of_entries([tensors[i] for i in picked]),
            [r if isinstance(r, TableRef) else None for r in refs],
            np.array([-1 if r is None else r.table for r in in_sections], np.int64),
            np.array([-1 if r is None else r.row for r in in_sections], np.int64),
            np.array([0 if r is None else r.dim for r in in_sections], np.int64),
            np.array([r.records if isinstance(r, CellSections) else r.count for r in refs], np.int64),
            SectionTable.of_refs({r.table: r.sections for r in in_sections if r is not None}),
            np.full(len(picked), -1, np.int64),
            [],
        )

    @classmethod
    def _of_table_entries(cls, te: TableEntries, names) -> CutTensors:
        c = te.columns
        cut = c.cells | (c.section_dim != entries.NONE)
        if te.read_chunks:
            cut[list(te.read_chunks)] = False
        if names is not None:
            cut &= np.fromiter((n in names for n in c.names), bool, len(c))
        rows = np.flatnonzero(cut)
        own = c.cells[rows]
        tables_: list[TableRef | None] = [None] * len(rows)
        mine = rows[own]  # a cell table of its own (formats 7 and 10): few, beside the sections
        for j, b, o, n, h, k in zip(
            np.flatnonzero(own).tolist(),
            *(
                x[mine].tolist()
                for x in (c.cell_blob, c.cell_offset, c.cell_length, te.records["sha256"], c.cell_count)
            ),
        ):
            tables_[j] = TableRef(b, o, n, h.hex(), k)
        assert te.table is not None and te.row is not None  # read with their places (read_tensor_tables)
        return cls(
            rows,
            cells.Owners.of_columns(c, rows),
            tables_,
            np.where(own, -1, te.table[rows]),
            np.where(own, -1, te.row[rows]),
            np.maximum(c.section_dim[rows], 0),
            c.cell_count[rows],
            SectionTable.of(te.sections),
            np.full(len(rows), -1, np.int64),
            [],
        )


def set_cells(
    m: Manifest, cut: CutTensors, raws: list[bytes | None], sections: dict[tuple[int, int], bytes] | None = None
) -> None:
    """Take cut tensors' chunks (``cut``, keeping those ``cut.kept`` gives) from the bytes of their cell tables
    (``raws``, in order; None for a tensor in cell sections, format 12, whose records come from ``sections``
    {(tensor table, share): bytes}, the sections read: :func:`sections_wanted`), every table checked against
    its SHA-256 and count and every record as inline chunks are (:func:`read_cells`); nothing is taken unless
    every table checks. A tensor's other records are read and checked but not kept. The chunks stay records
    until asked for (:class:`CellChunks`)."""
    with _collector_paused():
        got = read_cells(m, cut, raws, sections)
        if isinstance(m.tensors, TableEntries):
            m.tensors.take_chunks(cut.rows.tolist(), got)
        else:
            for i, c in zip(cut.rows.tolist(), got):
                m.tensors[i].chunks, m.tensors[i].cells = c, None


def sections_wanted(cut: CutTensors) -> dict[tuple[int, int], TableRef]:
    """The cell sections (format 12) that hold the chunks a reader takes of the tensors of ``cut`` in cell
    sections (those of the cells ``cut.kept`` gives, else all): {(tensor table, share): reference}, a share
    with no record left out. A rank of tensor parallelism wants the sections of its own share (and of an
    earlier one where a cell starting there reaches into its slice); found once per distinct (shape, grid,
    dimension, shares, cells kept), a K2 rank's 140 k tensors have a few."""
    out: dict[tuple[int, int], TableRef] = {}
    shared = np.flatnonzero(cut.table >= 0)
    if not len(shared):
        return out
    table = cut.table[shared]
    n_shares = cut.sections.shares(table)
    if (n_shares == 0).any():
        j = int(shared[np.argmax(n_shares == 0)])
        raise ManifestError(f"tensor {cut.owners.names[j]!r}: its table has no cell section with records")
    sets, wanted = cut.kept_sets, cut.kept[shared]
    radix = int(n_shares.max()) + 1
    code = ((cut.owners.kind[shared] * 2 + cut.dim[shared]) * radix + n_shares) * (len(sets) + 1) + wanted + 1
    distinct, of = np.unique(code, return_inverse=True)
    pairs: set[tuple[int, int]] = set()
    for u, x in enumerate(distinct.tolist()):
        rest, w = divmod(x, len(sets) + 1)
        k, n = divmod(rest, radix)
        if w == 0:
            shares: list[int] | range = range(1, n + 1)
        else:
            shape, grid = cut.owners.kinds[k // 2]
            per_cell = cell_shares(grid, shape, k % 2, n)
            shares = sorted({per_cell[c] for c in sets[w - 1] if 0 <= c < len(per_cell)})
        pairs.update((tb, sh) for tb in np.unique(table[of.reshape(-1) == u]).tolist() for sh in shares)
    for tb, k in sorted(pairs):
        ref = cut.sections.ref(tb, k)
        if ref is not None:
            out[(tb, k)] = ref
    return out


def set_codes(sets: list) -> tuple[list[frozenset], np.ndarray]:
    """Each tensor's cell set (a set, or None for every cell) as a code: (the distinct sets, told apart by
    identity: a selection's sets are shared; per tensor its set's index, -1 for every cell)."""
    index: dict[int, int] = {}
    distinct: list[frozenset] = []
    codes = []
    for w in sets:
        if w is None:
            codes.append(-1)
            continue
        k = index.get(id(w))
        if k is None:
            k = index[id(w)] = len(distinct)
            distinct.append(w)
        codes.append(k)
    return distinct, np.array(codes, np.int64)


def in_sets(distinct: list[frozenset], code: np.ndarray, cell: np.ndarray) -> np.ndarray:
    """Whether each record's cell is in its set (``code``: its set's index in ``distinct``, -1 for every cell),
    in one sorted lookup over the distinct sets' cells."""
    if not distinct:
        return np.ones(len(code), bool)
    sizes = [len(w) for w in distinct]
    members = np.repeat(np.arange(len(distinct), dtype=np.int64), sizes) * (1 << 32) + np.fromiter(
        (c for w in distinct for c in w), np.int64, sum(sizes)
    )
    return (code < 0) | np.isin(np.maximum(code, 0) * (1 << 32) + cell, members)


def read_cells(
    m: Manifest, cut: CutTensors, raws: list[bytes | None], sections: dict[tuple[int, int], bytes] | None = None
) -> list[CellChunks]:
    """The chunks of each tensor of ``cut`` from its cell table's bytes (``raws``), checked against the
    table's length and SHA-256, then every record by the rules inline chunks meet (:func:`cells.check`), over
    all records of all tables at once: a rank reads ~300,000 of them per Kimi-K2 version. The coders' rules are
    checked once per distinct (positions, values, mode, dtype). Only the chunks of the cells ``cut.kept``
    gives are kept (None: all). A tensor in cell sections (format 12; bytes None) takes its records from
    ``sections`` (:func:`_from_sections`). Each tensor's chunks come in cell order."""
    n = len(cut)
    if not n:
        return []
    names = cut.owners.names
    plain = np.flatnonzero(cut.table < 0)
    for j in plain.tolist():
        ref, raw = cut.tables[j], raws[j]
        assert ref is not None  # a tensor with no sections has a cell table of its own
        verify_table(ref, raw or b"", f"tensor {names[j]!r}: cell table")
        if len(raw or b"") != ref.count * CELL_RECORD.itemsize:
            raise ManifestError(f"tensor {names[j]!r}: cell table: {len(raw or b'')} bytes for {ref.count} records")
    from_plain = np.frombuffer(b"".join(bytes(raws[j] or b"") for j in plain.tolist()), CELL_RECORD)
    shared = np.flatnonzero(cut.table >= 0)
    from_sections, sec_owner, whole = _from_sections(m, cut, shared, sections or {})
    # every record with its tensor (an index into cut), the cell tables' first, then the sections'
    rec = np.concatenate([from_plain, from_sections])
    owner = np.concatenate([np.repeat(plain, cut.records[plain]), sec_owner])
    order = np.argsort(owner, kind="stable")
    rec, owner = rec[order], owner[order]
    counts = np.bincount(owner, minlength=n).astype(np.int64)
    full = np.ones(n, bool)
    full[shared] = whole
    where = lambda i: f"tensor {names[owner[i]]!r}: cell table"
    cells.check(m, cut.owners, counts, rec, where, full)
    offset, blob = rec["offset"], rec["blob"]
    by_place = np.lexsort((offset, blob, owner))
    end = (offset + rec["positions_length"] + rec["values_length"])[by_place]
    same = (owner[by_place][1:] == owner[by_place][:-1]) & (blob[by_place][1:] == blob[by_place][:-1])
    overlap = np.r_[False, same & (offset[by_place][1:] < end[:-1])][np.argsort(by_place)]
    if overlap.any():
        raise ManifestError(f"{where(int(np.argmax(overlap)))}: two cells overlap in their blob")
    kept = np.flatnonzero(in_sets(cut.kept_sets, cut.kept[owner], rec["cell"].astype(np.int64)))
    kept = kept[np.lexsort((rec["cell"][kept], owner[kept]))]  # by tensor, then cell
    records = rec[kept]
    at = np.cumsum(np.bincount(owner[kept], minlength=n)).tolist()
    return [CellChunks(records, a, b) for a, b in zip([0, *at], at)]


def _from_sections(
    m: Manifest, cut: CutTensors, shared: np.ndarray, sections: dict[tuple[int, int], bytes]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The records of the tensors ``shared`` (indices into ``cut``, in cell sections: format 12) found in the
    cell ``sections`` read {(tensor table, share): bytes}: CELL_RECORDs; each one's tensor (an index into
    ``cut``); and per tensor of ``shared``, whether those are all of its records (every section of its table
    that has records was read: then exactly its ``records``). Each section is checked against its length and
    SHA-256 in its table and its records sorted by (row, cell) within the table; each record of a tensor asked
    for must lie in the section of its cell's share. Records of other tensors are not used (a rank's section
    holds its share of every tensor of the table). All at once: a TP rank of K2 reads its share of 1.13 M
    records, of 140 k tensors."""
    if not len(shared):
        if sections:
            raise ManifestError("cell sections were read for no tensor in cell sections")
        return np.zeros(0, CELL_RECORD), np.zeros(0, np.int64), np.zeros(0, bool)
    parsed, table_of, share_of = [], [], []
    for (table, k), raw in sorted(sections.items()):
        ref = cut.sections.ref(table, k)
        if ref is None:
            raise ManifestError(f"tensor table {table}: cell section {k} was read for no tensor of it")
        verify_table(ref, raw, f"tensor table {table}: cell section {k}")
        rec = np.frombuffer(raw, SECTION_RECORD)
        key = rec["row"].astype(np.int64) * (1 << 32) + rec["cell"].astype(np.int64)
        if (key[1:] <= key[:-1]).any() or (rec["row"] >= m.tables[table].count).any():
            raise ManifestError(
                f"tensor table {table}: cell section {k}: its records are not sorted by row and cell, or lie beyond its table"
            )
        parsed.append(rec)
        table_of.append(np.full(len(rec), table, np.int64))
        share_of.append(np.full(len(rec), k, np.int64))
    rec = np.concatenate(parsed) if parsed else np.zeros(0, SECTION_RECORD)
    table = np.concatenate(table_of) if parsed else np.zeros(0, np.int64)
    share = np.concatenate(share_of) if parsed else np.zeros(0, np.int64)
    # each record's tensor among those asked for, by (table, row); the others' records are dropped
    tkey = cut.table[shared] * (1 << 16) + cut.row[shared]
    by_key = np.argsort(tkey)
    rkey = table * (1 << 16) + rec["row"].astype(np.int64)
    at = np.minimum(np.searchsorted(tkey[by_key], rkey), len(shared) - 1)
    mine = tkey[by_key][at] == rkey
    owner = shared[by_key[at][mine]]
    rec, share = rec[mine], share[mine]
    cell = rec["cell"].astype(np.int64)
    shares_of = np.zeros(len(cut), np.int64)
    shares_of[shared] = cut.sections.shares(cut.table[shared])
    got = cut.owners.cell_shares(cut.dim, shares_of, owner, cell)
    elsewhere = (got != -1) & (got != share)  # a cell beyond its grid (-1) is cells.check's to refuse
    if elsewhere.any():
        j = int(owner[np.argmax(elsewhere)])
        raise ManifestError(f"tensor {cut.owners.names[j]!r}: cell sections: a cell in another share's section")
    counts = np.bincount(owner, minlength=len(cut))[shared].astype(np.int64)
    whole = cut.sections.read_whole(sections)[cut.table[shared]]
    said = cut.records[shared]
    bad = (whole & (counts != said)) | (counts > said)
    if bad.any():
        j = int(shared[np.argmax(bad)])
        raise ManifestError(
            f"tensor {cut.owners.names[j]!r}: its cell sections hold {int(counts[np.argmax(bad)])} of its records, it says {int(cut.records[j])}"
        )
    order = np.lexsort((cell, owner))
    out = np.zeros(len(order), CELL_RECORD)
    for f in CELL_RECORD.names:
        out[f] = rec[f][order]
    return out, owner[order], whole


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
