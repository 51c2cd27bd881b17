"""Reading cut tensors' chunks from their cell tables (formats 7 and 10) and cell sections (format 12), as arrays.

A tensor-parallel rank of Kimi-K2 reads its share of 140 k cut tensors' chunks per version: which sections
and cell tables hold the cells it needs (:func:`sections_wanted`), then every record checked by the rules
inline chunks meet (:func:`read_cells`, :mod:`engine_ext.format.cells`), all at once. The tensors come as
columns (:class:`CutTensors`, from a manifest's columns: no entry object made), the sections as one array
(:class:`SectionTable`), and the chunks stay records until asked for
(:class:`~engine_ext.format.manifest.CellChunks`). The tables themselves, written and read, are
:mod:`engine_ext.format.tables`'.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ..errors import ManifestError
from . import cells, entries
from .bulk import collector_paused as _collector_paused
from .cells import CELL_RECORD
from .chunks import cell_shares
from .manifest import MAX_SHARES, CellChunks, CellSections, Manifest, TableRef, TensorEntry
from .tensor_records import SECTION_PLACE, SECTION_RECORD, TableEntries, section_ref, verify_bytes, verify_table


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

    def _lookup(self, keys: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Where sections ``keys`` [(table, share)] lie in ``places``, and whether each is there (holds records),
        in one sorted lookup: a TP rank of K2 asks for 2,200 sections."""
        want = np.array([t * (MAX_SHARES + 1) + k for t, k in keys], np.int64)
        if not len(self.keys):
            return np.zeros(len(want), np.int64), np.zeros(len(want), bool)
        at = np.minimum(np.searchsorted(self.keys, want), len(self.keys) - 1)
        return at, self.keys[at] == want

    def find(self, keys: list[tuple[int, int]]) -> np.ndarray:
        """The places of sections ``keys`` [(table, share)], each of which must hold records."""
        at, found = self._lookup(keys)
        if not found.all():
            table, k = keys[int(np.argmin(found))]
            raise ManifestError(f"tensor table {table}: cell section {k} was read for no tensor of it")
        return self.places[at]

    def refs(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], TableRef]:
        """Sections ``keys`` [(table, share)] as table references, in their order; those with no record left out."""
        at, found = self._lookup(keys)
        p = self.places[at[found]]
        held = [key for key, f in zip(keys, found.tolist()) if f]
        return {
            key: section_ref(blob, offset, count, sha)
            for key, blob, offset, count, sha in zip(
                held, p["blob"].tolist(), p["offset"].tolist(), p["count"].tolist(), p["sha256"].tolist()
            )
        }

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
        refs: list[TableRef | CellSections] = [r for i in picked if (r := tensors[i].cells) is not None]
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
    return cut.sections.refs(sorted(pairs))


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
    assert m.tables is not None  # a manifest in tables: its cut tensors' sections lie in them
    read = sorted(sections)
    places = cut.sections.find(read)
    raws = [sections[k] for k in read]
    for (table, k), raw, length, digest in zip(
        read, raws, (places["count"] * SECTION_RECORD.itemsize).tolist(), places["sha256"].tolist()
    ):  # no reference object per section: a TP rank of K2 reads 2,200
        verify_bytes(raw, length, digest.hex(), f"tensor table {table}: cell section {k}")
    rec = np.frombuffer(b"".join(raws), SECTION_RECORD)
    counts = places["count"]
    in_table, share = np.repeat(places["table"], counts), np.repeat(places["share"], counts)
    rows = np.array([m.tables[t].count for t in places["table"].tolist()], np.int64)
    key = rec["row"].astype(np.int64) * (1 << 32) + rec["cell"].astype(np.int64)
    ends = np.cumsum(counts)
    first = np.zeros(len(rec), bool)  # each section's first record: not compared with the one before it
    first[ends[:-1][ends[:-1] < len(rec)]] = True
    unsorted = ~first[1:] & (key[1:] <= key[:-1])
    beyond = rec["row"] >= np.repeat(rows, counts)
    if unsorted.any() or beyond.any():
        at = np.flatnonzero(np.r_[False, unsorted] | beyond)[0]
        section = int(np.searchsorted(ends, at, side="right"))
        raise ManifestError(
            f"tensor table {read[section][0]}: cell section {read[section][1]}: its records are not sorted by row "
            "and cell, or lie beyond its table"
        )
    # each record's tensor among those asked for, by (table, row); the others' records are dropped
    tkey = cut.table[shared] * (1 << 16) + cut.row[shared]
    by_key = np.argsort(tkey)
    rkey = in_table * (1 << 16) + rec["row"].astype(np.int64)
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
    for f in CELL_RECORD.names or ():
        out[f] = rec[f][order]
    return out, owner[order], whole
