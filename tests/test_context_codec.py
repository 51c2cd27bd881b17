"""The context-conditioned coder (format 4 ``ctx``): exact round trips, partial holders, the
two context passes side by side, hostile bytes, manifest rules, and the publisher's choice."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine_ext.format import codec, context_codec as cc
from engine_ext.store import open_store, reader
from engine_ext import settings
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import BY_NAME, as_bits, step_between
from engine_ext.errors import BaseMismatchError, IntegrityError, ManifestError
from engine_ext.format.manifest import Manifest
from engine_ext.trainer.publisher import DeltaPublisher


def _pair(shape, dtype=torch.bfloat16, seed=0, density=0.02, base=None):
    """A base (``base``, else drawn) and a version where small weights change more often, as in real training."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g)) * 0.02
    old = w.to(dtype) if base is None else base
    rate = (density * 0.01 / old.float().abs().clamp(min=1e-4)).clamp(max=0.9)  # an update of fixed size: small weights move
    chg = torch.rand(shape, generator=g) < rate
    step = torch.where(torch.rand(shape, generator=g) < 0.5, 1, -1) * (1 + (torch.rand(shape, generator=g) < rate / 2).int())
    bits = as_bits(old).clone()
    bits[chg] += step[chg].to(bits.dtype)  # one or two ULPs (same sign: no exponent wrap for these magnitudes)
    return old, bits.view(dtype)


def _changes(old, new):
    ob, nb = as_bits(old).reshape(-1), as_bits(new).reshape(-1)
    pos = torch.nonzero(ob != nb).reshape(-1)
    return pos.numpy(), step_between(ob[pos], nb[pos], True).numpy(), ob.numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(300,), (64, 96), (2, 33, 17)])
def test_round_trip_exact(dtype, shape):
    old, new = _pair(shape, dtype)
    pos, steps, base = _changes(old, new)
    name = BY_NAME[str(dtype).removeprefix("torch.")].name
    e = cc.encode(name, shape, base, pos, steps)
    got_pos, got_steps = cc.decode(name, shape, e.pos, e.val, pos.size, lambda box: cc.box_of(base, shape, box))
    assert np.array_equal(got_pos, pos) and np.array_equal(got_steps, steps)


def test_a_rank_holding_some_sub_cells_decodes_those():
    shape = (64, 96)
    old, new = _pair(shape)
    pos, steps, base = _changes(old, new)
    e = cc.encode("bfloat16", shape, base, pos, steps)
    cells = cc.sub_cells(shape)
    assert len(cells) == 4  # 2 x 2: a shard of 2 ranks along either dimension holds whole sub-cells
    top = [c for c in cells if c[0][0] == 0]
    got_pos, got_steps = cc.decode("bfloat16", shape, e.pos, e.val, pos.size,
                                   lambda box: cc.box_of(base, shape, box) if box in top else None)
    mine = pos < 32 * 96
    assert np.array_equal(got_pos, pos[mine]) and np.array_equal(got_steps, steps[mine])


def test_numba_and_numpy_context_passes_agree():
    pytest.importorskip("numba")
    old, _ = _pair((4096,), seed=3)
    bits = as_bits(old).numpy()
    lut = cc.class_lut([118, 120, 122], "bfloat16")
    cls = lut[cc.exponents(bits, "bfloat16")]
    rng = np.random.default_rng(0)
    ranks, starts = [], [0]
    for c in range(4):
        n = int((cls == c).sum())
        ranks.append(np.sort(rng.choice(n, min(n, 20), replace=False)))
        starts.append(starts[-1] + ranks[-1].size)
    ranks, starts = np.concatenate(ranks).astype(np.int64), np.array(starts, np.int64)
    a = cc.scan(bits, 7, 0xFF, lut, ranks, starts, backend="numba")
    b = cc.scan(bits, 7, 0xFF, lut, ranks, starts, backend="numpy")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    too_far = ranks.copy()
    too_far[starts[1] - 1] = int((cls == 0).sum())  # one past the class's population
    for backend in ("numba", "numpy"):
        with pytest.raises(IntegrityError, match="beyond their class"):
            cc.scan(bits, 7, 0xFF, lut, too_far, starts, backend=backend)


def test_hostile_bytes_fail_cleanly():
    shape = (64, 96)
    old, new = _pair(shape)
    pos, steps, base = _changes(old, new)
    e = cc.encode("bfloat16", shape, base, pos, steps)

    def dec(p, v, nnz=pos.size):
        return cc.decode("bfloat16", shape, p, v, nnz, lambda box: cc.box_of(base, shape, box))

    for bad in (b"", b"X", b"Y1" + e.pos[2:], e.pos[:7], e.pos[:2] + b"\x00" + e.pos[3:],
                e.pos[:2] + b"\x11" + e.pos[3:], e.pos + b"\x00"):
        with pytest.raises(IntegrityError):
            dec(bad, e.val)
    with pytest.raises(IntegrityError):
        dec(e.pos, e.val, pos.size + 1)  # the manifest's count disagrees with the header's
    with pytest.raises(IntegrityError):
        dec(e.pos, e.val[:-3])
    rng = np.random.default_rng(1)
    for _ in range(200):  # flipped bytes: an IntegrityError or a bounded (wrong) result, never a crash
        p, v = bytearray(e.pos), bytearray(e.val)
        target = p if rng.random() < 0.5 else v
        target[rng.integers(len(target))] ^= 1 << rng.integers(8)
        try:
            got_pos, got_steps = dec(bytes(p), bytes(v))
        except IntegrityError:
            continue
        assert got_pos.size == got_steps.size <= pos.size
        assert (got_pos >= 0).all() and (got_pos < base.size).all() and (np.diff(got_pos) > 0).all()


def test_the_base_fingerprint_is_checked_before_decoding(tmp_path):
    old, new = _pair((256, 256))
    with settings.override(context_coder=True), DeltaPublisher(str(tmp_path), anchor_every=0) as pub:
        pub.publish({"w": old})
        pub.publish({"w": new})
    m = reader.read_manifest(open_store(str(tmp_path)), "v00000001.json")
    assert m.tensors[0].positions.coder == "ctx"
    d = reader.load_delta(str(tmp_path / "v00000001.json"), bases=reader.TensorBases({"w": old}))
    assert torch.equal(as_bits(apply_tensor(old, d.tensors[0])), as_bits(new))
    with pytest.raises(BaseMismatchError, match="wrong base"):
        reader.load_delta(str(tmp_path / "v00000001.json"), bases=reader.TensorBases({"w": new}))
    with pytest.raises(IntegrityError, match="needs the base weights"):
        reader.load_delta(str(tmp_path / "v00000001.json"))


def test_manifest_rules(tmp_path):
    old, new = _pair((256, 256))
    with settings.override(context_coder=True), DeltaPublisher(str(tmp_path), anchor_every=0) as pub:
        pub.publish({"w": old})
        pub.publish({"w": new})
    doc = json.loads((tmp_path / "v00000001.json").read_text())
    Manifest.from_json(json.dumps(doc).encode())
    for change in ({"format_version": 3}, {"values": dict(doc["tensors"][0]["values"], mode="abs")},
                   {"values": dict(doc["tensors"][0]["values"], coder="pco")}):
        bad = json.loads(json.dumps(doc))
        if "format_version" in change:
            bad.update(change)
        else:
            bad["tensors"][0].update(change)
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(bad).encode())


def test_publisher_choice_and_switch(tmp_path):
    old, new = _pair((256, 256))
    ob, nb = as_bits(old).reshape(-1), as_bits(new).reshape(-1)
    pos = torch.nonzero(ob != nb).reshape(-1)
    plain = codec.encode(BY_NAME["bfloat16"], ob.numel(), pos, nb[pos], ob[pos])
    ctx = codec.encode(BY_NAME["bfloat16"], ob.numel(), pos, nb[pos], ob[pos], base=ob, shape=(256, 256))
    assert ctx.pos_coder == "ctx" and len(ctx.pos) + len(ctx.val) <= 0.9 * (len(plain.pos) + len(plain.val))
    # uniform changes carry no context: the plain coder is kept
    flat = ob.clone()
    flat[::50] += 1
    p2 = torch.nonzero(flat != ob).reshape(-1)
    assert codec.encode(BY_NAME["bfloat16"], ob.numel(), p2, flat[p2], ob[p2], base=ob, shape=(256, 256)).pos_coder != "ctx"
    with settings.override(context_coder=False), DeltaPublisher(str(tmp_path), anchor_every=0) as pub:
        pub.publish({"w": old})
        pub.publish({"w": new})
    doc = json.loads((tmp_path / "v00000001.json").read_text())
    assert doc["tensors"][0]["positions"]["coder"] != "ctx"


@pytest.mark.parametrize("world,chunked", [(1, False), (2, False), (2, True)])
def test_ranks_decode_a_chained_route_against_their_live_weights(tmp_path, world, chunked):
    """Fake ranks (this process) holding all or half the rows of ``w`` take versions 1-3 in one
    route of context-coded links: each link decoded against the live weights with the earlier
    links laid over them, then applied; the result is bit-exact."""
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_ranks import FakeRanks, make_rank

    from engine_ext.server.controller import Controller
    from engine_ext.server.protocol import UpdateRequest
    from engine_ext.store.sources import Sources

    states = [{"w": _pair((512, 256), seed=0)[0]}]
    for k in range(3):
        states.append({"w": _pair((512, 256), seed=k + 1, base=states[-1]["w"])[1]})
    with settings.override(context_coder=True), DeltaPublisher(
            str(tmp_path), anchor_every=0, chunk_min_cell=1 << 14 if chunked else None) as pub:
        for sd in states:
            pub.publish(sd)
    for v in (1, 2, 3):
        doc = json.loads((tmp_path / f"v{v:08d}.json").read_text())
        parts = doc["tensors"][0]["chunks"] or [doc["tensors"][0]]
        assert {p["positions"]["coder"] for p in parts} == {"ctx"}
    ranks = [make_rank(r, states[0], sharded=("w",) if world > 1 else (), world=world) for r in range(world)]
    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(tmp_path / "v00000003.json")})))
    assert a["version"] == 3
    rows = 512 // world
    for up in ranks:
        want = states[3]["w"][up.rank * rows:(up.rank + 1) * rows] if world > 1 else states[3]["w"]
        assert torch.equal(as_bits(up.module.w), as_bits(want))
