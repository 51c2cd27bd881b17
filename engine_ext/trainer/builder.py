"""Assemble one published version: encoded tensors -> blobs + manifest.

Blobs are spooled to temporary files (bounded memory for anchors and big deltas), on
the store's own filesystem where it has one (a local store then takes the file by a
hard link: its bytes are written once), hashed as they are written (never read back),
and handed to :func:`engine_ext.store.publish_version`, which creates blobs first,
the manifest next and moves ``LATEST`` last, never writing a published object twice.
A blob's key names its content (``v00000007.0.<first 32 hex digits of its SHA-256>.bin``):
where a backend cannot create an object exclusively (a multipart S3 upload, Hugging
Face Buckets), a second writer of that key can only write the same bytes.

A delta blob is the concatenation of each tensor's positions then values bytes
(independently decodable pco/zstd streams); an anchor blob is a plain safetensors
file, readable by any safetensors library, whose tensor data ranges the manifest
points at; its SHA-256 is a *pieces* digest (format 8, :mod:`engine_ext.format.pieces`), over
the digests its tensors and cells are listed with and its header's, so its bytes are hashed
once. A delta blob keeps a flat SHA-256: its bytes are few, and a delta then stays readable by
format-5 to 7 readers.

A sharded trainer's version (:mod:`engine_ext.trainer.sharded`) is built in parts: each
rank lays out and uploads its own blobs (:meth:`VersionBuilder.upload`, keys marked with
its rank) and hands its part of the manifest, with partial fingerprints, to rank 0,
which joins the parts (:func:`merge_parts`) and commits the one signed manifest
(:func:`commit`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .. import settings
from ..format import fingerprint as fpr
from ..format.bulk import collector_paused
from ..format.codec import ChunkedEncoded, Encoded
from ..format.dtypes import BY_SAFETENSORS, DType
from ..format.entries import Columns
from ..format.latest import Latest
from ..format.manifest import ANCHOR, DELTA, Blob, Chunk, Manifest, Segment, TensorEntry, listed_ranges, manifest_key
from ..format.pieces import PIECES, cuts
from ..format.tables import tabulate
from ..store import Store, publish_catch_up, publish_version
from ..store.base import _TMP_PREFIX
from ..store.checkpoint import SafetensorsWriter
from ..store.signing import Signer
from .blob_layout import COMMON, OpenBlob, cell_section, section_dim

BLOB_TARGET = 256 << 20  # start a new blob past this size, so readers can fetch in parallel
LATEST_TTL_S = 7 * 24 * 3600.0  # a signed LATEST older than this is stale (re-publish to refresh)


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, start + local rows)`` of a tensor of ``shape`` that one trainer rank writes into
    an anchor, and the tensor's dimension-0 cuts (every rank's boundaries among them): the cells
    inside those rows become its chunks, each a contiguous range of its safetensors slice."""

    shape: tuple  # the whole tensor's
    start: int
    cuts: tuple  # 0 = c[0] < ... < c[-1] = shape[0]


class VersionBuilder:
    def __init__(
        self,
        kind: str,
        model: str,
        version: int,
        base_version: int | None = None,
        anchor_version: int | None = None,
        blob_target: int = BLOB_TARGET,
        base_manifests: list[str] | None = None,
        spool_in: Store | None = None,
        part: int | None = None,
        reader_tp: int | None = None,
    ):
        """``reader_tp``: the tensor-parallel degree readers' cells are grouped for inside each delta blob
        (:mod:`~engine_ext.trainer.blob_layout`; default ``ENGINE_EXT_READER_TP``; 1: in encoding order)."""
        self.manifest = Manifest(
            kind=kind,
            model=model,
            version=version,
            fingerprint="",
            base_version=base_version if kind == DELTA else None,
            base_fingerprint="" if kind == DELTA else None,
            anchor_version=anchor_version,
            base_manifests=list(base_manifests or []) if kind == DELTA else [],
        )
        self.manifest_sha256: str | None = None  # of the published manifest's bytes
        self.latest: Latest | None = None  # the LATEST pointer published with it
        # Unlisted by local stores (their temp-file prefix); on the store's filesystem where it has one.
        self.tmp = tempfile.TemporaryDirectory(
            prefix=f"{_TMP_PREFIX}spool-", dir=spool_in.spool_dir() if spool_in else None
        )
        self.blob_target = blob_target
        self.part = part  # a sharded version's rank: its blobs' keys carry ``.r{part}``
        self.files: list[str] = []
        self.digests: dict[
            str, tuple[str, int, str | None]
        ] = {}  # blob file -> (SHA-256, size, digest kind), as written
        self.reader_tp = settings.current().reader_tp if reader_tp is None else reader_tp
        self._open: OpenBlob | None = None  # the delta blob being filled
        self._named: list[tuple[str, str]] | None = None  # the blobs' (key, local file), once named
        self._lists: dict[tuple, list] = {}  # one list per distinct shape and grid (:meth:`_shared`)

    def _shared(self, shape, grid: list[list[int]] | None = None) -> tuple[list[int], list[list[int]] | None]:
        """``shape`` and ``grid`` as lists shared by every entry of this version with the same (nothing changes
        an entry's shape or grid in place): the checks before a commit tell distinct ones apart by identity
        first (:mod:`engine_ext.format.entries`), and a K2 rank's 9,000 entries have a handful."""
        s = self._lists.setdefault(("shape", *shape), list(shape))
        g = None if grid is None else self._lists.setdefault(("grid", *map(tuple, grid)), grid)
        return s, g

    # -- deltas ---------------------------------------------------------------
    def add_step_tables(self, dtype: str, tables: list[bytes]) -> None:
        """The context coder's step tables for ``dtype``, which context-coded parts of it are decoded with."""
        self.manifest.step_tables = dict(self.manifest.step_tables or {}, **{dtype: [t.hex() for t in tables]})

    def add_unchanged(self, name: str, dtype: DType, shape, fp: int) -> None:
        f = fpr.fmt(fp)
        self.manifest.tensors.append(
            TensorEntry(name, dtype.name, self._shared(shape)[0], 0, f, f if self.manifest.kind == DELTA else None)
        )

    def add_delta(self, name: str, dtype: DType, shape, nnz: int, enc: Encoded, base_fp: int, fp: int) -> None:
        if nnz == 0:
            return self.add_unchanged(name, dtype, shape, fp)
        data = enc.pos + enc.val
        blob, offset = self._append(data, COMMON)
        entry = TensorEntry(
            name,
            dtype.name,
            self._shared(shape)[0],
            nnz,
            fpr.fmt(fp),
            fpr.fmt(base_fp),
            blob=blob,
            offset=offset,
            sha256=hashlib.sha256(data).hexdigest(),
            positions=Segment(enc.pos_coder, len(enc.pos)),
            values=Segment(enc.val_coder, len(enc.val), enc.mode),
        )
        self._place(entry, COMMON)
        self.manifest.tensors.append(entry)

    def _append(self, data: bytes, section: int) -> tuple[int, int]:
        """Append ``data`` to ``section`` of the current delta blob (a new one past ``blob_target``): (the blob,
        its offset in the section; :meth:`_place` makes it the blob's)."""
        if self._open is None or self._open.layout.size() >= self.blob_target:
            self._close_blob()
            path = os.path.join(self.tmp.name, f"{len(self.files)}.bin")
            self.files.append(path)
            self._open = OpenBlob.for_shares(len(self.files) - 1, path, self.reader_tp)
        return self._open.index, self._open.append(data, section)

    def _place(self, part: TensorEntry | Chunk, section: int) -> None:
        assert self._open is not None
        self._open.layout.place(part, section)

    def _close_blob(self) -> None:
        """Write the delta blob being filled, its sections in order (the parts' offsets made final)."""
        if self._open is not None:
            path = self._open.path
            with open(path, "wb") as f:
                sha = self._open.write(f)
                size = f.tell()
            self.digests[path] = (sha, size, None)
            self._open = None

    def add_encoded(
        self, name: str, dtype: DType, shape, nnz: int, enc: Encoded | ChunkedEncoded, base_fp: int, fp: int
    ) -> None:
        """A changed tensor from :func:`engine_ext.format.codec.encode_tensor`, whole or in cells."""
        if isinstance(enc, ChunkedEncoded):
            self.add_chunked_delta(name, dtype, shape, nnz, enc.cuts, enc.cells, base_fp, fp)
        else:
            self.add_delta(name, dtype, shape, nnz, enc, base_fp, fp)

    def add_chunked_delta(
        self,
        name: str,
        dtype: DType,
        shape,
        nnz: int,
        cuts: list[list[int]],
        cells: list[tuple[int, int, Encoded]],
        base_fp: int,
        fp: int,
    ) -> None:
        """A changed tensor cut into grid cells (``cells``: (cell, nnz, encoding) of each cell
        that changed), each with its own bytes and hash, so a rank can fetch only its cells."""
        chunks = []
        for cell, n, enc in cells:
            data = enc.pos + enc.val
            section = cell_section(name, shape, cuts, cell, self.reader_tp)
            blob, offset = self._append(data, section)
            chunk = Chunk(
                cell,
                n,
                blob,
                offset,
                hashlib.sha256(data).hexdigest(),
                Segment(enc.pos_coder, len(enc.pos)),
                Segment(enc.val_coder, len(enc.val), enc.mode),
            )
            self._place(chunk, section)
            chunks.append(chunk)
        shared_shape, grid = self._shared(shape, cuts)
        self.manifest.tensors.append(
            TensorEntry(name, dtype.name, shared_shape, nnz, fpr.fmt(fp), fpr.fmt(base_fp), grid=grid, chunks=chunks)
        )

    # -- anchors --------------------------------------------------------------
    def add_anchor(
        self,
        infos: list[tuple],
        load: Callable[[str], torch.Tensor],
        fingerprint: Callable[[str, torch.Tensor], int] | None = None,
        done: Callable[[], None] | None = None,
        workers: int | None = None,
    ) -> None:
        """Write every tensor of ``infos`` (in order) into anchor shards of about ``blob_target`` bytes.

        ``infos`` are ``(name, dtype, shape)``, or ``(name, dtype, local shape, Rows)`` for a
        sharded trainer's row slice (written under the tensor's name, listed as the cells it
        holds, with its partial fingerprint). The shards are written in parallel, one thread
        each (writes, hashing and fingerprints release the GIL); within a shard one tensor is
        in memory at a time, written once and hashed as written. ``load(name)`` gives the
        tensor, ``fingerprint(name, tensor)`` its fingerprint as the caller keeps it (None:
        fingerprinted as written, a few MB at a time while they are in cache; a row slice over
        its own elements); ``done()`` is called after each tensor.
        """
        rows = {i[0]: i[3] for i in infos if len(i) > 3 and i[3] is not None}
        infos = [tuple(i[:3]) for i in infos]
        shards = self.anchor_shards(infos)
        writers = []
        for shard in shards:  # blob indices in shard order
            path = os.path.join(self.tmp.name, f"{len(self.files)}.safetensors")
            self.files.append(path)
            writers.append(
                (
                    len(self.files) - 1,
                    SafetensorsWriter(
                        path, shard, {"format": "engine-ext-anchor", "version": self.manifest.version}, hashed=True
                    ),
                )
            )

        def write(job) -> list[TensorEntry]:
            (blob, w), shard = job
            entries = []
            for name, dt, _ in shard:
                t = load(name)
                r = rows.get(name)
                cells = _cells(r, t.shape[0]) if r is not None else []
                fp, at = [0], (r.start * math.prod(r.shape[1:]) if r is not None else 0)

                def hash_elements(chunk, offset, fp=fp, at=at, size=dt.itemsize):
                    fp[0] += fpr.buffer_fingerprint(chunk, size, at + offset // size)

                w.write(
                    name,
                    t,
                    splits=[(a - r.start) * (t.nbytes // max(1, t.shape[0])) for _, a, _ in cells[1:]],
                    on_chunk=hash_elements if fingerprint is None else None,
                )
                fp = fp[0] & fpr.MASK64 if fingerprint is None else fingerprint(name, t)
                entries.append(
                    self._anchor_entry(w, blob, name, t, fp)
                    if r is None
                    else self._anchor_cells(w, blob, name, t, fp, r, cells)
                )
                if done is not None:
                    done()
            w.close()
            if w.bounds != cuts(w.size, listed_ranges(entries, blob)):  # the writer's segments are the ones readers cut
                raise AssertionError(f"{w.path}: segments written at {w.bounds[:6]}..., listed otherwise")
            self.digests[str(w.path)] = (w.sha256, w.size, PIECES)
            return entries

        with ThreadPoolExecutor(max(1, min(workers or os.cpu_count() or 1, len(shards)))) as pool:
            for entries in pool.map(write, zip(writers, shards)):
                self.manifest.tensors.extend(entries)

    def anchor_shards(self, infos: list[tuple[str, DType, tuple]]) -> list[list[tuple[str, DType, tuple]]]:
        """Split tensors (in order) into safetensors shards of about blob_target bytes."""
        shards, cur, size = [], [], 0
        for name, dt, shape in infos:
            n = dt.itemsize * int(torch.Size(shape).numel())
            if cur and size + n > self.blob_target:
                shards.append(cur)
                cur, size = [], 0
            cur.append((name, dt, tuple(shape)))
            size += n
        if cur:
            shards.append(cur)
        return shards

    @staticmethod
    def _anchor_entry(w: SafetensorsWriter, blob: int, name: str, t: torch.Tensor, fp: int) -> TensorEntry:
        off, n = w.data_range(name)
        dt = w.header[name]
        if t.numel() == 0:  # an empty tensor: nothing to write or fetch
            return TensorEntry(name, BY_SAFETENSORS[dt["dtype"]].name, list(t.shape), 0, fpr.fmt(fp))
        return TensorEntry(
            name,
            BY_SAFETENSORS[dt["dtype"]].name,
            list(t.shape),
            t.numel(),
            fpr.fmt(fp),
            blob=blob,
            offset=off,
            sha256=w.tensor_sha256[name],
            positions=Segment("all", 0),
            values=Segment("raw", n, "abs"),
        )

    @staticmethod
    def _anchor_cells(
        w: SafetensorsWriter,
        blob: int,
        name: str,
        t: torch.Tensor,
        fp: int,
        rows: Rows,
        cells: list[tuple[int, int, int]],
    ) -> TensorEntry:
        """A row slice's entry: the cells inside it as chunks of the slice's bytes, its partial fingerprint."""
        off, n = w.data_range(name)
        row_bytes, per_row = n // max(1, t.shape[0]), t.numel() // max(1, t.shape[0])
        dt = BY_SAFETENSORS[w.header[name]["dtype"]]
        chunks = [
            Chunk(
                cell,
                (b - a) * per_row,
                blob,
                off + (a - rows.start) * row_bytes,
                sha,
                Segment("all", 0),
                Segment("raw", (b - a) * row_bytes, "abs"),
            )
            for (cell, a, b), sha in zip(cells, w.piece_sha256[name])
        ]
        return TensorEntry(
            name, dt.name, list(rows.shape), t.numel(), fpr.fmt(fp), grid=[list(rows.cuts)], chunks=chunks
        )

    # -- finish ---------------------------------------------------------------
    def name_blobs(self) -> list[tuple[str, str]]:
        """Name every blob by its version, rank part, index and content and list them in the manifest
        (once: later calls return the same); returns their (key, local file)."""
        if self._named is not None:
            return self._named
        self._close_blob()
        m = self.manifest
        version_tag = blob_tag(m.version, m.kind, self.part, catch_up_from(m))
        keys = []
        for i, path in enumerate(self.files):
            ext = "safetensors" if path.endswith(".safetensors") else "bin"
            sha, size, digest = self.digests[path]
            key = f"{version_tag}.{i}.{sha[:32]}.{ext}"
            m.blobs.append(Blob(key, size, sha, digest))
            keys.append((key, path))
        self._named = keys
        return keys

    def publish(self, store: Store, signer: Signer | None = None, latest_ttl_s: float = LATEST_TTL_S) -> str:
        """Hash blobs, finish the manifest, sign it (with ``signer``), publish; returns the
        manifest's URI. ``LATEST`` is signed too and stays valid for ``latest_ttl_s``."""
        keys = self.name_blobs()
        uri, self.manifest_sha256, self.latest = commit(
            store, self.manifest, signer, latest_ttl_s, keys, reader_tp=self.reader_tp
        )
        self.tmp.cleanup()
        return uri

    def upload(
        self, store: Store, workers: int = 4, write_tables: Callable[[Manifest, str], tuple] | None = None
    ) -> Manifest:
        """A sharded version's part: create this rank's blobs in the store (write-once, in parallel) and
        return its part of the manifest (blob indices its own, fingerprints partial) for :func:`merge_parts`.
        ``write_tables(part, spool)``: for a version published in tables, writes what the rank tables itself
        (:func:`engine_ext.trainer.table_parts.write_part`) as one more blob, uploaded with the others;
        then its result is returned."""
        keys = list(self.name_blobs())
        try:
            out = self.manifest
            if write_tables is not None:
                out, tables = write_tables(self.manifest, self.tmp.name)
                keys += [tables] if tables is not None else []
            if keys:
                with ThreadPoolExecutor(max(1, min(workers, len(keys)))) as pool:
                    list(pool.map(lambda kp: store.create_file(*kp), keys))
        finally:
            self.tmp.cleanup()
        return out


def _cells(rows: Rows, local_rows: int) -> list[tuple[int, int, int]]:
    """(cell, first row, end row) of the dimension-0 cells inside a row slice; they must tile it."""
    stop = rows.start + local_rows
    cells = [(i, a, b) for i, (a, b) in enumerate(zip(rows.cuts, rows.cuts[1:])) if rows.start <= a and b <= stop]
    if sum(b - a for _, a, b in cells) != local_rows:
        raise ValueError(f"rows {rows.start}..{stop} are not a union of the cells cut at {list(rows.cuts)[:8]}")
    return cells


def commit(
    store: Store,
    m: Manifest,
    signer: Signer | None = None,
    latest_ttl_s: float = LATEST_TTL_S,
    blobs: list[tuple[str, str]] = (),
    inline_limit: int | None = None,
    reader_tp: int | None = None,
) -> tuple[str, str, Latest | None]:
    """Finish a manifest whose blobs are named (model fingerprints, time, the lowest format version
    that describes it), validate it, sign it and publish it with ``blobs`` (key, local file) and
    ``LATEST`` (:func:`engine_ext.store.publish_version`). A manifest of over ``inline_limit`` tensor
    entries and chunks (default ``ENGINE_EXT_INLINE_ENTRIES``) is published in tables (format 10; format 12
    with cell sections for readers of ``reader_tp``-way tensor parallelism, default ``ENGINE_EXT_READER_TP``),
    its tensor entries and cell tables in one more blob (:func:`_tables_blob`); ``m`` keeps them inline.
    Returns (URI, SHA-256 of the published manifest's bytes, LATEST)."""
    with collector_paused():  # a K2 version's manifest holds millions of objects: no full passes over them
        keys = fpr.name_keys([t.name for t in m.tensors])  # once: both fingerprints, the checks, the name index
        columns = Columns.of_entries(m.tensors)  # once: the fingerprints, the checks, the tables
        fp, base = columns.model_fingerprints(keys, m.kind == DELTA)
        m.fingerprint = fpr.fmt(fp)
        if base is not None:
            m.base_fingerprint = fpr.fmt(base)
        m.created_unix = time.time()
        m.format_version = m.lowest_version()
        records = m.validate(keys, columns)
    mkey = m.key
    limit = settings.current().inline_entries if inline_limit is None else inline_limit
    in_tables = m.entries > limit
    with (
        tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}spool-", dir=store.spool_dir())
        if in_tables
        else contextlib.nullcontext()
    ) as spool:  # the tables' blob lives there until it is published
        if in_tables:
            with collector_paused():
                shares = settings.current().reader_tp if reader_tp is None else reader_tp
                wire, tables = _tables_blob(m, spool, records, keys, columns, shares)
            raw, blobs = wire.to_json(), [*blobs, tables]
        else:
            raw, blobs = m.to_json(), list(blobs)
        sha, latest = publish_manifest(store, m, raw, blobs, signer, latest_ttl_s)
    return store.key_uri(mkey), sha, latest


def publish_manifest(
    store: Store, m: Manifest, raw: bytes, blobs: list[tuple[str, str]], signer: Signer | None, latest_ttl_s: float
) -> tuple[str, Latest | None]:
    """Publish a finished manifest ``m`` as the bytes ``raw``, with ``blobs`` (key, local file) not yet in the
    store and ``LATEST`` (:func:`engine_ext.store.publish_version`; with a signer, the manifest's detached
    signature and a signed LATEST valid for ``latest_ttl_s``). Returns (SHA-256 of ``raw``, LATEST). A catch-up
    delta (format 11) leaves LATEST alone (:func:`engine_ext.store.publish_catch_up`; None for LATEST)."""
    sha = hashlib.sha256(raw).hexdigest()
    signature = signer.sign_detached(raw) if signer else None
    if m.stands_for is not None:  # a catch-up shortcuts a published version: LATEST stays on its own manifest
        publish_catch_up(store, blobs, m.key, raw, m.version, m.fingerprint, signature)
        return sha, None
    latest = Latest(
        m.version,
        manifest_key(m.version, m.kind),
        m.fingerprint,
        m.anchor_version,
        sha,
        time.time() + latest_ttl_s if signer is not None else None,
    )
    publish_version(
        store,
        blobs,
        manifest_key(m.version, m.kind),
        raw,
        sign_latest(latest, signer),
        m.version,
        signature=signature,
    )
    return sha, latest


def blob_tag(version: int, kind: str, part: int | None = None, catch_up_from: int | None = None) -> str:
    """How a version's blob keys begin: ``v{version}``, ``.anchor`` for an anchor, ``.from{base}`` for a
    catch-up delta from ``base``, ``.r{rank}`` for a rank's part."""
    return (
        f"v{version:08d}"
        + (".anchor" if kind == ANCHOR else "")
        + ("" if catch_up_from is None else f".from{catch_up_from:08d}")
        + ("" if part is None else f".r{part}")
    )


def catch_up_from(m: Manifest) -> int | None:
    """The base version of a catch-up delta (format 11), whose blobs are named apart from its version's own."""
    return m.base_version if m.stands_for is not None else None


class SpooledBlob:
    """One blob of tables written to a local file in ``spool`` and hashed as it is written: :meth:`put`
    appends bytes and says where they landed (blob ``index`` in the manifest, offset), as the table writers
    want. Its key carries ``name`` (default: ``index``): a rank's blobs are numbered within its part."""

    def __init__(self, spool: str, index: int, name: int | None = None):
        self.index, self.name, self._digest = index, index if name is None else name, hashlib.sha256()
        self.path = os.path.join(spool, f"tables.{self.index}.bin")
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()

    def put(self, raw: bytes) -> tuple[int, int]:
        offset = self._file.tell()
        self._file.write(raw)
        self._digest.update(raw)
        return self.index, offset

    def close(self, tag: str) -> tuple[Blob, tuple[str, str]]:
        """The finished blob, named ``{tag}.{name}.{SHA-256 prefix}.bin``, and its (key, local file)."""
        size = self._file.tell()
        self._file.close()
        sha = self._digest.hexdigest()
        key = f"{tag}.{self.name}.{sha[:32]}.bin"
        return Blob(key, size, sha), (key, self.path)


def _tables_blob(
    m: Manifest,
    spool: str,
    records: np.ndarray | None = None,
    keys: np.ndarray | None = None,
    columns: Columns | None = None,
    shares: int = 0,
) -> tuple[Manifest, tuple[str, str]]:
    """``m`` in tables (:func:`engine_ext.format.tables.tabulate`; ``records``: its chunks' cell records and
    ``columns`` its entries' columns, as its validation made them; ``keys``: its name keys; ``shares``: cell
    sections for that many tensor-parallel readers, below 2 none) and its tables' blob (key, local file),
    written in ``spool``: the cell tables and sections, tensor tables and name index one after another,
    hashed as written."""
    out = SpooledBlob(spool, len(m.blobs))
    dims = [section_dim(t.name, t.shape, t.grid) for t in m.tensors]
    wire = tabulate(m, out.put, records=records, name_keys=keys, columns=columns, shares=shares, dims=dims)
    blob, file = out.close(blob_tag(m.version, m.kind, catch_up_from=catch_up_from(m)))
    wire.blobs = list(m.blobs) + [blob]
    wire.validate()  # its header and table references; the entries were validated inline
    return wire, file


@collector_paused()  # a Kimi-K2 version's parts join over a million chunks
def merge_parts(parts: list[Manifest], names: list[str]) -> Manifest:
    """One manifest from the parts of a sharded version (:meth:`VersionBuilder.upload`, in rank order):
    blobs in rank order, each tensor's pieces joined (``names``, in manifest order, must be exactly
    the tensors the parts list). A tensor one rank wrote whole is taken as it is; one written in row
    slices gets the sum of their partial fingerprints (sums over elements at global indices) and
    their chunks, which must share one grid. Unvalidated: :func:`commit` validates the whole. The parts are
    consumed: their entries and chunks move into the result, blob indices shifted in place (a million new
    chunks cost a K2 commit 1.6 s)."""
    head = parts[0]
    m = Manifest(
        kind=head.kind,
        model=head.model,
        version=head.version,
        fingerprint="",
        base_version=head.base_version,
        base_fingerprint=head.base_fingerprint,
        anchor_version=head.anchor_version,
        base_manifests=list(head.base_manifests),
    )
    tables = {}
    pieces: dict[str, list[TensorEntry]] = {}
    for part in parts:
        if (part.kind, part.version, part.base_version) != (head.kind, head.version, head.base_version):
            raise ValueError(
                f"parts of different versions: v{part.version} ({part.kind}) and v{head.version} ({head.kind})"
            )
        for dtype, t in (part.step_tables or {}).items():
            if tables.setdefault(dtype, t) != t:
                raise ValueError(f"the ranks coded {dtype} against different step tables")
        shift = len(m.blobs)
        m.blobs += part.blobs
        for t in part.tensors:
            if shift:  # the part's blob indices, after the blobs of the ranks before it: shifted in place
                if t.blob is not None:
                    t.blob += shift
                for c in t.chunks or ():
                    c.blob += shift
            pieces.setdefault(t.name, []).append(t)
    if set(pieces) != set(names):
        raise ValueError(
            f"the parts list other tensors than the model's: missing {sorted(set(names) - set(pieces))[:5]}, "
            f"unknown {sorted(set(pieces) - set(names))[:5]}"
        )
    m.step_tables = tables or None
    for name in names:
        ps = pieces[name]
        if len(ps) == 1:
            m.tensors.append(ps[0])
            continue
        t0, nnz = ps[0], sum(p.nnz for p in ps)
        changed = [p for p in ps if p.nnz]
        if any(p.chunks is None for p in changed) or any(p.grid != changed[0].grid for p in changed):
            raise ValueError(f"{name}: a tensor written in row slices comes in cells of one grid")
        fp = sum(fpr.parse(p.fingerprint) for p in ps) & fpr.MASK64
        base = None if t0.base_fingerprint is None else fpr.fmt(sum(fpr.parse(p.base_fingerprint) for p in ps))
        m.tensors.append(
            TensorEntry(
                name,
                t0.dtype,
                t0.shape,
                nnz,
                fpr.fmt(fp),
                base,
                grid=changed[0].grid if changed else None,
                chunks=sorted((c for p in changed for c in p.chunks), key=lambda c: c.cell) or None,
            )
        )
    return m


def sign_latest(latest: Latest, signer: Signer | None) -> bytes:
    """The bytes of ``LATEST``: the pointer and, with a signer, its signatures."""
    return latest.to_json(signer.signatures(latest.signed_bytes()) if signer else None)
