"""Fused in-place apply of a weight delta: one Triton launch per dtype width.

A leaf: this module imports torch and Triton only. ``engine_ext.server.apply_fused`` builds
its inputs from the package's segments; :func:`reference_apply` is the same
computation in torch, and ``tests/test_apply_kernel.py`` holds the two side by side.

**Inputs.** A *segment* is one (checkpoint tensor, destination box) pair. ``table`` is
int64 ``[S, NCOL]``, one row per segment, columns named ``C_*`` below: raw addresses
(``data_ptr``) of the destination storage (viewed as signed ints of width ``W``), of the
sorted int64 positions and of the values, the segment's first undo slot, its item
count ``n``, flags ``F_*``, and its geometry padded to rank 4: checkpoint shape and
row-major strides, box start and extent, destination strides, destination offset,
and the flat range ``[lo, hi)`` when the box is a contiguous run. ``blocks`` is int64
``[B, 2]`` (segment, first item): block ``b`` handles items ``first .. first + BLOCK``.

**Math**, for item ``q`` of a segment (``q < n``):

* checkpoint index ``i``: ``positions[q]`` (sparse) or the ``q``-th element of the box
  in row-major order (dense); it is in the box if ``start <= coords(i) < start + ext``;
* destination element ``dst = off + sum_d (coords_d(i) - start_d) * dstride_d``
  (``off + i - lo`` on the flat path);
* ``new = values[q]`` (absolute) or ``unkey(key(old) + values[q])`` with the ordered
  key of floats ``key(x) = x ^ ((x >> (W-1)) & (2^(W-1) - 1))`` (an involution; a step
  wraps in ``W`` bits);
* ``undo[first_undo + q] = old``; ``dest[dst] = new``;
* per block: ``sum h(i, new) - h(i, old)`` and the count over counted segments, with
  ``h(i, b) = mix64((i * 0x9E3779B97F4A7C15) ^ zext(b))``, SplitMix64's finaliser
  ``mix64`` (shifts 30, 27, 31; multipliers 0xBF58476D1CE4E5B9, 0x94D049BB133111EB),
  in uint64 arithmetic that wraps, so the per-segment sums are exact mod 2^64.

Rollback writes ``undo`` back to the same ``dst``. :func:`check_positions` flags, in
one read pass, blocks whose positions are out of ``[0, numel)`` or not strictly
increasing, before anything is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
MAXD = 4  # checkpoint rank the geometry columns hold
NCOL = 32

# table columns
C_DEST = tl.constexpr(0)
C_POS = tl.constexpr(1)
C_VAL = tl.constexpr(2)
C_UNDO = tl.constexpr(3)
C_N = tl.constexpr(4)
C_FLAGS = tl.constexpr(5)
C_LO = tl.constexpr(6)
C_HI = tl.constexpr(7)
C_OFF = tl.constexpr(8)
C_SHAPE = tl.constexpr(9)  # 4 columns each, from here on
C_CSTRIDE = tl.constexpr(13)
C_START = tl.constexpr(17)
C_EXT = tl.constexpr(21)
C_DSTRIDE = tl.constexpr(25)
C_NUMEL = tl.constexpr(29)

# flags
F_DENSE = tl.constexpr(1)
F_REL = tl.constexpr(2)
F_FLOAT = tl.constexpr(4)
F_COUNT = tl.constexpr(8)
F_FLAT = tl.constexpr(16)
F_CHECK = tl.constexpr(32)

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # the literals in _hash


@triton.jit
def _flip(x, W: tl.constexpr):
    """Ordered-key involution for floats: flip all but the sign bit when negative."""
    s = x >> (W - 1)  # arithmetic: -1 for negative, 0 otherwise
    return x ^ (s & ((1 << (W - 1)) - 1)).to(x.dtype)


@triton.jit
def _hash(i, bits, ZM: tl.constexpr):
    """h(i, b) in uint64 arithmetic (wraps like int64)."""
    b = bits.to(tl.int64) & ZM
    z = (i.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15) ^ b.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _col(row, c):
    return tl.load(row + c)


@triton.jit
def _dest(row, off, c0, c1, c2, c3):
    """The destination offset of box coordinates (c0..c3): the segment's offset plus their destination strides."""
    return (
        off
        + c0 * _col(row, C_DSTRIDE)
        + c1 * _col(row, C_DSTRIDE + 1)
        + c2 * _col(row, C_DSTRIDE + 2)
        + c3 * _col(row, C_DSTRIDE + 3)
    )


@triton.jit
def _apply_kernel(
    tab_ptr,
    blk_ptr,
    undo_ptr,
    acc_ptr,
    W: tl.constexpr,
    ZM: tl.constexpr,
    NC: tl.constexpr,
    SAVE_UNDO: tl.constexpr,
    ROLLBACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.load(blk_ptr + 2 * pid)
    item0 = tl.load(blk_ptr + 2 * pid + 1)
    row = tab_ptr + seg * NC
    dest = _col(row, C_DEST).to(undo_ptr.dtype)
    pos = _col(row, C_POS).to(tl.pointer_type(tl.int64))
    vals = _col(row, C_VAL).to(undo_ptr.dtype)
    undo_base = _col(row, C_UNDO)
    n = _col(row, C_N)
    flags = _col(row, C_FLAGS)
    lo = _col(row, C_LO)
    hi = _col(row, C_HI)
    off = _col(row, C_OFF)
    dense = (flags & F_DENSE) != 0
    rel = (flags & F_REL) != 0
    is_float = (flags & F_FLOAT) != 0
    counted = (flags & F_COUNT) != 0
    flat = (flags & F_FLAT) != 0

    q = item0 + tl.arange(0, BLOCK).to(tl.int64)
    valid = q < n
    if dense:
        if flat:
            i = lo + q
            dst = off + q
        else:  # box-relative coordinates of the q-th box element, row-major over the extent
            rem = q
            e3 = _col(row, C_EXT + 3)
            c3 = rem % e3
            rem = rem // e3
            e2 = _col(row, C_EXT + 2)
            c2 = rem % e2
            rem = rem // e2
            e1 = _col(row, C_EXT + 1)
            c1 = rem % e1
            c0 = rem // e1
            i = (
                (c0 + _col(row, C_START)) * _col(row, C_CSTRIDE)
                + (c1 + _col(row, C_START + 1)) * _col(row, C_CSTRIDE + 1)
                + (c2 + _col(row, C_START + 2)) * _col(row, C_CSTRIDE + 2)
                + (c3 + _col(row, C_START + 3)) * _col(row, C_CSTRIDE + 3)
            )
            dst = _dest(row, off, c0, c1, c2, c3)
        m = valid
        vidx = i
    else:
        i = tl.load(pos + q, mask=valid, other=0)
        if flat:
            m = valid & (i >= lo) & (i < hi)
            dst = off + (i - lo)
        else:  # checkpoint coordinates of i, relative to the box start
            rem = i
            s3 = _col(row, C_SHAPE + 3)
            c3 = rem % s3 - _col(row, C_START + 3)
            rem = rem // s3
            s2 = _col(row, C_SHAPE + 2)
            c2 = rem % s2 - _col(row, C_START + 2)
            rem = rem // s2
            s1 = _col(row, C_SHAPE + 1)
            c1 = rem % s1 - _col(row, C_START + 1)
            c0 = rem // s1 - _col(row, C_START)
            m = (
                valid
                & (c0 >= 0)
                & (c0 < _col(row, C_EXT))
                & (c1 >= 0)
                & (c1 < _col(row, C_EXT + 1))
                & (c2 >= 0)
                & (c2 < _col(row, C_EXT + 2))
                & (c3 >= 0)
                & (c3 < _col(row, C_EXT + 3))
            )
            dst = _dest(row, off, c0, c1, c2, c3)
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
    flags = _col(row, C_FLAGS)
    if (flags & F_CHECK) != 0:
        pos = _col(row, C_POS).to(tl.pointer_type(tl.int64))
        n = _col(row, C_N)
        numel = _col(row, C_NUMEL)
        q = item0 + tl.arange(0, BLOCK).to(tl.int64)
        valid = q < n
        p = tl.load(pos + q, mask=valid, other=0)
        prev = tl.load(pos + q - 1, mask=valid & (q > 0), other=-1)
        bad = valid & ((p < 0) | (p >= numel) | (p <= prev))
        tl.store(bad_ptr + pid, tl.max(bad.to(tl.int32), axis=0))


# ----------------------------------------------------------------------------- launchers

INT_OF_WIDTH = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def blocks_for(counts: list[int], device) -> torch.Tensor:
    """The ``[B, 2]`` (segment, first item) blocks covering segments of ``counts`` items."""
    cnt = torch.tensor([-(-c // BLOCK) for c in counts], dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64), cnt)
    first = torch.cumsum(cnt, 0) - cnt
    item0 = (torch.arange(seg.numel(), dtype=torch.int64) - first[seg]) * BLOCK
    return torch.stack([seg, item0], 1).to(device)


def _launch(
    table: torch.Tensor, blocks: torch.Tensor, undo: torch.Tensor, width: int, *, save_undo: bool, rollback: bool
) -> torch.Tensor:
    """One launch of :func:`_apply_kernel` over ``blocks``: per block, [fingerprint change, counted elements]."""
    part = torch.empty(blocks.shape[0], 2, dtype=torch.int64, device=table.device)
    _apply_kernel[(blocks.shape[0],)](
        table,
        blocks,
        undo,
        part,
        W=width,
        ZM=-1 if width == 64 else (1 << width) - 1,
        NC=NCOL,
        SAVE_UNDO=save_undo,
        ROLLBACK=rollback,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return part


def apply_segments(table: torch.Tensor, blocks: torch.Tensor, undo: torch.Tensor | None, width: int) -> torch.Tensor:
    """Apply every segment of ``table`` (rows for one dtype width); returns per-segment
    ``[S, 2]`` int64 (fingerprint change mod 2^64, counted elements). ``undo``: ``n``
    slots per segment at its ``C_UNDO`` (None: no undo kept)."""
    buf = undo if undo is not None else torch.empty(1, dtype=INT_OF_WIDTH[width], device=table.device)
    part = _launch(table, blocks, buf, width, save_undo=undo is not None, rollback=False)
    acc = torch.zeros(table.shape[0], 2, dtype=torch.int64, device=table.device)
    acc.index_add_(0, blocks[:, 0], part)  # int64 sums wrap mod 2^64
    return acc


def rollback_segments(table: torch.Tensor, blocks: torch.Tensor, undo: torch.Tensor, width: int) -> None:
    """Write the old bits saved by :func:`apply_segments` back."""
    _launch(table, blocks, undo, width, save_undo=False, rollback=True)


def check_positions(table: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per block, 1 if a segment flagged ``F_CHECK`` has positions out of range or out of order (no sync)."""
    bad = torch.zeros(blocks.shape[0], dtype=torch.int32, device=table.device)
    _check_kernel[(blocks.shape[0],)](table, blocks, bad, NC=NCOL, BLOCK=BLOCK, num_warps=4)
    return bad


# ----------------------------------------------------------------------------- torch reference


def _mix64(z: torch.Tensor) -> torch.Tensor:
    def shr(x, s):
        return (x >> s) & ((1 << (64 - s)) - 1)

    s64 = [m - (1 << 64) for m in (MIX1, MIX2)]
    z = z ^ shr(z, 30)
    z = z * s64[0]
    z = z ^ shr(z, 27)
    z = z * s64[1]
    return z ^ shr(z, 31)


def reference_apply(
    row: list[int], dest: torch.Tensor, positions: torch.Tensor | None, values: torch.Tensor, width: int
) -> tuple[torch.Tensor, int, int]:
    """One table row applied with torch, the kernel's math in plain form (for its tests).

    ``dest``: the destination storage as a flat int view of ``width`` bits (written in
    place); ``positions``/``values`` as the row's pointers name them. Returns (old bits
    in the undo layout: one slot per item, zero for items outside the box; fingerprint
    change mod 2^64; counted elements).
    """
    flags = row[C_FLAGS]

    def has(f) -> bool:
        return bool(flags & f.value)

    shape = row[C_SHAPE : C_SHAPE + MAXD]
    start = row[C_START : C_START + MAXD]
    ext = row[C_EXT : C_EXT + MAXD]
    dstride = row[C_DSTRIDE : C_DSTRIDE + MAXD]
    cstride = row[C_CSTRIDE : C_CSTRIDE + MAXD]
    q = torch.arange(row[C_N], dtype=torch.int64)
    keep = torch.ones_like(q, dtype=torch.bool)
    if has(F_DENSE):
        coords, rem = [], q
        for e in reversed(ext):
            coords.insert(0, rem % e)
            rem = rem // e
        i = sum((c + s) * cs for c, s, cs in zip(coords, start, cstride))
        vals = values[i]
    else:
        i = positions[: row[C_N]]
        coords, rem = [], i
        for s in reversed(shape):
            coords.insert(0, rem % s)
            rem = rem // s
        coords = [c - s for c, s in zip(coords, start)]
        for c, e in zip(coords, ext):
            keep &= (c >= 0) & (c < e)
        i, coords, vals = i[keep], [c[keep] for c in coords], values[: row[C_N]][keep]
    dst = row[C_OFF] + sum(c * d for c, d in zip(coords, dstride))
    old = dest[dst].clone()
    if has(F_REL):

        def key(x):
            return x ^ ((x >> (width - 1)) & ((1 << (width - 1)) - 1)) if has(F_FLOAT) else x

        new = key(key(old) + vals.to(old.dtype))
    else:
        new = vals.to(old.dtype)
    dest[dst] = new
    slots = torch.zeros(row[C_N], dtype=dest.dtype)
    slots[keep] = old
    if not has(F_COUNT):
        return slots, 0, 0
    zm = (1 << width) - 1 if width < 64 else -1

    def h(bits):
        return _mix64((i * (GOLDEN - (1 << 64))) ^ (bits.to(torch.int64) & zm))

    return slots, int((h(new) - h(old)).sum()) & ((1 << 64) - 1), int(i.numel())


__all__ = [
    "BLOCK",
    "C_CSTRIDE",
    "C_DEST",
    "C_DSTRIDE",
    "C_EXT",
    "C_FLAGS",
    "C_HI",
    "C_LO",
    "C_N",
    "C_NUMEL",
    "C_OFF",
    "C_POS",
    "C_SHAPE",
    "C_START",
    "C_UNDO",
    "C_VAL",
    "F_CHECK",
    "F_COUNT",
    "F_DENSE",
    "F_FLAT",
    "F_FLOAT",
    "F_REL",
    "MAXD",
    "NCOL",
    "apply_segments",
    "blocks_for",
    "check_positions",
    "reference_apply",
    "rollback_segments",
]
