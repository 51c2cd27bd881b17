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
points at.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..format import fingerprint as fpr
from ..store.checkpoint import SafetensorsWriter
from ..format.codec import ChunkedEncoded, Encoded
from ..format.dtypes import BY_SAFETENSORS, DType
from ..format.manifest import ANCHOR, DELTA, Blob, Chunk, Latest, Manifest, Segment, TensorEntry, manifest_key
from ..store.base import _TMP_PREFIX
from ..store.signing import Signer
from ..store import Store, publish_version

BLOB_TARGET = 256 << 20  # start a new blob past this size, so readers can fetch in parallel
LATEST_TTL_S = 7 * 24 * 3600.0  # a signed LATEST older than this is stale (re-publish to refresh)


class VersionBuilder:
    def __init__(self, kind: str, model: str, version: int, base_version: int | None = None,
                 anchor_version: int | None = None, blob_target: int = BLOB_TARGET,
                 base_manifests: list[str] | None = None, spool_in: Store | None = None):
        self.manifest = Manifest(kind=kind, model=model, version=version, fingerprint="",
                                 base_version=base_version if kind == DELTA else None,
                                 base_fingerprint="" if kind == DELTA else None,
                                 anchor_version=anchor_version,
                                 base_manifests=list(base_manifests or []) if kind == DELTA else [])
        self.manifest_sha256: str | None = None  # of the published manifest's bytes
        self.latest: Latest | None = None  # the LATEST pointer published with it
        # Unlisted by local stores (their temp-file prefix); on the store's filesystem where it has one.
        self.tmp = tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}spool-", dir=spool_in.spool_dir() if spool_in else None)
        self.blob_target = blob_target
        self.files: list[str] = []
        self.digests: dict[str, tuple[str, int]] = {}  # blob file -> (SHA-256, size), recorded as written
        self._cur = None  # open file of the current delta blob
        self._cur_sha = None

    # -- deltas ---------------------------------------------------------------
    def add_step_tables(self, dtype: str, tables: list[bytes]) -> None:
        """The context coder's step tables for ``dtype``, which context-coded parts of it are decoded with."""
        self.manifest.step_tables = dict(self.manifest.step_tables or {}, **{dtype: [t.hex() for t in tables]})

    def add_unchanged(self, name: str, dtype: DType, shape, fp: int) -> None:
        f = fpr.fmt(fp)
        self.manifest.tensors.append(TensorEntry(name, dtype.name, list(shape), 0, f, f if self.manifest.kind == DELTA else None))

    def add_delta(self, name: str, dtype: DType, shape, nnz: int, enc: Encoded, base_fp: int, fp: int) -> None:
        if nnz == 0:
            return self.add_unchanged(name, dtype, shape, fp)
        data = enc.pos + enc.val
        offset = self._append(data)
        entry = TensorEntry(name, dtype.name, list(shape), nnz, fpr.fmt(fp), fpr.fmt(base_fp),
                            blob=len(self.files) - 1, offset=offset, sha256=hashlib.sha256(data).hexdigest(),
                            positions=Segment(enc.pos_coder, len(enc.pos)),
                            values=Segment(enc.val_coder, len(enc.val), enc.mode))
        self.manifest.tensors.append(entry)

    def _append(self, data: bytes) -> int:
        """Append ``data`` to the current delta blob (a new one past ``blob_target``); its offset there."""
        if self._cur is None or self._cur.tell() >= self.blob_target:
            self._close_cur()
            path = os.path.join(self.tmp.name, f"{len(self.files)}.bin")
            self.files.append(path)
            self._cur, self._cur_sha = open(path, "wb"), hashlib.sha256()
        offset = self._cur.tell()
        self._cur.write(data)
        self._cur_sha.update(data)
        return offset

    def _close_cur(self):
        if self._cur is not None:
            self.digests[self._cur.name] = (self._cur_sha.hexdigest(), self._cur.tell())
            self._cur.close()
            self._cur = None

    def add_encoded(self, name: str, dtype: DType, shape, nnz: int, enc: "Encoded | ChunkedEncoded",
                    base_fp: int, fp: int) -> None:
        """A changed tensor from :func:`engine_ext.format.codec.encode_tensor`, whole or in cells."""
        if isinstance(enc, ChunkedEncoded):
            self.add_chunked_delta(name, dtype, shape, nnz, enc.cuts, enc.cells, base_fp, fp)
        else:
            self.add_delta(name, dtype, shape, nnz, enc, base_fp, fp)

    def add_chunked_delta(self, name: str, dtype: DType, shape, nnz: int, cuts: list[list[int]],
                          cells: list[tuple[int, int, Encoded]], base_fp: int, fp: int) -> None:
        """A changed tensor cut into grid cells (``cells``: (cell, nnz, encoding) of each cell
        that changed), each with its own bytes and hash, so a rank can fetch only its cells."""
        chunks = []
        for cell, n, enc in cells:
            data = enc.pos + enc.val
            offset = self._append(data)
            chunks.append(Chunk(cell, n, len(self.files) - 1, offset, hashlib.sha256(data).hexdigest(),
                                Segment(enc.pos_coder, len(enc.pos)), Segment(enc.val_coder, len(enc.val), enc.mode)))
        self.manifest.tensors.append(TensorEntry(name, dtype.name, list(shape), nnz, fpr.fmt(fp), fpr.fmt(base_fp),
                                                 grid=cuts, chunks=chunks))

    # -- anchors --------------------------------------------------------------
    def add_anchor(self, infos: list[tuple[str, DType, tuple]], load: Callable[[str], torch.Tensor],
                   fingerprint: Callable[[str, torch.Tensor], int], done: Callable[[], None] | None = None,
                   workers: int | None = None) -> None:
        """Write every tensor of ``infos`` (in order) into anchor shards of about ``blob_target`` bytes.

        The shards are written in parallel, one thread each (writes, hashing and fingerprints
        release the GIL); within a shard one tensor is in memory at a time, written once and
        hashed as written. ``load(name)`` gives the tensor, ``fingerprint(name, tensor)`` its
        fingerprint (computed, or kept by the caller); ``done()`` is called after each tensor.
        """
        shards = self.anchor_shards(infos)
        writers = []
        for shard in shards:  # blob indices in shard order
            path = os.path.join(self.tmp.name, f"{len(self.files)}.safetensors")
            self.files.append(path)
            writers.append((len(self.files) - 1, SafetensorsWriter(
                path, shard, {"format": "engine-ext-anchor", "version": self.manifest.version}, hashed=True)))

        def write(job) -> list[TensorEntry]:
            (blob, w), shard = job
            entries = []
            for name, _, _ in shard:
                t = load(name)
                w.write(name, t)
                entries.append(self._anchor_entry(w, blob, name, t, fingerprint(name, t)))
                if done is not None:
                    done()
            w.close()
            self.digests[str(w.path)] = (w.sha256, w.size)
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
        return TensorEntry(name, BY_SAFETENSORS[dt["dtype"]].name, list(t.shape), t.numel(), fpr.fmt(fp),
                           blob=blob, offset=off, sha256=w.tensor_sha256[name],
                           positions=Segment("all", 0), values=Segment("raw", n, "abs"))

    # -- finish ---------------------------------------------------------------
    def publish(self, store: Store, signer: Signer | None = None, latest_ttl_s: float = LATEST_TTL_S) -> str:
        """Hash blobs, finish the manifest, sign it (with ``signer``), publish; returns the
        manifest's URI. ``LATEST`` is signed too and stays valid for ``latest_ttl_s``."""
        self._close_cur()
        m = self.manifest
        version_tag = f"v{m.version:08d}" + (".anchor" if m.kind == ANCHOR else "")
        keys = []
        for i, path in enumerate(self.files):
            ext = "safetensors" if path.endswith(".safetensors") else "bin"
            sha, size = self.digests[path]
            key = f"{version_tag}.{i}.{sha[:32]}.{ext}"
            m.blobs.append(Blob(key, size, sha))
            keys.append((key, path))
        m.fingerprint = fpr.fmt(fpr.model_fingerprint((t.name, fpr.parse(t.fingerprint)) for t in m.tensors))
        if m.kind == DELTA:
            m.base_fingerprint = fpr.fmt(fpr.model_fingerprint((t.name, fpr.parse(t.base_fingerprint)) for t in m.tensors))
        m.created_unix = time.time()
        m.validate()
        mkey = manifest_key(m.version, m.kind)
        raw = m.to_json()
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        latest = Latest(m.version, mkey, m.fingerprint, m.anchor_version, self.manifest_sha256,
                        time.time() + latest_ttl_s if signer is not None else None)
        self.latest = latest
        publish_version(store, keys, mkey, raw, sign_latest(latest, signer), m.version,
                        signature=signer.sign_detached(raw) if signer else None)
        self.tmp.cleanup()
        return store.key_uri(mkey)


def sign_latest(latest: Latest, signer: Signer | None) -> bytes:
    """The bytes of ``LATEST``: the pointer and, with a signer, its signatures."""
    return latest.to_json(signer.signatures(latest.signed_bytes()) if signer else None)
