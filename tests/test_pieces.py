"""Format 8: an anchor blob's SHA-256 is a pieces digest (issue 29 item 5), its bytes hashed once.

The publisher hashes each tensor (or cell) of an anchor once as it writes it; the blob's digest
is the SHA-256 over those digests and the header's, in offset order. A whole-blob reader
(``fetch_blobs``) cuts the blob where the manifest's byte ranges begin and end and checks every
segment, so a flipped byte anywhere (header, tensor, gap) is refused before any byte is used.
"""
from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from engine_ext import settings
from engine_ext.errors import IntegrityError, ManifestError
from engine_ext.format import manifest as manifest_mod
from engine_ext.format.dtypes import dtype_by_name
from engine_ext.format.manifest import Blob, Manifest
from engine_ext.format.pieces import PIECES, cuts, pieces_sha256
from engine_ext.store import open_store
from engine_ext.store.reader import decode_manifest, fetch_blobs, load_delta, read_manifest
from engine_ext.store.signing import Signer
from engine_ext.trainer.builder import Rows, VersionBuilder
from engine_ext.trainer.publisher import DeltaPublisher


def _states():
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(64, 48, generator=g), "b": torch.randn(5, generator=g), "n": torch.randn(32, generator=g)}
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    nxt = {k: v.clone() for k, v in sd.items()}
    nxt["w"][3, :7] += 1
    nxt["n"][1] += 1
    return sd, nxt


@pytest.fixture
def run(tmp_path):
    sd, nxt = _states()
    with DeltaPublisher(str(tmp_path), anchor_every=0) as pub:
        pub.publish(sd)
        pub.publish(nxt)
    return tmp_path, sd, nxt


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_an_anchor_is_format_8_with_a_pieces_digest_and_decodes_bit_for_bit(run):
    root, sd, _ = run
    doc = json.loads((root / "v00000000.anchor.json").read_bytes())
    assert doc["format_version"] == 8 and [b["digest"] for b in doc["blobs"]] == [PIECES]
    delta = json.loads((root / "v00000001.json").read_bytes())
    assert delta["format_version"] == 5 and "digest" not in delta["blobs"][0]  # deltas keep a flat digest
    store = open_store(str(root))
    m = read_manifest(store, "v00000000.anchor.json")
    blob = (root / m.blobs[0].key).read_bytes()
    bounds = m.segment_bounds(0)
    assert m.blobs[0].sha256 == pieces_sha256(blob, bounds) == pieces_sha256(blob, bounds, workers=3)
    assert m.blobs[0].sha256 != hashlib.sha256(blob).hexdigest()
    # the segments: the safetensors header, then each tensor, listed with the digest it was written with
    header = 8 + int.from_bytes(blob[:8], "little")
    assert bounds == cuts(len(blob), [(header, 0)] + [(t.offset, t.length) for t in m.tensors])
    assert sorted(t.sha256 for t in m.tensors) == sorted(hashlib.sha256(blob[a:b]).hexdigest()
                                                         for a, b in zip(bounds[1:], bounds[2:]))
    # still a plain safetensors file, and it decodes bit for bit like the state dict (a flat anchor did)
    plain = load_file(str(root / m.blobs[0].key))
    d = load_delta(str(root / "v00000000.anchor.json"))
    got = {t.name: t.values for t in d.tensors}
    for name, t in sd.items():
        assert torch.equal(_bits(plain[name]), _bits(t))
        assert torch.equal(got[name].view(torch.int16).reshape(t.shape), _bits(t))


@pytest.mark.parametrize("where", ["header", "tensor", "last byte"])
def test_a_flipped_byte_in_a_pieces_blob_is_refused(run, where):
    root, _, _ = run
    store = open_store(str(root))
    m = read_manifest(store, "v00000000.anchor.json")
    path = root / m.blobs[0].key
    raw = bytearray(path.read_bytes())
    w = next(t for t in m.tensors if t.name == "w")
    at = {"header": 20, "tensor": w.offset + 100, "last byte": len(raw) - 1}[where]
    raw[at] ^= 1
    path.write_bytes(raw)
    with pytest.raises(IntegrityError, match=m.blobs[0].key):
        fetch_blobs(store, m)
    with pytest.raises(IntegrityError):
        load_delta(str(root / "v00000000.anchor.json"))


def test_a_gap_is_a_segment_of_its_own(run):
    """A blob's bytes that no range lists (a gap between two tensors' bytes) are a segment too:
    checked like the rest (a delta in a pieces blob, written here by hand)."""
    root, _, _ = run
    store = open_store(str(root))
    m = read_manifest(store, "v00000001.json")
    want = {t.name: t for t in decode_manifest(m, fetch_blobs(store, m))}
    old = (root / m.blobs[0].key).read_bytes()
    first, second = sorted((t for t in m.tensors if t.nnz), key=lambda t: t.offset)
    cut = second.offset
    raw = bytearray(old[:cut] + b"\x00" * 16 + old[cut:])
    second.offset += 16
    m.blobs[0] = Blob("v00000001.gap.bin", len(raw), "0" * 64, PIECES)
    m.format_version = 8
    bounds = m.segment_bounds(0)
    assert first.offset == 0 and bounds[1:3] == [cut, cut + 16]  # the gap: a segment of its own
    m.blobs[0].sha256 = pieces_sha256(raw, bounds)
    m.validate()
    (root / "v00000001.gap.bin").write_bytes(raw)
    got = {t.name: t for t in decode_manifest(m, fetch_blobs(store, m))}
    assert got.keys() == want.keys() and all(torch.equal(got[n].values, want[n].values) for n in got)
    raw[cut + 5] ^= 1
    (root / "v00000001.gap.bin").write_bytes(raw)
    with pytest.raises(IntegrityError, match="v00000001.gap.bin"):
        fetch_blobs(store, m)


def test_a_format7_anchor_in_cells_reads_its_cell_tables_before_checking_its_blob(tmp_path):
    """A cut anchor (a sharded trainer's rank's rows) with its cells in cell tables: the segments
    of its data blob are known only once the cell tables are read, and fetch_blobs reads them first."""
    g = torch.Generator().manual_seed(1)
    sd = {"w": torch.randn(8, 6, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g).to(torch.bfloat16)}
    bf16 = dtype_by_name("bfloat16")
    b = VersionBuilder("anchor", "m", 0, anchor_version=0, spool_in=open_store(str(tmp_path)))
    b.add_anchor([("w", bf16, (8, 6), Rows((8, 6), 0, (0, 2, 5, 8))), ("b", bf16, (3,), None)], sd.__getitem__)
    with settings.override(inline_entries=0):
        b.publish(open_store(str(tmp_path)), Signer.from_settings())
    doc = json.loads((tmp_path / "v00000000.anchor.json").read_bytes())
    assert doc["format_version"] == 10 and doc["tensors"] == [] and [x.get("digest") for x in doc["blobs"]] == [PIECES, None]
    store = open_store(str(tmp_path))
    m = read_manifest(store, "v00000000.anchor.json")
    assert next(t for t in m.tensors if t.name == "w").cells is not None  # unread until fetch_blobs needs them
    got = {t.name: t.values.view(torch.int16).reshape(sd[t.name].shape)
           for t in decode_manifest(m, fetch_blobs(store, m))}
    assert all(torch.equal(got[n], sd[n].view(torch.int16)) for n in sd)
    assert len(next(t for t in m.tensors if t.name == "w").chunks) == 3


def _doc(root) -> dict:
    return json.loads((root / "v00000000.anchor.json").read_bytes())


@pytest.mark.parametrize("change, match", [
    (lambda d: d["blobs"][0].update(digest="flat"), "digest 'flat'"),
    (lambda d: d["blobs"][0].update(digest="PIECES"), "digest 'PIECES'"),
    (lambda d: d["blobs"][0].update(digest=None), "never null"),
    (lambda d: d["blobs"][0].update(digest=1), "digest 1"),
    (lambda d: d.update(format_version=7), "only 'pieces', from format 8"),
    (lambda d: d.update(format_version=5), "only 'pieces', from format 8"),
])
def test_a_bad_digest_field_is_refused(run, change, match):
    doc = _doc(run[0])
    Manifest.from_json(json.dumps(doc).encode())
    change(doc)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(doc).encode())


def test_a_tables_blob_keeps_a_flat_digest(tmp_path):
    """Its segments would change as its cell tables are read: a pieces digest there is refused."""
    with settings.override(inline_entries=0), DeltaPublisher(str(tmp_path), anchor_every=0) as pub:
        pub.publish(_states()[0])
    doc = _doc(tmp_path)
    assert doc["format_version"] == 10 and len(doc["blobs"]) == 2  # in tables (10), its data blob by pieces
    doc["blobs"][1]["digest"] = PIECES
    with pytest.raises(ManifestError, match="a blob holding tables has a flat SHA-256"):
        Manifest.from_json(json.dumps(doc).encode())


def test_an_older_reader_refuses_format_8_clearly(run, monkeypatch):
    """A reader of format 7 at most refuses a pieces anchor by its version, before it reads a field it does
    not know (this parser checks the version first; engine-ext's format-7 parser met ``digest`` first and
    refused the manifest as malformed: a ManifestError too)."""
    raw = (run[0] / "v00000000.anchor.json").read_bytes()
    monkeypatch.setattr(manifest_mod, "READABLE_VERSIONS", (1, 2, 3, 4, 5, 6, 7))  # what a format-7 reader accepts
    with pytest.raises(ManifestError, match="unknown format 'engine-ext-delta' version 8"):
        Manifest.from_json(raw)
    Manifest.from_json((run[0] / "v00000001.json").read_bytes())  # the delta: format 5, still read


def test_the_digest_depends_on_the_cuts():
    """A pieces digest is defined by the listed ranges: other cuts, another digest; an empty blob's
    is the SHA-256 of no digests; bounds that do not end at the blob's end are refused."""
    data = bytes(range(256)) * 4
    assert pieces_sha256(data, cuts(len(data), [(10, 20)])) != pieces_sha256(data, cuts(len(data), [(10, 21)]))
    assert pieces_sha256(b"", cuts(0, [])) == hashlib.sha256(b"").hexdigest()
    with pytest.raises(ValueError):
        pieces_sha256(data, [0, 10])


def test_the_writer_starts_each_stretch_to_disk_as_it_goes(tmp_path, monkeypatch):
    """Write-behind: every ``WRITE_BEHIND`` bytes the writer asks the OS to start writing the stretch
    just written (the whole file once, in order, none twice), and the file and its digest are the
    ones written without it. On Linux the kernel takes the call."""
    from engine_ext.store import checkpoint

    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(300, 100, generator=g).to(torch.bfloat16), "b": torch.randn(777, generator=g),
               "c": torch.randn(50, 64, generator=g).to(torch.bfloat16)}
    infos = [(n, dtype_by_name(str(t.dtype).removeprefix("torch.")), tuple(t.shape)) for n, t in tensors.items()]

    def write(path, behind):
        monkeypatch.setattr(checkpoint, "WRITE_CHUNK", 4096)
        monkeypatch.setattr(checkpoint, "WRITE_BEHIND", behind)
        w = checkpoint.SafetensorsWriter(path, infos, hashed=True)
        for n, t in tensors.items():
            w.write(n, t, splits=[20000] if n == "a" else ())
        w.close()
        return w

    calls = []
    real = checkpoint.start_writeback
    monkeypatch.setattr(checkpoint, "start_writeback", lambda fd, off, n: calls.append((off, n)) or real(fd, off, n))
    with_behind = write(tmp_path / "behind.safetensors", 10000)
    ranges = list(calls)
    calls.clear()
    without = write(tmp_path / "plain.safetensors", 1 << 40)
    assert not calls
    assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    assert all(n >= 10000 for _, n in ranges) and with_behind.size - (ranges[-1][0] + ranges[-1][1]) < 10000 + 4096
    assert (tmp_path / "behind.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert with_behind.sha256 == without.sha256 and with_behind.piece_sha256 == without.piece_sha256
    loaded = load_file(tmp_path / "behind.safetensors")
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    if sys.platform.startswith("linux"):
        with open(tmp_path / "behind.safetensors", "rb+") as f:
            assert real(f.fileno(), 0, 4096)
