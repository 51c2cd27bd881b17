"""What an apply wrote, for the hooks that refresh derived copies of weights.

Engines keep derived copies of some weights (vLLM's CPU backend re-packs each linear
layer for its GEMM and each MoE layer's experts for its grouped GEMM). After an apply
writes the checkpoint-layout weights, a refresh hook rebuilds those copies. A linear
layer is re-packed whole; an MoE layer holds hundreds of experts in one parameter, and
re-packing all of them for an update that touched a few would cost O(layer), so the hook
asks :meth:`Touched.blocks` which experts (blocks of the parameter's storage) were
written and re-packs only those. The answer uses the executors' own geometry
(:func:`engine_ext.server.maps.validate`) and is computed only when a hook asks; the set of
storages comes straight from the maps.
"""

from __future__ import annotations

import torch

from ..format.delta import TensorDelta
from .apply_torch import _chunk, _ranges
from .maps import validate


class Touched:
    """The storages an apply wrote (by ``data_ptr``), and on demand which blocks of one."""

    def __init__(self, deltas: list[TensorDelta], maps: dict):
        self._deltas, self._maps, self._segs = deltas, maps, None
        self._ptrs = {
            p.dest.untyped_storage().data_ptr()
            for td in deltas
            if td.nnz
            for p in getattr(maps.get(td.name), "pieces", ())
            if p.numel
        }

    def storages(self) -> set[int]:
        return set(self._ptrs)

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._ptrs

    def blocks(self, ptr: int, block: int) -> torch.Tensor:
        """Sorted unique ``offset // block`` of every storage element written in storage ``ptr``
        (elements of the destination's dtype): with ``block`` = one expert's size, the experts."""
        if self._segs is None:  # only MoE refresh asks: the apply's pause pays for nothing else
            self._segs = [s for s in validate(self._deltas, self._maps)[0] if s.n]
        out = []
        for s in self._segs:
            if s.piece.dest.untyped_storage().data_ptr() != ptr:
                continue
            pos = s.td.positions
            a, b = _ranges(s, pos)
            if a == b:
                continue
            _, dst, _ = _chunk(s, pos, a, b)
            if isinstance(dst, slice):
                out.append(torch.arange(dst.start // block, (dst.stop - 1) // block + 1))
            else:
                out.append(torch.unique(dst.cpu() // block))
        return torch.unique(torch.cat(out)) if out else torch.empty(0, dtype=torch.int64)
