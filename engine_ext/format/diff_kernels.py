"""The bitwise diff of two versions of a tensor, in numba: every core, one read from memory, no temporaries.

:func:`engine_ext.format.delta.changed_bits` states it (the positions where the raw bits
differ, with the old and the new bits there, in order) and is the path for other devices.
On the CPU a diff reads the whole model every step, so it runs here, once over memory:

* each core takes one contiguous range of the tensor (a thread of :data:`_POOL`: the kernel
  holds no GIL) and walks it in blocks of ``BLOCK`` elements small enough that both versions'
  bits stay in the core's L2 cache: it compares a block (vectorised, one byte per element) and
  counts its changes, then writes them (and, for the publisher, the new bits into the kept
  copy, so no scatter follows) while the block is still in cache, visiting the comparisons 8
  at a time (at RL densities most groups of 8 hold no change). Counting the whole tensor first, then filling, read it twice from memory
  (8 bytes per bf16 element against ``save_file``'s 2 read and 2 written).
* a range's output grows with the changes found (extrapolated from the blocks seen, so it is
  sized once in practice); the ranges' outputs are then joined in order (12 bytes per change:
  a few percent of the reads at RL densities).

One parallel start per tensor, not per block: on a shared host a thread that waits for a core
at every start costs a time slice each time.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

BLOCK = 1 << 16  # elements: old and new bits of a block (256 KB in bf16, 512 KB in fp32) stay in L2 between count and fill
MIN_RANGE = 1 << 20  # fewest elements a core takes on its own (below, starting a thread costs more than it saves)
_THREADS = max(1, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="engine-ext-diff")


@numba.njit(nogil=True, cache=True)
def _scan(old, new, lo, hi, block, update):
    """The changes in ``[lo, hi)``: (positions, old bits, new bits, count), the arrays maybe longer than the count."""
    cap, m = 0, 0
    pos, old_at, new_at = np.empty(0, np.int64), np.empty(0, old.dtype), np.empty(0, old.dtype)
    differs = np.zeros((block + 15) // 8 * 8, np.uint8)  # a block's comparisons (vectorised), read back 8 at a time
    words = differs.view(np.uint64)
    for b0 in range(lo, hi, block):
        size = min(hi, b0 + block) - b0
        k = 0
        for i in range(size):
            d = old[b0 + i] != new[b0 + i]
            differs[i] = d
            k += d
        if k == 0:
            continue
        if m + k > cap:  # room for what the blocks so far promise over the range, and some more
            cap = max(m + k, int((m + k) * ((hi - lo) / (b0 + size - lo)) * 1.125) + 1024)
            pos2, old2, new2 = np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)
            pos2[:m], old2[:m], new2[:m] = pos[:m], old_at[:m], new_at[:m]
            pos, old_at, new_at = pos2, old2, new2
        differs[size:size + 8] = 0
        for w in range((size + 7) // 8):
            if words[w] != 0:  # 8 elements at once: most hold no change
                for i in range(8 * w, 8 * w + 8):
                    if differs[i]:
                        j = b0 + i
                        b = new[j]
                        pos[m], old_at[m], new_at[m] = j, old[j], b
                        m += 1
                        if update:
                            old[j] = b
    return pos, old_at, new_at, m


def changed(old: np.ndarray, new: np.ndarray, update: bool = False, block: int = BLOCK,
            threads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old bits, new bits) where ``old`` and ``new`` (1-D, same dtype) differ; with
    ``update``, ``old`` takes the new bits there."""
    n = old.size
    parts = max(1, min(threads or _THREADS, n // MIN_RANGE))
    cuts = [n * i // parts for i in range(parts + 1)]
    if parts == 1:
        found = [_scan(old, new, 0, n, block, update)]
    else:
        found = list(_POOL.map(lambda r: _scan(old, new, r[0], r[1], block, update), zip(cuts, cuts[1:])))
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
            dst[at[i]:at[i + 1]] = src[:found[i][3]]

    list(_POOL.map(join, range(len(found))))
    return out
