"""The dtypes a checkpoint holds, and the bit views the codec and kernels work on.

Every element is handled as its raw bits, viewed as a signed integer of the same
width, so that every bit pattern (signed zeros, subnormals, infinities, NaN
payloads) round-trips exactly.

*Ordered bit space*: for floats, ``key(bits)`` maps the sign-magnitude encoding to
a two's-complement integer whose order is the float order (``-0.0 -> -1``,
``+0.0 -> 0``; adjacent floats have adjacent keys). A *relative step* is
``key(new) - key(old)`` wrapping in the dtype's width, so any pair of values is
encodable and steps of successive versions add up (mod 2^width). For integer
dtypes the key is the value itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str  # safetensors-style name used in manifests, e.g. "bfloat16"
    safetensors: str  # safetensors header code, e.g. "BF16"
    torch: torch.dtype
    bits: int  # 8, 16, 32 or 64
    is_float: bool

    @property
    def int_view(self) -> torch.dtype:
        """Signed integer dtype of the same width, used to read and write raw bits."""
        return _INT_OF_WIDTH[self.bits]

    @property
    def itemsize(self) -> int:
        return self.bits // 8


_INT_OF_WIDTH = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}

# The one fact of each dtype that torch does not hold: its safetensors header code (name, width and kind are torch's)
_SAFETENSORS_CODES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def _dtype(t: torch.dtype, safetensors: str) -> DType:
    """``t`` as a DType: its manifest name is torch's (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return DType(str(t).removeprefix("torch."), safetensors, t, t.itemsize * 8, t.is_floating_point)


_ALL = [_dtype(t, code) for t, code in _SAFETENSORS_CODES.items()]
BY_NAME = {d.name: d for d in _ALL}
BY_TORCH = {d.torch: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL}


def dtype_by_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(BY_NAME)}") from None


def dtype_of(t: torch.Tensor) -> DType:
    try:
        return BY_TORCH[t.dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {t.dtype}") from None


SERVED_DTYPES = ("bfloat16", "float16", "float32")


def served_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A served dtype given as a torch dtype or its name (``"bfloat16"``, ``"bf16"``...); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        d = dtype
    else:
        d = getattr(
            torch,
            {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
                str(dtype), str(dtype)
            ),
            None,
        )
    if d is not None and (
        not isinstance(d, torch.dtype) or BY_TORCH.get(d) is None or BY_TORCH[d].name not in SERVED_DTYPES
    ):
        raise ValueError(f"served dtype must be one of {SERVED_DTYPES} (or None: as held), got {dtype!r}")
    return d


def served_as(d: DType, dtype: torch.dtype | None) -> DType:
    """The dtype a tensor held as ``d`` is published in, for served ``dtype`` (:func:`to_served`'s rule)."""
    return BY_TORCH[dtype] if dtype is not None and d.is_float and d.bits >= 16 else d


def to_served(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` cast to the served ``dtype``, or ``t`` itself when nothing is to be cast: integer
    and bool tensors, 8-bit floats (already quantised bytes; their scales come with them,
    so an fp8 state dict is published with ``dtype=None``), a tensor already in ``dtype``,
    or ``dtype`` None (as held)."""
    if dtype is None or t.dtype == dtype or not t.is_floating_point() or t.element_size() < 2:
        return t
    return t.detach().to(dtype)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as a signed integer tensor of the same width (a view)."""
    d = dtype_of(t)
    if t.dtype == d.int_view:
        return t
    if t.dtype == torch.bool:
        return t.view(torch.uint8).view(torch.int8)
    return t.view(d.int_view)


def to_key(bits: torch.Tensor, is_float: bool) -> torch.Tensor:
    """Map raw bits (signed int view) to the ordered key space. An involution for floats."""
    if not is_float:
        return bits
    magnitude = torch.iinfo(bits.dtype).max  # 0x7f.., flips all but the sign bit
    return torch.where(bits < 0, bits ^ magnitude, bits)


from_key = to_key  # the float map is its own inverse; the integer map is the identity


def step_between(old_bits: torch.Tensor, new_bits: torch.Tensor, is_float: bool) -> torch.Tensor:
    """Relative step key(new) - key(old), wrapping in the dtype's width."""
    return to_key(new_bits, is_float) - to_key(old_bits, is_float)


def apply_step(old_bits: torch.Tensor, step: torch.Tensor, is_float: bool) -> torch.Tensor:
    """Inverse of :func:`step_between`: the new bits from the old bits and the step."""
    return from_key(to_key(old_bits, is_float) + step.to(old_bits.dtype), is_float)
