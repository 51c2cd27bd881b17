"""Tensor entries checked as arrays (issue 52, item 2: ``engine_ext/format/entries.py``).

Every rule a tensor entry meets runs as one pass over all entries, and the rules that depend on a shape,
a grid or a dtype run once per distinct value. Here a real published delta (inline, format 5: a cut
tensor with inline chunks, whole tensors with bytes, an unchanged one) has one field of one entry made
bad at a time: each is refused with a clear ManifestError naming the entry. The per-distinct shortcut
must never let a bad value through because an equal-looking good one came first (a bool is not the int
1, a float not the int 1), and entries read from one binary table share their shape and grid lists.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from test_chunks import noisy_versions

from engine_ext import settings
from engine_ext.errors import ManifestError
from engine_ext.format.manifest import Manifest
from engine_ext.store import open_store
from engine_ext.store.reader import read_manifest
from engine_ext.trainer.publisher import DeltaPublisher


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(inline delta manifest as a dict, root of the same versions in format 10)."""
    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(512, 256, generator=g), "experts.0.w": torch.randn(256, 128, generator=g),
          "experts.1.w": torch.randn(256, 128, generator=g), "b": torch.randn(64, generator=g),
          "frozen": torch.randn(32, generator=g)}
    states = noisy_versions({n: t.to(torch.bfloat16) for n, t in sd.items()}, 1, g)
    for s in states[1:]:
        s["frozen"] = states[0]["frozen"].clone()  # unchanged in the delta
    roots = {}
    for name, limit in (("inline", 4096), ("tables", 0)):
        roots[name] = tmp_path_factory.mktemp(name)
        with settings.override(inline_entries=limit), DeltaPublisher(str(roots[name]), chunk_min_cell=1024) as pub:
            for s in states:
                pub.publish(s)
    doc = json.loads((roots["inline"] / "v00000001.json").read_bytes())
    return doc, roots["tables"]


def _entry(doc: dict, kind: str) -> dict:
    """The first entry of ``kind``: cut (inline chunks), whole (bytes of its own) or unchanged."""
    for t in doc["tensors"]:
        if kind == "cut" and t.get("chunks"):
            return t
        if kind == "whole" and t["nnz"] and not t.get("chunks"):
            return t
        if kind == "unchanged" and not t["nnz"]:
            return t
    raise AssertionError(f"no {kind} tensor in the fixture")


def _set(t: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for k in head:
        t = t[k]
    t[last] = value


CASES = [  # (entry kind, field, bad value, what the error says)
    ("whole", "name", "", "bad or duplicate tensor name"),
    ("whole", "name", 7, "bad or duplicate tensor name"),
    ("whole", "name", "w", "bad or duplicate tensor name"),  # the cut tensor's name: twice
    ("whole", "dtype", "complex64", "unsupported dtype"),
    ("whole", "dtype", ["bfloat16"], "unsupported dtype"),
    ("whole", "shape", [64, -1], "bad shape"),
    ("whole", "shape", [True, 64], "bad shape"),
    ("whole", "shape", [64.0], "bad shape"),
    ("whole", "shape", {"a": 1}, "bad shape"),
    ("whole", "shape", [1 << 21] * 2, "over the"),
    ("whole", "nnz", 10**9, "outside"),
    ("whole", "nnz", -1, "outside"),
    ("whole", "nnz", True, "bad nnz"),
    ("whole", "nnz", 1 << 80, "outside"),
    ("whole", "fingerprint", "0" * 15 + "G", "fingerprint"),
    ("whole", "base_fingerprint", None, "fingerprint"),
    ("whole", "positions.coder", "lz4", "unknown coder"),
    ("whole", "positions.coder", ["pco"], "unknown coder"),
    ("whole", "values.mode", "xor", "unknown value mode"),
    ("whole", "values.length", -5, "outside"),
    ("whole", "values.length", 1 << 63, "outside"),
    ("whole", "blob", 9, "bad blob index"),
    ("whole", "blob", None, "bad blob index"),
    ("whole", "offset", 1 << 40, "beyond its blob"),
    ("whole", "offset", "0", "bad offset"),
    ("whole", "sha256", "AB" * 32, "missing or bad sha256"),
    ("whole", "sha256", None, "missing or bad sha256"),
    ("unchanged", "fingerprint", "0123456789abcdef", "unchanged but fingerprints differ"),
    ("unchanged", "positions.coder", "pco", "carries no bytes"),
    ("unchanged", "grid", [[0, 32]], "carries no bytes"),
    ("cut", "grid", None, "valid grid"),
    ("cut", "grid", [[0, 100, 500]], "valid grid"),  # its last cut is not the dimension
    ("cut", "grid", [[0, True, 512]], "valid grid"),
    ("cut", "grid", [[0, 256.0, 512]], "valid grid"),
    ("cut", "grid", "rows", "valid grid"),
    ("cut", "chunks", [], "non-empty chunk list"),
    ("cut", "blob", 0, "carries its bytes in its chunks only"),
    ("cut", "positions.coder", "pco", "carries its bytes in its chunks only"),
]


@pytest.mark.parametrize("kind,path,value,says", CASES, ids=[f"{k}-{p}-{v!r:.20}" for k, p, v, _ in CASES])
def test_each_bad_field_of_an_entry_is_refused_naming_it(published, kind, path, value, says):
    doc = copy.deepcopy(published[0])
    Manifest.from_json(json.dumps(doc).encode())  # as published: valid
    t = _entry(doc, kind)
    _set(t, path, value)
    with pytest.raises(ManifestError, match=says) as e:
        Manifest.from_json(json.dumps(doc).encode())
    assert len(str(e.value)) < 700


@pytest.mark.parametrize("value", [[True, 64], [64.0]], ids=["bool", "float"])
def test_a_shape_equal_to_a_good_one_is_still_checked(published, value):
    """Two entries whose shapes compare equal in Python ([1, 64] == [True, 64], [64] == [64.0]): the
    check runs once per distinct shape, by content with types, so the second is not let through."""
    doc = copy.deepcopy(published[0])
    b = next(t for t in doc["tensors"] if t["name"] == "b")
    twin = copy.deepcopy(b)
    twin["name"], twin["shape"] = "b2", [1, 64] if value[0] is True else [64]
    b["shape"] = value
    doc["tensors"].insert(0, twin)  # the good twin first
    with pytest.raises(ManifestError, match="bad shape"):
        Manifest.from_json(json.dumps(doc).encode())


def test_a_grid_equal_to_a_good_one_is_still_checked(published):
    doc = copy.deepcopy(published[0])
    cut = [t for t in doc["tensors"] if t.get("chunks")]
    a = next(t for t in cut if t["name"] == "experts.0.w")
    b = next(t for t in cut if t["name"] == "experts.1.w")
    assert a["grid"] == b["grid"]  # same shape, same grid: the bad one comes second
    bad = copy.deepcopy(a["grid"])
    bad[0][1] = float(bad[0][1])
    b["grid"] = bad
    with pytest.raises(ManifestError, match="valid grid"):
        Manifest.from_json(json.dumps(doc).encode())


def test_entries_of_one_binary_table_share_their_shape_and_grid_lists(published):
    """What makes the check per distinct value cheap for a reader: one list object per distinct shape
    and grid in a table, and the entries still equal the inline ones."""
    doc, root = published
    m = read_manifest(open_store(str(root)), "v00000001.json")
    e0, e1 = (next(t for t in m.tensors if t.name == n) for n in ("experts.0.w", "experts.1.w"))
    assert e0.shape is e1.shape and e0.grid is e1.grid
    inline = {t["name"]: t for t in doc["tensors"]}
    assert all(t.shape == inline[t.name]["shape"] for t in m.tensors)
