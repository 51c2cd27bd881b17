"""Boxes of a tensor that a rank can fetch on its own: a grid over its first two dimensions.

Tensor parallelism shards a checkpoint tensor along one of its first two dimensions
(column-parallel layers and vocabularies along dim 0, row-parallel ones along dim 1,
MoE experts along dim 0 and their intermediate along dim 1). A delta of a big tensor is
therefore cut into a grid of boxes, ``GRID`` parts along each of those dimensions (split
points ``round(i * n / GRID)``, so that shards of 2, 4 and 8 ranks fall on them), each
box (a *cell*, numbered row-major) encoded on its own: a rank fetches only the cells that
meet what it holds (:func:`meets`). Positions inside a box are box-local row-major indices
(:func:`to_local`, :func:`to_global`), which keeps their gaps as small as in the whole
tensor. Every cell costs a fixed decode overhead (~0.1 ms) and ~350 bytes of manifest,
so cells hold at least ``MIN_CELL`` elements: a 7B model's MLP matrices get 8 x 8 cells,
its 3584 x 3584 projections 4 x 4, small tensors none. Where the publisher knows the dimension a
matrix is sharded along (from its layer's name), it keeps the number of cells and puts up to 8 parts
along that dimension (:func:`grid`'s ``along``: those projections 8 x 2 or 2 x 8), so a rank of TP 8
fetches an eighth of them, not a quarter.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math

import numpy as np
import torch

GRID = 8  # most parts along one dimension
# fewest elements per cell a publisher cuts to (each cell costs ~0.1 ms to decode and ~350 manifest bytes)
MIN_CELL = 1 << 18
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


def _cuts(n: int, parts: int) -> list[int]:
    parts = max(1, min(parts, n))
    return sorted({round(i * n / parts) for i in range(parts + 1)})


def grid(shape, min_cell: int = MIN_CELL, parts: int = GRID, along: int | None = None) -> list[list[int]] | None:
    """The cut points along the first (one or two) dimensions a delta of a tensor of ``shape``
    is cut at, or None (not cut): the same number of parts along each, the largest power of
    two up to ``parts`` that leaves every cell ``min_cell`` elements or more.

    ``along`` (a matrix's dimension the engines shard it along, where the publisher knows it): the same
    number of cells of the same size, with as many parts along that dimension as ``parts`` allows and
    fewer along the other, so that a rank of TP ``parts`` fetches 1/``parts`` of the tensor rather than
    the 1/4 a 4 x 4 grid gives it (a 2048 x 7168 expert matrix: 8 x 2 cells)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return None
    dims, numel = min(2, len(shape)), math.prod(shape)
    k = 1
    while k * 2 <= parts and numel // (k * 2) ** dims >= min_cell:
        k *= 2
    cuts = [_cuts(n, k) for n in shape[:dims]]
    if along is not None and dims == 2 and k > 1:
        sharded = min(parts, k * k)
        while sharded > 1 and shape[along] % sharded:  # engines shard evenly: parts of equal size
            sharded //= 2
        counts = [0, 0]
        counts[along], counts[1 - along] = sharded, k * k // sharded
        aligned = [_cuts(n, c) for n, c in zip(shape, counts)]
        if sharded > 1 and math.prod(min(b - a for a, b in itertools.pairwise(c)) for c in aligned) >= min_cell:
            cuts = aligned  # else (small, odd shapes) the default grid
    return cuts if math.prod(len(c) - 1 for c in cuts) > 1 else None


def boxes(cuts: list[list[int]], shape) -> tuple[Box, ...]:
    """The cells of a grid, row-major: cell ``i * (len(cuts[1]) - 1) + j`` is row part i, column part j.
    Computed once per grid and shape (a 1T MoE's 140 k tensors share a handful; readers ask per tensor), the
    publisher's grids of at most 64 cells cached; bigger ones, which only a hostile manifest lists, are not.
    A binary tensor table's entries share one grid list and one shape list per distinct value
    (:func:`engine_ext.format.tensor_records.read_tensor_tables`): those are found by identity first, before the
    cache key is built (15 us a call, 0.14 s of a K2 TP rank's 9,000 tensors per 8 layers)."""
    hit = _by_identity.get((id(cuts), id(shape)))
    if hit is not None and hit[0] is cuts and hit[1] is shape:
        return hit[2]
    key = tuple(tuple(c) for c in cuts), tuple(int(s) for s in shape)
    if math.prod(len(c) - 1 for c in cuts) > GRID * GRID:
        return _boxes(*key)
    out = _small_boxes(*key)
    if len(_by_identity) >= 4096:  # inline manifests give each entry its own lists: keep it small
        _by_identity.clear()
    _by_identity[id(cuts), id(shape)] = (cuts, shape, out)  # holds both: their ids stay theirs
    return out


def _boxes(cuts: tuple[tuple[int, ...], ...], shape: tuple[int, ...]) -> tuple[Box, ...]:
    out = [((), ())]
    for c in cuts:
        out = [(s + (a,), e + (b,)) for s, e in out for a, b in itertools.pairwise(c)]
    return tuple((s + (0,) * (len(shape) - len(cuts)), e + shape[len(cuts) :]) for s, e in out)


_small_boxes = functools.lru_cache(maxsize=1024)(_boxes)  # at most 1024 x 64 boxes held
# (id(cuts), id(shape)) -> (cuts, shape, boxes) for grids of at most 64 cells; the lists are a parsed
# manifest's, never changed after it is read
_by_identity: dict[tuple[int, int], tuple[list, list, tuple[Box, ...]]] = {}


def valid_cuts(cuts, shape) -> bool:
    """Cut points per leading dimension: 0 = c[0] < c[1] < ... < c[-1] = the dimension."""
    return (
        isinstance(cuts, list)
        and 1 <= len(cuts) <= min(2, len(shape))
        and all(
            isinstance(c, list)
            and 2 <= len(c) <= 1 + 256
            and c[0] == 0
            and c[-1] == shape[d]
            and all(isinstance(x, int) and not isinstance(x, bool) for x in c)
            and all(a < b for a, b in itertools.pairwise(c))
            for d, c in enumerate(cuts)
        )
    )


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in zip(*box))


def _strides(shape) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def split(positions: np.ndarray, shape, cuts: list[list[int]]) -> list[tuple[int, np.ndarray]]:
    """For each cell that holds changes: (cell, indices into ``positions`` in that cell).

    ``positions`` are sorted flat indices; within each cell they stay in row-major order.
    """
    shape = tuple(shape)
    st = _strides(shape)
    cell = np.searchsorted(np.asarray(cuts[0][1:-1]), positions // st[0], side="right")
    if len(cuts) > 1:
        col = np.searchsorted(np.asarray(cuts[1][1:-1]), (positions // st[1]) % shape[1], side="right")
        cell = cell * (len(cuts[1]) - 1) + col
    n_cells = math.prod(len(c) - 1 for c in cuts)
    if n_cells <= 1 << 16:  # numpy's stable sort of 16-bit keys is a radix sort: O(n)
        cell = cell.astype(np.uint8 if n_cells <= 1 << 8 else np.uint16)
    order = np.argsort(cell, kind="stable")
    counts = np.bincount(cell, minlength=n_cells)
    out, at = [], 0
    for k, c in enumerate(counts):
        if c:
            out.append((k, order[at : at + c]))
        at += c
    return out


def to_local(positions: np.ndarray, shape, box: Box) -> np.ndarray:
    """Flat tensor indices (all inside ``box``) -> box-local row-major indices."""
    st, ext = _strides(shape), [b - a for a, b in zip(*box)]
    local = np.zeros_like(positions)
    rem = positions
    for d, s in enumerate(st):
        coord = rem // s - box[0][d]
        rem = rem % s
        local = local * ext[d] + coord
    return local


def to_global(local: torch.Tensor, shape, box: Box) -> torch.Tensor:
    """Box-local row-major indices -> flat tensor indices (sorted stays sorted within the box).

    Only the first two dimensions are ever cut, so below them a box is whole: with ``row``
    the elements under dimension 1 (``strides[1]``), a local index ``i`` lies in box row
    ``i // (width * row)`` (``width`` the box's extent in dimension 1) and moves by the
    columns the box skips per row, plus the box's own start: one division, in place."""
    st = _strides(shape)
    out = local.clone()
    if len(shape) > 1 and box[1][1] - box[0][1] != shape[1]:
        width = (box[1][1] - box[0][1]) * st[1]
        out += torch.div(local, width, rounding_mode="floor").mul_((shape[1] - (box[1][1] - box[0][1])) * st[1])
    return out.add_(box[0][0] * st[0] + (box[0][1] * st[1] if len(shape) > 1 else 0))


def meets(box: Box, start, stop) -> bool:
    """Whether ``box`` shares an element with the box ``[start, stop)``."""
    return all(max(a, c) < min(b, d) for a, b, c, d in zip(box[0], box[1], start, stop))


def cells_meeting(cuts: list[list[int]], shape, start, stop) -> set[int]:
    """The cells of the grid ``cuts`` over ``shape`` that share an element with the box ``[start, stop)``:
    the parts along each cut dimension that the box's range meets, crossed (what testing every cell with
    :func:`meets` gives, found by bisection: a rank picks its cells of 140 k tensors per K2 version)."""
    if any(max(a, 0) >= min(b, n) for a, b, n in zip(start, stop, shape)):
        return set()
    parts = [
        range(bisect.bisect_right(c, max(start[d], 0)) - 1, bisect.bisect_left(c, min(stop[d], c[-1])))
        for d, c in enumerate(cuts)
    ]
    if len(parts) == 1:
        return set(parts[0])
    cols = len(cuts[1]) - 1
    return {i * cols + j for i in parts[0] for j in parts[1]}


def share_of(start: int, length: int, shares: int) -> int:
    """The share (1 to ``shares``) of a dimension of ``length`` elements that element ``start`` lies in. A
    format-12 cell section holds the cells that start in one share, along the dimension the engines shard the
    tensor along (docs/FORMAT.md, "Cell sections"); a delta blob is laid out the same way
    (:mod:`engine_ext.trainer.blob_layout`)."""
    return 1 + start * shares // max(1, length)


def cell_shares(cuts: list[list[int]], shape, dim: int, shares: int) -> list[int]:
    """:func:`share_of` the first element of each cell of a two-dimensional grid along ``dim``, row-major.
    A rank whose slice begins inside a cell that starts in an earlier share reads that share's section too."""
    return [share_of(box[0][dim], int(shape[dim]), shares) for box in boxes(cuts, shape)]
