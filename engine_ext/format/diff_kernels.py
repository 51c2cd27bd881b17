"""The bitwise diff of two versions of a tensor, in numba: every core, two passes, no temporaries.

:func:`engine_ext.format.delta.changed_bits` states it (the positions where the raw bits
differ, with the old and the new bits there, in order) and is the path for other devices.
On the CPU a diff reads the whole model every step, so it runs here: a parallel pass counts
the changes per piece, a second writes each piece's changes at its offset (and, for the
publisher, the new bits into the kept copy, so no scatter follows).
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(parallel=True, nogil=True, cache=True)
def _count(old, new, pieces):
    n = old.size
    step = (n + pieces - 1) // pieces
    counts = np.zeros(pieces, dtype=np.int64)
    for p in numba.prange(pieces):
        k = 0
        for j in range(p * step, min(n, (p + 1) * step)):
            k += old[j] != new[j]
        counts[p] = k
    return counts


@numba.njit(parallel=True, nogil=True, cache=True)
def _fill(old, new, pieces, counts, pos, old_at, new_at, update):
    n = old.size
    step = (n + pieces - 1) // pieces
    starts = np.zeros(pieces, dtype=np.int64)
    for p in range(1, pieces):
        starts[p] = starts[p - 1] + counts[p - 1]
    for p in numba.prange(pieces):
        k = starts[p]
        for j in range(p * step, min(n, (p + 1) * step)):
            a, b = old[j], new[j]
            if a != b:
                pos[k], old_at[k], new_at[k] = j, a, b
                k += 1
                if update:
                    old[j] = b


def changed(old: np.ndarray, new: np.ndarray, update: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old bits, new bits) where ``old`` and ``new`` (1-D, same dtype) differ; with
    ``update``, ``old`` takes the new bits there."""
    pieces = max(1, min(1024, old.size >> 16))
    counts = _count(old, new, pieces)
    m = int(counts.sum())
    pos, old_at, new_at = np.empty(m, np.int64), np.empty(m, old.dtype), np.empty(m, old.dtype)
    _fill(old, new, pieces, counts, pos, old_at, new_at, update)
    return pos, old_at, new_at
