"""The fuzzers' corpus (issue 30): real data to mutate, made once per process.

A store published by the real :class:`DeltaPublisher` and signed (an anchor and a delta with
the context coder and a grid of cells, and the same without: every coder of the format), the
base and new weights, the keys, and real context-coded parts of every float dtype.
"""
from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_ext import settings
from engine_ext.format.context import blocks as cb, codec as cc, models as cm
from engine_ext.format.dtypes import as_bits, step_between
from engine_ext.format.manifest import Manifest
from engine_ext.store import decoding, reader
from engine_ext.store.local import LocalStore
from engine_ext.store.signing import Signer, Trust, generate_key


# --------------------------------------------------------------------------- a real published store


NOW = time.time()  # fixed per process: a strategy must draw the same way every time


SHAPES = {  # name: (shape, dtype): a delta of every coder, a grid of cells, context-coded parts
    "model.layers.0.mlp.down_proj.weight": ((64, 128), torch.bfloat16),  # cut into 2 x 2 cells
    "model.layers.0.self_attn.q_proj.weight": ((48, 64), torch.float32),
    "model.norm.weight": ((64,), torch.bfloat16),
    "model.layers.0.mlp.experts.w13": ((4, 32, 16), torch.float8_e4m3fn),
    "model.embed_tokens.weight": ((40, 24), torch.float16),
    "counter": ((8,), torch.int64),
}


def _pair(shape, dtype, seed: int, density: float):
    """A base and a version where small weights change more often, as in real training."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g)) * 0.02
    old = w.to(dtype)
    rate = (density * 0.01 / old.float().abs().clamp(min=1e-4)).clamp(max=0.9)
    chg = torch.rand(shape, generator=g) < rate
    bits = as_bits(old).clone()
    step = torch.where(torch.rand(shape, generator=g) < 0.5, 1, -1) * (1 + (torch.rand(shape, generator=g) < 0.1).int())
    bits[chg] += step[chg].to(bits.dtype)
    return old, bits.view(dtype)


def states() -> tuple[dict, dict]:
    a, b = {}, {}
    for i, (name, (shape, dt)) in enumerate(SHAPES.items()):
        if dt == torch.int64:
            a[name] = torch.arange(math.prod(shape), dtype=dt).reshape(shape)
            b[name] = a[name].clone()
            b[name][3] = 99
        else:
            a[name], b[name] = _pair(shape, dt, i, 0.2 if dt.itemsize == 1 else 0.03)
    return a, b


@dataclass
class Corpus:
    """A real store, published once per process: runs ``ctx`` (context coder on, cells of
    1024 elements) and ``plain`` (pco/zstd only), each an anchor (v0) and a delta (v1), signed
    by ``key``; a second key ``other`` nobody trusts by default."""

    root: Path
    a: dict
    b: dict
    key: str
    other: str
    manifests: dict  # name -> raw bytes ("ctx/v1", "ctx/v0", "plain/v1", "plain/v0", "rows/v0": format 6)
    blobs: dict  # key -> bytes (every run's, keys are unique by content)
    scratch: Path  # a store (directory) the targets write into, holding copies of every blob
    expected: dict  # name -> (shape, dtype name): the served model

    def manifest_doc(self, name: str) -> dict:
        return json.loads(self.manifests[name])


@functools.lru_cache(maxsize=1)
def corpus() -> Corpus:
    from engine_ext.trainer.publisher import DeltaPublisher

    root = Path(tempfile.mkdtemp(prefix="engine_ext_fuzz_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    generate_key(root / "publisher.key")
    generate_key(root / "other.key")
    a, b = states()
    runs = {"ctx": dict(chunk_min_cell=1024), "plain": dict(chunk_min_cell=None)}
    for run, kw in runs.items():
        with settings.override(context_coder=run == "ctx"):
            with DeltaPublisher(str(root / run), anchor_every=0, signing_key=str(root / "publisher.key"), dtype=None,
                                **kw) as pub:  # every dtype as held: the corpus covers each
                pub.publish(a)
                pub.publish(b)
    _rows_anchor(root / "rows", a, str(root / "publisher.key"))
    manifests, blobs = {}, {}
    scratch = root / "scratch"
    scratch.mkdir()
    for run in (*runs, "rows"):
        for v, key in ((0, "v00000000.anchor.json"), (1, "v00000001.json")):
            if (root / run / key).exists():
                manifests[f"{run}/v{v}"] = (root / run / key).read_bytes()
        for p in (root / run).iterdir():
            if p.name.endswith((".bin", ".safetensors")):
                blobs[p.name] = p.read_bytes()
                (scratch / p.name).write_bytes(blobs[p.name])
    expected = {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in a.items()}
    c = Corpus(root, a, b, str(root / "publisher.key"), str(root / "other.key"), manifests, blobs, scratch, expected)
    _warm_up(c)
    return c


def _rows_anchor(root: Path, a: dict, key: str) -> None:
    """v0 of ``a`` as a sharded trainer at world 2 writes it (format 6, a chunked anchor): every
    tensor's rows cut between two ranks' parts, each written by the real builder, merged and
    committed as :class:`~engine_ext.trainer.sharded.ShardedPublisher` does (without its process group)."""
    from engine_ext.format.dtypes import BY_TORCH
    from engine_ext.format.manifest import ANCHOR
    from engine_ext.trainer.builder import Rows, VersionBuilder, commit, merge_parts

    root.mkdir()
    store = LocalStore(str(root))
    parts = []
    for rank in range(2):
        b = VersionBuilder(ANCHOR, "model", 0, anchor_version=0, spool_in=store, part=rank)
        local, infos = {}, []
        for name, t in a.items():
            n0 = t.shape[0]
            lo, hi = (0, n0 // 2) if rank == 0 else (n0 // 2, n0)
            local[name] = t[lo:hi]
            infos.append((name, BY_TORCH[t.dtype], tuple(local[name].shape), Rows(tuple(t.shape), lo, (0, n0 // 2, n0))))
        b.add_anchor(infos, local.__getitem__)
        parts.append(b.upload(store))
    commit(store, merge_parts(parts, list(a)), Signer(key))


def _warm_up(c: Corpus) -> None:
    """Decode every genuine version once: numba loads its kernels and the pools start their threads
    here, not inside the first measured example."""
    store = LocalStore(str(c.scratch))
    for raw in c.manifests.values():
        m = Manifest.from_json(raw)
        reader.fetch_selected(store, m, None, workers=2, bases=decoding.TensorBases(c.a))
    for p in v2_pool():
        cc.decode(cc.StoredPart(p["dtype"], p["shape"], p["box"], p["e"].pos, p["e"].val, p["pos"].size, p["tables"]),
                  lambda sub, p=p: cb.box_of(p["base"], p["shape"] if p["box"] is None else
                                             tuple(b - a for a, b in zip(*p["box"])), sub))


@functools.lru_cache(maxsize=4)
def signer(path: str) -> Signer:
    return Signer(path)


def trust_of(c: Corpus, which: str) -> Trust:
    pub = signer(c.key).public_keys()[0]
    other = signer(c.other).public_keys()[0]
    return {"one": Trust.from_public_keys([pub]),
            "two": Trust.from_public_keys([pub, other], threshold=2),
            "one_or_unsigned": Trust.from_public_keys([pub], allow_unsigned=True),
            "unsigned": Trust(allow_unsigned=True),
            "none": Trust()}[which]


# --------------------------------------------------------------------------- real context-coded parts


@functools.lru_cache(maxsize=1)
def v2_pool() -> list[dict]:
    """Real context-coded parts (the real encoder): every float dtype, whole tensors and grid cells,
    several block policies."""
    out = []
    specs = [((64, 96), torch.bfloat16, 0b1011, None), ((300,), torch.float16, 0b0001, None),
             ((4, 48, 40), torch.float32, 0b0111, None), ((64, 96), torch.float8_e4m3fn, 0, None),
             ((32, 64), torch.float8_e5m2, 0b0010, None), ((64, 128), torch.bfloat16, 0b0011, ((0, 64), (32, 128))),
             ((96, 64), torch.bfloat16, 0b1001, ((32, 0), (96, 32)))]
    for i, (shape, dt, policy, box) in enumerate(specs):
        old, new = _pair(shape, dt, 100 + i, 0.2 if dt.itemsize == 1 else 0.03)
        name = str(dt).removeprefix("torch.")
        if box is not None:
            sl = tuple(slice(a, b) for a, b in zip(*box))
            old_part, new_part = old[sl].contiguous(), new[sl].contiguous()
        else:
            old_part, new_part = old, new
        ob, nb = as_bits(old_part).reshape(-1), as_bits(new_part).reshape(-1)
        pos = torch.nonzero(ob != nb).reshape(-1).numpy()
        steps = step_between(ob[pos], nb[pos], True).numpy()
        base = ob.numpy()
        tables = cm.step_tables(name, cm.exponents(base[pos], name), steps)
        e = cc.encode(name, shape, box, policy, base, pos, steps, tables)
        out.append(dict(dtype=name, shape=shape, box=box, base=base, pos=pos, steps=steps, tables=tables, e=e))
    return out


@functools.lru_cache(maxsize=1)
def safetensors_sample() -> bytes:
    c = corpus()
    key = next(k for k in c.blobs if k.endswith(".safetensors"))
    return c.blobs[key]
