"""Decoding a context-coded part where its base lives: on an accelerator, without copying the base.

Why: a GPU rank's base weights are on the GPU. :func:`engine_ext.format.context_codec.decode`
reads the base of every changed part on the host (numba, ~1 ns per base element per core),
so a GPU rank would first copy its whole changed weights to the host. Here the work is
split by size instead:

* on the host, the range-coded streams (:func:`~engine_ext.format.context_codec.decode_streams`:
  the ranks and steps, O(changes), a few bytes per change);
* on the base's device, the context pass (``engine_ext.triton_kernels.context_scan``'s
  blocked pass, Triton): ranks -> positions, reading every base element once in place;
* what crosses host -> device: the ranks (int64) and steps (the dtype's width) of the
  changes, the blocks' run tables (O(rows)) and a class table; device -> host: two
  scalars per part (the rank checks, the completeness check). The positions and values
  stay on the device, for the fused apply (:mod:`engine_ext.server.apply_fused`).

The result is bit-exact with the host decoder (``tests/test_context_device.py`` holds the
two side by side on every layout, in Triton's interpreter on the CPU).
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import torch

from ..errors import IntegrityError, PartlyHeldError
from .context_codec import CUT_BLOCK, decode_streams
from .context_models import EXPONENT, INT, ITEMSIZE, class_lut

_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_INTERPRETER = threading.Lock()  # Triton's interpreter patches triton.language while a kernel runs: one at a time


def _one_at_a_time_if_interpreted():
    """A lock under ``TRITON_INTERPRET=1`` (CPU tests: parts decode in a thread pool), nothing on a device."""
    return _INTERPRETER if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


def _runs(shape, off: int, ext) -> np.ndarray:
    """Run starts (row-major, along the last dimension) of a whole box of ``ext`` stored contiguously at ``off``."""
    rows = int(np.prod(ext[:-1], dtype=np.int64)) if len(ext) > 1 else 1
    return off + np.arange(rows, dtype=np.int64) * int(ext[-1])


def decode(dtype_name: str, tensor_shape, box, pos_data: bytes, val_data: bytes, nnz: int, base_of,
           tables: list[bytes], backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted part-local positions int64, steps) of the changes in the blocks the caller holds,
    on the base's device: :func:`engine_ext.format.context_codec.decode` with ``base_of(box)``
    giving the flat raw bits of a box as a torch tensor on its device (None: none of it held;
    :class:`PartlyHeldError`: only some, then each block is asked for alone).

    ``backend``: "triton" (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``) or "torch"
    (the pass in plain torch, any device)."""
    from ..triton_kernels.context_scan import block_positions

    st = decode_streams(dtype_name, tensor_shape, box, pos_data, val_data, nnz, tables)
    bl, K = st.bl, st.K
    itemsize = ITEMSIZE[dtype_name]
    shift, mask = EXPONENT[dtype_name]
    lut = torch.from_numpy(class_lut(st.edges, dtype_name))
    try:
        whole = base_of(((0,) * len(bl.shape), bl.shape))
    except PartlyHeldError:
        whole = False
    if whole is None:
        return torch.empty(0, dtype=torch.int64), torch.from_numpy(np.empty(0, INT[itemsize]))
    if whole is not False:
        bits = whole.reshape(-1)
        if bits.numel() != bl.numel:
            raise IntegrityError("the base of a context-coded part has the wrong size")
        geo = (bl.rows, bl.rows, bl.row_ptr, bl.run)
        ranks, starts, steps = st.ranks, st.starts, st.steps
    else:  # the held blocks, each read alone (on the device), laid end to end
        pieces, read, prow, nrows, run, keep = [], [], [], [], [], []
        at = 0
        for b, sub in enumerate(bl.boxes):
            try:
                got = base_of(sub)
            except PartlyHeldError as e:
                raise IntegrityError(f"{e}: {CUT_BLOCK}") from None
            if got is None:
                continue
            got = got.reshape(-1)
            if got.numel() != bl.sizes[b]:
                raise IntegrityError("the base of a context-coded block has the wrong size")
            ext = tuple(t - a for a, t in zip(*sub))
            r = _runs(bl.shape, at, ext)
            read.append(r)
            prow.append(bl.rows[bl.row_ptr[b]:bl.row_ptr[b + 1]])
            nrows.append(r.size)
            run.append(bl.run[b])
            keep.append(b)
            pieces.append(got)
            at += got.numel()
        if not pieces:
            return torch.empty(0, dtype=torch.int64), torch.from_numpy(np.empty(0, INT[itemsize]))
        bits = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        keep = np.asarray(keep)
        geo = (np.concatenate(read), np.concatenate(prow), np.concatenate([[0], np.cumsum(nrows)]).astype(np.int64),
               np.asarray(run, np.int64))
        sel = np.concatenate([np.arange(st.starts[b, 0], st.starts[b, K]) for b in keep]).astype(np.int64)
        starts = st.starts[keep] - st.starts[keep, :1] + np.concatenate([[0], np.cumsum(st.starts[keep, K] - st.starts[keep, 0])])[:-1, None]
        ranks, steps = st.ranks[sel], st.steps[sel]
    if bits.dtype != _TORCH_INT[itemsize]:
        bits = bits.view(_TORCH_INT[itemsize])
    dev = bits.device
    try:
        with _one_at_a_time_if_interpreted():
            pos, src = block_positions(bits, geo, shift, mask, lut, torch.from_numpy(ranks), starts, backend=backend)
    except ValueError as e:
        raise IntegrityError(f"context ranks beyond their class (a wrong base, or corrupt): {e}") from None
    return pos, torch.from_numpy(steps).to(dev)[src]
