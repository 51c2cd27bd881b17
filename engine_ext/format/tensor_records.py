"""Format-10 tensor tables: tensor entries as fixed binary records, read and written as columns (issue 52).

A tensor table (docs/FORMAT.md, "Indexed tensor tables") is ``u32 names_length``, ``u32 shapes_length``,
``count`` :data:`TENSOR_RECORD` records, the names, then the table's distinct shapes and grids as compact JSON.
A Kimi-K2 version has 140,790 entries in about 2,200 tables, which the driver reads whole once per version and
a tensor-parallel rank nearly whole. So every table's records are read into one array and checked as one
(:func:`read_tensor_tables`), become :class:`~engine_ext.format.entries.Columns` with no object per entry
(:class:`TableEntries` makes them only when one is asked for), and a writer makes every record of its entries
at once from their columns (:func:`tensor_records`, :func:`table_bytes`). Which tables a rank reads, the
name index and cell tables are :mod:`engine_ext.format.tables`'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence

import numpy as np

from ..errors import IntegrityError, ManifestError
from . import entries
from . import fingerprint as fpr
from .bulk import LastKept
from .cells import CELL_CODERS, CELL_MODES, CELL_RECORD, MAX_OFFSET
from .manifest import MAX_SHARES, SECTION_RECORD_BYTES, CellChunks, CellSections, Segment, TableRef, TensorEntry

# Format 10. A tensor table: u32 names bytes, u32 shapes bytes, ``count`` records, the names (UTF-8, in
# record order), then the table's distinct shapes and grids as compact JSON {"shapes": [...], "grids": [...]}.
TENSOR_RECORD = np.dtype(
    [
        ("name_length", "<u2"),
        ("dtype", "u1"),
        ("kind", "u1"),
        ("flags", "u1"),
        ("shape", "<u2"),
        ("grid", "<u2"),
        ("nnz", "<u8"),
        ("fingerprint", "<u8"),
        ("base_fingerprint", "<u8"),
        ("blob", "<u4"),
        ("offset", "<u8"),
        ("sha256", "V32"),
        ("positions_coder", "u1"),
        ("positions_length", "<u8"),
        ("values_coder", "u1"),
        ("values_length", "<u8"),
        ("mode", "u1"),
        ("count", "<u4"),
    ]
)
# a record's kind: no bytes; bytes of its own; a cell table (blob..count); its table's cell sections (format 12)
UNCHANGED, BYTES, CELLS, SECTIONS = 0, 1, 2, 3
HAS_BASE = 1  # flags: the base fingerprint is set
DIM1 = 2  # flags, format 12: a kind-3 record's cells are shared out along dimension 1 (else 0)
# Format 12: after the shapes, u16 shares (0: no cell sections), then one reference per share: where the
# section lies and the SHA-256 of its bytes, ``count`` SECTION_RECORDs (a share with none: all zero).
SECTION_REF = np.dtype([("blob", "<u4"), ("offset", "<u8"), ("count", "<u4"), ("sha256", "V32")])
SECTION_RECORD = np.dtype([("row", "<u2"), *((f, CELL_RECORD[f]) for f in CELL_RECORD.names or ())])
# a cell section as read, with records: its table (place in the manifest), share (1 to shares) and reference
SECTION_PLACE = np.dtype(
    [
        ("table", "<i8"),
        ("share", "<i8"),
        ("shares", "<i8"),
        ("blob", "<i8"),
        ("offset", "<i8"),
        ("count", "<i8"),
        ("sha256", "V32"),
    ]
)
assert SECTION_RECORD.itemsize == SECTION_RECORD_BYTES
NO_GRID = 0xFFFF
TABLE_DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)  # a dtype's byte in a record: its index (append only)
TABLE_HEAD = np.dtype([("names", "<u4"), ("shapes", "<u4")])


def tensor_table(tensors: list[TensorEntry], cells: Sequence[TableRef | CellSections | None]) -> bytes:
    """A format-10 tensor table of ``tensors`` (``cells[i]``: where tensor i's cell table lies, or None)."""
    c = entries.Columns.of_entries(tensors)
    return table_bytes(c, tensor_records(c, cells), 0, len(c))


def tensor_records(c: entries.Columns, cells: Sequence[TableRef | CellSections | None]) -> np.ndarray:
    """Validated entries' :data:`TENSOR_RECORD` records, a field at a time (``shape`` and ``grid``: the codes of
    ``c``, which each table makes its own). ``cells[i]``: where tensor i's chunks lie (a cell table; its
    table's cell sections, of which the record says the dimension and the count; None)."""
    n = len(c)
    rec = np.zeros(n, TENSOR_RECORD)
    shared = np.array([isinstance(r, CellSections) for r in cells], bool)
    in_cells = np.array([r is not None for r in cells], bool) & ~shared
    own = (c.nnz != 0) & ~in_cells
    rec["name_length"] = [len(x.encode()) for x in c.names]
    rec["dtype"] = np.array([TABLE_DTYPES.index(d) for d in c.dtypes], np.uint8)[c.dtype]
    own &= ~shared
    rec["kind"] = np.where(shared, SECTIONS, np.where(in_cells, CELLS, np.where(own, BYTES, UNCHANGED)))
    rec["flags"] = np.where(c.has_base, HAS_BASE, 0)
    rec["shape"], rec["grid"] = c.shape, np.where(c.grid == entries.NONE, NO_GRID, c.grid)
    rec["nnz"], rec["fingerprint"], rec["base_fingerprint"] = c.nnz, c.fingerprint, c.base
    rec["blob"] = np.where(own, c.blob, 0)
    rec["offset"] = np.where(own, c.offset, 0)
    rec["sha256"] = np.where(own, c.sha, np.zeros(n, "V32"))
    rec["positions_coder"] = np.where(own, _code_of(c.pcoder, c.pcoders, CELL_CODERS), 0)
    rec["positions_length"] = np.where(own, c.plen, 0)
    rec["values_coder"] = np.where(own, _code_of(c.vcoder, c.vcoders, CELL_CODERS), 0)
    rec["values_length"] = np.where(own, c.vlen, 0)
    rec["mode"] = np.where(own, _code_of(c.mode, c.modes, CELL_MODES), 0)
    rows = np.flatnonzero(in_cells)
    refs = [cells[i] for i in rows.tolist()]
    for f, values in (
        ("blob", [r.blob for r in refs]),
        ("offset", [r.offset for r in refs]),
        ("positions_length", [r.length for r in refs]),
        ("count", [r.count for r in refs]),
    ):
        rec[f][rows] = values
    rec["sha256"][rows] = np.frombuffer(bytes.fromhex("".join(r.sha256 for r in refs)), "V32")
    rows = np.flatnonzero(shared)
    sectioned = [r for r in cells if isinstance(r, CellSections)]  # in row order, as ``rows``
    rec["count"][rows] = [r.records for r in sectioned]
    rec["flags"][rows] |= np.array([DIM1 * r.dim for r in sectioned], np.uint8)
    return rec


def _code_of(codes: np.ndarray, values: list, table: tuple) -> np.ndarray:
    """A column's codes as their values' places in a record's ``table`` (coders, modes)."""
    return np.array([table.index(v) for v in values] + [0], np.uint8)[codes]


def table_bytes(c: entries.Columns, rec: np.ndarray, a: int, b: int, sections: bytes = b"") -> bytes:
    """Rows ``a:b`` as one tensor table: their records, with shape and grid codes into the table's own
    distinct shapes and grids (in order of first use), the names, the shapes section, then ``sections``
    (format 12: :func:`sections_trailer`)."""
    out = rec[a:b].copy()
    shapes, out["shape"] = _first_use(c.shape[a:b])
    has_grid = c.grid[a:b] != entries.NONE
    grids, local = _first_use(c.grid[a:b][has_grid])
    out["grid"][has_grid] = local
    extra = json.dumps(
        {"shapes": [list(c.shapes[s]) for s in shapes], "grids": [[list(x) for x in c.grids[g]] for g in grids]},
        separators=(",", ":"),
    ).encode()
    names_raw = "".join(c.names[a:b]).encode()
    head = np.array([(len(names_raw), len(extra))], TABLE_HEAD).tobytes()
    return head + out.tobytes() + names_raw + extra + sections


_NO_SECTION = TableRef(0, 0, 0, "0" * 64, 0)


def section_ref(blob: int, offset: int, count: int, sha256: bytes) -> TableRef:
    """A cell section of ``count`` records as a table reference (its place in a :data:`SECTION_PLACE`)."""
    return TableRef(blob, offset, count * SECTION_RECORD.itemsize, sha256.hex(), count)


def sections_trailer(refs: list[TableRef]) -> bytes:
    """A format-12 tensor table's last bytes: u16 shares, then where each share's cell section lies (a share
    with no record: all zero); ``refs`` empty: no cell sections (u16 0)."""
    out = np.zeros(len(refs), SECTION_REF)
    for i, r in enumerate(refs):
        if r.count:
            out[i] = (r.blob, r.offset, r.count, bytes.fromhex(r.sha256))
    return struct.pack("<H", len(refs)) + out.tobytes()


def _first_use(codes: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The distinct codes in order of first use, and each row's place among them."""
    distinct, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return distinct[order].tolist(), rank[inverse]


@dataclasses.dataclass
class _Parts:
    """A tensor table's parts, its bytes checked against its reference and the parts' sizes against its
    length. Records are joined into one array for every table at once (a structured concatenate of 2,200
    tables cost 0.1 s), and the shapes part parsed once per distinct text (tables of alike tensors list
    the same shapes and grids)."""

    records: bytes
    names: bytes
    shapes: bytes
    sections: np.ndarray  # format 12: SECTION_REF per share (none: no cell sections)


def _parts(ref: TableRef, raw: bytes, where: str, sectioned: bool) -> _Parts:
    verify_table(ref, raw, where)
    n, h = ref.count, TABLE_HEAD.itemsize
    if len(raw) < h + n * TENSOR_RECORD.itemsize:
        raise ManifestError(f"{where}: {len(raw)} bytes for {n} records")
    names_len, extra_len = struct.unpack_from("<II", raw)  # TABLE_HEAD
    at = h + n * TENSOR_RECORD.itemsize
    end = at + names_len + extra_len
    shares = 0
    if sectioned:
        if len(raw) < end + 2:
            raise ManifestError(f"{where}: {len(raw)} bytes, its parts account for more")
        (shares,) = struct.unpack_from("<H", raw, end)
        if shares == 1 or shares > MAX_SHARES:
            raise ManifestError(f"{where}: cell sections for {shares} shares (0, or 2 to {MAX_SHARES})")
    trailer = end + (2 + shares * SECTION_REF.itemsize if sectioned else 0)
    if len(raw) != trailer:
        raise ManifestError(f"{where}: {len(raw)} bytes, its parts account for {trailer}")
    sections = np.frombuffer(raw, SECTION_REF, shares, end + 2) if shares else np.zeros(0, SECTION_REF)
    return _Parts(raw[h:at], raw[at : at + names_len], raw[at + names_len : end], sections)


def _shape_lists(raw: bytes, where: str) -> tuple[list, list]:
    """A shapes section: compact JSON {"shapes": [...], "grids": [...]} (each value checked by the entries' rules)."""
    try:
        extra = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ManifestError(f"{where}: its shapes are not valid JSON") from None
    if (
        not isinstance(extra, dict)
        or set(extra) != {"shapes", "grids"}
        or not all(isinstance(extra[k], list) for k in extra)
    ):
        raise ManifestError(f"{where}: its shapes are not {{shapes, grids}}")
    return extra["shapes"], extra["grids"]


class TableEntries(entries.ColumnEntries):
    """Entries read from format-10 tensor tables: columns at once, objects when first asked for. Format 12:
    ``sections``, the cell sections of every table read (:data:`SECTION_PLACE`, a share with no record left
    out; their places in the blobs are Manifest.validate's to check), and where each entry's record lies
    (``table``: the table's place in the manifest, ``row``)."""

    def __init__(
        self,
        columns: entries.Columns,
        records: np.ndarray,
        signature: bytes | None,
        keys: np.ndarray | None,
        sections: np.ndarray | None = None,
        table: np.ndarray | None = None,
        row: np.ndarray | None = None,
    ):
        super().__init__(columns)
        self.records = records
        self._signature, self._keys = signature, keys
        self.sections = np.zeros(0, SECTION_PLACE) if sections is None else sections
        self.table, self.row = table, row
        self.read_chunks: dict[int, CellChunks] = {}  # row -> its chunks, read from its cell table or sections

    def take_chunks(self, rows: list[int], chunks: list[CellChunks]) -> None:
        """The chunks read for the cut tensors at ``rows`` (:func:`engine_ext.format.cell_reads.set_cells`): kept
        here, and given to the entry objects when they are made (or now, where they are)."""
        self.read_chunks.update(zip(rows, chunks))
        if self._made is not None:
            for i, c in zip(rows, chunks):
                self._made[i].chunks, self._made[i].cells = c, None

    def section_refs(self) -> dict[int, tuple[TableRef, ...]]:
        """Each table's cell sections as references, share 1 first (a share with no record: count 0)."""
        out: dict[int, list[TableRef]] = {}
        shares = self.sections["shares"].tolist()
        for number, share, n, blob, offset, count, sha in zip(
            self.sections["table"].tolist(),
            self.sections["share"].tolist(),
            shares,
            self.sections["blob"].tolist(),
            self.sections["offset"].tolist(),
            self.sections["count"].tolist(),
            self.sections["sha256"].tolist(),
        ):
            refs = out.setdefault(number, [_NO_SECTION] * n)
            refs[share - 1] = section_ref(blob, offset, count, sha)
        return {k: tuple(v) for k, v in out.items()}

    def name_keys(self) -> np.ndarray:
        """The entries' name keys, made once (and kept for the next whole read of the same names)."""
        if self._keys is None:
            self._keys = fpr.name_keys(self.columns.names)
            if self._signature is not None:
                self._keys.flags.writeable = False  # shared by every read that finds it
                _KNOWN.put(self._signature, (self.columns.names, self._keys))
        return self._keys

    def make(self) -> list[TensorEntry]:
        c, rec = self.columns, self.records
        sections = self.section_refs() if len(self.sections) else {}
        if sections:  # where each record lies, as lists (numpy's scalars, one at a time, cost more than the rest)
            assert self.table is not None and self.row is not None  # read with their places (read_tensor_tables)
            places, rows, dims = self.table.tolist(), self.row.tolist(), c.section_dim.tolist()
        cols = {f: rec[f].tolist() for f in ("kind", "blob", "offset", "positions_length", "values_length", "count")}
        sha = rec["sha256"].tolist()
        pcoder, vcoder, mode = c.pcoder.tolist(), c.vcoder.tolist(), c.mode.tolist()
        fps = [f"{x:016x}" for x in c.fingerprint.tolist()]
        bases = [f"{x:016x}" if has else None for x, has in zip(c.base.tolist(), c.has_base.tolist())]
        shapes, grids = c.shapes, c.grids  # one list per distinct shape and grid, shared by the entries that have
        dtypes, out = c.dtype_names(), []  # it (nothing changes one in place)
        for i, (name, shape, grid, nnz) in enumerate(zip(c.names, c.shape.tolist(), c.grid.tolist(), c.nnz.tolist())):
            t = TensorEntry(
                name,
                dtypes[i],
                shapes[shape],
                nnz,
                fps[i],
                bases[i],
                grid=None if grid == entries.NONE else grids[grid],
            )
            kind = cols["kind"][i]
            if kind == BYTES:
                t.blob, t.offset, t.sha256 = cols["blob"][i], cols["offset"][i], sha[i].hex()
                t.positions = Segment(CELL_CODERS[pcoder[i]], cols["positions_length"][i])
                t.values = Segment(CELL_CODERS[vcoder[i]], cols["values_length"][i], CELL_MODES[mode[i]])
            elif kind == CELLS:
                t.cells = TableRef(
                    cols["blob"][i], cols["offset"][i], cols["positions_length"][i], sha[i].hex(), cols["count"][i]
                )
            elif kind == SECTIONS:
                number = places[i]
                t.cells = CellSections(sections[number], number, rows[i], dims[i], cols["count"][i])
            out.append(t)
        for i, got in self.read_chunks.items():
            out[i].chunks, out[i].cells = got, None
        return out


def read_tensor_tables(
    refs: list[TableRef],
    raws: list[bytes],
    numbers: list[int],
    rows=None,
    only: frozenset | None = None,
    sectioned: bool = False,
) -> TableEntries:
    """The tensor entries of format-10 tensor tables (``numbers``: the tables' places in the manifest, for
    errors; ``rows``: per table, only those records; ``only``: only the entries of these names; ``sectioned``:
    format 12's, with cell sections), as columns: each table's bytes checked against its
    reference's length and SHA-256, then every byte accounted for, over all the tables' records at once: the
    parts' sizes, each record's codes, the fields its kind leaves unused all zero, every shape and grid a
    table lists used by one of its records, every name UTF-8, a table's cell sections holding as many records
    as its kind-3 records count. The entries are then checked by the caller as
    inline ones are (:func:`engine_ext.format.entries.check`, from Manifest.validate); the cell sections' places
    by Manifest.validate too; no object is made until one is asked for (:class:`TableEntries`)."""
    parts = [_parts(ref, raw, f"tensor table {i}", sectioned) for ref, raw, i in zip(refs, raws, numbers)]
    counts = np.array([ref.count for ref in refs], np.int64)
    table = np.repeat(np.arange(len(parts)), counts)
    rec = np.frombuffer(b"".join(p.records for p in parts), TENSOR_RECORD)

    def refuse(bad: np.ndarray, msg: str) -> None:
        if bad.any():
            raise ManifestError(f"tensor table {numbers[int(table[int(np.argmax(bad))])]}: {msg}")

    firsts = np.cumsum(counts) - counts
    names_length = np.add.reduceat(rec["name_length"], firsts, dtype=np.int64) if len(rec) else counts
    if (names_length != [len(p.names) for p in parts]).any():
        i = int(np.argmax(names_length != [len(p.names) for p in parts]))
        raise ManifestError(f"tensor table {numbers[i]}: its records' name lengths do not sum to its names' bytes")
    texts: dict[bytes, int] = {}  # each distinct shapes section, parsed once (errors name its first table)
    lists: list[tuple[list, list]] = []
    for p, number in zip(parts, numbers):
        if p.shapes not in texts:
            texts[p.shapes] = len(lists)
            lists.append(_shape_lists(p.shapes, f"tensor table {number}"))
    text_of = np.array([texts[p.shapes] for p in parts], np.int64)
    n_shapes = np.array([len(s) for s, _ in lists], np.int64)[text_of]
    n_grids = np.array([len(g) for _, g in lists], np.int64)[text_of]
    kind, grid, shape = rec["kind"], rec["grid"].astype(np.int64), rec["shape"].astype(np.int64)
    no_grid = grid == NO_GRID
    shares = np.array([len(p.sections) for p in parts], np.int64)
    refuse(
        (rec["dtype"] >= len(TABLE_DTYPES))
        | (kind > (SECTIONS if sectioned else CELLS))
        | ((rec["flags"] & ~np.uint8(HAS_BASE | DIM1)) != 0)
        | (((rec["flags"] & DIM1) != 0) & (kind != SECTIONS))
        | ((kind == SECTIONS) & (shares[table] == 0))
        | (shape >= n_shapes[table])
        | (~no_grid & (grid >= n_grids[table]))
        | (rec["positions_coder"] >= len(CELL_CODERS))
        | (rec["values_coder"] >= len(CELL_CODERS))
        | (rec["mode"] >= len(CELL_MODES)),
        "a record's code is out of range",
    )
    unused = (
        (rec["blob"] != 0)
        | (rec["offset"] != 0)
        | (rec["sha256"] != np.void(bytes(32)))
        | (rec["positions_coder"] != 0)
        | (rec["positions_length"] != 0)
    )
    rest = (rec["values_coder"] != 0) | (rec["values_length"] != 0) | (rec["mode"] != 0)
    refuse(
        ((kind == UNCHANGED) & (unused | rest | (rec["count"] != 0) | ~no_grid))
        | ((kind == BYTES) & ((rec["count"] != 0) | ~no_grid))
        | ((kind == CELLS) & (rest | (rec["positions_coder"] != 0) | no_grid))
        | ((kind == SECTIONS) & (unused | rest | no_grid)),
        "a record sets fields its kind does not use",
    )
    in_sections = np.bincount(table, np.where(kind == SECTIONS, rec["count"], 0), len(parts)).astype(np.int64)
    sections = _sections_read(parts, numbers, in_sections)
    refuse(
        (kind == UNCHANGED) != (rec["nnz"] == 0),
        "a record's kind says unchanged where it has changes, or the other way round",
    )
    for used, listed in ((table * NO_GRID + shape, n_shapes), ((table * NO_GRID + grid)[~no_grid], n_grids)):
        per_table = np.bincount(np.unique(used) // NO_GRID, minlength=len(parts))
        if (per_table != listed).any():
            i = int(np.argmax(per_table != listed))
            raise ManifestError(f"tensor table {numbers[i]}: it lists a shape or grid no record uses")
    # a record's shape (grid) code: its place among every distinct section's shapes, then among the distinct shapes
    shape_code, shapes = entries.codes_of([s for section, _ in lists for s in section])
    grid_code, grids = entries.codes_of([g for _, section in lists for g in section])
    shape = shape_code[np.cumsum([0, *(len(s) for s, _ in lists)])[text_of][table] + shape]
    place = np.cumsum([0, *(len(g) for _, g in lists)])[text_of][table] + grid
    grid = np.where(no_grid, entries.NONE, np.append(grid_code, 0)[np.where(no_grid, len(grid_code), place)])
    names_raw = b"".join(p.names for p in parts)
    keep = (
        np.arange(len(rec))
        if rows is None
        else np.concatenate(
            [np.zeros(0, np.int64)] + [np.asarray(r, np.int64) + first for r, first in zip(rows, firsts)]
        )
    )
    signature = names_raw + rec["name_length"].tobytes() if rows is None else None
    known = _KNOWN.get(signature)
    if known is not None:
        names, keys = known
    else:
        names, keys = _decode_names(names_raw, rec["name_length"], keep, lambda i: numbers[int(table[keep[i]])]), None
    if only is not None and not only.issuperset(names):  # a rank's: the index placed its names on these rows
        mine = [j for j, name in enumerate(names) if name in only]  # (another name may share a key)
        keep, names = keep[mine], [names[j] for j in mine]
    if rows is not None or only is not None:
        rec, shape, grid = rec[keep], shape[keep], grid[keep]
    place = np.asarray(numbers, np.int64)[table[keep]] if len(parts) else np.zeros(0, np.int64)
    row = keep - firsts[table[keep]] if len(parts) else np.zeros(0, np.int64)
    columns = _columns(rec, names, shape, shapes, grid, grids)
    return TableEntries(columns, rec, signature, keys, sections, place, row)


def _sections_read(parts: list[_Parts], numbers: list[int], in_sections: np.ndarray) -> np.ndarray:
    """Every table's cell sections that hold records, as :data:`SECTION_PLACE`s, refused unless a share with
    no record is all zero and a table's sections hold ``in_sections`` records (its kind-3 records' counts) in
    all, each table at once."""
    shares = np.array([len(p.sections) for p in parts], np.int64)
    raw = np.frombuffer(b"".join([p.sections.tobytes() for p in parts]), SECTION_REF)  # not a structured concatenate
    table = np.repeat(np.arange(len(parts)), shares)
    count = raw["count"].astype(np.int64)
    empty = count == 0
    stray = empty & ((raw["blob"] != 0) | (raw["offset"] != 0) | (raw["sha256"] != np.void(bytes(32))))
    if stray.any():
        raise ManifestError(
            f"tensor table {numbers[int(table[np.argmax(stray)])]}: a cell section of no record is not all zero"
        )
    if (raw["offset"] > MAX_OFFSET).any():
        raise ManifestError(
            f"tensor table {numbers[int(table[np.argmax(raw['offset'] > MAX_OFFSET)])]}: a cell section's offset is past {MAX_OFFSET}"
        )
    held = np.bincount(table, count, len(parts)).astype(np.int64)
    if (held != in_sections).any():
        i = int(np.argmax(held != in_sections))
        raise ManifestError(
            f"tensor table {numbers[i]}: its cell sections hold {int(held[i])} records, its records say {int(in_sections[i])}"
        )
    out = np.zeros(int((~empty).sum()), SECTION_PLACE)
    out["table"] = np.asarray(numbers, np.int64)[table[~empty]] if len(parts) else 0
    out["share"] = (np.arange(len(raw)) - np.repeat(np.cumsum(shares) - shares, shares))[~empty] + 1
    out["shares"] = shares[table[~empty]]
    for f in ("blob", "offset", "count", "sha256"):
        out[f] = raw[f][~empty]
    return out


def _decode_names(raw: bytes, lengths: np.ndarray, keep: np.ndarray, table_of) -> list[str]:
    """The names of rows ``keep`` from the tables' names' bytes (``table_of(i)``: row i's table, for errors)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    starts, stops = (ends - lengths)[keep].tolist(), ends[keep].tolist()
    if raw.isascii():  # one decode, then slices (a byte is a character)
        text = raw.decode("ascii")
        return [text[a:b] for a, b in zip(starts, stops)]
    names = []
    for i, (a, b) in enumerate(zip(starts, stops)):
        try:
            names.append(raw[a:b].decode())
        except UnicodeDecodeError:
            raise ManifestError(f"tensor table {table_of(i)}: a record's name is not UTF-8") from None
    return names


_KNOWN = LastKept()  # the last whole read's names bytes and lengths -> (names, name keys)
"""A driver reads every version of one model, whose names stay the same: decoding 140 k names and hashing
each (a name key is the start of its SHA-256) took 0.3 s of its 0.7 s per K2 version; comparing the 7 MB of
names bytes whole takes a millisecond."""


def forget_names() -> None:
    """Forget the names of the last whole read: the next reads as a fresh process's first (benchmarks)."""
    _KNOWN.clear()


def _columns(rec: np.ndarray, names: list[str], shape, shapes, grid, grids) -> entries.Columns:
    """Records' columns: a kind's unused fields are zero (checked), so a coder of 0 is "none"."""
    kind, n = rec["kind"], len(rec)
    has_bytes, has_cells = kind == BYTES, kind == CELLS
    section_dim = np.where(kind == SECTIONS, (rec["flags"] & DIM1).astype(np.int64) // DIM1, entries.NONE)
    where = lambda i: entries.label(names[i])
    blob, offset = rec["blob"].astype(np.int64), _bounded(rec["offset"], where, "offset")
    plen = _bounded(rec["positions_length"], where, "segment length")
    zero = np.zeros(n, np.int64)
    return entries.Columns(
        names=names,
        dtype=rec["dtype"].astype(np.int64),
        dtypes=list(TABLE_DTYPES),
        shape=shape,
        shapes=shapes,
        grid=grid,
        grids=grids,
        nnz=_bounded(rec["nnz"], where, "nnz"),
        fingerprint=rec["fingerprint"].astype(np.uint64),
        base=rec["base_fingerprint"].astype(np.uint64),
        has_base=(rec["flags"] & HAS_BASE).astype(bool),
        pcoder=rec["positions_coder"].astype(np.int64),
        pcoders=list(CELL_CODERS),
        vcoder=rec["values_coder"].astype(np.int64),
        vcoders=list(CELL_CODERS),
        mode=rec["mode"].astype(np.int64),
        modes=list(CELL_MODES),
        plen=np.where(has_bytes, plen, 0),
        vlen=_bounded(rec["values_length"], where, "segment length"),
        blob=np.where(has_bytes, blob, entries.NONE),
        offset=np.where(has_bytes, offset, 0),
        has_sha=has_bytes,
        sha=np.where(has_bytes, rec["sha256"], np.zeros(n, "V32")),
        chunk_lists=[None] * n,
        has_chunks=np.zeros(n, bool),
        cells=has_cells,
        cell_blob=np.where(has_cells, blob, zero),
        cell_offset=np.where(has_cells, offset, zero),
        cell_length=np.where(has_cells, plen, zero),
        cell_count=rec["count"].astype(np.int64),
        section_dim=section_dim,
    )


def _bounded(values: np.ndarray, where, what: str) -> np.ndarray:
    """A uint64 field as int64, refused past 2**62 (as a JSON entry's would be)."""
    if (values > MAX_OFFSET).any():
        i = int(np.argmax(values > MAX_OFFSET))
        raise ManifestError(f"{where(i)}: {what} {int(values[i])} outside [0, {MAX_OFFSET}]")
    return values.astype(np.int64)


def verify_table(ref: TableRef, raw: bytes, where: str) -> None:
    """A table's bytes are what its reference names (length and SHA-256), before any is parsed."""
    verify_bytes(raw, ref.length, ref.sha256, where)


def verify_bytes(raw: bytes, length: int, sha256: str, where: str) -> None:
    """Bytes are ``length`` long with SHA-256 ``sha256`` (hex), before any is parsed."""
    if len(raw) != length or hashlib.sha256(raw).hexdigest() != sha256:
        raise IntegrityError(f"{where}: SHA-256 mismatch (corrupt table)")
