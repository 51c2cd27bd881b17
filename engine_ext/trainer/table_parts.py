"""A sharded version in tables, written where its entries are made: each rank its own, rank 0 the index.

A version listing more tensor entries and chunks than a manifest inlines (``ENGINE_EXT_INLINE_ENTRIES``) is
published in tables (format 10, docs/FORMAT.md "Tables"). Joined on rank 0, a Kimi-K2 version's 140,790
entries and 1.13 M chunks cost its commit 6 s of Python objects (validated, turned into records, written),
against a share of 0.5 s (issue 52). Here every rank validates the tensors it published whole and writes
their cell tables and tensor tables into one more blob of its own (:func:`write_part`), in parallel with
the others; it hands rank 0 their references, their name keys and its share of the two model fingerprints
(:class:`TablesPart`: a sum over its tensors, as the model fingerprint is). Rank 0
(:func:`commit_tables`) joins only the row slices of tensors several ranks publish (:func:`merge_parts`:
few, whole-model FSDP's hundreds), checks that the ranks' names are exactly the model's (one comparison of
sorted key arrays), writes the name index over every table and signs the manifest.

Nothing a reader relies on moves off the readers: a reader of the whole (the driver) still reads every
tensor table, checks every entry, the name index against the tables and both model fingerprints against
the entries; a rank checks every cell table it reads (docs/FORMAT.md, "Checks"). The publisher's own
checks before it signs are the same as an unsharded commit's, made by the rank that made the entries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from .. import settings
from ..format import entries
from ..format import fingerprint as fpr
from ..format.bulk import collector_paused
from ..format.latest import Latest
from ..format.manifest import CELL_SECTIONS, DELTA, INDEXED, MAX_TENSOR_TABLES, Manifest, TableRef, manifest_key
from ..format.tables import PER_TABLE, binary_tables, index_records
from ..store import Store
from ..store.base import _TMP_PREFIX
from ..store.signing import Signer
from .blob_layout import section_dim
from .builder import SpooledBlob, blob_tag, merge_parts, publish_manifest

ZERO = fpr.fmt(0)


@dataclass
class TablesPart:
    """What one rank hands rank 0 of a version published in tables (:func:`write_part`)."""

    part: Manifest  # its blobs (the tables' blob last, if any) and its row slices of split tensors, for merge_parts
    tables: list[TableRef]  # its tensor tables (blob indices the version's), in order
    keys: np.ndarray  # uint64: the name keys of the tensors in those tables, in table then row order
    fingerprint: int  # its share of the model fingerprint: fingerprint.combined over its tables' tensors
    base_fingerprint: int | None  # the same of the base model fingerprint (a delta)
    shares: int = 0  # its tables' cell sections are for that many tensor-parallel readers (format 12); 0: none


def per_table(tensors: int, world: int) -> int:
    """Tensors per tensor table when ``world`` ranks each write tables of a version of ``tensors`` tensors,
    and rank 0 one more set: the version stays within MAX_TENSOR_TABLES (each writer's last table may be
    short)."""
    return max(PER_TABLE, -(-tensors // max(1, MAX_TENSOR_TABLES - world - 1)))


def _shares(shares: int | None) -> int:
    """The tensor-parallel readers a version's cell sections are for (``ENGINE_EXT_READER_TP`` by default); 0
    below 2 (format 10: none)."""
    shares = settings.current().reader_tp if shares is None else shares
    return shares if shares >= 2 else 0


def write_part(
    part: Manifest,
    spool: str,
    *,
    split: frozenset[str],
    shift: int,
    tag: str,
    per: int,
    shares: int | None = None,
) -> tuple[TablesPart, tuple[str, str] | None]:
    """A rank's part of a version published in tables: the tensors of ``part`` (its manifest part, blob indices
    its own) that it published whole are validated as a commit validates them (entries and chunks against
    its own blobs), then written into one more blob of its own, in ``spool``, named ``{tag}.{index}.…``: their
    cell tables, then tensor tables of ``per`` tensors, with every blob index moved to the version's
    (``shift``: the blobs of the ranks before it); with cell sections for ``shares`` tensor-parallel readers
    (default ``ENGINE_EXT_READER_TP``; every rank and rank 0 the same, format 12). Its row slices of ``split``
    tensors stay in the part, for rank 0 to join. Returns what rank 0 gets and the new blob's (key, local file), None if it wrote none;
    the part's tensors are consumed."""
    whole = [t for t in part.tensors if t.name not in split]
    part.tensors = [t for t in part.tensors if t.name in split]
    shares = _shares(shares)
    if not whole:
        return TablesPart(part, [], np.zeros(0, np.uint64), 0, 0 if part.kind == DELTA else None, shares), None
    with collector_paused():  # a K2 rank's part: ~9,000 entries, ~70,000 chunks
        keys = fpr.name_keys([t.name for t in whole])
        checked = dataclasses.replace(
            part,
            tensors=whole,
            fingerprint=ZERO,
            base_fingerprint=ZERO if part.kind == DELTA else None,
            format_version=INDEXED,
        )
        checked.held = frozenset(t.name for t in whole)  # a subset: the model fingerprints are rank 0's
        columns = entries.Columns.of_entries(whole)  # once: the checks, the fingerprints, the tables
        records = checked.validate(keys, columns)
        fp, base = columns.model_fingerprints(keys, part.kind == DELTA)
        for t in whole:  # the version's blob indices; chunks go into the tables as their records
            if t.blob is not None:
                t.blob += shift
        columns.blob = np.where(columns.blob == entries.NONE, entries.NONE, columns.blob + shift)
        if records is not None:
            records["blob"] += shift
        out = SpooledBlob(spool, shift + len(part.blobs), name=len(part.blobs))  # named as the rank's blobs are
        dims = [section_dim(t.name, t.shape, t.grid) for t in whole]
        tables = binary_tables(whole, out.put, per, records, columns, shares, dims)
    blob, file = out.close(tag)
    part.blobs.append(blob)
    return TablesPart(part, tables, keys, fp, base, shares), file


def commit_tables(
    store: Store,
    parts: list[TablesPart],
    split: list[str],
    model_keys: np.ndarray,
    signer: Signer | None,
    latest_ttl_s: float,
    per: int,
) -> tuple[str, str, Latest]:
    """Rank 0's commit of a version whose ranks wrote their tables (:func:`write_part`, ``parts`` in rank
    order): the ranks' row slices of the ``split`` tensors joined (:func:`merge_parts`) and validated, the
    ranks' tensor names checked to be exactly the model's (``model_keys``: the sorted name keys of every
    tensor, which the publisher makes once), the model fingerprints summed from the ranks' shares, then one
    blob of rank 0's: the split tensors' tables and the name index over every tensor table; the manifest
    is signed and published with it; its tables with cell sections for as many readers as every rank's (ranks
    that wrote for different counts are refused). Returns (URI, SHA-256 of the manifest's bytes, LATEST), as
    :func:`~engine_ext.trainer.builder.commit` does."""
    shares = parts[0].shares
    if any(p.shares != shares for p in parts):
        raise ValueError(f"the ranks wrote cell sections for different readers: {sorted({p.shares for p in parts})}")
    with collector_paused():
        m = merge_parts([p.part for p in parts], split)
        keys = fpr.name_keys(split)
        columns = entries.Columns.of_entries(m.tensors)  # once: the fingerprints, the checks, the tables
        fp, base = columns.model_fingerprints(keys, m.kind == DELTA)
        m.fingerprint = fpr.fmt(fp + sum(p.fingerprint for p in parts))
        if base is not None:
            m.base_fingerprint = fpr.fmt(base + sum(p.base_fingerprint or 0 for p in parts))
        m.created_unix = time.time()
        m.format_version = INDEXED
        m.held = frozenset(split)  # validated as a subset: its fingerprints were summed above
        records = m.validate(keys, columns)
        m.held = None
        every = np.concatenate([p.keys for p in parts] + [keys])
        if len(every) != len(model_keys) or not np.array_equal(np.sort(every), model_keys):
            raise ValueError(
                f"the ranks' tables list {len(every)} tensors that are not the model's {len(model_keys)} "
                "(a tensor missing, twice, or unknown)"
            )
    with tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}spool-", dir=store.spool_dir()) as spool:
        out = SpooledBlob(spool, len(m.blobs))
        with collector_paused():
            dims = [section_dim(t.name, t.shape, t.grid) for t in m.tensors]
            own = binary_tables(m.tensors, out.put, per, records, columns, shares, dims)
            tables = [r for p in parts for r in p.tables] + own
            raw_index = index_records(every, [r.count for r in tables])
            index = TableRef(*out.put(raw_index), len(raw_index), hashlib.sha256(raw_index).hexdigest(), len(every))
        blob, file = out.close(blob_tag(m.version, m.kind))
        wire = dataclasses.replace(m, tensors=[], blobs=[*m.blobs, blob], tables=tables, index=index)
        wire.format_version = CELL_SECTIONS if shares else INDEXED
        wire.validate()  # the header and every table reference (the entries: each rank's, and the split ones above)
        raw = wire.to_json()
        sha, latest = publish_manifest(store, wire, raw, [file], signer, latest_ttl_s)
    if latest is None:  # only a catch-up delta leaves LATEST alone, and a sharded trainer writes none
        raise ValueError(f"v{m.version}: a sharded version is not a catch-up delta")
    return store.key_uri(manifest_key(m.version, m.kind)), sha, latest
