"""Assemble one published version: encoded tensors -> blobs + manifest.

Blobs are spooled to temporary files (bounded memory for anchors and big deltas)
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
from typing import Callable

import torch

from ..format import fingerprint as fpr
from ..store.checkpoint import SafetensorsWriter
from ..format.codec import ChunkedEncoded, Encoded
from ..format.dtypes import BY_SAFETENSORS, DType
from ..format.manifest import ANCHOR, DELTA, Blob, Chunk, Latest, Manifest, Segment, TensorEntry, manifest_key
from ..store.signing import Signer
from ..store import Store, publish_version

BLOB_TARGET = 256 << 20  # start a new blob past this size, so readers can fetch in parallel
LATEST_TTL_S = 7 * 24 * 3600.0  # a signed LATEST older than this is stale (re-publish to refresh)


class VersionBuilder:
    def __init__(self, kind: str, model: str, version: int, base_version: int | None = None,
                 anchor_version: int | None = None, blob_target: int = BLOB_TARGET,
                 base_manifests: list[str] | None = None):
        self.manifest = Manifest(kind=kind, model=model, version=version, fingerprint="",
                                 base_version=base_version if kind == DELTA else None,
                                 base_fingerprint="" if kind == DELTA else None,
                                 anchor_version=anchor_version,
                                 base_manifests=list(base_manifests or []) if kind == DELTA else [])
        self.manifest_sha256: str | None = None  # of the published manifest's bytes
        self.latest: Latest | None = None  # the LATEST pointer published with it
        self.tmp = tempfile.TemporaryDirectory(prefix="engine-ext-")
        self.blob_target = blob_target
        self.files: list[str] = []
        self._cur = None  # open file of the current delta blob

    # -- deltas ---------------------------------------------------------------
    def add_unchanged(self, name: str, dtype: DType, shape, fp: int) -> None:
        f = fpr.fmt(fp)
        self.manifest.tensors.append(TensorEntry(name, dtype.name, list(shape), 0, f, f if self.manifest.kind == DELTA else None))

    def add_delta(self, name: str, dtype: DType, shape, nnz: int, enc: Encoded, base_fp: int, fp: int) -> None:
        if nnz == 0:
            return self.add_unchanged(name, dtype, shape, fp)
        f = self._delta_blob()
        data = enc.pos + enc.val
        entry = TensorEntry(name, dtype.name, list(shape), nnz, fpr.fmt(fp), fpr.fmt(base_fp),
                            blob=len(self.files) - 1, offset=f.tell(), sha256=hashlib.sha256(data).hexdigest(),
                            positions=Segment(enc.pos_coder, len(enc.pos)),
                            values=Segment(enc.val_coder, len(enc.val), enc.mode))
        f.write(data)
        self.manifest.tensors.append(entry)

    def _delta_blob(self):
        if self._cur is None or self._cur.tell() >= self.blob_target:
            self._close_cur()
            path = os.path.join(self.tmp.name, f"{len(self.files)}.bin")
            self.files.append(path)
            self._cur = open(path, "wb")
        return self._cur

    def _close_cur(self):
        if self._cur is not None:
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
            f = self._delta_blob()
            data = enc.pos + enc.val
            chunks.append(Chunk(cell, n, len(self.files) - 1, f.tell(), hashlib.sha256(data).hexdigest(),
                                Segment(enc.pos_coder, len(enc.pos)), Segment(enc.val_coder, len(enc.val), enc.mode)))
            f.write(data)
        self.manifest.tensors.append(TensorEntry(name, dtype.name, list(shape), nnz, fpr.fmt(fp), fpr.fmt(base_fp),
                                                 grid=cuts, chunks=chunks))

    # -- anchors --------------------------------------------------------------
    def add_anchor(self, infos: list[tuple[str, DType, tuple]], load: Callable[[str], torch.Tensor],
                   fingerprint: Callable[[str, torch.Tensor], int], done: Callable[[], None] | None = None) -> None:
        """Write every tensor of ``infos`` (in order) into anchor shards, one tensor in memory at a time.

        ``load(name)`` gives the tensor, ``fingerprint(name, tensor)`` its fingerprint
        (computed, or kept by the caller); ``done()`` is called after each tensor (progress).
        """
        for shard in self.anchor_shards(infos):
            w = self.open_anchor_shard(shard)
            for name, _, _ in shard:
                t = load(name)
                self.add_anchor_tensor(w, name, t, fingerprint(name, t))
                if done is not None:
                    done()
            w.close()

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

    def open_anchor_shard(self, infos) -> SafetensorsWriter:
        path = os.path.join(self.tmp.name, f"{len(self.files)}.safetensors")
        self.files.append(path)
        return SafetensorsWriter(path, infos, {"format": "engine-ext-anchor", "version": self.manifest.version})

    def add_anchor_tensor(self, w: SafetensorsWriter, name: str, t: torch.Tensor, fp: int) -> None:
        w.write(name, t)
        off, n = w.data_range(name)
        dt = w.header[name]
        entry = TensorEntry(name, BY_SAFETENSORS[dt["dtype"]].name, list(t.shape), t.numel(), fpr.fmt(fp),
                            blob=len(self.files) - 1, offset=off, sha256=None,
                            positions=Segment("all", 0), values=Segment("raw", n, "abs"))
        if t.numel() == 0:  # an empty tensor: nothing to write or fetch
            entry.nnz, entry.blob, entry.offset = 0, None, 0
            entry.positions, entry.values = Segment("none", 0), Segment("none", 0)
        self.manifest.tensors.append(entry)

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
            sha, size = _sha256_file(path)
            key = f"{version_tag}.{i}.{sha[:32]}.{ext}"
            m.blobs.append(Blob(key, size, sha))
            keys.append((key, path))
        for t in m.tensors:  # anchors hash tensor ranges after the file is complete
            if t.nnz and t.sha256 is None and t.chunks is None:
                t.sha256 = _sha256_range(self.files[t.blob], t.offset, t.length)
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


def _sha256_file(path: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _sha256_range(path: str, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(length, 8 << 20))
            if not chunk:
                break
            h.update(chunk)
            length -= len(chunk)
    return h.hexdigest()
