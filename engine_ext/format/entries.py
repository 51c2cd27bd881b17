"""Tensor entries checked as arrays: every rule a manifest's tensor entry meets, one numpy pass per rule.

A Kimi-K2 version lists 140,790 tensors. Its driver checks them all, each TP rank nearly all, and rank 0's
commit checks them before it writes them. One Python call per entry (about 15 us) made that 2 s per read
(issue 52). Here the entries become columns, a field at a time, each refused where it is not the type its
field needs; the rules then run over the columns. The rules that depend on a shape, a grid or a coder
combination run once per distinct value: a model has a handful.

The chunks of a cut tensor are :mod:`engine_ext.format.cells`' (the tensors whose chunks are listed inline
are returned for it); the overlap of byte ranges across the whole manifest is the caller's
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
from .cells import MAX_OFFSET

_LOWER_HEX = re.compile(r"[0-9a-f]*")


@dataclass
class Ranges:
    """The byte ranges the entries claim in their blobs (a changed tensor's own bytes, a cut tensor's cell
    table), and how an error names range i."""

    blob: np.ndarray
    start: np.ndarray
    end: np.ndarray
    where: Callable[[int], str]


def check(m, tensors: Sequence) -> tuple[list, Ranges]:
    """Refuse (ManifestError) unless every entry of ``tensors`` (``m``'s) is valid on its own and its name
    unique: name, dtype, shape and size, counts, fingerprints; an unchanged tensor carries nothing; a changed
    one its coders and byte range, or a valid grid and its chunks' place (a cell table, or a non-empty
    inline list). Returns the tensors whose chunks are listed inline (for :func:`cells.check`) and the byte
    ranges the entries claim."""
    n = len(tensors)

    def where(i: int) -> str:
        return mf._cut(f"tensor {tensors[i].name!r}", 200)

    def refuse(bad: np.ndarray, msg: str) -> None:
        if bad.any():
            raise ManifestError(mf._cut(f"{where(int(np.argmax(bad)))}: {msg}"))

    def column(path: str) -> list:
        return list(map(attrgetter(path), tensors))

    _names(column("name"))
    dtypes = column("dtype")
    itemsize = _per_distinct(dtypes, lambda d, i: mf.dtype_by_name_checked(d, where(i)).itemsize, where, key=_itself)
    shapes = column("shape")
    numel = _per_distinct(shapes, lambda s, i: _shape_numel(s, where(i)), where)
    nnz = _ints(column("nnz"), where, "nnz")
    refuse(nnz > numel, "nnz outside [0, its elements]")
    _fingerprints(column("fingerprint"), range(n))
    base = column("base_fingerprint")
    _fingerprints(base, range(n) if m.kind == mf.DELTA else [i for i, b in enumerate(base) if b is not None])

    plen, vlen = (
        _ints(column("positions.length"), where, "segment length"),
        _ints(column("values.length"), where, "segment length"),
    )
    pcoder, vcoder = column("positions.coder"), column("values.coder")
    grid, chunk_lists, cell_refs = column("grid"), column("chunks"), column("cells")
    has_grid = np.array([g is not None for g in grid], bool)
    has_chunks = np.array([c is not None for c in chunk_lists], bool)
    has_cells = np.array([c is not None for c in cell_refs], bool)
    no_coders = np.array([p == "none" and v == "none" for p, v in zip(pcoder, vcoder)], bool)
    blob, sha = column("blob"), column("sha256")
    no_bytes = np.array([b is None and s is None for b, s in zip(blob, sha)], bool)

    unchanged = nnz == 0
    refuse(
        unchanged
        & (~no_coders | (plen + vlen > 0) | np.array([bool(c) or bool(g) for c, g in zip(chunk_lists, grid)], bool)),
        "an unchanged tensor carries no bytes",
    )
    if m.kind == mf.DELTA:
        refuse(
            unchanged & np.array([f != b for f, b in zip(column("fingerprint"), base)], bool),
            "unchanged but fingerprints differ",
        )

    whole = ~unchanged & ~has_grid & ~has_chunks & ~has_cells
    ranges = [_whole_bytes(m, tensors, whole, nnz, numel, itemsize, plen, vlen, blob, sha, where)]
    cut_rows = np.flatnonzero(~unchanged & ~whole)
    if len(cut_rows):
        if m.format_version < (3 if m.kind == mf.DELTA else mf.CHUNKED_ANCHORS):
            raise ManifestError(f"{where(int(cut_rows[0]))}: only format-3 deltas and format-6 anchors come in chunks")
        if m.kind == mf.ANCHOR:
            refuse(~unchanged & ~whole & (nnz != numel), "a chunked anchor lists every cell")
        cut_grids = [grid[i] for i in cut_rows.tolist()]
        grids = _per_distinct(
            cut_grids, lambda g, i: _grid_cells(g, where(int(cut_rows[i]))), lambda i: where(int(cut_rows[i]))
        )
        cells = np.zeros(n, np.int64)
        cells[cut_rows] = grids
        # each distinct grid cuts a shape of its own: its last cut points are that shape's leading sizes
        _per_distinct(
            [(g, s) for g, s in zip(cut_grids, (shapes[i] for i in cut_rows.tolist()))],
            lambda gs, i: _valid_grid(gs, where(int(cut_rows[i]))),
            lambda i: where(int(cut_rows[i])),
            key=lambda gs: (id(gs[0]), id(gs[1])),
        )
        refuse(~unchanged & ~whole & ~(no_coders & no_bytes), "a chunked tensor carries its bytes in its chunks only")
        refuse(has_cells & has_chunks, "chunks both inline and in a cell table")
        ranges.append(_cell_tables(m, np.flatnonzero(~unchanged & has_cells), nnz, cells, cell_refs, where))
        inline = np.flatnonzero(~unchanged & ~whole & ~has_cells)
        refuse(
            np.isin(np.arange(n), inline) & np.array([not isinstance(c, list) or not c for c in chunk_lists], bool),
            "a chunked tensor needs a non-empty chunk list",
        )
    else:
        inline = np.zeros(0, np.int64)
    rows = np.concatenate([r[0] for r in ranges])
    labels = [r[1] for r in ranges]
    at = np.cumsum([0] + [len(r[0]) for r in ranges])

    def range_where(i: int) -> str:
        part = int(np.searchsorted(at, i, "right")) - 1
        return labels[part](int(rows[i]))

    return [tensors[int(i)] for i in inline], Ranges(
        np.concatenate([r[2] for r in ranges]),
        np.concatenate([r[3] for r in ranges]),
        np.concatenate([r[4] for r in ranges]),
        range_where,
    )


def _whole_bytes(m, tensors, rows_mask, nnz, numel, itemsize, plen, vlen, blob, sha, where):
    """A changed tensor's own bytes: coders (once per distinct combination), 'all' iff every element
    changes, 'ctx-rans' in one segment, raw values of nnz * itemsize, a blob and a range inside it, a SHA-256."""

    def refuse(bad, msg):
        if bad.any():
            raise ManifestError(mf._cut(f"{where(int(np.argmax(bad)))}: {msg}"))

    rows = np.flatnonzero(rows_mask)
    sub = [tensors[int(i)] for i in rows]
    combos: dict = {}
    for i, t in zip(rows.tolist(), sub):
        p, v = t.positions, t.values
        try:
            key = (p.coder, v.coder, v.mode, t.dtype)
            if key not in combos:
                combos[key] = i
                m.check_coders(where(i), p, v, t.dtype)
        except TypeError:  # an unhashable coder or mode (a JSON list or object)
            raise ManifestError(
                mf._cut(f"{where(i)}: unknown coder or mode {p.coder!r:.40}/{v.coder!r:.40}/{v.mode!r:.40}")
            ) from None
    pc = np.array([t.positions.coder for t in sub], object) if sub else np.zeros(0, object)
    vc = np.array([t.values.coder for t in sub], object) if sub else np.zeros(0, object)
    k, p, v = nnz[rows], plen[rows], vlen[rows]
    every = pc == "all"
    refuse(
        _spread(rows_mask, (every != (k == numel[rows])) | (every & (p != 0))),
        "positions coder 'all' iff every element changes, with no bytes",
    )
    refuse(
        _spread(rows_mask, (pc == "ctx-rans") & (v != 0)),
        f"'ctx-rans' needs format {mf.RANS_STREAMS}, its bytes all in the positions segment",
    )
    refuse(_spread(rows_mask, (vc == "raw") & (v != k * itemsize[rows])), "raw values must be nnz * itemsize bytes")
    blobs = _ints([blob[int(i)] for i in rows], lambda j: where(int(rows[j])), "blob index")
    refuse(_spread(rows_mask, blobs >= len(m.blobs)), "bad blob index")
    offset = _ints([tensors[int(i)].offset for i in rows], lambda j: where(int(rows[j])), "offset")
    sizes = np.array([min(b.size, MAX_OFFSET) for b in m.blobs] or [0], np.uint64)
    end = offset.astype(np.uint64) + p.astype(np.uint64) + v.astype(np.uint64)  # each <= 2**62: no wrap
    refuse(_spread(rows_mask, end > sizes[np.minimum(blobs, len(sizes) - 1)]), "byte range beyond its blob")
    _shas([sha[int(i)] for i in rows], lambda j: where(int(rows[j])))
    return rows, where, blobs, offset, end.astype(np.int64)


def _cell_tables(m, rows, nnz, cells, refs, where):
    """A cut tensor's cell table's place (format 7): a range of a blob with a flat SHA-256, 75 bytes per
    record, between 1 and min(its grid's cells, its changes) records, and a SHA-256."""
    named = lambda j: where(int(rows[j])) + ": cell table"

    def refuse(bad, msg):
        if bad.any():
            raise ManifestError(mf._cut(f"{named(int(np.argmax(bad)))}: {msg}"))

    sub = [refs[int(i)] for i in rows]
    if not all(isinstance(r, mf.TableRef) for r in sub):
        refuse(np.array([not isinstance(r, mf.TableRef) for r in sub], bool), "a bad table reference")
    if len(sub) and m.format_version < mf.TABLES:
        raise ManifestError(f"{named(0)}: only format-7 manifests keep tables in their blobs")
    blob = _ints([r.blob for r in sub], named, "blob")
    offset = _ints([r.offset for r in sub], named, "offset")
    length = _ints([r.length for r in sub], named, "length")
    count = _ints([r.count for r in sub], named, "count")
    sizes = np.array([min(b.size, MAX_OFFSET) for b in m.blobs] or [0], np.uint64)
    end = offset.astype(np.uint64) + length.astype(np.uint64)  # each <= 2**62: no wrap
    refuse((blob >= len(m.blobs)) | (end > sizes[np.minimum(blob, len(sizes) - 1)]), "table beyond its blob")
    flat = np.array([b.digest is not None for b in m.blobs] or [False], bool)
    refuse(flat[np.minimum(blob, len(flat) - 1)], "a blob holding tables has a flat SHA-256")
    refuse(
        (count < 1) | (count > np.minimum(cells[rows], nnz[rows])),
        "a cell table of more records than its grid's cells or its changes",
    )
    refuse(
        length != count * mf.CELL_RECORD_BYTES, f"a cell table's length is not {mf.CELL_RECORD_BYTES} bytes per record"
    )
    _shas([r.sha256 for r in sub], named)
    return rows, lambda i: where(i) + ": cell table", blob, offset, end.astype(np.int64)


def _spread(mask: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """``sub`` (one value per True of ``mask``) at those places, False elsewhere: errors name the entry."""
    out = np.zeros(len(mask), bool)
    out[mask] = sub
    return out


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


def _fingerprints(fps: list, rows) -> None:
    """Each of ``fps[rows]`` 16 lower-case hex digits (:func:`fingerprint.parse_all`: all joined in one match)."""
    fpr.parse_all([fps[i] for i in rows])


def _shas(shas: list, where: Callable[[int], str]) -> None:
    if set(map(type, shas)) <= {str} and set(map(len, shas)) <= {64} and _LOWER_HEX.fullmatch("".join(shas)):
        return
    for i, s in enumerate(shas):
        if not isinstance(s, str) or not mf._SHA_RE.fullmatch(s):
            raise ManifestError(f"{where(i)}: missing or bad sha256")


def _itself(v):
    return v


def _identity(v) -> int:
    """The same object: entries read from one tensor table share their shape and grid lists (held alive
    by the caller's list for the whole check, so no two share an id)."""
    return id(v)


def _per_distinct(values: list, rule, where, key=_identity) -> np.ndarray:
    """``rule(value, i)`` once per distinct value (``i``: its first row), spread to every row as an array.
    Values are told apart by ``key`` first (cheap), then by content: the value itself for ``key=_itself``
    (strings), else its ``repr``, which keeps every element's type (a bool or a float is not the int it
    equals: the rule must see it)."""
    out: list[int] = []
    codes: list[int] = []
    by_key: dict = {}
    by_content: dict = {}
    for i, v in enumerate(values):
        k = key(v)
        try:
            code = by_key.get(k)
        except TypeError:  # an unhashable value (hostile JSON): the rule refuses it, or it is malformed
            rule(v, i)
            raise ManifestError(f"{where(i)}: malformed entry") from None
        if code is None:
            content = v if key is _itself else repr(v)
            code = by_content.get(content)
            if code is None:
                code = by_content[content] = len(out)
                out.append(rule(v, i))
            by_key[k] = code
        codes.append(code)
    return np.array(out, np.int64)[np.array(codes, np.int64)] if values else np.zeros(0, np.int64)


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


def _valid_grid(grid_shape, where: str) -> int:
    grid, shape = grid_shape
    if not chunks.valid_cuts(grid, shape):
        raise ManifestError(f"{where}: a chunked tensor needs a valid grid")
    return 0
