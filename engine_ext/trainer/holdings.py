"""What a publisher holds of each tensor, and so how it describes, reads, cuts and anchors it.

A :class:`~engine_ext.trainer.publisher.DeltaPublisher` holds every tensor whole, already in the
served dtype (:class:`WholeTensors`). A :class:`~engine_ext.trainer.sharded.ShardedPublisher`'s rank
holds only the rows it publishes of some tensors, in the dtype it trains in (:class:`RankRows`):
a tensor is then described by the whole tensor's shape and the first row the rank holds, cast to
the served dtype one tensor at a time as its bits are taken, cut at the ranks' row boundaries (every
cell inside one rank's rows: docs/FORMAT.md, "Sharded versions"), and written into an anchor as the
cells of its rows. The publisher's snapshot, diff, encode and anchor code is the same for both; it
asks its holding these four things.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..format.dtypes import BY_TORCH, DType, as_bits, dtype_by_name, dtype_of, served_as, to_served
from .builder import Rows
from .shards import Placement


@dataclass(frozen=True)
class Described:
    """A state-dict entry as published."""

    dtype: DType  # the served dtype
    shape: tuple  # the whole tensor's
    first_row: int  # the first row of the tensor the entry holds (0: all of it, or a rank's rows from the start)


class Holding(Protocol):
    """What a publisher holds of each tensor (:class:`WholeTensors`, :class:`RankRows`)."""

    def describe(self, name: str, t: torch.Tensor) -> Described:
        """The served dtype, the whole tensor's shape and the first row ``t`` holds."""

    def bits(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The flat raw bits of ``t`` as served (made one tensor at a time)."""

    def cuts(self, name: str) -> list[list[int]] | None:
        """The grid a changed tensor is cut into (None: the usual, :func:`engine_ext.format.chunks.grid`)."""

    def anchor_info(self, name: str, kept: torch.Tensor) -> tuple:
        """What :meth:`~engine_ext.trainer.builder.VersionBuilder.add_anchor` writes of a kept tensor."""


class WholeTensors:
    """A single-process publisher's holding: every tensor whole, as given (``publish`` cast it already)."""

    def describe(self, name: str, t: torch.Tensor) -> Described:
        return Described(dtype_of(t), tuple(t.shape), 0)

    def bits(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return as_bits(t.detach()).reshape(-1)

    def cuts(self, name: str) -> list[list[int]] | None:
        return None

    def anchor_info(self, name: str, kept: torch.Tensor) -> tuple:
        """(name, dtype, shape)."""
        return name, dtype_of(kept), tuple(kept.shape)


@dataclass(frozen=True)
class RankRows:
    """A sharded trainer rank's holding: the rows it publishes of each tensor, as the ranks agreed at
    the first publish (:func:`engine_ext.trainer.shards.agree`)."""

    placements: dict[str, Placement]  # every tensor of the model: who publishes which rows
    starts: dict[str, int]  # the first row of each tensor this rank publishes
    dtype: torch.dtype | None  # the served dtype (None: as held)
    chunk_min_cell: int | None  # the usual grid's smallest cell, where a split tensor's cells allow it

    def describe(self, name: str, t: torch.Tensor) -> Described:
        p = self.placements[name]
        return Described(served_as(dtype_by_name(p.dtype), self.dtype), p.shape, self.starts[name])

    def bits(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return as_bits(to_served(t.detach(), self.dtype)).reshape(-1)

    def cuts(self, name: str) -> list[list[int]] | None:
        """A tensor several ranks publish: cut at their row boundaries (and the usual grid's where they fit)."""
        p = self.placements[name]
        if not p.split:
            return None
        return p.grid(self.chunk_min_cell, anchor=False)

    def anchor_info(self, name: str, kept: torch.Tensor) -> tuple:
        """(name, dtype, local shape, :class:`~engine_ext.trainer.builder.Rows` of a split tensor, else None)."""
        p = self.placements[name]
        rows = None
        if p.split:
            rows = Rows(p.shape, self.starts[name], tuple(p.grid(self.chunk_min_cell, anchor=True)[0]))
        return name, BY_TORCH[kept.dtype], tuple(kept.shape), rows
