"""Cell sections (format 12, issue 52): a tensor-parallel rank reads the cell records of its own share only.

A publisher in tables (``ENGINE_EXT_INLINE_ENTRIES`` exceeded; 0 here) keeps the chunks of each matrix cut
along the dimension the engines shard it along in its tensor table's *cell sections*, one per share of
``ENGINE_EXT_READER_TP``, each share's sections of every table one after another. A rank of that degree reads
its own share's section of each table it holds, checked against the SHA-256 its table lists; a matrix the
name does not place keeps a cell table of its own (format 7's). Decoded, whole or by rank, it equals the
inline publish bit for bit; hostile sections (records in another share, counts that lie, bytes changed) are
refused before any chunk is taken.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import struct
from unittest import mock

import numpy as np
import pytest
import torch
from fake_ranks import FakeRanks, make_rank
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from test_chunks import noisy_versions

from engine_ext import settings
from engine_ext.errors import IntegrityError, ManifestError
from engine_ext.format import cell_reads, chunks, tables, tensor_records
from engine_ext.format.manifest import CellSections, Manifest, TableRef
from engine_ext.format.tensor_records import SECTION_RECORD, SECTION_REF, TENSOR_RECORD
from engine_ext.server.controller import Controller
from engine_ext.server.protocol import UpdateRequest
from engine_ext.store import open_store
from engine_ext.store.decoding import TensorBases
from engine_ext.store.reader import fetch_selected, load_cells, load_delta, open_held, read_manifest
from engine_ext.store.sources import Sources
from engine_ext.trainer.publisher import DeltaPublisher

Q, O, W = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight", "w"
NORM = "model.layers.0.input_layernorm.weight"


def _states(steps=2, seed=0):
    """q_proj (column parallel: shared out along 0), o_proj (row parallel: along 1), ``w`` (no layer the
    engines name: a cell table of its own) and a norm (not cut), then ``steps`` versions."""
    g = torch.Generator().manual_seed(seed)
    sd = {Q: torch.randn(512, 256, generator=g), O: torch.randn(256, 512, generator=g),
          W: torch.randn(512, 256, generator=g), NORM: torch.randn(256, generator=g)}
    return noisy_versions({n: t.to(torch.bfloat16) for n, t in sd.items()}, steps, g)


def _publish(root, states, limit: int, reader_tp: int = 8, per_table: int | None = None):
    patch = mock.patch.object(tables, "PER_TABLE", per_table) if per_table else contextlib.nullcontext()
    with settings.override(inline_entries=limit, reader_tp=reader_tp), patch, \
            DeltaPublisher(str(root), anchor_every=0, chunk_min_cell=1024) as pub:
        for sd in states:
            pub.publish(sd)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The same versions in tables (format 12, one tensor per table) and inline (format 5)."""
    states = _states()
    sectioned, inline = tmp_path_factory.mktemp("sections"), tmp_path_factory.mktemp("inline")
    _publish(sectioned, states, 0, per_table=1)
    _publish(inline, states, 4096)
    return states, sectioned, inline


def _raw(root, m, ref):
    return (root / m.blobs[ref.blob].key).read_bytes()[ref.offset:ref.offset + ref.length]


def test_format_12_keeps_sharded_matrices_in_cell_sections(run):
    _, root, _ = run
    doc = json.loads((root / "v00000001.json").read_bytes())
    assert doc["format_version"] == 12 and doc["tensors"] == []
    m = read_manifest(open_store(str(root)), "v00000001.json")
    by = {t.name: t for t in m.tensors}
    assert isinstance(by[Q].cells, CellSections) and by[Q].cells.dim == 0 and len(by[Q].cells.sections) == 8
    assert isinstance(by[O].cells, CellSections) and by[O].cells.dim == 1
    assert isinstance(by[W].cells, TableRef) and by[NORM].cells is None  # no layer named; not cut
    store = open_store(str(root))
    counts = {t.name: [r.count for r in t.cells.sections] for t in (by[Q], by[O])}
    load_cells(store, m)
    for t in (by[Q], by[O]):  # a table of one tensor: section k holds its changed cells of share k (an 8 x 8 grid)
        per_cell = chunks.cell_shares(t.grid, t.shape, 0 if t.name == Q else 1, 8)
        assert counts[t.name] == [sum(1 for c in t.chunks if per_cell[c.cell] == k) for k in range(1, 9)]
        assert sum(counts[t.name]) == len(t.chunks) and len(t.grid[0 if t.name == Q else 1]) == 9
    # share k's sections of every table lie one after another: a rank of TP 8 reads one range per share
    m = read_manifest(store, "v00000001.json")
    by = {t.name: t for t in m.tensors}
    starts = sorted((r.offset, r.length, k) for t in (by[Q], by[O]) for k, r in enumerate(t.cells.sections, 1) if r.count)
    assert [k for _, _, k in starts] == sorted(k for _, _, k in starts)
    for (a, n, k), (b, _, k2) in itertools.pairwise(starts):
        assert k2 != k or b == a + n


def test_format_12_decodes_as_inline_does(run):
    states, root, inline = run
    for v in (1, 2):
        a, b = (load_delta(str(r / f"v{v:08d}.json"), bases=TensorBases(states[v - 1])) for r in (root, inline))
        assert a.fingerprint == b.fingerprint and a.tensor_fingerprints == b.tensor_fingerprints
        for x, y in zip(sorted(a.tensors, key=lambda t: t.name), sorted(b.tensors, key=lambda t: t.name)):
            assert x.name == y.name and torch.equal(x.positions, y.positions) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("tp", [2, 8])
def test_a_tp_rank_reads_only_the_sections_of_its_share(run, tp):
    """Each rank of TP ``tp`` reads its own shares' sections (and the cell table of ``w``), no other record,
    and decodes exactly the inline publish's cells it selects."""
    states, root, inline = run
    store, istore = open_store(str(root)), open_store(str(inline))
    whole = read_manifest(store, "v00000001.json")
    sections = [t.cells.sections for t in whole.tensors if t.name in (Q, O)]
    for rank in range(tp):
        sel = {}
        for name, dim in ((Q, 0), (O, 1)):
            shape = states[0][name].shape
            start, stop = [0, 0], list(shape)
            start[dim], stop[dim] = rank * shape[dim] // tp, (rank + 1) * shape[dim] // tp
            grid = next(t.grid for t in whole.tensors if t.name == name)
            sel[name] = chunks.cells_meeting(grid, shape, start, stop)
        raw = (root / "v00000001.json").read_bytes()
        m, _ = open_held(store, raw, set(sel))
        per = 8 // tp  # its shares of the 8 sections: exactly those are read
        assert load_cells(store, m, sel) == sum(r.length for s in sections for r in s[rank * per:(rank + 1) * per])
        ref = read_manifest(istore, "v00000001.json")
        mine = {t.name: sorted((c.cell, c.nnz) for c in t.chunks if c.cell in sel[t.name]) for t in m.tensors}
        want = {t.name: sorted((c.cell, c.nnz) for c in t.chunks if c.cell in sel[t.name]) for t in ref.tensors if t.name in sel}
        assert mine == want
        a, _ = fetch_selected(store, m, sel, bases=TensorBases(states[0]))
        b, _ = fetch_selected(istore, ref, sel, bases=TensorBases(states[0]))
        for x, y in zip(sorted(a, key=lambda t: t.name), sorted(b, key=lambda t: t.name)):
            assert torch.equal(x.positions, y.positions) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_end_bit_exact(run, world):
    """In-process ranks holding 1/world of q_proj's rows and o_proj's columns take the format-12 chain
    through the controller and equal the last version exactly."""
    states, root, _ = run
    ranks = [make_rank(r, states[0], sharded=(Q, O), world=world, by_column=(O,)) for r in range(world)]
    ctl = Controller(FakeRanks(ranks), Sources([str(root)]), version=0)
    asyncio.run(ctl.start())
    assert asyncio.run(ctl.update(UpdateRequest.parse({"url": str(root / "v00000002.json")})))["version"] == 2
    for up in ranks:
        rows, cols = 512 // world, 512 // world
        assert torch.equal(up.module.param(Q).view(torch.int16), states[2][Q][up.rank * rows:(up.rank + 1) * rows].view(torch.int16))
        assert torch.equal(up.module.param(O).view(torch.int16), states[2][O][:, up.rank * cols:(up.rank + 1) * cols].view(torch.int16))
        assert torch.equal(up.module.param(W).view(torch.int16), states[2][W].view(torch.int16))


def test_reader_tp_1_writes_format_10(tmp_path):
    _publish(tmp_path, _states(steps=1), 0, reader_tp=1)
    assert json.loads((tmp_path / "v00000001.json").read_bytes())["format_version"] == 10
    m = read_manifest(open_store(str(tmp_path)), "v00000001.json")
    assert not any(isinstance(t.cells, CellSections) for t in m.tensors)


# ---- hostile sections: a signed manifest naming tables whose hashes match, their contents lying


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One format-12 delta, every tensor in one table: its bytes, its index, and each share's section."""
    root = tmp_path_factory.mktemp("hostile")
    _publish(root, _states(steps=1), 0)
    raw = (root / "v00000001.json").read_bytes()
    m = Manifest.from_json(raw)
    assert len(m.tables) == 1
    table, index = _raw(root, m, m.tables[0]), _raw(root, m, m.index)
    trailer = _trailer(table)
    sections = {k: _raw(root, m, TableRef(int(r["blob"]), int(r["offset"]), int(r["count"]) * SECTION_RECORD.itemsize, "", 1))
                for k, r in enumerate(trailer, 1) if r["count"]}
    return raw, table, index, sections


def _trailer(table: bytes) -> np.ndarray:
    (shares,) = struct.unpack_from("<H", table, len(table) - 2 - 8 * SECTION_REF.itemsize)
    assert shares == 8
    return np.frombuffer(table, SECTION_REF, 8, len(table) - 8 * SECTION_REF.itemsize).copy()


def _with(small, sections: dict[int, bytes], table_edit=None):
    """The manifest with its table's sections replaced by ``sections`` (their counts and hashes written into
    its trailer, the table's hash into the manifest), resolved whole, and the sections keyed for set_cells."""
    raw, table, index, _ = small
    trailer = _trailer(table)
    blob, at = int(trailer["blob"].max()), 10 ** 8  # laid out afresh, one after another, far from the tables
    for k in range(1, 9):
        b = sections.get(k, b"")
        n = len(b) // SECTION_RECORD.itemsize
        trailer["count"][k - 1] = n
        trailer["sha256"][k - 1] = hashlib.sha256(b).digest() if n else bytes(32)
        trailer["blob"][k - 1], trailer["offset"][k - 1] = (blob, at) if n else (0, 0)
        at += len(b)
    body = bytearray(table[:len(table) - 8 * SECTION_REF.itemsize] + trailer.tobytes())
    if table_edit:
        table_edit(body)
    m = Manifest.from_json(raw)
    m.tables[0].sha256, m.tables[0].length = hashlib.sha256(bytes(body)).hexdigest(), len(body)
    m.blobs[m.tables[0].blob].size = 10 ** 9
    tables.resolve(m, [bytes(body)], index)
    return m, {(0, k): b for k, b in sections.items() if len(b)}


def _set(m, sections):
    """set_cells over the tensors in cell sections (the manifest's other cut tensor keeps its cell table)."""
    cut = cell_reads.CutTensors.of(m, {t.name for t in _in_sections(m)})
    assert len(cut) and (cut.table >= 0).all()
    cell_reads.set_cells(m, cut, [None] * len(cut), sections)


def _in_sections(m) -> list:
    return [t for t in m.tensors if isinstance(t.cells, CellSections)]


def _take(m, sections):
    cut = _in_sections(m)
    _set(m, sections)
    return cut


def test_the_sections_as_written_are_taken(small):
    m, sections = _with(small, dict(small[3]))
    for t in _take(m, sections):
        assert t.cells is None and sum(c.nnz for c in t.chunks) == t.nnz


def _moved(small) -> dict[int, bytes]:
    """Share 1's first record moved into share 2's section (each still sorted)."""
    one, two = (np.frombuffer(small[3][k], SECTION_RECORD).copy() for k in (1, 2))
    two = np.sort(np.concatenate([two, one[:1]]), order=["row", "cell"])
    return {**small[3], 1: one[1:].tobytes(), 2: two.tobytes()}


def test_a_record_in_another_shares_section_is_refused(small):
    m, sections = _with(small, _moved(small))
    cut = _in_sections(m)
    with pytest.raises(ManifestError, match="another share's section"):
        _set(m, sections)
    assert all(t.chunks is None and t.cells is not None for t in cut)  # nothing taken


def test_sections_that_lie_about_their_records_are_refused(small):
    one = np.frombuffer(small[3][1], SECTION_RECORD)
    with pytest.raises(ManifestError, match="cell sections hold"):  # a record dropped: the table's count
        _with(small, {**small[3], 1: one[1:].tobytes()})
    swapped = one.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    m, sections = _with(small, {**small[3], 1: swapped.tobytes()})
    with pytest.raises(ManifestError, match="not sorted"):
        _take(m, sections)
    beyond = one.copy()
    beyond["row"][-1] = 60000
    m, sections = _with(small, {**small[3], 1: beyond.tobytes()})
    with pytest.raises(ManifestError, match="beyond its table"):
        _take(m, sections)


def test_changed_section_bytes_are_refused(small):
    m, sections = _with(small, dict(small[3]))
    key = next(iter(sections))
    sections[key] = bytes([sections[key][0] ^ 1]) + sections[key][1:]
    with pytest.raises(IntegrityError, match="cell section"):
        _take(m, sections)


def _record_field(body: bytearray, field: str, value: int, row: int = 0) -> None:
    at = tensor_records.TABLE_HEAD.itemsize + row * TENSOR_RECORD.itemsize + TENSOR_RECORD.fields[field][1]
    struct.pack_into("<B", body, at, value)


def test_a_trailer_or_flags_out_of_the_rules_are_refused(small):
    def one_share(body):
        struct.pack_into("<H", body, len(body) - 2 - 8 * SECTION_REF.itemsize, 1)

    with pytest.raises(ManifestError):
        _with(small, dict(small[3]), one_share)
    m = Manifest.from_json(small[0])
    norm = [t.name for t in tables.read_tensor_tables(m.tables, [small[1]], [0], sectioned=True).make()].index(NORM)
    with pytest.raises(ManifestError, match="code is out of range"):  # the dimension flag on a tensor not in sections
        _with(small, dict(small[3]), lambda body: _record_field(body, "flags", 1 | tensor_records.DIM1, norm))


def test_a_format_10_reader_of_a_format_12_table_refuses_it(small):
    m = Manifest.from_json(small[0])
    m.format_version = 10
    with pytest.raises(ManifestError, match="parts account for"):
        tables.resolve(m, [small[1]], small[2])


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_section_bytes_give_a_clear_error_or_valid_chunks(small, data):
    """Sections whose hashes match: any field of any record set to any value its width holds, any byte
    changed, a section cut or any bytes: a ManifestError (or IntegrityError) and nothing taken, or chunks
    that check."""
    sections = dict(small[3])
    k = data.draw(st.sampled_from(sorted(sections)))
    how = data.draw(st.sampled_from(["field", "byte", "cut", "any"]))
    b = bytearray(sections[k])
    if how == "field":
        rec = np.frombuffer(bytes(b), SECTION_RECORD).copy()
        field, i = data.draw(st.sampled_from(SECTION_RECORD.names)), data.draw(st.integers(0, len(rec) - 1))
        if field == "sha256":
            rec[field][i] = data.draw(st.binary(min_size=32, max_size=32))
        else:
            rec[field][i] = data.draw(st.integers(0, 2 ** (8 * SECTION_RECORD[field].itemsize) - 1))
        b = bytearray(rec.tobytes())
    elif how == "byte":
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    elif how == "cut":
        b = b[:SECTION_RECORD.itemsize * data.draw(st.integers(0, len(b) // SECTION_RECORD.itemsize - 1))]
    else:
        b = bytearray(data.draw(st.binary(max_size=4 * SECTION_RECORD.itemsize)))
        b = b[:len(b) // SECTION_RECORD.itemsize * SECTION_RECORD.itemsize]
    sections[k] = bytes(b)
    try:
        m, keyed = _with(small, sections)
    except ManifestError:
        return
    cut = _in_sections(m)
    try:
        _set(m, keyed)
    except ManifestError:
        assert all(t.chunks is None for t in cut)
        return
    for t in cut:
        assert sum(c.nnz for c in t.chunks) == t.nnz and len({c.cell for c in t.chunks}) == len(t.chunks)
