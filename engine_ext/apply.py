"""Write a decoded delta into live parameters, in place, in O(changed elements).

The engine-agnostic half of the apply: a :class:`TensorMap` says where each element
of one checkpoint tensor lives at runtime on this rank (boxes of checkpoint
coordinates mapped affinely into parameter storage, as learned by
:mod:`engine_ext.layout`), and :func:`apply_delta` writes a list of
:class:`~engine_ext.delta.TensorDelta` through those maps. In the same pass it keeps
the old bits (undo log, for an all-or-nothing multi-tensor update) and the change of
each tensor's fingerprint (so verification needs no extra pass over the model).

Two executors with identical, bit-exact semantics: a vectorised torch path (the
reference, and the default on CPU) and a fused Triton kernel (the default for CUDA
tensors, one launch per dtype width; see ``engine_ext.triton_kernels``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from . import fingerprint as fpr
from .delta import ABS, REL, TensorDelta
from .dtypes import BY_TORCH, DType

MASK64 = fpr.MASK64
CHUNK = 1 << 16  # elements per torch-path step on the CPU: temporaries stay in cache (~0.5 MB each)
CHUNK_DEVICE = 1 << 20  # on accelerators: fewer launches


@dataclass
class Piece:
    """A box of checkpoint elements and where it lands in one destination parameter.

    Element ``c`` (checkpoint coordinates, ``start <= c < stop``) lives at storage
    element ``offset + sum_d (c_d - start_d) * strides[d]`` of ``dest``'s storage.
    """

    dest: torch.Tensor
    start: tuple[int, ...]
    stop: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]
    count_fingerprint: bool = True  # False for a second copy of the same checkpoint elements

    @property
    def extent(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        return math.prod(self.extent)


@dataclass
class TensorMap:
    """Where one checkpoint tensor lives on this rank; positions outside every box belong to another shard."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Unmappable:
    """A checkpoint tensor the loader transforms non-affinely (quantisation, repacking...)."""

    name: str
    reason: str


# Casts an engine may apply to a checkpoint tensor at load that keep every value exactly
# (vLLM's sgl CPU GEMM path keeps linear biases in float32): the checkpoint bits can be
# read back from the live value, so such a tensor is still updated in place, O(changed).
EXACT_WIDENINGS = frozenset({
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
})


@dataclass(frozen=True)
class Conversion:
    """The exact widening from a checkpoint dtype to the live dtype of a destination.

    A *converting* piece stores ``live = cast(checkpoint value)``. The executors read
    the old checkpoint bits back with :meth:`to_checkpoint` (exact for a widened
    value), apply the step there, write :meth:`to_live` of the new bits, and keep the
    old live bits for undo; fingerprints stay over checkpoint bits.
    """

    checkpoint: DType
    live: torch.dtype

    @property
    def live_int(self) -> torch.dtype:
        return BY_TORCH[self.live].int_view

    def to_live(self, bits: torch.Tensor) -> torch.Tensor:
        """Checkpoint bits -> live bits; refuses a value the cast would not keep (e.g. a NaN payload)."""
        live = bits.view(self.checkpoint.torch).to(self.live).view(self.live_int)
        if not torch.equal(self.to_checkpoint(live), bits):
            raise ValueError(f"a new value is not exactly representable through {self.checkpoint.name} -> {self.live}")
        return live

    def to_checkpoint(self, live_bits: torch.Tensor) -> torch.Tensor:
        return live_bits.view(self.live).to(self.checkpoint.torch).view(self.checkpoint.int_view)


def conversion(name: str, checkpoint: DType, live: torch.dtype) -> "Conversion | None":
    """None for an in-place copy, a :class:`Conversion` for an exact widening; ValueError otherwise."""
    if live == checkpoint.torch:
        return None
    if (checkpoint.torch, live) not in EXACT_WIDENINGS:
        raise ValueError(f"{name}: destination dtype {live} is not the checkpoint dtype {checkpoint.name} "
                         "nor an exact widening of it")
    return Conversion(checkpoint, live)


@dataclass
class ApplyResult:
    fingerprint_delta: dict[str, int]  # per tensor, mod 2^64, over counted pieces
    written: dict[str, int]  # changed checkpoint elements written into counted pieces
    undo: "UndoLog | None"


class UndoLog:
    """Old bits of every element an apply wrote; :meth:`rollback` restores them exactly.

    Holds O(changed) memory: the old bits (one per written element) plus references to
    the delta's positions (not copies). Rollback replays the same geometry in reverse.
    """

    def __init__(self, parts: list):
        self._parts = parts  # objects with .rollback() and .nbytes, applied order
        self.done = False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

    def rollback(self) -> None:
        if self.done:
            raise RuntimeError("undo log already used or discarded")
        for part in reversed(self._parts):
            part.rollback()
        self.done = True

    def discard(self) -> None:
        """Drop the saved bits once the update is committed."""
        self._parts = []
        self.done = True


# ---------------------------------------------------------------------------------
# Geometry shared by both executors


def row_major_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def storage_bits(dest: torch.Tensor, int_view: torch.dtype) -> torch.Tensor:
    """A flat signed-int view of ``dest``'s whole storage (writes land in the parameter)."""
    return torch.empty(0, dtype=int_view, device=dest.device).set_(dest.untyped_storage())


@dataclass
class Segment:
    """One (tensor delta, piece) pair, validated and with its geometry precomputed."""

    tensor: int  # index into the deltas list
    td: TensorDelta
    piece: Piece
    storage: torch.Tensor  # storage_bits(piece.dest) in the live dtype's width
    conv: "Conversion | None"  # set when the destination holds a widened copy
    cstrides: tuple[int, ...]  # checkpoint row-major strides
    flat: tuple[int, int] | None  # (lo, hi): box is a contiguous flat range mapped contiguously
    ext: tuple[int, ...] = ()  # box extent per checkpoint dim
    numel: int = 0  # box elements
    geom: tuple | None = None  # the cached geometry this segment came from (executors key caches on it)

    def __post_init__(self):
        if not self.ext:
            self.ext, self.numel = self.piece.extent, self.piece.numel

    @property
    def dense(self) -> bool:
        return self.td.positions is None

    @property
    def n(self) -> int:
        """Elements the executor enumerates: the delta's positions, or the box when dense."""
        return self.numel if self.dense else self.td.nnz


def _flat_range(p: Piece, shape, cstrides) -> tuple[int, int] | None:
    """(lo, hi) if checkpoint box elements lo..hi-1 land at offset.. contiguously."""
    ext = p.extent
    nd = len(shape)
    k = 0
    while k < nd and ext[k] == 1:
        k += 1
    for d in range(k + 1, nd):
        if p.start[d] != 0 or p.stop[d] != shape[d] or p.strides[d] != cstrides[d]:
            return None
    if k < nd and ext[k] > 1 and p.strides[k] != cstrides[k]:
        return None
    lo = sum(a * s for a, s in zip(p.start, cstrides))
    return lo, lo + p.numel


def _check_piece(name: str, shape, dtype: DType, p: Piece) -> None:
    nd = len(shape)
    if not (len(p.start) == len(p.stop) == len(p.strides) == nd):
        raise ValueError(f"{name}: piece has {len(p.start)}/{len(p.stop)}/{len(p.strides)} dims, tensor has {nd}")
    for d in range(nd):
        if not 0 <= p.start[d] <= p.stop[d] <= shape[d]:
            raise ValueError(f"{name}: piece box [{p.start}, {p.stop}) outside shape {tuple(shape)}")
    conversion(name, dtype, p.dest.dtype)
    if p.numel == 0:
        return
    lo = p.offset + sum((e - 1) * s for e, s in zip(p.extent, p.strides) if s < 0)
    hi = p.offset + sum((e - 1) * s for e, s in zip(p.extent, p.strides) if s > 0)
    size = p.dest.untyped_storage().nbytes() // p.dest.element_size()
    if lo < 0 or hi >= size:
        raise ValueError(f"{name}: piece reaches storage elements [{lo}, {hi}] outside [0, {size})")


def validate(deltas: list[TensorDelta], maps: dict) -> tuple[list[Segment], list[int]]:
    """Check everything but the positions' order and range (see :func:`check_positions`, run by
    the executor before it writes); return the segments and the deltas whose positions need it."""
    seen: dict[str, TensorDelta] = {}
    segs: list[Segment] = []
    dests: dict[tuple, str] = {}
    checks: list[int] = []
    for ti, td in enumerate(deltas):
        name = td.name
        if name in seen:  # a composed chain may give an absolute and a relative part, disjoint
            other = seen[name]
            if td.positions is None or other.positions is None or bool(torch.isin(td.positions, other.positions).any()):
                raise ValueError(f"{name}: appears twice in one apply with overlapping positions")
        seen[name] = td
        m = maps.get(name)
        if m is None:
            raise ValueError(f"{name}: no runtime map for this tensor")
        if isinstance(m, Unmappable):
            raise ValueError(f"{name}: unmappable ({m.reason}); reload it densely instead")
        if tuple(m.shape) != tuple(td.shape) or m.dtype is not td.dtype:
            raise ValueError(f"{name}: delta is {tuple(td.shape)}/{td.dtype.name}, runtime map is {tuple(m.shape)}/{m.dtype.name}")
        if td.mode not in (ABS, REL):
            raise ValueError(f"{name}: unknown mode {td.mode!r}")
        v = td.values
        if v.dim() != 1 or v.dtype != td.dtype.int_view:
            raise ValueError(f"{name}: values must be 1-D {td.dtype.int_view}, got {tuple(v.shape)} {v.dtype}")
        numel = td.numel
        if td.positions is None:
            if v.numel() != numel:
                raise ValueError(f"{name}: dense delta has {v.numel()} values for {numel} elements")
        else:
            p = td.positions
            if p.dim() != 1 or p.dtype != torch.int64:
                raise ValueError(f"{name}: positions must be 1-D int64, got {tuple(p.shape)} {p.dtype}")
            if p.numel() != v.numel():
                raise ValueError(f"{name}: {p.numel()} positions but {v.numel()} values")
            if p.numel():
                checks.append(ti)  # sorted/unique/range: checked by the executor, before any write
        for piece in m.pieces:
            g = _geometry(name, td.shape, td.dtype, piece)
            if g is None:
                continue  # empty box
            key = g[0]
            if key in dests and dests[key] != name:
                raise ValueError(f"{name}: writes the same destination elements as {dests[key]} (tied weights?); apply only one of them")
            dests[key] = name
            segs.append(Segment(ti, td, piece, *g[1:], geom=g))
    return segs, checks


_GEOM: dict = {}  # id(piece) -> (inputs, geometry): maps are static, so re-validating a piece is a lookup


def _geometry(name: str, shape, dtype: DType, piece: Piece):
    """Checked geometry of a piece: (dest key, storage view, conversion, checkpoint strides, flat range, extent, numel)."""
    st = piece.dest.untyped_storage()
    inputs = (tuple(piece.start), tuple(piece.stop), piece.offset, tuple(piece.strides), piece.count_fingerprint,
              st.data_ptr(), st.nbytes(), piece.dest.dtype, piece.dest.device, tuple(shape), dtype.name)
    hit = _GEOM.get(id(piece))
    if hit is not None and hit[0] == inputs:
        return hit[1]
    _check_piece(name, shape, dtype, piece)
    if piece.numel == 0:
        g = None
    else:
        cs = row_major_strides(shape)
        key = (st.data_ptr(), piece.offset, tuple(piece.strides), piece.extent)
        conv = conversion(name, dtype, piece.dest.dtype)
        live_int = dtype.int_view if conv is None else conv.live_int
        g = (key, storage_bits(piece.dest, live_int), conv, cs, _flat_range(piece, shape, cs), piece.extent, piece.numel)
    if len(_GEOM) > 1 << 16:
        _GEOM.clear()
    _GEOM[id(piece)] = (inputs, g)
    return g


def check_positions(tds: list[TensorDelta]) -> None:
    """Positions sorted, unique and in range; one device sync per device (ValueError otherwise)."""
    by_dev: dict = {}
    for td in tds:
        p = td.positions
        if p is None or p.numel() == 0:
            continue
        bad = (p[0] < 0) | (p[-1] >= td.numel)
        if p.numel() > 1:
            bad = bad | (p[1:] <= p[:-1]).any()
        by_dev.setdefault(p.device, []).append((bad, td))
    for items in by_dev.values():
        if bool(torch.stack([b for b, _ in items]).any()):
            td = next(t for b, t in items if bool(b))
            raise ValueError(f"{td.name}: positions must be sorted, unique and in [0, {td.numel})")


# ---------------------------------------------------------------------------------
# Torch executor (reference; CPU default)


def _box_coords(q: torch.Tensor, ext) -> list[torch.Tensor]:
    """Box-relative coordinates of box-flat indices ``q`` (row-major over ``ext``)."""
    coords = []
    rem = q
    for e in reversed(ext):
        coords.append(rem % e)
        rem = rem // e
    return coords[::-1]


def _chunk(seg: Segment, pos: torch.Tensor | None, a: int, b: int):
    """Checkpoint indices, destination indices and value indices of items a..b-1 of a segment.

    Returns (i, dst, vsel) where vsel selects the values (a slice or an index tensor)
    and ``i``/``dst`` are int64 tensors, or a slice for ``dst`` on the dense flat path.
    """
    pc = seg.piece
    dev = seg.storage.device
    if seg.dense:
        if seg.flat is not None:
            lo = seg.flat[0]
            return None, slice(pc.offset + a, pc.offset + b), slice(lo + a, lo + b)
        q = torch.arange(a, b, dtype=torch.int64, device=dev)
        c = _box_coords(q, seg.ext)
        i = sum((cd + s) * st for cd, s, st in zip(c, pc.start, seg.cstrides))
        dst = pc.offset + sum(cd * st for cd, st in zip(c, pc.strides))
        return i, dst, i
    p = pos[a:b]
    if seg.flat is not None:  # a..b already restricted to the box by searchsorted
        shift = pc.offset - seg.flat[0]
        return p, (p + shift if shift else p), slice(a, b)
    c = _box_coords(p, seg.td.shape)
    inbox = torch.ones_like(p, dtype=torch.bool)
    dst = torch.full_like(p, pc.offset)
    for cd, s, e, st in zip(c, pc.start, seg.ext, pc.strides):
        rel = cd - s
        inbox &= (rel >= 0) & (rel < e)
        dst += rel * st
    sel = inbox.nonzero().reshape(-1)
    return p[sel], dst[sel], sel + a


def _ranges(seg: Segment, pos: torch.Tensor | None) -> tuple[int, int]:
    """Item range [a, b) to enumerate: the box slice of sorted positions on the flat path."""
    if seg.dense or seg.flat is None:
        return 0, seg.n
    lo, hi = seg.flat
    if pos.device.type == "cpu":
        a, b = np.searchsorted(pos.numpy(), [lo, hi])
        return int(a), int(b)
    ab = torch.searchsorted(pos, torch.tensor([lo, hi], dtype=torch.int64, device=pos.device))
    return int(ab[0]), int(ab[1])


_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _hash_change(i: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor, sl) -> int:
    """sum h(i, new) - h(i, old) mod 2^64 (see engine_ext.fingerprint) as a Python int.

    On the CPU in numpy uint64 (logical shifts, in place, ``i * GOLDEN`` shared by both
    hashes, old and new mixed as one array); elsewhere
    :func:`engine_ext.fingerprint.element_hash`.
    """
    if i is None:  # dense flat: checkpoint indices are a range
        i = torch.arange(sl.start, sl.stop, dtype=torch.int64, device=old.device)
    if old.device.type != "cpu":
        return int(fpr.element_hash(i, new).sum()) - int(fpr.element_hash(i, old).sum())
    n = old.numel()
    ut = _NP_UINT[old.element_size()]
    z = np.empty((2, n), dtype=np.uint64)
    z[0] = old.numpy().view(ut)
    z[1] = new.numpy().view(ut)
    t = i.numpy().view(np.uint64) * _GOLDEN
    z ^= t
    t = np.empty_like(z)
    for shift, mul in ((_S30, _M1), (_S27, _M2)):
        np.right_shift(z, shift, out=t)
        z ^= t
        z *= mul
    np.right_shift(z, _S31, out=t)
    z ^= t
    s = z.sum(axis=1, dtype=np.uint64)
    return int(s[1]) - int(s[0])


_GOLDEN, _M1, _M2 = np.uint64(fpr.GOLDEN), np.uint64(fpr.MIX1), np.uint64(fpr.MIX2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _gather(t: torch.Tensor, sel) -> torch.Tensor:
    return t[sel].clone() if isinstance(sel, slice) else t.index_select(0, sel)


def _scatter(t: torch.Tensor, sel, src: torch.Tensor) -> None:
    if isinstance(sel, slice):
        t[sel] = src
    elif t.device.type == "cpu":  # numpy's scatter is ~1.5x faster than index_copy_ on the CPU
        t.numpy()[sel.numpy()] = src.numpy()
    else:
        t.index_copy_(0, sel, src)


def _key(x):
    """dtypes.to_key for floats without a select: flip all but the sign bit of negatives (torch or numpy)."""
    width = x.itemsize * 8
    return x ^ ((x >> (width - 1)) & ((1 << (width - 1)) - 1))


def _step(old: torch.Tensor, step: torch.Tensor, is_float: bool) -> torch.Tensor:
    """dtypes.apply_step (wrapping add in ordered key space), in fewer passes (numpy on the CPU)."""
    if old.device.type == "cpu":
        o, s = old.numpy(), step.numpy()
        return torch.from_numpy(_key(_key(o) + s) if is_float else o + s)
    if not is_float:
        return old + step
    return _key(_key(old) + step)


class _TorchUndo:
    def __init__(self):
        self.items: list[tuple[Segment, torch.Tensor | None, int, int, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return sum(old.numel() * old.element_size() for *_, old in self.items)

    def rollback(self) -> None:
        for seg, pos, a, b, old in reversed(self.items):
            _, dst, _ = _chunk(seg, pos, a, b)
            _scatter(seg.storage, dst, old)


def apply_torch(segs: list[Segment], names: list[str], undo: bool) -> tuple[dict, dict, _TorchUndo | None]:
    fp = {n: 0 for n in names}
    written = {n: 0 for n in names}
    log = _TorchUndo() if undo else None
    try:
        _apply_torch_segments(segs, fp, written, log)
    except BaseException:
        if log is not None:  # a failure midway (e.g. out of memory) leaves nothing half-written
            log.rollback()
        raise
    return fp, written, log


def _apply_torch_segments(segs: list[Segment], fp: dict, written: dict, log: _TorchUndo | None) -> None:
    moved: dict = {}
    for seg in segs:
        td, dev = seg.td, seg.storage.device
        key = (seg.tensor, dev)
        if key not in moved:  # positions/values on the destination's device, once per tensor
            pos = None if td.positions is None else td.positions.to(dev)
            moved[key] = (pos, td.values.to(dev))
        pos, vals = moved[key]
        a0, b0 = _ranges(seg, pos)
        acc = 0
        count = 0
        step = CHUNK if dev.type == "cpu" else CHUNK_DEVICE
        for a in range(a0, b0, step):
            b = min(a + step, b0)
            i, dst, vsel = _chunk(seg, pos, a, b)
            old_live = _gather(seg.storage, dst)
            old = old_live if seg.conv is None else seg.conv.to_checkpoint(old_live)
            v = vals[vsel] if isinstance(vsel, slice) else vals.index_select(0, vsel)  # read-only: no copy
            new = _step(old, v, td.dtype.is_float) if td.mode == REL else v
            _scatter(seg.storage, dst, new if seg.conv is None else seg.conv.to_live(new))
            if log is not None:
                log.items.append((seg, pos, a, b, old_live))
            if seg.piece.count_fingerprint:
                acc += _hash_change(i, old, new, vsel)
                count += old.numel()
        if seg.piece.count_fingerprint:
            fp[td.name] = (fp[td.name] + acc) & MASK64
            written[td.name] += count


# ---------------------------------------------------------------------------------
# Public API


def apply_delta(deltas: list[TensorDelta], maps: dict, *, undo: bool = True, backend: str = "auto") -> ApplyResult:
    """Write ``deltas`` through ``maps`` in place; all inputs are validated before any write.

    ``fingerprint_delta[name]`` is ``sum h(i, new) - h(i, old)`` over the elements written
    into counted pieces (``i`` the checkpoint flat index), so a rank that holds the whole
    tensor gets ``fp_new - fp_old``. Deltas whose tensors this rank does not hold need a
    map with no pieces. ``backend``: "auto" (Triton for CUDA destinations, torch
    otherwise), "torch" or "triton" (on CPU tensors only under ``TRITON_INTERPRET=1``).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}")
    segs, checks = validate(deltas, maps)
    names = [td.name for td in deltas]
    if backend == "auto":
        backend = "triton" if segs and all(s.storage.is_cuda for s in segs) and _triton_ok() else "torch"
    with torch.no_grad():
        if backend == "torch":
            check_positions([deltas[i] for i in checks])
            fp, written, log = apply_torch(segs, names, undo)
            parts = [log] if log is not None else []
        else:
            from .triton_kernels.apply_kernel import apply_triton

            fp, written, parts = apply_triton(segs, names, undo, [deltas[i] for i in checks])
    return ApplyResult(fp, written, UndoLog(parts) if undo else None)


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def decode_gaps(gaps: torch.Tensor) -> torch.Tensor:
    """Absolute positions from gaps (``gaps[0] = pos[0]``, ``gaps[k] = pos[k] - pos[k-1]``), on the gaps' device."""
    return torch.cumsum(gaps.to(torch.int64), 0)


def _box_items(seg_like: Segment, a: int, b: int):
    i, dst, _ = _chunk(seg_like, None, a, b)
    if i is None:
        i = torch.arange(seg_like.flat[0] + a, seg_like.flat[0] + b, dtype=torch.int64, device=seg_like.storage.device)
    return i, dst


def local_fingerprint(m: TensorMap) -> int:
    """sum h(i, bits) over the checkpoint elements this rank holds (counted pieces), read from the destinations."""
    total = 0
    cs = row_major_strides(m.shape)
    dense = TensorDelta(m.name, m.dtype, tuple(m.shape), ABS, None, torch.empty(0, dtype=m.dtype.int_view))
    for p in m.pieces:
        if not p.count_fingerprint or p.numel == 0:
            continue
        _check_piece(m.name, m.shape, m.dtype, p)
        conv = conversion(m.name, m.dtype, p.dest.dtype)
        live_int = m.dtype.int_view if conv is None else conv.live_int
        seg = Segment(0, dense, p, storage_bits(p.dest, live_int), conv, cs, _flat_range(p, m.shape, cs))
        acc = torch.zeros((), dtype=torch.int64, device=p.dest.device)
        with torch.no_grad():
            for a in range(0, p.numel, fpr.CHUNK):
                i, dst = _box_items(seg, a, min(a + fpr.CHUNK, p.numel))
                bits = seg.storage[dst]
                acc += fpr.element_hash(i, bits if conv is None else conv.to_checkpoint(bits)).sum()
        total += int(acc)
    return total & MASK64


def covered_elements(m: TensorMap) -> int:
    """Checkpoint elements the counted pieces cover (== numel: this rank holds the whole tensor)."""
    return sum(p.numel for p in m.pieces if p.count_fingerprint)
