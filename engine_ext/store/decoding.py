"""A version's verified parts decoded into :class:`~engine_ext.format.delta.TensorDelta` objects.

:mod:`.reader` fetches and checks the bytes (every part against its SHA-256 from the signed manifest, and the
decode's size bounded from the manifest alone); this module turns them into each tensor's changes, in global
positions sorted ascending, as the apply reads them:

- plainly coded tensors (positions as gaps, values plain: codec v1) in batches of many tensors of one dtype,
  each one kernel call into one buffer (:func:`_decode_plain`, :func:`_batches`);
- context-coded cells (codec v2, decoded against the base weights a :class:`Bases` holds), a row-cut anchor's
  whole cells and every tensor where numba is missing part by part, one task per tensor
  (:func:`_decode_tensor`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..errors import BaseMismatchError, IntegrityError
from ..format import chunks, codec, kernel_module
from ..format import fingerprint as fpr
from ..format.cells import CELL_CODERS, CELL_MODES
from ..format.context import codec as ctx_codec
from ..format.delta import TensorDelta, apply_tensor
from ..format.dtypes import as_bits, dtype_by_name
from ..format.manifest import CONTEXT_CODERS, Manifest, TensorEntry

if TYPE_CHECKING:
    from .reader import Plan


class _Part(NamedTuple):
    """One part of :class:`Plan` as its tensor's decode reads it: the bytes of a changed tensor (``box`` None)
    or of one cell of it (``box`` the cell)."""

    box: tuple | None
    tables: tuple  # the version's step tables for the tensor's dtype (context-coded parts)
    blob: int
    offset: int
    nnz: int
    positions_coder: str
    positions_length: int  # the positions segment first, the values right after
    values_coder: str
    mode: str | None  # the values': "abs" or "rel"


class Bases:
    """The base weights context-coded parts (:mod:`engine_ext.format.context`) are decoded
    against: a decoder reads the base of each part it decodes, after checking the tensor's
    base fingerprint where it can (a wrong base decodes to garbage)."""

    def bits(self, name: str, start: tuple, stop: tuple) -> np.ndarray | None:
        """Flat row-major raw bits of box [start, stop) of tensor ``name``; None when none of it is held."""
        raise NotImplementedError

    def context_device(self, name: str) -> torch.device | None:
        """Where the context pass over ``name``'s base runs: None on the host (numba, from
        :meth:`bits`); a torch device: there (:mod:`engine_ext.triton_kernels.context_decode`, Triton),
        from :meth:`tensor_bits`, with no copy of the base to the host. The decoded positions
        and values of such a tensor are on that device."""
        return None

    def tensor_bits(self, name: str, start: tuple, stop: tuple) -> torch.Tensor | None:
        """:meth:`bits` as a flat torch tensor on :meth:`context_device` (PartlyHeldError as :meth:`bits`)."""
        bits = self.bits(name, start, stop)
        return None if bits is None else torch.from_numpy(bits)

    def verify(self, name: str, fingerprint: int) -> None:
        """Raise BaseMismatchError unless the held base of ``name`` has ``fingerprint`` (where checkable)."""

    def advance(self, tensors: list[TensorDelta]) -> None:
        """The next link of a route is decoded against this base with ``tensors`` applied."""
        raise NotImplementedError


class TensorBases(Bases):
    """Bases from whole tensors held in memory (a checkpoint, a trainer's copy)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.source = tensors  # read lazily, once per tensor (a checkpoint need not be loaded whole)
        self.tensors: dict[str, torch.Tensor] = {}
        self._fps: dict[str, int] = {}

    def _get(self, name: str) -> torch.Tensor | None:
        if name not in self.tensors:
            if name not in self.source:
                return None
            self.tensors[name] = self.source[name].detach().cpu()
        return self.tensors[name]

    def bits(self, name, start, stop):
        t = self._get(name)
        if t is None:
            return None
        box = as_bits(t.contiguous())[tuple(slice(a, b) for a, b in zip(start, stop))]
        return box.contiguous().reshape(-1).numpy()

    def verify(self, name, fingerprint):
        if name not in self._fps and self._get(name) is not None:
            self._fps[name] = fpr.tensor_fingerprint(self.tensors[name])
        if self._fps.get(name, fingerprint) != fingerprint:
            raise BaseMismatchError(
                f"tensor {name!r}: the held base has fingerprint {fpr.fmt(self._fps[name])}, "
                f"the delta's is {fpr.fmt(fingerprint)} (wrong base)"
            )

    def advance(self, tensors):
        for td in tensors:
            base = self._get(td.name)
            if base is not None or (td.positions is None and td.mode == "abs"):  # an anchor's tensor: its own base
                self.tensors[td.name] = apply_tensor(base, td, check=False)
                self._fps.pop(td.name, None)


def _decode_context(
    t: TensorEntry, p: _Part, data: memoryview, bases: Bases | None
) -> tuple[torch.Tensor, torch.Tensor]:
    box = p.box
    if bases is None:
        raise IntegrityError(f"tensor {t.name!r} is context-coded: decoding needs the base weights")
    start = (0,) * len(t.shape) if box is None else box[0]
    device = bases.context_device(t.name)  # where the base lives: the pass runs there
    read = bases.bits if device is None else bases.tensor_bits

    def base_of(sub):
        return read(t.name, tuple(a + s for a, s in zip(start, sub[0])), tuple(a + s for a, s in zip(start, sub[1])))

    n = p.positions_length
    part = ctx_codec.StoredPart(t.dtype, tuple(t.shape), box, bytes(data[:n]), bytes(data[n:]), p.nnz, list(p.tables))
    if device is None:
        pos, vals = (torch.from_numpy(a) for a in ctx_codec.decode(part, base_of))
    else:
        from ..triton_kernels import context_decode  # Triton: loaded only where a base lives on a device

        pos, vals = context_decode.decode(part, base_of)
    return pos, vals


def _decode_part(
    t: TensorEntry, p: _Part, data: memoryview, bases: Bases | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(positions, local to the part's box if it has one, or None for every element; values) of one part of
    tensor ``t``."""
    box = p.box
    dt = dtype_by_name(t.dtype)
    numel = t.numel if box is None else chunks.box_numel(box)
    n = p.positions_length
    try:
        if p.positions_coder in CONTEXT_CODERS:
            return _decode_context(t, p, data, bases)
        pos = codec.decode_positions(p.positions_coder, bytes(data[:n]), p.nnz, numel)
        vals = codec.decode_values(p.values_coder, bytes(data[n:]), p.nnz, dt)
    except IntegrityError as err:
        raise IntegrityError(f"tensor {t.name!r}: {err}") from None
    return pos, vals


def _join(t: TensorEntry, ps: list[_Part], pieces: list) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(global positions in ascending order, or None for every element; values) of a tensor from its
    decoded parts ``ps`` (in cell order) and their ``pieces`` (box-local positions, values). On the host,
    the cells are placed in one pass (:func:`engine_ext.format.cell_kernels.place`); parts decoded on a
    device (context-coded, where the base lives) are mapped there and sorted."""
    boxes = [p.box for p in ps if p.box is not None]
    if not boxes:
        return pieces[0]
    local = [
        torch.arange(chunks.box_numel(b), dtype=torch.int64) if q is None else q for b, (q, _) in zip(boxes, pieces)
    ]
    kernels = kernel_module("cell_kernels")
    if kernels is not None and all(v.device.type == "cpu" for _, v in pieces):
        pos, vals = kernels.place(t.shape, boxes, [q.numpy() for q in local], [v.numpy() for _, v in pieces])
        return torch.from_numpy(pos), torch.from_numpy(vals)
    pieces = _on_one_device([(chunks.to_global(q, t.shape, b), v) for b, q, (_, v) in zip(boxes, local, pieces)])
    pos = torch.cat([q for q, _ in pieces])
    vals = torch.cat([v for _, v in pieces])
    if len(t.grid or ()) > 1:  # cells side by side along dimension 1 interleave by row
        pos, order = torch.sort(pos)
        vals = vals[order]
    return pos, vals


def _decode_values(t: TensorEntry, p: _Part, data: memoryview) -> torch.Tensor:
    """The values of a part whose positions are every element of it (no bytes)."""
    try:
        return codec.decode_values(p.values_coder, bytes(data[p.positions_length :]), p.nnz, dtype_by_name(t.dtype))
    except IntegrityError as err:
        raise IntegrityError(f"tensor {t.name!r}: {err}") from None


def _on_one_device(pieces: list) -> list:
    """Parts of one tensor decoded on its base's device (context-coded) and on the host (the others),
    all on the base's device, where the apply reads them."""
    devices = {v.device for _, v in pieces}
    if len(devices) == 1:
        return pieces
    dev = next(d for d in devices if d.type != "cpu")
    return [(None if q is None else q.to(dev), v.to(dev)) for q, v in pieces]


def decode_parts(m: Manifest, parts: Plan, data_of, workers: int, bases: Bases | None = None) -> list[TensorDelta]:
    """The TensorDeltas of ``m``'s tensors (one per tensor and value mode, in the manifest's order) from their
    decoded parts (``parts``: a :class:`Plan`; cells merged into sorted positions). Plainly coded tensors are
    decoded in batches of many tensors of one dtype (:func:`_decode_plain`); the others (context-coded
    cells, whole anchors, tensors without numba) one task per tensor (:func:`_decode_tensor`)."""
    tensors = list(m.tensors)  # the entry objects, made here (once, before the threads) if not yet
    step_tables = {dt: tuple(m.tables_for(dt)) for dt in (m.step_tables or {})}
    r = parts.records
    cols = list(
        zip(
            parts.cells.tolist(),
            r["blob"].tolist(),
            r["offset"].tolist(),
            r["nnz"].tolist(),
            [CELL_CODERS[x] for x in r["positions_coder"].tolist()],
            r["positions_length"].tolist(),
            [CELL_CODERS[x] for x in r["values_coder"].tolist()],
            [CELL_MODES[x] for x in r["mode"].tolist()],
        )
    )
    rows = parts.rows
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]).tolist() if len(rows) else []
    batched = kernel_module("cell_kernels") is not None
    plain: dict[str, list[_Unit]] = {}  # dtype -> units
    singles: list[tuple[int, TensorEntry, list[_Part]]] = []
    for order, (a, b) in enumerate(zip(starts, [*starts[1:], len(rows)])):
        t = tensors[int(rows[a])]
        tab, boxes = step_tables.get(t.dtype, ()), t.boxes() if t.grid is not None else ()
        ps = [_Part(None if cell < 0 else boxes[cell], tab, *rest) for cell, *rest in cols[a:b]]
        if batched and not _whole_in_rows(t, ps) and _plain(t, ps):
            by_mode: dict[str | None, list[_Part]] = {}
            for p in ps:
                by_mode.setdefault(p.mode, []).append(p)
            plain.setdefault(t.dtype, []).extend(_Unit(order, t, mode, mps) for mode, mps in by_mode.items())
        else:
            singles.append((order, t, ps))
    # decoding is CPU work (pcodec and the kernels release the GIL): more threads than cores only hand the GIL
    # around (a K2 EP rank's layer: 77 ns per change on 8 threads, 43 on 2, on 2 cores)
    threads = max(1, min(workers, _cores()))
    tasks = [partial(_decode_plain, units, data_of) for units in _batches(plain, threads)]
    tasks += [partial(_decode_tensor, order, t, ps, data_of, bases) for order, t, ps in singles]
    with ThreadPoolExecutor(max(1, min(threads, len(tasks)))) as pool:
        done = [od for ods in pool.map(lambda task: task(), tasks) for od in ods]
    done.sort(key=itemgetter(0))  # stable: a tensor's value modes stay in their order
    return [td for _, td in done]


class _Unit(NamedTuple):
    """One TensorDelta's worth of a plainly coded tensor: its parts of one value mode (in cell order)."""

    order: int  # the tensor's place among the decoded tensors
    t: TensorEntry
    mode: str | None
    parts: list[_Part]


def _plain(t: TensorEntry, ps: list[_Part]) -> bool:
    """Whether tensor ``t``'s parts ``ps`` decode in a batch (:func:`engine_ext.format.codec.plain`)."""
    whole = ((0,) * len(t.shape), tuple(t.shape))
    return codec.plain(t.shape, [(whole if p.box is None else p.box, p.positions_coder, p.values_coder) for p in ps])


def _batches(plain: dict[str, list[_Unit]], threads: int) -> list[list[_Unit]]:
    """Each dtype's units cut into runs of about a quarter of a thread's share of the changes, and at most 2^20
    (~10 MB of arrays), so that the pool balances the threads: two batches of a Qwen2-shaped model (one of
    them its embedding) read 1.3x slower than one task per tensor, while one task per tensor cost a K2 TP
    rank's two-cell tensors their Python."""
    sizes = {dt: [sum(p.nnz for p in u.parts) for u in units] for dt, units in plain.items()}
    target = max(1, min(1 << 20, sum(map(sum, sizes.values())) // (4 * threads)))
    out = []
    for dt, units in plain.items():
        run: list[_Unit] = []
        held = 0
        for u, n in zip(units, sizes[dt]):
            run.append(u)
            held += n
            if held >= target:
                out.append(run)
                run, held = [], 0
        if run:
            out.append(run)
    return out


def _decode_plain(units: list[_Unit], data_of) -> list[tuple[int, TensorDelta]]:
    """(order, TensorDelta) of ``units`` (one dtype, each :func:`_plain`), in one call into one buffer
    (:func:`engine_ext.format.codec.decode_cells`)."""
    t0 = units[0].t
    dtype = dtype_by_name(t0.dtype)
    batch = []
    for u in units:
        whole = ((0,) * len(u.t.shape), tuple(u.t.shape))
        cells_ = []
        for p in u.parts:
            d, n = data_of((p.blob, p.offset)), p.positions_length
            box = whole if p.box is None else p.box
            cells_.append(codec.PlainCell(box, p.nnz, p.positions_coder, bytes(d[:n]), p.values_coder, bytes(d[n:])))
        batch.append(codec.PlainTensor(u.t.name, whole[1], cells_))
    out = []
    for u, (pos, vals) in zip(units, codec.decode_cells(batch, dtype)):
        t = u.t
        out.append(
            (
                u.order,
                TensorDelta(
                    t.name,
                    dtype,
                    tuple(t.shape),
                    u.mode,
                    None if pos.numel() == t.numel else pos,  # sorted, unique: every element, in order
                    vals,
                    fpr.parse(t.base_fingerprint) if t.base_fingerprint else None,
                    fpr.parse(t.fingerprint),
                ),
            )
        )
    return out


def _decode_tensor(
    order: int, t: TensorEntry, ps: list[_Part], data_of, bases: Bases | None
) -> list[tuple[int, TensorDelta]]:
    """(order, TensorDelta) per value mode of tensor ``t`` from its parts ``ps`` (in cell order), part by part."""
    base = fpr.parse(t.base_fingerprint) if t.base_fingerprint else None
    if _whole_in_rows(t, ps):  # every cell of a row-cut anchor: its values in order, no positions
        vals = torch.cat([_decode_values(t, p, data_of((p.blob, p.offset))) for p in ps])
        return [
            (
                order,
                TensorDelta(
                    t.name, dtype_by_name(t.dtype), tuple(t.shape), "abs", None, vals, base, fpr.parse(t.fingerprint)
                ),
            )
        ]
    by_mode: dict[str | None, list] = {}
    if bases is not None and any(p.positions_coder in CONTEXT_CODERS for p in ps):
        bases.verify(t.name, base)  # before any context decoding: a wrong base decodes to garbage
    for p in ps:
        by_mode.setdefault(p.mode, []).append((p, _decode_part(t, p, data_of((p.blob, p.offset)), bases)))
    out = []
    for mode, decoded in by_mode.items():
        pos, vals = _join(t, [p for p, _ in decoded], [piece for _, piece in decoded])
        if pos is not None and pos.numel() == t.numel:  # sorted, unique: every element, in order
            pos = None
        out.append(
            (
                order,
                TensorDelta(
                    t.name, dtype_by_name(t.dtype), tuple(t.shape), mode, pos, vals, base, fpr.parse(t.fingerprint)
                ),
            )
        )
    return out


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _whole_in_rows(t: TensorEntry, ps: list[_Part]) -> bool:
    """Whether ``ps`` (in cell order) are every cell of tensor ``t``, cut along dimension 0 only, each
    holding all its elements: their values, concatenated, are the whole tensor's (a chunked
    anchor: the one path that materialises no positions)."""
    return (
        t.chunks is not None
        and len(t.grid or ()) == 1
        and len(ps) == len((t.grid or [[]])[0]) - 1
        and all(p.positions_coder == "all" and p.mode == "abs" for p in ps)
    )
