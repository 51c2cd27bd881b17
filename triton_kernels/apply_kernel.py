"""One Triton launch per dtype width applies every segment of a delta, in place.

A segment is one (checkpoint tensor, destination piece) pair of
:mod:`engine_ext.apply`. The kernel reads a small int64 segment table whose rows hold
raw addresses (``data_ptr``) of the destination storage, the positions and the
values, cast to pointers in the kernel (this also works under ``TRITON_INTERPRET=1``
on CPU tensors), so no concatenated copy of the delta is made. Per element it maps
the checkpoint index to a storage element (box test + affine map, checkpoint rank
padded to 4), reads the old bits, writes the new bits (absolute, or a wrapping step
in ordered key space), saves the old bits to the undo buffer, and adds
``h(i, new) - h(i, old)``: each block stores its partial sum and count, reduced per
segment afterwards (no atomics; int64 sums wrap mod 2^64, so the result is exact).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from engine_ext import fingerprint as fpr
from engine_ext.apply import MASK64, REL, Segment, apply_torch

MAXD = 4  # checkpoint rank handled by the kernel; more -> torch path
BLOCK = 1024
NCOL = 32
# table columns
C_DEST, C_POS, C_VAL, C_UNDO, C_N, C_FLAGS, C_LO, C_HI, C_OFF = range(9)
C_SHAPE, C_CS, C_START, C_EXT, C_DS = 9, 13, 17, 21, 25
F_DENSE, F_REL, F_FLOAT, F_COUNT, F_FLAT, F_CHECK = 1, 2, 4, 8, 16, 32
C_NUMEL = 29


# the literals in _hash below are the format's constants
assert (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB) == (fpr.GOLDEN, fpr.MIX1, fpr.MIX2)


@triton.jit
def _flip(x, W: tl.constexpr):
    """Ordered-key involution for floats: flip all but the sign bit when negative."""
    s = x >> (W - 1)  # arithmetic: -1 for negative, 0 otherwise
    return x ^ (s & ((1 << (W - 1)) - 1)).to(x.dtype)


@triton.jit
def _hash(i, bits, ZM: tl.constexpr):
    """h(i, b) of engine_ext.fingerprint in uint64 arithmetic (wraps like int64)."""
    b = bits.to(tl.int64) & ZM
    z = (i.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15) ^ b.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _apply_kernel(tab_ptr, blk_ptr, undo_ptr, acc_ptr, W: tl.constexpr, ZM: tl.constexpr, NC: tl.constexpr,
                  SAVE_UNDO: tl.constexpr, ROLLBACK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(blk_ptr + 2 * pid)
    item0 = tl.load(blk_ptr + 2 * pid + 1)
    row = tab_ptr + seg * NC
    dest = tl.load(row + 0).to(undo_ptr.dtype)
    pos = tl.load(row + 1).to(tl.pointer_type(tl.int64))
    vals = tl.load(row + 2).to(undo_ptr.dtype)
    undo_base = tl.load(row + 3)
    n = tl.load(row + 4)
    flags = tl.load(row + 5)
    lo = tl.load(row + 6)
    hi = tl.load(row + 7)
    off = tl.load(row + 8)
    dense = (flags & 1) != 0
    rel = (flags & 2) != 0
    is_float = (flags & 4) != 0
    counted = (flags & 8) != 0
    flat = (flags & 16) != 0

    q = item0 + tl.arange(0, BLOCK).to(tl.int64)
    valid = q < n
    if dense:
        if flat:
            i = lo + q
            dst = off + q
        else:
            rem = q
            e3 = tl.load(row + 24)
            c3 = rem % e3
            rem = rem // e3
            e2 = tl.load(row + 23)
            c2 = rem % e2
            rem = rem // e2
            e1 = tl.load(row + 22)
            c1 = rem % e1
            c0 = rem // e1
            i = ((c0 + tl.load(row + 17)) * tl.load(row + 13) + (c1 + tl.load(row + 18)) * tl.load(row + 14)
                 + (c2 + tl.load(row + 19)) * tl.load(row + 15) + (c3 + tl.load(row + 20)) * tl.load(row + 16))
            dst = off + c0 * tl.load(row + 25) + c1 * tl.load(row + 26) + c2 * tl.load(row + 27) + c3 * tl.load(row + 28)
        m = valid
        vidx = i
    else:
        i = tl.load(pos + q, mask=valid, other=0)
        if flat:
            m = valid & (i >= lo) & (i < hi)
            dst = off + (i - lo)
        else:
            rem = i
            s3 = tl.load(row + 12)
            c3 = rem % s3 - tl.load(row + 20)
            rem = rem // s3
            s2 = tl.load(row + 11)
            c2 = rem % s2 - tl.load(row + 19)
            rem = rem // s2
            s1 = tl.load(row + 10)
            c1 = rem % s1 - tl.load(row + 18)
            c0 = rem // s1 - tl.load(row + 17)
            m = (valid & (c0 >= 0) & (c0 < tl.load(row + 21)) & (c1 >= 0) & (c1 < tl.load(row + 22))
                 & (c2 >= 0) & (c2 < tl.load(row + 23)) & (c3 >= 0) & (c3 < tl.load(row + 24)))
            dst = off + c0 * tl.load(row + 25) + c1 * tl.load(row + 26) + c2 * tl.load(row + 27) + c3 * tl.load(row + 28)
        vidx = q
    dst = tl.where(m, dst, 0)

    if ROLLBACK:
        old_bits = tl.load(undo_ptr + undo_base + q, mask=m, other=0)
        tl.store(dest + dst, old_bits, mask=m)
    else:
        old = tl.load(dest + dst, mask=m, other=0)
        v = tl.load(vals + vidx, mask=m, other=0)
        key = tl.where(is_float, _flip(old, W), old)
        nk = (key + v).to(old.dtype)
        stepped = tl.where(is_float, _flip(nk, W), nk)
        new = tl.where(rel, stepped, v)
        tl.store(dest + dst, new, mask=m)
        if SAVE_UNDO:
            tl.store(undo_ptr + undo_base + q, old, mask=m)
        mc = m & counted
        d = tl.where(mc, _hash(i, new, ZM) - _hash(i, old, ZM), 0)
        tl.store(acc_ptr + 2 * pid, tl.sum(d, axis=0).to(tl.int64, bitcast=True))
        tl.store(acc_ptr + 2 * pid + 1, tl.sum(mc.to(tl.int64), axis=0))


@triton.jit
def _check_kernel(tab_ptr, blk_ptr, bad_ptr, NC: tl.constexpr, BLOCK: tl.constexpr):
    """Flag a block whose positions are out of range or not strictly increasing (one read pass)."""
    pid = tl.program_id(0)
    seg = tl.load(blk_ptr + 2 * pid)
    item0 = tl.load(blk_ptr + 2 * pid + 1)
    row = tab_ptr + seg * NC
    flags = tl.load(row + 5)
    if (flags & 32) != 0:
        pos = tl.load(row + 1).to(tl.pointer_type(tl.int64))
        n = tl.load(row + 4)
        numel = tl.load(row + 29)
        q = item0 + tl.arange(0, BLOCK).to(tl.int64)
        valid = q < n
        p = tl.load(pos + q, mask=valid, other=0)
        prev = tl.load(pos + q - 1, mask=valid & (q > 0), other=-1)
        bad = valid & ((p < 0) | (p >= numel) | (p <= prev))
        tl.store(bad_ptr + pid, tl.max(bad.to(tl.int32), axis=0))


_STATIC: dict = {}  # id(segment geometry) -> (geometry, the row's static part): maps are static


def _static_row(seg: Segment) -> list[int]:
    """The columns that depend only on the piece and the checkpoint tensor (rank padded to MAXD)."""
    pc, td = seg.piece, seg.td
    pad = MAXD - len(td.shape)
    shape = (1,) * pad + tuple(td.shape)
    cs = (0,) * pad + seg.cstrides
    start = (0,) * pad + tuple(pc.start)
    ext = (1,) * pad + seg.ext
    ds = (0,) * pad + tuple(pc.strides)
    flags = (F_FLOAT if td.dtype.is_float else 0) | (F_COUNT if pc.count_fingerprint else 0)
    flags |= F_FLAT if seg.flat is not None else 0
    lo, hi = seg.flat if seg.flat is not None else (0, 0)
    r = [seg.storage.data_ptr(), 0, 0, 0, 0, flags, lo, hi, pc.offset]
    r += list(shape) + list(cs) + list(start) + list(ext) + list(ds)
    r += [0] * (NCOL - len(r))
    r[C_NUMEL] = td.numel
    return r


def _row(seg: Segment, pos, vals, undo_base: int, check: bool) -> list[int]:
    """One table row (see the C_* columns)."""
    g = seg.geom
    hit = _STATIC.get(id(g)) if g is not None else None
    if hit is not None and hit[0] is g:
        r = list(hit[1])
    else:
        r = _static_row(seg)
        if g is not None:
            if len(_STATIC) > 1 << 16:
                _STATIC.clear()
            _STATIC[id(g)] = (g, list(r))
    r[C_POS] = 0 if pos is None else pos.data_ptr()
    r[C_VAL] = vals.data_ptr()
    r[C_UNDO] = undo_base
    r[C_N] = seg.n
    r[C_FLAGS] |= (F_DENSE if seg.dense else 0) | (F_REL if seg.td.mode == REL else 0) | (F_CHECK if check else 0)
    return r


class _TritonUndo:
    """Undo buffer of one width: old bits at each segment's item slots, replayed by the same kernel."""

    def __init__(self, W, tab, blk, undo, keep):
        self.W, self.tab, self.blk, self.undo, self._keep = W, tab, blk, undo, keep

    @property
    def nbytes(self) -> int:
        return self.undo.numel() * self.undo.element_size()

    def rollback(self) -> None:
        _launch(self.W, self.tab, self.blk, self.undo, None, save_undo=False, rollback=True)


def _launch(W, tab, blk, undo, acc, *, save_undo, rollback):
    nblk = blk.numel() // 2
    zm = -1 if W == 64 else (1 << W) - 1
    if acc is None:
        acc = torch.zeros(2, dtype=torch.int64, device=tab.device)
    _apply_kernel[(nblk,)](tab, blk, undo, acc, W=W, ZM=zm, NC=NCOL, SAVE_UNDO=save_undo, ROLLBACK=rollback,
                           BLOCK=BLOCK, num_warps=4)


def _on(t: torch.Tensor, dev) -> torch.Tensor:
    return t if t.device == dev else t.to(dev)


_INT = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def apply_triton(segs: list[Segment], names: list[str], undo: bool, checks: list):
    """Apply validated segments with one launch per (device, width); rank > 4 and converting
    destinations (a widened copy, see ``engine_ext.apply.Conversion``) go to the torch path.

    ``checks``: deltas whose positions still need the order/range check; it runs on the
    device over the same tables (one read pass, one sync) before anything is written.
    """
    fp = {n: 0 for n in names}
    written = {n: 0 for n in names}
    parts = []
    groups: dict = {}
    for s in segs:
        if len(s.td.shape) <= MAXD and s.conv is None and s.n > 0 and s.numel > 0:
            groups.setdefault((s.storage.device, s.td.dtype.bits), []).append(s)
    moved: dict = {}
    need = {id(td) for td in checks}
    plans, flags = [], []
    for (dev, W), group in groups.items():
        rows, counts, keep, undo_total = [], [], [], 0
        for s in group:
            key = (s.tensor, dev)
            if key not in moved:
                td = s.td
                moved[key] = (None if td.positions is None else _on(td.positions, dev), _on(td.values, dev))
            pos, vals = moved[key]
            keep += [pos, vals]
            check = id(s.td) in need
            need.discard(id(s.td))
            rows.append(_row(s, pos, vals, undo_total, check))
            counts.append(-(-s.n // BLOCK))
            undo_total += s.n
        tab = torch.from_numpy(np.array(rows, dtype=np.int64)).to(dev)
        cnt = torch.from_numpy(np.array(counts, dtype=np.int64))
        seg_of_blk = torch.repeat_interleave(torch.arange(len(group), dtype=torch.int64), cnt)
        first = torch.cumsum(cnt, 0) - cnt
        item0 = (torch.arange(seg_of_blk.numel(), dtype=torch.int64) - first[seg_of_blk]) * BLOCK
        blk = torch.stack([seg_of_blk, item0], 1).reshape(-1).to(dev)
        bad = torch.zeros(blk.numel() // 2, dtype=torch.int32, device=dev)
        _check_kernel[(bad.numel(),)](tab, blk, bad, NC=NCOL, BLOCK=BLOCK, num_warps=4)
        flags.append(bad.any())
        plans.append((dev, W, group, tab, blk, undo_total, keep))
    from engine_ext.apply import check_positions

    check_positions([td for td in checks if id(td) in need])  # tensors without a kernel segment
    if flags and bool(torch.stack([f.cpu() for f in flags]).any()):
        check_positions(checks)  # names the culprit
        raise ValueError("positions must be sorted, unique and in range")
    slow = [s for s in segs if len(s.td.shape) > MAXD or s.conv is not None]
    if slow:
        f2, w2, log = apply_torch(slow, names, undo)
        for n in names:
            fp[n] = (fp[n] + f2[n]) & MASK64
            written[n] += w2[n]
        if log is not None:
            parts.append(log)
    for dev, W, group, tab, blk, undo_total, keep in plans:
        ubuf = torch.empty(undo_total if undo else 1, dtype=_INT[W], device=dev)
        part = torch.empty(blk.numel(), dtype=torch.int64, device=dev)  # per block: (fp sum, count)
        _launch(W, tab, blk, ubuf, part, save_undo=undo, rollback=False)
        acc = torch.zeros(len(group), 2, dtype=torch.int64, device=dev)
        acc.index_add_(0, blk.view(-1, 2)[:, 0], part.view(-1, 2))  # int64 sums wrap mod 2^64
        acc = acc.reshape(-1).cpu().tolist()
        for k, s in enumerate(group):
            if s.piece.count_fingerprint:
                fp[s.td.name] = (fp[s.td.name] + acc[2 * k]) & MASK64
                written[s.td.name] += acc[2 * k + 1]
        if undo:
            parts.append(_TritonUndo(W, tab, blk, ubuf, keep))
    return fp, written, parts
