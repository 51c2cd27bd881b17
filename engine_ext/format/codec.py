"""Encode and decode one tensor's changed positions and values (lossless, bounded).

Positions are gaps ``p[k] - p[k-1]`` (``p[-1] = 0``) of the sorted flat indices, so a
single cumulative sum decodes them;
values are either the new raw bits (``abs``) or ordered-space steps (``rel``). Both
are integer sequences that pcodec (``pco``) codes within a few percent of their
first-order entropy, faster than zstd decodes its larger output (see
docs/benchmarks.md). ``zstd`` (with byte planes split for values) is kept for tiny
segments where pco's header dominates. Given a :class:`Context` (the tensor's base bits,
block policy and the version's step tables), the context-conditioned coder
(:mod:`engine_ext.format.context`) is tried too and kept when it saves at least
``CONTEXT_GAIN`` and pays on the version's :class:`Readers` (its saved bytes take longer to
fetch than its decode takes beyond v1's). Decoding never allocates more than the
manifest-declared count, which the caller bounds before fetching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pcodec
import torch
import zstandard

from .. import settings
from ..errors import IntegrityError
from . import chunks, kernel_module
from .context import blocks as ctx_blocks
from .context import codec as ctx_codec
from .context import models as ctx_models
from .context import symbols as ctx_symbols
from .dtypes import DType, step_between
from .manifest import CONTEXT_CODERS

ZSTD_LEVEL = 3
SMALL = 256  # below this many changes also try zstd and keep the smaller (above, pco always won: 32-4096 changes, densities 0.1-50 %)
MODE_SAMPLE = 4096  # values sampled to choose abs or rel on big tensors
CONTEXT_GAIN = 0.10  # the context coder is kept when it saves at least this fraction of the bytes
CONTEXT_MIN = 64  # fewer changes than this are never context coded (headers dominate)
_NP_INT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
# Gaps of changed positions and changed values alike: no delta order and classic mode. That is
# what pco's search picks for both (positions sorted and changes scattered, so neighbours do not
# predict each other): the same bytes, at half the time the search takes or less
# (`python bench/codec_configs.py`: gaps, abs and rel values of bf16, fp32 and fp8 real AdamW
# steps; docs/benchmarks.md).
_PCO = pcodec.ChunkConfig(delta_spec=pcodec.DeltaSpec.no_op(), mode_spec=pcodec.ModeSpec.classic())


# What a reader pays to decode a part, from `python bench/context_bench.py --costs` (the 2-core AMX host,
# 2026-12-03, one run; docs/benchmarks.md, "What a reader pays for v2"):
V1_NS_PER_CHANGE = 5.8  # v1's whole decode (pcodec), per change, one thread
STREAMS_NS_PER_CHANGE = 7.0  # v2's streams (format 9's rANS chunks), on one thread of the host
PASS_NS_PER_ELEMENT = {
    "cpu": 0.51,  # the context pass over the base, compiled (scan_native.c), AVX2, both cores of a 2-core host
    # (`python bench/context_bench.py --pass`, 2026-12-07: AVX-512 0.36, numba 0.93; the AVX2 build is the floor a
    # publisher can count on for an x86 reader that has the package built)
    "gpu": 0.001,
}  # Triton on the device: ESTIMATED (two reads of a bf16 base at ~4 TB/s; no GPU lent)
PART_NS = {
    "cpu": 17e3,  # per part: the streams' fixed costs on the host (header, plan, tables), measured
    "gpu": 120e3,
}  # the same, and the device's launches, copies and syncs for the part: ESTIMATED (~0.1 ms)
MOST_SAVED_PER_CHANGE = 0.6  # bytes: the most v2 saves per change on real training (fp8 block: 0.54-0.59)
MOST_PLAIN_PER_CHANGE = 4.0  # bytes: about the most v1 takes per change (fp32 masters; bf16 1.1-1.5)


@dataclass(frozen=True)
class Readers:
    """Who decodes the versions a publisher writes, as it is told (``ENGINE_EXT_READER_DEVICE``,
    ``ENGINE_EXT_READER_MBPS``): where the readers' weights live (``gpu``: the context pass runs
    there, :mod:`engine_ext.triton_kernels.context_decode`; ``cpu``: on the host) and the store bandwidth
    one reader rank fetches at, in MB/s. Every reader decodes every part it holds and no reader
    chooses a coding, so the publisher chooses for all: a part is context coded only where it
    pays on them (:meth:`pays`). ``mbps`` 0: bytes first (metered or slow links)."""

    device: str = "gpu"
    mbps: float = 100.0

    def __post_init__(self):
        if self.device not in PASS_NS_PER_ELEMENT or not self.mbps >= 0:
            raise ValueError(f"readers: device one of {sorted(PASS_NS_PER_ELEMENT)} and MB/s >= 0, got {self}")

    @classmethod
    def from_settings(cls) -> Readers:
        s = settings.current()
        return cls(s.reader_device, s.reader_mbps)

    def decode_s(self, changes: int, elements: int, context: bool) -> float:
        """Seconds a reader spends decoding a part of ``elements`` with ``changes``, context coded or plainly."""
        if not context:
            return changes * V1_NS_PER_CHANGE * 1e-9
        return (
            changes * STREAMS_NS_PER_CHANGE + elements * PASS_NS_PER_ELEMENT[self.device] + PART_NS[self.device]
        ) * 1e-9

    def pays(self, plain_bytes: float, coded_bytes: float, changes: int, elements: int) -> bool:
        """Whether a reader gets the part sooner context coded (``coded_bytes``) than plainly: a rank fetches a part
        while it decodes the one before, so each form costs the longer of its fetch (at the readers' bandwidth)
        and its decode, not their sum (bytes first: always)."""
        if self.mbps == 0:
            return True
        bw = self.mbps * 1e6
        return max(coded_bytes / bw, self.decode_s(changes, elements, True)) <= max(
            plain_bytes / bw, self.decode_s(changes, elements, False)
        )

    def may_pay(self, changes: int, elements: int) -> bool:
        """Before anything is encoded: whether v2 could pay at the most it saves per change on about the most v1
        takes (else the publisher spends no step tables and no pass over the base on the tensor)."""
        plain = MOST_PLAIN_PER_CHANGE * changes
        return self.pays(plain, plain - MOST_SAVED_PER_CHANGE * changes, changes, elements)


@dataclass(frozen=True)
class Context:
    """What the context coder needs besides a tensor's changes: its bits (flat, any device),
    the base's or the new version's (the changed elements are put back from the old bits
    part by part, so a publisher hands its kept bits without copying the model), its block
    policy (:func:`engine_ext.format.context.blocks.block_policy`), the version's step
    tables for its dtype, and its readers (None: :meth:`Readers.from_settings`). ``base`` may
    hold only rows ``origin`` onwards of the tensor (what one rank of a sharded trainer
    holds): then only parts inside those rows are coded."""

    base: torch.Tensor
    policy: int
    tables: list
    readers: Readers | None = None
    origin: int = 0  # the row (index along dimension 0) of the tensor that ``base`` starts at: a trainer rank's rows


@dataclass
class Encoded:
    pos_coder: str
    pos: bytes
    mode: str
    val_coder: str
    val: bytes


def _gap_dtype(numel: int):
    return np.uint32 if numel <= 1 << 32 else np.uint64


def _pco(arr: np.ndarray) -> bytes:
    return pcodec.standalone.simple_compress(np.ascontiguousarray(arr), _PCO)


def _planes(arr: np.ndarray) -> bytes:
    """Bytes of ``arr`` with byte k of every element stored together (zstd likes it)."""
    b = arr.view(np.uint8).reshape(-1, arr.itemsize)
    return np.ascontiguousarray(b.T).tobytes()


def _unplanes(data: bytes, dtype, n: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    b = np.frombuffer(data, np.uint8).reshape(size, n)
    return np.array(b.T, order="C").view(dtype).reshape(n)


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def _for_pco(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.int16) if bits.itemsize == 1 else bits


def encode_positions(pos: np.ndarray, numel: int) -> tuple[str, bytes]:
    if pos.size == numel:
        return "all", b""
    return encode_gaps(np.diff(pos, prepend=np.int64(0)).astype(_gap_dtype(numel)))


def encode_gaps(gaps: np.ndarray) -> tuple[str, bytes]:
    """Positions as their gaps (in :func:`_gap_dtype` of the part's elements), fewer than all of them."""
    best = ("pco", _pco(gaps))
    if gaps.size < SMALL:
        z = ("zstd", _zstd(gaps.tobytes()))
        best = min(best, z, key=lambda c: len(c[1]))
    return best


def encode_values(values: np.ndarray) -> tuple[str, bytes]:
    best = ("pco", _pco(_for_pco(values)))
    if values.size < SMALL:
        best = min(best, ("zstd", _zstd(_planes(values))), key=lambda c: len(c[1]))
    return best


def _value_modes(dtype: DType, new_bits: torch.Tensor, old_bits: torch.Tensor | None, mode: str | None) -> dict:
    """The value sequences a mode may code: the new bits (``abs``), the steps from the old (``rel``)."""
    values = {"abs": new_bits.detach().cpu().numpy()}
    if old_bits is not None and mode != "abs":
        values["rel"] = step_between(old_bits.detach().cpu(), new_bits.detach().cpu(), dtype.is_float).numpy()
    return values


def _sample(n: int) -> np.ndarray:
    return np.linspace(0, n - 1, MODE_SAMPLE).astype(np.int64)


def _sampled_mode(dtype: DType, new_bits: torch.Tensor, old_bits: torch.Tensor) -> str:
    """The value mode that codes an evenly spread sample of the changes smaller: half the
    encode time of coding both, the same choice in practice."""
    pick = torch.from_numpy(_sample(new_bits.numel()))
    values = _value_modes(dtype, new_bits[pick.to(new_bits.device)], old_bits[pick.to(old_bits.device)], None)
    return _smaller(values)


def _smaller(values: dict) -> str:
    return min(values, key=lambda k: len(encode_values(values[k])[1]))


def _plain(pos: tuple[str, bytes], values: dict, mode: str | None, plain_mode: str | None) -> Encoded:
    """The plain (v1) coding of a part whose positions are coded (``pos``) from the value sequences
    its modes may code (:func:`_value_modes`): the forced or chosen mode's, else the smaller (by
    a sample, for many changes)."""
    chosen = mode or plain_mode
    if chosen in values:
        values = {chosen: values[chosen]}
    elif len(values) == 2 and (n := len(values["abs"])) > 4 * MODE_SAMPLE:
        pick = _sample(n)
        values = {(m := _smaller({k: v[pick] for k, v in values.items()})): values[m]}
    m, val_coder, val_bytes = min(((k, *encode_values(v)) for k, v in values.items()), key=lambda c: len(c[2]))
    return Encoded(*pos, m, val_coder, val_bytes)


def encode(
    dtype: DType,
    numel: int,
    positions: torch.Tensor,
    new_bits: torch.Tensor,
    old_bits: torch.Tensor | None,
    mode: str | None = None,
    context: Context | None = None,
    shape=None,
    box=None,
    plain_mode: str | None = None,
) -> Encoded:
    """Encode changes at ``positions`` (sorted int64, part-local) to ``new_bits``.

    With ``old_bits`` (the base bits at the same positions) both value modes are tried and
    the smaller kept, unless ``mode`` forces one or ``plain_mode`` names the one the caller
    chose for the whole tensor. With a ``context`` the context coder is tried as well (unless
    ``mode`` is ``abs``), for the part ``box`` (None: all) of the tensor of ``shape``.
    Tensors on any device.
    """
    pos = positions.detach().cpu().numpy().astype(np.int64, copy=False)
    best = _plain(encode_positions(pos, numel), _value_modes(dtype, new_bits, old_bits, mode), mode, plain_mode)
    if context is not None and old_bits is not None and mode != "abs" and CONTEXT_MIN <= pos.size < numel:
        readers = context.readers or Readers.from_settings()
        if readers.may_pay(pos.size, numel):
            ctx = encode_context(dtype, shape, box, context, pos, old_bits, new_bits)
            plain, coded = len(best.pos) + len(best.val), None if ctx is None else len(ctx.pos) + len(ctx.val)
            if (
                coded is not None
                and coded <= (1 - CONTEXT_GAIN) * plain
                and readers.pays(plain, coded, pos.size, numel)
            ):
                return ctx
    return best


def context_policy(name: str, dtype: DType, shape, nnz: int) -> int | None:
    """The block policy a changed tensor is context coded under, or None where the coder is not tried."""
    if not ctx_symbols.supports(dtype.name) or nnz < CONTEXT_MIN:
        return None
    return ctx_blocks.block_policy(name, shape)


def step_tables_by_dtype(changes) -> dict[str, list[bytes]]:
    """A version's step tables per dtype, from ``(dtype, old bits, new bits)`` at the changes of
    every tensor the context coder may take (all of them, before any is encoded)."""
    return step_tables_from(step_histograms(changes))


def step_histograms(changes) -> dict[str, np.ndarray]:
    """Per dtype, the step histogram (:func:`engine_ext.format.context.models.step_histogram`) of ``(dtype, old bits,
    new bits)`` at the changes: what the step tables depend on, summable over a sharded trainer's ranks."""
    out: dict[str, np.ndarray] = {}
    for dtype, old_bits, new_bits in changes:
        old_bits = old_bits.detach().cpu()
        steps = step_between(old_bits, new_bits.detach().cpu(), dtype.is_float).numpy()
        h = ctx_models.step_histogram(dtype.name, ctx_models.exponents(old_bits.numpy(), dtype.name), steps)
        out[dtype.name] = h if dtype.name not in out else out[dtype.name] + h
    return out


def step_tables_from(histograms: dict[str, np.ndarray]) -> dict[str, list[bytes]]:
    """The step tables per dtype of (summed) :func:`step_histograms`."""
    return {dt: ctx_models.tables_from_histogram(dt, h) for dt, h in sorted(histograms.items())}


def context_pays(dtype: DType, base: torch.Tensor, old_bits: torch.Tensor, readers: Readers | None = None) -> bool:
    """Whether a sample of a tensor's bits (``base``, flat, either version's: they differ only
    at the changes) promises the context coder ``CONTEXT_GAIN`` on its changes (whose old
    bits are ``old_bits``), and whether it could pay on the ``readers`` (default: the
    settings'). Asked before a tensor gets a :class:`Context`, so uniform changes, or readers
    on whom v2 cannot pay, cost neither step tables nor a pass over the whole base."""
    readers = readers or Readers.from_settings()
    return (
        ctx_symbols.supports(dtype.name)
        and readers.may_pay(old_bits.numel(), base.numel())
        and ctx_codec.pays(
            dtype.name,
            ctx_codec.sample(base.detach().reshape(-1)),
            old_bits.detach().cpu().numpy(),
            base.numel(),
            CONTEXT_GAIN,
        )
    )


def encode_context(
    dtype: DType, shape, box, context: Context, pos: np.ndarray, old_bits: torch.Tensor, new_bits: torch.Tensor
) -> Encoded | None:
    """The context-coded form of a part's changes, or None where the coder does not apply."""
    if not ctx_symbols.supports(dtype.name) or not context.tables:
        return None
    shape = tuple(shape)
    base = context.base.detach().reshape((-1, *shape[1:]) if shape else ())
    if shape:  # the part's box in base, which holds the tensor's rows from ``origin``
        start, stop = box or ((0,) * len(shape), shape)
        if start[0] < context.origin or stop[0] - context.origin > base.shape[0]:
            raise ValueError(
                f"part rows {start[0]}..{stop[0]} lie outside the base's rows {context.origin}.."
                f"{context.origin + base.shape[0]}"
            )
        box_index = (slice(start[0] - context.origin, stop[0] - context.origin),) + tuple(
            slice(a, b) for a, b in zip(start[1:], stop[1:])
        )
        base = base[box_index]
    base = base.to("cpu", copy=True).reshape(-1)  # the part alone
    old_bits = old_bits.detach().cpu()
    base[torch.from_numpy(pos)] = old_bits  # the base, whichever version's bits the context holds
    steps = step_between(old_bits, new_bits.detach().cpu(), dtype.is_float).numpy()
    e = ctx_codec.encode(dtype.name, shape, box, context.policy, base.numpy(), pos, steps, context.tables)
    return Encoded("ctx-rans", e.pos, "rel", "ctx-rans", e.val)


@dataclass
class ChunkedEncoded:
    """A big tensor's changes cut into grid cells (:mod:`engine_ext.format.chunks`), each encoded alone."""

    cuts: list[list[int]]
    cells: list[tuple[int, int, Encoded]]  # (cell, changes in it, its encoding), cells with changes only


def encode_tensor(
    dtype: DType,
    shape,
    positions: torch.Tensor,
    new_bits: torch.Tensor,
    old_bits: torch.Tensor | None,
    mode: str | None = None,
    min_cell: int | None = chunks.MIN_CELL,
    context: Context | None = None,
    cuts: list[list[int]] | None = None,
) -> Encoded | ChunkedEncoded:
    """A changed tensor's encoding: whole (:func:`encode`), or per grid cell (:func:`chunks.grid`,
    cells of ``min_cell`` elements or more; None: never cut), so that a rank can fetch the
    cells it holds. With a ``context`` (given where :func:`context_pays`), the context coder
    is tried per part. ``cuts`` imposes the grid (a sharded trainer's rank codes only the
    cells inside its rows: ``positions`` are flat indices of the whole tensor, all in them)."""
    numel = int(np.prod(shape, dtype=np.int64))
    if cuts is None:
        cuts = None if min_cell is None else chunks.grid(shape, min_cell)
    if cuts is None:
        return encode(dtype, numel, positions, new_bits, old_bits, mode, context, tuple(shape))
    pos = positions.detach().cpu().numpy().astype(np.int64, copy=False)
    new_bits, old_bits = new_bits.detach().cpu(), None if old_bits is None else old_bits.detach().cpu()
    plain_mode = None  # chosen once for the tensor where its cells are many and big enough to share it
    if mode is None and old_bits is not None and pos.size > 4 * MODE_SAMPLE:
        plain_mode = _sampled_mode(dtype, new_bits, old_bits)
    cells = chunks.boxes(cuts, shape)
    if context is None and max(map(chunks.box_numel, cells)) <= 1 << 32 and (kernels := _cell_kernels()) is not None:
        return ChunkedEncoded(
            cuts, _plain_cells(dtype, shape, cuts, cells, kernels, pos, new_bits, old_bits, mode, plain_mode)
        )
    out = []
    for cell, idx in chunks.split(pos, shape, cuts):
        box, sel = cells[cell], torch.from_numpy(idx)
        local = torch.from_numpy(chunks.to_local(pos[idx], shape, box))
        out.append(
            (
                cell,
                len(idx),
                encode(
                    dtype,
                    chunks.box_numel(box),
                    local,
                    new_bits[sel],
                    None if old_bits is None else old_bits[sel],
                    mode,
                    context,
                    tuple(shape),
                    box,
                    plain_mode,
                ),
            )
        )
    return ChunkedEncoded(cuts, out)


def _plain_cells(
    dtype: DType,
    shape,
    cuts,
    cells,
    kernels,
    pos: np.ndarray,
    new_bits: torch.Tensor,
    old_bits: torch.Tensor | None,
    mode: str | None,
    plain_mode: str | None,
) -> list[tuple[int, int, Encoded]]:
    """Every changed cell's plain coding, its gaps and values grouped by cell in two passes over the
    changes (:mod:`engine_ext.format.cell_kernels`): the bytes the per-cell path codes."""
    rel = old_bits is not None and mode != "abs"
    counts, gaps, abs_values, steps = kernels.group(
        pos, new_bits.numpy(), old_bits.numpy() if rel else None, shape, cuts, dtype.is_float
    )
    out, at = [], 0
    for cell, n in enumerate(counts.tolist()):
        if not n:
            continue
        numel = chunks.box_numel(cells[cell])
        values = {"abs": abs_values[at : at + n]} | ({"rel": steps[at : at + n]} if rel else {})
        coded = ("all", b"") if n == numel else encode_gaps(gaps[at : at + n].astype(_gap_dtype(numel), copy=False))
        out.append((cell, n, _plain(coded, values, mode, plain_mode)))
        at += n
    return out


def _cell_kernels():
    return kernel_module("cell_kernels")


def uses_context(e: Encoded | ChunkedEncoded) -> bool:
    """Whether any part of a tensor's encoding is context coded."""
    parts = [e] if isinstance(e, Encoded) else [enc for _, _, enc in e.cells]
    return any(p.pos_coder in CONTEXT_CODERS for p in parts)


def decode_positions(coder: str, data: bytes, nnz: int, numel: int) -> torch.Tensor | None:
    """Sorted unique int64 positions in [0, numel); None for 'all'. Raises IntegrityError."""
    if coder == "all":
        if nnz != numel or data:
            raise IntegrityError("'all' positions with a count other than numel")
        return None
    if coder not in PLAIN_POSITIONS:
        raise IntegrityError(f"unknown positions coder {coder!r}")
    gaps = np.empty(nnz, _gap_dtype(numel))
    _gaps_into(coder, data, gaps)
    if nnz == 0:
        return torch.empty(0, dtype=torch.int64)
    kernels = kernel_module("codec_kernels")
    if kernels is not None:  # the checks and the running sum in one pass
        pos, status, at = kernels.positions(gaps, numel)
        if status == kernels.REPEATED:
            raise IntegrityError("repeated position")
        if status == kernels.BEYOND:
            raise IntegrityError(f"position number {at} (from 0) lies at or beyond the tensor's {numel} elements")
        return torch.from_numpy(pos)
    if gaps.dtype == np.uint64 and int(gaps.max()) >= numel:  # the int64 sum below could wrap
        raise IntegrityError("position gap beyond the tensor")
    if nnz > 1 and gaps[1:].min() == 0:
        raise IntegrityError("repeated position")
    pos = np.cumsum(gaps, dtype=np.int64)
    if pos[-1] >= numel:
        raise IntegrityError(f"position {int(pos[-1])} beyond the tensor's {numel} elements")
    return torch.from_numpy(pos)


def decode_values(coder: str, data: bytes, nnz: int, dtype: DType) -> torch.Tensor:
    np_int = _NP_INT[dtype.bits]
    wide = np.empty(nnz, np.int16 if dtype.bits == 8 and coder == "pco" else np_int)  # pco codes 8 bits widened
    _values_into(coder, data, wide, np_int)
    if wide.dtype == np_int:
        return torch.from_numpy(wide)
    kernels = kernel_module("codec_kernels")
    if kernels is not None:  # checked and narrowed in one pass
        narrow = kernels.narrow8(wide)
    else:
        narrow = wide.astype(np.int8) if not nnz or -128 <= wide.min() <= wide.max() <= 127 else None
    if narrow is None:
        raise IntegrityError("8-bit values out of range")
    return torch.from_numpy(narrow)


class PlainCell(NamedTuple):
    """One cell of a tensor as :func:`decode_cells` takes it: its box and its two coded segments."""

    box: tuple
    nnz: int
    positions_coder: str
    positions: bytes
    values_coder: str
    values: bytes


class PlainTensor(NamedTuple):
    """A tensor's plainly coded cells (in cell order), as :func:`decode_cells` takes them; ``name`` for errors."""

    name: str
    shape: tuple
    cells: list[PlainCell]


PLAIN_POSITIONS, PLAIN_VALUES = frozenset({"pco", "zstd"}), frozenset({"pco", "raw", "zstd"})


def plain(shape, cells) -> bool:
    """Whether :func:`decode_cells` decodes a tensor of ``shape`` from cells given as (box, positions coder,
    values coder): positions as gaps, values plain, and no cell of more than 2^32 elements (their gaps are
    32-bit)."""
    return bool(shape) and all(
        pc in PLAIN_POSITIONS and vc in PLAIN_VALUES and chunks.box_numel(box) <= 1 << 32 for box, pc, vc in cells
    )


def decode_cells(tensors: list[PlainTensor], dtype: DType) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(global positions in ascending order, values) of each of ``tensors`` (of one dtype, each :func:`plain`):
    every cell's streams decoded into its run of one buffer, then one kernel call sums, checks, narrows and
    places them all (:func:`engine_ext.format.cell_kernels.decode_place`); each tensor's result is a view of
    one array. A K2 rank's cells hold ~2,700 changes each: decoded one by one (a positions pass, a narrowing
    pass, two concatenations and a placing pass per tensor, four calls per cell), the steps around pcodec cost
    more than pcodec itself, and the Python per tensor more again. Needs numba (without it a reader decodes
    cell by cell). Raises IntegrityError."""
    kernels = _cell_kernels()
    sizes = [c.nnz for t in tensors for c in t.cells]
    bounds = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=bounds[1:])
    at = bounds.tolist()
    np_int = _NP_INT[dtype.bits]
    gaps = np.empty(at[-1], np.uint32)
    wide = np.empty(at[-1], np.int16 if dtype.bits == 8 else np_int)
    k = 0
    for t in tensors:
        try:
            for c in t.cells:
                _gaps_into(c.positions_coder, c.positions, gaps[at[k] : at[k + 1]])
                _values_into(c.values_coder, c.values, wide[at[k] : at[k + 1]], np_int)
                k += 1
        except IntegrityError as err:
            raise IntegrityError(f"tensor {t.name!r}: {err}") from None
    (status, i, cell, index), pos, vals = kernels.decode_place(
        [(t.shape, [c.box for c in t.cells]) for t in tensors], gaps, wide, bounds, np_int
    )
    if status != kernels.OK:
        t = tensors[i]
        what = {kernels.REPEATED: "repeated position", kernels.WIDE: "8-bit values out of range"}.get(
            status,
            f"position number {index} (from 0) lies at or beyond the part's {chunks.box_numel(t.cells[cell].box)} "
            "elements",
        )
        raise IntegrityError(f"tensor {t.name!r}: " + (f"cell {cell}: {what}" if len(t.cells) > 1 else what))
    pos_t, vals_t = torch.from_numpy(pos), torch.from_numpy(vals)
    out, k = [], 0
    for t in tensors:
        a, b = at[k], at[k + len(t.cells)]
        out.append((pos_t[a:b], vals_t[a:b]))
        k += len(t.cells)
    return out


def _gaps_into(coder: str, data: bytes, out: np.ndarray) -> None:
    if coder == "pco":
        _pco_decode_into(data, out, "positions")
    elif coder == "zstd":
        out[:] = np.frombuffer(_zstd_decode(data, out.nbytes, "positions"), out.dtype)
    else:
        raise IntegrityError(f"positions coder {coder!r} is not coded as gaps")


def _values_into(coder: str, data: bytes, out: np.ndarray, np_int) -> None:
    """A part's values (of integer view ``np_int``) into ``out``: int16 for 8-bit pco values (pcodec codes them
    widened), else ``np_int`` or wider (a batch's buffer)."""
    n = len(out)
    if coder == "pco":
        _pco_decode_into(data, out, "values")
    elif coder == "raw":
        if len(data) != n * np.dtype(np_int).itemsize:
            raise IntegrityError("raw values of the wrong length")
        out[:] = np.frombuffer(data, np_int)
    elif coder == "zstd":
        out[:] = _unplanes(_zstd_decode(data, n * np.dtype(np_int).itemsize, "values"), np_int, n)
    else:
        raise IntegrityError(f"unknown values coder {coder!r}")


def _pco_decode_into(data: bytes, out: np.ndarray, what: str) -> None:
    try:
        progress = pcodec.standalone.simple_decompress_into(data, out)
    except (RuntimeError, TypeError, ValueError) as e:
        raise IntegrityError(f"{what}: corrupt pco stream ({e})") from None
    if progress.n_processed != len(out) or not progress.finished:
        raise IntegrityError(f"{what}: pco stream holds a different count than the manifest's {len(out)}")


def _zstd_decode(data: bytes, expected: int, what: str) -> bytes:
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what}: corrupt zstd frame ({e})") from None
    if params.content_size != expected:
        raise IntegrityError(f"{what}: zstd frame declares {params.content_size} bytes, expected {expected}")
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what}: corrupt zstd frame ({e})") from None
    if len(out) != expected:
        raise IntegrityError(f"{what}: zstd frame decoded to {len(out)} bytes, expected {expected}")
    return out
