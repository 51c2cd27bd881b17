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
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import numpy as np
import torch

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
    return int(element_hash(index, bits).sum()) & MASK64


def tensor_fingerprint(t: torch.Tensor) -> int:
    """fp(T) over every element, in chunks, on the tensor's own device."""
    flat = as_bits(t.detach().contiguous()).reshape(-1)
    total = 0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK]
        idx = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64)
        total += hash_sum(idx, part)
    return total & MASK64


def update_fingerprint(fp: int, index: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor) -> int:
    """fp after elements at ``index`` changed from ``old_bits`` to ``new_bits``."""
    return (fp + hash_sum(index, new_bits) - hash_sum(index, old_bits)) & MASK64


def name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


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


def element_hash_np(index: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """h(i, b) for uint64 indices and raw bits zero-extended to uint64 (numpy; see :func:`element_hash`)."""
    return mix64_np((index * np.uint64(GOLDEN)) ^ bits)


def model_fingerprint(tensor_fps: Mapping[str, int] | Iterable[tuple[str, int]]) -> int:
    items = list(tensor_fps.items() if isinstance(tensor_fps, Mapping) else tensor_fps)
    z = np.array([name_key(n) ^ (fp & MASK64) for n, fp in items], dtype=np.uint64)
    return int(mix64_np(z).sum(dtype=np.uint64)) & MASK64


def fmt(fp: int) -> str:
    return f"{fp & MASK64:016x}"


def parse(s: str) -> int:
    if not isinstance(s, str) or len(s) != 16:
        raise ValueError(f"bad fingerprint {s!r}: expected 16 hex digits")
    return int(s, 16)
