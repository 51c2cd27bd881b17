"""Every public delta format we can run or re-implement, beside ours, on the same real training steps.

    BENCH_VENV/bin/python bench/peers.py   # a venv with Fireworks' package too (bench/fireworks_codec.py says how)
    .venv/bin/python bench/peers.py [--size small|medium] [--lr 3e-6] [--repeat 2]

Data (bench/train_data.py): a Qwen2-shaped model trained with AdamW on fp32 masters. Version 0 is
the model after the warm-up and ``settle`` steps at ``--lr``; the pairs are version 0 -> 1 (one step
apart) and 0 -> 10 (ten steps apart, what a replica ten versions behind needs), in two checkpoints:

* **bf16**: the bf16 cast of the fp32 masters (the checkpoint a rollout server loads; in this repo the
  bf16 steps and "fp32 masters cast to bf16" are one and the same data);
* **fp8 block**: ``bench/fp8_bench.py``'s fp8 checkpoint of the same masters (e4m3 linear weights in
  128x128 tiles with float32 scales; embeddings, lm_head and norms in bf16): three dtypes in one version.

Per format and pair: bytes per changed element (every byte a receiver gets: payload, per-tensor
metadata, checksums, signatures), encode and decode nanoseconds per change (best of ``--repeat``,
the whole process pinned to one CPU, one torch/numba thread), whether the decode gives back the new
bits exactly (checked against the new checkpoint, bit for bit, every tensor), and whether the format
carries a check that the reader verifies. Encode starts from the two whole state dicts (each format
does its own diff); decode starts from the encoded bytes and the old state dict and ends with, per
tensor, the changed positions and their new bits (XOR+zstd and arc_v3 give whole tensors: that is
their decode).

Formats (each re-implementation's docstring names its source and what it assumes):

* verl ``delta_sharded``: verl 0.9.1's own encoder (``shard_delta_indices``, ``DeltaParam``,
  ``checksum``), assembled as ``_assemble_flush`` does, decoded as its vLLM consumer does;
* vLLM ``sparse_nccl``: its wire layout, re-implemented (needs NCCL);
* slime ``indices`` / ``deltas`` / ``deltas_zstd``: re-implemented from its source;
* TRL's async GRPO delta codec: re-implemented from the PR's description (not in a released TRL);
* PULSE: re-implemented from its authors' code (grail ``sparse_codec`` v3.1);
* Fireworks ``arc_v3``: the published package (bench/fireworks_codec.py), where importable;
* XOR + zstd (NeMo-RL, SkyRL style): re-implemented;
* ours, the publisher's default coding and bytes first (``ENGINE_EXT_READER_MBPS=0``): a real signed
  publish into a local store and a real ``load_delta``; so our encode time includes what a publish does
  besides coding (diff, fingerprints, SHA-256, Ed25519 signing, writing files) and our decode time
  includes reading the files and verifying the signature and every blob's SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import ClassVar

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # one thread for every format (before numba loads)

import numpy as np
import torch
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import fireworks_codec
from bench.fp8_bench import fp8_checkpoint
from bench.train_data import versions

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SIZES = {  # bench/train_data.py's Spec fields; small is its default (cached after the first run)
    "small": {},
    "medium": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 1376, "vocab": 8192},
}

StateDict = dict[str, torch.Tensor]


class Unsupported(Exception):
    """The format cannot code this checkpoint (the message says why)."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The flat integer view of ``t``'s bits."""
    return t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])


def changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """int64 flat positions whose bits differ."""
    return torch.nonzero(bits(old) != bits(new)).reshape(-1)


def changes(old: StateDict, new: StateDict):
    """(name, new tensor, its changed flat positions) of every tensor that changed, in ``new``'s order."""
    for name, v in new.items():
        pos = changed(old[name], v)
        if pos.numel():
            yield name, v, pos


# ----------------------------------------------------------------------------- the formats


class Format:
    """One format: ``encode(old, new) -> payload``, ``size(payload) -> bytes``, ``decode(old, payload)``
    -> ``{name: (positions, new values)}`` or ``{name: new tensor}`` (tensors not named are unchanged)."""

    name = ""
    source = ""  # run from the real package, or re-implemented from what
    verified = "no"  # a check the reader verifies, or "no"

    def timed_encode(self, old: StateDict, new: StateDict):
        t = time.perf_counter()
        payload = self.encode(old, new)
        return payload, time.perf_counter() - t

    def encode(self, old: StateDict, new: StateDict):
        raise NotImplementedError

    def size(self, payload) -> int:
        raise NotImplementedError

    def decode(self, old: StateDict, payload) -> dict:
        raise NotImplementedError


def by_dtype(names, sd: StateDict) -> dict[torch.dtype, list[str]]:
    out: dict[torch.dtype, list[str]] = {}
    for n in names:
        out.setdefault(sd[n].dtype, []).append(n)
    return out


class VerlDeltaSharded(Format):
    """verl 0.9.1 ``delta_sharded`` with verl's own code: ``delta_sync.sparse_gather.shard_delta_indices``
    per tensor, assembled like ``DeltaCheckpointEngine._assemble_flush`` (int32 positions as a uint8 blob, one
    values tensor, a ``DeltaParam`` per tensor, ``delta_sync.checksum``); decoded like
    ``vllm_rollout.delta_weight_transfer.decode_delta_payload`` (checksum check, then per-tensor slices).

    Assumed: the whole version is one flush per value dtype (verl bounds flushes by
    ``update_weights_bucket_megabytes``; more flushes only add specs); the spec (JSON, sent beside the
    data) is counted. verl's consumers accept bf16 models only ("VERL delta weight transfer supports only
    BF16 vLLM models", "does not support quantized vLLM models"), so its fp8 rows are the encoder's output
    for a checkpoint its receivers refuse."""

    name = "verl delta_sharded"
    source = "verl 0.9.1 (its encoder and checksum)"
    verified = "yes: XOR-reduce hash (torch.hash_tensor) of positions and values"

    def encode(self, old, new):
        from verl.checkpoint_engine.delta_sync import DeltaParam, checksum
        from verl.checkpoint_engine.delta_sync.sparse_gather import shard_delta_indices

        pieces = {}
        for name, v in new.items():
            i, x = shard_delta_indices(v.reshape(-1), old[name].reshape(-1), 0)
            if i.numel():
                pieces[name] = (i.to(torch.int32), x)
        flushes = []
        for names in by_dtype(pieces, new).values():
            params, pos_off, val_off = [], 0, 0
            for n in names:
                k = pieces[n][0].numel()
                dt = str(new[n].dtype).removeprefix("torch.")
                params.append(DeltaParam(n, dt, list(new[n].shape), pos_off, pos_off + 4 * k, 4, val_off, val_off + k))
                pos_off, val_off = pos_off + 4 * k, val_off + k
            positions = torch.cat([pieces[n][0] for n in names]).view(torch.uint8)
            values = torch.cat([pieces[n][1] for n in names])
            try:
                check = checksum(positions, values)
            except NotImplementedError as e:  # torch.hash_tensor has no float8 kernel
                raise Unsupported(f"its checksum raises on {values.dtype}: {e}") from e
            spec = {"encoding": "indices", "params": [p.__dict__ for p in params], "checksum": check}
            flushes.append((json.dumps(spec).encode(), positions, values))
        return flushes

    def size(self, flushes):
        return sum(len(s) + p.numel() + v.numel() * v.element_size() for s, p, v in flushes)

    def decode(self, old, flushes):
        from verl.checkpoint_engine.delta_sync import checksum

        out = {}
        for raw, positions, values in flushes:
            spec = json.loads(raw)
            if checksum(positions, values) != spec["checksum"]:
                raise ValueError("delta checksum mismatch")
            for p in spec["params"]:
                pos = positions[p["pos_start"] : p["pos_end"]].view(torch.int32)
                out[p["name"]] = (pos, values[p["val_start"] : p["val_end"]])
        return out


class VllmSparseNccl(Format):
    """vLLM 0.32's ``sparse_nccl`` weight transfer (``distributed/weight_transfer/sparse_nccl_engine.py``),
    its wire layout re-implemented (the engine itself needs NCCL): per changed tensor, int32 flat ``indices``
    then ``values`` in the tensor's dtype, each broadcast as is; ``SparseNCCLWeightTransferUpdateInfo``
    (names, dtype names, shapes, counts) goes to the workers by RPC and is counted here as JSON. No checksum.

    Not modelled: the worker's loader stages each patch with NaN meaning "unchanged"
    (``checkpoint_weight_patch.copy_non_nan_``), so a new value that is NaN would not be applied; no
    value here is NaN. Whether vLLM's fp8 weight loaders accept sparse patches was not checked: the fp8 rows
    show the wire bytes."""

    name = "vLLM sparse_nccl"
    source = "re-implemented from vLLM 0.32 sparse_nccl_engine.py"

    def encode(self, old, new):
        patches = {}
        for name, v, pos in changes(old, new):
            patches[name] = (pos.to(torch.int32), v.reshape(-1)[pos])
        info = {
            "names": list(patches),
            "dtype_names": [str(new[n].dtype).split(".")[-1] for n in patches],
            "shapes": [list(new[n].shape) for n in patches],
            "num_updates_list": [i.numel() for i, _ in patches.values()],
        }
        return json.dumps(info).encode(), patches

    def size(self, payload):
        info, patches = payload
        return len(info) + sum(i.numel() * 4 + v.numel() * v.element_size() for i, v in patches.values())

    def decode(self, old, payload):
        info = json.loads(payload[0])
        return {n: payload[1][n] for n in info["names"]}


class Slime(Format):
    """slime's delta weight sync (THUDM/slime ``backends/megatron_utils/update_weight/
    update_weight_from_distributed_delta.py``), re-implemented. One wire layout: a uint8 ``__positions__``
    blob, one ``__values__`` tensor in the parameters' dtype, a ``DeltaParam`` list; three encodings:

    * ``indices``: int32 positions;
    * ``deltas``: gaps ``idx[k] - idx[k-1] - 1`` (first: the index) as uint16 per tensor, uint32 where a
      gap does not fit;
    * ``deltas_zstd``: ``deltas`` written as one safetensors file (positions, values, the params as JSON
      metadata) wrapped in zstd level 1 (its disk transport).

    For ``indices``/``deltas`` the params JSON (its ``DeltaSpec``) is counted. No checksum. Assumed: one
    flush per value dtype (a flush concatenates its values into one tensor, so mixed dtypes cannot share
    one); slime's fp8 path (a quantisation config on the receiver) is not modelled."""

    verified = "no"

    def __init__(self, encoding: str):
        self.encoding = encoding
        self.name = f"slime {encoding}"
        self.source = "re-implemented from slime's update_weight_from_distributed_delta.py"

    def encode(self, old, new):
        diffs = {}
        for name, v, pos in changes(old, new):
            diffs[name] = (pos, v.reshape(-1)[pos])
        flushes = []
        for names in by_dtype(diffs, new).values():
            params, blobs, pos_off, val_off = [], [], 0, 0
            for n in names:
                pos = diffs[n][0]
                if self.encoding == "indices":
                    width, blob = 4, pos.to(torch.int32).numpy().tobytes()
                else:
                    gaps = np.diff(pos.numpy(), prepend=-1) - 1
                    width = 2 if gaps.max() <= 65535 else 4
                    blob = gaps.astype(np.uint16 if width == 2 else np.uint32).tobytes()
                k = pos.numel()
                params.append(
                    {
                        "name": n,
                        "dtype": str(new[n].dtype).removeprefix("torch."),
                        "shape": list(new[n].shape),
                        "pos_start": pos_off,
                        "pos_end": pos_off + len(blob),
                        "pos_width": width,
                        "val_start": val_off,
                        "val_end": val_off + k,
                    }
                )
                blobs.append(blob)
                pos_off, val_off = pos_off + len(blob), val_off + k
            positions = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
            values = torch.cat([diffs[n][1] for n in names])
            spec = {"encoding": self.encoding, "params": params}
            if self.encoding == "deltas_zstd":
                raw = st_save(
                    {"__positions__": positions, "__values__": values},
                    metadata={"encoding": self.encoding, "params": json.dumps(params)},
                )
                flushes.append(zstandard.ZstdCompressor(level=1).compress(raw))
            else:
                flushes.append((json.dumps(spec).encode(), positions, values))
        return flushes

    def size(self, flushes):
        if self.encoding == "deltas_zstd":
            return sum(len(f) for f in flushes)
        return sum(len(s) + p.numel() + v.numel() * v.element_size() for s, p, v in flushes)

    def decode(self, old, flushes):
        out = {}
        for f in flushes:
            if self.encoding == "deltas_zstd":
                raw = zstandard.ZstdDecompressor().decompress(f)
                t = st_load(raw)
                n = struct.unpack("<Q", raw[:8])[0]
                params = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["params"])
                positions, values = t["__positions__"], t["__values__"]
            else:
                params = json.loads(f[0])["params"]
                positions, values = f[1], f[2]
            for p in params:
                blob = positions[p["pos_start"] : p["pos_end"]]
                if self.encoding == "indices":
                    pos = blob.view(torch.int32)
                else:
                    gaps = blob.numpy().view(np.uint16 if p["pos_width"] == 2 else np.uint32)
                    pos = torch.from_numpy(np.cumsum(gaps.astype(np.int64) + 1) - 1)
                out[p["name"]] = (pos, values[p["val_start"] : p["val_end"]])
        return out


class Trl(Format):
    """TRL's async GRPO delta codec, re-implemented from its description: TRL PR 5937 ("Delta weight sync
    for AsyncGRPO", closed; not in TRL 1.16.0, the release installed here) and our field notes: a sparse
    safetensors patch per version with, per changed tensor, its position gaps (first: the index) as uint16,
    uint32 where a gap does not fit, and its raw values. Assumed: safetensors' header counts; gaps are
    ``idx[k] - idx[k-1]``. The PR's nvCOMP-compressed gaps (~1.3 B per change by its figures) need a GPU
    library and are not run. The description says bf16; other dtypes are coded the same way (raw values).
    No checksum is described."""

    name = "TRL delta (gaps + raw)"
    source = "re-implemented from TRL PR 5937's description"

    def encode(self, old, new):
        tensors = {}
        for name, v, pos in changes(old, new):
            gaps = np.diff(pos.numpy(), prepend=0)
            dt = np.uint16 if gaps.max() <= 65535 else np.uint32
            tensors[f"{name}.gaps"] = torch.from_numpy(gaps.astype(dt).view(np.int16 if dt is np.uint16 else np.int32))
            tensors[f"{name}.values"] = v.reshape(-1)[pos]
        return st_save(tensors)

    def size(self, blob):
        return len(blob)

    def decode(self, old, blob):
        t = st_load(blob)
        out = {}
        for key, g in t.items():
            if key.endswith(".gaps"):
                name = key.removesuffix(".gaps")
                gaps = g.numpy().view(np.uint16 if g.dtype == torch.int16 else np.uint32).astype(np.int64)
                out[name] = (torch.from_numpy(np.cumsum(gaps)), t[f"{name}.values"])
        return out


class Pulse(Format):
    """PULSE (arXiv 2602.03839, PULSESync), re-implemented from its authors' code, one-covenant/grail
    ``grail/infrastructure/sparse_codec.py`` format v3.1: per changed tensor, COO indices (row = flat //
    columns, column = flat % columns; 1-D tensors: row = index), row deltas as uint8 / uint16 / int32 and
    column deltas (within a row; the absolute column where the row changes) as uint16 / int32, whichever
    fits the tensor's largest; values raw in bf16/fp16/fp32, any other dtype widened to float32 (so fp8 goes
    as 4 B, exactly); a 4-byte header length and a JSON header; the whole payload zstd level 1.

    The paper says every transfer is checked with SHA-256; we append the SHA-256 of the uncompressed payload
    (32 B) and check it on decode. Our decode is vectorised where grail's loops over rows."""

    name = "PULSE (grail v3.1)"
    source = "re-implemented from grail sparse_codec.py v3.1"
    verified = "yes: SHA-256 (per the paper)"
    _RAW: ClassVar[dict] = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.float32}

    @staticmethod
    def _narrow(x: np.ndarray, allow_u8: bool):
        m = int(x.max()) if x.size else 0
        if allow_u8 and m <= 255:
            return "uint8", x.astype(np.uint8)
        return ("uint16", x.astype(np.uint16)) if m <= 65535 else ("int32", x.astype(np.int32))

    def encode(self, old, new):
        meta, chunks, off = [], [], 0
        for name, v, pos in changes(old, new):
            pos = pos.numpy()
            cols = int(np.prod(v.shape[1:])) if v.dim() > 1 else 1
            rows, cs = pos // cols, pos % cols
            rd = np.diff(rows, prepend=0)
            boundary = np.ones(pos.size, dtype=bool)
            boundary[1:] = rd[1:] != 0
            cd = np.where(boundary, cs, np.diff(cs, prepend=0))
            rdt, rb = self._narrow(rd, True)
            cdt, cb = self._narrow(cd, False)
            vals = v.reshape(-1)[torch.from_numpy(pos)]
            raw_dt = self._RAW.get(v.dtype)
            vb = (vals.view(raw_dt) if raw_dt else vals.float()).numpy().tobytes()
            rb, cb = rb.tobytes(), cb.tobytes()
            meta.append(
                {
                    "name": name,
                    "shape": list(v.shape),
                    "num_nonzero": int(pos.size),
                    "value_dtype": str(v.dtype if raw_dt else torch.float32).removeprefix("torch."),
                    "row_dtype": rdt,
                    "col_dtype": cdt,
                    "offset": off,
                    "rows_size": len(rb),
                    "cols_size": len(cb),
                    "values_size": len(vb),
                }
            )
            chunks += [rb, cb, vb]
            off += len(rb) + len(cb) + len(vb)
        header = json.dumps({"version": 31, "tensors": meta}, separators=(",", ":")).encode()
        raw = struct.pack("<I", len(header)) + header + b"".join(chunks)
        return zstandard.ZstdCompressor(level=1).compress(raw) + hashlib.sha256(raw).digest()

    def size(self, blob):
        return len(blob)

    def decode(self, old, blob):
        raw = zstandard.ZstdDecompressor().decompress(blob[:-32])
        if hashlib.sha256(raw).digest() != blob[-32:]:
            raise ValueError("SHA-256 mismatch")
        n = struct.unpack("<I", raw[:4])[0]
        data = memoryview(raw)[4 + n :]
        out = {}
        for m in json.loads(raw[4 : 4 + n])["tensors"]:
            o = m["offset"]
            rd = np.frombuffer(data[o : o + m["rows_size"]], dtype=m["row_dtype"]).astype(np.int64)
            o += m["rows_size"]
            cd = np.frombuffer(data[o : o + m["cols_size"]], dtype=m["col_dtype"]).astype(np.int64)
            o += m["cols_size"]
            vb = np.frombuffer(data[o : o + m["values_size"]], dtype=np.uint8)
            rows = np.cumsum(rd)
            boundary = np.ones(rows.size, dtype=bool)
            boundary[1:] = rd[1:] != 0
            c = np.cumsum(cd)
            starts = np.flatnonzero(boundary)
            seg = np.cumsum(boundary) - 1
            cols_ = c - (c[starts] - cd[starts])[seg]
            ncols = int(np.prod(m["shape"][1:])) if len(m["shape"]) > 1 else 1
            vdt = getattr(torch, m["value_dtype"])
            vals = torch.frombuffer(bytearray(vb), dtype=vdt)
            dt = old[m["name"]].dtype
            out[m["name"]] = (torch.from_numpy(rows * ncols + cols_), vals if vdt == dt else vals.to(dt))
        return out


class XorZstd(Format):
    """XOR + zstd as NeMo-RL and SkyRL ship it, re-implemented: per tensor, the XOR of the old and new bits
    over the whole tensor, zstd level 3 (python ``zstandard`` defaults: no frame checksum). Assumed: a JSON
    header of names, dtypes, shapes and sizes; unchanged tensors are sent too (their XOR is all zeros, a
    few bytes). No checksum; the decode is the whole tensor (XOR back onto the old bits)."""

    name = "XOR + zstd-3"
    source = "re-implemented (NeMo-RL / SkyRL style)"

    def encode(self, old, new):
        z = zstandard.ZstdCompressor(level=3)
        blobs = {n: z.compress((bits(old[n]) ^ bits(v)).numpy().tobytes()) for n, v in new.items()}
        header = [[n, str(v.dtype), list(v.shape), len(blobs[n])] for n, v in new.items()]
        return json.dumps(header).encode(), blobs

    def size(self, payload):
        return len(payload[0]) + sum(len(b) for b in payload[1].values())

    def decode(self, old, payload):
        d = zstandard.ZstdDecompressor()
        out = {}
        for n, _, _, _ in json.loads(payload[0]):
            ob = bits(old[n])
            x = torch.frombuffer(bytearray(d.decompress(payload[1][n])), dtype=ob.dtype)
            out[n] = (ob ^ x).view(old[n].dtype).reshape(old[n].shape)
        return out


class FireworksArc3(Format):
    """Fireworks' ``arc_v3`` from the published package ``fireworks-delta-compression`` 0.1.0, per tensor
    (every tensor, as its files hold one blob per tensor), through bench/fireworks_codec.py: bytes = blob
    + checksum string; ``wait_all``: every candidate coder runs and the smallest wins (its best size; its
    encode time is five coders' work)."""

    name = "Fireworks arc_v3"
    source = "fireworks-delta-compression 0.1.0 (the package)"
    verified = "yes: adler32 (in the blob and beside it)"

    def encode(self, old, new):
        return {n: fireworks_codec.arc_v3_encode(old[n], v) for n, v in new.items()}

    def size(self, blobs):
        return sum(b.numel() + len(c.encode()) for b, c in blobs.values())

    def decode(self, old, blobs):
        return {n: fireworks_codec._decode(old[n].contiguous(), b, c) for n, (b, c) in blobs.items()}


class Ours(Format):
    """engine_ext: a real signed :class:`~engine_ext.trainer.publisher.DeltaPublisher` publish (the old
    version as an anchor, untimed, then the new one as a delta, timed to the end of its background work)
    into a local store, and a real ``load_delta`` (signature, every blob's SHA-256, decode) against the old
    weights in memory; REL parts' steps are turned into new bits (timed). Bytes: the delta's blobs, its
    manifest and its signature."""

    verified = "yes: Ed25519-signed manifest, SHA-256 per blob, fingerprint per tensor"
    source = "engine_ext (this repo)"

    def __init__(self, label: str, overrides: dict, tmp: Path):
        from engine_ext.store.signing import Trust, generate_key

        self.name, self.overrides, self.tmp = f"ours, {label}", overrides, tmp
        self.key = tmp / "publisher.key"
        if not self.key.exists():
            generate_key(self.key)
        self.trust = Trust.from_public_keys([f"{self.key}.pub"])
        self.runs = 0

    def timed_encode(self, old, new):
        from engine_ext import settings
        from engine_ext.trainer.publisher import DeltaPublisher

        self.runs += 1
        root = self.tmp / f"{self.name.replace(' ', '_').replace(',', '')}-{self.runs}"
        with settings.override(**self.overrides):
            pub = DeltaPublisher(
                str(root), model="peers", anchor_every=0, workers=1, dtype=None, signing_key=str(self.key)
            )
            pub.publish(old, version=0)
            pub.wait()
            t = time.perf_counter()
            pub.publish(new, version=1)
            pub.wait()
            s = time.perf_counter() - t
            pub.close()
        return root, s

    def size(self, root):
        return sum(p.stat().st_size for p in root.glob("v00000001*"))

    def decode(self, old, root):
        from engine_ext.format.delta import REL
        from engine_ext.format.dtypes import apply_step, as_bits
        from engine_ext.store.decoding import TensorBases
        from engine_ext.store.reader import load_delta

        d = load_delta(str(root / "v00000001.json"), bases=TensorBases(old), workers=1, trust=self.trust)
        out = {}
        for td in d.tensors:
            if not td.nnz:
                continue
            idx = td.index()
            nb = td.values
            if td.mode == REL:
                nb = apply_step(as_bits(old[td.name]).reshape(-1)[idx], td.values, td.dtype.is_float)
            out[td.name] = (idx, nb)
        return out


# ----------------------------------------------------------------------------- the harness


def lossless(old: StateDict, new: StateDict, decoded: dict) -> bool:
    """The decode, applied to ``old``, equals ``new`` bit for bit in every tensor."""
    for name, n in new.items():
        got = decoded.get(name)
        if got is None:
            ok = torch.equal(bits(old[name]), bits(n))
        elif isinstance(got, torch.Tensor):
            ok = got.shape == n.shape and got.dtype == n.dtype and torch.equal(bits(got), bits(n))
        else:
            pos, vals = got
            out = bits(old[name]).clone()
            out[pos.long()] = vals.reshape(-1).view(out.dtype) if vals.dtype != out.dtype else vals
            ok = torch.equal(out, bits(n))
        if not ok:
            return False
    return True


def measure(fmt: Format, old: StateDict, new: StateDict, nnz: int, repeat: int) -> dict:
    enc = dec = float("inf")
    for _ in range(repeat):
        payload, s = fmt.timed_encode(old, new)
        enc = min(enc, s)
        t = time.perf_counter()
        decoded = fmt.decode(old, payload)
        dec = min(dec, time.perf_counter() - t)
    return {
        "bytes": fmt.size(payload),
        "enc_ns": 1e9 * enc / nnz,
        "dec_ns": 1e9 * dec / nnz,
        "lossless": lossless(old, new, decoded),
    }


def formats(tmp: Path) -> tuple[list[Format], list[str]]:
    notes = []
    fs: list[Format] = []
    try:
        import verl.checkpoint_engine.delta_sync  # noqa: F401

        fs.append(VerlDeltaSharded())
    except ImportError as e:
        notes.append(f"verl delta_sharded skipped: verl not importable ({e})")
    fs += [VllmSparseNccl(), Slime("indices"), Slime("deltas"), Slime("deltas_zstd"), Trl(), Pulse()]
    if fireworks_codec.available():
        fs.append(FireworksArc3())
    else:
        notes.append(
            "Fireworks arc_v3 skipped: fireworks-delta-compression not importable in this Python "
            "(install it as bench/fireworks_codec.py says, run with that venv's python)"
        )
    fs += [XorZstd(), Ours("default", {}, tmp), Ours("bytes first", {"reader_mbps": 0.0}, tmp)]
    return fs, notes


def checkpoints(size: str, lr: float, settle: int) -> dict[str, list[StateDict]]:
    """Versions 0, 1 and 10 of one training run, as bf16 and as fp8 block checkpoints."""
    quiet = lambda *a: None
    masters = versions(lr, 10, settle=settle, masters=True, log=quiet, **SIZES[size])
    picked = [masters[0], masters[1], masters[10]]
    return {
        "bf16": [{n: t.to(torch.bfloat16) for n, t in m.items()} for m in picked],
        "fp8 block": [fp8_checkpoint(m) for m in picked],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--size",
        choices=list(SIZES),
        default="small",
        help="model size (bench/train_data.py); medium trains a new warm-up first (minutes)",
    )
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--settle", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2, help="timings: best of this many")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # arc_v3's decode
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    t0 = time.perf_counter()
    data = checkpoints(a.size, a.lr, a.settle)
    rows = []
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        fs, notes = formats(Path(tmp))
        print(f"command: {shlex.join(['python', 'bench/peers.py', *sys.argv[1:]])}")
        for label, (v0, v1, v10) in data.items():
            numel = sum(t.numel() for t in v0.values())
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in v0.values()})
            print(f"\n### {label}: {numel / 1e6:.2f} M elements ({', '.join(dtypes)}), lr {a.lr:g}\n")
            print(
                "| steps apart | changed | format | B / change | encode ns / change | decode ns / change "
                "| lossless | verified |"
            )
            print("|---:|---:|---|---:|---:|---:|---|---|")
            for gap, new in ((1, v1), (10, v10)):
                nnz = sum(int(changed(v0[n], t).numel()) for n, t in new.items())
                for f in fs:
                    try:
                        r = measure(f, v0, new, nnz, a.repeat)
                    except Unsupported as e:
                        print(f"| {gap} | | {f.name} | cannot code: {e} | | | | |")
                        continue
                    rows.append(dict(data=label, steps=gap, nnz=nnz, numel=numel, format=f.name, **r))
                    print(
                        f"| {gap} | {100 * nnz / numel:.2f} % ({nnz:,}) | {f.name} | {r['bytes'] / nnz:.3f} | "
                        f"{r['enc_ns']:.0f} | {r['dec_ns']:.0f} | {'yes' if r['lossless'] else '**NO**'} | "
                        f"{'yes' if f.verified.startswith('yes') else 'no'} |",
                        flush=True,
                    )
        print("\nformats:")
        for f in fs:
            print(f"- {f.name}: {f.source}; check: {f.verified}")
        for n in notes:
            print(f"- {n}")
    print(f"\none CPU, one thread; times best of {a.repeat}; total {time.perf_counter() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
