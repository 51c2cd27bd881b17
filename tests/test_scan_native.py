"""The compiled context pass (engine_ext/format/context/scan_native.c) against its definition and the numba
reference, in every variant this CPU runs (avx512bw, avx2, scalar): every float dtype, runs that end inside a
64-element chunk, 1 to 16 classes, every element listed, and hostile input (ranks beyond their class, negative,
repeated, at int64's limits; arrays that do not fit each other), which must come out short or refused, never read out of bounds."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine_ext import settings
from engine_ext.errors import IntegrityError
from engine_ext.format.context import blocks as cb, models as cm, scan_kernels as ck
from engine_ext.format.dtypes import as_bits
from test_context_codec import FLOATS, _model_scan, _name, _pair
from test_context_device import _random_ranks

NATIVE = ck._scan_native.ISAS if ck._scan_native is not None else ()
PASSES = ["numba", *NATIVE]


def test_the_compiled_pass_is_built_where_a_compiler_is():
    """setup.py builds it as optional (no compiler: numba serves); with a compiler present its absence is a
    broken build, which this catches."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host: the numba pass serves")
    assert NATIVE and NATIVE[-1] == "scalar"
    with settings.override(context_pass="auto"):
        assert ck.native_variant() == NATIVE[0]


def _case(dtype, shape, policy, frac, n_edges, seed):
    name = _name(dtype)
    old, _ = _pair(shape, dtype, seed=seed)
    u = as_bits(old).reshape(-1).numpy()
    u = u.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[u.itemsize])
    shift, mask = cm.EXPONENT[name]
    present = np.flatnonzero(np.bincount((u >> shift) & mask, minlength=mask + 1))
    edges = sorted({int(e) for e in present[1:: max(1, present.size // (n_edges + 1))][:n_edges]} - {0})
    lut = cm.class_lut(edges, name)
    bl = cb.part_blocks(shape, None, policy)
    ranks, starts = _random_ranks(u, shift, mask, lut, bl, len(edges) + 1, frac, np.random.default_rng(seed))
    return name, u, edges, lut, bl, ranks, starts


CASES = [(dt, (37, 129), 0b0011, 0.05, 3) for dt in FLOATS]  # runs of 16-17 and 64-65 elements: chunk tails
CASES += [(torch.bfloat16, (3000,), 0, 0.02, 15), (torch.bfloat16, (64, 200), 0b1011, 1.0, 6),
          (torch.float32, (130, 70), 0b0001, 0.3, 15), (torch.float8_e4m3fn, (4, 32, 24), 0b10011, 0.1, 5),
          (torch.bfloat16, (500,), 0, 0.05, 0)]


@pytest.mark.parametrize("variant", PASSES)
@pytest.mark.parametrize("dtype,shape,policy,frac,n_edges", CASES)
def test_every_variant_equals_the_definition(variant, dtype, shape, policy, frac, n_edges):
    name, u, edges, lut, bl, ranks, starts = _case(dtype, shape, policy, frac, n_edges, seed=7)
    shift, mask = cm.EXPONENT[name]
    want = _model_scan(u, shift, mask, lut, bl, ranks, starts)
    with settings.override(context_pass=variant):
        got = ck.scan(u, name, edges, bl, ranks, starts)
        some = ck.scan(u, name, edges, bl, ranks, starts, which=np.arange(bl.S)[::2])
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    in_some = np.isin(got[1], np.concatenate([np.arange(starts[b, 0], starts[b, -1]) for b in range(0, bl.S, 2)]))
    assert np.array_equal(some[0], got[0][in_some]) and np.array_equal(some[1], got[1][in_some])


@pytest.mark.parametrize("variant", PASSES)
def test_a_big_part_split_over_the_cores_equals_numba(variant, monkeypatch):
    """Blocks spread over the pool (PARALLEL_MIN lowered): the groups' outputs join in block order."""
    name, u, edges, _, bl, ranks, starts = _case(torch.bfloat16, (256, 512), 0b0011, 0.04, 15, seed=3)
    with settings.override(context_pass="numba"):
        want = ck.scan(u, name, edges, bl, ranks, starts)
    monkeypatch.setattr(ck, "PARALLEL_MIN", 0)
    with settings.override(context_pass=variant):
        got = ck.scan(u, name, edges, bl, ranks, starts)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("variant", PASSES)
@pytest.mark.parametrize("harm", ["beyond", "negative", "repeated", "descending", "int64 max", "int64 min next"])
def test_hostile_ranks_come_out_short(variant, harm):
    name, u, edges, _, bl, ranks, starts = _case(torch.bfloat16, (64, 96), 0b0011, 0.05, 4, seed=1)
    bad = ranks.copy()
    listed = starts[:, 1:] - starts[:, :-1]
    b, c = np.unravel_index(int(np.argmax(listed)), listed.shape)  # the (block, class) listing the most ranks
    first = int(starts[b, c])
    assert listed[b, c] >= 2
    if harm == "beyond":
        bad[first + 1] += 10_000
    elif harm == "negative":
        bad[first] = -5
    elif harm == "repeated":
        bad[first + 1] = bad[first]
    elif harm == "descending":
        bad[first], bad[first + 1] = bad[first + 1], bad[first]
    elif harm == "int64 max":  # rank + 1 would overflow
        bad[first] = np.iinfo(np.int64).max
    else:  # the gap to it would overflow
        bad[first + 1] = np.iinfo(np.int64).min
    with settings.override(context_pass=variant), pytest.raises(IntegrityError, match="beyond their class"):
        ck.scan(u, name, edges, bl, bad, starts)


@pytest.mark.skipif(not NATIVE, reason="the compiled pass is not built here")
def test_the_compiled_pass_refuses_arrays_that_do_not_fit():
    """Its own bounds checks, below the Python wrapper: rows past the base, starts past the ranks, output too
    short, a variant this CPU does not run. Each a ValueError before any element is read."""
    name, u, edges, _, bl, ranks, starts = _case(torch.bfloat16, (32, 64), 0b0001, 0.1, 3, seed=2)
    rows, row_ptr, run = bl.rows.astype(np.int64), bl.row_ptr.astype(np.int64), bl.run.astype(np.int64)
    n = int(starts[-1, -1] - starts[0, 0])
    out = np.empty(n, np.int64), np.empty(n, np.int64)
    isa = NATIVE[0]

    def call(isa=isa, u=u, rows=rows, row_ptr=row_ptr, run=run, ranks=ranks, starts=starts, out=out, edges=edges):
        return ck._scan_native.scan_blocks(isa, u, u.itemsize, 7, 0xFF, bytes(edges), rows, row_ptr, run,
                                           ranks, starts, *out)

    assert call() == n
    far_row = rows.copy()
    far_row[-1] = u.size
    short = np.empty(n - 1, np.int64), np.empty(n - 1, np.int64)
    past = starts.copy()
    past[-1, -1] = ranks.size + 1
    for harm in [dict(rows=far_row), dict(u=u[:-1]), dict(out=short), dict(starts=past), dict(starts=np.ascontiguousarray(starts[:, :-1])),
                 dict(row_ptr=row_ptr[:-1]), dict(isa="sse9"), dict(edges=list(range(1, 17)))]:
        with pytest.raises(ValueError, match="scan_blocks"):
            call(**harm)


def test_naming_a_variant_this_install_lacks_is_an_error(monkeypatch):
    monkeypatch.setattr(ck, "_scan_native", None)
    with settings.override(context_pass="avx2"), pytest.raises(RuntimeError, match="ENGINE_EXT_CONTEXT_PASS=avx2"):
        ck.native_variant()
    with settings.override(context_pass="auto"):
        assert ck.native_variant() is None
