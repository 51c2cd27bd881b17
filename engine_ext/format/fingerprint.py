"""Per-tensor fingerprints that can be kept current in O(changed elements).

``fp(T) = sum_i h(i, bits_i) mod 2^64`` over the flat (row-major, checkpoint
layout) index ``i`` and the element's raw bits zero-extended to 64 bits, with

    h(i, b) = mix64((i * 0x9E3779B97F4A7C15) xor b)
    mix64   = the SplitMix64 finaliser (shifts 30, 27, 31; multipliers
              0xBF58476D1CE4E5B9, 0x94D049BB133111EB)

so changing element ``i`` from ``a`` to ``b`` changes ``fp`` by ``h(i,b) - h(i,a)``.
A model fingerprint combines tensors by name:
``sum_t mix64(name_key(t) xor fp(t)) mod 2^64`` with ``name_key`` the first 8
bytes (little endian) of SHA-256 of the UTF-8 name. Fingerprints are written as 16
lower-case hex digits. All arithmetic is int64 with two's-complement wrap-around,
which torch (CPU and CUDA) and Triton both do.

Fingerprinting reads the whole model (anchors, start-up checks, rebuilt bases), so on the
CPU it runs as one fused, vectorised loop on every core (numba: :func:`range_fingerprint`,
:func:`hash_sum`, :func:`box_fingerprint`; ~2 G elements/s per AVX-512 core, against
~0.01-0.02 G for the torch reference, which materialises every intermediate). The torch
functions (:func:`element_hash`) are the reference and the path for other devices.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from . import kernel_module
from .dtypes import as_bits

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
CHUNK = 1 << 22  # elements hashed at a time: bounds temporary memory


def _s64(u: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed types)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shr(z, 30)
    z = z * _s64(MIX1)
    z = z ^ _shr(z, 27)
    z = z * _s64(MIX2)
    return z ^ _shr(z, 31)


def zero_extend(bits: torch.Tensor) -> torch.Tensor:
    """Raw bits (signed int view of any width) as unsigned values in int64."""
    width = torch.iinfo(bits.dtype).bits
    b = bits.to(torch.int64)
    return b if width == 64 else b & ((1 << width) - 1)


def element_hash(index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """h(i, b) for int64 flat indices and raw bits (any signed int view)."""
    return mix64((index.to(torch.int64) * _s64(GOLDEN)) ^ zero_extend(bits))


def hash_sum(index: torch.Tensor, bits: torch.Tensor) -> int:
    """sum of h(i, b) mod 2^64, as a Python int in [0, 2^64)."""
    if index.numel() == 0:
        return 0
    kernels = _kernels() if bits.device.type == "cpu" else None
    if kernels is not None:
        return int(kernels.pairs(index.contiguous().numpy(), _unsigned(bits.contiguous()), *_U64))
    return int(element_hash(index, bits).sum()) & MASK64


def range_fingerprint(flat_bits: torch.Tensor, start: int = 0) -> int:
    """sum of h(start + j, flat_bits[j]) mod 2^64: the fingerprint of a run of consecutive elements."""
    flat_bits = flat_bits.reshape(-1)
    kernels = _kernels() if flat_bits.device.type == "cpu" else None
    if kernels is not None:
        return int(kernels.run(_unsigned(flat_bits.contiguous()), start, _chunks(flat_bits.numel()), *_U64))
    total = 0
    for a in range(0, flat_bits.numel(), CHUNK):
        part = flat_bits[a : a + CHUNK]
        idx = torch.arange(start + a, start + a + part.numel(), device=part.device, dtype=torch.int64)
        total += int(element_hash(idx, part).sum())
    return total & MASK64


def buffer_fingerprint(data, itemsize: int, start: int = 0) -> int:
    """sum of h(start + j, element j) mod 2^64 over a buffer of raw little-endian elements of
    ``itemsize`` bytes, on the calling thread only: a writer fingerprints what it writes, a
    few MB at a time, while the bytes are in cache (its threads already use every core)."""
    arr = np.frombuffer(data, dtype=_UNSIGNED[itemsize])
    kernels = _kernels()
    if kernels is not None:
        return int(kernels.run1(arr, start, *_U64))
    return range_fingerprint(torch.from_numpy(arr.view(_SIGNED[itemsize]).copy()), start)


def tensor_fingerprint(t: torch.Tensor) -> int:
    """fp(T) over every element, on the tensor's own device (all cores on the CPU)."""
    return range_fingerprint(as_bits(t.detach().contiguous()).reshape(-1))


def box_fingerprint(bits: torch.Tensor, start, shape) -> int:
    """sum of h(i, b) over a box of a tensor of ``shape``: ``bits`` holds the box's raw bits (any
    strides, the box's own shape) and ``start`` its first corner; ``i`` is the row-major flat
    index in ``shape``. What a rank holds of a tensor (a shard, a padded block) is such a box."""
    ext, shape, start = tuple(bits.shape), tuple(int(x) for x in shape), tuple(int(x) for x in start)
    if len(ext) <= 1:
        return range_fingerprint(bits, start[0] if start else 0)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    rows = np.zeros(ext[:-1], dtype=np.int64) + start[-1]  # flat index of each row's first element
    for d in range(len(ext) - 1):
        coord = (np.arange(ext[d], dtype=np.int64) + start[d]) * strides[d]
        rows += coord.reshape([-1 if e == d else 1 for e in range(len(ext) - 1)])
    values = bits.contiguous().reshape(-1, ext[-1])
    kernels = _kernels() if values.device.type == "cpu" else None
    if kernels is not None:
        return int(kernels.rows(_unsigned(values).reshape(values.shape), rows.reshape(-1), *_U64))
    idx = torch.from_numpy(rows.reshape(-1, 1) + np.arange(ext[-1], dtype=np.int64)).to(values.device)
    return hash_sum(idx.reshape(-1), values.reshape(-1))


def update_fingerprint(fp: int, index: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor) -> int:
    """fp after elements at ``index`` changed from ``old_bits`` to ``new_bits``."""
    return (fp + hash_sum(index, new_bits) - hash_sum(index, old_bits)) & MASK64


def name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


_U64 = (np.uint64(GOLDEN), np.uint64(MIX1), np.uint64(MIX2))  # the constants, as the kernels take them
_NP_MIX = [(np.uint64(30), np.uint64(MIX1)), (np.uint64(27), np.uint64(MIX2))]
_NP_LAST = np.uint64(31)


def mix64_np(z: np.ndarray) -> np.ndarray:
    """mix64 on a uint64 numpy array, in place (logical shifts; the CPU's fast path)."""
    t = np.empty_like(z)
    for shift, mul in _NP_MIX:
        np.right_shift(z, shift, out=t)
        z ^= t
        z *= mul
    np.right_shift(z, _NP_LAST, out=t)
    z ^= t
    return z


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _unsigned(bits: torch.Tensor) -> np.ndarray:
    """A CPU tensor's raw bits as an unsigned numpy array (zero-extension is then a plain widening)."""
    return bits.numpy().view(_UNSIGNED[bits.element_size()])


def _chunks(n: int) -> int:
    """Pieces a run is cut into for the threads: several per thread, each at least 64 Ki elements."""
    return max(1, min(256, n >> 16))


def _kernels():
    return kernel_module("fingerprint_kernels")


def model_fingerprint(tensor_fps: Mapping[str, int] | Iterable[tuple[str, int]]) -> int:
    items = list(tensor_fps.items() if isinstance(tensor_fps, Mapping) else tensor_fps)
    keys = name_keys([n for n, _ in items])
    return combined(keys, np.array([fp & MASK64 for _, fp in items], dtype=np.uint64))


def name_keys(names: list[str]) -> np.ndarray:
    """Each name's :func:`name_key`, as uint64 (a reader checking both model fingerprints makes them once)."""
    return np.array([name_key(n) for n in names], dtype=np.uint64)


def combined(keys: np.ndarray, fps: np.ndarray) -> int:
    """The model fingerprint of tensors with name keys ``keys`` and fingerprints ``fps`` (uint64 each)."""
    return int(mix64_np(keys ^ fps).sum(dtype=np.uint64)) & MASK64


def parse_all(fps: Sequence[str | None]) -> np.ndarray:
    """Fingerprints written as 16 lower-case hex digits each, as uint64, at once; raises ValueError on the
    first that :func:`parse` refuses (one regex over them joined, not one per fingerprint)."""
    joined = "".join(s if isinstance(s, str) and len(s) == 16 else "?" for s in fps)
    if len(joined) != 16 * len(fps) or not _HEX_RUN.fullmatch(joined):
        for s in fps:
            parse(s)  # raises, naming it
    return np.frombuffer(bytes.fromhex(joined), ">u8").astype(np.uint64)


def fmt(fp: int) -> str:
    return f"{fp & MASK64:016x}"


_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX_RUN = re.compile(r"[0-9a-f]*")


def parse(s: object) -> int:
    """The fingerprint written as 16 lower-case hex digits (exactly: ``int(s, 16)`` alone would also
    take a sign, spaces, underscores, a ``0x`` or upper case, and "-000000000000001" as -1)."""
    if not isinstance(s, str) or not _HEX16.fullmatch(s):
        raise ValueError(f"bad fingerprint {s!r:.40}: expected 16 lower-case hex digits")
    return int(s, 16)
