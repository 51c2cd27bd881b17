"""Format 7's tables: a manifest's tensor entries and cut tensors' chunk lists in a blob (docs/FORMAT.md, "Tables").

A model of very many tensors (a 1T MoE: ~140,000 tensors, over a million grid cells) would
list ~450 MB inline; in tables its signed manifest stays a few KB. Tensor tables are
compact JSON arrays of the inline entries (every reader reads them all); a cell table is
one fixed little-endian record per chunk (:data:`CELL_RECORD`, 75 bytes against ~220 in
JSON), read only by the ranks that fetch the tensor. Each is a byte range of a blob named by
a :class:`~engine_ext.format.manifest.TableRef` and checked against its SHA-256 and count
before it is parsed; the entries are then checked as inline ones
(:func:`resolve`, :func:`set_cells`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Callable

import numpy as np

from ..errors import IntegrityError, ManifestError
from .manifest import (CELL_RECORD_BYTES, Chunk, Manifest, Segment, TableRef, TensorEntry, _REQUIRED, _parsed,
                       _tensor)

# A cell table's record (format 7): one chunk in 75 bytes, little-endian (JSON would take ~220).
CELL_RECORD = np.dtype([("cell", "<u4"), ("nnz", "<u8"), ("blob", "<u4"), ("offset", "<u8"),
                        ("positions_length", "<u8"), ("values_length", "<u8"), ("positions_coder", "u1"),
                        ("values_coder", "u1"), ("mode", "u1"), ("sha256", "V32")])
CELL_CODERS = ("none", "all", "raw", "pco", "zstd", "ctx", "ctx-rans")  # a coder's byte in a record: its index
CELL_MODES = (None, "abs", "rel")
assert CELL_RECORD.itemsize == CELL_RECORD_BYTES  # what the manifest's checks count with


def tabulate(m: Manifest, put: Callable[[bytes], tuple[int, int]], per_table: int = 4096) -> Manifest:
    """A (finished, validated) manifest as format 7: every cut tensor's chunks in a cell table,
    then the tensor entries in tables of ``per_table``, each handed to ``put(bytes) -> (blob,
    offset)`` (which appends it to a blob the returned manifest lists). ``m`` is unchanged."""
    def ref(entries: list) -> TableRef:
        raw = json.dumps(entries, separators=(",", ":")).encode()
        blob, offset = put(raw)
        return TableRef(blob, offset, len(raw), hashlib.sha256(raw).hexdigest(), len(entries))

    def row(x) -> dict:  # asdict's result without its deep copies (a million chunks: 10x faster)
        return dict(vars(x), positions=vars(x.positions), values=vars(x.values))

    rows, default = [], row(TensorEntry("", "", [], 0, ""))
    for t in m.tensors:
        r = row(t)
        if t.chunks is not None:
            raw = cell_table(t.chunks)
            blob, offset = put(raw)
            r["chunks"], r["cells"] = None, vars(TableRef(blob, offset, len(raw), hashlib.sha256(raw).hexdigest(),
                                                          len(t.chunks)))
        rows.append({k: v for k, v in r.items() if k in _REQUIRED or v != default[k]})  # absent: the default
    out = dataclasses.replace(m, tensors=[], tables=[ref(rows[i:i + per_table]) for i in range(0, len(rows), per_table)])
    out.format_version = max(m.lowest_version(), out.lowest_version())  # 7, 8 with a pieces digest, 9 with ctx-rans
    return out


def resolve(m: Manifest, tables: list[bytes]) -> None:
    """Take a format-7 manifest's tensor entries from the bytes of its tensor tables (in the order of
    ``m.tables``), each checked against its SHA-256 and count, then validate the whole as inline."""
    if m.resolved:
        return
    if len(tables) != len(m.tables):
        raise ManifestError(f"{len(tables)} tensor tables given, the manifest lists {len(m.tables)}")
    tensors = []
    for i, (ref, raw) in enumerate(zip(m.tables, tables)):
        tensors += _parsed(lambda: [_tensor(t) for t in read_table(ref, raw, f"tensor table {i}")])
    m.tensors = tensors
    try:
        _parsed(m.validate)
    except ManifestError:
        m.tensors = []
        raise


def set_cells(m: Manifest, t: TensorEntry, raw: bytes) -> None:
    """Take a cut tensor's chunks from the bytes of its cell table, checked against the table's
    SHA-256 and count and then as inline chunks are (each cell of the grid once, counts, byte ranges)."""
    if t.cells is None:
        return
    where = f"tensor {t.name!r}"
    chunks = read_cells(t.cells, raw, f"{where}: cell table")
    checked = dataclasses.replace(t, chunks=chunks, cells=None)
    _parsed(lambda: m._check_chunks(checked, where, [[] for _ in m.blobs], overlap=True))
    t.chunks, t.cells = chunks, None


def cell_table(chunks: list[Chunk]) -> bytes:
    """A cut tensor's chunks as its cell table: one :data:`CELL_RECORD` each, in order."""
    rec = np.zeros(len(chunks), CELL_RECORD)
    for i, c in enumerate(chunks):
        rec[i] = (c.cell, c.nnz, c.blob, c.offset, c.positions.length, c.values.length,
                  CELL_CODERS.index(c.positions.coder), CELL_CODERS.index(c.values.coder),
                  CELL_MODES.index(c.values.mode), bytes.fromhex(c.sha256))
    return rec.tobytes()


def read_cells(ref: TableRef, raw: bytes, where: str) -> list[Chunk]:
    """The chunks of a cell table's bytes, checked against its length and SHA-256 (the chunks
    themselves are checked by the caller, as inline ones)."""
    _verify(ref, raw, where)
    if len(raw) != ref.count * CELL_RECORD.itemsize:
        raise ManifestError(f"{where}: {len(raw)} bytes for {ref.count} records")
    out = []
    for r in np.frombuffer(raw, CELL_RECORD):
        codes = (int(r["positions_coder"]), int(r["values_coder"]), int(r["mode"]))
        if codes[0] >= len(CELL_CODERS) or codes[1] >= len(CELL_CODERS) or codes[2] >= len(CELL_MODES):
            raise ManifestError(f"{where}: unknown coder or mode {codes}")
        out.append(Chunk(int(r["cell"]), int(r["nnz"]), int(r["blob"]), int(r["offset"]), bytes(r["sha256"]).hex(),
                         Segment(CELL_CODERS[codes[0]], int(r["positions_length"])),
                         Segment(CELL_CODERS[codes[1]], int(r["values_length"]), CELL_MODES[codes[2]])))
    return out


def read_table(ref: TableRef, raw: bytes, where: str) -> list:
    """A table's entries: its bytes checked against its length and SHA-256, then a JSON array of
    ``count`` objects."""
    _verify(ref, raw, where)
    try:
        rows = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON: {str(e)[:200]}") from None
    if not isinstance(rows, list) or len(rows) != ref.count or not all(isinstance(r, dict) for r in rows):
        raise ManifestError(f"{where}: not a list of {ref.count} objects")
    return rows


def _verify(ref: TableRef, raw: bytes, where: str) -> None:
    """A table's bytes are what its reference names (length and SHA-256), before any is parsed."""
    if len(raw) != ref.length or hashlib.sha256(raw).hexdigest() != ref.sha256:
        raise IntegrityError(f"{where}: SHA-256 mismatch (corrupt table)")
