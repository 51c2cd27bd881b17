"""The fused executor: validated segments -> the Triton kernel's table -> one launch per width.

:func:`engine_ext.server.apply.apply_delta` hands its :class:`~engine_ext.server.maps.Segment` list
here when the destinations are on an accelerator (or under ``TRITON_INTERPRET=1``).
This module turns each segment into one row of ``engine_ext.triton_kernels``'s table
(the kernel itself is a leaf that knows nothing of the package), checks the positions
on the device before anything is written, launches, and keeps one undo buffer per
width. Segments the kernel does not take (checkpoint rank above 4, converting
destinations) go through the torch executor in the same call.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format import fingerprint as fpr
from ..format.delta import REL
from ..triton_kernels import apply_kernel as K
from .apply_torch import apply_torch
from .maps import Segment, check_positions


def _static_row(seg: Segment) -> list[int]:
    """The columns that depend only on the piece and the checkpoint tensor (rank padded to 4)."""
    pc, td = seg.piece, seg.td
    pad = K.MAXD - len(td.shape)
    flags = (K.F_FLOAT.value if td.dtype.is_float else 0) | (K.F_COUNT.value if pc.count_fingerprint else 0)
    flags |= K.F_FLAT.value if seg.flat is not None else 0
    lo, hi = seg.flat if seg.flat is not None else (0, 0)
    r = [0] * K.NCOL
    r[K.C_DEST], r[K.C_FLAGS], r[K.C_LO], r[K.C_HI], r[K.C_OFF] = seg.storage.data_ptr(), flags, lo, hi, pc.offset
    for col, values in (
        (K.C_SHAPE, (1,) * pad + tuple(td.shape)),
        (K.C_CSTRIDE, (0,) * pad + seg.cstrides),
        (K.C_START, (0,) * pad + tuple(pc.start)),
        (K.C_EXT, (1,) * pad + seg.ext),
        (K.C_DSTRIDE, (0,) * pad + tuple(pc.strides)),
    ):
        r[col : col + K.MAXD] = values
    r[K.C_NUMEL] = td.numel
    return r


def _row(seg: Segment, pos, vals, undo_base: int, check: bool) -> list[int]:
    """One table row; the static part is kept in the piece's cache while its geometry holds."""
    hit = seg.piece.cache.get("kernel_row")
    if hit is not None and hit[0] is seg.geom:
        r = list(hit[1])
    else:
        r = _static_row(seg)
        seg.piece.cache["kernel_row"] = (seg.geom, list(r))
    r[K.C_POS] = 0 if pos is None else pos.data_ptr()
    r[K.C_VAL] = vals.data_ptr()
    r[K.C_UNDO] = undo_base
    r[K.C_N] = seg.n
    r[K.C_FLAGS] |= (
        (K.F_DENSE.value if seg.dense else 0)
        | (K.F_REL.value if seg.td.mode == REL else 0)
        | (K.F_CHECK.value if check else 0)
    )
    return r


class _FusedUndo:
    """Undo buffer of one width: old bits at each segment's item slots, replayed by the kernel."""

    def __init__(self, width, table, blocks, undo, keep):
        self.width, self.table, self.blocks, self.undo, self._keep = width, table, blocks, undo, keep

    @property
    def nbytes(self) -> int:
        return self.undo.numel() * self.undo.element_size()

    def rollback(self) -> None:
        K.rollback_segments(self.table, self.blocks, self.undo, self.width)


def _on(t: torch.Tensor, dev) -> torch.Tensor:
    return t if t.device == dev else t.to(dev)


def apply_fused(segs: list[Segment], names: list[str], undo: bool, checks: list):
    """Apply validated segments with one launch per (device, width).

    ``checks``: deltas whose positions still need the order/range check; it runs on the
    device over the same tables (one read pass, one sync) before anything is written.
    Returns (fingerprint change per name, written per name, undo parts).
    """
    fp = {n: 0 for n in names}
    written = {n: 0 for n in names}
    parts = []
    groups: dict = {}
    for s in segs:
        if len(s.td.shape) <= K.MAXD and s.conv is None and s.n > 0 and s.numel > 0:
            groups.setdefault((s.storage.device, s.td.dtype.bits), []).append(s)
    moved: dict = {}
    need = {id(td) for td in checks}
    plans, flags = [], []
    for (dev, width), group in groups.items():
        rows, keep, undo_total = [], [], 0
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
            undo_total += s.n
        table = torch.from_numpy(np.array(rows, dtype=np.int64)).to(dev)
        blocks = K.blocks_for([s.n for s in group], dev)
        flags.append(K.check_positions(table, blocks).any())
        plans.append((dev, width, group, table, blocks, undo_total, keep))
    check_positions([td for td in checks if id(td) in need])  # tensors without a kernel segment
    if flags and bool(torch.stack([f.cpu() for f in flags]).any()):
        check_positions(checks)  # names the culprit
        raise ValueError("positions must be sorted, unique and in range")
    slow = [s for s in segs if len(s.td.shape) > K.MAXD or s.conv is not None]
    if slow:
        f2, w2, log = apply_torch(slow, names, undo)
        for n in names:
            fp[n] = (fp[n] + f2[n]) & fpr.MASK64
            written[n] += w2[n]
        if log is not None:
            parts.append(log)
    for dev, width, group, table, blocks, undo_total, keep in plans:
        buf = torch.empty(undo_total, dtype=K.INT_OF_WIDTH[width], device=dev) if undo else None
        acc = K.apply_segments(table, blocks, buf, width).reshape(-1).cpu().tolist()
        for k, s in enumerate(group):
            if s.piece.count_fingerprint:
                fp[s.td.name] = (fp[s.td.name] + acc[2 * k]) & fpr.MASK64
                written[s.td.name] += acc[2 * k + 1]
        if undo:
            parts.append(_FusedUndo(width, table, blocks, buf, keep))
    return fp, written, parts
