"""Where each checkpoint element lives at runtime, and a delta checked against it before any write.

A :class:`TensorMap` says where each element of one checkpoint tensor lives on this
rank: boxes of checkpoint coordinates mapped affinely into parameter storage
(:class:`Piece`), as learned by :mod:`engine_ext.server.layout`, possibly through an exact
widening (:class:`Conversion`). :func:`validate` checks a list of
:class:`~engine_ext.format.delta.TensorDelta` against the maps and precomputes each
(delta, piece) :class:`Segment`; both executors (:mod:`engine_ext.server.apply_torch`,
:mod:`engine_ext.server.apply_fused`) consume segments, and :mod:`engine_ext.server.apply` chooses
between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import OutOfOrderError, PartlyHeldError
from ..format import fingerprint as fpr
from ..format.delta import ABS, REL, TensorDelta
from ..format.dtypes import BY_TORCH, DType

MASK64 = fpr.MASK64


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
    # Checked geometry and executor inputs derived from this piece, kept with it (not in a
    # module-level cache) so a dropped map frees them and the parameter storage they view.
    cache: dict = field(default_factory=dict, repr=False, compare=False)

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
    storages: tuple[int, ...] = ()  # data_ptrs of the parameter storages its loader wrote (reloaded there densely)


# Casts an engine may apply to a checkpoint tensor at load that keep every value exactly
# (vLLM's sgl CPU GEMM path keeps linear biases in float32): the checkpoint bits can be
# read back from the live value, so such a tensor is still updated in place, O(changed).
EXACT_WIDENINGS = frozenset(
    {
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
    }
)


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


def conversion(name: str, checkpoint: DType, live: torch.dtype) -> Conversion | None:
    """None for an in-place copy, a :class:`Conversion` for an exact widening; ValueError otherwise."""
    if live == checkpoint.torch:
        return None
    if (checkpoint.torch, live) not in EXACT_WIDENINGS:
        raise ValueError(
            f"{name}: destination dtype {live} is not the checkpoint dtype {checkpoint.name} "
            "nor an exact widening of it"
        )
    return Conversion(checkpoint, live)


@dataclass
class ApplyResult:
    fingerprint_delta: dict[str, int]  # per tensor, mod 2^64, over counted pieces
    written: dict[str, int]  # changed checkpoint elements written into counted pieces
    undo: UndoLog | None


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
            raise OutOfOrderError("undo log already used or discarded")
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
    conv: Conversion | None  # set when the destination holds a widened copy
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


def flat_range(p: Piece, shape, cstrides) -> tuple[int, int] | None:
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


def check_piece(name: str, shape, dtype: DType, p: Piece) -> None:
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
            raise ValueError(
                f"{name}: delta is {tuple(td.shape)}/{td.dtype.name}, runtime map is {tuple(m.shape)}/{m.dtype.name}"
            )
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
                raise ValueError(
                    f"{name}: writes the same destination elements as {dests[key]} (tied weights?); apply only one of them"
                )
            dests[key] = name
            segs.append(Segment(ti, td, piece, *g[1:], geom=g))
    return segs, checks


def _geometry(name: str, shape, dtype: DType, piece: Piece):
    """Checked geometry of a piece: (dest key, storage view, conversion, checkpoint strides, flat range, extent, numel).

    Maps are static, so it is computed once per piece and kept in ``piece.cache`` while
    the inputs it was computed from (box, storage, dtypes) stay the same.
    """
    st = piece.dest.untyped_storage()
    inputs = (
        tuple(piece.start),
        tuple(piece.stop),
        piece.offset,
        tuple(piece.strides),
        piece.count_fingerprint,
        st.data_ptr(),
        st.nbytes(),
        piece.dest.dtype,
        piece.dest.device,
        tuple(shape),
        dtype.name,
    )
    hit = piece.cache.get("geometry")
    if hit is not None and hit[0] == inputs:
        return hit[1]
    check_piece(name, shape, dtype, piece)
    if piece.numel == 0:
        g = None
    else:
        cs = row_major_strides(shape)
        key = (st.data_ptr(), piece.offset, tuple(piece.strides), piece.extent)
        conv = conversion(name, dtype, piece.dest.dtype)
        live_int = dtype.int_view if conv is None else conv.live_int
        g = (key, storage_bits(piece.dest, live_int), conv, cs, flat_range(piece, shape, cs), piece.extent, piece.numel)
    piece.cache["geometry"] = (inputs, g)
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


def piece_bits(m: TensorMap, p: Piece) -> torch.Tensor:
    """The checkpoint bits of piece ``p`` of ``m``, read from its destination (a strided view of the
    parameter; a converted copy where the engine holds a widened value), shaped like its box."""
    check_piece(m.name, m.shape, m.dtype, p)
    conv = conversion(m.name, m.dtype, p.dest.dtype)
    st = storage_bits(p.dest, m.dtype.int_view if conv is None else conv.live_int)
    view = torch.as_strided(st, p.extent, p.strides, p.offset)
    return view if conv is None else conv.to_checkpoint(view)


def local_fingerprint(m: TensorMap) -> int:
    """sum h(i, bits) over the checkpoint elements this rank holds (its counted pieces), read from the
    destinations: every core, no index arrays (:func:`engine_ext.format.fingerprint.box_fingerprint`)."""
    return (
        sum(
            fpr.box_fingerprint(piece_bits(m, p), p.start, m.shape) for p in m.pieces if p.count_fingerprint and p.numel
        )
        & MASK64
    )


def checkpoint_view(m: TensorMap, t: torch.Tensor) -> TensorMap:
    """``m``'s boxes pointed at the checkpoint tensor ``t`` itself (row-major), so that the
    fingerprint of the same elements can be computed from the checkpoint and from the live weights."""
    t = t.detach().contiguous()
    cs = row_major_strides(m.shape)
    return TensorMap(
        m.name,
        m.shape,
        m.dtype,
        [
            Piece(
                t,
                p.start,
                p.stop,
                t.storage_offset() + sum(a * s for a, s in zip(p.start, cs)),
                cs,
                p.count_fingerprint,
            )
            for p in m.pieces
        ],
    )


def covered_elements(m: TensorMap) -> int:
    """Checkpoint elements the counted pieces cover (== numel: this rank holds the whole tensor)."""
    return sum(p.numel for p in m.pieces if p.count_fingerprint)


class PartlyHeld(PartlyHeldError, ValueError):
    """A box this rank holds only some elements of (it cannot read the whole box)."""


def read_box(m: TensorMap, start, stop) -> torch.Tensor | None:
    """The checkpoint bits of box [start, stop) of ``m``'s tensor, read from the live weights
    (counted pieces, through any exact widening), as a contiguous tensor of the box's shape on
    the weights' device; None when this rank holds none of it; :class:`PartlyHeld` when only some."""
    start, stop = tuple(int(x) for x in start), tuple(int(x) for x in stop)
    ext = tuple(b - a for a, b in zip(start, stop))
    out, got = None, 0
    for p in m.pieces:
        if not p.count_fingerprint or p.numel == 0:
            continue
        lo = tuple(max(a, b) for a, b in zip(start, p.start))
        hi = tuple(min(a, b) for a, b in zip(stop, p.stop))
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        view = piece_bits(m, p)[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, p.start))]
        if out is None:
            out = torch.empty(ext, dtype=m.dtype.int_view, device=p.dest.device)
        out[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))] = view
        got += math.prod(b - a for a, b in zip(lo, hi))
    if out is None:
        return None
    if got != math.prod(ext):
        raise PartlyHeld(f"{m.name}: this rank holds {got} of the {math.prod(ext)} elements of box {start}..{stop}")
    return out
