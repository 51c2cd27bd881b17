"""Tensor entries checked as arrays: every rule a manifest's tensor entry meets, one numpy pass per rule.

A Kimi-K2 version lists 140,790 tensors. Its driver checks them all, each TP rank nearly all, and rank 0's
commit checks them before it writes them. One Python call per entry (about 15 us) made that 2 s per read
(issue 52). The entries become :class:`Columns`: one array per numeric field, and each categorical field (a
dtype, a shape, a grid, a coder, a mode) as codes into its distinct values, so a rule that depends on one runs
once per distinct value (a model has a handful). Columns are made from entry objects (:meth:`Columns.of_entries`:
inline JSON, a publisher's own entries), which refuses any field that is not the type it needs, or straight
from a format-10 tensor table's records (:func:`engine_ext.format.tensor_records.read_tensor_tables`), for which no
object is made: the rules (:func:`check`) are the same for both.

The chunks of a cut tensor are :mod:`engine_ext.format.cells`' (the rows whose chunks are listed inline are
returned for it); the overlap of byte ranges across the whole manifest is the caller's
(:meth:`Manifest.validate`), over the ranges returned here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from ..errors import ManifestError
from . import chunks
from . import fingerprint as fpr
from . import manifest as mf  # its constants and rules, read at call time (manifest imports this module)
from .bulk import MadeWhenAsked
from .cells import MAX_OFFSET

_LOWER_HEX = re.compile(r"[0-9a-f]*")
NONE = -1  # the code of an absent grid, blob or cell table


def label(name) -> str:
    """How an error names a tensor entry."""
    return mf._cut(f"tensor {name!r}", 200)


@dataclass
class Columns:
    """Tensor entries as columns, in entry order: what :func:`check` runs over and what a reader of the whole
    model sums over (names, dtypes, shapes, changes, fingerprints) without an object per entry. A categorical
    field is an int64 code array into its list of distinct values (``-1``: absent); positions and values
    coders have a vocabulary each."""

    names: list[str]
    dtype: np.ndarray
    dtypes: list
    shape: np.ndarray
    shapes: list
    grid: np.ndarray  # -1: no grid
    grids: list
    nnz: np.ndarray  # int64
    fingerprint: np.ndarray  # uint64
    base: np.ndarray  # uint64, 0 where has_base is False
    has_base: np.ndarray
    pcoder: np.ndarray
    pcoders: list
    vcoder: np.ndarray
    vcoders: list
    mode: np.ndarray
    modes: list
    plen: np.ndarray
    vlen: np.ndarray
    blob: np.ndarray  # -1: none (a changed whole tensor's bytes)
    offset: np.ndarray
    has_sha: np.ndarray  # its bytes' SHA-256 is given (64 lower-case hex digits)
    sha: np.ndarray  # the SHA-256 as 32 bytes ("V32"), zero where not given
    chunk_lists: list  # each entry's inline chunk list, or None (always, for a binary table's entries)
    has_chunks: np.ndarray
    cells: np.ndarray  # bool: its chunks lie in a cell table (format 7), placed by cell_*
    cell_blob: np.ndarray
    cell_offset: np.ndarray
    cell_length: np.ndarray
    cell_count: np.ndarray  # records: of its cell table, or (format 12) in its table's cell sections
    section_dim: np.ndarray  # format 12: its chunks lie in its table's cell sections, shared out along 0 or 1; -1: not

    def __len__(self) -> int:
        return len(self.names)

    def where(self, i: int) -> str:
        """How an error names entry ``i``."""
        return label(self.names[i])

    def model_fingerprints(self, keys: np.ndarray, delta: bool) -> tuple[int, int | None]:
        """The model fingerprint of these entries (name keys ``keys``, in order) and, for a delta, the base
        model fingerprint: each a sum over the entries, so the shares of a sharded version's ranks add up to
        the version's (mod 2**64: :func:`~engine_ext.format.fingerprint.fmt`)."""
        return fpr.combined(keys, self.fingerprint), fpr.combined(keys, self.base) if delta else None

    def changed(self) -> list[str]:
        """The names of the entries with changes."""
        return [self.names[i] for i in np.flatnonzero(self.nnz).tolist()]

    def dtype_names(self) -> list[str]:
        return [self.dtypes[c] for c in self.dtype.tolist()]

    def shape_tuples(self) -> list[tuple]:
        per = [tuple(s) for s in self.shapes]
        return [per[c] for c in self.shape.tolist()]

    def itemsizes(self) -> np.ndarray:
        """Each entry's element size in bytes, its dtype checked once per distinct dtype (naming an entry)."""
        return _per_code(self.dtype, self.dtypes, lambda d, i: mf.dtype_by_name_checked(d, self.where(i)).itemsize)

    @classmethod
    def of_entries(cls, tensors: Sequence) -> Columns:
        """``tensors`` (TensorEntry objects) as columns, a field at a time; a field that is not the type the
        column needs (hostile JSON: a string where an int goes, a bool, a float) is refused naming the entry."""
        n = len(tensors)

        def where(i: int) -> str:
            return label(tensors[i].name)

        def column(path: str) -> list:
            return list(map(attrgetter(path), tensors))

        names = column("name")
        _names(names)
        fps = fpr.parse_all(column("fingerprint"))  # raises ValueError naming the first bad one, as a base's
        base = column("base_fingerprint")
        has_base = np.array([b is not None for b in base], bool)
        base_fp = np.zeros(n, np.uint64)
        base_fp[has_base] = fpr.parse_all([b for b in base if b is not None])
        blob = column("blob")
        given = [i for i, b in enumerate(blob) if b is not None]
        blobs = np.full(n, NONE, np.int64)
        blobs[given] = _ints([blob[i] for i in given], lambda j: where(given[j]), "blob index")
        sha = column("sha256")
        has_sha = np.array([s is not None for s in sha], bool)
        given_sha = [s for s in sha if s is not None]
        _shas(given_sha, lambda j: where(int(np.flatnonzero(has_sha)[j])))
        sha_bytes = np.zeros(n, "V32")
        sha_bytes[has_sha] = np.frombuffer(bytes.fromhex("".join(given_sha)), "V32")
        chunk_lists = column("chunks")
        refs = column("cells")
        shared = [(i, r) for i, r in enumerate(refs) if isinstance(r, mf.CellSections)]
        section_dim = np.full(n, NONE, np.int64)
        section_count = np.zeros(n, np.int64)
        for i, r in shared:  # a rank's entries as read (format 12), checked when read: taken as they are
            section_dim[i], section_count[i] = r.dim, r.records
        has_cells = np.array([r is not None for r in refs], bool) & (section_dim == NONE)
        rows = np.flatnonzero(has_cells)
        sub = [refs[i] for i in rows.tolist()]
        named = lambda j: where(int(rows[j])) + ": cell table"
        if not all(isinstance(r, mf.TableRef) for r in sub):
            j = next(j for j, r in enumerate(sub) if not isinstance(r, mf.TableRef))
            raise ManifestError(f"{named(j)}: a bad table reference")
        cell = {f: np.zeros(n, np.int64) for f in ("blob", "offset", "length", "count")}
        for f, col in cell.items():
            col[rows] = _ints([getattr(r, f) for r in sub], named, f)
        _shas([r.sha256 for r in sub], named)
        dtype, dtypes = codes_of(column("dtype"), _itself)
        shape, shapes = codes_of(column("shape"))
        grid, grids = codes_of(column("grid"), none=True)
        pcoder, pcoders = codes_of(column("positions.coder"), _itself)
        vcoder, vcoders = codes_of(column("values.coder"), _itself)
        mode, modes = codes_of(column("values.mode"), _itself)
        return cls(
            names=names,
            dtype=dtype,
            dtypes=dtypes,
            shape=shape,
            shapes=shapes,
            grid=grid,
            grids=grids,
            nnz=_ints(column("nnz"), where, "nnz"),
            fingerprint=fps,
            base=base_fp,
            has_base=has_base,
            pcoder=pcoder,
            pcoders=pcoders,
            vcoder=vcoder,
            vcoders=vcoders,
            mode=mode,
            modes=modes,
            plen=_ints(column("positions.length"), where, "segment length"),
            vlen=_ints(column("values.length"), where, "segment length"),
            blob=blobs,
            offset=_ints(column("offset"), where, "offset"),
            has_sha=has_sha,
            sha=sha_bytes,
            chunk_lists=chunk_lists,
            has_chunks=np.array([c is not None for c in chunk_lists], bool),
            cells=has_cells,
            cell_blob=cell["blob"],
            cell_offset=cell["offset"],
            cell_length=cell["length"],
            cell_count=np.where(section_dim == NONE, cell["count"], section_count),
            section_dim=section_dim,
        )


class ColumnEntries(MadeWhenAsked):
    """Tensor entries held as :class:`Columns` (a binary table's, as read): the entry objects are made all
    together the first time one is asked for (:meth:`make`). A reader of the whole model (the driver) checks
    and sums over the columns and never asks; a rank that walks its entries does."""

    def __init__(self, columns: Columns):
        super().__init__()
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns)

    def __repr__(self) -> str:
        return f"<{len(self)} tensor entries as columns>"


@dataclass
class Ranges:
    """The byte ranges the entries claim in their blobs (a changed tensor's own bytes, a cut tensor's cell
    table), and how an error names range i."""

    blob: np.ndarray
    start: np.ndarray
    end: np.ndarray
    where: Callable[[int], str]


def joined(a: Ranges, b: Ranges) -> Ranges:
    """The ranges of ``a`` then ``b``, each still named as its own."""
    n = len(a.blob)
    return Ranges(
        np.concatenate([a.blob, b.blob]),
        np.concatenate([a.start, b.start]),
        np.concatenate([a.end, b.end]),
        lambda i: a.where(i) if i < n else b.where(i - n),
    )


def check(m, c: Columns) -> tuple[np.ndarray, Ranges]:
    """Refuse (ManifestError) unless every entry of ``c`` (``m``'s) is valid on its own and its name unique:
    name, dtype, shape and size, counts, fingerprints; an unchanged tensor carries nothing; a changed one its
    coders and byte range, or a valid grid and its chunks' place (a cell table, or a non-empty inline list).
    Returns the rows whose chunks are listed inline (for :func:`cells.check`) and the byte ranges the entries
    claim."""
    n = len(c)
    where = c.where

    def refuse(bad: np.ndarray, msg: str) -> None:
        if bad.any():
            raise ManifestError(mf._cut(f"{where(int(np.argmax(bad)))}: {msg}"))

    itemsize = c.itemsizes()
    numel = _per_code(c.shape, c.shapes, lambda s, i: _shape_numel(s, where(i)))
    refuse(c.nnz > numel, "nnz outside [0, its elements]")
    if m.kind == mf.DELTA and not c.has_base.all():
        refuse(~c.has_base, "bad fingerprint None: a delta's every entry has a base fingerprint")
    no_coders = _flags(c.pcoder, c.pcoders, lambda x: x == "none") & _flags(c.vcoder, c.vcoders, lambda x: x == "none")
    has_grid = c.grid != NONE
    chunks_given = np.array([bool(x) for x in c.chunk_lists], bool) if c.has_chunks.any() else c.has_chunks
    unchanged = c.nnz == 0
    refuse(
        unchanged & (~no_coders | (c.plen + c.vlen > 0) | chunks_given | _flags(c.grid, c.grids, bool)),
        "an unchanged tensor carries no bytes",
    )
    if m.kind == mf.DELTA:
        refuse(unchanged & (c.fingerprint != c.base), "unchanged but fingerprints differ")

    sectioned = c.section_dim != NONE
    elsewhere = c.cells | sectioned  # its chunks lie in a cell table or its table's cell sections
    whole = ~unchanged & ~has_grid & ~c.has_chunks & ~elsewhere
    ranges = [_whole_bytes(m, c, whole, numel, itemsize)]
    cut_rows = np.flatnonzero(~unchanged & ~whole)
    if len(cut_rows):
        if m.format_version < (3 if m.kind == mf.DELTA else mf.CHUNKED_ANCHORS):
            raise ManifestError(f"{where(int(cut_rows[0]))}: only format-3 deltas and format-6 anchors come in chunks")
        if m.kind == mf.ANCHOR:
            refuse(~unchanged & ~whole & (c.nnz != numel), "a chunked anchor lists every cell")
        cut = np.zeros(n, bool)
        cut[cut_rows] = True
        refuse(cut & ~has_grid, "a chunked tensor needs a valid grid")
        cells = _per_code(c.grid, c.grids, lambda g, i: _grid_cells(g, where(i)), rows=cut_rows)
        # each distinct grid cuts a shape of its own: its last cut points are that shape's leading sizes
        pair = c.grid[cut_rows] * len(c.shapes) + c.shape[cut_rows]
        for p, i in zip(*(x.tolist() for x in np.unique(pair, return_index=True))):
            if not chunks.valid_cuts(c.grids[p // len(c.shapes)], c.shapes[p % len(c.shapes)]):
                raise ManifestError(f"{where(int(cut_rows[i]))}: a chunked tensor needs a valid grid")
        refuse(
            cut & ~(no_coders & (c.blob == NONE) & ~c.has_sha), "a chunked tensor carries its bytes in its chunks only"
        )
        refuse(elsewhere & c.has_chunks, "chunks both inline and in a cell table")
        ranges.append(_cell_tables(m, c, np.flatnonzero(cut & c.cells), cells))
        _cell_sections(m, c, np.flatnonzero(cut & sectioned), cells)
        inline = np.flatnonzero(cut & ~elsewhere)
        empty = [i for i in inline.tolist() if not isinstance(c.chunk_lists[i], list) or not c.chunk_lists[i]]
        if empty:
            raise ManifestError(f"{where(empty[0])}: a chunked tensor needs a non-empty chunk list")
    else:
        inline = np.zeros(0, np.int64)
    rows = np.concatenate([r[0] for r in ranges])
    labels = [r[1] for r in ranges]
    at = np.cumsum([0] + [len(r[0]) for r in ranges])

    def range_where(i: int) -> str:
        part = int(np.searchsorted(at, i, "right")) - 1
        return labels[part](int(rows[i]))

    return inline, Ranges(
        np.concatenate([r[2] for r in ranges]),
        np.concatenate([r[3] for r in ranges]),
        np.concatenate([r[4] for r in ranges]),
        range_where,
    )


def _whole_bytes(m, c: Columns, rows_mask, numel, itemsize):
    """A changed tensor's own bytes: coders (once per distinct combination), 'all' iff every element
    changes, 'ctx-rans' in one segment, raw values of nnz * itemsize, a blob and a range inside it, a SHA-256."""
    where = c.where

    def refuse(bad, msg):
        if bad.any():
            raise ManifestError(mf._cut(f"{where(int(np.argmax(bad)))}: {msg}"))

    rows = np.flatnonzero(rows_mask)
    sizes = (len(c.pcoders), len(c.vcoders), len(c.modes), len(c.dtypes))
    combo = (
        np.ravel_multi_index((c.pcoder[rows], c.vcoder[rows], c.mode[rows], c.dtype[rows]), sizes)
        if len(rows)
        else rows
    )
    for code, i in zip(*(x.tolist() for x in np.unique(combo, return_index=True))):
        p, v, md, d = np.unravel_index(code, sizes)
        pc, vc, mode = c.pcoders[p], c.vcoders[v], c.modes[md]
        try:
            m.check_coders(where(int(rows[i])), mf.Segment(pc, 0), mf.Segment(vc, 0, mode), c.dtypes[d])
        except TypeError:  # an unhashable coder or mode (a JSON list or object)
            raise ManifestError(
                mf._cut(f"{where(int(rows[i]))}: unknown coder or mode {pc!r:.40}/{vc!r:.40}/{mode!r:.40}")
            ) from None
    every = _flags(c.pcoder, c.pcoders, lambda x: x == "all")
    refuse(
        rows_mask & ((every != (c.nnz == numel)) | (every & (c.plen != 0))),
        "positions coder 'all' iff every element changes, with no bytes",
    )
    refuse(
        rows_mask & _flags(c.pcoder, c.pcoders, lambda x: x == "ctx-rans") & (c.vlen != 0),
        f"'ctx-rans' needs format {mf.RANS_STREAMS}, its bytes all in the positions segment",
    )
    raw = _flags(c.vcoder, c.vcoders, lambda x: x == "raw")
    refuse(rows_mask & raw & (c.vlen != c.nnz * itemsize), "raw values must be nnz * itemsize bytes")
    blob = c.blob[rows]
    refuse(rows_mask & ((c.blob == NONE) | (c.blob >= len(m.blobs))), "bad blob index")
    blob_sizes = np.array([min(b.size, MAX_OFFSET) for b in m.blobs] or [0], np.uint64)
    offset = c.offset[rows]
    end = offset.astype(np.uint64) + c.plen[rows].astype(np.uint64) + c.vlen[rows].astype(np.uint64)  # each <= 2**62
    refuse(_spread(rows_mask, end > blob_sizes[np.minimum(blob, len(blob_sizes) - 1)]), "byte range beyond its blob")
    refuse(rows_mask & ~c.has_sha, "missing or bad sha256")
    return rows, where, blob, offset, end.astype(np.int64)


def _cell_tables(m, c: Columns, rows, cells):
    """A cut tensor's cell table's place (format 7): a range of a blob with a flat SHA-256, 75 bytes per
    record, between 1 and min(its grid's cells, its changes) records."""
    named = lambda j: c.where(int(rows[j])) + ": cell table"

    def refuse(bad, msg):
        if bad.any():
            raise ManifestError(mf._cut(f"{named(int(np.argmax(bad)))}: {msg}"))

    if len(rows) and m.format_version < mf.TABLES:
        raise ManifestError(f"{named(0)}: only format-7 manifests keep tables in their blobs")
    blob, offset, length, count = (x[rows] for x in (c.cell_blob, c.cell_offset, c.cell_length, c.cell_count))
    sizes = np.array([min(b.size, MAX_OFFSET) for b in m.blobs] or [0], np.uint64)
    end = offset.astype(np.uint64) + length.astype(np.uint64)  # each <= 2**62: no wrap
    refuse((blob >= len(m.blobs)) | (end > sizes[np.minimum(blob, len(sizes) - 1)]), "table beyond its blob")
    flat = np.array([b.digest is not None for b in m.blobs] or [False], bool)
    refuse(flat[np.minimum(blob, len(flat) - 1)], "a blob holding tables has a flat SHA-256")
    refuse(
        (count < 1) | (count > np.minimum(cells[rows], c.nnz[rows])),
        "a cell table of more records than its grid's cells or its changes",
    )
    refuse(
        length != count * mf.CELL_RECORD_BYTES, f"a cell table's length is not {mf.CELL_RECORD_BYTES} bytes per record"
    )
    return rows, lambda i: c.where(i) + ": cell table", blob, offset, end.astype(np.int64)


def _cell_sections(m, c: Columns, rows, cells) -> None:
    """A cut tensor whose chunks lie in its table's cell sections (format 12): a grid over two dimensions,
    between 1 and min(its grid's cells, its changes) records. The sections' places are its table's (checked
    once per table: Manifest.validate), their records the reader's (:func:`engine_ext.format.cell_reads.read_cells`)."""
    if not len(rows):
        return
    named = lambda j: c.where(int(rows[j])) + ": cell sections"
    if m.format_version < mf.CELL_SECTIONS:
        raise ManifestError(f"{named(0)}: only format-{mf.CELL_SECTIONS} manifests keep cell sections")
    dims = _per_code(c.grid, c.grids, lambda g, i: len(g), rows=rows)[rows]
    count = c.cell_count[rows]
    bad = (dims != 2) | (count < 1) | (count > np.minimum(cells[rows], c.nnz[rows]))
    if bad.any():
        raise ManifestError(
            mf._cut(
                f"{named(int(np.argmax(bad)))}: a grid of two dimensions and 1 to min(its cells, its changes) records"
            )
        )


def _spread(mask: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """``sub`` (one value per True of ``mask``) at those places, False elsewhere: errors name the entry."""
    out = np.zeros(len(mask), bool)
    out[mask] = sub
    return out


def _spread_codes(codes: np.ndarray, per_value: list) -> np.ndarray:
    """Each row's value, from one value per code (``-1``: 0)."""
    table = np.array([*per_value, 0], np.int64)
    return table[codes]


def _per_code(codes: np.ndarray, values: list, rule, rows: np.ndarray | None = None) -> np.ndarray:
    """``rule(value, i)`` once per distinct value the rows (``rows``: those only) use, ``i`` its first row,
    spread to every row as an int64 array (0 where not computed)."""
    sub = codes if rows is None else codes[rows]
    out = [0] * len(values)
    for code, i in zip(*(x.tolist() for x in np.unique(sub, return_index=True))):
        if code != NONE:
            out[code] = rule(values[code], i if rows is None else int(rows[i]))
    return _spread_codes(codes, out)


def _flags(codes: np.ndarray, values: list, test) -> np.ndarray:
    """Each row's ``test(value)`` as a bool array (False where absent), ``test`` run once per distinct value."""
    return np.array([bool(test(v)) for v in values] + [False], bool)[codes]


def codes_of(values: list, key=None, none: bool = False) -> tuple[np.ndarray, list]:
    """Each value's code into the distinct values (in first-seen order); with ``none``, None is ``-1``. Values
    are told apart by ``key`` first (cheap: the object's identity by default, entries read from one table
    share their shape and grid lists), then by content with types (``repr``: a bool or a float is not the int
    it equals, and a rule must see it). Tensor tables' shapes and grids are coded this way too."""
    key = key or id
    distinct: list = []
    codes: list[int] = []
    by_key: dict = {}
    by_content: dict = {}
    for v in values:
        if none and v is None:
            codes.append(NONE)
            continue
        try:
            k = key(v)
            code = by_key.get(k)
        except TypeError:  # an unhashable value (hostile JSON): told apart by content only
            k, code = None, None
        if code is None:
            content = repr(v)
            code = by_content.get(content)
            if code is None:
                code = by_content[content] = len(distinct)
                distinct.append(v)
            if k is not None:
                by_key[k] = code
        codes.append(code)
    return np.array(codes, np.int64), distinct


def _names(names: list) -> None:
    if set(map(type, names)) <= {str} and all(0 < len(x) <= 1024 for x in names) and len(set(names)) == len(names):
        return
    seen: set = set()
    for x in names:
        if not isinstance(x, str) or not x or len(x) > 1024 or x in seen:
            raise ManifestError(mf._cut(f"bad or duplicate tensor name {x!r:.100}"))
        seen.add(x)


def _ints(values: list, where: Callable[[int], str], what: str) -> np.ndarray:
    """``values`` as int64, each an int (not a bool) in [0, 2**62]: else refused, naming the first."""
    if not set(map(type, values)) <= {int}:
        bad = [type(v) is not int for v in values]
        raise ManifestError(mf._cut(f"{where(bad.index(True))}: bad {what} {values[bad.index(True)]!r:.40}"))
    try:
        out = np.array(values, np.int64) if values else np.zeros(0, np.int64)
    except OverflowError:
        out = np.array([min(max(v, -1), MAX_OFFSET + 1) for v in values], np.int64)
    if ((out < 0) | (out > MAX_OFFSET)).any():
        i = int(np.argmax((out < 0) | (out > MAX_OFFSET)))
        raise ManifestError(mf._cut(f"{where(i)}: {what} {values[i]!r:.40} outside [0, {MAX_OFFSET}]"))
    return out


def _shas(shas: list, where: Callable[[int], str]) -> None:
    if set(map(type, shas)) <= {str} and set(map(len, shas)) <= {64} and _LOWER_HEX.fullmatch("".join(shas)):
        return
    for i, s in enumerate(shas):
        if not isinstance(s, str) or not mf._SHA_RE.fullmatch(s):
            raise ManifestError(f"{where(i)}: missing or bad sha256")


def _itself(v):
    return v


def _shape_numel(shape, where: str) -> int:
    if not isinstance(shape, list) or len(shape) > mf.MAX_NDIM or not all(mf._is_int(s) and s >= 0 for s in shape):
        raise ManifestError(mf._cut(f"{where}: bad shape {shape!r}"))
    numel = math.prod(shape)
    if numel > mf.MAX_NUMEL:
        raise ManifestError(f"{where}: {numel} elements, over the {mf.MAX_NUMEL} limit")
    return numel


def _grid_cells(grid, where: str) -> int:
    """The cells of a grid (cut points per leading dimension), refused unless a list of lists."""
    if not isinstance(grid, list) or not all(isinstance(c, list) for c in grid):
        raise ManifestError(f"{where}: a chunked tensor needs a valid grid")
    return math.prod(len(c) - 1 for c in grid)
