"""HF-style safetensors checkpoint directories, read and written tensor by tensor.

Reading goes through ``safetensors.safe_open`` (memory-mapped, one tensor at a
time). Writing streams too: the header is computed from the known names, dtypes and
shapes first, then each tensor's bytes are appended, so memory stays bounded by the
largest tensor rather than the shard (``safetensors.torch.save_file`` needs the whole
shard in memory).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import math
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..format.dtypes import BY_SAFETENSORS, DType, as_bits
from ..format.pieces import combine

INDEX_NAME = "model.safetensors.index.json"
WRITE_CHUNK = 4 << 20  # bytes a writer hands the OS (and the hashes) at a time
WRITE_BEHIND = 64 << 20  # bytes a writer lets pile up in the page cache before it asks the OS to start writing them out
SINGLE_NAME = "model.safetensors"


@dataclass
class TensorInfo:
    """One tensor of a checkpoint directory as its safetensors header states it (nothing of its data is read):
    enough to size it and to find its shard. Not format.TensorDelta, which names the same three facts of a
    tensor: that one carries a change to it, this one where the checkpoint keeps it."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    file: str  # shard file name within the directory

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def read_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file (without reading its data). ValueError for anything
    else: a file too short, a header longer than the file (never allocated), not a JSON object."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: {len(head)} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > 100 << 20 or n > size - 8:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible (the file holds {size})")
        try:
            header = json.loads(f.read(n))
        except RecursionError:
            raise ValueError(f"{path}: safetensors header nested too deep") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    return header


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)


class CheckpointDir:
    """A directory with model.safetensors, or shards named by model.safetensors.index.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_NAME).exists():
            files = [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(f"{self.path}: no safetensors checkpoint here")
            files = found
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            for name, meta in read_header(self.path / fname).items():
                if name == "__metadata__":
                    continue
                if (
                    not isinstance(meta, dict)
                    or not isinstance(meta.get("dtype"), str)
                    or not _is_shape(meta.get("shape"))
                ):
                    raise ValueError(
                        f"{fname}:{name!r:.100}: not a tensor entry (a dtype and a shape of non-negative ints)"
                    )
                dt = BY_SAFETENSORS.get(meta["dtype"])
                if dt is None:
                    raise ValueError(f"{fname}:{name!r:.100}: unsupported dtype {meta['dtype'][:40]!r}")
                self.tensors[name] = TensorInfo(name, dt, tuple(meta["shape"]), fname)

    def names(self) -> list[str]:
        return list(self.tensors)

    def config(self) -> dict:
        """``config.json`` of the directory ({} when there is none)."""
        path = self.path / "config.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def drop_tied_copies(self) -> dict[str, str]:
        """Leave out the tied copy of the input embedding that some checkpoints store beside it.

        A model whose ``config.json`` says ``tie_word_embeddings`` (at its top level, else in its
        ``text_config``) holds one tensor under two names; engines load the input embedding and
        skip ``lm_head.weight``, and a version carries it once, under the kept name. Each
        ``lm_head.weight`` here is checked to be byte for byte the input embedding of its shape
        and dtype (an ``embed`` tensor) before it is left out; a "tied" copy that differs is
        refused (ValueError): the checkpoint is not what its config says. Returns {dropped: kept}.
        """
        cfg = self.config()
        tie = cfg.get("tie_word_embeddings")
        if tie is None:
            tie = (cfg.get("text_config") or {}).get("tie_word_embeddings")
        if not tie:
            return {}
        out = {}
        for copy in [n for n in self.tensors if n == "lm_head.weight" or n.endswith(".lm_head.weight")]:
            info = self.tensors[copy]
            kept = next(
                (
                    n
                    for n, i in self.tensors.items()
                    if n != copy and "embed" in n and (i.shape, i.dtype) == (info.shape, info.dtype)
                ),
                None,
            )
            if kept is None:
                raise ValueError(
                    f"{self.path}: config.json ties the word embeddings, but no input embedding has "
                    f"{copy}'s shape {list(info.shape)} and dtype {info.dtype.name}"
                )
            if not torch.equal(as_bits(self.load(copy)), as_bits(self.load(kept))):
                raise ValueError(
                    f"{self.path}: config.json ties the word embeddings, but {copy} differs from {kept} "
                    "(the checkpoint is not what its config says: untie it in config.json, or fix the weights)"
                )
            out[copy] = kept
        for copy in out:
            del self.tensors[copy]
        return out

    def specs(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        """{name: (shape, dtype)} from the headers only."""
        return {n: (i.shape, i.dtype) for n, i in self.tensors.items()}

    def load(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        with safe_open(self.path / info.file, framework="pt") as f:
            return f.get_tensor(name)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) one at a time, shard by shard."""
        for fname in self.files:
            with safe_open(self.path / fname, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys() and is not iterable
                    if name in self.tensors:  # not a tied copy left out
                        yield name, f.get_tensor(name)


def served_checkpoint(model: str, revision: str | None = None) -> CheckpointDir:
    """The checkpoint an engine serves: ``model`` is a local directory or a Hugging Face id
    already in the local cache (engines download it before the plugin looks)."""
    if os.path.isdir(model):
        return CheckpointDir(model)
    from huggingface_hub import snapshot_download

    return CheckpointDir(
        snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"], local_files_only=True)
    )


def _sync_file_range():
    """Linux's ``sync_file_range`` (Python's ``os`` has none), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages out; do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the OS to start writing ``nbytes`` at ``offset`` of a file to disk now, without waiting
    (write-behind, as RocksDB's ``bytes_per_sync`` and PostgreSQL's ``*_flush_after`` do).

    Why: a writer that fsyncs only at the end has the kernel write the whole file to disk then,
    after every byte was written and hashed: a 2.25 GB anchor waited 0.8-1.5 s in its fsyncs on
    this host. Started as it goes, the disk writes overlap the writer's hashing and the final
    fsync finds almost nothing left (``python bench/anchor_profile.py``). Only a hint: the fsync
    still makes the file durable, so where the call is missing (not Linux) or fails, nothing
    but time changes. True where the OS took it."""
    if _SYNC_FILE_RANGE is None or nbytes <= 0:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0  # releases the GIL (ctypes)


class SafetensorsWriter:
    """Write a safetensors file whose tensors are known up front, one tensor at a time.

    Each tensor's bytes are written straight from its memory (no copy), once. With
    ``hashed``, they are hashed once as they are written, each tensor (or piece) on its own
    (:attr:`tensor_sha256`, :attr:`piece_sha256`), and the file's digest is the pieces digest
    over them and the header's (:attr:`sha256`; format 8, :mod:`engine_ext.format.pieces`), so a
    publisher never reads the file back nor hashes its bytes twice. Every ``WRITE_BEHIND`` bytes
    it starts their write to disk (:func:`start_writeback`), so that :meth:`close`'s fsync waits
    for little.
    """

    def __init__(
        self,
        path: str | Path,
        infos: list[tuple[str, DType, tuple[int, ...]]],
        metadata: dict | None = None,
        hashed: bool = False,
    ):
        header, offset = {}, 0
        self.order = []
        for name, dt, shape in infos:
            n = dt.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": dt.safetensors, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.order.append((name, n))
            offset += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.header = header
        self.data_start = 8 + len(raw)
        self.path = Path(path)
        self.f = open(self.path, "wb")  # noqa: SIM115 - written tensor by tensor until close()
        head = struct.pack("<Q", len(raw)) + raw
        self.f.write(head)
        self.size = len(head)
        self.hashed = hashed
        self.segments = [hashlib.sha256(head).digest()] if hashed else []  # each segment's SHA-256, in file order
        self.bounds = [0, len(head)]  # where the segments begin and end
        self.tensor_sha256: dict[str, str] = {}
        self.piece_sha256: dict[str, list[str]] = {}  # per tensor written with ``splits``: each piece's SHA-256
        self.next = 0
        self.behind = 0  # bytes of the file whose write to disk was started (:func:`start_writeback`)

    @property
    def sha256(self) -> str:
        """The file's pieces digest (``hashed`` writers, once every tensor is written): its segments
        are the header and each tensor or piece, which the manifest lists as byte ranges."""
        return combine(self.segments)

    def data_range(self, name: str) -> tuple[int, int]:
        """(file offset, length) of a tensor's bytes."""
        a, b = self.header[name]["data_offsets"]
        return self.data_start + a, b - a

    def write(self, name: str, t: torch.Tensor, splits=(), on_chunk=None) -> None:
        """Append the next tensor's bytes. With ``splits`` (byte offsets into them, ascending), a
        ``hashed`` writer hashes the pieces between them too (:attr:`piece_sha256`): the cells a
        sharded anchor lists. ``on_chunk(bytes, offset)`` sees every few MB as they are written."""
        expected, n = self.order[self.next]
        if name != expected:
            raise ValueError(f"tensors must be written in header order: expected {expected!r}, got {name!r}")
        data = memoryview(as_bits(t.detach().contiguous()).reshape(-1).cpu().numpy()).cast("B")
        if len(data) != n:
            raise ValueError(f"{name}: {len(data)} bytes, header says {n}")
        edges = [0, *splits, n]
        pieces = []
        for a, b in itertools.pairwise(edges):  # written and hashed a few MB at a time, while they are in cache
            piece = hashlib.sha256() if self.hashed else None
            for c in range(a, b, WRITE_CHUNK):
                chunk = data[c : min(b, c + WRITE_CHUNK)]
                self.f.write(chunk)  # one huge write() is several times slower than many of a few MB
                if piece is not None:
                    piece.update(chunk)
                if on_chunk is not None:
                    on_chunk(chunk, c)
                if (written := self.size + c + len(chunk)) - self.behind >= WRITE_BEHIND:
                    self.f.flush()
                    start_writeback(self.f.fileno(), self.behind, written - self.behind)
                    self.behind = written
            pieces.append(piece)
            if b > a:  # an empty piece is no segment
                self.bounds.append(self.size + b)
                if piece is not None:
                    self.segments.append(piece.digest())
        self.size += n
        if self.hashed:
            self.piece_sha256[name] = [h.hexdigest() for h in pieces]
            if not splits:
                self.tensor_sha256[name] = self.piece_sha256[name][0]
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order) and not self.f.closed:
            self.f.close()
            raise ValueError(f"{self.path}: only {self.next} of {len(self.order)} tensors written")
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
