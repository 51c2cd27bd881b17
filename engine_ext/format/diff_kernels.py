"""The bitwise diff of two versions of a tensor, in numba: every core, one read from memory, no temporaries.

:func:`engine_ext.format.delta.changed_bits` states it (the positions where the raw bits
differ, with the old and the new bits there, in order) and is the path for other devices.
On the CPU a diff reads the whole model every step, so it runs here, once over memory:

* each core takes one contiguous range of the tensor (a thread of :data:`_POOL`: the kernel
  holds no GIL) and walks it a word of 8 bytes at a time: the XOR of the two versions' words
  is zero for most words at RL densities, and where it is not, each changed element is found
  from its lowest differing bit (a trailing-zero count) and written out (and, for the
  publisher, the new bits into the kept copy, so no scatter follows) while the word is in
  cache. No element is tested alone and nothing is counted first: an earlier kernel counted
  each L2-sized block (vectorised), then tested the changed words' elements one by one; at 1 %
  of bf16 that took 1.5-2x as long (docs/benchmarks.md, ``python bench/diff_bench.py``).
* a range's output grows with the changes found (extrapolated from the words seen, with room
  for one more block at most, so it is sized a few times at most); the ranges' outputs are then
  joined in order (12 bytes per change: a few percent of the reads at RL densities).

One parallel start per tensor, not per block: on a shared host a thread that waits for a core
at every start costs a time slice each time.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

OUTPUT_BLOCK = (
    1 << 16
)  # elements a range's output makes room for at a time (its largest over-allocation: 12 bytes each)
MIN_RANGE = 1 << 20  # fewest elements a core takes on its own (below, starting a thread costs more than it saves)
_THREADS = max(1, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="engine-ext-diff")


@numba.njit(nogil=True, cache=True)
def _scan(old, new, old_words, new_words, per, lo, hi, block, update):
    """The changes in ``[lo, hi)``: (positions, old bits, new bits, count), the arrays maybe longer than
    the count. ``old_words``/``new_words`` view the same bits as uint64 (``per`` elements a word); ``lo``,
    ``block`` and, but for the tensor's end, ``hi`` are multiples of ``per``."""
    cap, m = 0, 0
    bits = 64 // per
    lane = (np.uint64(1) << np.uint64(bits)) - np.uint64(1) if bits < 64 else ~np.uint64(0)  # one element's bits
    pos, old_at, new_at = np.empty(0, np.int64), np.empty(0, old.dtype), np.empty(0, old.dtype)
    for b0 in range(lo, hi, block):
        b1 = min(hi, b0 + block)
        if m + (b1 - b0) > cap:  # room for a whole block of changes, and for what the words so far promise
            cap = m + (b1 - b0) + max(1024, int(m * ((hi - lo) / max(1, b0 - lo)) * 1.125))
            pos2, old2, new2 = np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)
            pos2[:m], old2[:m], new2[:m] = pos[:m], old_at[:m], new_at[:m]
            pos, old_at, new_at = pos2, old2, new2
        w1 = b0 // per + (b1 - b0) // per
        for w in range(b0 // per, w1):
            x = old_words[w] ^ new_words[w]
            while x != 0:  # each changed element of the word, from its lowest differing bit
                e = np.int64(trailing_zeros(x)) // bits
                j = w * per + e
                pos[m], old_at[m], new_at[m] = j, old[j], new[j]
                m += 1
                if update:
                    old[j] = new[j]
                x &= ~(lane << np.uint64(e * bits))
        m = _take(old, new, w1 * per, b1, pos, old_at, new_at, m, update)  # the tensor's last elements, short of a word
    return pos, old_at, new_at, m


@numba.njit(nogil=True, cache=True, inline="always")
def _take(old, new, lo, hi, pos, old_at, new_at, m, update):
    """Write the changes in ``[lo, hi)`` (fewer than a word's elements) from index ``m`` of the outputs
    (and, with ``update``, the new bits into ``old``); the count after them."""
    for j in range(lo, hi):
        a, b = old[j], new[j]
        if a != b:
            pos[m], old_at[m], new_at[m] = j, a, b
            m += 1
            if update:
                old[j] = b
    return m


def changed(
    old: np.ndarray, new: np.ndarray, update: bool = False, block: int = OUTPUT_BLOCK, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old bits, new bits) where ``old`` and ``new`` (1-D, same dtype) differ; with
    ``update``, ``old`` takes the new bits there."""
    n, per = old.size, 8 // old.itemsize
    words = n // per
    old_words, new_words = old[: words * per].view(np.uint64), new[: words * per].view(np.uint64)
    block = max(per, block // per * per)
    parts = max(1, min(threads or _THREADS, n // MIN_RANGE))
    cuts = [words * i // parts * per for i in range(parts)] + [n]

    def scan(r):
        return _scan(old, new, old_words, new_words, per, r[0], r[1], block, update)

    found = [scan((0, n))] if parts == 1 else list(_POOL.map(scan, itertools.pairwise(cuts)))
    if len(found) == 1:
        pos, old_at, new_at, m = found[0]
        if pos.size - m > m // 16:  # more room than an extrapolation's slack: give it back
            return pos[:m].copy(), old_at[:m].copy(), new_at[:m].copy()
        return pos[:m], old_at[:m], new_at[:m]
    m = sum(f[3] for f in found)
    out = np.empty(m, np.int64), np.empty(m, old.dtype), np.empty(m, old.dtype)
    at = np.cumsum([0] + [f[3] for f in found])

    def join(i):
        for dst, src in zip(out, found[i][:3]):
            dst[at[i] : at[i + 1]] = src[: found[i][3]]

    list(_POOL.map(join, range(len(found))))
    return out
