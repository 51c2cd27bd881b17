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
        for h in range(bounds[c], bounds[c + 1]):
            row = local[h] // width
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
def _place(local, values, bounds, boxes, row_len, inner, out_pos, out_values):
    n_cells = bounds.size - 1
    o = 0
    i = 0
    while i < n_cells:
        j = i + 1
        while j < n_cells and boxes[j, 0] == boxes[i, 0]:  # a band: the cells of one row range
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
                for h in range(bounds[i], bounds[i + 1]):
                    out_pos[o] = start + local[h] // width * (row_len - width) + local[h]
                    out_values[o] = values[h]
                    o += 1
        elif bounds[j] - bounds[i] >= 2 * (j - i) * (boxes[i, 1] - boxes[i, 0]):  # two or more per (row, cell)
            o = _merge_rows(local, values, bounds, boxes, i, j, row_len, inner, o, out_pos, out_values)
        else:
            o = _count_rows(local, values, bounds, boxes, i, j, row_len, inner, o, out_pos, out_values)
        i = j
    return o


def place(shape, boxes: list, locals_: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(global positions, values): the cells ``boxes`` of a tensor of ``shape`` (in cell order, each
    ``((row0, col0, ...), (row1, col1, ...))``) with their changes at ``locals_`` (sorted, unique
    box-local row-major indices, as :func:`engine_ext.format.codec.decode_positions` checks them) and
    ``values`` (one integer dtype), as one run in ascending global order: what concatenating
    :func:`chunks.to_global` of each cell and sorting gives, without the sort."""
    shape = tuple(int(s) for s in shape)
    cols = shape[1] if len(shape) > 1 else 1
    inner = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 1 else 1
    box_array = np.empty((len(boxes), 4), np.int64)
    for k, (lo, hi) in enumerate(boxes):
        box_array[k] = (lo[0], hi[0], lo[1], hi[1]) if len(shape) > 1 else (lo[0], hi[0], 0, 1)
    bounds = np.zeros(len(boxes) + 1, np.int64)
    np.cumsum([len(x) for x in locals_], out=bounds[1:])
    local = np.concatenate(locals_) if len(locals_) > 1 else locals_[0]
    vals = np.concatenate(values) if len(values) > 1 else values[0]
    out_pos = np.empty(int(bounds[-1]), np.int64)
    out_values = np.empty(int(bounds[-1]), vals.dtype)
    _place(local, vals, bounds, box_array, cols * inner, inner, out_pos, out_values)
    return out_pos, out_values
