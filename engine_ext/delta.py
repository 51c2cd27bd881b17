"""The decoded form of a delta: what the codec produces and the appliers consume.

A :class:`TensorDelta` says, for one checkpoint tensor, which flat (row-major)
element indices change and to what, either as the new raw bits (``abs``) or as a
wrapping step in the dtype's ordered bit space (``rel``, see :mod:`engine_ext.dtypes`).
Everything here is plain torch on the CPU and serves as the reference semantics
that the kernels must match bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import fingerprint as fpr
from .dtypes import DType, apply_step, as_bits, dtype_of, step_between

ABS = "abs"
REL = "rel"


@dataclass
class TensorDelta:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    mode: str  # ABS: values are the new raw bits; REL: values are ordered-space steps
    positions: torch.Tensor | None  # int64, sorted, unique flat indices; None = every element
    values: torch.Tensor  # 1-D, dtype.int_view, one per position
    base_fingerprint: int | None = None  # fp of the whole base tensor (None: anchor)
    fingerprint: int | None = None  # fp of the whole resulting tensor
    meta: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def index(self) -> torch.Tensor:
        """The flat indices, materialised (an arange for dense deltas)."""
        if self.positions is None:
            return torch.arange(self.numel, dtype=torch.int64)
        return self.positions


def diff_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor, mode: str = REL) -> TensorDelta:
    """Changed elements of ``new`` against ``old`` (bitwise), on the tensors' device.

    With ``old=None`` the result is a dense absolute delta (an anchor entry).
    The returned tensors stay on the input device; callers move them as needed.
    """
    d = dtype_of(new)
    new_bits = as_bits(new.detach().contiguous()).reshape(-1)
    fp_new = fpr.tensor_fingerprint(new)
    if old is None:
        return TensorDelta(name, d, tuple(new.shape), ABS, None, new_bits, None, fp_new)
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"{name}: shape/dtype changed {tuple(old.shape)}/{old.dtype} -> {tuple(new.shape)}/{new.dtype}")
    old_bits = as_bits(old.detach().contiguous()).reshape(-1)
    pos = torch.nonzero(old_bits != new_bits).reshape(-1)
    if mode == REL:
        vals = step_between(old_bits[pos], new_bits[pos], d.is_float)
    else:
        vals = new_bits[pos]
    return TensorDelta(name, d, tuple(new.shape), mode, pos, vals, fpr.tensor_fingerprint(old), fp_new)


def apply_tensor(base: torch.Tensor | None, td: TensorDelta, check: bool = True) -> torch.Tensor:
    """A new tensor equal to ``base`` with ``td`` applied (reference path, not in place)."""
    if base is None:
        if td.positions is not None or td.mode != ABS:
            raise ValueError(f"{td.name}: a sparse or relative delta needs a base tensor")
        out_bits = td.values.clone()
    else:
        if tuple(base.shape) != td.shape or dtype_of(base) is not td.dtype:
            raise ValueError(f"{td.name}: base is {tuple(base.shape)}/{base.dtype}, delta expects {td.shape}/{td.dtype.name}")
        out_bits = as_bits(base.detach().contiguous()).reshape(-1).clone()
        idx = td.index()
        if td.mode == REL:
            out_bits[idx] = apply_step(out_bits[idx], td.values, td.dtype.is_float)
        else:
            out_bits[idx] = td.values
    out = out_bits.view(td.dtype.torch if td.dtype.torch != torch.bool else torch.uint8).reshape(td.shape)
    if td.dtype.torch == torch.bool:
        out = out.view(torch.bool)
    if check and td.fingerprint is not None:
        got = fpr.tensor_fingerprint(out)
        if got != td.fingerprint:
            raise ValueError(f"{td.name}: result fingerprint {fpr.fmt(got)} != expected {fpr.fmt(td.fingerprint)}")
    return out
