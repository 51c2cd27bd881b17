"""A sharded version in tables written where its entries are made (issue 52, item 1): each rank validates and
tables the tensors it publishes whole, rank 0 joins only the split ones and writes the name index.

The parts here are made by hand (entries and chunks as a rank's encoder lists them, blob contents never
read: the readers below read tables only); tests/test_sharded.py publishes such versions from real ranks
(``ENGINE_EXT_INLINE_ENTRIES=0``, world 4) and serves them bit-exact.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from engine_ext.errors import ManifestError
from engine_ext.format import chunks
from engine_ext.format import fingerprint as fpr
from engine_ext.format.manifest import DELTA, Blob, Chunk, Manifest, Segment, TensorEntry
from engine_ext.store import open_store
from engine_ext.store.reader import load_cells, open_held, open_manifest
from engine_ext.trainer import table_parts
from engine_ext.trainer.builder import commit, merge_parts

SHA = hashlib.sha256(b"x").hexdigest()


def _part(rank: int, whole: list[tuple[str, list[int]]], rows: dict[str, tuple[list[int], int, int]]) -> Manifest:
    """Rank ``rank``'s part of v2 (a delta on v1): ``whole`` tensors it publishes whole (big ones cut into the
    usual grid), and row slices ``rows`` {name: (shape, first cell, end cell)} of tensors cut at dimension 0
    into 4-row cells, whose other cells other ranks publish; fingerprints are this rank's partial sums."""
    m = Manifest(DELTA, "toy", 2, "", base_version=1, base_fingerprint="", anchor_version=0)
    m.blobs.append(Blob(f"v00000002.r{rank}.0.{SHA[:32]}.bin", 0, SHA))
    at = 0

    def place(n: int) -> int:
        nonlocal at
        at += n
        m.blobs[0].size = at
        return at - n

    def chunk(cell: int, nnz: int) -> Chunk:
        return Chunk(cell, nnz, 0, place(2 * nnz), SHA, Segment("pco", nnz), Segment("pco", nnz, "rel"))

    for k, (name, shape) in enumerate(whole):
        fp, base = fpr.fmt(rank * 1000 + k + 1), fpr.fmt(rank * 1000 + k + 7)
        cuts = chunks.grid(shape, min_cell=64)
        if cuts is None:
            m.tensors.append(TensorEntry(name, "bfloat16", shape, 3, fp, base, blob=0, offset=place(6), sha256=SHA,
                                         positions=Segment("pco", 3), values=Segment("pco", 3, "rel")))
        else:
            cells = [chunk(c, 2) for c in range(len(chunks.boxes(cuts, shape)))]
            m.tensors.append(TensorEntry(name, "bfloat16", shape, 2 * len(cells), fp, base, grid=cuts, chunks=cells))
    for name, (shape, first, end) in rows.items():
        cells = [chunk(c, 1) for c in range(first, end)]
        grid = [list(range(0, shape[0] + 1, 4))]
        m.tensors.append(TensorEntry(name, "bfloat16", shape, len(cells), fpr.fmt(rank + 11), fpr.fmt(rank + 13),
                                     grid=grid, chunks=cells))
    return m


def _parts() -> list[Manifest]:
    """Two ranks: each its own experts (cut and uncut), both rows of the embedding (split: rank 0 joins it)."""
    return [
        _part(0, [("experts.0.w", [64, 32]), ("norm", [8])], {"embed": ([16, 4], 0, 2)}),
        _part(1, [("experts.1.w", [64, 32]), ("experts.1.b", [5])], {"embed": ([16, 4], 2, 4)}),
    ]


NAMES = ["embed", "experts.0.w", "norm", "experts.1.w", "experts.1.b"]


def _publish_in_parts(tmp_path, parts: list[Manifest], names=NAMES, model_names=NAMES):
    """What the ranks and rank 0 do (table_parts.write_part on each, commit_tables on rank 0), in one process."""
    split = frozenset(["embed"])
    store, out, shift = open_store(str(tmp_path / "store")), [], 0
    per = table_parts.per_table(len(model_names), len(parts))
    for rank, p in enumerate(parts):
        spool = tmp_path / f"spool{rank}"
        spool.mkdir(parents=True)
        tp, file = table_parts.write_part(p, str(spool), split=split, shift=shift, tag=f"v00000002.r{rank}", per=per)
        if file is not None:
            store.create_file(*file)
        shift += len(tp.part.blobs)
        out.append(tp)
    keys = np.sort(fpr.name_keys(model_names))
    table_parts.commit_tables(store, out, [n for n in names if n in split], keys, None, 60.0, per)
    return store


def _entries(m: Manifest) -> dict:
    return {t.name: (t.dtype, t.shape, t.nnz, t.fingerprint, t.base_fingerprint, t.grid, t.positions, t.values)
            for t in m.tensors}


def test_ranks_tables_read_as_one_commit_does(tmp_path):
    """The driver reads every tensor as an unsharded commit of the same parts lists it, with the same model
    fingerprints; a rank reads its own entries from the index and their chunks from its own cell tables."""
    store = _publish_in_parts(tmp_path, _parts())
    ref_store = open_store(str(tmp_path / "ref"))
    commit(ref_store, merge_parts(_parts(), NAMES), inline_limit=0)
    raw, ref_raw = (s.read("v00000002.json") for s in (store, ref_store))
    got, want = open_manifest(store, raw), open_manifest(ref_store, ref_raw)
    assert _entries(got) == _entries(want) and len(got.tensors) == len(NAMES)
    assert (got.fingerprint, got.base_fingerprint) == (want.fingerprint, want.base_fingerprint)
    doc = json.loads(raw)
    keys = [doc["blobs"][r["blob"]]["key"] for r in doc["tables"]]
    assert keys[0].startswith("v00000002.r0.1.") and keys[-1].startswith("v00000002.4.")  # rank 0's own, then the join
    assert doc["index"]["blob"] == 4 and len(doc["blobs"]) == 5  # r0 data, r0 tables, r1 data, r1 tables, rank 0's
    held, _ = open_held(store, raw, {"experts.1.w", "embed"})
    load_cells(store, held)
    want_chunks = {t.name: t for t in want.tensors}
    load_cells(ref_store, want)
    for t in held.tensors:  # the chunks, blob indices the version's
        w = want_chunks[t.name]
        assert [(c.cell, c.nnz, c.length) for c in t.chunks] == [(c.cell, c.nnz, c.length) for c in w.chunks]
        assert [doc["blobs"][c.blob]["key"] for c in t.chunks] == [json.loads(ref_raw)["blobs"][c.blob]["key"]
                                                                   for c in w.chunks]


def test_a_tensor_missing_twice_or_unknown_is_refused_and_nothing_is_published(tmp_path):
    parts = _parts()
    parts[1].tensors = [t for t in parts[1].tensors if t.name != "experts.1.b"]
    with pytest.raises(ValueError, match="not the model's"):
        _publish_in_parts(tmp_path / "missing", parts)
    parts = _parts()
    parts[1].tensors.append(TensorEntry("norm", "bfloat16", [8], 0, fpr.fmt(5), fpr.fmt(5)))  # both ranks list it
    with pytest.raises(ValueError, match="not the model's"):
        _publish_in_parts(tmp_path / "twice", parts)
    parts = _parts()
    parts[1].tensors.append(TensorEntry("ghost", "bfloat16", [8], 0, fpr.fmt(5), fpr.fmt(5)))  # not the model's
    with pytest.raises(ValueError, match="not the model's"):
        _publish_in_parts(tmp_path / "unknown", parts)
    for case in ("missing", "twice", "unknown"):
        store = open_store(str(tmp_path / case / "store"))
        assert not store.exists("v00000002.json") and not store.exists("LATEST")


def test_a_rank_refuses_its_own_bad_entry_before_it_writes(tmp_path):
    parts = _parts()
    parts[1].tensors[0].chunks[0].offset = parts[1].blobs[0].size  # beyond its blob
    with pytest.raises(ManifestError, match="beyond"):
        _publish_in_parts(tmp_path, parts)
    assert not (tmp_path / "store" / "v00000002.json").exists()


def test_a_rank_that_lies_about_its_fingerprint_share_is_refused_by_the_driver(tmp_path):
    """Rank 0 sums the ranks' shares as they say; the reader of the whole checks both model fingerprints
    against the entries (the check the publisher's own commit made before), so a wrong share never serves."""
    parts = _parts()
    real = table_parts.write_part

    def lying(part, spool, **kw):
        tp, file = real(part, spool, **kw)
        tp.fingerprint += 1
        return tp, file

    table_parts.write_part, saved = lying, real
    try:
        store = _publish_in_parts(tmp_path, parts)
    finally:
        table_parts.write_part = saved
    with pytest.raises(ManifestError, match="model fingerprint"):
        open_manifest(store, store.read("v00000002.json"))
