"""Codec v1's decode passes over a part's changes, in numba: each one pass where numpy took three.

A part's positions are coded as gaps (its first position, then each minus the one before) and its
8-bit values widened to 16 bits for pcodec. A reader checks every decoded number before it is used:
no gap of 0 after the first (a repeated position), no position at or past the part's elements, no
widened value outside 8 bits. With numpy that was the least gap, the running sum and the last
position, and the least value, the greatest and a narrowing copy: passes that, with the Python around
them, cost a K2 rank about as much as pcodec's decode itself. Here each is one pass that checks as it
goes and stops at the first bad number; :mod:`engine_ext.format.codec` turns a status into its error.
"""

from __future__ import annotations

import numba
import numpy as np

OK, REPEATED, BEYOND = 0, 1, 2


@numba.njit(nogil=True, cache=True)
def _positions(gaps, last_gap, numel, out):
    acc = np.int64(0)
    for k in range(gaps.size):
        g = gaps[k]
        if g > last_gap:  # compared in the gaps' own unsigned type: exact for uint64 too
            return BEYOND, k
        if k and g == 0:
            return REPEATED, k
        acc += np.int64(g)
        if acc >= numel:
            return BEYOND, k
        out[k] = acc
    return OK, gaps.size


def positions(gaps: np.ndarray, numel: int) -> tuple[np.ndarray, int, int]:
    """(positions as int64, status, the index of the first bad gap) from ``gaps`` (uint32 or uint64) of a
    part of ``numel`` elements: status :data:`OK`, :data:`REPEATED` (a gap of 0 after the first) or
    :data:`BEYOND` (a position at or past ``numel``)."""
    out = np.empty(gaps.size, np.int64)
    status, at = _positions(gaps, gaps.dtype.type(numel - 1), numel, out)
    return out, status, at


@numba.njit(nogil=True, cache=True)
def _narrow8(wide, out):
    for k in range(wide.size):
        v = wide[k]
        if v < -128 or v > 127:
            return False
        out[k] = v
    return True


def narrow8(wide: np.ndarray) -> np.ndarray | None:
    """``wide`` (int16) as int8, or None if a value lies outside 8 bits."""
    out = np.empty(wide.size, np.int8)
    return out if _narrow8(wide, out) else None
