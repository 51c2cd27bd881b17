"""Write a decoded delta into live parameters, in place, in O(changed elements).

:func:`apply_delta` checks a list of :class:`~engine_ext.format.delta.TensorDelta` against this
rank's maps (:mod:`engine_ext.server.maps`) before any write, then runs one of two executors
with identical, bit-exact semantics: the torch path (:mod:`engine_ext.server.apply_torch`, the
reference and the CPU default) or the fused Triton kernel (:mod:`engine_ext.server.apply_fused`,
the default for CUDA tensors, one launch per dtype width). In the same pass it keeps the
old bits (an undo log, for an all-or-nothing multi-tensor update) and the change of each
tensor's fingerprint (so verification needs no extra pass over the model).
"""

from __future__ import annotations

import torch

from ..format.delta import TensorDelta
from .apply_torch import apply_torch
from .maps import ApplyResult, UndoLog, check_positions, validate


def apply_delta(deltas: list[TensorDelta], maps: dict, *, undo: bool = True, backend: str = "auto") -> ApplyResult:
    """Write ``deltas`` through ``maps`` in place; all inputs are validated before any write.

    ``fingerprint_delta[name]`` is ``sum h(i, new) - h(i, old)`` over the elements written
    into counted pieces (``i`` the checkpoint flat index), so a rank that holds the whole
    tensor gets ``fp_new - fp_old``. Deltas whose tensors this rank does not hold need a
    map with no pieces. ``backend``: "auto" (Triton for CUDA destinations, torch
    otherwise), "torch" or "triton" (on CPU tensors only under ``TRITON_INTERPRET=1``).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}")
    segs, checks = validate(deltas, maps)
    names = [td.name for td in deltas]
    if backend == "auto":
        backend = "triton" if segs and all(s.storage.is_cuda for s in segs) and _triton_ok() else "torch"
    with torch.no_grad():
        if backend == "torch":
            check_positions([deltas[i] for i in checks])
            fp, written, log = apply_torch(segs, names, undo)
            parts = [log] if log is not None else []
        else:
            from .apply_fused import apply_fused

            fp, written, parts = apply_fused(segs, names, undo, [deltas[i] for i in checks])
    return ApplyResult(fp, written, UndoLog(parts) if undo else None)


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401 - optional: present where a GPU build of torch is
    except Exception:  # noqa: BLE001 - a broken Triton install (not only a missing one) means the torch path
        return False
    return True


def decode_gaps(gaps: torch.Tensor) -> torch.Tensor:
    """Absolute positions from gaps (``gaps[0] = pos[0]``, ``gaps[k] = pos[k] - pos[k-1]``), on the gaps' device."""
    return torch.cumsum(gaps.to(torch.int64), 0)
