"""The fingerprint's element hash summed over a run, an index set, or the rows of a box, in numba.

:mod:`engine_ext.format.fingerprint` states the hash (SplitMix64's finaliser of
``i * GOLDEN xor bits``, its constants passed in as ``g, m1, m2``) and keeps the torch
reference; these are the same sums as one fused loop per piece, on every core
(``prange``), compiled once and cached on disk. Unsigned 64-bit arithmetic wraps, as the
spec's int64 two's complement does.
"""

from __future__ import annotations

import numba
import numpy as np

_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@numba.njit(inline="always", cache=True)
def _h(i, b, g, m1, m2):
    z = (np.uint64(i) * g) ^ np.uint64(b)
    z = (z ^ (z >> _S30)) * m1
    z = (z ^ (z >> _S27)) * m2
    return z ^ (z >> _S31)


@numba.njit(parallel=True, nogil=True, cache=True)
def run(bits, start, pieces, g, m1, m2):
    """sum of h(start + j, bits[j]) over a contiguous run, cut into ``pieces`` for the threads."""
    n = bits.size
    step = (n + pieces - 1) // pieces
    part = np.zeros(pieces, dtype=np.uint64)
    for c in numba.prange(pieces):
        acc = np.uint64(0)
        for j in range(c * step, min(n, (c + 1) * step)):
            acc += _h(start + j, bits[j], g, m1, m2)
        part[c] = acc
    total = np.uint64(0)
    for c in range(pieces):
        total += part[c]
    return total


@numba.njit(nogil=True, cache=True)
def run1(bits, start, g, m1, m2):
    """:func:`run` on the calling thread alone: a writer thread's few MB, hashed while in cache."""
    acc = np.uint64(0)
    for j in range(bits.size):
        acc += _h(start + j, bits[j], g, m1, m2)
    return acc


@numba.njit(parallel=True, nogil=True, cache=True)
def pairs(index, bits, g, m1, m2):
    """sum of h(index[j], bits[j])."""
    n = index.size
    pieces = max(1, min(256, n >> 16))
    step = (n + pieces - 1) // pieces
    part = np.zeros(pieces, dtype=np.uint64)
    for c in numba.prange(pieces):
        acc = np.uint64(0)
        for j in range(c * step, min(n, (c + 1) * step)):
            acc += _h(index[j], bits[j], g, m1, m2)
        part[c] = acc
    total = np.uint64(0)
    for c in range(pieces):
        total += part[c]
    return total


@numba.njit(parallel=True, nogil=True, cache=True)
def rows(values, first, g, m1, m2):
    """sum of h(first[r] + j, values[r, j]): the rows of a box, each a run of consecutive indices."""
    part = np.zeros(first.size, dtype=np.uint64)
    for r in numba.prange(first.size):
        acc = np.uint64(0)
        for j in range(values.shape[1]):
            acc += _h(first[r] + j, values[r, j], g, m1, m2)
        part[r] = acc
    total = np.uint64(0)
    for r in range(first.size):
        total += part[r]
    return total
