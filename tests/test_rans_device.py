"""The ctx-rans streams decoded on a device (``engine_ext.triton_kernels.rans_decode``), run by Triton's
interpreter on CPU tensors, against the host decoder (``rans_stage.decode``, numba), bit for bit: every float
dtype, the chunks of the blocks each rank of a TP layout holds (rows, columns, a padded vocabulary, fused
experts, an fp8 block-quantised shape), chunks that split and span blocks on 1, 2, 4 and 8 lanes, escaped
quotients and steps of every width; corrupt bytes refused with the host's own error; and
``context_decode.decode`` of ctx-rans parts equal to ``context.codec.decode``, its streams decoded on the device.

The interpreter runs a few ms per round of lanes: parts here hold hundreds of changes, on up to 4 lanes (the
encoder's ``LANE_MIN`` lowered so that small chunks take several)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import _interpreted
from engine_ext.errors import IntegrityError, PartlyHeldError
from engine_ext.format.context import blocks as cb, codec as cc, models as cm, rans_stage as cr
from engine_ext.format.context.models import EXACT, INT, ITEMSIZE, QMAX
from engine_ext.format.dtypes import as_bits
from engine_ext.triton_kernels import context_decode as cdev
from test_context_codec import FLOATS, _changes, _name, _pair, _shard


@pytest.fixture(scope="module")
def rd():
    """The kernel module under Triton's interpreter (CPU tensors), for this module."""
    yield from _interpreted("engine_ext.triton_kernels.rans_decode", "_rans_decode_kernel")


@pytest.fixture
def lanes(monkeypatch):
    """Small chunks take several lanes (the encoder gives a lane ``LANE_MIN`` changes, 1024 by default)."""
    monkeypatch.setattr(cr, "LANE_MIN", 16)


def _encode(name, shape, base, pos, steps, policy):
    """(the part's bytes, the version's step tables): ctx-rans keeps a part in one segment."""
    tables = cm.step_tables(name, cm.exponents(base[pos], name), steps)
    e = cc.encode(name, shape, None, policy, base, pos, steps, tables)
    return (e if isinstance(e, bytes) else e.pos), tables


def _plan(name, shape, data, nnz, tables, want=None):
    h, bl = cc.part_header(name, shape, None, data, nnz)
    assert h.magic == cr.MAGIC
    d = np.frombuffer(data, np.uint8)
    return d, cr.plan(d, h, bl, INT[ITEMSIZE[name]], tables, want), bl


def _both(rd, d, p):
    """(host, device): each decoder's (ranks, steps) as numpy, or the message of the IntegrityError it raised."""
    try:
        host = cr.decode(d, p)
    except IntegrityError as e:
        host = str(e)
    try:
        dev = rd.decode(torch.from_numpy(d.copy()), p)
        assert dev[0].dtype == torch.int64 and dev[1].dtype == {1: torch.int8, 2: torch.int16, 4: torch.int32}[
            np.dtype(p.step_dtype).itemsize]
        dev = dev[0].numpy(), dev[1].numpy()
    except IntegrityError as e:
        dev = str(e)
    return host, dev


def _same(rd, d, p):
    host, dev = _both(rd, d, p)
    assert not isinstance(host, str) and not isinstance(dev, str), (host, dev)
    assert np.array_equal(dev[0], host[0]) and np.array_equal(dev[1], host[1]) and dev[1].dtype == host[1].dtype
    return host


def _part(shape, dtype=torch.bfloat16, density=0.05, policy=0b0001, seed=0):
    name = _name(dtype)
    old, new = _pair(shape, dtype, seed=seed, density=density)
    pos, steps, base = _changes(old, new)
    data, tables = _encode(name, shape, base, pos, steps, policy)
    return name, pos, steps, data, tables


def _held(bl, shape, world, r, how):
    """The blocks rank ``r`` of ``world`` holds whole (a rank's shard cuts no block: the policy's promise)."""
    shard = [b for b in _shard(shape, world, r, how) if all(a < z for a, z in zip(*b))]
    return [i for i, box in enumerate(bl.boxes)
            if any(all(h[0][d] <= box[0][d] and box[1][d] <= h[1][d] for d in range(len(shape))) for h in shard)]


# ----------------------------------------------------------------------------- whole parts, every dtype


# CI decodes bf16 and e4m3 (the widths the engines serve); the other floats are `full` (CI time)
@pytest.mark.parametrize("dtype", [d if d in (torch.bfloat16, torch.float8_e4m3fn) else pytest.param(d, marks=pytest.mark.full)
                                   for d in FLOATS])
def test_every_dtype_decodes_alike(rd, lanes, dtype):
    shape = (48, 64)
    name, pos, steps, data, tables = _part(shape, dtype, density=0.2 if dtype.itemsize == 1 else 0.05,
                                           policy=0b1011)
    d, p, _ = _plan(name, shape, data, pos.size, tables)
    assert p.lanes.max() == 4
    ranks, got = _same(rd, d, p)
    assert ranks.size == pos.size and np.array_equal(np.sort(got), np.sort(steps))  # (block-major order)


# ----------------------------------------------------------------------------- the blocks a rank holds


def _every_rank(rd, name, shape, data, nnz, tables, worlds, how):
    _, whole, bl = _plan(name, shape, data, nnz, tables)
    for world in worlds:
        seen_blocks, seen_chunks = set(), set()
        for r in range(world):
            want = _held(bl, shape, world, r, how)
            d, p, _ = _plan(name, shape, data, nnz, tables, want)
            if world > 1 and len(whole.which) > 2:
                assert p.which.size < whole.which.size  # a rank decodes only its blocks' chunks
            _same(rd, d, p)
            seen_blocks |= set(want)
            seen_chunks |= set(p.which.tolist())
        assert seen_blocks == set(range(bl.S)) and seen_chunks == set(whole.which.tolist())


@pytest.mark.parametrize("name,shape,how", [("model.layers.0.mlp.gate_proj.weight", (96, 64), "rows"),
                                            pytest.param("model.layers.0.self_attn.o_proj.weight", (64, 96), "columns",
                                                         marks=pytest.mark.full)])
def test_tp_ranks_decode_the_chunks_of_their_blocks(rd, lanes, monkeypatch, name, shape, how):
    """TP 2, 4 and 8: each rank plans only the chunks holding its blocks (small chunks here, so that a part
    has many) and decodes them exactly as the host does."""
    monkeypatch.setattr(cr, "CHUNK_MIN", 48)
    policy = cb.block_policy(name, shape)
    _, pos, _, data, tables = _part(shape, density=0.03, policy=policy)
    _every_rank(rd, "bfloat16", shape, data, pos.size, tables, (2, 4, 8), how)


def test_a_padded_vocabulary(rd, lanes, monkeypatch):
    monkeypatch.setattr(cr, "CHUNK_MIN", 64)
    shape = (1000, 64)
    policy = cb.block_policy("model.embed_tokens.weight", shape)
    assert policy == 0b1001
    _, pos, _, data, tables = _part(shape, density=0.003, policy=policy)
    _every_rank(rd, "bfloat16", shape, data, pos.size, tables, (8,), "padded-rows")


@pytest.mark.parametrize("name,policy,how", [("model.layers.0.mlp.experts.gate_up_proj", 0b10011, "fused-halves"),
                                             pytest.param("model.layers.0.mlp.experts.up_proj", 0b0011, "experts",
                                                          marks=pytest.mark.full)])
def test_fused_experts(rd, lanes, monkeypatch, name, policy, how):
    monkeypatch.setattr(cr, "CHUNK_MIN", 8)  # the blocks a rank holds interleave with the others'; small chunks
    shape = (4, 64, 32)
    assert cb.block_policy(name, shape) == policy
    _, pos, _, data, tables = _part(shape, density=0.01, policy=policy)
    _every_rank(rd, "bfloat16", shape, data, pos.size, tables, (4,), how)


def test_an_fp8_block_quantised_weight(rd, lanes):
    """fp8 e4m3 weights of 128 x 128 scale blocks' shape, row-parallel."""
    shape = (256, 128)
    policy = cb.block_policy("model.layers.0.mlp.down_proj.weight", shape)
    name, pos, _, data, tables = _part(shape, torch.float8_e4m3fn, density=0.003, policy=policy)
    assert 300 < pos.size < 1000
    d, p, _ = _plan(name, shape, data, pos.size, tables)
    _same(rd, d, p)


# ----------------------------------------------------------------------------- chunks, lanes, escapes, steps


@pytest.mark.parametrize("n_lanes", [pytest.param(n, marks=pytest.mark.full) for n in (1, 2, 4)] + [8])  # CI: 8 (4: every other test)
def test_chunks_that_split_and_span_blocks(rd, monkeypatch, n_lanes):
    """Blocks of more than CHUNK_CHANGES cut into chunks that continue their (block, class) from ``prev``, small
    blocks gathered into chunks that span them (rounds crossing (block, class) groups), on 1-8 lanes; and the
    chunks of one block in the middle alone."""
    monkeypatch.setattr(cr, "CHUNK_CHANGES", 40)
    monkeypatch.setattr(cr, "CHUNK_MIN", 24)
    monkeypatch.setattr(cr, "LANES", n_lanes)
    monkeypatch.setattr(cr, "LANE_MIN", 4)
    shape = (64, 48)
    for policy, density in ((0b0001, 0.1 if n_lanes > 1 else 0.05), (0b1011, 0.05)):
        name, pos, _, data, tables = _part(shape, density=density, policy=policy, seed=n_lanes)
        d, p, bl = _plan(name, shape, data, pos.size, tables)
        assert p.lanes.max() == n_lanes if n_lanes <= 4 else p.lanes.max() > 4  # (6 and 7 lanes: width 8)
        block_end = np.cumsum(p.starts[:, -1] - p.starts[:, 0])
        c_last = np.searchsorted(block_end, p.c_start[1:] - 1, side="right")
        if policy == 0b0001:
            assert (p.prev > 0).any()  # chunks that continue a (block, class)
        else:
            assert (c_last > p.c_block).any()  # chunks that span blocks
        _same(rd, d, p)
        d, p, _ = _plan(name, shape, data, pos.size, tables, want=[bl.S // 2])
        assert 0 < p.which.size < len(p.lanes)
        _same(rd, d, p)


def test_escaped_quotients(rd, monkeypatch):
    """A few changes in a huge block: gaps far beyond the Golomb parameter's reach escape to 48 raw bits,
    several in one round, some in the rounds' last lanes."""
    monkeypatch.setattr(cr, "LANE_MIN", 4)
    n = 1 << 20
    base = as_bits(_pair((n,))[0]).numpy()
    pos = np.concatenate([np.arange(0, 600, 3), 600 + np.arange(1, 7) * (n // 7)])  # 2^B ~ n / 4k: gaps of n / 7
    steps = np.where(np.arange(pos.size) % 3, 1, -2).astype(np.int16)
    data, tables = _encode("bfloat16", (n,), base, pos, steps, 0)
    d, p, _ = _plan("bfloat16", (n,), data, pos.size, tables)
    ranks, _ = _same(rd, d, p)
    escapes = 0
    for g in range(p.gend.size):
        a, z = (p.gend[g - 1] if g else 0), p.gend[g]
        gaps = np.diff(np.concatenate([[-1], ranks[a:z]])) - 1
        escapes += int(((gaps >> p.gB[g]) >= QMAX).sum())
    assert escapes >= 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.full),
                                   pytest.param(torch.float8_e5m2, marks=pytest.mark.full)])
def test_big_steps(rd, lanes, dtype):
    """Steps of every magnitude up to the dtype's width (the extremes included): symbols from EXACT on, with up
    to 31 low bits each."""
    name = _name(dtype)
    shape = (32, 48)
    w = 8 * dtype.itemsize
    rng = np.random.default_rng(w)
    base = as_bits(_pair(shape, dtype)[0]).reshape(-1).numpy()
    pos = np.sort(rng.choice(base.size, 200, replace=False))
    top = np.int64(1) << rng.integers(0, w - 1, pos.size)
    mag = top + rng.integers(0, top)  # |step| in [2^e, 2^(e + 1)), e up to w - 2
    steps = np.where(rng.random(pos.size) < 0.5, -mag, mag)
    steps[:2] = -(1 << (w - 1)), (1 << (w - 1)) - 1
    steps = steps.astype(INT[dtype.itemsize])
    data, tables = _encode(name, shape, base, pos, steps, 0b0001)
    d, p, _ = _plan(name, shape, data, pos.size, tables)
    _, got = _same(rd, d, p)
    assert np.array_equal(np.sort(got), np.sort(steps))
    assert (cm.zigzag(got, dtype.itemsize) >= EXACT).mean() > 0.5
    if dtype.itemsize > 1:  # steps wider than the dtype a plan names: refused (code -8)
        host, dev = _both(rd, d, cr.Plan(**{**p.__dict__, "step_dtype": np.dtype(np.int8)}))
        assert host == "ctx-rans: corrupt chunk (code -8)" and dev == host


# ----------------------------------------------------------------------------- corrupt parts


def _corrupt_part(monkeypatch):
    monkeypatch.setattr(cr, "CHUNK_CHANGES", 30)
    monkeypatch.setattr(cr, "CHUNK_MIN", 20)
    monkeypatch.setattr(cr, "LANE_MIN", 4)
    shape = (64, 48)
    name, pos, _, data, tables = _part(shape, density=0.03, policy=0b0001, seed=3)
    d, p, _ = _plan(name, shape, data, pos.size, tables)
    assert len(p.lanes) >= 3 and p.lanes.max() == 4 and (p.nbypass > 0).sum() >= 2
    return name, shape, pos.size, data, tables, p


def test_corrupt_bytes_are_refused_as_the_host_refuses(rd, monkeypatch):
    """Bytes flipped in a chunk's words, its bypass bits (low bits, step bits, padding) and its lane states: each
    decoder refuses with the same error (the same chunk's code), or both decode the same (the chunks of the
    corrupt chunk's block decoded, as a rank holding it would)."""
    name, shape, nnz, data, tables, p = _corrupt_part(monkeypatch)
    states_at = int(p.offs[0]) - 4 * int(p.states.size)
    spots = []
    for ch in np.flatnonzero(p.nbypass > 0)[[0, -1]].tolist():
        w0, b0 = int(p.offs[ch]), int(p.offs[ch] + 2 * p.nwords[ch])
        b1 = b0 + int(p.nbypass[ch])
        spots += [(ch, at, bit) for at, bit in [(w0, 0x01), ((w0 + b0) // 2, 0x80), (b0 - 1, 0x10), (b0, 0x01),
                                                 ((b0 + b1) // 2, 0x04), (b1 - 1, 0x80)]]
    last = len(p.lanes) - 1
    spots += [(0, states_at, 0x01), (last, states_at + 4 * int(p.c_state[last]) + 1, 0x40)]
    refused = 0
    for ch, at, bit in spots:
        bad = bytearray(data)
        bad[at] ^= bit
        try:
            d, q, _ = _plan(name, shape, bytes(bad), nnz, tables, want=[int(p.c_block[ch])])
        except IntegrityError:
            continue  # the plan (host work both decoders share) refused it
        assert ch in q.which.tolist()
        host, dev = _both(rd, d, q)
        if isinstance(host, str):
            assert dev == host, (at, bit)
            refused += 1
        else:
            assert not isinstance(dev, str) and all(np.array_equal(a, b) for a, b in zip(host, dev)), (at, bit, dev)
    assert refused >= len(spots) // 2  # (a flipped low bit may make other ranks, still valid: both decode it alike)


def test_truncated_and_mismatched_bytes_are_refused(rd, monkeypatch):
    """A part cut short is refused (by the plan, or by both decoders alike: its last chunk's bypass comes up
    short); bytes that are not the plan's part never reach the kernel."""
    name, shape, nnz, data, tables, p = _corrupt_part(monkeypatch)
    for cut in (1, 3, 40):
        try:
            d, q, _ = _plan(name, shape, data[:-cut], nnz, tables, want=[int(p.c_block[-1])])
        except IntegrityError:
            continue
        host, dev = _both(rd, d, q)
        assert isinstance(host, str) and dev == host, (cut, host, dev)
    d = np.frombuffer(data, np.uint8)
    with pytest.raises(IntegrityError, match="bytes where the plan"):
        rd.decode(torch.from_numpy(d[:-3].copy()), p)  # every read of the kernel stays inside the bytes it has


def test_directory_claims_the_kernel_checks(rd, monkeypatch):
    """A chunk naming a rank before it while it starts its (block, class) (code -7), and one that continues its
    (block, class) from a rank other than where the previous chunk ended (the continuation check, on the
    device): refused by both decoders alike."""
    name, shape, nnz, data, tables, p = _corrupt_part(monkeypatch)
    d = np.frombuffer(data, np.uint8)
    assert p.prev[0] == 0 and (p.prev > 0).any()
    for ch, delta in ((0, 5), (int(np.flatnonzero(p.prev > 0)[0]), 1), (int(np.flatnonzero(p.prev > 0)[-1]), -1)):
        q = cr.Plan(**{**p.__dict__, "prev": p.prev.copy(), "which": np.array([ch, len(p.lanes) - 1])})
        q.prev[ch] += delta
        host, dev = _both(rd, d, q)
        assert isinstance(host, str) and dev == host, (ch, delta, host, dev)
    q = cr.Plan(**{**p.__dict__, "gsize": np.minimum(p.gsize, 20), "which": p.which[-2:]})  # ranks past a block
    host, dev = _both(rd, d, q)
    assert host == "ctx-rans: corrupt chunk (code -6)" and dev == host


# ----------------------------------------------------------------------------- context_decode.decode


def test_context_device_decodes_ctx_rans_streams_on_the_device(rd, ctx_interp, lanes, monkeypatch):
    """``context_decode.decode`` of a ctx-rans part (whole, and one TP-2 rank's blocks) equals the host decoder
    (``context.codec.decode``): its streams decoded by the kernel (the host stream decoder never called; on the
    CPU only where ``CPU_TOO`` says so), the context pass on the device; the torch backend keeps the host
    streams."""
    monkeypatch.setattr(cr, "CHUNK_MIN", 64)
    monkeypatch.setattr(rd, "CPU_TOO", True)
    assert rd.serves(torch.device("cuda", 0)) and rd.serves("cpu")
    shape = (96, 64)
    name = "model.layers.0.mlp.gate_proj.weight"
    old, new = _pair(shape, density=0.03)
    pos, steps, base = _changes(old, new)
    data, tables = _encode("bfloat16", shape, base, pos, steps, cb.block_policy(name, shape))
    launches = []
    real = rd.decode
    monkeypatch.setattr(rd, "decode", lambda *a: launches.append(1) or real(*a))
    rank1 = _shard(shape, 2, 1, "rows")[0]

    def base_of(box, numpy=True, only=None):
        if only is not None and not all(only[0][i] <= box[0][i] and box[1][i] <= only[1][i] for i in range(2)):
            if all(max(box[0][i], only[0][i]) < min(box[1][i], only[1][i]) for i in range(2)):
                raise PartlyHeldError("cut")
            return None
        got = cb.box_of(base, shape, box)
        return got if numpy else torch.from_numpy(np.ascontiguousarray(got).copy())

    for only in (None, rank1):
        host = cc.decode(cc.StoredPart("bfloat16", shape, None, data, b"", pos.size, tables), lambda b: base_of(b, True, only))
        with monkeypatch.context() as m:
            m.setattr(cdev, "decode_streams", lambda *a, **k: pytest.fail("the streams were decoded on the host"))
            dev = cdev.decode(cc.StoredPart("bfloat16", shape, None, data, b"", pos.size, tables), lambda b: base_of(b, False, only))
        torch_backend = cdev.decode(cc.StoredPart("bfloat16", shape, None, data, b"", pos.size, tables), lambda b: base_of(b, False, only), backend="torch")
        for got in (dev, torch_backend):
            assert got[0].dtype == torch.int64 and got[1].dtype == torch.int16
            assert np.array_equal(got[0].numpy(), host[0]) and np.array_equal(got[1].numpy(), host[1])
        assert host[0].size == (pos.size if only is None else int((pos >= 48 * 64).sum()))
    assert len(launches) == 2
    monkeypatch.setattr(rd, "CPU_TOO", False)  # a base on the CPU: the host's decoder is the CPU's own
    assert not rd.serves("cpu")
    got = cdev.decode(cc.StoredPart("bfloat16", shape, None, data, b"", pos.size, tables), lambda b: base_of(b, False))
    assert np.array_equal(got[0].numpy(), pos) and len(launches) == 2
    monkeypatch.setattr(rd, "CPU_TOO", True)
    _, p, _ = _plan("bfloat16", shape, data, pos.size, tables)
    bad = bytearray(data)
    bad[int(p.offs[0]) - 1] ^= 0x01  # the last lane's state
    with pytest.raises(IntegrityError, match="corrupt chunk"):
        cdev.decode(cc.StoredPart("bfloat16", shape, None, bytes(bad), b"", pos.size, tables), lambda b: base_of(b, False))
    with pytest.raises(IntegrityError, match="no values segment"):
        cdev.decode(cc.StoredPart("bfloat16", shape, None, data, b"\0", pos.size, tables), lambda b: base_of(b, False))
