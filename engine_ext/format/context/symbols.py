"""What codec v2 codes, per dtype, and the step tables' limits: the facts a manifest is checked against.

Kept apart from :mod:`.models` (which compiles its Golomb laws with numba) so that reading and checking a
manifest never imports numba: vLLM 0.32 CPU's plugin processes read manifests, and its kernel-override scan
of ``sys.modules`` dies on numba's llvmlite (tests/test_compat.py holds the plugin's imports clear of it).
"""

from __future__ import annotations

MAX_STEP_TABLES = 64  # step tables per dtype in a manifest
STEP_TABLE_MIN = 512  # changes behind one step table (rarer exponents share their neighbours')
EXACT = 8  # zigzag steps below this are symbols of their own; above, one symbol per power of two

# exponent field of each float dtype: (shift, mask) of the raw bits
EXPONENT = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float8_e4m3fn": (3, 0xF),
    "float8_e5m2": (2, 0x1F),
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


def supports(dtype_name: str) -> bool:
    """Whether codec v2 codes this dtype (a float whose exponent field it conditions on)."""
    return dtype_name in EXPONENT


def alphabet(dtype_name: str) -> int:
    """Step symbols of a dtype: EXACT small ones and one per power of two above."""
    return EXACT + 8 * ITEMSIZE[dtype_name] - 3
