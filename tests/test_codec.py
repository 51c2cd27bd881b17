"""Codec and format: lossless for every bit pattern, bounded and clean on hostile input."""
import time

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_ext.format import codec
from engine_ext.format import fingerprint as fpr
from engine_ext.format.delta import ABS, REL, apply_tensor, compose, diff_tensor
from engine_ext.format.dtypes import BY_NAME, apply_step, as_bits, step_between
from engine_ext.errors import IntegrityError, ManifestError
from engine_ext.format.manifest import FORMAT_VERSION, Manifest

DTYPES = list(BY_NAME.values())
SPECIAL_F16 = [0x0000, 0x8000, 0x0001, 0x8001, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7BFF, 0x03FF]


def random_bits(dt, n, rng):
    """Raw bits covering every pattern class: random words plus zeros, signed zeros, infs, NaN payloads."""
    info = np.iinfo({8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[dt.bits])
    bits = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=info.dtype)
    if dt.bits == 16 and n:
        sp = np.array(SPECIAL_F16, dtype=np.uint16).view(np.int16)
        bits[: min(n, len(sp))] = sp[: min(n, len(sp))]
    if dt.name == "bool":
        bits = (bits & 1).astype(np.int8)
    return torch.from_numpy(bits)


def to_tensor(dt, bits):
    if dt.name == "bool":
        return bits.view(torch.uint8).view(torch.bool)
    return bits.view(dt.torch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 3000), density=st.sampled_from([0.0, 0.001, 0.03, 0.5, 1.0]),
       seed=st.integers(0, 2**31), mode=st.sampled_from([None, "abs", "rel"]))
def test_round_trip_every_dtype(dtype, n, density, seed, mode):
    rng = np.random.default_rng(seed)
    old = random_bits(dtype, n, rng)
    new = old.clone()
    change = torch.from_numpy(rng.random(n) < density)
    new[change] = random_bits(dtype, int(change.sum()), rng)
    pos = torch.nonzero(old != new).reshape(-1)
    enc = codec.encode(dtype, n, pos, new[pos], old[pos], mode)
    got_pos = codec.decode_positions(enc.pos_coder, enc.pos, pos.numel(), n)
    vals = codec.decode_values(enc.val_coder, enc.val, pos.numel(), dtype)
    got_pos = torch.arange(n) if got_pos is None else got_pos
    assert torch.equal(got_pos, pos)
    got = vals if enc.mode == ABS else apply_step(old[pos], vals, dtype.is_float)
    assert torch.equal(got, new[pos])
    # and through the TensorDelta reference, with fingerprints
    td = diff_tensor("t", to_tensor(dtype, old), to_tensor(dtype, new))
    assert torch.equal(as_bits(apply_tensor(to_tensor(dtype, old), td)), as_bits(to_tensor(dtype, new)))



@pytest.mark.parametrize("shape,cuts", [((300, 200), None), ((64, 16, 5), None), ((50_000,), None),
                                        ((300, 200), "rows"), ((5000, 40), None)])
@pytest.mark.parametrize("dtype", [BY_NAME["bfloat16"], BY_NAME["float32"], BY_NAME["int8"], BY_NAME["bool"]])
@pytest.mark.parametrize("mode", [None, "abs", "rel"])
def test_cells_grouped_in_numba_code_the_same_bytes(shape, cuts, dtype, mode, monkeypatch):
    """A cut tensor's cells coded from the numba grouping (cell_kernels) are byte for byte those of
    the per-cell numpy path (chunks.split, to_local, gathers, steps): every cell, coder, mode and byte,
    at densities from none to all of a cell (all: positions coded as 'all'), with a mode chosen once
    for a tensor of many changes (more than 4 * MODE_SAMPLE) and per cell for fewer."""
    from engine_ext.format import chunks

    rng = np.random.default_rng(sum(shape) + dtype.bits)
    numel = int(np.prod(shape))
    grid = [chunks._cuts(shape[0], 4)] if cuts == "rows" else chunks.grid(shape, 1 << 10)
    assert grid is not None
    old = random_bits(dtype, numel, rng)
    for density in (0.0, 0.002, 0.05, 0.5):
        new = old.clone()
        hit = torch.from_numpy(rng.random(numel) < density)
        new[hit] = random_bits(dtype, int(hit.sum()), rng)
        start, stop = chunks.boxes(grid, shape)[0]  # the first cell changes whole
        box = tuple(slice(a, b) for a, b in zip(start, stop))
        new.view(shape)[box] = old.view(shape)[box] ^ 1
        pos = torch.nonzero(old != new).reshape(-1)
        args = (dtype, shape, pos, new[pos], old[pos], mode, None, None, grid)
        fast = codec.encode_tensor(*args)
        monkeypatch.setattr(codec, "_cell_kernels", lambda: None)
        slow = codec.encode_tensor(*args)
        monkeypatch.undo()
        assert fast.cuts == slow.cuts and len(fast.cells) == len(slow.cells) >= 1
        assert fast.cells == slow.cells, (density, [c for c, _, _ in fast.cells])
        assert fast.cells[0][2].pos_coder == "all"


def test_ordered_steps_are_small_and_cross_zero():
    x = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.0, float("inf")], dtype=torch.float32)
    y = torch.nextafter(x, torch.full_like(x, float("inf")))
    s = step_between(as_bits(x), as_bits(y), True)
    assert s[[0, 2, 4]].tolist() == [1, 1, 1]
    assert step_between(as_bits(torch.tensor([-0.0])), as_bits(torch.tensor([0.0])), True).item() == 1


def test_compose_adds_steps_and_abs_wins():
    rng = np.random.default_rng(0)
    dt = BY_NAME["bfloat16"]
    states = [torch.randn(500).to(torch.bfloat16)]
    for k in range(4):
        nxt = states[-1].clone()
        idx = torch.from_numpy(rng.choice(500, 60, replace=False))
        nxt[idx] = (nxt[idx].float() * (1 + 0.01 * k)).to(torch.bfloat16)
        states.append(nxt)
    chain = [diff_tensor("w", a, b, mode=ABS if k == 2 else REL) for k, (a, b) in enumerate(zip(states, states[1:]))]
    parts = compose(chain)
    out = states[0]
    for p in parts:
        out = apply_tensor(out, p, check=False)
    assert torch.equal(as_bits(out), as_bits(states[-1]))
    assert fpr.tensor_fingerprint(out) == parts[0].fingerprint


# ---- hostile input: fails cleanly and fast ---------------------------------------

def _fast(fn, *a):
    t = time.perf_counter()
    with pytest.raises(IntegrityError):
        fn(*a)
    assert time.perf_counter() - t < 1.0


def test_hostile_positions():
    pos = torch.tensor([3, 10, 999], dtype=torch.int64)
    c, data = codec.encode_positions(pos.numpy(), 1000)
    _fast(codec.decode_positions, c, data[: len(data) // 2], 3, 1000)  # truncated
    _fast(codec.decode_positions, c, data, 4, 1000)  # count larger than the stream
    _fast(codec.decode_positions, c, data, 3, 999)  # out of range
    _fast(codec.decode_positions, c, b"\x00" * 7, 3, 1000)  # garbage
    _fast(codec.decode_positions, "all", b"", 3, 1000)
    _fast(codec.decode_positions, "lz4", data, 3, 1000)


def _plain_tensor(name, shape, cuts, pos, bits, keep, raw_values):
    """A tensor's kept cells coded as the publisher codes them (positions box-local, as gaps), as
    :func:`codec.decode_cells` takes them, and the reference: each cell decoded alone, then placed."""
    from engine_ext.format import cell_kernels, chunks

    boxes = chunks.boxes(cuts, shape) if cuts else [((0,) * len(shape), tuple(shape))]
    split = chunks.split(pos, shape, cuts) if cuts else [(0, np.arange(len(pos)))]
    kept = [(c, idx) for c, idx in split if keep(c)] or split[:1]
    cells, locals_, values = [], [], []
    for c, idx in kept:
        local = chunks.to_local(pos[idx], shape, boxes[c]) if cuts else pos[idx]
        pc, pb = codec.encode_positions(local, chunks.box_numel(boxes[c]))
        vc, vb = ("raw", bits[idx].tobytes()) if raw_values else codec.encode_values(bits[idx])
        cells.append(codec.PlainCell(boxes[c], len(idx), pc, pb, vc, vb))
        locals_.append(local)
        values.append(bits[idx])
    want = cell_kernels.place(shape, [boxes[c] for c, _ in kept], locals_, values)
    return codec.PlainTensor(name, tuple(shape), cells), want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"]), st.integers(1, 4), st.data())
def test_a_batch_of_plain_tensors_decodes_as_each_cell_alone(dtype_name, n_tensors, data):
    """codec.decode_cells (every cell's streams into one buffer, one kernel call for many tensors: what a rank
    decodes codec v1 with) gives each tensor exactly what decoding its cells one by one and placing them gave:
    any grid or none, any subset of cells a rank keeps, 1 to 3 dimensions, pco, zstd and raw segments."""
    from engine_ext.format import chunks

    dt = BY_NAME[dtype_name]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    batch, wants = [], []
    for k in range(n_tensors):
        shape = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple))
        numel = int(np.prod(shape))
        cuts = None
        if data.draw(st.booleans()):
            along = data.draw(st.sampled_from([None, 0, 1])) if len(shape) > 1 else None
            cuts = chunks.grid(shape, min_cell=1, parts=data.draw(st.sampled_from([2, 4, 8])), along=along)
        n = data.draw(st.integers(1, min(numel, 400)))
        pos = np.sort(rng.choice(numel, n, replace=False)).astype(np.int64)
        bits = random_bits(dt, n, rng).numpy()
        keep = lambda c: data.draw(st.booleans())  # noqa: E731
        t, want = _plain_tensor(f"t{k}", shape, cuts, pos, bits, keep, data.draw(st.booleans()))
        if not codec.plain(shape, [(c.box, c.positions_coder, c.values_coder) for c in t.cells]):
            continue  # a cell every element of which changed: "all" positions, decoded cell by cell
        batch.append(t)
        wants.append(want)
    got = codec.decode_cells(batch, dt) if batch else []
    for (pos, vals), (want_pos, want_vals) in zip(got, wants):
        assert pos.tolist() == want_pos.tolist()
        assert vals.numpy().tolist() == want_vals.tolist()


def test_the_row_by_reciprocal_is_the_division_at_every_edge():
    """cell_kernels._row finds a change's row by a multiplication (rounded, then corrected by one): the
    floor division's row at each row's first and last element, for widths and rows up to a cell of 2^32
    elements, where float64 rounding first misses."""
    from engine_ext.format import cell_kernels

    for width in (1, 3, 7, 4096, 7168, 2**31 - 1, 2**32 - 5):
        for row in (0, 1, 2, 3, 1000, 2**32 // width - 1, 2**40 // width):
            for q in (row * width - 1, row * width, row * width + width - 1):
                if q >= 0:
                    assert cell_kernels._row(q, width, 1.0 / width) == q // width, (width, q)


def test_a_batch_refuses_a_hostile_cell_and_names_its_tensor():
    """A repeated position, one past its cell, an 8-bit value outside 8 bits or a corrupt stream in one cell of
    one tensor of a batch: IntegrityError naming the tensor (and the cell), fast."""
    from engine_ext.format import chunks

    dt = BY_NAME["float8_e4m3fn"]
    shape, cuts = (16, 16), chunks.grid((16, 16), min_cell=1, parts=4, along=1)
    pos = np.array([1, 5, 17, 40, 200, 255], np.int64)
    bits = np.array([1, -1, 2, -2, 3, -3], np.int8)
    good, _ = _plain_tensor("good", shape, cuts, pos, bits, lambda c: True, False)
    bad, _ = _plain_tensor("bad", shape, cuts, pos, bits, lambda c: True, False)
    numel = chunks.box_numel(bad.cells[1].box)

    def with_cell(cell: codec.PlainCell) -> list:
        return [good, bad._replace(cells=[bad.cells[0], cell, *bad.cells[2:]])]

    c = bad.cells[1]._replace(positions_coder="pco", values_coder="pco")
    hostile = {
        "repeated position": c._replace(nnz=2, positions=codec._pco(np.array([3, 0], np.uint32)), values=codec._pco(np.array([1, 1], np.int16))),
        "lies at or beyond": c._replace(nnz=1, positions=codec._pco(np.array([numel], np.uint32)), values=codec._pco(np.array([1], np.int16))),
        "8-bit values out of range": c._replace(nnz=1, positions=codec._pco(np.array([0], np.uint32)), values=codec._pco(np.array([300], np.int16))),
        "corrupt pco stream": c._replace(positions=b"\x00" * 7),
        "is not coded as gaps": c._replace(positions_coder="all"),
    }
    for what, cell in hostile.items():
        t = time.perf_counter()
        with pytest.raises(IntegrityError, match=f"tensor 'bad': .*{what}"):
            codec.decode_cells(with_cell(cell), dt)
        assert time.perf_counter() - t < 1.0


@pytest.mark.parametrize("gap_dtype", [np.uint32, np.uint64])
def test_gap_kernel_accepts_and_refuses_as_the_numpy_reference(gap_dtype):
    """codec_kernels.positions (one pass) against the three numpy passes it replaced, on good gaps and on
    each bad kind at the start, middle and end: a 0 gap after the first, a sum at numel, a huge gap."""
    from engine_ext.format import codec_kernels

    def reference(gaps, numel):
        if gap_dtype == np.uint64 and int(gaps.max()) >= numel:
            return None
        if len(gaps) > 1 and gaps[1:].min() == 0:
            return None
        pos = np.cumsum(gaps, dtype=np.int64)
        return None if pos[-1] >= numel else pos

    rng = np.random.default_rng(1)
    numel = 5000
    good = np.diff(np.sort(rng.choice(numel, 300, replace=False)), prepend=0).astype(gap_dtype)
    cases = [good, good[:1], np.zeros(1, gap_dtype), np.array([numel - 1], gap_dtype)]
    for at in (0, 1, 150, 299):
        for bad in (0, numel - int(good[:at].sum()), np.iinfo(gap_dtype).max):
            g = good.copy()
            g[at] = bad
            cases.append(g)
    for gaps in cases:
        want = reference(gaps, numel)
        got, status, _ = codec_kernels.positions(gaps, numel)
        assert (status == codec_kernels.OK) == (want is not None), gaps[:4]
        if want is not None:
            assert np.array_equal(got, want)


def test_narrow8_refuses_exactly_the_values_outside_8_bits():
    from engine_ext.format import codec_kernels

    wide = np.arange(-128, 128, dtype=np.int16)
    assert np.array_equal(codec_kernels.narrow8(wide), wide.astype(np.int8))
    for bad in (-129, 128, -32768, 32767):
        assert codec_kernels.narrow8(np.array([0, 5, bad, 1], np.int16)) is None


def test_zstd_bomb_refused_fast():
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\x00" * (256 << 20))  # 256 MiB from ~8 KB
    assert len(bomb) < 100_000
    _fast(codec.decode_values, "zstd", bomb, 10, BY_NAME["bfloat16"])
    _fast(codec.decode_positions, "zstd", bomb, 10, 1 << 30)


def test_pco_count_mismatch():
    c, data = codec.encode_values(np.arange(100, dtype=np.int16))
    _fast(codec.decode_values, c, data, 1_000_000, BY_NAME["bfloat16"])
    _fast(codec.decode_values, c, data, 10, BY_NAME["bfloat16"])


def _manifest(**over):
    from engine_ext.format.manifest import Blob, Segment, TensorEntry
    fp = fpr.fmt(5)
    t = TensorEntry("w", "bfloat16", [10], 2, fp, fp, blob=0, offset=0, sha256="0" * 64,
                    positions=Segment("zstd", 4), values=Segment("zstd", 4, "rel"))
    m = Manifest(kind="delta", model="m", version=1, base_version=0, fingerprint=fpr.fmt(fpr.model_fingerprint({"w": 5})),
                 base_fingerprint=fpr.fmt(fpr.model_fingerprint({"w": 5})), blobs=[Blob("v1.bin", 8, "0" * 64)], tensors=[t])
    for k, v in over.items():
        setattr(t if hasattr(t, k) else m, k, v)
    return m


@pytest.mark.parametrize("change", [
    {"nnz": 11}, {"nnz": -1}, {"shape": [1 << 41]}, {"offset": 5}, {"blob": 3}, {"dtype": "complex64"},
    {"base_version": 1}, {"format_version": FORMAT_VERSION + 1}, {"fingerprint": "zz"}, {"sha256": None},
    {"base_manifests": ["xyz"]}, {"base_manifests": ["0" * 64] * 5}, {"base_manifests": ["0" * 63 + "\n"]},
    {"format_version": 1, "base_manifests": ["0" * 64]},
])
def test_hostile_manifests_refused(change):
    m = _manifest()
    m.validate()
    with pytest.raises(ManifestError):
        Manifest.from_json(_manifest(**change).to_json())


def test_manifest_not_json_or_bad_blob_key():
    with pytest.raises(ManifestError):
        Manifest.from_json(b"{not json")
    m = _manifest()
    m.blobs[0].key = "../../etc/passwd"
    with pytest.raises(ManifestError):
        Manifest.from_json(m.to_json())


_JSON_LEAVES = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
_JSON = st.recursive(_JSON_LEAVES, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_manifest_text_is_what_the_json_module_writes(doc):
    """The manifest's text (:mod:`engine_ext.format.json_text`, a faster writer) is byte for byte
    ``json.dumps(..., indent=1)``: on any JSON data (unicode, NaN and infinities, empty containers)."""
    import json

    from engine_ext.format.json_text import dumps_indent1

    assert dumps_indent1(doc) == json.dumps(doc, indent=1).encode()


def test_a_published_manifest_is_the_json_of_its_fields(tmp_path):
    """A delta manifest with whole and chunked tensors, unchanged ones and format 5's step tables:
    its bytes are ``json.dumps(asdict(m), indent=1)`` without the unset format-7 and format-10 fields."""
    import dataclasses
    import json

    from engine_ext.trainer.builder import VersionBuilder

    g = torch.Generator().manual_seed(3)
    b = VersionBuilder("delta", "m\u00fcdel \"x\"", 2, 1, 0, base_manifests=["ab" * 32])
    for name, shape in [("big", (512, 1024)), ("small", (300,))]:
        old = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32).to(torch.int16).reshape(-1)
        pos = torch.nonzero(torch.rand(old.numel(), generator=g) < 0.05).reshape(-1)
        new = old[pos] + 1
        enc = codec.encode_tensor(BY_NAME["bfloat16"], shape, pos, new, old[pos], min_cell=1 << 14)
        b.add_encoded(name, BY_NAME["bfloat16"], shape, pos.numel(), enc, 5, 7)
    b.add_unchanged("still", BY_NAME["float32"], (4,), 9)
    b.add_step_tables("bfloat16", [b"\x00\x01", b"\xff"])
    b.manifest.created_unix = 1.5
    m = b.manifest
    assert any(t.chunks for t in m.tensors) and any(t.chunks is None and t.nnz for t in m.tensors)
    d = dataclasses.asdict(m)
    del d["tables"], d["index"], d["stands_for"]  # left out where None (older readers refuse unknown keys)
    for t in d["tensors"]:
        del t["cells"]
    assert m.to_json() == json.dumps(d, indent=1).encode()
