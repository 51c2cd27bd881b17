"""The context pass (changed within-class ranks -> element positions): Triton kernels, torch path, numpy model.

The model below works from the definition: the class of each element, a stable argsort
of the classes (``order``), and the element of class ``c`` with rank ``r`` is
``order[off[c] + r]``. The torch backend (``reference_context_positions``) and the
Triton backend (its two kernels run by Triton's interpreter on CPU tensors) must both
return exactly the model's ``(pos, src)``; kernel A's per-block histogram is also held
against its torch mirror. Inputs are small (a few thousand elements) so the
interpreter runs them in seconds.
"""
from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

BACKENDS = ["torch", "triton"]
BF16 = dict(shift=7, emask=0xFF)
FP32 = dict(shift=23, emask=0xFF)


@pytest.fixture(scope="module")
def cs():
    """The module, its kernels decorated in Triton's interpreter mode (set for this test module only).

    Yields ``(module, reason)``: ``reason`` is None when the Triton backend can run here,
    else why not. Triton's own ``@jit`` library functions (``tl.sum``, ``tl.cumsum``) are
    decorated when ``triton.language`` is first imported; if that happened without
    ``TRITON_INTERPRET=1`` (conftest imports the kernels in interpreter mode first to
    prevent it), interpreted kernels cannot call them.
    """
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import engine_ext.triton_kernels.context_scan as m

    reason = None
    if m.triton is None:
        reason = "triton is not installed"
    else:
        if "Interpreted" not in type(m._class_hist_kernel).__name__:
            m = importlib.reload(m)
        if "Interpreted" not in type(m.tl.sum).__name__:
            reason = "triton.language was first imported without TRITON_INTERPRET=1: its tl.sum cannot be interpreted"
    yield m, reason
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def _run(cs, backend, *args, **kw):
    m, reason = cs
    if backend == "triton" and reason:
        pytest.skip(reason)
    return m.context_positions(*args, **kw, backend=backend)


# ----------------------------------------------------------------------------- the numpy model


def model_classes(bits: torch.Tensor, shift: int, emask: int, lut: torch.Tensor) -> np.ndarray:
    width = bits.element_size() * 8
    u = bits.numpy().astype(np.int64) & ((1 << width) - 1)  # raw bits, unsigned
    return lut.numpy().astype(np.int64)[(u >> shift) & emask]


def model_positions(bits, shift, emask, lut, ranks, starts):
    cls = model_classes(bits, shift, emask, lut)
    K = len(starts) - 1
    order = np.argsort(cls, kind="stable")
    pop = np.bincount(cls, minlength=K)
    off = np.cumsum(pop) - pop
    pos, src = [], []
    for c in range(K):
        for j in range(int(starts[c]), int(starts[c + 1])):
            assert 0 <= ranks[j] < pop[c]
            pos.append(order[off[c] + ranks[j]])
            src.append(j)
    pos, src = np.asarray(pos, dtype=np.int64), np.asarray(src, dtype=np.int64)
    k = np.argsort(pos)
    return pos[k], src[k]


def pick_ranks(cls: np.ndarray, K: int, frac: float, seed: int):
    """Sorted unique ranks, about ``frac`` of each class's elements (at least one where it has any)."""
    rng = np.random.default_rng(seed)
    pop = np.bincount(cls, minlength=K)
    ranks, starts = [], [0]
    for c in range(K):
        k = min(int(pop[c]), max(1, round(pop[c] * frac))) if pop[c] else 0
        r = np.sort(rng.choice(int(pop[c]), size=k, replace=False)) if k else np.zeros(0, np.int64)
        ranks.append(r.astype(np.int64))
        starts.append(starts[-1] + k)
    return torch.from_numpy(np.concatenate(ranks)), torch.tensor(starts, dtype=torch.int64)


def bf16_bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16)


def exponent_lut(lo: int = 118, K: int = 6, size: int = 256) -> torch.Tensor:
    """Exponents below ``lo`` -> class 0, then one class per exponent, the top ones -> K - 1 (~6 classes for N(0, 0.02))."""
    return torch.clamp(torch.arange(size) - lo, 0, K - 1).to(torch.uint8)


def check(cs, backend, bits, shift, emask, lut, ranks, starts):
    pos, src = _run(cs, backend, bits, shift, emask, lut, ranks, starts)
    mpos, msrc = model_positions(bits, shift, emask, lut, ranks.numpy(), starts.numpy())
    assert pos.dtype == torch.int64 and src.dtype == torch.int64
    np.testing.assert_array_equal(pos.numpy(), mpos)
    np.testing.assert_array_equal(src.numpy(), msrc)
    # the contract, spelled out: src[k] lies in the range of pos[k]'s class
    cls = model_classes(bits, shift, emask, lut)
    c = cls[mpos]
    st = starts.numpy()
    assert np.all((st[c] <= msrc) & (msrc < st[c + 1]))
    return pos, src


# ----------------------------------------------------------------------------- tests


def test_kernel_is_a_leaf():
    """The kernel module imports torch and Triton only (nothing of engine_ext)."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "engine_ext" / "triton_kernels" / "context_scan.py"
    tree = ast.parse(src.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert mods <= {"__future__", "torch", "triton"}, mods
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_random_bf16(cs, backend, seed):
    """randn * 0.02 in bf16, ~6 exponent classes, ~1 % of each class changed; n not a multiple of BLOCK."""
    n = 4000 + 37 * seed
    bits = bf16_bits(n, seed)
    lut = exponent_lut()
    cls = model_classes(bits, **BF16, lut=lut)
    assert len(np.unique(cls)) == 6
    ranks, starts = pick_ranks(cls, 6, 0.01, seed)
    assert 30 <= ranks.numel() <= 80
    check(cs, backend, bits, **BF16, lut=lut, ranks=ranks, starts=starts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_element_changed(cs, backend):
    """All ranks of every class listed: pos is arange(n), src the inverse of the class-sorted order."""
    n = 3 * 1024 + 5
    bits = bf16_bits(n, 7)
    lut = exponent_lut()
    cls = model_classes(bits, **BF16, lut=lut)
    ranks, starts = pick_ranks(cls, 6, 1.0, 7)
    assert ranks.numel() == n
    pos, _ = check(cs, backend, bits, **BF16, lut=lut, ranks=ranks, starts=starts)
    assert torch.equal(pos, torch.arange(n))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 2 * 1024 + 7])
def test_sizes(cs, backend, n):
    """n == 0, one element, around one block, a ragged last block; ~5 % changed."""
    bits = bf16_bits(n, n)
    lut = exponent_lut()
    ranks, starts = pick_ranks(model_classes(bits, **BF16, lut=lut), 6, 0.05, n)
    check(cs, backend, bits, **BF16, lut=lut, ranks=ranks, starts=starts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_class(cs, backend):
    """K == 1: the within-class rank is the index itself, so pos == ranks."""
    n = 2500
    bits = bf16_bits(n, 11)
    lut = torch.zeros(256, dtype=torch.uint8)
    ranks, starts = pick_ranks(model_classes(bits, **BF16, lut=lut), 1, 0.02, 11)
    pos, src = check(cs, backend, bits, **BF16, lut=lut, ranks=ranks, starts=starts)
    assert torch.equal(pos, ranks) and torch.equal(src, torch.arange(ranks.numel()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_ranks(cs, backend):
    n = 3000
    bits = bf16_bits(n, 12)
    ranks, starts = torch.zeros(0, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)
    pos, src = check(cs, backend, bits, **BF16, lut=exponent_lut(), ranks=ranks, starts=starts)
    assert pos.numel() == 0 and src.numel() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_classes_and_sixteen(cs, backend):
    """K = 16 with classes 3, 9 and 15 empty (no exponent maps to them); an int32 lut."""
    n = 3000
    bits = bf16_bits(n, 13)
    e = torch.arange(256)
    lut = (e % 13).to(torch.int32)
    lut = torch.where(lut >= 9, lut + 1, lut)
    lut = torch.where(lut >= 3, lut + 1, lut)  # values in [0, 15) without 3 and 9
    cls = model_classes(bits, **BF16, lut=lut)
    pop = np.bincount(cls, minlength=16)
    assert pop[3] == pop[9] == pop[15] == 0 and (pop > 0).sum() >= 8
    ranks, starts = pick_ranks(cls, 16, 0.03, 13)
    check(cs, backend, bits, **BF16, lut=lut, ranks=ranks, starts=starts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sign_bit_is_a_logical_shift(cs, backend):
    """int16 bits with the sign bit set: (bits >> 12) & 0xff must be < 16 (unsigned); an arithmetic
    shift would put negative elements into class 3, which must stay empty."""
    n = 3000
    bits = bf16_bits(n, 14)
    assert (bits < 0).sum() > 1000
    lut = torch.full((256,), 3, dtype=torch.uint8)
    lut[:16] = torch.arange(16) % 3
    cls = model_classes(bits, shift=12, emask=0xFF, lut=lut)
    assert set(np.unique(cls)) == {0, 2}  # top nibble 0x3 (positive) or 0xb (negative); never class 3
    ranks, starts = pick_ranks(cls, 4, 0.02, 14)
    check(cs, backend, bits, shift=12, emask=0xFF, lut=lut, ranks=ranks, starts=starts)
    # sign and exponent together (shift 7, 9 bits): negatives form classes of their own
    lut = torch.cat([exponent_lut(), exponent_lut() + 6])
    cls = model_classes(bits, shift=7, emask=0x1FF, lut=lut)
    ranks, starts = pick_ranks(cls, 12, 0.02, 15)
    check(cs, backend, bits, shift=7, emask=0x1FF, lut=lut, ranks=ranks, starts=starts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_bits(cs, backend):
    """int32 raw bits of fp32 weights (shift 23, emask 0xff), signs mixed; also the sign bit alone (shift 31)."""
    n = 2 * 1024 + 300
    g = torch.Generator().manual_seed(16)
    bits = (torch.randn(n, generator=g) * 0.02).view(torch.int32)
    lut = exponent_lut()
    ranks, starts = pick_ranks(model_classes(bits, **FP32, lut=lut), 6, 0.02, 16)
    check(cs, backend, bits, **FP32, lut=lut, ranks=ranks, starts=starts)
    lut = torch.tensor([0, 1], dtype=torch.uint8)
    ranks, starts = pick_ranks(model_classes(bits, shift=31, emask=1, lut=lut), 2, 0.05, 17)
    check(cs, backend, bits, shift=31, emask=1, lut=lut, ranks=ranks, starts=starts)
    # a logical shift on 32 bits too: (bits >> 28) & 0xff < 16, class 3 stays empty
    lut = torch.full((256,), 3, dtype=torch.uint8)
    lut[:16] = torch.arange(16) % 3
    cls = model_classes(bits, shift=28, emask=0xFF, lut=lut)
    assert set(np.unique(cls)) == {0, 2}  # top nibble 0x3 or 0xb
    ranks, starts = pick_ranks(cls, 4, 0.02, 18)
    check(cs, backend, bits, shift=28, emask=0xFF, lut=lut, ranks=ranks, starts=starts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_views_accepted(cs, backend):
    """bf16 / fp32 tensors are read as their raw bits."""
    n = 1500
    bits = bf16_bits(n, 18)
    lut = exponent_lut()
    ranks, starts = pick_ranks(model_classes(bits, **BF16, lut=lut), 6, 0.02, 18)
    want = _run(cs, "torch", bits, BF16["shift"], BF16["emask"], lut, ranks, starts)
    got = _run(cs, backend, bits.view(torch.bfloat16), BF16["shift"], BF16["emask"], lut, ranks, starts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_too_large(cs, backend):
    """A rank equal to its class's population (a wrong base): ValueError, naming the class."""
    n = 3000
    bits = bf16_bits(n, 19)
    lut = exponent_lut()
    cls = model_classes(bits, **BF16, lut=lut)
    pop = np.bincount(cls, minlength=6)
    ranks, starts = pick_ranks(cls, 6, 0.01, 19)
    bad = ranks.clone()
    bad[int(starts[3]) - 1] = int(pop[2])  # the last rank of class 2
    with pytest.raises(ValueError, match="class 2"):
        _run(cs, backend, bits, **BF16, lut=lut, ranks=bad, starts=starts)
    # a rank listed for a class with no elements at all
    lut0 = torch.where(lut == 5, 4, lut).to(torch.uint8)
    ranks, starts = pick_ranks(model_classes(bits, **BF16, lut=lut0), 6, 0.01, 19)
    assert int(starts[6] - starts[5]) == 0
    ranks = torch.cat([ranks, torch.tensor([0])])
    starts = starts.clone()
    starts[6] += 1
    with pytest.raises(ValueError, match="class 5"):
        _run(cs, backend, bits, **BF16, lut=lut0, ranks=ranks, starts=starts)
    # any rank at all when n == 0
    with pytest.raises(ValueError):
        _run(cs, backend, bits[:0], **BF16, lut=lut, ranks=torch.tensor([0]), starts=torch.tensor([0, 1, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_rank_lists(cs, backend):
    """Negative, repeated or unsorted ranks within a class, and inconsistent starts, are refused."""
    bits = bf16_bits(2000, 20)
    lut = exponent_lut()
    ranks, starts = pick_ranks(model_classes(bits, **BF16, lut=lut), 6, 0.02, 20)
    s2, e2 = int(starts[2]), int(starts[3])
    assert e2 - s2 >= 2
    for mutate in ("neg", "dup", "swap"):
        r = ranks.clone()
        if mutate == "neg":
            r[s2] = -1
        elif mutate == "dup":
            r[s2 + 1] = r[s2]
        else:
            r[s2], r[s2 + 1] = int(r[s2 + 1]), int(r[s2])
        with pytest.raises(ValueError):
            _run(cs, backend, bits, **BF16, lut=lut, ranks=r, starts=starts)
    with pytest.raises(ValueError, match="starts"):
        _run(cs, backend, bits, **BF16, lut=lut, ranks=ranks, starts=starts[:-1].clone().index_fill_(0, torch.tensor([5]), 0))
    with pytest.raises(ValueError, match="lut"):
        _run(cs, backend, bits, **BF16, lut=exponent_lut(K=7), ranks=ranks, starts=starts)


def test_class_hist_kernel(cs):
    """Kernel A against its torch mirror, including a ragged last block and int32 bits."""
    m, reason = cs
    if reason:
        pytest.skip(reason)
    bits = bf16_bits(3 * 1024 + 100, 21)
    lut = exponent_lut()
    got = m.class_hist(bits, 7, 0xFF, lut, 6)
    assert torch.equal(got, m.reference_class_hist(bits, 7, 0xFF, lut, 6))
    assert int(got.sum()) == bits.numel() and got.shape == (4, 6)
    bits32 = (torch.randn(1500) * 0.02).view(torch.int32)
    assert torch.equal(m.class_hist(bits32, 23, 0xFF, lut, 6), m.reference_class_hist(bits32, 23, 0xFF, lut, 6))


def test_auto_backend_on_cpu(cs, monkeypatch):
    """auto == torch for CPU tensors (the kernels are not called)."""
    m, _ = cs
    monkeypatch.setattr(m, "_triton_positions", lambda *a: pytest.fail("triton path taken on CPU"))
    bits = bf16_bits(500, 22)
    lut = exponent_lut()
    ranks, starts = pick_ranks(model_classes(bits, **BF16, lut=lut), 6, 0.02, 22)
    pos, src = m.context_positions(bits, 7, 0xFF, lut, ranks, starts)
    mpos, msrc = model_positions(bits, 7, 0xFF, lut, ranks.numpy(), starts.numpy())
    np.testing.assert_array_equal(pos.numpy(), mpos)
    np.testing.assert_array_equal(src.numpy(), msrc)
    with pytest.raises(ValueError, match="backend"):
        m.context_positions(bits, 7, 0xFF, lut, ranks, starts, backend="cuda")
