"""A cut tensor's changes grouped by grid cell, as the codec codes them, and placed back, in numba.

:func:`engine_ext.format.codec.encode_tensor` codes each cell of a big tensor's grid
(:mod:`engine_ext.format.chunks`) on its own: box-local positions as gaps, and the values as
the new bits (``abs``) or as steps in ordered bit space (``rel``). Done with numpy and torch
per cell (the cell of every change, a stable sort by cell, box-local indices, gathers, steps)
that took a dozen passes over the changes and most of a delta's background time; here one
pass finds each change's cell and box-local index, a second writes its gap and values at
its cell's place. The results are the arrays :func:`chunks.split`, :func:`chunks.to_local`
and :func:`engine_ext.format.dtypes.step_between` give, so the bytes coded are the same.

A reader does the inverse (:func:`place`): the decoded cells of a tensor, each in box-local
row-major order, become one run of global positions in ascending order and their values beside
them. Cells side by side along dimension 1 interleave row by row; concatenating
:func:`chunks.to_global` of each and sorting (what the reader did) cost a sort of every change and
most of a K2 rank's decode. Here each band of cells (the cells sharing a row range, in column order)
is placed in one or two passes: a band of one cell is in order already and mapped straight; else row
by row where its cells hold many changes per row, else by a counting sort on the row (measured on K2's experts: 8 x 2 cells at 0.3 % density hold ~10 changes
per (row, cell), 2 x 8 cells under one).
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def _group(pos, new, old, cols, inner, row_cuts, col_cuts, n_cells, rel, is_float, key_max):
    n = pos.size
    cell = np.empty(n, np.int32)
    local = np.empty(n, np.int64)
    counts = np.zeros(n_cells, np.int64)
    n_cols = col_cuts.size - 1
    row_len = cols * inner
    r, row_start, rp = 0, 0, 0
    for k in range(n):  # positions are sorted: the row and its part only move forward
        p = pos[k]
        if p >= row_start + row_len:
            r = p // row_len
            row_start = r * row_len
            while r >= row_cuts[rp + 1]:
                rp += 1
        rem = p - row_start
        c = rem // inner if inner > 1 else rem
        e = rem - c * inner
        cp = 0
        while c >= col_cuts[cp + 1]:  # a few parts: a short scan
            cp += 1
        x = rp * n_cols + cp
        cell[k] = x
        local[k] = ((r - row_cuts[rp]) * (col_cuts[cp + 1] - col_cuts[cp]) + (c - col_cuts[cp])) * inner + e
        counts[x] += 1
    at = np.zeros(n_cells, np.int64)
    for x in range(1, n_cells):
        at[x] = at[x - 1] + counts[x - 1]
    prev = np.zeros(n_cells, np.int64)
    gaps = np.empty(n, np.uint32)
    abs_values = np.empty(n, new.dtype)
    steps = np.empty(n if rel else 0, new.dtype)
    for k in range(n):  # stable: within a cell the changes keep their (row-major) order
        x = cell[k]
        i = at[x]
        at[x] += 1
        gaps[i] = local[k] - prev[x]
        prev[x] = local[k]
        b = new[k]
        abs_values[i] = b
        if rel:
            a = old[k]
            kb, ka = np.int64(b), np.int64(a)
            if is_float:
                kb = kb ^ key_max if kb < 0 else kb
                ka = ka ^ key_max if ka < 0 else ka
            steps[i] = kb - ka  # wraps in the dtype's width, as torch's subtraction does
    return counts, gaps, abs_values, steps


def group(positions: np.ndarray, new_bits: np.ndarray, old_bits: np.ndarray | None, shape, cuts, is_float: bool):
    """(changes per cell, gaps, new bits, steps or None), each cell's run in cell order: the box-local
    gaps (uint32: every cell holds fewer than 2^32 elements) and values of :func:`chunks.split`'s
    cells, ``steps`` those of ``rel`` (None without ``old_bits``)."""
    shape = tuple(int(s) for s in shape)
    cols = shape[1] if len(cuts) > 1 else 1
    inner = int(np.prod(shape[len(cuts) :], dtype=np.int64))
    row_cuts = np.asarray(cuts[0], np.int64)
    col_cuts = np.asarray(cuts[1] if len(cuts) > 1 else [0, 1], np.int64)
    rel = old_bits is not None
    key_max = np.iinfo(new_bits.dtype).max
    counts, gaps, abs_values, steps = _group(
        positions,
        new_bits,
        new_bits if old_bits is None else old_bits,
        cols,
        inner,
        row_cuts,
        col_cuts,
        (len(row_cuts) - 1) * (len(col_cuts) - 1),
        rel,
        is_float,
        key_max,
    )
    return counts, gaps, abs_values, steps if rel else None


@numba.njit(nogil=True, cache=True)
def _merge_rows(local, values, bounds, boxes, i, j, row_len, inner, o, out_pos, out_values):
    """Band ``[i, j)`` row by row, each cell's run of the row left to right: the work is the changes plus
    the (row, cell) pairs, the cheaper where cells hold many changes per row."""
    done = np.int64(1) << 62
    heads = bounds[i:j].copy()
    head_row = np.empty(j - i, np.int64)  # the band row of each cell's next change (done: none left)
    r = done
    for c in range(i, j):
        width = (boxes[c, 3] - boxes[c, 2]) * inner
        head_row[c - i] = local[heads[c - i]] // width if heads[c - i] < bounds[c + 1] else done
        r = min(r, head_row[c - i])
    while r < done:
        nxt = done
        for c in range(i, j):
            if head_row[c - i] == r:
                width = (boxes[c, 3] - boxes[c, 2]) * inner
                start = (boxes[c, 0] + r) * row_len + boxes[c, 2] * inner - r * width
                h, end, stop = heads[c - i], bounds[c + 1], (r + 1) * width
                while h < end and local[h] < stop:
                    out_pos[o] = start + local[h]
                    out_values[o] = values[h]
                    o += 1
                    h += 1
                heads[c - i] = h
                head_row[c - i] = local[h] // width if h < end else done
            nxt = min(nxt, head_row[c - i])
        r = nxt
    return o


@numba.njit(nogil=True, cache=True)
def _count_rows(local, values, bounds, boxes, i, j, row_len, inner, o, out_pos, out_values):
    """Band ``[i, j)`` as a counting sort by row: one pass counts each row's changes, a second writes each
    cell's changes, left to right, at its row's next place: the work is the changes and the rows, the
    cheaper where cells hold few changes per row."""
    rows = boxes[i, 1] - boxes[i, 0]
    at = np.zeros(rows + 1, np.int64)
    row_of = np.empty(bounds[j] - bounds[i], np.int64)
    for c in range(i, j):
        width = (boxes[c, 3] - boxes[c, 2]) * inner
        inv_width = 1.0 / width
        for h in range(bounds[c], bounds[c + 1]):
            row = _row(local[h], width, inv_width)
            row_of[h - bounds[i]] = row
            at[row + 1] += 1
    at[0] = o
    for r in range(rows):  # where each row's run starts
        at[r + 1] += at[r]
    for c in range(i, j):  # left to right, so within a row the cells keep column order
        width = (boxes[c, 3] - boxes[c, 2]) * inner
        start = boxes[c, 0] * row_len + boxes[c, 2] * inner
        for h in range(bounds[c], bounds[c + 1]):
            row = row_of[h - bounds[i]]
            d = at[row]
            at[row] = d + 1
            out_pos[d] = start + row * (row_len - width) + local[h]
            out_values[d] = values[h]
    return o + bounds[j] - bounds[i]


@numba.njit(nogil=True, cache=True)
def _row(q, width, inv_width):
    """``q // width`` for box-local index ``q`` >= 0: by a multiplication by the width's reciprocal, corrected by
    one where rounding missed (a division per change cost twice the loop around it)."""
    r = np.int64(q * inv_width)
    if r * width > q:
        r -= 1
    elif (r + 1) * width <= q:
        r += 1
    return r


@numba.njit(nogil=True, cache=True)
def _place(local, values, bounds, boxes, first, last, row_len, inner, out_pos, out_values):
    """Cells ``[first, last)`` (one tensor's) placed from ``out_pos[bounds[first]]`` on."""
    o = bounds[first]
    i = first
    while i < last:
        j = i + 1
        while j < last and boxes[j, 0] == boxes[i, 0]:  # a band: the cells of one row range
            j += 1
        if j - i == 1:  # one cell in the band (a rank's column share, or cut along rows only): in order already
            width = (boxes[i, 3] - boxes[i, 2]) * inner
            start = boxes[i, 0] * row_len + boxes[i, 2] * inner
            if width == row_len:
                for h in range(bounds[i], bounds[i + 1]):
                    out_pos[o] = start + local[h]
                    out_values[o] = values[h]
                    o += 1
            else:
                inv_width, skip = 1.0 / width, row_len - width
                for h in range(bounds[i], bounds[i + 1]):
                    q = local[h]
                    out_pos[o] = start + _row(q, width, inv_width) * skip + q
                    out_values[o] = values[h]
                    o += 1
        elif bounds[j] - bounds[i] >= 2 * (j - i) * (boxes[i, 1] - boxes[i, 0]):  # two or more per (row, cell)
            o = _merge_rows(local, values, bounds, boxes, i, j, row_len, inner, o, out_pos, out_values)
        else:
            o = _count_rows(local, values, bounds, boxes, i, j, row_len, inner, o, out_pos, out_values)
        i = j
    return o


def _box_array(shape, boxes: list) -> np.ndarray:
    """``boxes`` as rows (row0, row1, col0, col1); a 1-D tensor's as one column."""
    if len(shape) > 1:
        return np.array([(lo[0], hi[0], lo[1], hi[1]) for lo, hi in boxes], np.int64).reshape(-1, 4)
    return np.array([(lo[0], hi[0], 0, 1) for lo, hi in boxes], np.int64).reshape(-1, 4)


def _row_len_inner(shape) -> tuple[int, int]:
    """(elements per row of dimension 0, elements per column of dimension 1) of a tensor of ``shape``."""
    inner = math.prod(int(s) for s in shape[2:])
    return (int(shape[1]) if len(shape) > 1 else 1) * inner, inner


def place(shape, boxes: list, locals_: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(global positions, values): the cells ``boxes`` of a tensor of ``shape`` (in cell order, each
    ``((row0, col0, ...), (row1, col1, ...))``) with their changes at ``locals_`` (sorted, unique
    box-local row-major indices, as :func:`engine_ext.format.codec.decode_positions` checks them) and
    ``values`` (one integer dtype), as one run in ascending global order: what concatenating
    :func:`chunks.to_global` of each cell and sorting gives, without the sort."""
    row_len, inner = _row_len_inner(shape)
    bounds = np.zeros(len(boxes) + 1, np.int64)
    np.cumsum([len(x) for x in locals_], out=bounds[1:])
    local = np.concatenate(locals_) if len(locals_) > 1 else locals_[0]
    vals = np.concatenate(values) if len(values) > 1 else values[0]
    out_pos = np.empty(int(bounds[-1]), np.int64)
    out_values = np.empty(int(bounds[-1]), vals.dtype)
    _place(local, vals, bounds, _box_array(shape, boxes), 0, len(boxes), row_len, inner, out_pos, out_values)
    return out_pos, out_values


OK, REPEATED, BEYOND, WIDE = 0, 1, 2, 3  # :func:`decode_place`'s statuses


@numba.njit(nogil=True, cache=True)
def _decode_place(gaps, wide, bounds, boxes, firsts, row_lens, inners, narrow, out_pos, out_values):
    """Per tensor ``t`` (cells ``firsts[t]:firsts[t + 1]``): each cell's gaps summed into box-local positions
    and checked (no gap of 0 after a cell's first, none at or past the cell's elements), its values narrowed
    and checked, then :func:`_place`; a tensor whose cells are whole rows (most: not cut, or cut along rows) is
    written in place at once, with no second pass. (status, tensor, cell, index in the cell of the first bad
    number)."""
    local = np.empty(gaps.size, np.int64)  # pages touched only by tensors whose cells need placing
    values = np.empty(gaps.size, out_values.dtype)
    for t in range(firsts.size - 1):
        inner, row_len = inners[t], row_lens[t]
        rows_whole = True  # every cell whole rows (not cut, or cut along rows only): in cell order, in order already
        for c in range(firsts[t], firsts[t + 1]):
            rows_whole = rows_whole and (boxes[c, 3] - boxes[c, 2]) * inner == row_len
        to_pos = out_pos if rows_whole else local
        to_values = out_values if rows_whole else values
        for c in range(firsts[t], firsts[t + 1]):
            numel = (boxes[c, 1] - boxes[c, 0]) * (boxes[c, 3] - boxes[c, 2]) * inner
            start = boxes[c, 0] * row_len if rows_whole else np.int64(0)
            acc = np.int64(0)
            a = bounds[c]
            for h in range(a, bounds[c + 1]):
                g = np.int64(gaps[h])  # uint32: exact in int64
                if h > a and g == 0:
                    return REPEATED, t, c - firsts[t], h - a
                acc += g
                if acc >= numel:
                    return BEYOND, t, c - firsts[t], h - a
                to_pos[h] = start + acc
                v = wide[h]
                if narrow and (v < -128 or v > 127):
                    return WIDE, t, c - firsts[t], h - a
                to_values[h] = v
        if not rows_whole:
            _place(local, values, bounds, boxes, firsts[t], firsts[t + 1], row_len, inner, out_pos, out_values)
    return OK, 0, 0, 0


def decode_place(
    tensors: list[tuple[tuple, list]], gaps: np.ndarray, wide: np.ndarray, bounds: np.ndarray, value_dtype
) -> tuple[tuple[int, int, int, int], np.ndarray, np.ndarray]:
    """((status, tensor, cell, index), global positions, values) of ``tensors`` ((shape, the boxes of its cells
    in cell order) each), from their cells' decoded gaps (uint32; cell ``c``'s run ``bounds[c]:bounds[c + 1]``,
    the tensors' cells one after another) and values (``wide``: int16 for 8-bit values, narrowed to
    ``value_dtype`` here): what :func:`engine_ext.format.codec.decode_positions` and ``decode_values`` per cell,
    then :func:`place` per tensor give, in one call, each tensor's run where its cells' lie. Status :data:`OK`,
    else the first bad number's tensor, cell and place in it (:data:`REPEATED`, :data:`BEYOND` or
    :data:`WIDE`: a value outside 8 bits)."""
    firsts = np.zeros(len(tensors) + 1, np.int64)
    np.cumsum([len(boxes) for _, boxes in tensors], out=firsts[1:])
    dims = np.array([_row_len_inner(shape) for shape, _ in tensors], np.int64).reshape(-1, 2)
    box_array = np.concatenate([_box_array(shape, boxes) for shape, boxes in tensors])
    out_pos = np.empty(gaps.size, np.int64)
    out_values = np.empty(gaps.size, value_dtype)
    narrow = wide.dtype != out_values.dtype
    status = _decode_place(
        gaps, wide, bounds, box_array, firsts, dims[:, 0].copy(), dims[:, 1].copy(), narrow, out_pos, out_values
    )
    return status, out_pos, out_values
