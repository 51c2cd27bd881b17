"""The ``ctx-rans`` streams (format 9) decoded on a device: one Triton program per chunk, its lanes a vector.

:func:`decode` is the entry point, the device twin of :func:`engine_ext.format.context.rans_stage.decode`: the numba
kernel behind that (``rans_stage_kernels.decode_chunks``) is the reference semantics and the plain reference
of this module (``tests/test_rans_device.py`` holds the two side by side, bit for bit, this one in Triton's
interpreter on CPU tensors). The host parses a part's header and directory (:func:`engine_ext.format.context.rans_stage.plan`,
O(chunks)); what crosses host -> device is the part's bytes and the plan's small arrays (the tables once per
device); device -> host one sync of two scalars. Chunks are decoded in one launch, a program each.

**A chunk** (``plan.which[pid]``): changes ``s <= j < e`` on ``L`` lanes (change ``j`` on lane ``(j - s) % L``),
in *rounds* of ``m = min(L, e - j0)`` changes ``j0 .. j0 + m - 1``. Its words (16-bit LE) are ``data[r0:wend]``,
its bypass bits ``data[wend:wend + nbypass]`` least significant bit first. Lane ``l``'s state ``x_l`` starts at
the chunk's stored u32. Per round, with ``act_l = l < m``:

* *groups*: change ``j`` lies in (block, class) group ``g(j)``, the first ``g >= g(j - 1)`` with ``gend[g] > j``
  (a vector walk over the round's lanes, only in a round that leaves its group); it *starts* its group when
  ``j == gend[g(j) - 1]`` (0 for ``g = 0``);
* *quotient pass*: ``ent = qtab[gq[g] + (x & 4095)]`` (``f | bias << 13 | sym << 25``), ``q = ent >> 25``,
  ``x' = f * (x >> 12) + bias``; renormalisation without branches: ``need_l = act_l & (x'_l < 2^16)``, lane
  ``l`` reads the word at ``r + 2 * sum_{i < l} need_i`` (an exclusive prefix sum: words are read in lane
  order) and ``x = (x' << 16) | word``; ``r += 2 * sum need``;
* *bypass of the quotient pass*: lane ``l``'s fields are ``w_l = 48 [q_l = QMAX] + B_l`` bits at bit offset
  ``o_l = used + sum_{i < l} w_i`` (an exclusive prefix sum): the escape ``q = QMAX + bits(o_l, 48)``, the low
  ``bits(o_l + 48 [esc], B)``. ``bits(o, w)`` (``w <= 48``) gathers the 8 bytes from ``o >> 3`` into an int64
  (shifts up to 56, never past bit 63), shifts right by ``o & 7`` and masks;
* *ranks*: ``d_l = 1 + (q_l << B_l | low_l)``; with ``t_l = max{i <= l : starts_i}`` (-1: none), a segmented
  prefix sum over the lanes: ``rank_l = (t_l >= 0 ? -1 : prev) + sum_{max(t_l, 0) <= i <= l} d_i`` (a
  ``[LANES, LANES]`` masked sum, only in a round that leaves its group; else ``prev + cumsum(d)``); ``prev``
  = the last lane's rank (a chunk's first group continues from the directory's ``prev - 1``);
* *step pass*: the same rANS step under ``stab[gs[g]]``; symbol ``sy >= EXACT`` has ``lg = sy - EXACT + 3`` low
  bits (offsets: an exclusive prefix sum after the quotient pass's fields), ``z = 1 << lg | low``, else
  ``z = sy``; ``step = (z >> 1) ^ -(z & 1)``.

**Errors** (the CPU kernel's codes; a round's first failing change in the CPU's order names it): -7 a chunk's
``prev`` disagrees with where its group starts; -5 a bypass field past the section; -6 an escape beyond
``2^40 >> B`` or a rank past its block; -8 a zero step or one wider than the dtype; -1 words read past the
chunk's after a round; after the last round -2 words left, -4 bypass bits left (a whole byte, or nonzero
padding), -3 a lane not back at ``2^16``. Then, with torch on the device, the continuation check
(:meth:`engine_ext.format.context.rans_stage.Plan.check_continuations`). Any: :class:`IntegrityError` (the host's
message; where several chunks fail, the lowest code, as the host's threads report).

**Parallelism** is the part's: ``chunks x lanes`` rANS chains (a 4096 x 4096 part at 1 % has 10-20 chunks of up
to 16384 changes, 4 lanes each), each round a chain of dependent loads; a program's time is its chunk's rounds.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from ..errors import IntegrityError
from ..format.context import rans
from ..format.context.models import EXACT, QMAX

try:
    import triton
    import triton.language as tl
except ImportError:  # annotations are strings (``from __future__``); decode needs Triton
    triton = tl = None


def _jit(fn):
    """``triton.jit`` when Triton is installed (an interpreted function under ``TRITON_INTERPRET=1``)."""
    return triton.jit(fn) if triton is not None else fn


def _device_fn(fn):
    """A device function: ``triton.jit``, except under Triton's interpreter, where the plain function runs inside
    the interpreted kernel (which has patched ``triton.language`` already): an interpreted device-function call
    re-patches it, ~1 ms a call, most of a round's time on the CPU."""
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        return fn
    return triton.jit(fn)


def _const(v: int):
    return tl.constexpr(v) if tl is not None else v


LANES_MIN = 4  # the lanes vector's width at least (the format's chunks have 1-4 lanes; wider ones widen it)
_RANS_L = _const(rans.RANS_L)
_PROB_BITS = _const(rans.PROB_BITS)
_SLOT = _const(rans.M - 1)
_QMAX = _const(QMAX)
_EXACT = _const(EXACT)
_ESCAPE = _const(48)  # rans_stage_kernels.ESCAPE_BITS
_ESCAPE_MASK = _const((1 << 48) - 1)
_LIMIT_BITS = _const(40)  # an escaped quotient q must keep q << B <= 2^40 (rans_stage: ``lim``)

_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if _INTERPRETED or tl is None:  # the interpreter: reductions without a device-function call each (~1 ms a call)

    @_device_fn
    def _sum(v, axis):
        """``tl.sum`` without its dtype promotion (every use here sums int64 or int32)."""
        return tl.reduce(v, axis, tl.standard._sum_combine)

    @_device_fn
    def _max(v, axis):
        return tl.reduce(v, axis, tl.standard._elementwise_max)

    @_device_fn
    def _min(v, axis):
        return tl.reduce(v, axis, tl.standard._elementwise_min)

    @_device_fn
    def _cumsum(v):
        return tl.associative_scan(v, 0, tl.standard._sum_combine)
else:  # a device: Triton's public reductions (the same results on int64 and int32, which is all this sums)

    @_device_fn
    def _sum(v, axis):
        return tl.sum(v, axis)

    @_device_fn
    def _max(v, axis):
        return tl.max(v, axis)

    @_device_fn
    def _min(v, axis):
        return tl.min(v, axis)

    @_device_fn
    def _cumsum(v):
        return tl.cumsum(v, 0)


@_device_fn
def _bits(data_ptr, at, end, off, fmask, act, k):
    """Per lane, the bits ``fmask`` (``2^w - 1``, ``w <= 48``) selects at bit ``off`` of the bytes from ``at``,
    least significant bit first; bytes at or past ``end`` read as zero (as do inactive lanes). ``k``:
    ``arange(0, 8)``: 8 bytes, shifts up to 56; byte 7 lands at bits 56-63, above the 49 that are read."""
    idx = (at + (off >> 3))[:, None] + k[None, :]
    b = tl.load(data_ptr + idx, mask=act[:, None] & (idx < end), other=0).to(tl.int64)
    return (_sum(b << (8 * k[None, :]), 1) >> (off & 7)) & fmask


@_device_fn
def _step(data_ptr, tab_ptr, row, x, r, act, last, k):
    """One rANS decode step on the active lanes, table rows ``row``: (symbols, new states, new word offset).
    ``k``: ``arange(0, 2)``. Every lane's ``x`` and ``row`` are valid, so the table load needs no mask."""
    ent = tl.load(tab_ptr + row + (x & _SLOT)).to(tl.int64)
    v = (ent & 0x1FFF) * (x >> _PROB_BITS) + ((ent >> 13) & 0xFFF)
    need = act & (v < _RANS_L)
    ni = need.to(tl.int64)
    at = tl.minimum(r + 2 * (_cumsum(ni) - ni), last)  # words in lane order
    word = _sum(
        tl.load(data_ptr + at[:, None] + k[None, :], mask=need[:, None], other=0).to(tl.int64) << (8 * k[None, :]), 1
    )
    return ent >> 25, tl.where(need, (v << 16) | word, tl.where(act, v, x)), r + 2 * _sum(ni, 0)


@_device_fn
def _first(code, ln, width):
    """The code of the first lane whose code is nonzero (0: none)."""
    i = _min(tl.where(code != 0, ln, width), 0)
    return _sum(tl.where(ln == i, code, 0), 0)


@_device_fn
def _at(v, ln, i):
    """Lane ``i`` of ``v``."""
    return _sum(tl.where(ln == i, v, 0), 0)


@_device_fn
def _any(flags):
    return _sum(flags.to(tl.int32), 0) > 0


@_jit
def _rans_decode_kernel(
    data_ptr,
    which_ptr,
    c_start_ptr,
    lanes_ptr,
    offs_ptr,
    nwords_ptr,
    nbypass_ptr,
    c_state_ptr,
    prev_ptr,
    c_block_ptr,
    states_ptr,
    gend_ptr,
    gq_ptr,
    gB_ptr,
    gsize_ptr,
    gs_ptr,
    qtab_ptr,
    stab_ptr,
    ranks_ptr,
    steps_ptr,
    err_ptr,
    K,
    itembits,
    last,
    LANES: tl.constexpr,
):
    """Chunk ``which[pid]`` into ``ranks``/``steps`` at its changes' places; ``err[pid]`` its code (0: sound)."""
    pid = tl.program_id(0)
    ch = tl.load(which_ptr + pid)
    s = tl.load(c_start_ptr + ch)
    e = tl.load(c_start_ptr + ch + 1)
    L = tl.load(lanes_ptr + ch)
    r = tl.load(offs_ptr + ch)
    wend = r + 2 * tl.load(nwords_ptr + ch)
    bend = wend + tl.load(nbypass_ptr + ch)
    nbits = 8 * (bend - wend)
    ln = tl.arange(0, LANES).to(tl.int64)
    k8 = tl.arange(0, 8).to(tl.int64)
    k2 = tl.arange(0, 2).to(tl.int64)
    zero = ln * 0
    one = zero + 1
    none = ln < 0
    x = tl.load(states_ptr + tl.load(c_state_ptr + ch) + ln, mask=ln < L, other=_RANS_L)
    g = tl.load(c_block_ptr + ch) * K  # the group of change s, its end, its parameters on every lane
    while tl.load(gend_ptr + g) <= s:
        g += 1
    ge = tl.load(gend_ptr + g)
    gl = g + zero
    B = tl.load(gB_ptr + g + zero)
    qrow = tl.load(gq_ptr + g + zero)
    srow = tl.load(gs_ptr + g + zero)
    size = tl.load(gsize_ptr + g + zero)
    bm = (one << B) - 1  # the low bits' mask
    gfirst = tl.where(g > 0, tl.load(gend_ptr + tl.maximum(g - 1, 0)), 0)
    prev = tl.load(prev_ptr + ch) - 1
    err = tl.where((prev >= 0) == (gfirst == s), -7, 0).to(tl.int64)
    used = s - s  # bypass bits read
    j = s
    ii = ln[None, :]
    before = ii <= ln[:, None]
    while (j < e) & (err == 0):
        m = tl.minimum(L, e - j)
        jj = j + ln
        act = ln < m
        starts = none  # the lanes whose change starts its group
        cross = j + m > ge
        if cross:  # the round leaves group g: walk each lane past the groups that end at or before its change
            gl = g + zero
            adv = act & (tl.load(gend_ptr + gl) <= jj)
            while _any(adv):
                gl += adv.to(tl.int64)
                adv = act & (tl.load(gend_ptr + gl) <= jj)
            starts = act & (jj == tl.load(gend_ptr + gl - 1, mask=act & (gl > 0), other=0))
            B = tl.load(gB_ptr + gl)
            qrow = tl.load(gq_ptr + gl)
            srow = tl.load(gs_ptr + gl)
            size = tl.load(gsize_ptr + gl)
            bm = (one << B) - 1
        Ba = tl.where(act, B, 0)
        # quotients (an escape: 48 more bits), their low bits, the ranks
        q, x, r = _step(data_ptr, qtab_ptr, qrow, x, r, act, last, k2)
        esc = act & (q == _QMAX)
        w = Ba + tl.where(esc, _ESCAPE, 0)
        o = used + _cumsum(w) - w
        big = none
        if _any(esc):
            q += tl.where(esc, _bits(data_ptr, wend, bend, o, _ESCAPE_MASK, esc, k8), 0)
            big = esc & (q > (tl.full(q.shape, 1, tl.int64) << _LIMIT_BITS) >> Ba)
            q = tl.where(big, 0, q)
        d = tl.where(act, 1 + ((q << Ba) | _bits(data_ptr, wend, bend, o + w - Ba, bm, act, k8)), 0)
        rank = prev + _cumsum(d)
        if cross:  # a segmented prefix sum: ranks restart at a group's first change
            t = _max(tl.where(before & starts[None, :], ii, -1), 1)
            rank = tl.where(t >= 0, -1, prev) + _sum(tl.where(before & (ii >= t[:, None]), d[None, :], 0), 1)
        over = act & (rank >= size)
        used += _sum(w, 0)
        # steps (a symbol from EXACT on: lg more bits)
        us = used
        sy, x, r = _step(data_ptr, stab_ptr, srow, x, r, act, last, k2)
        wide = act & (sy >= _EXACT)
        z = sy
        lg = zero
        if _any(wide):
            lg = tl.where(wide, sy - _EXACT + 3, 0)
            top = one << lg
            z = tl.where(wide, top | _bits(data_ptr, wend, bend, used + _cumsum(lg) - lg, top - 1, wide, k8), sy)
            used += _sum(lg, 0)
        zbad = act & ((z == 0) | ((z >> itembits) != 0))
        tl.store(ranks_ptr + jj, rank, mask=act)
        tl.store(steps_ptr + jj, ((z >> 1) ^ -(z & 1)).to(steps_ptr.dtype.element_ty), mask=act)
        prev = _at(rank, ln, m - 1)
        if cross:  # the next round starts in the group of this one's last change
            g = _at(gl, ln, m - 1)
            ge = tl.load(gend_ptr + g)
            B = tl.load(gB_ptr + g + zero)
            qrow = tl.load(gq_ptr + g + zero)
            srow = tl.load(gs_ptr + g + zero)
            size = tl.load(gsize_ptr + g + zero)
            bm = (one << B) - 1
        if (used > nbits) | (r > wend) | _any(big | over | zbad):  # the round's first failure, in the CPU's order
            cq = tl.where(
                esc & (o + _ESCAPE > nbits),
                -5,
                tl.where(big, -6, tl.where(act & (o + w > nbits), -5, tl.where(over, -6, 0))),
            )
            o2 = us + _cumsum(lg) - lg
            cs = tl.where(act & (o2 + lg > nbits), -5, tl.where(zbad, -8, 0))
            code = _first(cq.to(tl.int64), ln, LANES)
            code = tl.where(code != 0, code, _first(cs.to(tl.int64), ln, LANES))
            err = tl.where(code != 0, code, -1)  # else only the words overran
        j += m
    pad = tl.load(data_ptr + wend + (used >> 3), mask=(used < nbits) & ((used & 7) != 0), other=0).to(tl.int64)
    left = (nbits - used >= 8) | ((pad >> (used & 7)) != 0)
    err = tl.where(
        err != 0, err, tl.where(r != wend, -2, tl.where(left, -4, tl.where(_any((x != _RANS_L) & (ln < L)), -3, 0)))
    )
    tl.store(err_ptr + pid, err.to(tl.int32))


# ----------------------------------------------------------------------------- launcher

_ON_DEVICE: dict = {}  # (id(table), device) -> (weakref to the host table, its device copy)


def _on_device(arr: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A device copy of a cached host table (the quotient tables, a version's step tables), made once per device."""
    key = (id(arr), str(dev))
    hit = _ON_DEVICE.get(key)
    if hit is not None and hit[0]() is arr:
        return hit[1]
    if len(_ON_DEVICE) >= 64:
        _ON_DEVICE.clear()
    t = torch.from_numpy(np.ascontiguousarray(arr, np.int32)).to(dev)
    _ON_DEVICE[key] = (weakref.ref(arr), t)
    return t


CPU_TOO = False  # tests: context_decode decodes here for a base on the CPU too (in Triton's interpreter)


def serves(device: torch.device) -> bool:
    """Whether ``engine_ext.triton_kernels.context_decode`` decodes a part's ctx-rans streams here for a base on
    ``device``: on an accelerator. On the CPU the host's decoder is the device's own (numba, a few ns per change;
    Triton's interpreter takes ~1 ms per change), unless :data:`CPU_TOO` (what tests set to hold this kernel
    against the host's through ``context_decode``)."""
    return torch.device(device).type != "cpu" or CPU_TOO


def _lanes_width(lanes: np.ndarray) -> int:
    most = int(lanes.max()) if lanes.size else 1
    return max(LANES_MIN, 1 << (most - 1).bit_length())


def decode(data: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranks int64, steps) of ``plan.which``'s chunks on ``data``'s device (``data``: the part's bytes, uint8, the
    plan's offsets index it), block-major (:attr:`Plan.starts`; other chunks' entries zero): what
    :func:`engine_ext.format.context.rans_stage.decode` gives, bit for bit, or :class:`IntegrityError` where it refuses.
    One launch, one sync."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"data must be 1-D uint8, got {data.dtype} {tuple(data.shape)}")
    data = data.contiguous()
    dev = data.device
    p = plan
    itemsize = np.dtype(p.step_dtype).itemsize
    ranks = torch.zeros(p.n, dtype=torch.int64, device=dev)
    steps = torch.zeros(p.n, dtype=_TORCH_INT[itemsize], device=dev)
    which = np.asarray(p.which, np.int64)
    if which.size == 0:
        return ranks, steps
    if data.numel() != int(p.offs[-1] + 2 * p.nwords[-1] + p.nbypass[-1]):  # every read stays inside ``data``
        raise IntegrityError(
            f"ctx-rans: {data.numel()} bytes where the plan's part has "
            f"{int(p.offs[-1] + 2 * p.nwords[-1] + p.nbypass[-1])}"
        )
    cont = which[p.prev[which] > 0]
    per_chunk, per_group = p.chunk_arrays(), p.group_arrays()
    parts = [which, *per_chunk, *per_group, p.c_start[cont] - 1, p.prev[cont] - 1]
    sizes = [int(a.size) for a in parts]
    host = np.concatenate([np.asarray(a, np.int64).reshape(-1) for a in parts])
    on_device = torch.from_numpy(host).to(dev).split(sizes)  # the plan: one copy
    which_d, at, expect = on_device[0], on_device[-2], on_device[-1]
    chunks, groups = on_device[1 : 1 + len(per_chunk)], on_device[1 + len(per_chunk) : -2]
    err = torch.empty(which.size, dtype=torch.int32, device=dev)
    width = _lanes_width(p.lanes[which])  # a chain per lane: 4 in the format's chunks (wider ones: more warps)
    _rans_decode_kernel[(which.size,)](
        data,
        which_d,
        *chunks,
        *groups,
        _on_device(p.qtab, dev),
        _on_device(p.stab, dev),
        ranks,
        steps,
        err,
        int(p.K),
        8 * itemsize,
        max(data.numel() - 2, 0),
        LANES=width,
        num_warps=1 if width <= 8 else 4,
    )
    bad = (ranks[at] != expect).any() if cont.size else torch.zeros((), dtype=torch.bool, device=dev)
    code, broken = torch.stack([err.min().to(torch.int64), bad.to(torch.int64)]).tolist()  # the one sync
    if code:
        raise IntegrityError(f"ctx-rans: corrupt chunk (code {code})")
    if broken:
        raise IntegrityError("ctx-rans: a chunk does not continue its (block, class) where the previous ended")
    return ranks, steps


__all__ = ["CPU_TOO", "LANES_MIN", "decode", "serves"]
