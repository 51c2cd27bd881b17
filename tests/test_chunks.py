"""Grid cells of big tensors (format 3): the geometry, and that a rank fetches only its cells.

The geometry is checked by property tests against numpy's own index arithmetic; the
fetch by ranks that hold a row shard (as tensor parallelism does) of a real published
run in a local store, counting the bytes each rank read against the whole delta.
"""
from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from engine_ext.format import chunks
from engine_ext.server.controller import Controller
from engine_ext.errors import ManifestError
from engine_ext.format.manifest import Manifest
from engine_ext.server.protocol import UpdateRequest
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.store.decoding import TensorBases
from engine_ext.store.reader import fetch_selected, read_manifest
from engine_ext import settings
from engine_ext.store.local import LocalStore
from engine_ext.store.sources import Sources
from engine_ext.store import open_store
from fake_ranks import FakeRanks, make_rank

shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)


@hsettings(max_examples=200, deadline=None)
@given(shapes, st.data())
def test_split_local_global_round_trip(shape, data):
    numel = math.prod(shape)
    cuts = chunks.grid(shape, min_cell=1, parts=data.draw(st.sampled_from([2, 4, 8])))
    if cuts is None:
        assert numel // 2 ** min(2, len(shape)) < 1 or all(s == 1 for s in shape[:2])  # no two cells of >= 1 element
        return
    assert chunks.valid_cuts(cuts, shape)
    boxes = chunks.boxes(cuts, shape)
    assert sum(chunks.box_numel(b) for b in boxes) == numel  # the cells tile the tensor
    pos = np.array(sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=60))), dtype=np.int64)
    seen = []
    for cell, idx in chunks.split(pos, shape, cuts):
        box = boxes[cell]
        coords = np.stack(np.unravel_index(pos[idx], shape), axis=1) if len(shape) > 1 else pos[idx][:, None]
        assert ((coords >= box[0]) & (coords < box[1])).all()  # every position lies in its cell
        local = chunks.to_local(pos[idx], shape, box)
        assert (np.diff(local) > 0).all() and (local < chunks.box_numel(box)).all()  # row-major inside the box
        back = chunks.to_global(torch.from_numpy(local), shape, box).numpy()
        assert (back == pos[idx]).all()
        seen.append(pos[idx])
    assert (sorted(np.concatenate(seen).tolist()) if seen else []) == pos.tolist()  # each position in one cell


@hsettings(max_examples=300, deadline=None)
@given(shapes, st.data())
def test_place_is_to_global_of_each_cell_then_sorted(shape, data):
    """The reader's one-pass placement of decoded cells (any subset a rank selects, any grid: the
    publisher's, aligned or not, and hand-cut ones with uneven parts) gives exactly what concatenating
    each cell's :func:`chunks.to_global` and sorting gave, positions and the values beside them."""
    from engine_ext.format import cell_kernels

    numel = math.prod(shape)
    if data.draw(st.booleans()):
        along = data.draw(st.sampled_from([None, 0, 1])) if len(shape) > 1 else None
        cuts = chunks.grid(shape, min_cell=1, parts=data.draw(st.sampled_from([2, 4, 8])), along=along)
    else:
        cuts = [sorted({0, shape[0], *data.draw(st.sets(st.integers(1, shape[0]), max_size=3))})]
        if len(shape) > 1 and data.draw(st.booleans()):
            cuts.append(sorted({0, shape[1], *data.draw(st.sets(st.integers(1, shape[1]), max_size=3))}))
    if cuts is None:
        return
    boxes = chunks.boxes(cuts, shape)
    pos = np.array(sorted(data.draw(st.sets(st.integers(0, numel - 1), min_size=1, max_size=80))), dtype=np.int64)
    vals = np.arange(len(pos), dtype=np.int16) * 7 - 300
    split = chunks.split(pos, shape, cuts)
    kept = [(c, idx) for c, idx in split if data.draw(st.booleans())] or split[:1]
    local = [chunks.to_local(pos[idx], shape, boxes[c]) for c, idx in kept]
    got_pos, got_vals = cell_kernels.place(shape, [boxes[c] for c, _ in kept], local, [vals[idx] for _, idx in kept])
    want = torch.cat([chunks.to_global(torch.from_numpy(q), shape, boxes[c]) for q, (c, _) in zip(local, kept)])
    want, order = torch.sort(want)
    assert got_pos.tolist() == want.tolist()
    assert got_vals.tolist() == np.concatenate([vals[idx] for _, idx in kept])[order.numpy()].tolist()


@hsettings(max_examples=300, deadline=None)
@given(shapes, st.data())
def test_cells_meeting_a_box_are_those_meets_finds(shape, data):
    """The cells a rank fetches, found by bisection, are exactly the cells :func:`chunks.meets` says meet its box."""
    cuts = chunks.grid(shape, min_cell=1, parts=data.draw(st.sampled_from([2, 4, 8])))
    if cuts is None:
        return
    start = tuple(data.draw(st.integers(-1, n)) for n in shape)
    stop = tuple(data.draw(st.integers(a, n + 1)) for a, n in zip(start, shape))
    want = {i for i, box in enumerate(chunks.boxes(cuts, shape)) if chunks.meets(box, start, stop)}
    assert chunks.cells_meeting(cuts, shape, start, stop) == want


def test_two_and_four_way_shards_fall_on_cuts():
    cuts = chunks.grid((8192, 2048))
    for world in (2, 4, 8):
        for r in range(world):
            assert r * 8192 // world in cuts[0] and r * 2048 // world in cuts[1]
    assert chunks.grid((511, 1024)) is None and chunks.grid((1 << 18,)) is None  # cells of at least MIN_CELL
    assert [len(c) - 1 for c in chunks.grid((1024, 1024))] == [2, 2] and chunks.grid((1 << 21,)) == [[i << 18 for i in range(9)]]
    assert [len(c) - 1 for c in chunks.grid((3584, 3584))] == [4, 4] and [len(c) - 1 for c in chunks.grid((18944, 3584))] == [8, 8]


@hsettings(max_examples=200, deadline=None)
@given(st.integers(1, 20_000), st.integers(1, 20_000), st.sampled_from([0, 1]))
def test_a_grid_along_the_shard_dimension_gives_tp_8_its_eighth(rows, cols, along):
    """A matrix whose shard dimension the publisher knows is cut into as many cells, of the same sizes, as
    the default grid, with up to 8 parts along that dimension: every share of 2, 4 and 8 ranks falls on its
    cuts wherever the dimension holds that many parts."""
    shape = (rows, cols)
    usual, aligned = chunks.grid(shape, 1024), chunks.grid(shape, 1024, along=along)
    if usual is None:
        assert aligned is None
        return
    k = max(len(c) - 1 for c in usual)  # the default grid's parts per dimension (before a short one is clamped)
    assert chunks.valid_cuts(aligned, shape) and math.prod(len(c) - 1 for c in aligned) <= k * k
    if aligned == usual:  # where the aligned one would cut cells under the minimum (small, odd shapes)
        return
    assert min(map(chunks.box_numel, chunks.boxes(aligned, shape))) >= 1024
    parts = len(aligned[along]) - 1
    assert shape[along] % parts == 0 and (parts == min(8, k * k) or shape[along] % (2 * parts))
    for world in (2, 4, 8):
        if world <= parts:  # every rank's share starts on a cut
            assert all(r * shape[along] // world in aligned[along] for r in range(world))
    assert chunks.grid((2048, 7168), along=0) == [chunks._cuts(2048, 8), chunks._cuts(7168, 2)]  # an expert: 8 x 2


def test_the_publisher_cuts_known_layers_along_their_shard_dimension(tmp_path):
    """q_proj (column-parallel) is cut into row parts, o_proj (row-parallel) into column parts, a layer the
    names do not place into the default grid: a TP 4 rank of the first two fetches a quarter of their bytes."""
    g = torch.Generator().manual_seed(5)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (128, 64), "model.layers.0.self_attn.o_proj.weight": (64, 128),
              "model.layers.0.mystery.weight": (128, 64)}
    states = noisy_versions({n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}, 1, g)
    with DeltaPublisher(str(tmp_path), anchor_every=0, chunk_min_cell=1024) as pub:
        for sd in states:
            pub.publish(sd)
    m = read_manifest(open_store(str(tmp_path)), "v00000001.json")
    parts = {t.name.split(".")[-2]: [len(c) - 1 for c in t.grid] for t in m.tensors}
    assert parts == {"q_proj": [4, 1], "o_proj": [1, 4], "mystery": [2, 2]}


def _states(seed=0, steps=2):
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(512, 256, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g).to(torch.bfloat16)}
    return noisy_versions(sd, steps, g)


def noisy_versions(sd: dict, steps: int, g: torch.Generator) -> list[dict]:
    """``sd`` and ``steps`` versions after it, each changing ~2.5 % of every tensor's elements."""
    out = [sd]
    for _ in range(steps):
        nxt = {}
        for n, t in out[-1].items():
            x = t.float().clone().reshape(-1)
            idx = torch.randint(0, x.numel(), (max(1, x.numel() // 40),), generator=g)
            x[idx] += 0.05 * (x[idx].abs() + 1e-3)
            nxt[n] = x.to(torch.bfloat16).reshape(t.shape)
        out.append(nxt)
    return out


def test_chunked_manifest_and_partial_fetch(tmp_path):
    states = _states()
    with DeltaPublisher(str(tmp_path), anchor_every=0, chunk_min_cell=1024) as pub:
        for sd in states:
            pub.publish(sd)
    store = open_store(str(tmp_path))
    m = read_manifest(store, "v00000001.json")
    w = next(t for t in m.tensors if t.name == "w")
    assert m.format_version == 5 and w.grid == chunks.grid((512, 256), 1024) and len(w.chunks) == 64
    assert next(t for t in m.tensors if t.name == "b").chunks is None  # small: not cut
    whole, n_all = fetch_selected(store, m, bases=TensorBases(states[0]))
    half, n_half = fetch_selected(store, m, {"w": {c for c in range(64) if c < 32}}, bases=TensorBases(states[0]))  # rows 0-255
    assert n_half < 0.6 * n_all
    full = next(t for t in whole if t.name == "w")
    mine = half[0]
    rows = full.positions // 256
    assert torch.equal(mine.positions, full.positions[rows < 256]) and torch.equal(mine.values, full.values[rows < 256])
    doc = json.loads(store.read("v00000001.json"))
    wj = next(t for t in doc["tensors"] if t["name"] == "w")
    wj["chunks"][1]["offset"] = wj["chunks"][0]["offset"]
    with pytest.raises(ManifestError, match="cell 1 and tensor 'w' cell 0 overlap"):  # bytes claimed twice
        Manifest.from_json(json.dumps(doc).encode())


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_fetches_only_its_rows(tmp_path, world):
    """Ranks holding 1/world of ``w``'s rows read well under the whole delta and still end bit-exact."""
    states = _states(steps=3)
    with DeltaPublisher(str(tmp_path), anchor_every=0, chunk_min_cell=1024) as pub:
        for sd in states:
            pub.publish(sd)
    ranks = [make_rank(r, states[0], sharded=("w",), world=world) for r in range(world)]
    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(tmp_path / "v00000003.json")})))
    assert a["version"] == 3 and len(a["fetched_bytes"]) == world
    whole = sum(fetch_selected(open_store(str(tmp_path)), read_manifest(open_store(str(tmp_path)), f"v{v:08d}.json"),
                               bases=TensorBases(states[v - 1]))[1] for v in (1, 2, 3))
    assert max(a["fetched_bytes"]) <= (0.6 if world == 2 else 0.35) * whole, (a["fetched_bytes"], whole)
    for up in ranks:
        rows = 512 // world
        want = states[3]["w"][up.rank * rows:(up.rank + 1) * rows]
        assert torch.equal(up.module.w.view(torch.int16), want.view(torch.int16))
        assert torch.equal(up.module.b.view(torch.int16), states[3]["b"].view(torch.int16))


class CountingStore(LocalStore):
    """A local store that counts range requests: what a rank's fetch costs an object store (a real store,
    counted, not a mock)."""

    def __init__(self, root: str):
        super().__init__(root)
        self.requests = 0

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self.requests += 1
        return super().read_range(key, start, length)


def _tp_share(name: str, shape, rank: int, world: int) -> tuple[tuple, tuple]:
    """What rank ``rank`` of ``world`` holds of a tensor, as the engines shard it: the columns of row-parallel
    layers (o_proj, down_proj), the rows of the others, norms whole."""
    if len(shape) == 1:
        return (0,), tuple(shape)
    dim = 1 if "o_proj" in name or "down_proj" in name else 0
    n = shape[dim] // world
    start, stop = [0, 0], list(shape)
    start[dim], stop[dim] = rank * n, (rank + 1) * n
    return tuple(start), tuple(stop)


@pytest.mark.parametrize("layout_tp", [8, 1])
def test_a_tp_rank_reads_its_share_in_two_ranges_per_blob(tmp_path, layout_tp):
    """Blobs laid out for TP 8 (the default) give a rank of TP 2, 4 or 8 its cells of every tensor in two ranges
    per blob (the parts every rank reads, then its share), each part still verified; laid out in encoding order
    (``ENGINE_EXT_READER_TP=1``) a rank of TP 8 reads one range per cell it needs."""
    g = torch.Generator().manual_seed(3)
    shapes = {"model.layers.0.self_attn.o_proj.weight": (256, 512), "model.layers.0.mlp.gate_proj.weight": (512, 256),
              "model.layers.0.mlp.down_proj.weight": (256, 512), "model.norm.weight": (256,)}
    states = noisy_versions({n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}, 1, g)
    with settings.override(reader_tp=layout_tp), DeltaPublisher(str(tmp_path), anchor_every=0, chunk_min_cell=1024) as pub:
        for sd in states:
            pub.publish(sd)
    store = CountingStore(str(tmp_path))
    m = read_manifest(store, "v00000001.json")
    assert len(m.blobs) == 1 and all(len(t.chunks) == 64 for t in m.tensors if t.grid)
    whole, _ = fetch_selected(store, m, bases=TensorBases(states[0]))
    for world in (2, 4, 8):
        for rank in (0, world - 1):
            held = {n: _tp_share(n, s, rank, world) for n, s in shapes.items()}
            selection = {t.name: None if t.grid is None else
                         {i for i, box in enumerate(t.boxes()) if chunks.meets(box, *held[t.name])} for t in m.tensors}
            store.requests = 0
            mine, _ = fetch_selected(store, m, selection, bases=TensorBases(states[0]))
            cells = sum(len(c) for c in selection.values() if c is not None)
            assert store.requests <= (2 if layout_tp == 8 else cells), (world, rank, store.requests)
            for got in mine:  # the rank's changes are the whole delta's inside its share
                full, shape, (start, stop) = next(t for t in whole if t.name == got.name), shapes[got.name], held[got.name]
                coords = [full.positions // shape[1], full.positions % shape[1]] if len(shape) == 2 else [full.positions]
                inside = torch.ones_like(full.positions, dtype=torch.bool)
                for c, a, b in zip(coords, start, stop):
                    inside &= (c >= a) & (c < b)
                assert torch.equal(got.positions, full.positions[inside]) and torch.equal(got.values, full.values[inside])
    if layout_tp == 1:
        assert store.requests > 8  # rank 7 of 8: its cells scattered over the blob
