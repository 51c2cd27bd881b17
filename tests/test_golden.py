"""Owned bytes: a committed store (tests/golden/store, written by tests/golden/make_golden.py from
fixed inputs) pins every coder and format version the publisher writes, both ways; older ones
(tests/golden/store-f8, store-f9 and store-f10, the same inputs as written before formats 9, 10 and 12) pin
what readers must still read.

* Decode: the committed bytes of both stores, read through the CLI's verified reader (its signatures
  checked against the committed test key), give back the fixed inputs bit for bit at every version.
* Encode: publishing the same inputs again writes the same bytes: every blob (their names are
  content hashes) and every manifest, but for its creation time (and so its signature and the
  next version's hashes of it).
* Coverage: the store holds positions coders ``all``, ``pco``, ``zstd`` and ``ctx-rans``, values
  coders ``raw``, ``pco``, ``zstd`` and ``ctx-rans``, both value modes, cells, cell sections, step tables
  and format versions 5, 10 and 12; store-f10 the same without cell sections (5 and 10); store-f9 the same in format 7's JSON tables (formats 5, 8 and 9); store-f8 holds
  format 5's ``ctx`` (range-coded streams) in format 7's tables, and formats 5 and 8 (format 6, a
  chunked anchor without a pieces digest, was never kept).

An upgrade of pcodec, zstandard or constriction that changes what they write or read fails here
(pyproject.toml caps them below their next minor or major version). If a format change is meant,
rerun make_golden.py and commit the store with it.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "golden"))
import make_golden  # noqa: E402

from engine_ext.cli import main  # noqa: E402
from engine_ext.store import open_store  # noqa: E402
from engine_ext.format.manifest import CellSections  # noqa: E402
from engine_ext.store.reader import load_cells, read_link  # noqa: E402
from engine_ext.store.signing import Trust  # noqa: E402
from engine_ext.store.checkpoint import CheckpointDir  # noqa: E402

KEYS = ["v00000000.anchor.json", "v00000001.json", "v00000002.json"]
PUB = str(make_golden.KEY) + ".pub"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def manifests(store_dir: Path) -> dict[str, dict]:
    """Every manifest as JSON, less what a second writing changes: its time, and so the hashes of its base's
    manifests (their bytes hold their times)."""
    out = {}
    for key in KEYS:
        d = json.loads((store_dir / key).read_text())
        d.pop("created_unix")
        d.pop("base_manifests", None)
        out[key] = d
    return out


STORES = {"store": make_golden.STORE, "store-f10": make_golden.FORMAT_10, "store-f9": make_golden.FORMAT_9,
          "store-f8": make_golden.FORMAT_8}


def cut_matrix(which: str) -> str:
    """The name of the golden model's cut matrix in store ``which`` (``a.weight`` before format 12)."""
    return make_golden.SECTIONED if which == "store" else "a.weight"


@pytest.mark.parametrize("which", sorted(STORES))
def test_the_committed_bytes_decode_to_the_fixed_inputs(tmp_path, which):
    store = shutil.copytree(STORES[which], tmp_path / "store")  # readers may leave files; never in the repo
    base = None
    for key, want in zip(KEYS, make_golden.states(sectioned=which == "store")):
        out = tmp_path / key.split(".")[0]
        argv = ["apply", str(store / key), "--out", str(out), "--trust", PUB] + (["--base", str(base)] if base else [])
        assert main(argv) == 0, key
        got = CheckpointDir(out)
        assert set(got.names()) == set(want), key
        for name, t in want.items():
            g = got.load(name)
            assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(bits(g), bits(t)), (key, name)
        base = out


def test_the_fixed_inputs_encode_to_the_committed_bytes(tmp_path):
    make_golden.publish(tmp_path / "store", make_golden.KEY)
    committed = {p.name: p.read_bytes() for p in make_golden.STORE.glob("v*.bin")} | \
        {p.name: p.read_bytes() for p in make_golden.STORE.glob("v*.safetensors")}
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "store").glob("v*.bin")} | \
        {p.name: p.read_bytes() for p in (tmp_path / "store").glob("v*.safetensors")}
    assert sorted(fresh) == sorted(committed)
    for name in committed:
        assert fresh[name] == committed[name], name
    assert manifests(tmp_path / "store") == manifests(make_golden.STORE)


COVERS = {"store": ({"all", "pco", "zstd", "ctx-rans"}, {"raw", "pco", "zstd", "ctx-rans"}, {5, 10, 12}),
          "store-f10": ({"all", "pco", "zstd", "ctx-rans"}, {"raw", "pco", "zstd", "ctx-rans"}, {5, 10}),
          "store-f9": ({"all", "pco", "zstd", "ctx-rans"}, {"raw", "pco", "zstd", "ctx-rans"}, {5, 8, 9}),
          "store-f8": ({"all", "pco", "zstd", "ctx"}, {"raw", "pco", "zstd", "ctx"}, {5, 7, 8})}


@pytest.mark.parametrize("which", sorted(STORES))
def test_the_store_covers_every_coder_and_format_version(tmp_path, which):
    store = open_store(str(shutil.copytree(STORES[which], tmp_path / "store")))
    trust = Trust.from_public_keys([PUB])
    positions, values, modes, versions, cells, tables, sections = set(), set(), set(), set(), 0, 0, 0
    for key in KEYS:
        m = read_link(store, key, trust).manifest
        sections += sum(isinstance(t.cells, CellSections) for t in m.tensors)
        load_cells(store, m)
        versions.add(m.format_version)
        tables += bool(m.step_tables)
        for t in m.tensors:
            for part in (t.chunks or [t]):
                cells += bool(t.chunks)
                if part.positions.coder != "none":
                    positions.add(part.positions.coder)
                    values.add(part.values.coder)
                    modes.add(part.values.mode)
    assert (positions, values, versions) == COVERS[which]
    assert modes == {"abs", "rel"} and cells and tables and bool(sections) == (which == "store")


@pytest.mark.parametrize("lib", ["pcodec", "zstandard", "constriction"])
def test_the_libraries_that_write_stored_bytes_are_capped(lib):
    """pyproject.toml caps each library that writes or reads stored bytes below its next minor (0.x) or major
    version (constriction: format 5's ``ctx`` streams, which readers still read)."""
    text = (HERE.parent / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f'"{lib}>='))
    assert ",<" in line, line


@pytest.mark.parametrize(
    "which,coder", [("store", "ctx-rans"), ("store-f10", "ctx-rans"), ("store-f9", "ctx-rans"), ("store-f8", "ctx")]
)
def test_inspect_shows_the_coder_of_every_part(tmp_path, which, coder, capsys):
    """``engine-ext inspect`` reads the cell tables and names each part's coder (a cut tensor's cells each)."""
    store = shutil.copytree(STORES[which], tmp_path / "store")
    assert main(["inspect", str(store / "v00000002.json"), "--trust", PUB, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    mix = doc["parts_by_encoding"][cut_matrix(which)]  # a cut tensor: its cells coded apart
    # its 4 cells: 2 x 2 as a.weight; 4 x 1 as q_proj (cut along the dimension the engines shard it along)
    want = {f"{coder}+rel-{coder}": 2, "pco+rel-pco": 2} if which == "store" else {f"{coder}+rel-{coder}": 1, "pco+rel-pco": 3}
    assert mix == want, mix
    assert doc["bytes_per_changed_element"][f"positions:{coder}"] > 0
