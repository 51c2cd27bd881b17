"""The torch executor: segments applied with vectorised torch/numpy, the reference semantics.

The default on the CPU (numpy scatter, keys and hashes in place), and the path any
segment takes that the fused kernel does not (rank above 4, converting destinations).
Works on any device torch does.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import fingerprint as fpr
from ..format.delta import REL
from .maps import MASK64, Segment

CHUNK = 1 << 16  # elements per torch-path step on the CPU: temporaries stay in cache (~0.5 MB each)
CHUNK_DEVICE = 1 << 20  # on accelerators: fewer launches


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


def _hash_change(i: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor, sl) -> int:
    """sum h(i, new) - h(i, old) (see engine_ext.format.fingerprint) as a Python int; ``i`` None:
    the checkpoint indices are the range ``sl``."""
    if i is None:
        return fpr.range_fingerprint(new, sl.start) - fpr.range_fingerprint(old, sl.start)
    return fpr.hash_sum(i, new) - fpr.hash_sum(i, old)


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
