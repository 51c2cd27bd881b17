"""Cell records: a cut tensor's chunks as fixed binary records, and the rules every chunk meets, checked as arrays.

A Kimi-K2 version lists over a million chunks (grid cells with changes). They reach a reader from a cell
table (docs/FORMAT.md, "Tables"), and reach the publisher's commit and an inline manifest's reader as
:class:`~engine_ext.format.manifest.Chunk` objects. Either way they become one :data:`CELL_RECORD` array
(:func:`records`, which refuses any value the record could not hold as given), and :func:`check` applies
every rule a chunk meets, one numpy pass per rule over all of them. Before, inline chunks were checked one
Python call at a time: rank 0's commit of a K2 version spent about half its 13-21 s there (issue 52).

This module knows records and rules, not manifests: the caller passes the manifest (for its blobs, kind
and coder rules) and the tensors the records belong to, and says how an error names record ``i``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from ..errors import ManifestError
from .chunks import box_numel, boxes
from .chunks import cell_shares as chunks_cell_shares
from .dtypes import dtype_by_name

# A cell table's record (format 7): one chunk in 75 bytes, little-endian (JSON would take ~220).
CELL_RECORD = np.dtype(
    [
        ("cell", "<u4"),
        ("nnz", "<u8"),
        ("blob", "<u4"),
        ("offset", "<u8"),
        ("positions_length", "<u8"),
        ("values_length", "<u8"),
        ("positions_coder", "u1"),
        ("values_coder", "u1"),
        ("mode", "u1"),
        ("sha256", "V32"),
    ]
)
CELL_CODERS = ("none", "all", "raw", "pco", "zstd", "ctx", "ctx-rans")  # a coder's byte in a record: its index
CELL_MODES = (None, "abs", "rel")
CODER_INDEX = {c: i for i, c in enumerate(CELL_CODERS)}
MODE_INDEX = {md: i for i, md in enumerate(CELL_MODES)}
MAX_OFFSET = 1 << 62  # a byte offset or length past this is refused: sums of two stay inside int64 and uint64
_LOWER_HEX = re.compile(r"[0-9a-f]*")

Where = Callable[[int], str]  # how an error names record i ("tensor 'w' cell 3", "tensor 'w': cell table")


def _refuse(bad: np.ndarray, where: Where, msg: str) -> None:
    if bad.any():
        raise ManifestError(f"{where(int(np.argmax(bad)))}: {msg}"[:600])


def records(chunks: Sequence, where: Where) -> np.ndarray:
    """``chunks`` as :data:`CELL_RECORD` records, a field at a time. A value the record would not hold as
    given is refused here, before :func:`check`: an integer field that is not a Python int (a bool, a
    float, a string from hostile JSON), is negative or too wide for its field; a coder or mode not known; a
    SHA-256 that is not 64 lowercase hex digits. Nothing is wrapped, truncated or rounded."""
    n = len(chunks)
    rec = np.zeros(n, CELL_RECORD)
    for f, path in (
        ("cell", "cell"),
        ("nnz", "nnz"),
        ("blob", "blob"),
        ("offset", "offset"),
        ("positions_length", "positions.length"),
        ("values_length", "values.length"),
    ):
        values = list(map(attrgetter(path), chunks))
        if not set(map(type, values)) <= {int}:
            _refuse(np.array([type(v) is not int for v in values]), where, f"its {f} is not an integer")
        top = (1 << 8 * CELL_RECORD[f].itemsize) - 1 if f in ("cell", "blob") else MAX_OFFSET
        try:
            column = np.array(values, np.int64)
        except OverflowError:
            column = np.array([min(max(v, -1), top + 1) for v in values], np.int64)
        _refuse((column < 0) | (column > top), where, f"its {f} is outside [0, {top}]")
        rec[f] = column
    for f, path, index in (
        ("positions_coder", "positions.coder", CODER_INDEX),
        ("values_coder", "values.coder", CODER_INDEX),
        ("mode", "values.mode", MODE_INDEX),
    ):
        values = list(map(attrgetter(path), chunks))
        try:
            rec[f] = [index[v] for v in values]
        except (KeyError, TypeError):  # a name not known, or a JSON list or object (unhashable)
            _refuse(np.array([not isinstance(v, Hashable) or v not in index for v in values]), where, f"unknown {f}")
    shas = list(map(attrgetter("sha256"), chunks))
    if n and not (set(map(type, shas)) == {str} and set(map(len, shas)) == {64}):
        _refuse(np.array([not (type(s) is str and len(s) == 64) for s in shas]), where, "missing or bad sha256")
    hexes = "".join(shas)
    if not _LOWER_HEX.fullmatch(hexes):
        _refuse(np.array([not _LOWER_HEX.fullmatch(s) for s in shas]), where, "missing or bad sha256")
    rec["sha256"] = np.frombuffer(bytes.fromhex(hexes), "V32")
    return rec


@dataclass(frozen=True)
class Owners:
    """The tensors a batch of records belongs to, as columns (tensor j's records: ``counts[j]`` of them, in
    order): a tensor-parallel rank's 140 k cut tensors at once, from a manifest's columns
    (:meth:`of_columns`: no entry object made) or from entry objects (:meth:`of_entries`)."""

    names: Sequence[str]
    dtypes: list[str]  # the distinct dtype names
    dtype: np.ndarray  # per tensor: its code in ``dtypes``
    kinds: list[tuple[tuple, list]]  # the distinct (shape, grid)
    kind: np.ndarray  # per tensor: its code in ``kinds``
    nnz: np.ndarray  # per tensor (uint64)

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of_entries(cls, tensors: Sequence) -> Owners:
        """From tensor entries (valid, each with a grid); their shape and grid lists told apart by identity
        first (a table's entries share them: all alive meanwhile), then by content."""
        by_id: dict = {}
        by_content: dict = {}
        kinds: list[tuple[tuple, list]] = []
        kind = np.empty(len(tensors), np.int64)
        for j, t in enumerate(tensors):
            code = by_id.get((id(t.shape), id(t.grid)))
            if code is None:
                key = (tuple(t.shape), tuple(map(tuple, t.grid)))
                code = by_content.get(key)
                if code is None:
                    code = by_content[key] = len(kinds)
                    kinds.append((key[0], t.grid))
                by_id[(id(t.shape), id(t.grid))] = code
            kind[j] = code
        dtypes = sorted({t.dtype for t in tensors})
        code_of = {d: i for i, d in enumerate(dtypes)}
        return cls(
            [t.name for t in tensors],
            dtypes,
            np.array([code_of[t.dtype] for t in tensors], np.int64),
            kinds,
            kind,
            np.array([t.nnz for t in tensors], np.uint64),
        )

    @classmethod
    def of_columns(cls, c, rows: np.ndarray) -> Owners:
        """From rows ``rows`` of :class:`~engine_ext.format.entries.Columns` ``c`` (each with a grid)."""
        pair = c.shape[rows] * (len(c.grids) + 1) + c.grid[rows]
        distinct, kind = np.unique(pair, return_inverse=True)
        kinds = [(tuple(c.shapes[p // (len(c.grids) + 1)]), c.grids[p % (len(c.grids) + 1)]) for p in distinct.tolist()]
        dtype, used = c.dtype[rows], sorted(set(c.dtype[rows].tolist()))
        remap = np.zeros(len(c.dtypes), np.int64)
        remap[used] = np.arange(len(used))
        names = [c.names[i] for i in rows.tolist()]
        return cls(
            names, [c.dtypes[i] for i in used], remap[dtype], kinds, kind.reshape(-1), c.nnz[rows].astype(np.uint64)
        )

    def cell_shares(self, dim: np.ndarray, shares: np.ndarray, owner: np.ndarray, cell: np.ndarray) -> np.ndarray:
        """The share each record's cell starts in (:func:`~engine_ext.format.chunks.cell_shares`), record i being
        cell ``cell[i]`` of tensor ``owner[i]``, cut along ``dim[owner[i]]`` among ``shares[owner[i]]``; -1 for a
        cell beyond its grid. Made once per distinct (shape, grid, dimension, shares): a K2 version has a handful."""
        radix = int(shares.max(initial=0)) + 1
        code = (self.kind * 2 + dim) * radix + shares
        distinct, of = np.unique(code, return_inverse=True)
        per = []
        for x in distinct.tolist():
            k, n = divmod(x, radix)
            shape, grid = self.kinds[k // 2]
            per.append(chunks_cell_shares(grid, shape, k % 2, n))
        sizes = np.array([len(p) for p in per], np.int64)
        first = np.cumsum(sizes) - sizes
        flat = np.array([s for p in per for s in p] + [-1], np.int64)
        of = of.reshape(-1)[owner]
        inside = cell < sizes[of]
        return flat[np.where(inside, first[of] + cell, len(flat) - 1)]


def check(
    m, tensors: Owners, counts: np.ndarray, rec: np.ndarray, where: Where, whole: np.ndarray | None = None
) -> np.ndarray:
    """Every rule a chunk meets, over ``rec`` (the records of ``tensors`` in order, ``counts[i]`` of tensor
    i's; each tensor already checked valid, with a grid): a known coder pair allowed by ``m`` (once per
    distinct (positions, values, mode, dtype)), a cell of the grid listed once, nnz in [1, the cell's
    elements] and summing to the tensor's, 'all' iff every element changes, 'ctx-rans' in the positions
    segment, raw values of nnz * itemsize bytes, a blob ``m`` lists and a byte range inside it. ``whole``: per
    tensor, whether ``rec`` holds all its records (else, format 12, a rank's shares of them: its changes
    there are at most the tensor's, and may be none). Returns each record's tensor (its index in
    ``tensors``); overlaps are the caller's (within a cell table, or across the whole manifest)."""
    owner = np.repeat(np.arange(len(tensors)), counts)
    pc, vc, mode = rec["positions_coder"], rec["values_coder"], rec["mode"]
    _refuse(
        (pc >= len(CELL_CODERS)) | (vc >= len(CELL_CODERS)) | (mode >= len(CELL_MODES)), where, "unknown coder or mode"
    )
    dtypes = tensors.dtypes
    dt = tensors.dtype[owner]
    combos = np.unique((((pc.astype(np.int64) << 8) | vc) << 8 | mode) << 8 | dt)
    for code in combos.tolist():
        p, v, md, d = code >> 24, (code >> 16) & 255, (code >> 8) & 255, code & 255
        m.check_coders(
            "a chunk", _Segment(CELL_CODERS[p], 0, None), _Segment(CELL_CODERS[v], 0, CELL_MODES[md]), dtypes[d]
        )
    # each cell's elements, per distinct (shape, grid): a TP rank's 70 k tensors have a few dozen
    numels = [cell_numels(shape, grid) for shape, grid in tensors.kinds]
    kinds = tensors.kind
    first = np.cumsum([0] + [len(x) for x in numels])[:-1].astype(np.int64)[kinds]
    cell, nnz = rec["cell"].astype(np.int64), rec["nnz"]
    _refuse(cell >= np.array([len(x) for x in numels], np.int64)[kinds][owner], where, "no such cell in its grid")
    key = owner * (1 << 32) + cell
    o = np.argsort(key, kind="stable")
    twice = np.zeros(len(key), bool)
    twice[o[1:]] = key[o[1:]] == key[o[:-1]]
    _refuse(twice, where, "a cell listed twice")
    box = (np.concatenate(numels) if numels else np.zeros(0, np.uint64))[first[owner] + cell]
    _refuse((nnz == 0) | (nnz > box), where, "its nnz is outside [1, its cell's elements]")
    ends = np.cumsum(counts)
    running = np.concatenate([np.zeros(1, np.uint64), np.cumsum(nnz, dtype=np.uint64)])  # each <= 2**40 cells
    held = running[ends] - running[ends - counts]
    total = tensors.nnz
    full = np.ones(len(tensors), bool) if whole is None else whole
    bad = (full & ((counts == 0) | (held != total))) | (held > total)
    if bad.any():
        i = int(np.argmax(bad))
        raise ManifestError(f"tensor {tensors.names[i]!r}: its chunks hold another count of changes than the tensor")
    plen, vlen, offset, blob = rec["positions_length"], rec["values_length"], rec["offset"], rec["blob"]
    every = pc == CODER_INDEX["all"]
    _refuse(
        (every != (nnz == box)) | (every & (plen != 0)),
        where,
        "positions coder 'all' iff every element changes, with no bytes",
    )
    _refuse(
        (pc == CODER_INDEX["ctx-rans"]) & (vlen != 0), where, "'ctx-rans' keeps its bytes all in the positions segment"
    )
    size = np.array([dtype_by_name(d).itemsize for d in dtypes], np.uint64)[dt]
    _refuse((vc == CODER_INDEX["raw"]) & (vlen != nnz * size), where, "raw values must be nnz * itemsize bytes")
    _refuse(blob >= len(m.blobs), where, "bad blob index")
    big = np.uint64(MAX_OFFSET)  # every term bounded first: their sum cannot wrap
    sizes = np.array([min(b.size, MAX_OFFSET) for b in m.blobs] or [0], np.uint64)
    _refuse((offset > big) | (plen > big) | (vlen > big), where, "byte range beyond its blob")
    _refuse(offset + plen + vlen > sizes[np.minimum(blob, len(sizes) - 1)], where, "byte range beyond its blob")
    return owner


def first_overlap(blob: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[int, int] | None:
    """The first two byte ranges (by blob, then start) that overlap, as indices into the arrays, or None."""
    order = np.lexsort((end, start, blob))
    b, s, e = blob[order], start[order], end[order]
    bad = (b[1:] == b[:-1]) & (s[1:] < e[:-1])
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return int(order[i]), int(order[i + 1])


class _Segment:
    """What :meth:`Manifest.check_coders` reads of a segment (the record's coder bytes, decoded)."""

    __slots__ = ("coder", "length", "mode")

    def __init__(self, coder: str, length: int, mode: str | None):
        self.coder, self.length, self.mode = coder, length, mode


_NUMELS: dict[tuple, np.ndarray] = {}


def cell_numels(shape: tuple, grid) -> np.ndarray:
    """The elements of each cell of ``grid`` (a tensor's, already checked valid), cached per distinct
    (shape, grid): a model has few (a K2 version: a handful among 140,000 tensors)."""
    key = (shape, tuple(map(tuple, grid)))
    got = _NUMELS.get(key)
    if got is None:
        got = np.array([box_numel(b) for b in boxes([list(c) for c in grid], shape)], np.uint64)
        if len(_NUMELS) < 1024:  # a hostile manifest's many grids are computed, not kept
            _NUMELS[key] = got
    return got
