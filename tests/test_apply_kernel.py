"""The Triton apply kernel against its torch reference, row by row (the Liger-style mirror).

Random segments (boxes of 0-4-d checkpoint tensors mapped into packed, transposed,
padded destinations; sparse and dense; absolute and relative; every width) become
kernel table rows through ``engine_ext.server.apply_fused``; the kernel (in Triton's
interpreter on the CPU) and ``reference_apply`` then run on copies of the same
destination and must agree bit for bit: the written storage, the undo slots, the
fingerprint change and the count. Rollback restores the storage.
"""
from __future__ import annotations


import pytest
import torch

from engine_ext.format import dtypes
from engine_ext.server.maps import validate

from test_kernels import make_case  # noqa: E402  (tests/ is on sys.path via conftest)


def test_kernel_is_a_leaf():
    """The kernel module imports torch and Triton only (nothing of engine_ext)."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "engine_ext" / "triton_kernels" / "apply_kernel.py"
    mods = {a.name.split(".")[0] for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Import) for a in n.names}
    mods |= {(n.module or "").split(".")[0] for n in ast.walk(ast.parse(src.read_text()))
             if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert mods <= {"__future__", "torch", "triton"}, mods
    assert not [n for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 0]


@pytest.mark.parametrize("seed", range(24))
def test_kernel_equals_reference(interp, seed):
    K = interp
    from engine_ext.server.apply_fused import _row

    d = [x for x in dtypes.BY_NAME.values()][seed % len(dtypes.BY_NAME)]
    td, m, buf = make_case(1000 + seed, d, ndim=min(4, seed % 5), dense=seed % 3 == 0)
    segs, _ = validate([td], {"t": m})
    for s in segs:
        if s.n == 0:
            continue
        width = d.bits
        pos = td.positions
        row = _row(s, pos, td.values, 0, check=pos is not None)
        base = s.storage.clone()
        # the kernel, on the real storage
        table = torch.tensor([row], dtype=torch.int64)
        blocks = K.blocks_for([s.n], "cpu")
        assert int(K.check_positions(table, blocks).sum()) == 0
        undo = torch.zeros(s.n, dtype=K.INT_OF_WIDTH[width])
        acc = K.apply_segments(table, blocks, undo, width)
        got = s.storage.clone()
        # the reference, on a copy of the old storage
        ref = base.clone()
        old, fp, count = K.reference_apply(row, ref, pos, td.values, width)
        assert torch.equal(got, ref), (seed, d.name)
        assert int(acc[0, 0]) & ((1 << 64) - 1) == fp and int(acc[0, 1]) == count
        assert torch.equal(undo, old)  # slot q: the old bits of item q (zero where q is outside the box)
        K.rollback_segments(table, blocks, undo, width)
        assert torch.equal(s.storage, base)
