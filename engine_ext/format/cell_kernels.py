"""A cut tensor's changes grouped by grid cell, as the codec codes them, in numba: two passes over the changes.

:func:`engine_ext.format.codec.encode_tensor` codes each cell of a big tensor's grid
(:mod:`engine_ext.format.chunks`) on its own: box-local positions as gaps, and the values as
the new bits (``abs``) or as steps in ordered bit space (``rel``). Done with numpy and torch
per cell (the cell of every change, a stable sort by cell, box-local indices, gathers, steps)
that took a dozen passes over the changes and most of a delta's background time; here one
pass finds each change's cell and box-local index, a second writes its gap and values at
its cell's place. The results are the arrays :func:`chunks.split`, :func:`chunks.to_local`
and :func:`engine_ext.format.dtypes.step_between` give, so the bytes coded are the same.
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
