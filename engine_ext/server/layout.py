"""Learn where each checkpoint element lands at runtime by watching the engine's own loader.

:func:`probe_layout` runs the engine's loader (``load(name, tensor)``, e.g. vLLM's
``model.load_weights([(name, t)])``) on a *probe*: an uninitialised tensor of the
checkpoint's shape and dtype whose storage we know. A ``TorchFunctionMode``
intercepts every write into the module's parameters and buffers (``copy_``,
``__setitem__``, ``fill_``, any in-place op, ``.data =``) and suppresses it, so the
weights are untouched; ``.contiguous()`` and ``.clone()`` of a view of the probe give that view
back (they keep every element at its index). A ``copy_`` / ``__setitem__`` whose source is a view of the
probe's storage with the same dtype and shape is an affine map: the source's storage
offset and strides give a box in checkpoint coordinates, the destination's give the
parameter storage offset and strides, together a :class:`~engine_ext.server.maps.Piece`.
A copy that widens the dtype exactly (bf16 into a float32 parameter, as vLLM's sgl CPU
GEMM path keeps biases) is such a map too, a *converting* one
(:class:`~engine_ext.server.maps.Conversion`). Anything else that writes a parameter
(narrowed, computed, quantised, concatenated data; scatter-like ops; rebinding
``.data``) makes the tensor :class:`~engine_ext.server.maps.Unmappable`, with the reason. Constant fills (padding) are
not checkpoint data and are ignored. No model-specific tables.

A ``TorchFunctionMode`` sees only the thread it is entered in, and some loaders fan their
writes out to a thread pool (SGLang's DeepSeek loader): writes the mode never saw would put
the probe's uninitialised bytes into the live weights. While a loader is probed, a
``ThreadPoolExecutor`` it uses runs each task in the probing thread (:func:`_loader_inline`),
and a loader that starts a thread of its own is stopped before the thread runs (the tensor is
then unmappable: reloaded densely).
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.overrides import TorchFunctionMode

from ..format.dtypes import DType, dtype_by_name
from .maps import EXACT_WIDENINGS, Piece, TensorMap, Unmappable, row_major_strides

_CONSTANT_WRITES = {"fill_", "zero_"}
# Copies that keep every element at its index (GPT-OSS's expert loader transposes, then ``.contiguous()``):
# under the probe they return the probe's view itself, whose strides say where each element came from. A
# loader that then writes into that "copy" writes into the probe, which the probe refuses (unmappable).
_IDENTITY_COPIES = {"contiguous", "clone"}


class _Unmappable(Exception):
    pass


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _norm_dims(shape, strides, cshape, cstrides):
    """Source view dims as (checkpoint dim, extent, index into view dims, split factor inner) lists.

    Size-1 view dims are dropped; a view dim that spans several whole checkpoint dims
    (a reshape of contiguous rows) is split into them.
    """
    out = []
    for j, (e, s) in enumerate(zip(shape, strides)):
        if e == 1:
            continue
        inner = 1  # elements of this view dim per step of the current sub-dim
        while True:
            cands = [d for d in range(len(cshape)) if cstrides[d] == s and cshape[d] > 1]
            if not cands:
                raise _Unmappable(f"source view stride {s} matches no checkpoint dimension")
            d = cands[0]
            if e <= cshape[d]:
                out.append((d, e, j, inner))
                break
            if e % cshape[d]:
                raise _Unmappable("source view dimension does not split into checkpoint dimensions")
            out.append((d, cshape[d], j, inner))
            inner *= cshape[d]
            e //= cshape[d]
            s = cstrides[d] * cshape[d]
    return out


def piece_from_views(src: torch.Tensor, probe: torch.Tensor, dst: torch.Tensor) -> Piece:
    """The Piece for ``dst.copy_(src)`` with ``src`` a view of ``probe`` (same shape and dtype)."""
    cshape = tuple(probe.shape)
    cstrides = row_major_strides(cshape)
    first = src.storage_offset() - probe.storage_offset()
    if src.numel() == 0:
        raise _Unmappable("empty copy")
    start = []
    rem = first
    for cs in cstrides:
        start.append(rem // cs if cs else 0)
        rem = rem % cs if cs else rem
    stop = [a + 1 for a in start]
    dstrides = [0] * len(cshape)
    used = set()
    for d, e, j, inner in _norm_dims(src.shape, src.stride(), cshape, cstrides):
        if d in used:
            raise _Unmappable("source view uses a checkpoint dimension twice")
        used.add(d)
        stop[d] = start[d] + e
        if stop[d] > cshape[d]:
            raise _Unmappable("source view leaves the checkpoint box")
        dstrides[d] = dst.stride(j) * inner
    if math.prod(b - a for a, b in zip(start, stop)) != src.numel():
        raise _Unmappable("source view is not a box of the checkpoint tensor")
    return Piece(dst, tuple(start), tuple(stop), dst.storage_offset(), tuple(dstrides))


class _Probe(TorchFunctionMode):
    """Record (and suppress) writes into tracked storages during one loader call."""

    def __init__(self, tracked: dict, probe: torch.Tensor):
        super().__init__()
        self.tracked = tracked  # storage key -> (param name, param)
        self.probe = probe
        self.pkey = _storage_key(probe)
        self.pieces: list[Piece] = []
        self.error: str | None = None
        self.targets: set[int] = set()  # storages the loader wrote (mappable or not)

    def _fail(self, reason: str):
        if self.error is None:
            self.error = reason

    def _record(self, dst: torch.Tensor, src, op: str):
        name, param = self.tracked[_storage_key(dst)]
        if not isinstance(src, torch.Tensor):
            return  # a constant written into a parameter (padding): not checkpoint data
        if src.numel() == 0:
            return
        if _storage_key(src) != self.pkey:
            return self._fail(
                f"{op} into {name} from data that is not a view of the loaded tensor (converted, computed or concatenated)"
            )
        if src.dtype != dst.dtype and (src.dtype, dst.dtype) not in EXACT_WIDENINGS:
            return self._fail(f"{op} into {name} converts {src.dtype} -> {dst.dtype}")
        if tuple(src.shape) != tuple(dst.shape):
            return self._fail(f"{op} into {name} broadcasts {tuple(src.shape)} -> {tuple(dst.shape)}")
        try:
            pc = piece_from_views(src, self.probe, dst)
        except _Unmappable as e:
            return self._fail(f"{op} into {name}: {e}")
        pc.dest = param  # the parameter itself; offsets are in its storage
        self.pieces.append(pc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (
            name in _IDENTITY_COPIES
            and args
            and isinstance(args[0], torch.Tensor)
            and _storage_key(args[0]) == self.pkey
        ):
            return args[
                0
            ]  # the same elements at the same indices: the view itself keeps the map (see _IDENTITY_COPIES)
        if (
            name == "__set__"
            and getattr(getattr(func, "__self__", None), "__name__", None) == "data"
            and isinstance(args[0], torch.Tensor)
            and _storage_key(args[0]) in self.tracked
        ):
            self._fail(f"loader rebinds {self.tracked[_storage_key(args[0])][0]}.data")
            return None
        inplace = (
            (name.endswith("_") and not name.startswith("_"))
            or name == "__setitem__"
            or (name.startswith("__i") and name.endswith("__"))
        )
        out = kwargs.get("out")
        target = (
            out
            if isinstance(out, torch.Tensor)
            else (args[0] if inplace and args and isinstance(args[0], torch.Tensor) else None)
        )
        if target is not None and target.untyped_storage().nbytes() > 0:
            key = _storage_key(target)
            if key in self.tracked:
                self.targets.add(key[2])
                if name == "copy_":
                    self._record(args[0], args[1], name)
                elif name == "__setitem__":
                    self._record(args[0][args[1]], args[2], name)
                elif name not in _CONSTANT_WRITES:
                    self._fail(f"{name} writes {self.tracked[key][0]}")
                return args[0] if out is None else out
            if key == self.pkey:
                self._fail(f"loader modifies the loaded tensor in place ({name})")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _loader_inline():
    """While the probing thread runs the loader: a thread pool's tasks run in that thread (where the
    probe's mode sees their writes), and starting a thread raises before it runs. Other threads of the
    process are left alone."""
    me = threading.get_ident()
    submit, start = ThreadPoolExecutor.submit, threading.Thread.start

    def inline_submit(self, fn, /, *args, **kwargs):
        if threading.get_ident() != me:
            return submit(self, fn, *args, **kwargs)
        f = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the task's failure is the future's, as in a pool
            f.set_exception(e)
        return f

    def refused_start(self):
        if threading.get_ident() != me:
            return start(self)
        # Never a request's answer: the probe catches it (the tensor becomes Unmappable, with this reason)
        raise RuntimeError("the loader starts a thread, whose writes the layout probe cannot see")

    ThreadPoolExecutor.submit, threading.Thread.start = inline_submit, refused_start
    try:
        yield
    finally:
        ThreadPoolExecutor.submit, threading.Thread.start = submit, start


def tracked_storages(module: torch.nn.Module) -> dict:
    """Storage key -> (name, tensor) for every parameter and buffer with storage."""
    out: dict[tuple, tuple[str, torch.Tensor]] = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    ):
        if t.untyped_storage().nbytes() > 0:
            out.setdefault(_storage_key(t), (name, t))
    return out


def _dedupe(name: str, shape, pieces: list[Piece]) -> list[Piece]:
    """Drop repeated identical writes; later copies of already-held elements don't count."""
    out: list[Piece] = []
    seen = set()
    for p in pieces:
        key = (_storage_key(p.dest), p.start, p.stop, p.offset, p.strides)
        if key in seen:
            continue
        seen.add(key)
        for q in out:
            if not q.count_fingerprint:
                continue
            inter = all(max(a, c) < min(b, d) for a, b, c, d in zip(p.start, p.stop, q.start, q.stop))
            if inter:
                inside = all(c <= a and b <= d for a, b, c, d in zip(p.start, p.stop, q.start, q.stop))
                if not inside:
                    raise _Unmappable("copies overlap partially in checkpoint coordinates")
                p.count_fingerprint = False
                break
        out.append(p)
    return out


def probe_layout(module: torch.nn.Module, load, names_shapes_dtypes, device="cpu") -> dict:
    """Map every checkpoint tensor to :class:`TensorMap` or :class:`Unmappable`, writing nothing.

    ``names_shapes_dtypes``: iterable of (name, shape, dtype) with dtype a
    :class:`~engine_ext.format.dtypes.DType`, its name, or a torch dtype. ``device``: where the
    probe tensor lives (an uninitialised ``torch.empty``, so it costs no page faults on
    the CPU); choose the device the engine's loader receives checkpoint tensors on.
    """
    tracked = tracked_storages(module)
    out: dict = {}
    for name, shape, dt in names_shapes_dtypes:
        d = _as_dtype(dt)
        shape = tuple(int(s) for s in shape)
        probe = torch.empty(shape, dtype=d.torch, device=device)
        mode = _Probe(tracked, probe)
        try:
            with torch.no_grad(), _loader_inline(), mode:
                load(name, probe)
        except Exception as e:  # noqa: BLE001 - the loader's own failure makes the tensor unmappable
            mode._fail(f"loader raised {type(e).__name__}: {e}")
        if mode.error is not None:
            out[name] = Unmappable(name, mode.error, tuple(sorted(mode.targets)))
            continue
        try:
            out[name] = TensorMap(name, shape, d, _dedupe(name, shape, mode.pieces))
        except _Unmappable as e:
            out[name] = Unmappable(name, str(e), tuple(sorted(mode.targets)))
    return out


def _as_dtype(dt) -> DType:
    from ..format.dtypes import BY_TORCH

    if isinstance(dt, DType):
        return dt
    if isinstance(dt, torch.dtype):
        return BY_TORCH[dt]
    return dtype_by_name(dt)
