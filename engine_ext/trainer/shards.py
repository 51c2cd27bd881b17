"""What each rank of a sharded trainer holds, and which rank publishes which rows of which tensor.

A trainer rank holds, of each checkpoint tensor, a run of rows along dimension 0 (FSDP2
``fully_shard``: a ``DTensor`` with ``Shard(0)``; uneven and empty shards allowed), all of it
(``Replicate``, a plain tensor, a pipeline stage's or an expert-parallel rank's tensors
named by what it passes), or nothing. :func:`held_tensors` reads that from a module or a
state dict without moving a byte: a ``DTensor``'s local shard and its global offset
(``compute_local_shape_and_global_offset``), never ``full_tensor()``.

:func:`agree` then turns every rank's view (gathered once, names, shapes and row ranges
only) into a :class:`Placement` per tensor: the distinct row ranges must tile dimension 0,
and each range is published by exactly one of the ranks that hold it (chosen by a hash of
the name, so that replicated tensors spread over the ranks), which is what lets a
version be written by all ranks at once with no byte written twice
(:mod:`engine_ext.trainer.sharded`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

import torch

from ..format import chunks
from ..format.dtypes import dtype_of
from .checkpoint_layout import rows_in_checkpoint_layout
from .state_dict import clean_state_dict

MAX_PARTS = 256  # parts along one dimension of a grid (docs/FORMAT.md)


@dataclass(frozen=True)
class Held:
    """What this rank holds of one checkpoint tensor: rows ``[start, stop)`` of a tensor of ``shape``."""

    name: str
    tensor: torch.Tensor  # the local rows, a plain tensor in the rank's own memory
    shape: tuple
    start: int
    stop: int

    def describe(self) -> tuple:
        """What the other ranks learn of it: (name, dtype name, shape, start, stop)."""
        return self.name, dtype_of(self.tensor).name, self.shape, self.start, self.stop


def rows(shape) -> int:
    """Rows along dimension 0 (a 0-dimensional tensor is one row)."""
    return int(shape[0]) if len(shape) else 1


def held_tensors(model_or_state_dict) -> dict[str, Held]:
    """This rank's part of every tensor of a module (its parameters, as vLLM's ``ModuleSource``
    names them) or state dict, wrapper prefixes removed; no collective, no copy."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        model_or_state_dict = dict(model_or_state_dict.named_parameters())
    out = {}
    for name, t in clean_state_dict(model_or_state_dict).items():
        out[name] = _held(name, t.detach())
    return out


def in_checkpoint_layout(held: dict[str, Held], model: torch.nn.Module | None) -> dict[str, Held]:
    """``held`` (in-memory names) as the checkpoint tensors engines load: each tensor's rows converted
    by ``model``'s own conversions, row by row (:func:`~engine_ext.trainer.checkpoint_layout.rows_in_checkpoint_layout`:
    a transformers 5 MoE's fused experts become whole per-expert tensors of the rank holding
    them); unchanged without a model or conversions."""
    if model is None:
        return held
    out = {}
    for h in held.values():
        for r in rows_in_checkpoint_layout(model, h.name, h.tensor, h.shape, h.start):
            out[r.name] = Held(r.name, r.tensor, r.shape, r.start, r.start + rows(r.tensor.shape))
    return out


def _held(name: str, t: torch.Tensor) -> Held:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = None
    shape = tuple(int(s) for s in t.shape)
    if DTensor is None or not isinstance(t, DTensor):
        return Held(name, t, shape, 0, rows(shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if (
            not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0))
            or type(p).__name__ == "_StridedShard"
        ):
            raise NotImplementedError(
                f"{name}: placement {p} is not Shard(0) or Replicate; a sharded publisher "
                "publishes row ranges only (FSDP2 fully_shard's layout)"
            )
    local = t.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(f"{name}: the local shard is {tuple(local.shape)}, its placement says {tuple(local_shape)}")
    start = int(offset[0]) if shape else 0
    return Held(name, local, shape, start, start + (int(local_shape[0]) if shape else 1))


@dataclass(frozen=True)
class Placement:
    """Who publishes one tensor: its row ranges (``cuts[i]`` to ``cuts[i + 1]``) and the rank of each."""

    name: str
    dtype: str
    shape: tuple
    cuts: tuple  # 0 = cuts[0] < ... < cuts[-1] = rows (a single range: the tensor held whole)
    owners: tuple  # the rank that publishes each range

    @property
    def split(self) -> bool:
        """Whether several ranks publish rows of it (then it comes in cells: docs/FORMAT.md)."""
        return len(self.owners) > 1

    def owned(self, rank: int, start: int) -> bool:
        """Whether ``rank``, holding rows from ``start``, publishes them."""
        return any(o == rank and a == start for o, a in zip(self.owners, self.cuts))

    def grid(self, min_cell: int | None, anchor: bool) -> list[list[int]]:
        """The grid a split tensor is cut into: its ranges' boundaries along dimension 0, and the
        usual grid's cuts (:func:`engine_ext.format.chunks.grid`) where they fit; anchors are cut
        along dimension 0 only (a cell is then a run of a rank's rows: contiguous bytes)."""
        usual = None if min_cell is None or not self.shape else chunks.grid(self.shape, min_cell)
        dim0 = sorted(set(self.cuts) | set(usual[0] if usual else ()))
        if len(dim0) - 1 > MAX_PARTS:
            dim0 = list(self.cuts)
        return [dim0] if anchor or not usual else [dim0, *usual[1:]]


def agree(views: list[list[tuple]]) -> dict[str, Placement]:
    """Every tensor's :class:`Placement` from every rank's :meth:`Held.describe` list (in rank
    order; the same result on every rank). Raises ValueError where the ranks disagree on a
    tensor's dtype or shape, or its ranges do not tile its rows."""
    meta: dict[str, tuple] = {}
    holders: dict[str, dict[tuple, list[int]]] = {}
    for rank, view in enumerate(views):
        for name, dtype, shape, start, stop in view:
            shape = tuple(shape)
            if meta.setdefault(name, (dtype, shape)) != (dtype, shape):
                raise ValueError(f"{name}: the ranks hold it as {meta[name]} and as {(dtype, shape)}")
            if stop > start or rows(shape) == 0 or math.prod(shape) == 0:
                holders.setdefault(name, {}).setdefault((start, stop), []).append(rank)
            else:
                holders.setdefault(name, {})
    out = {}
    for name, (dtype, shape) in meta.items():
        ranges = sorted(holders[name])
        if not ranges:
            raise ValueError(f"{name}: no rank holds any of it")
        if rows(shape) == 0 or math.prod(shape) == 0:
            ranges = ranges[:1]  # an empty tensor: one rank writes its (empty) entry
        elif (
            ranges[0][0] != 0
            or ranges[-1][1] != rows(shape)
            or any(a[1] != b[0] for a, b in itertools.pairwise(ranges))
        ):
            raise ValueError(
                f"{name}: the ranks' rows {ranges[:8]} do not tile its {rows(shape)} rows (overlapping "
                "or missing ranges: only row ranges of one sharding can be published)"
            )
        if len(ranges) > MAX_PARTS:
            raise ValueError(f"{name}: {len(ranges)} row ranges, over the {MAX_PARTS} parts a grid may have")
        owners = tuple(_pick(name, a, holders[name][(a, b)]) for a, b in ranges)
        out[name] = Placement(name, dtype, shape, (ranges[0][0], *(b for _, b in ranges)), owners)
    return out


def _pick(name: str, start: int, ranks: list[int]) -> int:
    """The one of ``ranks`` (all holding the same rows) that publishes them: by a hash of the name,
    so that replicated tensors spread over the ranks."""
    return sorted(ranks)[zlib.crc32(f"{name}@{start}".encode()) % len(ranks)]


__all__ = ["Held", "Placement", "agree", "held_tensors", "in_checkpoint_layout", "rows"]
