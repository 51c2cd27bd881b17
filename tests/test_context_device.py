"""Decoding context-coded parts where the base lives (engine_ext.triton_kernels.context_decode): the
Triton pass, run by Triton's interpreter on CPU tensors, against the host decoder (numba), bit
for bit: every float dtype, whole parts and every shard of every layout the engines produce
(TP 2/4/8, padded vocabularies, fused experts), hostile input, and ranks that take a chained
route with their base never copied to the host."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from engine_ext.errors import IntegrityError, PartlyHeldError
from engine_ext.format.context import blocks as cb, codec as cc, models as cm, scan_kernels as ck
from engine_ext.format.dtypes import as_bits
from engine_ext.triton_kernels import context_decode as cdev
from test_context_codec import FLOATS, _assert_ranks_hold, _changes, _encode, _layouts, _name, _pair, _publish, _shard

pytestmark = pytest.mark.usefixtures("ctx_interp")


def _both(name, shape, e, nnz, tables, base_of):
    """(host decode, device decode) of one encoded part; ``base_of(box)`` gives numpy bits."""
    host = cc.decode(cc.StoredPart(name, shape, None, e.pos, e.val, nnz, tables), base_of)

    def on_device(box):
        got = base_of(box)
        return None if got is None else torch.from_numpy(np.ascontiguousarray(got).copy())

    dev = cdev.decode(cc.StoredPart(name, shape, None, e.pos, e.val, nnz, tables), on_device)
    return host, dev


def _same(host, dev):
    assert dev[0].dtype == torch.int64 and dev[1].dtype == torch.from_numpy(host[1]).dtype
    assert np.array_equal(dev[0].numpy(), host[0]) and np.array_equal(dev[1].numpy(), host[1])


# ----------------------------------------------------------------------------- the blocked pass


def _random_ranks(u, shift, mask, lut, bl, K, frac, rng):
    ranks, starts = [], np.zeros((bl.S, K + 1), np.int64)
    for b in range(bl.S):
        elems = np.concatenate([np.arange(s, s + bl.run[b]) for s in bl.rows[bl.row_ptr[b]:bl.row_ptr[b + 1]]])
        cls = lut[(u[elems] >> shift) & mask]
        for c in range(K):
            n = int((cls == c).sum())
            k = min(n, max(1, round(n * frac))) if n else 0
            ranks.append(np.sort(rng.choice(n, k, replace=False)) if k else np.zeros(0, np.int64))
            starts[b, c + 1] = starts[b, c] + k
        if b + 1 < bl.S:
            starts[b + 1, 0] = starts[b, K]
    return np.concatenate(ranks).astype(np.int64), starts


PASSES = [(torch.bfloat16, (2500,), 0, 0.03), (torch.bfloat16, (64, 40), 0b1011, 0.05),
          (torch.bfloat16, (4, 32, 8), 0b10011, 0.1), (torch.bfloat16, (48, 64), 0, 1.0)]
PASSES += [(dt, shape, policy, frac) for dt in FLOATS[1:] for shape, policy, frac in [((2500,), 0, 0.03), ((32, 48), 0b0011, 0.05)]]


@pytest.mark.parametrize("dtype,shape,policy,frac", PASSES)
def test_the_blocked_pass_equals_the_host_scan(ctx_interp, dtype, shape, policy, frac):
    """Positions and their rank indices from the Triton pass (and its torch mirror) equal the
    numba scan's: one block over ragged tiles, many blocks cut by each kind of policy (vocabulary,
    fused halves), every element listed; every float dtype's bits."""
    name = _name(dtype)
    old, _ = _pair(shape, dtype)
    u = as_bits(old).reshape(-1).numpy()
    u = u.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[u.itemsize])
    shift, mask = cm.EXPONENT[name]
    present = np.flatnonzero(np.bincount((u >> shift) & mask, minlength=mask + 1))
    edges = sorted({int(e) for e in present[1::max(1, present.size // 5)][:6]} - {0})
    lut = cm.class_lut(edges, name)
    K = len(edges) + 1
    bl = cb.part_blocks(shape, None, policy)
    ranks, starts = _random_ranks(u, shift, mask, lut, bl, K, frac, np.random.default_rng(0))
    want_pos, want_src = ck.scan(u, name, edges, bl, ranks, starts)
    order = np.argsort(want_pos, kind="stable")
    geo = (bl.rows, bl.rows, bl.row_ptr, bl.run)
    for backend in ("triton", "torch"):
        pos, src = ctx_interp.block_positions(as_bits(old).reshape(-1), geo, shift, mask, torch.from_numpy(lut),
                                              torch.from_numpy(ranks), starts, backend=backend)
        assert np.array_equal(pos.numpy(), want_pos[order]) and np.array_equal(src.numpy(), want_src[order]), backend


def test_the_blocked_pass_refuses_bad_ranks(ctx_interp):
    shape = (96, 64)
    old, _ = _pair(shape)
    u = as_bits(old).reshape(-1).numpy().view(np.uint16)
    lut = cm.class_lut([118, 121], "bfloat16")
    bl = cb.part_blocks(shape, None, 0b0001)
    ranks, starts = _random_ranks(u, 7, 0xFF, lut, bl, 3, 0.05, np.random.default_rng(1))
    geo = (bl.rows, bl.rows, bl.row_ptr, bl.run)
    bits, tlut = as_bits(old).reshape(-1), torch.from_numpy(lut)
    for backend in ("triton", "torch"):
        too_far = ranks.copy()
        too_far[starts[0, 1] - 1] += 10_000  # past its class's population in block 0
        with pytest.raises(ValueError):
            ctx_interp.block_positions(bits, geo, 7, 0xFF, tlut, torch.from_numpy(too_far), starts, backend=backend)
        swapped = ranks.copy()
        swapped[[starts[1, 1], starts[1, 1] + 1]] = swapped[[starts[1, 1] + 1, starts[1, 1]]]
        with pytest.raises(ValueError):
            ctx_interp.block_positions(bits, geo, 7, 0xFF, tlut, torch.from_numpy(swapped), starts, backend=backend)
    with pytest.raises(ValueError, match="block-major"):
        ctx_interp.block_positions(bits, geo, 7, 0xFF, tlut, torch.from_numpy(ranks), starts[::-1].copy())
    with pytest.raises(ValueError, match="geometry"):
        ctx_interp.block_positions(bits, (bl.rows + 64, bl.rows, bl.row_ptr, bl.run), 7, 0xFF, tlut,
                                   torch.from_numpy(ranks), starts)


# ----------------------------------------------------------------------------- whole decodes


ROUND_TRIPS = [(dt, shape, policy) for dt in FLOATS for shape, policy in [((300,), 0b0001), ((64, 48), 0b1011)]]
ROUND_TRIPS.append((torch.bfloat16, (2, 24, 16), 0b0111))  # a dtype's bits and a part's geometry are independent


@pytest.mark.parametrize("dtype,shape,policy", ROUND_TRIPS)
def test_round_trip_on_the_device(dtype, shape, policy):
    old, new = _pair(shape, dtype, density=0.2 if dtype.itemsize == 1 else 0.02)
    pos, steps, base = _changes(old, new)
    name = _name(dtype)
    e, tables = _encode(name, shape, base, pos, steps, policy)
    host, dev = _both(name, shape, e, pos.size, tables, lambda box: cb.box_of(base, shape, box))
    _same(host, dev)
    assert np.array_equal(host[0], pos) and np.array_equal(host[1], steps)


def test_big_parts_decode_alike(monkeypatch):
    """The host looks classes up by an element's top 16 bits in big parts, the device by its
    exponent: the same classes (a small part made "big" here, for the interpreter's sake)."""
    monkeypatch.setattr(cm, "WIDE_MIN", 1)
    shape = (96, 64)
    old, new = _pair(shape)
    pos, steps, base = _changes(old, new)
    e, tables = _encode("bfloat16", shape, base, pos, steps, 0b1011)
    assert cm.class_key([120], "bfloat16", 100)[1] == 0xFFFF
    _same(*_both("bfloat16", shape, e, pos.size, tables, lambda box: cb.box_of(base, shape, box)))


@pytest.mark.parametrize("name,shape,world,how", _layouts())
def test_every_shard_decodes_on_its_device(name, shape, world, how):
    """Every rank of every layout decodes on the device exactly what the host decoder gives it,
    asking only for boxes inside its shard."""
    old, new = _pair(shape, density=0.5)
    pos, steps, base = _changes(old, new)
    policy = cb.block_policy(name, shape)
    e, tables = _encode("bfloat16", shape, base, pos, steps, policy)
    total = 0
    for r in range(world):
        held = [b for b in _shard(shape, world, r, how) if all(a < z for a, z in zip(*b))]

        def base_of(box):
            if any(all(h[0][d] <= box[0][d] and box[1][d] <= h[1][d] for d in range(len(shape))) for h in held):
                return cb.box_of(base, shape, box)
            if any(all(max(box[0][d], h[0][d]) < min(box[1][d], h[1][d]) for d in range(len(shape))) for h in held):
                raise PartlyHeldError(f"box {box} is cut by the shard")
            return None

        host, dev = _both("bfloat16", shape, e, pos.size, tables, base_of)
        _same(host, dev)
        total += host[0].size
    assert total == pos.size


def test_a_wrong_base_or_corrupt_stream_is_refused():
    shape = (64, 96)
    old, new = _pair(shape)
    pos, steps, base = _changes(old, new)
    e, tables = _encode("bfloat16", shape, base, pos, steps, 0b1011)
    zeros = np.zeros_like(base)  # every element in one class: ranks beyond the others' populations
    with pytest.raises(IntegrityError, match="beyond their class"):
        cdev.decode(cc.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.size, tables), lambda box: torch.from_numpy(cb.box_of(zeros, shape, box).copy()))
    with pytest.raises(IntegrityError, match="wrong size"):
        cdev.decode(cc.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.size, tables), lambda box: torch.zeros(5, dtype=torch.int16))
    with pytest.raises(IntegrityError):
        cdev.decode(cc.StoredPart("bfloat16", shape, None, e.pos[:9], e.val, pos.size, tables), lambda box: None)
    got = cdev.decode(cc.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.size, tables), lambda box: None)
    assert got[0].numel() == got[1].numel() == 0  # a rank that holds none of the part


# ----------------------------------------------------------------------------- ranks


CASES = [(1, "rows", ()), (2, "columns", ()), (4, "padded", ()), (8, "rows", ("chunked",))]


@pytest.mark.parametrize("world,how,extra", CASES)
def test_ranks_decode_on_their_device_and_never_read_the_base_to_the_host(tmp_path, monkeypatch, world, how, extra):
    """Fake ranks whose decode runs the Triton pass (and whose apply the fused kernel) take versions
    1-3 as one chained route of context-coded links (later links decoded against the live
    weights with the earlier ones laid over them, on the device): bit-exact, and the host read of
    the base (``_LiveBases.bits``) is never called."""
    from fake_ranks import FakeRanks, make_rank

    from engine_ext.server import rank as rank_mod
    from engine_ext.server.controller import Controller
    from engine_ext.server.protocol import UpdateRequest
    from engine_ext.store.sources import Sources

    name = {"rows": "model.layers.0.mlp.up_proj.weight", "columns": "model.layers.0.mlp.down_proj.weight",
            "padded": "model.embed_tokens.weight"}[how]
    shape = (130, 64) if how == "padded" else (128, 64)
    states = [{name: _pair(shape, seed=0)[0]}]
    for k in range(3):
        states.append({name: _pair(shape, seed=k + 1, base=states[-1][name])[1]})
    _publish(tmp_path, states, chunk_min_cell=1 << 10 if extra else None)
    for v in (1, 2, 3):
        doc = json.loads((tmp_path / f"v{v:08d}.json").read_text())
        parts = doc["tensors"][0]["chunks"] or [doc["tensors"][0]]
        assert {p["positions"]["coder"] for p in parts} == {"ctx-rans"} and (len(parts) > 1) == bool(extra)
    monkeypatch.setattr(rank_mod._LiveBases, "bits", lambda *a: pytest.fail("the base was read to the host"))
    decoded, real = [], cdev.decode
    monkeypatch.setattr(cdev, "decode", lambda *a, **k: decoded.append(1) or real(*a, **k))
    ranks = [make_rank(r, states[0], sharded=(name,) if world > 1 else (), world=world,
                       by_column=(name,) if how == "columns" else (), padded=(name,) if how == "padded" else ())
             for r in range(world)]
    for up in ranks:
        up.decode_backend, up.apply_backend = "device", "triton"
    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(tmp_path / "v00000003.json")})))
    assert a["version"] == 3 and decoded
    _assert_ranks_hold(ranks, name, states[3][name], world, how)
