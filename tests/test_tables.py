"""Tables: a manifest's tensor entries and cell tables in its blobs (issue 31, item 3; issue 42).

A publisher writes a manifest of over ``ENGINE_EXT_INLINE_ENTRIES`` tensors and cells in tables: the
signed manifest keeps its header and where its tensor tables lie; each cut tensor's cells
lie in a cell table of their own. Here the limit is 0, so a small model takes that path. Format 10
(written now) keeps the tensor tables as binary records behind a name index: a rank reads the
index and only the tables holding its tensors; format 7 (JSON tables, every reader reads them
all) is still read. Ranks holding part of a tensor read only the cell tables of what they hold,
end bit-exact, and every table is checked (SHA-256, count, contents) before use.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from engine_ext import settings
from engine_ext.errors import IntegrityError, ManifestError, ModelMismatchError
from engine_ext.format import manifest as manifest_mod
from engine_ext.format.manifest import Manifest
from engine_ext.format import cell_reads, entries, tables, tensor_records
from engine_ext.format.fingerprint import name_key
from engine_ext.format.tables import CELL_RECORD
from engine_ext.server.controller import Controller
from engine_ext.server.protocol import UpdateRequest
from engine_ext.store import open_store
from engine_ext.store.decoding import TensorBases
from engine_ext.store.reader import check_decode_budget, check_expected, fetch_selected, load_cells, load_delta
from engine_ext.store.reader import open_held, open_manifest, read_manifest
from engine_ext.store.sources import Sources
from engine_ext.trainer.publisher import DeltaPublisher
from fake_ranks import FakeRanks, make_rank
from test_chunks import noisy_versions


def _states(seed=0, steps=3):
    """A model of a cut tensor ``w``, a cut expert pair and small tensors, and ``steps`` versions after it."""
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(512, 256, generator=g), "experts.0.w": torch.randn(256, 128, generator=g),
          "experts.1.w": torch.randn(256, 128, generator=g), "b": torch.randn(64, generator=g),
          "norm": torch.randn(32, generator=g)}
    return noisy_versions({n: t.to(torch.bfloat16) for n, t in sd.items()}, steps, g)


def _publish(root, states, limit: int, anchor_every: int = 0, binary: bool = True):
    """Publish ``states``; ``binary=False``: format 7's JSON tensor tables (as an older publisher wrote them)."""
    tabulate = functools.partial(tables.tabulate, binary=binary)
    with settings.override(inline_entries=limit), mock.patch("engine_ext.trainer.builder.tabulate", tabulate), \
            DeltaPublisher(str(root), anchor_every=anchor_every, chunk_min_cell=1024) as pub:
        for sd in states:
            pub.publish(sd)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The same versions published twice: format 7 (tables) and inline (format 5)."""
    states = _states()
    tables, inline = tmp_path_factory.mktemp("tables"), tmp_path_factory.mktemp("inline")
    _publish(tables, states, 0)
    _publish(inline, states, 4096)
    return states, tables, inline


def test_the_manifest_holds_no_tensor_and_no_cell(run):
    states, root, inline = run
    doc = json.loads((root / "v00000002.json").read_bytes())
    assert doc["format_version"] == 10 and doc["tensors"] == [] and len(doc["tables"]) == 1
    assert doc["index"]["count"] == 5 and doc["index"]["length"] == 5 * tables.INDEX_RECORD.itemsize
    assert json.loads((inline / "v00000002.json").read_bytes())["format_version"] == 5
    assert b"chunks" not in (root / "v00000002.json").read_bytes()
    assert json.loads((root / "v00000000.anchor.json").read_bytes())["format_version"] == 10  # the first version (an anchor, its data blob a pieces digest) too
    store = open_store(str(root))
    m = read_manifest(store, "v00000002.json")
    assert [t.name for t in m.tensors] == list(states[0])
    w = next(t for t in m.tensors if t.name == "w")
    assert w.chunks is None and w.cells.count == 64 and w.grid  # cells not read yet


def test_tables_decode_as_inline_does(run):
    """Every version, whole and by selection, decodes to the same tensors as the inline publish."""
    states, root, inline = run
    for v in (1, 2, 3):
        a, b = (load_delta(str(r / f"v{v:08d}.json"), bases=TensorBases(states[v - 1])) for r in (root, inline))
        assert a.fingerprint == b.fingerprint and a.tensor_fingerprints == b.tensor_fingerprints
        for x, y in zip(sorted(a.tensors, key=lambda t: t.name), sorted(b.tensors, key=lambda t: t.name)):
            assert x.name == y.name and torch.equal(x.positions, y.positions) and torch.equal(x.values, y.values)


def test_a_rank_reads_only_the_cell_tables_it_needs(run):
    states, root, _ = run
    store = open_store(str(root))
    m = read_manifest(store, "v00000001.json")
    held = {t.name: t.cells.length for t in m.tensors if t.cells is not None}
    assert set(held) >= {"w"}
    got = load_cells(store, m, {"w": None, "b": None})  # "b" is not cut: no table
    assert got == held["w"]
    assert all((t.cells is None) == (t.name == "w" or t.name not in held) for t in m.tensors)
    part, n = fetch_selected(store, m, {"w": {0, 1}}, bases=TensorBases(states[0]))
    assert {td.name for td in part} == {"w"} and n < 0.2 * m.payload_bytes


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_end_bit_exact(run, world):
    """In-process ranks (the code vLLM's and SGLang's workers run) holding 1/world of ``w`` take the
    chain of format-7 versions through the controller and equal the last version exactly."""
    states, root, inline = run
    ranks = [make_rank(r, states[0], sharded=("w",), world=world) for r in range(world)]
    ctl = Controller(FakeRanks(ranks), Sources([str(root)]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(root / "v00000003.json")})))
    assert a["version"] == 3
    for up in ranks:
        rows = 512 // world
        assert torch.equal(up.module.w.view(torch.int16), states[3]["w"][up.rank * rows:(up.rank + 1) * rows].view(torch.int16))
        for name in ("b", "norm"):
            assert torch.equal(getattr(up.module, name).view(torch.int16), states[3][name].view(torch.int16))


def test_anchors_and_a_rank_resume(tmp_path):
    """An anchor in tables loads whole; an anchor in tables (its data blob a pieces digest) + delta
    route reaches the last version."""
    states = _states(steps=2)
    _publish(tmp_path, states, 0, anchor_every=2)
    doc = json.loads((tmp_path / "v00000002.anchor.json").read_bytes())
    assert doc["format_version"] == 10 and doc["tensors"] == [] and [b.get("digest") for b in doc["blobs"]] == ["pieces", None]
    d = load_delta(str(tmp_path / "v00000002.anchor.json"))
    assert {t.name: t.values.view(torch.int16) for t in d.tensors}.keys() == states[2].keys()
    for t in d.tensors:
        assert torch.equal(t.values.view(torch.int16).reshape(states[2][t.name].shape), states[2][t.name].view(torch.int16))


def _corrupt(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_table_is_refused_and_changes_nothing(tmp_path):
    states = _states(steps=2)
    _publish(tmp_path, states, 0)
    store = open_store(str(tmp_path))
    m = Manifest.from_json((tmp_path / "v00000002.json").read_bytes())
    tables_blob = tmp_path / m.blobs[m.tables[0].blob].key
    good = tables_blob.read_bytes()
    _corrupt(tables_blob, m.tables[0].offset + 5)  # a tensor table
    with pytest.raises(IntegrityError, match="tensor table 0"):
        read_manifest(store, "v00000002.json")
    tables_blob.write_bytes(good)
    w = next(t for t in read_manifest(store, "v00000002.json").tensors if t.name == "w")
    _corrupt(tables_blob, w.cells.offset + 3)  # w's cell table
    ranks = [make_rank(r, states[0], sharded=("w",), world=2) for r in range(2)]
    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]), version=0)
    asyncio.run(ctl.start())
    before = [up.module.w.clone() for up in ranks]
    with pytest.raises(Exception, match="cell table"):
        asyncio.run(ctl.update(UpdateRequest.parse({"url": str(tmp_path / "v00000002.json")})))
    assert ctl.state.version == 0 and all(torch.equal(b, up.module.w) for b, up in zip(before, ranks))


def _doc(tmp_path, binary=False):
    _publish(tmp_path, _states(steps=1), 0, binary=binary)
    return json.loads((tmp_path / "v00000001.json").read_bytes())


@pytest.mark.parametrize("change, match", [
    (lambda d: d["tables"][0].update(offset=d["blobs"][-1]["size"]), "beyond its blob"),
    (lambda d: d["tables"][0].update(length=10 ** 9), "beyond its blob|bytes for"),
    (lambda d: d["tables"][0].update(count=-1), "bytes for"),
    (lambda d: d["tables"][0].update(count=0), "bytes for"),
    (lambda d: (d["blobs"][-1].update(size=1 << 40), d["tables"][0].update(count=1 << 19, length=(1 << 30) + 1)),
     "take over"),
    (lambda d: d["tables"][0].update(sha256="x"), "sha256"),
    (lambda d: d.update(format_version=6), "only format-7"),
    (lambda d: d.update(tables=[]), "1 to"),
    (lambda d: d.update(tensors=[{"name": "b", "dtype": "bfloat16", "shape": [64], "nnz": 0, "fingerprint": "0" * 16,
                                  "base_fingerprint": "0" * 16}]), "no tensors inline"),
    (lambda d: d["tables"].append(dict(d["tables"][0])), "overlap|name index holds 5 records"),
])
@pytest.mark.parametrize("binary", [False, True], ids=["format7", "format10"])
def test_hostile_table_references_are_refused(tmp_path, change, match, binary):
    doc = _doc(tmp_path, binary)
    change(doc)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(doc).encode())


def test_a_table_that_lies_about_its_contents_is_refused(tmp_path):
    """Tables whose bytes match their hash but not the manifest: counts, fingerprints, cells."""
    doc = _doc(tmp_path)
    m = Manifest.from_json(json.dumps(doc).encode())
    rows = json.loads((tmp_path / m.blobs[-1].key).read_bytes()[m.tables[0].offset:][:m.tables[0].length])

    def table(entries):
        raw = json.dumps(entries).encode()
        fresh = Manifest.from_json(json.dumps(doc).encode())
        fresh.tables[0].sha256, fresh.tables[0].length, fresh.tables[0].count = hashlib.sha256(raw).hexdigest(), len(raw), len(entries)
        fresh.blobs[-1].size = 10 ** 9
        return fresh, raw

    fresh, raw = table(rows[:-1])  # a tensor left out: the model fingerprint no longer adds up
    with pytest.raises(ManifestError, match="fingerprint"):
        tables.resolve(fresh, [raw])
    assert rows[0]["name"] == "w" and "cells" in rows[0]
    fresh, raw = table([dict(rows[0], nnz=rows[0]["nnz"] + 1)] + rows[1:])  # one change more than its cells hold
    tables.resolve(fresh, [raw])  # a cell table is checked when it is read
    w, blob = fresh.tensors[0], (tmp_path / m.blobs[-1].key).read_bytes()
    with pytest.raises(ManifestError, match="another count of changes"):
        cell_reads.set_cells(fresh, cell_reads.CutTensors.of(fresh, {"w"}), [blob[w.cells.offset:w.cells.offset + w.cells.length]])
    assert w.chunks is None and w.cells is not None  # nothing taken
    fresh, raw = table(rows)
    with pytest.raises(ManifestError, match="1 tensor tables|tables given"):
        tables.resolve(fresh, [raw, raw])
    with pytest.raises(ManifestError, match="not read"):
        fresh.require_resolved()


def test_an_older_reader_refuses_format_7_clearly(tmp_path, monkeypatch):
    doc = _doc(tmp_path)
    monkeypatch.setattr(manifest_mod, "READABLE_VERSIONS", (1, 2, 3, 4, 5, 6))  # what a format-6 reader accepts
    with pytest.raises(ManifestError, match="unknown format 'engine-ext-delta' version 7"):
        Manifest.from_json(json.dumps(doc).encode())


def test_inline_manifests_keep_their_format(tmp_path):
    """Under the limit nothing changes: format 5, no table fields (format-5 readers refuse unknown keys)."""
    _publish(tmp_path, _states(steps=1), 4096)
    raw = (tmp_path / "v00000001.json").read_bytes()
    assert json.loads(raw)["format_version"] == 5 and b'"tables"' not in raw and b'"cells"' not in raw


def test_a_1t_moe_manifest_is_small_and_a_rank_reads_its_own_metadata():
    """bench/manifest_size.py on two layers of a Kimi-K2-like MoE (4,618 tensors, 37,128 cells): the
    manifest grows by a table reference per 64 tensors, not by tensors or cells; an expert-parallel
    rank reads its own tables and cell tables only, a few percent of the data it fetches."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("manifest_size", Path(__file__).parents[1] / "bench" / "manifest_size.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cell_tables = bench.measure(layers=2, experts=384, ep=16, reader_tp=1)  # format 10
    assert cell_tables["format_version"] == 10
    assert cell_tables["cell_tables_bytes"] == cell_tables["cells"] * CELL_RECORD.itemsize  # 75 bytes a cell
    r = bench.measure(layers=2, experts=384, ep=16)  # format 12: cell sections for TP 8
    assert r["format_version"] == 12 and r["tensors"] == 4618 and r["cells"] > 36_000
    assert r["manifest_bytes"] < 16 << 10 < 10 ** 6 < r["inline_manifest_bytes"]
    ep, tp, everything = r["ep_rank"], r["tp_rank"], r["tensor_tables_bytes"] + r["cell_tables_bytes"]
    ep10 = cell_tables["ep_rank"]["read_bytes"]
    assert ep10 < (cell_tables["tensor_tables_bytes"] + cell_tables["cell_tables_bytes"]) / 10
    # a rank of whole tensors reads every section of its tables, the records of the other tensors there with
    # its own (+21 % here): still a few percent of its data
    assert ep["read_bytes"] < 1.25 * ep10 and ep["read_bytes"] < 0.05 * ep["data_bytes"]
    assert ep["tensors"] == 2 + 4 * 2 + 2 * 24 * 6  # the embeddings, the dense tensors, its 24 experts' 6 tensors
    assert tp["tensors"] == r["tensors"] and tp["data_bytes"] == cell_tables["tp_rank"]["data_bytes"]
    # the TP rank reads every tensor table and its share of the cell records: under half what format 10 made it read
    assert tp["read_bytes"] < r["tensor_tables_bytes"] + r["cell_tables_bytes"] / 4 + r["manifest_bytes"]
    assert tp["read_bytes"] < 0.5 * cell_tables["tp_rank"]["read_bytes"]


_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True)
                     | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                     max_leaves=6)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    _publish(root, _states(steps=1), 0, binary=False)
    m = Manifest.from_json((root / "v00000001.json").read_bytes())
    blob = (root / m.blobs[-1].key).read_bytes()
    rows = json.loads(blob[m.tables[0].offset:m.tables[0].offset + m.tables[0].length])
    w = rows[0]["cells"]
    return (root / "v00000001.json").read_bytes(), rows, blob[w["offset"]:w["offset"] + w["length"]]


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_table_bytes_give_a_manifest_error_or_a_valid_manifest(small, data):
    """Tables whose hashes match (a signed manifest naming hostile tables): any field of a tensor
    entry replaced by any JSON value or removed, the table not a list, any field of a cell record
    set to any value its width holds, a cell table of any bytes: a clear ManifestError, never
    another exception, and never chunks taken that do not check."""
    raw, rows, cells = small
    rows = json.loads(json.dumps(rows))
    target = data.draw(st.sampled_from(["tensor", "cell", "cell bytes", "whole"]))
    if target == "whole":
        rows = data.draw(_json)
    elif target == "tensor":
        row = rows[data.draw(st.integers(0, len(rows) - 1))]
        key = data.draw(st.sampled_from(sorted(row) + ["extra"]))
        if data.draw(st.booleans()):
            row[key] = data.draw(_json)
        else:
            row.pop(key, None)
    elif target == "cell":  # one field of one record, any value its width holds
        rec = np.frombuffer(cells, CELL_RECORD).copy()
        field = data.draw(st.sampled_from(CELL_RECORD.names))
        i = data.draw(st.integers(0, len(rec) - 1))
        if field == "sha256":
            rec[field][i] = data.draw(st.binary(min_size=32, max_size=32))
        else:
            rec[field][i] = data.draw(st.integers(0, 2 ** (8 * CELL_RECORD[field].itemsize) - 1))
        cells = rec.tobytes()
    else:
        cells = data.draw(st.binary(max_size=4 * CELL_RECORD.itemsize))

    def with_table(m, ref, entries):
        b = entries if isinstance(entries, bytes) else json.dumps(entries).encode()
        ref.sha256, ref.length = hashlib.sha256(b).hexdigest(), len(b)
        ref.count = max(1, len(b) // CELL_RECORD.itemsize) if isinstance(entries, bytes) else (
            len(entries) if isinstance(entries, list) else 1)
        m.blobs[ref.blob].size = 10 ** 9
        return b

    m = Manifest.from_json(raw)
    table = with_table(m, m.tables[0], rows)
    try:
        tables.resolve(m, [table])
    except ManifestError:
        return
    w = m.tensors[0]  # (format 7)
    if w.cells is None:
        return
    try:
        cell_reads.set_cells(m, cell_reads.CutTensors.of(m, {w.name}), [with_table(m, w.cells, cells)])
    except ManifestError:
        assert w.chunks is None
        return
    assert sum(c.nnz for c in w.chunks) == w.nnz


# ---- format 10: binary tensor tables behind a name index (issue 42)

def _raw_of(root, m, ref):
    return (root / m.blobs[ref.blob].key).read_bytes()[ref.offset:ref.offset + ref.length]


@pytest.fixture(scope="module")
def small_tables(tmp_path_factory):
    """One delta of the 5-tensor model in format 10, two tensors per table (3 tables)."""
    root = tmp_path_factory.mktemp("f10")
    with mock.patch.object(tables, "PER_TABLE", 2):
        _publish(root, _states(steps=1), 0)
    return root


def test_a_rank_reads_the_index_and_only_the_tables_of_its_tensors(small_tables):
    root = small_tables
    store, raw = open_store(str(root)), (root / "v00000001.json").read_bytes()
    whole = read_manifest(store, "v00000001.json")
    assert [r.count for r in whole.tables] == [2, 2, 1] and whole.format_version == 10
    m, n = open_held(store, raw, {"experts.1.w", "not.in.this.version"})
    assert [t.name for t in m.tensors] == ["experts.1.w"] and m.held is not None
    assert n == m.index.length + m.tables[1].length  # the index and the one table that holds it
    assert m.tensors[0] == next(t for t in whole.tensors if t.name == "experts.1.w")
    with pytest.raises(ManifestError, match="own tensors only"):
        m.require_whole()
    m0, n0 = open_held(store, raw, {"not.in.this.version"})
    assert m0.tensors == [] and n0 == m0.index.length
    mw, _ = open_held(store, raw, {"w"})  # a rank holding rows of w keeps its cells' chunks, checks every record
    load_cells(store, mw, {"w": {0, 1}})
    w = next(t for t in whole.tensors if t.name == "w")
    load_cells(store, whole)
    assert [c.cell for c in mw.tensors[0].chunks] == [0, 1] and mw.tensors[0].chunks == w.chunks[:2]
    with pytest.raises(ManifestError, match="only a rank's own manifest"):
        cell_reads.CutTensors.of(whole, {"w": {0}}, keep=True)
    states = _states(steps=1)
    part, _ = fetch_selected(store, m, {"experts.1.w": None}, bases=TensorBases(states[0]))
    full = load_delta(str(root / "v00000001.json"), names={"experts.1.w"}, bases=TensorBases(states[0]))
    assert torch.equal(part[0].values, full.tensors[0].values) and torch.equal(part[0].positions, full.tensors[0].positions)


def _retabled(root, doc, edit):
    """``doc`` with tensor table 0 and the index re-written from ``edit(entries of every table)`` ->
    (entries per table, index bytes or None: rebuilt): their hashes match, so only their contents can lie."""
    m = Manifest.from_json(json.dumps(doc).encode())
    groups = [list(tensor_records.read_tensor_tables([r], [_raw_of(root, m, r)], [0])) for r in m.tables]
    groups, index = edit(groups)
    blobs = [tensor_records.tensor_table(g, [t.cells for t in g]) for g in groups]
    index = index if index is not None else tables.name_index([[t.name for t in g] for g in groups])
    for ref, raw in zip(m.tables, blobs):
        ref.sha256, ref.length, ref.count = hashlib.sha256(raw).hexdigest(), len(raw), len(raw) and ref.count
    m.index.sha256, m.index.length = hashlib.sha256(index).hexdigest(), len(index)
    for ref, g in zip(m.tables, groups):
        ref.count = len(g)
    m.index.count = len(index) // tables.INDEX_RECORD.itemsize
    m.blobs[-1].size = 10 ** 9
    return m, blobs, index


def test_a_ranks_selection_cells_and_parts_come_from_columns_with_no_entry_made(small_tables):
    """Issue 52, item 2: a rank's metadata (select_cells, load_cells) and its parts run on the manifest's
    columns and the cell records; no entry object is made before the decode. select_cells: a tensor held whole
    (None) or through a box of every element is wanted whole; one held none of (()) is left out, cut or not; a
    cut one held in part wants the cells meeting its boxes; a changed tensor the reader does not name is
    returned as unknown. The parts are those the entry objects give."""
    from engine_ext.format.chunks import cells_meeting
    from engine_ext.store.reader import plan, select_cells

    root = small_tables
    store, raw = open_store(str(root)), (root / "v00000001.json").read_bytes()
    whole = read_manifest(store, "v00000001.json")
    load_cells(store, whole)
    shape = {t.name: tuple(t.shape) for t in whole.tensors}
    held = {"w": (((0, 0), (100, 256)),), "experts.0.w": (((0, 0), shape["experts.0.w"]),), "experts.1.w": (),
            "b": (), "norm": None}
    m, _ = open_held(store, raw, set(held))
    sel, unknown = select_cells(m, held)
    assert unknown == [] and m.tensors._made is None
    w = next(t for t in whole.tensors if t.name == "w")
    changed = {t.name for t in whole.tensors if t.nnz}
    assert changed >= {"w", "experts.0.w", "norm", "b"} and w.grid is not None
    assert sel == {"w": frozenset(cells_meeting(w.grid, w.shape, (0, 0), (100, 256))), "experts.0.w": None,
                   "norm": None}
    assert select_cells(m, {k: v for k, v in held.items() if k != "w"})[1] == ["w"]
    load_cells(store, m, sel)
    parts = plan(m, sel)
    assert m.tensors._made is None and len(parts)  # still no entry object
    by_name = {t.name: t for t in whole.tensors}
    expected = [(n, c.cell, c.blob, c.offset, c.length, c.sha256) for n in ("w", "experts.0.w")
                for c in sorted(by_name[n].chunks, key=lambda c: c.cell) if sel[n] is None or c.cell in sel[n]]
    t = by_name["norm"]
    expected += [("norm", -1, t.blob, t.offset, t.length, t.sha256)]
    names = m.columns().names
    got = [(names[r], cell, b, o, n, parts.records["sha256"][i].tobytes().hex())
           for i, (r, cell, (b, o, n)) in enumerate(zip(parts.rows.tolist(), parts.cells.tolist(), parts.ranges()))]
    assert got == sorted(expected, key=lambda e: ([t.name for t in whole.tensors].index(e[0]), e[1]))
    assert set(parts.digests()) == {(b, o) for _, _, b, o, _, _ in expected}
    mw, _ = open_held(store, raw, {"w"})  # held, but none of its cells kept: no part, and no error
    load_cells(store, mw, {"w": frozenset()})
    assert len(plan(mw, {"w": frozenset()})) == 0 and len(mw.tensors[0].chunks) == 0


def test_the_driver_reads_the_whole_as_columns_and_makes_no_entry(small_tables):
    """Issue 52, item 2: the whole read (the driver's, once per version) checks 140 k K2 entries as arrays and
    the plan's checks run on the columns: no TensorEntry is made until one is asked for, and then each says
    what its columns said (and what the inline entries of the same version say: test_entries). The names of
    a model are decoded and hashed once per process: a later read of the same names reuses them."""
    root = small_tables
    store, raw = open_store(str(root)), (root / "v00000001.json").read_bytes()
    tensor_records.forget_names()
    m = open_manifest(store, raw)
    assert isinstance(m.tensors, tensor_records.TableEntries) and len(m.tensors) == 5
    served = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in _states(steps=1)[1].items()}
    check_expected(m, served, "v1")
    check_decode_budget(m)
    c = m.columns()
    assert sorted(c.changed()) == sorted(n for n, nnz in zip(c.names, c.nnz.tolist()) if nnz) and c.changed()
    assert m.tensors._made is None  # nothing above made an object
    made = entries.Columns.of_entries(list(m.tensors))  # the objects, then their columns: the same
    assert made.names == c.names and made.dtype_names() == c.dtype_names() and made.shape_tuples() == c.shape_tuples()
    for field in ("nnz", "fingerprint", "base", "has_base", "plen", "vlen", "blob", "offset", "cells", "cell_count"):
        assert np.array_equal(getattr(made, field), getattr(c, field)), field
    again = open_manifest(store, raw)
    assert again.columns().names is c.names and again.tensors.name_keys() is m.tensors.name_keys()
    with pytest.raises(ModelMismatchError, match="'b' is \\[64\\]/bfloat16, the served model has \\[65\\]"):
        check_expected(again, served | {"b": ((65,), "bfloat16")}, "v1")
    assert again.tensors._made is None


def _with_records(root, m, i: int, edit):
    """The bytes of every tensor table of ``m``, table ``i``'s records changed by ``edit(records)``, and the
    references re-hashed (a signed manifest naming lying tables: only their contents can lie)."""
    blobs = [_raw_of(root, m, r) for r in m.tables]
    at, n = tensor_records.TABLE_HEAD.itemsize, m.tables[i].count
    b = bytearray(blobs[i])
    rec = np.frombuffer(bytes(b[at:at + n * tensor_records.TENSOR_RECORD.itemsize]), tensor_records.TENSOR_RECORD).copy()
    edit(rec)
    b[at:at + n * tensor_records.TENSOR_RECORD.itemsize] = rec.tobytes()
    blobs[i] = bytes(b)
    m.tables[i].sha256 = hashlib.sha256(blobs[i]).hexdigest()
    return blobs


@pytest.mark.parametrize("edit, says", [
    (lambda r: r.__setitem__("dtype", 200), "tensor table 2: a record's code is out of range"),
    (lambda r: r.__setitem__("nnz", 1 << 63), "outside"),
    (lambda r: r.__setitem__("shape", 1), "tensor table 2: a record's code is out of range"),
    (lambda r: r["flags"].__setitem__(0, 0), "fingerprint"),
], ids=["code", "huge-nnz", "shape", "base-flag"])
def test_a_lying_record_in_a_later_table_is_refused_naming_it(small_tables, edit, says):
    """Every table's records are checked as one array: an error still names the table and the entry."""
    root = small_tables
    raw = (root / "v00000001.json").read_bytes()
    m = Manifest.from_json(raw)
    index = _raw_of(root, m, m.index)
    blobs = _with_records(root, m, 2, edit)
    with pytest.raises(ManifestError, match=says):
        tables.resolve(m, blobs, index)
    assert m.tensors == []


def test_binary_tables_and_an_index_that_lie_are_refused(small_tables):
    root = small_tables
    doc = json.loads((root / "v00000001.json").read_bytes())
    m, blobs, index = _retabled(root, doc, lambda g: ([g[0][:1], *g[1:]], None))  # a tensor left out
    with pytest.raises(ManifestError, match="fingerprint"):
        tables.resolve(m, blobs, index)

    def swapped(g):  # the index places two names on each other's records
        idx = np.frombuffer(tables.name_index([[t.name for t in x] for x in g]), tables.INDEX_RECORD).copy()
        idx["row"][[0, 1]], idx["table"][[0, 1]] = idx["row"][[1, 0]], idx["table"][[1, 0]]
        return g, idx.tobytes()

    m, blobs, index = _retabled(root, doc, swapped)
    with pytest.raises(ManifestError, match="not the one"):
        tables.resolve(m, blobs, index)
    name = next(t.name for g in [list(tensor_records.read_tensor_tables([r], [b], [0])) for r, b in zip(m.tables, blobs)] for t in g
                if name_key(t.name) == int(np.frombuffer(index, tables.INDEX_RECORD)["key"][0]))
    places, found = tables.lookup(m, index, {name})
    with pytest.raises(ManifestError, match="places"):
        tables.select(m, places, dict(enumerate(blobs)), {name}, found)
    assert m.held is None and m.tensors == []


@pytest.mark.parametrize("change, match", [
    (lambda d: d["index"].update(count=d["index"]["count"] + 1), "name index holds"),
    (lambda d: d.pop("index"), "needs a name index"),
    (lambda d: d.update(format_version=9), "only format-10"),
    (lambda d: d["index"].update(offset=d["tables"][0]["offset"]), "overlap"),
    (lambda d: d["index"].update(sha256="0" * 63), "sha256"),
])
def test_hostile_index_references_are_refused(small_tables, change, match):
    doc = json.loads((small_tables / "v00000001.json").read_bytes())
    change(doc)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(doc).encode())


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_binary_table_bytes_give_a_manifest_error_or_a_valid_manifest(small_tables, data):
    """Format 10, hashes matching (a signed manifest naming hostile tables): any field of any tensor record
    set to any value its width holds, any byte of the table changed, the table cut or any bytes: a clear
    ManifestError from the whole read and from a rank's, never another exception; what is taken checks."""
    root = small_tables
    raw = (root / "v00000001.json").read_bytes()
    m = Manifest.from_json(raw)
    blobs = [_raw_of(root, m, r) for r in m.tables]
    index = _raw_of(root, m, m.index)
    i = data.draw(st.integers(0, len(blobs) - 1))
    how = data.draw(st.sampled_from(["field", "byte", "cut", "any"]))
    b = bytearray(blobs[i])
    if how == "field":
        at, n = tensor_records.TABLE_HEAD.itemsize, m.tables[i].count
        rec = np.frombuffer(bytes(b[at:at + n * tensor_records.TENSOR_RECORD.itemsize]), tensor_records.TENSOR_RECORD).copy()
        field, j = data.draw(st.sampled_from(tensor_records.TENSOR_RECORD.names)), data.draw(st.integers(0, n - 1))
        if field == "sha256":
            rec[field][j] = data.draw(st.binary(min_size=32, max_size=32))
        else:
            rec[field][j] = data.draw(st.integers(0, 2 ** (8 * tensor_records.TENSOR_RECORD[field].itemsize) - 1))
        b[at:at + n * tensor_records.TENSOR_RECORD.itemsize] = rec.tobytes()
    elif how == "byte":
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    elif how == "cut":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    else:
        b = bytearray(data.draw(st.binary(max_size=600)))
    blobs[i] = bytes(b)
    ref = m.tables[i]
    ref.sha256, ref.length = hashlib.sha256(blobs[i]).hexdigest(), len(blobs[i])
    m.blobs[ref.blob].size = 10 ** 9
    names = {"w", "experts.0.w", "experts.1.w", "b", "norm"}
    for whole in (True, False):
        fresh = Manifest.from_json(json.dumps(json.loads(m.to_json())).encode()) if len(blobs[i]) >= 2 else None
        if fresh is None:
            return
        try:
            if whole:
                tables.resolve(fresh, blobs, index)
            else:
                places, found = tables.lookup(fresh, index, names)
                tables.select(fresh, places, dict(enumerate(blobs)), names, found)
        except ManifestError:
            assert not fresh.tensors
            continue
        assert {t.name for t in fresh.tensors} <= names


def test_expert_parallel_ranks_read_only_their_own_tensor_tables(tmp_path):
    """In-process ranks (the code vLLM's and SGLang's workers run): rank 0 holds expert 0, rank 1 expert 1,
    both hold ``w`` in halves and the small tensors. One tensor per table: each rank reads the name index
    and the tables of its own tensors, never the other expert's; the update lands bit-exact on both."""
    states = _states(steps=2)
    with mock.patch.object(tables, "PER_TABLE", 1):
        _publish(tmp_path, states, 0)
    other = {0: "experts.1.w", 1: "experts.0.w"}
    ranks = [make_rank(r, states[0], sharded=("w",), world=2, absent=(other[r],)) for r in range(2)]
    seen: dict = {}
    select = tables.select

    def recording(m, places, got, names, found):
        seen[frozenset(names)] = sorted(t.name for i in places for t in list(tensor_records.read_tensor_tables([m.tables[i]], [got[i]], [i])))
        return select(m, places, got, names, found)

    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]), version=0)
    asyncio.run(ctl.start())
    with mock.patch.object(tables, "select", recording):
        a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(tmp_path / "v00000002.json")})))
    assert a["version"] == 2
    for up in ranks:
        names = set(states[0]) - {other[up.rank]}
        assert seen[frozenset(names)] == sorted(names)  # its tables, one tensor each: not the other expert's
        for name in names - {"w"}:
            assert torch.equal(up.module.param(name).view(torch.int16), states[2][name].view(torch.int16)), name
        half = up.module.param("w")
        assert torch.equal(half.view(torch.int16), states[2]["w"][up.rank * 256:(up.rank + 1) * 256].view(torch.int16))
    assert len(seen) == 2 and len(a["fetched_bytes"]) == 2
