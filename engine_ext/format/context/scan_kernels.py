"""The context coder's passes over a part's base: one read of every element.

:mod:`engine_ext.format.context.codec` states the model. Encoding needs each change's rank
among its (block, class) elements (:func:`ranks`); decoding the inverse, the elements of
listed ranks (:func:`scan`): per class a countdown to the next listed rank. Both read
every element of the part once; :func:`scan` spreads blocks over the cores (kernels that
release the GIL, on a thread pool, so any numba threading layer does).

:func:`scan` runs the compiled pass (``_scan_native``, built from scan_native.c by the
package's own build, SIMD where the CPU has it) when it is installed, else the numba
reference here (:func:`_scan_blocks`): the same positions, in the same order. A reader's
whole read is mostly this pass, which numba cannot vectorise (per element a class lookup
and a countdown that chain through memory, about 4 cycles): ``python bench/context_bench.py
--pass`` measures both. A Triton pass for GPU ranks is in ``engine_ext.triton_kernels.context_scan``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from ... import settings
from ...errors import IntegrityError
from .models import class_key
from .symbols import EXPONENT

try:
    from . import _scan_native  # type: ignore[attr-defined]
except ImportError:  # no C compiler at install (setup.py: the extension is optional)
    _scan_native = None

PARALLEL_MIN = 1 << 20  # parts this big scan their blocks on every core


@numba.njit(nogil=True, cache=True)
def exponent_histogram(u, shift, mask):  # pragma: no cover - compiled
    h = np.zeros((4, mask + 1), np.int64)
    n4 = u.shape[0] // 4 * 4
    for i in range(0, n4, 4):  # four histograms: no store-to-load chain between neighbours
        h[0, (u[i] >> shift) & mask] += 1
        h[1, (u[i + 1] >> shift) & mask] += 1
        h[2, (u[i + 2] >> shift) & mask] += 1
        h[3, (u[i + 3] >> shift) & mask] += 1
    for i in range(n4, u.shape[0]):
        h[0, (u[i] >> shift) & mask] += 1
    return h.sum(axis=0)


@numba.njit(nogil=True, cache=True)
def ranks(u, shift, mask, lut, rows, row_ptr, run, pos, bstart, rank):  # pragma: no cover - compiled
    """For each block (its runs ``rows[row_ptr[b]:row_ptr[b + 1]]`` of ``run[b]`` elements), the
    within-(block, class) rank of each change: ``pos`` are the changes' part-flat positions
    grouped by block (ascending within)."""
    cnt = np.zeros(256, np.int64)
    for b in range(run.shape[0]):
        cnt[:] = 0
        j, end = bstart[b], bstart[b + 1]
        nxt = pos[j] if j < end else -1
        for ri in range(row_ptr[b], row_ptr[b + 1]):
            for i in range(rows[ri], rows[ri] + run[b]):
                c = lut[(u[i] >> shift) & mask]
                if i == nxt:
                    rank[j] = cnt[c]
                    j += 1
                    nxt = pos[j] if j < end else -1
                cnt[c] += 1


@numba.njit(nogil=True, cache=True)
def _scan_blocks(u, shift, mask, lut, rows, row_ptr, run, ranks, starts, pos, src):  # pragma: no cover - compiled
    """The context pass over blocks: per block ``b`` and class ``c``, ``ranks[starts[b, c] :
    starts[b, c + 1]]`` are ascending within-(block, class) ranks; writes the part-flat position
    of each (``pos``) and its index into ``ranks`` (``src``), block by block in element order.
    A countdown per class to its next listed rank: one load and one store per element.
    Returns the number found (short of the ranks listed: a rank beyond its class)."""
    K = starts.shape[1] - 1
    left = np.empty(256, np.int64)
    ptr = np.empty(256, np.int64)
    far = np.int64(1) << 62
    k = 0
    for b in range(run.shape[0]):
        left[:] = far
        for c in range(K):
            ptr[c] = starts[b, c]
            if ptr[c] < starts[b, c + 1]:
                left[c] = ranks[ptr[c]] + 1
        for ri in range(row_ptr[b], row_ptr[b + 1]):
            for i in range(rows[ri], rows[ri] + run[b]):
                c = lut[(u[i] >> shift) & mask]
                v = left[c] - 1
                left[c] = v
                if v == 0:
                    p = ptr[c]
                    pos[k] = i
                    src[k] = p
                    k += 1
                    ptr[c] = p + 1
                    left[c] = ranks[p + 1] - ranks[p] if p + 1 < starts[b, c + 1] else far
    return k


_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The pool the passes (and the streams of big parts) spread over: one thread per core."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="ctx-scan")
    return _POOL


def native_variant() -> str | None:
    """The compiled variant :func:`scan` runs (``ENGINE_EXT_CONTEXT_PASS``), None for numba."""
    want = settings.current().context_pass
    have: tuple[str, ...] = _scan_native.ISAS if _scan_native is not None else ()
    if want == "numba" or (want == "auto" and not have):
        return None
    if want == "auto":
        return have[0]
    if want not in have:
        raise RuntimeError(
            f"ENGINE_EXT_CONTEXT_PASS={want}: this install's compiled pass runs {list(have) or 'nothing'} here"
        )
    return want


def scan(u, dtype_name, edges, bl, ranks, starts, which=None):
    """(part-flat positions, index into ``ranks``) of the listed ranks, in block then element
    order, over the blocks ``which`` (default all; ``u`` the part's base bits, flat, as unsigned
    integers of the dtype's width; ``edges`` the classes' exponent edges); blocks split among the
    cores when there are many elements. Raises IntegrityError for a rank beyond its class."""
    which = np.arange(bl.S) if which is None else np.asarray(which)
    sizes = bl.sizes[which]
    workers = min(os.cpu_count() or 1, which.size) if int(sizes.sum()) >= PARALLEL_MIN else 1
    bounds = np.searchsorted(np.cumsum(sizes), np.linspace(0, int(sizes.sum()), workers + 1)[1:-1])
    groups = [g for g in np.split(which, bounds) if g.size]
    isa = native_variant()
    if isa is None:
        shift, mask, lut = class_key(edges, dtype_name, u.size)
    else:
        exp_shift, exp_mask = EXPONENT[dtype_name]
        edge_bytes = bytes(edges)
    ranks = np.ascontiguousarray(ranks, np.int64)

    def one(g):
        rows = np.ascontiguousarray(np.concatenate([bl.rows[bl.row_ptr[b] : bl.row_ptr[b + 1]] for b in g]), np.int64)
        row_ptr = np.concatenate([[0], np.cumsum(bl.row_ptr[g + 1] - bl.row_ptr[g])]).astype(np.int64)
        run, st = np.ascontiguousarray(bl.run[g], np.int64), np.ascontiguousarray(starts[g], np.int64)
        n = int((st[:, -1] - st[:, 0]).sum())
        pos, src = np.empty(n, np.int64), np.empty(n, np.int64)
        if isa is None:
            found = _scan_blocks(u, shift, mask, lut, rows, row_ptr, run, ranks, st, pos, src)
        else:
            args = (rows, row_ptr, run, ranks, st, pos, src)
            found = _scan_native.scan_blocks(isa, u, u.itemsize, exp_shift, exp_mask, edge_bytes, *args)
        if found != n:
            raise IntegrityError("context ranks beyond their class (a wrong base, or corrupt)")
        return pos, src

    got = list(pool().map(one, groups)) if len(groups) > 1 else [one(g) for g in groups]
    if not got:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate([p for p, _ in got]), np.concatenate([s for _, s in got])
