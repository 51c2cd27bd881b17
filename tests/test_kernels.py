"""apply_delta: Triton kernel (interpreter on CPU) == torch path == a naive per-element reference.

The reference below works element by element in Python integers, from the
definitions (row-major checkpoint index, box test, affine destination map, ordered
key space, SplitMix64 element hash), independently of both executors. Comparisons
are on the raw bytes of each destination's whole storage (so a stray write anywhere
fails), and on fingerprint deltas against full recomputation.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_ext.errors import OutOfOrderError
from engine_ext.format import dtypes
from engine_ext.format import fingerprint as fpr
from engine_ext.server.apply import apply_delta, decode_gaps
from engine_ext.server.maps import local_fingerprint
from engine_ext.server.maps import Piece, TensorMap, Unmappable, covered_elements, row_major_strides
from engine_ext.format.delta import TensorDelta, diff_tensor

ALL = list(dtypes.BY_NAME.values())
M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- reference


def _key(b: int, w: int, is_float: bool) -> int:
    if is_float and b < 0:
        return b ^ ((1 << (w - 1)) - 1)
    return b


def _wrap(x: int, w: int) -> int:
    x &= (1 << w) - 1
    return x - (1 << w) if x >= 1 << (w - 1) else x


def _mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int, written from the format spec (docs/FORMAT.md)."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _h(i: int, b: int, w: int) -> int:
    return _mix64(((i * 0x9E3779B97F4A7C15) & M64) ^ (b & ((1 << w) - 1)))


def naive_apply(td: TensorDelta, m: TensorMap):
    """Per-element Python reference: returns (fp_delta, written) and writes the storages."""
    w, isf = td.dtype.bits, td.dtype.is_float
    cs = row_major_strides(td.shape)
    idx = range(td.numel) if td.positions is None else td.positions.tolist()
    vals = td.values.tolist()
    fp, written = 0, 0
    for p in m.pieces:
        store = torch.empty(0, dtype=td.dtype.int_view).set_(p.dest.untyped_storage())
        for k, i in enumerate(idx):
            c = [(i // s) % n for s, n in zip(cs, td.shape)]
            if not all(a <= x < b for x, a, b in zip(c, p.start, p.stop)):
                continue
            d = p.offset + sum((x - a) * s for x, a, s in zip(c, p.start, p.strides))
            old = int(store[d])
            v = vals[i] if td.positions is None else vals[k]
            new = _wrap(_key(_wrap(_key(old, w, isf) + v, w), w, isf), w) if td.mode == "rel" else v
            store[d] = new
            if p.count_fingerprint:
                fp += _h(i, new, w) - _h(i, old, w)
                written += 1
    return fp & M64, written


# ----------------------------------------------------------------------------- layouts


def _rand_bits(n, d, g):
    return torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64).to(d.int_view)


def make_case(seed: int, d, *, ndim=None, density=None, dense=False, mode=None, npieces=None):
    """A random checkpoint tensor, a map of 1-2 pieces (box = slice/shard, permuted dims =
    transpose, padded dest dims, offset into a shared packed buffer), and a delta."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    nd = ndim if ndim is not None else r(0, 4)
    shape = tuple(r(1, 5) for _ in range(nd))
    numel = math.prod(shape)
    buf = torch.empty(0)
    pieces = []
    layouts = []
    for k in range(npieces if npieces is not None else r(1, 2)):
        start = tuple(r(0, s - 1) for s in shape)
        stop = tuple(r(a + 1, s) for a, s in zip(start, shape))
        if k == 0 and r(0, 2) == 0:
            start, stop = (0,) * nd, shape  # whole tensor
        ext = [b - a for a, b in zip(start, stop)]
        perm = torch.randperm(nd, generator=g).tolist() if r(0, 1) else list(range(nd))
        pad = [r(0, 2) if r(0, 1) else 0 for _ in range(nd)]
        dshape = [ext[p] + pad[p] for p in perm]  # dest dim j holds checkpoint dim perm[j]
        dstr = row_major_strides(dshape)
        strides = [0] * nd
        for j, p in enumerate(perm):
            strides[p] = dstr[j]
        lead = r(0, 7)  # packed: other data before this piece in the same storage
        layouts.append((start, stop, tuple(strides), lead, math.prod(dshape), k > 0))
    total = sum(lo + n + 3 for *_, lo, n, _ in layouts)
    buf = _rand_bits(total, d, g)
    tview = buf if d.torch == d.int_view else (buf.view(torch.uint8).view(torch.bool) if d.torch == torch.bool else buf.view(d.torch))
    at = 0
    for start, stop, strides, lead, n, second in layouts:
        pieces.append(Piece(tview, start, stop, at + lead, strides, count_fingerprint=not second))
        at += lead + n + 3
    m = TensorMap("t", shape, d, pieces)
    mode = mode or ("rel" if r(0, 1) else "abs")
    if dense:
        pos, nnz = None, numel
    else:
        dens = density if density is not None else [0.0, 0.3, 1.0][r(0, 2)]
        mask = torch.rand(numel, generator=g) < dens
        pos = mask.nonzero().reshape(-1)
        nnz = pos.numel()
    vals = _rand_bits(nnz, d, g)
    if mode == "rel" and r(0, 1):
        vals = torch.randint(-2, 3, (nnz,), generator=g).to(d.int_view)  # RL-like small steps
    return TensorDelta("t", d, shape, mode, pos, vals), m, buf


def _run(seed, d, backend, **kw):
    td, m, buf = make_case(seed, d, **kw)
    before = buf.clone()
    lf0 = local_fingerprint(m)
    if backend == "naive":
        fp, wr = naive_apply(td, m)
        return buf, before, fp, wr, None, lf0, m
    res = apply_delta([td], {"t": m}, backend=backend)
    return buf, before, res.fingerprint_delta["t"], res.written["t"], res, lf0, m


def _check_all(seed, d, interp_on, **kw):
    ref_buf, before, ref_fp, ref_wr, _, lf0, m = _run(seed, d, "naive", **kw)
    assert ref_fp == (local_fingerprint(m) - lf0) & M64  # reference agrees with recomputation
    backends = ["torch", "triton"] if interp_on else ["torch"]
    for be in backends:
        buf, before2, fp, wr, res, _, m2 = _run(seed, d, be, **kw)
        assert torch.equal(before, before2)
        assert torch.equal(buf, ref_buf), (be, d.name, seed)
        assert (fp, wr) == (ref_fp, ref_wr), (be, d.name, seed)
        res.undo.rollback()
        assert torch.equal(buf, before), ("undo", be, d.name, seed)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("d", ALL, ids=lambda d: d.name)
def test_all_dtypes_all_backends(d, interp):
    for seed in range(3):
        _check_all(seed, d, True)
    _check_all(11, d, True, dense=True)
    _check_all(12, d, True, density=1.0, ndim=2)
    _check_all(13, d, True, density=0.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), di=st.integers(0, len(ALL) - 1), dense=st.booleans())
def test_random_layouts_torch_vs_naive(seed, di, dense):
    _check_all(seed, ALL[di], False, dense=dense)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), di=st.integers(0, len(ALL) - 1), dense=st.booleans())
def test_random_layouts_triton_interpreter(seed, di, dense, interp):
    _check_all(seed, ALL[di], True, dense=dense)


def test_one_element_and_empty_and_rank5(interp):
    bf = dtypes.BY_NAME["bfloat16"]
    _check_all(5, bf, True, ndim=0)  # a scalar tensor
    for be in ("torch", "triton"):
        # 5-d checkpoint tensor: the Triton backend routes it to the torch path
        t = torch.arange(32, dtype=torch.int16).reshape(2, 2, 2, 2, 2)
        m = TensorMap("t", tuple(t.shape), dtypes.BY_NAME["int16"], [Piece(t, (0,) * 5, (2,) * 5, 0, row_major_strides(t.shape))])
        td = TensorDelta("t", m.dtype, m.shape, "rel", torch.tensor([3, 31]), torch.tensor([10, -1], dtype=torch.int16))
        r = apply_delta([td], {"t": m}, backend=be)
        assert t.reshape(-1)[3] == 13 and t.reshape(-1)[31] == 30 and r.written["t"] == 2
        r.undo.rollback()
        assert torch.equal(t.reshape(-1), torch.arange(32, dtype=torch.int16))
        empty = TensorDelta("t", m.dtype, m.shape, "abs", torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16))
        r = apply_delta([empty], {"t": m}, backend=be)
        assert r.written == {"t": 0} and r.fingerprint_delta == {"t": 0}


def test_multi_tensor_batch_and_foreign_shard(interp):
    """Several tensors of mixed widths in one call; a map with no pieces (another rank's tensor)."""
    for be in ("torch", "triton"):
        cases = [make_case(100 + k, ALL[k % len(ALL)], npieces=1) for k in range(8)]
        deltas, maps, bufs = [], {}, []
        for k, (td, m, buf) in enumerate(cases):
            td.name = m.name = f"t{k}"
            deltas.append(td)
            maps[m.name] = m
            bufs.append((buf, buf.clone()))
        absent = TensorDelta("elsewhere", ALL[0], (4,), "abs", torch.tensor([1]), torch.tensor([7], dtype=torch.int16))
        deltas.append(absent)
        maps["elsewhere"] = TensorMap("elsewhere", (4,), ALL[0], [])
        lf0 = {n: local_fingerprint(m) for n, m in maps.items()}
        res = apply_delta(deltas, maps, backend=be)
        for n, m in maps.items():
            assert res.fingerprint_delta[n] == (local_fingerprint(m) - lf0[n]) & M64
        assert res.written["elsewhere"] == 0 and covered_elements(maps["elsewhere"]) == 0
        res.undo.rollback()
        assert all(torch.equal(a, b) for a, b in bufs)
        with pytest.raises(OutOfOrderError, match="undo log already used"):
            res.undo.rollback()


def test_whole_tensor_fingerprint_matches_full_recomputation():
    d = dtypes.BY_NAME["bfloat16"]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    new = w.clone()
    mask = torch.rand(w.shape, generator=g) < 0.02
    new[mask] = (new[mask].float() * 1.01).to(torch.bfloat16)
    from engine_ext.format.delta import diff_tensor

    td = diff_tensor("w", w, new)
    dest = w.clone()
    m = TensorMap("w", tuple(w.shape), d, [Piece(dest, (0, 0), (64, 48), 0, (48, 1))])
    assert covered_elements(m) == w.numel() and local_fingerprint(m) == fpr.tensor_fingerprint(w)
    r = apply_delta([td], {"w": m})
    assert torch.equal(dest.view(torch.int16), new.view(torch.int16))
    assert r.fingerprint_delta["w"] == (td.fingerprint - td.base_fingerprint) & M64
    assert local_fingerprint(m) == td.fingerprint


def test_int64_addressing_beyond_2_31(interp):
    """Checkpoint indices and storage offsets above 2^31 (lazily allocated storage: only touched pages count)."""
    d = dtypes.BY_NAME["int8"]
    shape = (1 << 20, 1 << 12)  # 2^32 checkpoint elements
    big = torch.empty((1 << 31) + (1 << 16), dtype=torch.int8)
    off = (1 << 31) + 100
    region = big[off: off + 2 * 4096]
    region.copy_(torch.arange(2 * 4096, dtype=torch.int64).to(torch.int8))
    saved = region.clone()
    row0 = (1 << 20) - 2  # the box: the last two rows
    m = TensorMap("t", shape, d, [Piece(big, (row0, 0), (1 << 20, 1 << 12), off, (4096, 1))])
    pos = torch.tensor([5, row0 * 4096 + 1, (1 << 32) - 1], dtype=torch.int64)  # first is another shard's
    td = TensorDelta("t", d, shape, "rel", pos, torch.tensor([1, 2, 3], dtype=torch.int8))
    results = []
    for be in ("torch", "triton"):
        region.copy_(saved)
        r = apply_delta([td], {"t": m}, backend=be)
        exp = (_h(row0 * 4096 + 1, int(saved[1]) + 2, 8) - _h(row0 * 4096 + 1, int(saved[1]), 8)
               + _h((1 << 32) - 1, _wrap(int(saved[-1]) + 3, 8), 8) - _h((1 << 32) - 1, int(saved[-1]), 8)) & M64
        assert r.written["t"] == 2 and r.fingerprint_delta["t"] == exp, be
        results.append(region.clone())
        r.undo.rollback()
        assert torch.equal(region, saved)
    assert torch.equal(results[0], results[1])
    assert int(results[0][1]) == int(saved[1]) + 2


def _bad_inputs():
    d = dtypes.BY_NAME["bfloat16"]
    dest = torch.zeros(4, 3, dtype=torch.bfloat16)
    good = lambda **kw: TensorDelta(**{**dict(name="t", dtype=d, shape=(4, 3), mode="abs",
                                               positions=torch.tensor([1, 5]), values=torch.tensor([7, 8], dtype=torch.int16)), **kw})
    m = TensorMap("t", (4, 3), d, [Piece(dest, (0, 0), (4, 3), 0, (3, 1))])
    I16 = torch.int16
    return dest, m, [
        ("unsorted", good(positions=torch.tensor([5, 1])), {"t": m}),
        ("duplicate", good(positions=torch.tensor([5, 5])), {"t": m}),
        ("out of range", good(positions=torch.tensor([1, 12])), {"t": m}),
        ("negative", good(positions=torch.tensor([-1, 2])), {"t": m}),
        ("int32 positions", good(positions=torch.tensor([1, 5], dtype=torch.int32)), {"t": m}),
        ("values dtype", good(values=torch.tensor([7, 8], dtype=torch.int32)), {"t": m}),
        ("values length", good(values=torch.tensor([7, 8, 9], dtype=I16)), {"t": m}),
        ("dense length", good(positions=None), {"t": m}),
        ("mode", good(mode="xor"), {"t": m}),
        ("no map", good(name="u"), {"t": m}),
        ("unmappable", good(), {"t": Unmappable("t", "quantised")}),
        ("map dtype", good(), {"t": TensorMap("t", (4, 3), dtypes.BY_NAME["float16"], m.pieces)}),
        ("map shape", good(), {"t": TensorMap("t", (3, 4), d, m.pieces)}),
        ("box outside shape", good(), {"t": TensorMap("t", (4, 3), d, [Piece(dest, (0, 0), (5, 3), 0, (3, 1))])}),
        ("outside storage", good(), {"t": TensorMap("t", (4, 3), d, [Piece(dest, (0, 0), (4, 3), 1, (3, 1))])}),
        ("dest dtype", good(), {"t": TensorMap("t", (4, 3), d, [Piece(dest.view(I16), (0, 0), (4, 3), 0, (3, 1))])}),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_writes_nothing(backend, interp):
    dest, m, cases = _bad_inputs()
    ok = TensorDelta("ok", m.dtype, (4, 3), "abs", torch.tensor([0]), torch.tensor([99], dtype=torch.int16))
    for why, td, maps in cases:
        maps = {**maps, "ok": m}
        with pytest.raises(ValueError):
            apply_delta([ok, td], maps, backend=backend)  # the valid tensor first: still nothing written
        assert int(dest.view(torch.int16).abs().sum()) == 0, why
    with pytest.raises(ValueError):
        apply_delta([ok, ok], {"ok": m}, backend=backend)
    with pytest.raises(ValueError):
        apply_delta([ok], {"ok": m}, backend="cuda-magic")
    assert int(dest.view(torch.int16).abs().sum()) == 0


def test_decode_gaps():
    pos = torch.tensor([0, 3, 4, 10, (1 << 40)], dtype=torch.int64)
    gaps = torch.diff(pos, prepend=torch.zeros(1, dtype=torch.int64))
    assert torch.equal(decode_gaps(gaps), pos)
    assert torch.equal(decode_gaps(torch.empty(0, dtype=torch.int64)), torch.empty(0, dtype=torch.int64))


def test_auto_backend_is_torch_on_cpu(monkeypatch):
    import engine_ext.server.apply as ap

    td, m, _ = make_case(1, dtypes.BY_NAME["float32"], npieces=1)
    monkeypatch.setattr(ap, "apply_torch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("torch path used")))
    with pytest.raises(AssertionError, match="torch path used"):
        apply_delta([td], {"t": m})


def test_composed_mixed_parts_apply_together():
    """A chain composed to an absolute and a relative part of one tensor applies in one call,
    and the result equals applying the chain step by step (reader.compose -> apply_delta)."""
    from engine_ext.format.delta import REL, ABS, compose, diff_tensor

    g = torch.Generator().manual_seed(7)
    states = [torch.randn(64, 32, generator=g).to(torch.bfloat16)]
    for k in range(3):
        nxt = states[-1].clone()
        rows = torch.randperm(64, generator=g)[:10]
        nxt[rows] = (nxt[rows].float() * 1.01).to(torch.bfloat16)
        states.append(nxt)
    chain = [diff_tensor("w", a, b, mode=ABS if k == 0 else REL) for k, (a, b) in enumerate(zip(states, states[1:]))]
    parts = compose(chain)
    assert sorted(p.mode for p in parts) == ["abs", "rel"]
    live = states[0].clone()
    m = TensorMap("w", (64, 32), dtypes.BY_NAME["bfloat16"], [Piece(live, (0, 0), (64, 32), 0, (32, 1))])
    res = apply_delta(parts, {"w": m})
    assert torch.equal(dtypes.as_bits(live), dtypes.as_bits(states[-1]))
    assert (fpr.tensor_fingerprint(states[0]) + res.fingerprint_delta["w"]) % 2**64 == fpr.tensor_fingerprint(states[-1])
    res.undo.rollback()
    assert torch.equal(dtypes.as_bits(live), dtypes.as_bits(states[0]))
    overlapping = [parts[0], TensorDelta("w", parts[0].dtype, parts[0].shape, REL, parts[0].positions, parts[0].values)]
    with pytest.raises(ValueError, match="overlapping"):
        apply_delta(overlapping, {"w": m})
    assert torch.equal(dtypes.as_bits(live), dtypes.as_bits(states[0]))


def test_failure_midway_rolls_back(monkeypatch):
    """If the torch path fails after writing some segments, what it wrote is undone."""
    import engine_ext.server.apply_torch as ap

    a, b = torch.zeros(100, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.bfloat16)
    bf = dtypes.BY_NAME["bfloat16"]
    maps = {n: TensorMap(n, (100,), bf, [Piece(t, (0,), (100,), 0, (1,))]) for n, t in (("a", a), ("b", b))}
    ones = torch.ones(100, dtype=torch.bfloat16).view(torch.int16)
    deltas = [TensorDelta(n, bf, (100,), "abs", None, ones) for n in ("a", "b")]
    real, calls = ap._scatter, []

    def failing(storage, dst, new):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("simulated failure in the second segment")
        return real(storage, dst, new)

    monkeypatch.setattr(ap, "_scatter", failing)
    with pytest.raises(MemoryError):
        apply_delta(deltas, maps, backend="torch")
    monkeypatch.setattr(ap, "_scatter", real)
    assert not a.view(torch.int16).any() and not b.view(torch.int16).any()


@pytest.mark.parametrize("ckpt,live", [("bfloat16", torch.float32), ("float16", torch.float32), ("bfloat16", torch.float64),
                                       ("float32", torch.float64)])
def test_converting_destination(ckpt, live, interp):
    """A destination that holds a widened copy (vLLM's sgl path keeps biases in float32):
    both executors write the converted new value, fingerprint checkpoint bits, undo exactly."""
    d = dtypes.BY_NAME[ckpt]
    g = torch.Generator().manual_seed(11)
    base = (torch.randn(6, 40, generator=g) * 0.02).to(d.torch)
    new = base.clone()
    new.view(-1)[::7] = (new.view(-1)[::7].float() * 1.5 + 1e-3).to(d.torch)
    for be in ("torch", "triton"):
        for mode in ("rel", "abs"):
            live_buf = torch.zeros(300, dtype=live)  # the piece sits at an offset inside a larger storage
            dest = live_buf[20:260].view(6, 40)
            dest.copy_(base)
            m = TensorMap("b", (6, 40), d, [Piece(dest, (0, 0), (6, 40), 20, (40, 1))])
            assert local_fingerprint(m) == fpr.tensor_fingerprint(base)
            td = diff_tensor("b", base, new)
            if mode == "abs":
                td = TensorDelta("b", d, td.shape, "abs", td.positions, dtypes.as_bits(new).reshape(-1)[td.positions],
                                 td.base_fingerprint, td.fingerprint)
            before = live_buf.clone()
            res = apply_delta([td], {"b": m}, backend=be)
            assert torch.equal(dest, new.to(live)), (be, mode)
            assert torch.equal(live_buf[:20], before[:20]) and torch.equal(live_buf[260:], before[260:])
            assert res.fingerprint_delta["b"] == (td.fingerprint - td.base_fingerprint) & M64
            assert res.written["b"] == td.nnz and local_fingerprint(m) == td.fingerprint
            res.undo.rollback()
            assert torch.equal(live_buf.view(torch.uint8), before.view(torch.uint8)), (be, mode)


def test_converting_destination_refuses_narrowing_and_inexact_values():
    """Narrowing (float32 checkpoint into bf16) is not a converting map; a value the widening
    would not keep (a NaN payload the cast canonicalises) is refused and nothing stays written."""
    f32, bf = dtypes.BY_NAME["float32"], dtypes.BY_NAME["bfloat16"]
    narrow = torch.zeros(4, dtype=torch.bfloat16)
    m = TensorMap("n", (4,), f32, [Piece(narrow, (0,), (4,), 0, (1,))])
    td = TensorDelta("n", f32, (4,), "abs", torch.tensor([1]), torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="exact widening"):
        apply_delta([td], {"n": m})
    live = torch.arange(4, dtype=torch.float32)
    m = TensorMap("w", (4,), bf, [Piece(live, (0,), (4,), 0, (1,))])
    nan_payload = torch.tensor([1, 3], dtype=torch.int64), torch.tensor([0x3F80, 0x7F81], dtype=torch.int16)  # 1.0, odd NaN
    td = TensorDelta("w", bf, (4,), "abs", *nan_payload)
    with pytest.raises(ValueError, match="not exactly representable"):
        apply_delta([td], {"w": m}, backend="torch")
    assert torch.equal(live, torch.arange(4, dtype=torch.float32))


def test_dropped_model_frees_its_storage(interp):
    """Nothing engine_ext keeps outlives the maps: after an apply (both executors) and a
    commit, dropping the model and its maps frees the parameter's storage."""
    import gc
    import weakref

    import numpy as np

    bf = dtypes.BY_NAME["bfloat16"]
    for be in ("torch", "triton"):
        arr = np.zeros(1 << 20, dtype=np.int16)  # 2 MiB, owned by numpy: weakref-able
        alive = weakref.ref(arr)
        param = torch.nn.Parameter(torch.from_numpy(arr).view(torch.bfloat16).reshape(1024, 1024), requires_grad=False)
        del arr
        maps = {"w": TensorMap("w", (1024, 1024), bf, [Piece(param, (0, 0), (1024, 1024), 0, (1024, 1))])}
        td = TensorDelta("w", bf, (1024, 1024), "abs", torch.tensor([3, 70000]), torch.tensor([5, 7], dtype=torch.int16))
        res = apply_delta([td], maps, backend=be)
        res.undo.discard()
        assert int(param.view(torch.int16).reshape(-1)[70000]) == 7
        del param, maps, res, td
        gc.collect()
        assert alive() is None, f"{be}: a cache still holds the dropped parameter's storage"


def test_model_fingerprint_matches_the_spec():
    fps = {"a": 1, "b.weight": M64, "model.layers.0.mlp.down_proj.weight": 12345}
    want = sum(_mix64(fpr.name_key(n) ^ f) for n, f in fps.items()) & M64
    assert fpr.model_fingerprint(fps) == want and fpr.model_fingerprint(list(fps.items())) == want
    assert fpr.model_fingerprint({}) == 0
