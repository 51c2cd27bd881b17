"""Where a delta's parts lie inside its blobs: by tensor-parallel share, so that a reader rank's bytes are contiguous.

A tensor-parallel rank holds one share of every big tensor, cut along the dimension the engines shard it
(:func:`engine_ext.format.context.blocks.shard_dim`), and fetches the grid cells that meet it
(:mod:`engine_ext.format.chunks`: at most 8 parts along each of the first two dimensions, cut at the shares
of 2, 4 and 8 ranks). Laid out in the order tensors are encoded, a rank's cells lie scattered over the
blob: one range per cell for a tensor cut along dimension 1, some thousands per layer of a large MoE, each a
request to the store (tens of milliseconds each from an object store).

So a delta blob is written in *sections*: first the parts every rank may read whole (tensors not cut into
cells, and those whose shard dimension the name does not say: fused experts, unknown layers), then, for
share ``k`` of ``shares`` in turn, every matrix's cells that start in share ``k``. A rank of TP ``shares``
then reads two ranges per blob (the common section and its own), a rank of a smaller power of two adjacent
sections (two ranges too), and a rank holding whole tensors (expert parallelism) the ranges of its tensors
in each section. The sections are held in memory until the blob is closed (at most the blob target).
Nothing in the format changes: every part keeps its own blob and offset, and readers follow them.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

from ..format import chunks
from ..format.context.blocks import shard_dim

COMMON = 0  # the section of parts every rank reads whole


def section_dim(name: str, shape, cuts: list[list[int]] | None) -> int | None:
    """The dimension the cells of ``name``'s grid ``cuts`` are shared out along, in its delta blob's sections
    and its tensor table's cell sections (format 12): the one the engines shard the matrix along; None where
    the name does not say it, or the tensor is not a matrix cut along both dimensions (every rank may read
    all of it: kept together)."""
    if len(shape) != 2 or cuts is None or len(cuts) != 2:
        return None
    dim = _SHARD_DIMS.get(name, -1)
    if dim == -1:
        dim = shard_dim(name, shape)
        if len(_SHARD_DIMS) < 1 << 21:  # a model's matrices, asked again every version (a K2 rank: 9,000)
            _SHARD_DIMS[name] = dim
    return dim


_SHARD_DIMS: dict[str, int | None] = {}  # a matrix's name -> shard_dim (names are a model's, read per version)


def cell_section(name: str, shape, cuts: list[list[int]], cell: int, shares: int) -> int:
    """The section of cell ``cell`` of ``name``'s grid ``cuts`` (row-major over its cells): 1 + the share (of
    ``shares``, along :func:`section_dim`) its first element falls in; COMMON where there is none."""
    dim = section_dim(name, shape, cuts)
    if dim is None:
        return COMMON
    return chunks.share_of(chunks.boxes(cuts, shape)[cell][0][dim], int(shape[dim]), shares)


@dataclass
class Sections:
    """Where parts go in one blob of ``1 + shares`` sections, by size alone: each part's offset is first
    relative to its section's start, then made the blob's when the blob is closed (:meth:`finish`)."""

    sizes: list[int]
    placed: list[tuple[object, int]] = field(default_factory=list)  # (part with an ``offset``, section)

    @classmethod
    def for_shares(cls, shares: int) -> Sections:
        return cls([0] * (1 + shares))

    def size(self) -> int:
        return sum(self.sizes)

    def add(self, length: int, section: int) -> int:
        """Room for ``length`` bytes at the end of ``section``: their offset there."""
        offset = self.sizes[section]
        self.sizes[section] += length
        return offset

    def place(self, part: object, section: int) -> None:
        """``part.offset`` (within ``section``) becomes the blob's offset in :meth:`finish`."""
        self.placed.append((part, section))

    def finish(self) -> None:
        """Every placed part's offset made the blob's: its section's start added."""
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        for part, section in self.placed:
            part.offset += starts[section]  # type: ignore[attr-defined]
        self.placed.clear()


@dataclass
class OpenBlob:
    """The delta blob being filled: its sections' bytes, in memory until it is closed (at most the
    builder's blob target, 256 MB)."""

    index: int  # the blob's index in the version
    path: str  # where the blob is written when closed
    layout: Sections
    buffers: list[io.BytesIO]

    @classmethod
    def for_shares(cls, index: int, path: str, shares: int) -> OpenBlob:
        return cls(index, path, Sections.for_shares(shares), [io.BytesIO() for _ in range(1 + shares)])

    def append(self, data: bytes, section: int) -> int:
        """Append ``data`` to ``section``; its offset there."""
        self.buffers[section].write(data)
        return self.layout.add(len(data), section)

    def write(self, f) -> str:
        """The sections, in order, into file ``f``; every placed part's offset made the blob's. Returns the
        blob's SHA-256."""
        sha = hashlib.sha256()
        for buf in self.buffers:
            f.write(buf.getbuffer())
            sha.update(buf.getbuffer())
        self.layout.finish()
        return sha.hexdigest()
