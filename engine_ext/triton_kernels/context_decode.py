"""Decoding a context-coded part where its base lives: on an accelerator, without copying the base.

Why: a GPU rank's base weights are on the GPU. :func:`engine_ext.format.context.codec.decode`
reads the base of every changed part on the host (numba, ~1 ns per base element per core),
so a GPU rank would first copy its whole changed weights to the host. Here the work is
split by size instead:

* the streams (O(changes), about a byte per change): format 9's ``ctx-rans`` chunks on the base's
  device (``engine_ext.triton_kernels.rans_decode``: the host only plans the part from its header and
  directory, O(chunks), and the part's bytes cross once), format 5's range-coded ``ctx`` streams on the
  host (:func:`~engine_ext.format.context.codec.decode_streams`, then their ranks and steps cross);
* on the base's device, the context pass (``engine_ext.triton_kernels.context_scan``'s
  blocked pass, Triton): ranks -> positions, reading every base element once in place;
* also crossing host -> device: the blocks' run tables (O(rows)) and a class table; device -> host:
  a few scalars per part (the streams' checks, the rank checks, the completeness check). The
  positions and values stay on the device, for the fused apply (:mod:`engine_ext.server.apply_fused`).

The result is bit-exact with the host decoder (``tests/test_context_device.py`` holds the
two side by side on every layout, in Triton's interpreter on the CPU).

It lives here, above :mod:`engine_ext.format`, not in :mod:`engine_ext.format.context`: it is the
composition of this package's two device kernels with the format's host-side pieces (the part's
header, its blocks, the ``ctx-rans`` plan), so it imports both, and the format never imports the
kernels. The reader (:mod:`engine_ext.store.reader`) picks it where a part's base lives on a device.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import torch

from ..errors import IntegrityError
from ..format.context import rans_stage
from ..format.context.codec import StoredPart, decode_streams, held_blocks
from ..format.context.models import EXPONENT, INT, ITEMSIZE, class_lut
from . import context_scan, rans_decode  # modules, not names: tests reload them under Triton's interpreter

_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_INTERPRETER = threading.Lock()  # Triton's interpreter patches triton.language while a kernel runs: one at a time


def _one_at_a_time_if_interpreted():
    """A lock under ``TRITON_INTERPRET=1`` (CPU tests: parts decode in a thread pool), nothing on a device."""
    return _INTERPRETER if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


def _runs(shape, off: int, ext) -> np.ndarray:
    """Run starts (row-major, along the last dimension) of a whole box of ``ext`` stored contiguously at ``off``."""
    rows = int(np.prod(ext[:-1], dtype=np.int64)) if len(ext) > 1 else 1
    return off + np.arange(rows, dtype=np.int64) * int(ext[-1])


def decode(part: StoredPart, base_of, backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted part-local positions int64, steps) of the changes in the blocks the caller holds,
    on the base's device: :func:`engine_ext.format.context.codec.decode` with ``base_of(box)``
    giving the flat raw bits of a box as a torch tensor on its device (None: none of it held;
    :class:`PartlyHeldError`: only some, then each block is asked for alone).

    ``backend``: "triton" (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``) or "torch"
    (the pass in plain torch, any device)."""
    h, bl = part.header()
    K = h.K
    dtype_name = part.dtype_name
    itemsize = ITEMSIZE[dtype_name]
    shift, mask = EXPONENT[dtype_name]
    lut = torch.from_numpy(class_lut(h.edges, dtype_name))
    held = held_blocks(bl, base_of)
    if not held:
        return torch.empty(0, dtype=torch.int64), torch.from_numpy(np.empty(0, INT[itemsize]))
    want = None if -1 in held else np.fromiter(held, np.int64)
    on = next(iter(held.values())).device
    if (
        h.magic == rans_stage.MAGIC and backend == "triton" and rans_decode.serves(on)
    ):  # ctx-rans: streams on the device
        if part.val_data:
            raise IntegrityError("a ctx-rans part has no values segment")
        data = np.frombuffer(part.pos_data, np.uint8)
        p = rans_stage.plan(data, h, bl, INT[itemsize], part.step_tables, want)  # host: O(chunks)
        with _one_at_a_time_if_interpreted():  # the bytes cross once; ranks and steps are born on the device
            ranks, steps = rans_decode.decode(torch.from_numpy(data.copy()).to(on), p)
        all_starts = p.starts
    else:
        st = decode_streams(part, want, (h, bl))
        ranks, steps, all_starts = torch.from_numpy(st.ranks), torch.from_numpy(st.steps), st.starts
    if -1 in held:
        bits = held[-1].reshape(-1)
        if bits.numel() != bl.numel:
            raise IntegrityError("the base of a context-coded part has the wrong size")
        geo = (bl.rows, bl.rows, bl.row_ptr, bl.run)
        starts = all_starts
    else:  # the held blocks, each read alone (on the device), laid end to end
        pieces, read, prow, nrows, run, keep = [], [], [], [], [], []
        at = 0
        for b, got in held.items():
            got = got.reshape(-1)
            if got.numel() != bl.sizes[b]:
                raise IntegrityError("the base of a context-coded block has the wrong size")
            ext = tuple(t - a for a, t in zip(*bl.boxes[b]))
            r = _runs(bl.shape, at, ext)
            read.append(r)
            prow.append(bl.rows[bl.row_ptr[b] : bl.row_ptr[b + 1]])
            nrows.append(r.size)
            run.append(bl.run[b])
            keep.append(b)
            pieces.append(got)
            at += got.numel()
        bits = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        keep = np.asarray(keep)
        geo = (
            np.concatenate(read),
            np.concatenate(prow),
            np.concatenate([[0], np.cumsum(nrows)]).astype(np.int64),
            np.asarray(run, np.int64),
        )
        spans = [(int(all_starts[b, 0]), int(all_starts[b, K])) for b in keep]  # held blocks' changes: slices
        starts = (
            all_starts[keep]
            - all_starts[keep, :1]
            + np.concatenate([[0], np.cumsum(all_starts[keep, K] - all_starts[keep, 0])])[:-1, None]
        )
        ranks, steps = (
            torch.cat([t[a:z] for a, z in spans]) if len(spans) > 1 else t[spans[0][0] : spans[0][1]]
            for t in (ranks, steps)
        )
    if bits.dtype != _TORCH_INT[itemsize]:
        bits = bits.view(_TORCH_INT[itemsize])
    dev = bits.device
    try:
        with _one_at_a_time_if_interpreted():
            pos, src = context_scan.block_positions(bits, geo, shift, mask, lut, ranks, starts, backend=backend)
    except ValueError as e:
        raise IntegrityError(f"context ranks beyond their class (a wrong base, or corrupt): {e}") from None
    return pos, steps.to(dev)[src]
