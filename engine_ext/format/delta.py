"""The decoded form of a delta: what the codec produces and the appliers consume.

A :class:`TensorDelta` says, for one checkpoint tensor, which flat (row-major)
element indices change and to what, either as the new raw bits (``abs``) or as a
wrapping step in the dtype's ordered bit space (``rel``, see :mod:`engine_ext.format.dtypes`).
Everything here is plain torch on the CPU and serves as the reference semantics
that the kernels must match bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import fingerprint as fpr
from . import kernel_module
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
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        return int(self.values.numel())

    def index(self) -> torch.Tensor:
        """The flat indices, materialised (an arange for dense deltas)."""
        if self.positions is None:
            return torch.arange(self.numel, dtype=torch.int64, device=self.values.device)
        return self.positions


def changed_bits(
    old_bits: torch.Tensor, new_bits: torch.Tensor, update: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat positions, old bits there, new bits there) of the elements whose raw bits differ,
    on the inputs' device: the one diff the publisher, the CLI and :func:`diff_tensor` share.
    With ``update``, ``old_bits`` takes the new bits at those positions (the publisher's kept copy).
    On the CPU one numba pass on every core (:mod:`engine_ext.format.diff_kernels`)."""
    if old_bits.device.type == "cpu" and new_bits.device.type == "cpu" and old_bits.numel() >= 1 << 16:
        kernels = _diff_kernels()
        if kernels is not None:
            return tuple(
                torch.from_numpy(a)
                for a in kernels.changed(old_bits.contiguous().numpy(), new_bits.contiguous().numpy(), update)
            )
    pos = torch.nonzero(old_bits != new_bits).reshape(-1)
    out = pos, old_bits[pos], new_bits[pos]
    if update:
        old_bits[pos] = out[2]
    return out


def _diff_kernels():
    return kernel_module("diff_kernels")


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
        raise ValueError(
            f"{name}: shape/dtype changed {tuple(old.shape)}/{old.dtype} -> {tuple(new.shape)}/{new.dtype}"
        )
    pos, old_at, new_at = changed_bits(as_bits(old.detach().contiguous()).reshape(-1), new_bits)
    vals = step_between(old_at, new_at, d.is_float) if mode == REL else new_at
    return TensorDelta(name, d, tuple(new.shape), mode, pos, vals, fpr.tensor_fingerprint(old), fp_new)


def apply_tensor(base: torch.Tensor | None, td: TensorDelta, check: bool = True) -> torch.Tensor:
    """A new tensor equal to ``base`` with ``td`` applied (reference path, not in place)."""
    if base is None:
        if td.positions is not None or td.mode != ABS:
            raise ValueError(f"{td.name}: a sparse or relative delta needs a base tensor")
        out_bits = td.values.clone()
    else:
        if tuple(base.shape) != td.shape or dtype_of(base) is not td.dtype:
            raise ValueError(
                f"{td.name}: base is {tuple(base.shape)}/{base.dtype}, delta expects {td.shape}/{td.dtype.name}"
            )
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


def _member(x: torch.Tensor, sorted_set: torch.Tensor) -> torch.Tensor:
    """``torch.isin(x, sorted_set)`` for a sorted set, by binary search (a dense anchor holds
    millions of positions; sorting them again per step took seconds)."""
    if not sorted_set.numel() or not x.numel():
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    at = torch.searchsorted(sorted_set, x).clamp_(max=sorted_set.numel() - 1)
    return sorted_set[at] == x


def _merge(pos_a, val_a, pos_b, val_b):
    """Two disjoint sorted position sets and their values as one sorted set."""
    if not pos_a.numel():
        return pos_b, val_b
    if not pos_b.numel():
        return pos_a, val_a
    pos, order = torch.sort(torch.cat([pos_a, pos_b]))
    return pos, torch.cat([val_a, val_b])[order]


def compose(chain: list[TensorDelta]) -> list[TensorDelta]:
    """Fold successive deltas of one tensor into one apply (last writer wins).

    Relative steps add up (mod 2^width) in ordered bit space; an absolute value
    followed by steps stays absolute. Returns one delta per mode present (an
    absolute part and a relative part on disjoint positions); elements whose steps
    sum to zero are dropped. The parts carry the first base and the last result
    fingerprint. Links decoded on an accelerator and on the host compose on the accelerator.
    """
    first, last = chain[0], chain[-1]
    dev = next((d.values.device for d in chain if d.values.device.type != "cpu"), first.values.device)
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    abs_pos, abs_val = empty, torch.empty(0, dtype=first.dtype.int_view, device=dev)
    rel_pos, rel_val = empty, torch.empty(0, dtype=first.dtype.int_view, device=dev)
    for d in chain:
        if (d.name, d.shape, d.dtype) != (first.name, first.shape, first.dtype):
            raise ValueError(
                f"cannot compose deltas of different tensors: {d.name} {d.shape} vs {first.name} {first.shape}"
            )
        if d.values.device != dev:
            d = TensorDelta(
                d.name, d.dtype, d.shape, d.mode, None if d.positions is None else d.positions.to(dev), d.values.to(dev)
            )
        pos = d.index()
        if d.mode == ABS:
            keep = ~_member(rel_pos, pos)
            rel_pos, rel_val = rel_pos[keep], rel_val[keep]
            keep = ~_member(abs_pos, pos)
            abs_pos, abs_val = _merge(abs_pos[keep], abs_val[keep], pos, d.values)
        else:
            in_abs = _member(pos, abs_pos)
            at = torch.searchsorted(abs_pos, pos[in_abs])
            abs_val[at] = apply_step(abs_val[at], d.values[in_abs], d.dtype.is_float)
            pos, steps = pos[~in_abs], d.values[~in_abs]
            in_rel = _member(pos, rel_pos)
            at = torch.searchsorted(rel_pos, pos[in_rel])
            rel_val[at] = rel_val[at] + steps[in_rel]
            rel_pos, rel_val = _merge(rel_pos, rel_val, pos[~in_rel], steps[~in_rel])
            nonzero = rel_val != 0
            rel_pos, rel_val = rel_pos[nonzero], rel_val[nonzero]
    out = []
    common: dict[str, Any] = {
        "name": first.name,
        "dtype": first.dtype,
        "shape": first.shape,
        "base_fingerprint": first.base_fingerprint,
        "fingerprint": last.fingerprint,
    }
    if abs_pos.numel():
        dense = abs_pos.numel() == first.numel
        out.append(TensorDelta(mode=ABS, positions=None if dense else abs_pos, values=abs_val, **common))
    if rel_pos.numel():
        out.append(TensorDelta(mode=REL, positions=rel_pos, values=rel_val, **common))
    return out
