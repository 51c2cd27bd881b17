"""The context-conditioned coder (format 5 ``ctx``): exact round trips on every float dtype,
every shard of every layout decoded from its own base alone, the context pass against its
definition, hostile bytes, the manifest's rules, and the publisher's choice (on by default)."""
from __future__ import annotations

import hashlib
import json
import types

import numpy as np
import pytest
import torch

from engine_ext.format import codec
from engine_ext.format.context import blocks as cb, codec as cc, models as cm, scan_kernels as ck
from engine_ext.store import decoding, open_store, reader
from engine_ext import settings
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import BY_NAME, as_bits, step_between
from engine_ext.errors import BaseMismatchError, IntegrityError, ManifestError, PartlyHeldError
from engine_ext.format.manifest import Manifest
from engine_ext.trainer import builder
from engine_ext.trainer.publisher import DeltaPublisher

import legacy_ctx

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


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


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode(name, shape, base, pos, steps, policy, box=None):
    exps = cm.exponents(base[pos], name)
    tables = cm.step_tables(name, exps, steps)
    return cc.encode(name, shape, box, policy, base, pos, steps, tables), tables


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,policy", [((300,), 0b0001), ((64, 96), 0b1011), ((200, 96), 0b1011),
                                          ((4, 48, 40), 0b0111), ((64, 96), 0)])
def test_round_trip_exact(dtype, shape, policy):
    old, new = _pair(shape, dtype, density=0.2 if dtype.itemsize == 1 else 0.02)
    pos, steps, base = _changes(old, new)
    name = _name(dtype)
    e, tables = _encode(name, shape, base, pos, steps, policy)
    got_pos, got_steps = cc.decode(cc.StoredPart(name, shape, None, e.pos, e.val, pos.size, tables), lambda box: cb.box_of(base, shape, box))
    assert np.array_equal(got_pos, pos) and np.array_equal(got_steps, steps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_big_parts_look_classes_up_by_the_top_bits(dtype):
    shape = (1024, 1024)
    assert cb.part_blocks(shape, None, 0b0011).numel >= cm.WIDE_MIN
    old, new = _pair(shape, dtype, density=0.005)
    pos, steps, base = _changes(old, new)
    e, tables = _encode(_name(dtype), shape, base, pos, steps, 0b0011)
    got = cc.decode(cc.StoredPart(_name(dtype), shape, None, e.pos, e.val, pos.size, tables), lambda box: cb.box_of(base, shape, box))
    assert np.array_equal(got[0], pos) and np.array_equal(got[1], steps)


def test_the_decoders_models_are_pinned():
    """Every probability a decoder uses is built from integers and IEEE + - * / only, so every
    host builds the same models; pinned, so that a changed model is a new format, not a drift."""
    h = hashlib.sha256()
    for key in range(5 * 16):
        h.update(cm.quotient_probs(key).tobytes())
    h.update(cm.table_weights(bytes(range(1, 256))).tobytes())
    assert h.hexdigest() == PINNED, h.hexdigest()


PINNED = "7f6f45e7c044038fe2a824126985bb7c21e65dda12297372451ccc11d4d2d67a"


def _layouts():
    """(tensor name, shape, ranks, how a rank's share is cut): the engines' shards."""
    out = []
    for world in (2, 4, 8):
        out += [("model.layers.0.mlp.gate_proj.weight", (96, 64), world, "rows"),
                ("model.layers.0.self_attn.o_proj.weight", (64, 96), world, "columns"),
                ("model.embed_tokens.weight", (200, 64), world, "padded-rows"),  # 200 rows -> 256 split
                ("lm_head.weight", (130, 64), world, "padded-rows"),
                ("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 32), world, "fused-halves"),
                ("model.layers.0.mlp.experts.down_proj", (4, 32, 32), world, "last"),
                ("model.layers.0.mlp.experts.down_proj", (8, 32, 32), world, "experts"),
                ("some.custom.weight", (64, 96), world, "rows"), ("some.custom.weight", (64, 96), world, "columns")]
    return out


def _shard(shape, world, r, how):
    """The box of the checkpoint tensor that rank ``r`` of ``world`` holds."""
    start, stop = [0] * len(shape), list(shape)
    if how in ("rows", "experts"):
        n = shape[0] // world
        start[0], stop[0] = r * n, (r + 1) * n
    elif how == "columns":
        n = shape[1] // world
        start[1], stop[1] = r * n, (r + 1) * n
    elif how == "padded-rows":
        n = -(-shape[0] // 64) * 64 // world
        start[0], stop[0] = min(shape[0], r * n), min(shape[0], (r + 1) * n)
    elif how == "last":
        n = shape[-1] // world
        start[-1], stop[-1] = r * n, (r + 1) * n
    elif how == "fused-halves":  # gate and up halves of dimension 1, each split: two ranges per rank
        half = shape[1] // 2
        n = half // world
        return [(tuple(start[:1]) + (h * half + r * n,) + tuple(start[2:]),
                 tuple(stop[:1]) + (h * half + (r + 1) * n,) + tuple(stop[2:])) for h in (0, 1)]
    return [(tuple(start), tuple(stop))]


@pytest.mark.parametrize("name,shape,world,how", _layouts())
def test_every_shard_decodes_from_its_own_base(name, shape, world, how):
    """Each rank of each layout decodes exactly the changes in what it holds, asking only for
    boxes inside its shard (never another rank's base)."""
    old, new = _pair(shape, density=0.5)
    pos, steps, base = _changes(old, new)
    policy = cb.block_policy(name, shape)
    assert policy is not None
    e, tables = _encode("bfloat16", shape, base, pos, steps, policy)
    coords = np.stack(np.unravel_index(pos, shape), axis=1)
    seen = np.zeros(pos.size, dtype=bool)
    for r in range(world):
        held = [b for b in _shard(shape, world, r, how) if all(a < z for a, z in zip(*b))]

        def inside(box, h):
            return all(h[0][d] <= box[0][d] and box[1][d] <= h[1][d] for d in range(len(shape)))

        def meets(box, h):
            return all(max(box[0][d], h[0][d]) < min(box[1][d], h[1][d]) for d in range(len(shape)))

        def base_of(box):
            if any(inside(box, h) for h in held):
                return cb.box_of(base, shape, box)
            if any(meets(box, h) for h in held):
                raise PartlyHeldError(f"box {box} is cut by the shard")
            return None

        got_pos, got_steps = cc.decode(cc.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.size, tables), base_of)
        mine = np.zeros(pos.size, dtype=bool)
        for h in held:
            mine |= np.all((coords >= np.array(h[0])) & (coords < np.array(h[1])), axis=1)
        assert np.array_equal(got_pos, pos[mine]) and np.array_equal(got_steps, steps[mine])
        seen |= mine
    assert seen.all()


def test_a_rank_decodes_only_the_chunks_of_its_blocks(monkeypatch):
    """Format 9 lays a part's changes out block-major in chunks: a TP 8 rank holding one block's rows plans
    (and decodes) only the chunks that hold that block, and gets exactly its changes."""
    from engine_ext.format.context import rans_stage as cr

    monkeypatch.setattr(cr, "CHUNK_MIN", 64)  # small chunks: one or two blocks each
    shape = (512, 128)
    old, new = _pair(shape, density=0.2)
    pos, steps, base = _changes(old, new)
    e, tables = _encode("bfloat16", shape, base, pos, steps, 0b0001)
    h, bl = cc.part_header("bfloat16", shape, None, e.pos, pos.size)
    data = np.frombuffer(e.pos, np.uint8)
    every = cr.plan(data, h, bl, np.int16, tables)
    assert bl.S == 8 and every.which.size >= 8
    rows = 512 // 8
    for r in range(8):
        mine = cr.plan(data, h, bl, np.int16, tables, want=[r])
        assert 1 <= mine.which.size < every.which.size  # only the chunks that hold block r
        held = ((r * rows, 0), ((r + 1) * rows, 128))

        def base_of(box, held=held):
            if box == held:
                return cb.box_of(base, shape, box)
            if box[1][0] <= held[0][0] or box[0][0] >= held[1][0]:
                return None
            raise PartlyHeldError("the box is cut by the shard")

        got_pos, got_steps = cc.decode(cc.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.size, tables), base_of)
        keep = (pos // 128 >= r * rows) & (pos // 128 < (r + 1) * rows)
        assert np.array_equal(got_pos, pos[keep]) and np.array_equal(got_steps, steps[keep])


def test_block_policies_follow_the_engines():
    p = cb.block_policy
    assert p("model.layers.3.self_attn.q_proj.weight", (64, 64)) == 0b0001
    assert p("model.layers.3.self_attn.q_proj.bias", (64,)) == 0b0001
    assert p("model.layers.3.self_attn.o_proj.weight", (64, 64)) == 0b0010
    assert p("model.layers.3.self_attn.o_proj.bias", (64,)) == 0  # replicated
    assert p("model.embed_tokens.weight", (100, 64)) == 0b1001
    assert p("model.layers.3.input_layernorm.weight", (64,)) == 0
    assert p("model.layers.3.mlp.experts.7.down_proj.weight", (64, 32)) == 0b0010
    assert p("model.layers.3.mlp.experts.gate_up_proj", (8, 64, 32)) == 0b10011
    assert p("model.layers.3.mlp.experts.down_proj", (8, 32, 32)) == 0b0101
    assert p("model.layers.3.self_attn.qkv_proj.weight", (96, 32)) is None  # several ranges per rank
    assert p("model.layers.3.mlp.gate_up_proj.weight", (64, 32)) is None
    assert p("model.layers.3.mlp.gate.weight", (8, 32)) == 0b1011  # anything else: both leading dimensions
    assert cb.shard_cuts(200, padded_vocab=True) == [25, 32, 50, 64, 75, 96, 100, 125, 128, 150, 160, 175, 192]
    assert cb.shard_cuts(96) == [12, 24, 36, 48, 60, 72, 84]


def _model_scan(u, shift, mask, lut, bl, ranks, starts):
    """The context pass from its definition: per block, the element of class c with rank r is
    the r-th of that class in the block's row-major order."""
    pos, src = [], []
    for b in range(bl.S):
        elems = np.concatenate([np.arange(s, s + bl.run[b]) for s in bl.rows[bl.row_ptr[b]:bl.row_ptr[b + 1]]])
        cls = lut[(u[elems] >> shift) & mask]
        found = []
        for c in range(starts.shape[1] - 1):
            of_c = elems[cls == c]
            for j in range(starts[b, c], starts[b, c + 1]):
                if ranks[j] >= of_c.size:
                    raise IntegrityError("beyond their class")
                found.append((of_c[ranks[j]], j))
        found.sort()
        pos += [p for p, _ in found]
        src += [j for _, j in found]
    return np.array(pos, np.int64), np.array(src, np.int64)


def test_the_context_pass_matches_its_definition():
    shape = (48, 40)
    old, _ = _pair(shape, seed=3)
    u = as_bits(old).reshape(-1).numpy().view(np.uint16)
    bl = cb.part_blocks(shape, None, 0b1011)
    lut = cm.class_lut([118, 120, 122], "bfloat16")
    rng = np.random.default_rng(0)
    ranks, starts = [], np.zeros((bl.S, 5), np.int64)
    for b in range(bl.S):
        elems = np.concatenate([np.arange(s, s + bl.run[b]) for s in bl.rows[bl.row_ptr[b]:bl.row_ptr[b + 1]]])
        cls = lut[(u[elems] >> 7) & 0xFF]
        for c in range(4):
            n = int((cls == c).sum())
            ranks.append(np.sort(rng.choice(n, min(n, 3), replace=False)))
            starts[b, c + 1] = starts[b, c] + ranks[-1].size
        if b + 1 < bl.S:
            starts[b + 1, 0] = starts[b, 4]
    ranks = np.concatenate(ranks).astype(np.int64)
    got = ck.scan(u, "bfloat16", [118, 120, 122], bl, ranks, starts)
    want = _model_scan(u, 7, 0xFF, lut, bl, ranks, starts)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    too_far = ranks.copy()
    too_far[starts[0, 1] - 1] += 1000  # past the class's population in block 0
    with pytest.raises(IntegrityError, match="beyond their class"):
        ck.scan(u, "bfloat16", [118, 120, 122], bl, too_far, starts)


LAYOUTS = {"ctx-rans": cc.encode, "ctx": legacy_ctx.encode}  # format 9's writer, format 5's (kept in tests)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hostile_bytes_fail_cleanly(layout):
    shape = (64, 96)
    old, new = _pair(shape)
    pos, steps, base = _changes(old, new)
    tables = cm.step_tables("bfloat16", cm.exponents(base[pos], "bfloat16"), steps)
    e = LAYOUTS[layout]("bfloat16", shape, None, 0b1011, base, pos, steps, tables)

    def dec(p, v, nnz=pos.size, tabs=tables):
        return cc.decode(cc.StoredPart("bfloat16", shape, None, p, v, nnz, tabs), lambda box: cb.box_of(base, shape, box))

    for bad in (b"", b"X", b"X1" + e.pos[2:], e.pos[:7], e.pos[:2] + b"\x00" + e.pos[3:],
                e.pos[:2] + b"\x11" + e.pos[3:], e.pos[:3] + b"\x20" + e.pos[4:], e.pos + b"\x00"):
        with pytest.raises(IntegrityError):
            dec(bad, e.val)
    with pytest.raises(IntegrityError):
        dec(e.pos, e.val, pos.size + 1)  # the manifest's count disagrees with the header's
    with pytest.raises(IntegrityError):
        dec(*((e.pos, e.val[:-3]) if e.val else (e.pos[:-3], e.val)))  # the streams cut short
    with pytest.raises(IntegrityError, match="step table"):
        dec(e.pos, e.val, tabs=tables[:0])
    if layout == "ctx-rans":
        with pytest.raises(IntegrityError, match="no values segment"):
            dec(e.pos, b"\x00")
    rng = np.random.default_rng(1)
    for _ in range(200):  # flipped bytes: an IntegrityError or a bounded (wrong) result, never a crash
        p, v = bytearray(e.pos), bytearray(e.val)
        target = p if rng.random() < 0.5 or not v else v
        target[rng.integers(len(target))] ^= 1 << rng.integers(8)
        try:
            got_pos, got_steps = dec(bytes(p), bytes(v))
        except IntegrityError:
            continue
        assert got_pos.size == got_steps.size <= pos.size
        assert (got_pos >= 0).all() and (got_pos < base.size).all() and (np.diff(got_pos) > 0).all()


def _publish(tmp_path, states, **kw):
    with DeltaPublisher(str(tmp_path), anchor_every=0, **kw) as pub:
        for sd in states:
            pub.publish(sd)


def test_bytes_first_codes_v2_and_the_base_fingerprint_is_checked_first(tmp_path):
    old, new = _pair((256, 256))
    assert settings.current().reader_mbps == 0  # the suite's publishers code bytes first (conftest)
    _publish(tmp_path, [{"w": old}, {"w": new}])
    m = reader.read_manifest(open_store(str(tmp_path)), "v00000001.json")
    assert m.tensors[0].positions.coder == "ctx-rans" and m.format_version == 9 and m.step_tables["bfloat16"]
    d = reader.load_delta(str(tmp_path / "v00000001.json"), bases=decoding.TensorBases({"w": old}))
    assert torch.equal(as_bits(apply_tensor(old, d.tensors[0])), as_bits(new))
    with pytest.raises(BaseMismatchError, match="wrong base"):
        reader.load_delta(str(tmp_path / "v00000001.json"), bases=decoding.TensorBases({"w": new}))
    with pytest.raises(IntegrityError, match="needs the base weights"):
        reader.load_delta(str(tmp_path / "v00000001.json"))


def test_manifest_rules(tmp_path):
    old, new = _pair((256, 256))
    _publish(tmp_path, [{"w": old}, {"w": new}])
    doc = json.loads((tmp_path / "v00000001.json").read_text())
    Manifest.from_json(json.dumps(doc).encode())
    table = doc["step_tables"]["bfloat16"][0]
    for change in ({"format_version": 4}, {"step_tables": None}, {"step_tables": {"bfloat16": []}},
                   {"step_tables": {"bfloat16": [table[:-2]]}}, {"step_tables": {"bfloat16": ["00" + table[2:]]}},
                   {"step_tables": {"int8": [table]}}, {"step_tables": {"bfloat16": [table] * 65}},
                   {"values": dict(doc["tensors"][0]["values"], mode="abs")},
                   {"values": dict(doc["tensors"][0]["values"], coder="pco")}):
        bad = json.loads(json.dumps(doc))
        if "values" in change:
            bad["tensors"][0].update(change)
        else:
            bad.update(change)
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(bad).encode())


def test_publisher_choice_and_switch(tmp_path):
    old, new = _pair((256, 256))
    ob, nb = as_bits(old).reshape(-1), as_bits(new).reshape(-1)
    pos = torch.nonzero(ob != nb).reshape(-1)
    tables = cm.step_tables("bfloat16", cm.exponents(ob[pos].numpy(), "bfloat16"), step_between(ob[pos], nb[pos], True).numpy())
    context = codec.Context(ob, 0b1011, tables)
    plain = codec.encode(BY_NAME["bfloat16"], ob.numel(), pos, nb[pos], ob[pos])
    ctx = codec.encode(BY_NAME["bfloat16"], ob.numel(), pos, nb[pos], ob[pos], context=context, shape=(256, 256))
    assert ctx.pos_coder == "ctx-rans" and len(ctx.pos) + len(ctx.val) <= 0.9 * (len(plain.pos) + len(plain.val))
    # uniform changes carry no context: the plain coder is kept
    flat = ob.clone()
    flat[::50] += 1
    p2 = torch.nonzero(flat != ob).reshape(-1)
    assert codec.encode(BY_NAME["bfloat16"], ob.numel(), p2, flat[p2], ob[p2], context=context,
                        shape=(256, 256)).pos_coder != "ctx-rans"
    with settings.override(context_coder=False):
        _publish(tmp_path, [{"w": old}, {"w": new}])
    doc = json.loads((tmp_path / "v00000001.json").read_text())
    assert doc["tensors"][0]["positions"]["coder"] != "ctx-rans" and doc["step_tables"] is None


def test_the_publisher_chooses_v2_where_it_pays_on_its_readers(tmp_path, monkeypatch):
    """v2 costs every reader its streams (host, per change, plus a fixed cost per part) and a pass over the
    base (per element: on the host for CPU readers, on the device for GPU readers); it saves bytes. A rank
    fetches a part while it decodes the one before, so the publisher keeps a part context coded where the
    longer of its fetch and its decode is shorter than plain coding's, on the readers it is told of: the
    deployed default (GPU readers at 100 MB/s) takes v2 on big parts, not on small ones, and a publisher
    whose readers v2 cannot pay on spends no step tables and no pass over the base."""
    gpu_fast, gpu_link, cpu_fast = codec.Readers("gpu", 100), codec.Readers("gpu", 1000), codec.Readers("cpu", 100)
    changes, elements = 100_000, 10_000_000  # a 1 % part: 1.1 B per change plainly, 0.85 context coded (measured)
    plain, coded = 110_000, 85_000
    assert gpu_fast.pays(plain, coded, changes, elements)  # 0.85 ms of fetch hides its ~0.83 ms of decode: < 1.1 ms
    assert not gpu_link.pays(plain, coded, changes, elements)  # at 1 GB/s the decode is what a rank waits for
    assert not cpu_fast.pays(plain, coded, changes, elements)  # the host pass over 10 M elements adds 10 ms
    assert not gpu_fast.pays(1100, 850, 1000, 100_000)  # a small part: its fixed cost outweighs its fetch
    assert codec.Readers("cpu", 0).pays(1, 1, changes, elements)  # bytes first
    assert settings.Settings().reader_mbps == 100 and codec.Readers() == gpu_fast  # the deployed default
    with pytest.raises(ValueError, match="ENGINE_EXT_READER_DEVICE"):
        settings.Settings.from_env({"ENGINE_EXT_READER_DEVICE": "tpu"})
    with pytest.raises(ValueError, match="ENGINE_EXT_READER_MBPS"):
        settings.Settings.from_env({"ENGINE_EXT_READER_MBPS": "-1"})

    seen = []
    real = codec.step_histograms  # what the publisher's step tables are made from
    monkeypatch.setattr(codec, "step_histograms", lambda changes: seen.append(list(changes)) or real(seen[-1]))
    old, new = _pair((256, 256))
    for mbps, want in ((1000.0, False), (0.05, True)):  # 1 GB/s: v2's decode would be what a rank waits for
        with settings.override(reader_device="gpu", reader_mbps=mbps):
            _publish(tmp_path / str(mbps), [{"w": old}, {"w": new}])
        m = reader.read_manifest(open_store(str(tmp_path / str(mbps))), "v00000001.json")
        assert (m.tensors[0].positions.coder == "ctx-rans") == want and bool(m.step_tables) == want
    assert [len(c) for c in seen] == [0, 1]  # the fast link: the sample is never asked, no tables from any change
    d = reader.load_delta(str(tmp_path / "0.05" / "v00000001.json"), bases=decoding.TensorBases({"w": old}))
    assert torch.equal(as_bits(apply_tensor(old, d.tensors[0])), as_bits(new))


def test_a_sample_decides_whether_the_context_is_worth_a_pass():
    """Changes that follow the exponents are tried; uniform ones (nothing to gain) skip the
    passes over the whole base."""
    old, new = _pair((512, 512))
    pos, _, base = _changes(old, new)
    some = cc.sample(torch.from_numpy(base))
    assert some.size == cc.SAMPLE_RUNS * cc.SAMPLE_RUN
    assert cc.pays("bfloat16", some, base[pos], base.size, codec.CONTEXT_GAIN)
    uniform = np.flatnonzero(np.random.default_rng(0).random(base.size) < pos.size / base.size)
    assert not cc.pays("bfloat16", some, base[uniform], base.size, codec.CONTEXT_GAIN)


def test_uniform_changes_build_no_step_tables(tmp_path, monkeypatch):
    """Where no tensor's sample promises a gain, the publisher builds no step tables (a pass over
    every change) and codes every tensor plainly; tensors that do promise one still get them."""
    seen = []
    real = codec.step_histograms
    monkeypatch.setattr(codec, "step_histograms", lambda changes: seen.append(list(changes)) or real(seen[-1]))
    old, _ = _pair((256, 256))
    uniform = as_bits(old).clone().reshape(-1)
    uniform[::50] += 1
    follows, _ = _pair((256, 256), seed=1)
    follows_new = _pair((256, 256), seed=1, base=follows)[1]
    _publish(tmp_path, [{"a": old, "b": follows}, {"a": uniform.view(torch.bfloat16).reshape(256, 256), "b": follows_new}])
    m = reader.read_manifest(open_store(str(tmp_path)), "v00000001.json")
    coders = {t.name: t.positions.coder for t in m.tensors}
    assert coders["a"] != "ctx-rans" and coders["b"] == "ctx-rans"
    assert [len(c) for c in seen] == [1]  # the tables were built from tensor b's changes alone
    d = reader.load_delta(str(tmp_path / "v00000001.json"), bases=decoding.TensorBases({"a": old, "b": follows}))
    got = {t.name: t for t in d.tensors}
    assert torch.equal(as_bits(apply_tensor(old, got["a"])).reshape(-1), uniform)
    assert torch.equal(as_bits(apply_tensor(follows, got["b"])), as_bits(follows_new))


def test_the_publisher_never_copies_the_model_for_the_context(tmp_path):
    """The context's base is the kept bits with the old bits put back, read in the background:
    the next version's diff waits for that read, and every version decodes exactly."""
    states = [{"w": _pair((256, 256), seed=0)[0]}]
    for k in range(4):
        states.append({"w": _pair((256, 256), seed=k + 1, base=states[-1]["w"])[1]})
    _publish(tmp_path, states)
    w = states[0]["w"]
    for v in range(1, 5):
        d = reader.load_delta(str(tmp_path / f"v{v:08d}.json"), bases=decoding.TensorBases({"w": w}))
        w = apply_tensor(w, d.tensors[0])
        assert torch.equal(as_bits(w), as_bits(states[v]["w"]))


CASES = [(1, "rows", ()), (2, "rows", ()), (4, "rows", ()), (8, "rows", ()), (2, "columns", ()), (8, "columns", ()),
         (2, "rows", ("chunked",)), (4, "padded", ())]


def _assert_ranks_hold(ranks, name: str, final: torch.Tensor, world: int, how: str) -> None:
    """Each fake rank's parameter holds its share of ``final`` (rows, columns, or padded rows), bit for bit."""
    for up in ranks:
        p = up.module.param(name)
        if world == 1:
            want = final
        elif how == "columns":
            cols = final.shape[1] // world
            want = final[:, up.rank * cols:(up.rank + 1) * cols]
        else:
            rows = p.shape[0]
            want = final[up.rank * rows:(up.rank + 1) * rows]
        assert torch.equal(as_bits(p[:want.shape[0]]), as_bits(want))


@pytest.mark.parametrize("world,how,extra", CASES)
def test_ranks_decode_a_chained_route_against_their_live_weights(tmp_path, world, how, extra):
    """Fake ranks (this process) each holding its share of the tensors take versions 1-3 in one
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

    name = {"rows": "model.layers.0.mlp.up_proj.weight", "columns": "model.layers.0.mlp.down_proj.weight",
            "padded": "model.embed_tokens.weight"}[how]
    shape = (200, 256) if how == "padded" else (512, 256)
    states = [{name: _pair(shape, seed=0)[0]}]
    for k in range(3):
        states.append({name: _pair(shape, seed=k + 1, base=states[-1][name])[1]})
    _publish(tmp_path, states, chunk_min_cell=1 << 14 if extra else None)
    for v in (1, 2, 3):
        doc = json.loads((tmp_path / f"v{v:08d}.json").read_text())
        parts = doc["tensors"][0]["chunks"] or [doc["tensors"][0]]
        assert {p["positions"]["coder"] for p in parts} == {"ctx-rans"}
    ranks = [make_rank(r, states[0], sharded=(name,) if world > 1 else (), world=world,
                       by_column=(name,) if how == "columns" else (), padded=(name,) if how == "padded" else ())
             for r in range(world)]
    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(tmp_path / "v00000003.json")})))
    assert a["version"] == 3
    _assert_ranks_hold(ranks, name, states[3][name], world, how)


class _EncodeAfterDiff(DeltaPublisher):
    encode_early = False  # the background encodes each version after its whole diff (the path before the overlap)


class _EncodeEarly(DeltaPublisher):
    encode_early = True  # each tensor encoded as it is diffed (on the CPU, "auto" does this only for GPU weights)


def _stored(root) -> dict:
    """Every object of a local store by key, its bytes (the temporary files and locks left out)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.parametrize("context_coder", [True, False])
def test_encoding_each_tensor_as_it_is_diffed_writes_the_same_bytes(tmp_path, monkeypatch, context_coder):
    """The publisher encodes a tensor on its pool as soon as the training thread has diffed it,
    while the next ones are diffed, except the tensors the context coder is tried on (they need
    the version's step tables, built from every tensor's changes): every blob and manifest
    is byte for byte the one encoding after the whole diff writes, with context-coded tensors,
    plain ones, a tensor cut into cells, an unchanged one and an integer one, over 3 deltas."""
    g = torch.Generator().manual_seed(5)
    follows = _pair((256, 256), seed=1)[0]
    big = (0.02 * torch.randn(1024, 768, generator=g)).to(torch.bfloat16)  # cut into cells of 16 k elements or more
    states = [{"ctx": follows, "uniform": _pair((256, 256))[0], "big": big, "still": torch.ones(300),
               "count": torch.arange(5000, dtype=torch.int32)}]
    for k in range(3):
        prev = states[-1]
        nxt = dict(prev, ctx=_pair((256, 256), seed=k + 2, base=prev["ctx"])[1])
        for name in ("uniform", "big"):
            bits = as_bits(prev[name]).clone().reshape(-1)
            bits[torch.rand(bits.numel(), generator=g) < 0.02] += 1
            nxt[name] = bits.view(torch.bfloat16).reshape(prev[name].shape)
        nxt["count"] = prev["count"] + (torch.rand(5000, generator=g) < 0.1).int()
        states.append(nxt)
    monkeypatch.setattr(builder, "time", types.SimpleNamespace(time=lambda: 1.7e9))  # the manifests' creation time
    stores = {}
    with settings.override(context_coder=context_coder):
        for cls in (_EncodeEarly, _EncodeAfterDiff):
            root = tmp_path / cls.__name__
            with cls(str(root), anchor_every=0, chunk_min_cell=1 << 14) as pub:
                for sd in states:
                    pub.publish(sd)
            stores[cls] = _stored(root)
    early, after = stores[_EncodeEarly], stores[_EncodeAfterDiff]
    assert early.keys() == after.keys() and len([k for k in early if k.endswith(".bin")]) >= 3 and "LATEST" in early
    for key in early:
        assert early[key] == after[key], key
    last = json.loads(early["v00000003.json"])
    coders = {t["name"]: {c["positions"]["coder"] for c in (t["chunks"] or [t])} for t in last["tensors"]}
    assert (coders["ctx"] == {"ctx-rans"}) == context_coder and "ctx-rans" not in coders["uniform"] | coders["big"]
    assert len(next(t for t in last["tensors"] if t["name"] == "big")["chunks"]) > 1
