"""The fast fingerprint paths (numba, every core) equal the torch reference, element for element.

``element_hash`` is the spec written as torch ops; ``range_fingerprint``, ``hash_sum`` and
``box_fingerprint`` are what the publisher, the start-up check and the ranks run on the
CPU. They must agree bit for bit on every dtype width, on runs, index sets and boxes of
any rank and strides, on empty and 0-d tensors, and with numba missing (torch fallback).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_ext.format import fingerprint as fpr

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int32, torch.float8_e4m3fn,
          torch.bool]


def reference(index: torch.Tensor, bits: torch.Tensor) -> int:
    return int(fpr.element_hash(index.reshape(-1), bits.reshape(-1)).sum()) & fpr.MASK64


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.fixture(params=["numba", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":  # numba missing: the torch reference path serves
        monkeypatch.setattr(fpr, "_kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_runs_and_index_sets(dtype, path):
    t = sample((257, 131), dtype)
    bits = fpr.as_bits(t).reshape(-1)
    assert fpr.tensor_fingerprint(t) == reference(torch.arange(bits.numel()), bits)
    assert fpr.range_fingerprint(bits[1000:9000], 1000) == reference(torch.arange(1000, 9000), bits[1000:9000])
    idx = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(1))[:5000]  # unsorted
    assert fpr.hash_sum(idx, bits[idx]) == reference(idx, bits[idx])


@pytest.mark.parametrize("shape,box", [((50, 40), ((3, 7), (20, 33))), ((6, 10, 12), ((1, 2, 3), (5, 9, 12))),
                                       ((4, 5, 6, 7), ((0, 1, 2, 3), (4, 3, 5, 7))), ((1000,), ((17,), (900,)))])
def test_boxes_of_any_rank_and_strides(shape, box, path):
    t = sample(shape, torch.bfloat16)
    bits = fpr.as_bits(t)
    start, stop = box
    view = bits[tuple(slice(a, b) for a, b in zip(start, stop))]  # a strided view, as a rank's piece is read
    grid = torch.stack(torch.meshgrid(*[torch.arange(a, b) for a, b in zip(start, stop)], indexing="ij"), -1)
    strides = torch.tensor([int(torch.tensor(shape[d + 1:]).prod()) for d in range(len(shape))])
    index = (grid * strides).sum(-1)
    assert fpr.box_fingerprint(view, start, shape) == reference(index, view)
    transposed = bits.reshape(shape).transpose(0, -1).contiguous().transpose(0, -1)  # same values, other strides
    assert fpr.box_fingerprint(transposed[tuple(slice(a, b) for a, b in zip(start, stop))], start, shape) == reference(index, view)


def test_empty_and_scalar(path):
    assert fpr.tensor_fingerprint(torch.empty(0, 5, dtype=torch.bfloat16)) == 0
    s = torch.tensor(3.5)
    assert fpr.tensor_fingerprint(s) == reference(torch.zeros(1, dtype=torch.int64), fpr.as_bits(s))
    assert fpr.hash_sum(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16)) == 0


def test_update_in_o_changed_matches_recomputation():
    t = sample((300, 200), torch.bfloat16)
    fp = fpr.tensor_fingerprint(t)
    bits = fpr.as_bits(t).reshape(-1).clone()
    idx = torch.tensor([0, 5, 777, 59_999])
    new = bits[idx] ^ 1
    fp2 = fpr.update_fingerprint(fp, idx, bits[idx], new)
    bits[idx] = new
    assert fp2 == fpr.range_fingerprint(bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_the_cpu_diff_equals_torchs(dtype, monkeypatch):
    """changed_bits on the CPU (numba, both passes) gives torch's positions and bits, in order, and with
    ``update`` leaves the old tensor equal to the new one."""
    from engine_ext.format import delta

    old = fpr.as_bits(sample((700, 300), dtype)).reshape(-1)
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=torch.Generator().manual_seed(2))[:3000]
    new[idx] = new[idx] ^ 1
    fast = delta.changed_bits(old, new)
    monkeypatch.setattr(delta, "_diff_kernels", lambda: None)
    slow = delta.changed_bits(old, new)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow)) and fast[0].numel() == 3000
    monkeypatch.undo()
    kept = old.clone()
    assert all(torch.equal(a, b) for a, b in zip(delta.changed_bits(kept, new, update=True), slow))
    assert torch.equal(kept, new)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("block,threads", [(8, 1), (13, 3), (1 << 10, 2), (1 << 16, 4)])
def test_the_one_pass_diff_in_blocks_and_ranges(dtype, block, threads, monkeypatch):
    """diff_kernels.changed, walked in blocks by several threads, equals torch's diff at every density a
    block may meet (none, all, a run at a range's edge, sparse after dense, so its output grows): positions
    in order, old and new bits, and with ``update`` the kept copy equals the new one."""
    from engine_ext.format import diff_kernels

    monkeypatch.setattr(diff_kernels, "MIN_RANGE", 64)
    g = torch.Generator().manual_seed(block + threads)
    n = 40_011
    old = torch.randint(-100, 100, (n,), generator=g).to(dtype)
    cases = {"none": torch.zeros(n, dtype=torch.bool), "all": torch.ones(n, dtype=torch.bool),
             "sparse": torch.rand(n, generator=g) < 0.01, "edges": torch.zeros(n, dtype=torch.bool)}
    cases["edges"][[0, 7, 8, n // 2 - 1, n // 2, n // 3, n - 9, n - 1]] = True
    late = torch.rand(n, generator=g) < 0.002  # few changes first: the output is sized small, then grows
    late[n // 2:] = torch.rand(n - n // 2, generator=g) < 0.9
    cases["late"] = late
    for name, hit in cases.items():
        new = old.clone()
        new[hit] = new[hit] ^ 1
        base = old
        if name == "edges":  # views at an odd element: their 8-byte words are not aligned
            base, new, hit = old[1:], new[1:], hit[1:]
        want = torch.nonzero(hit).reshape(-1)
        got = diff_kernels.changed(base.numpy(), new.numpy(), block=block, threads=threads)
        assert torch.equal(torch.from_numpy(got[0]), want), name
        assert torch.equal(torch.from_numpy(got[1]), base[want]) and torch.equal(torch.from_numpy(got[2]), new[want]), name
        kept = old.clone()[1:] if name == "edges" else old.clone()  # the kept copy unaligned too
        again = diff_kernels.changed(kept.numpy(), new.numpy(), update=True, block=block, threads=threads)
        assert all(np.array_equal(a, b) for a, b in zip(got, again)) and torch.equal(kept, new), name


def test_parse_all_takes_and_refuses_what_parse_does():
    """parse_all (one regex over the joined fingerprints: a commit and a driver parse 140 k at once) gives
    parse's values and refuses, naming it, any fingerprint parse refuses, wherever it lies in the list."""
    good = [fpr.fmt(x) for x in (0, 1, 2**64 - 1, 0x0123456789ABCDEF)]
    assert fpr.parse_all(good).tolist() == [fpr.parse(s) for s in good]
    assert fpr.parse_all([]).dtype == np.uint64
    for bad in ("0123456789ABCDEF", "0" * 15, "0" * 17, " " + "0" * 15, "0x" + "0" * 14, "-" + "0" * 15, None, 5):
        for at in (0, 2, 4):
            with pytest.raises(ValueError, match="bad fingerprint"):
                fpr.parse_all(good[:at] + [bad] + good[at:])
