"""Fuzz targets for everything a server parses from a hostile store or caller (issue 30, item 2).

Each :class:`Target` drives one entry point a server uses, with a hypothesis strategy that
starts from real encoded data (a store published by :class:`DeltaPublisher`, streams from
the real encoders, a real signed ``LATEST``) and mutates it: field by field, byte by byte,
truncated, with huge declared sizes, nested past the recursion limit. The oracle allows two
outcomes only, an accepted valid input (checked against the spec, independently of the
parser) or the documented refusal (the :mod:`engine_ext.errors` class of docs/SECURITY.md
and docs/vllm.md, with its HTTP status and a short message). Every example is timed and its
allocations measured (tracemalloc's peak for Python and numpy, the peak resident set for
native code), each against a bound. ``tests/test_fuzz.py`` runs a fixed budget of every
target in CI; ``bench/fuzz_campaign.py`` runs them for minutes.

Where an entry point needs the rest of a server, the real parts run: a :class:`LocalStore`
over a directory, :class:`TensorBases` holding the base weights a rank would hold, the real
``post_answer`` with a real :class:`Auth`. The one stand-in is the controller behind
``post_answer`` (:class:`_RecordingController`): the update itself is out of scope here
(tests/test_hostile.py runs it); what is fuzzed is the body's parsing and status mapping.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import re
import signal
import struct
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from hypothesis import strategies as st

from engine_ext import settings
from engine_ext.errors import (BaseMismatchError, DeltaError, IntegrityError, ManifestError, NotFoundError,
                               PartlyHeldError, SourceError)
from engine_ext.format import chunks, codec, context_blocks as cb, context_codec as cc, context_models as cm
from engine_ext.format import fingerprint as fpr
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import BY_NAME, BY_SAFETENSORS, as_bits, step_between
from engine_ext.format.manifest import ANCHOR, DELTA, FORMAT, MAX_MANIFEST_BYTES, READABLE_VERSIONS, Latest, Manifest
from engine_ext.server.controller import Auth, error_answer
from engine_ext.server.http import post_answer
from engine_ext.server.protocol import MAX_BODY_BYTES, PAUSE_MODES, RequestError, UpdateRequest
from engine_ext.store import reader
from engine_ext.store.checkpoint import CheckpointDir, read_header
from engine_ext.store.local import LocalStore
from engine_ext.store.signing import MAX_SIGNATURE_BYTES, SignatureError, Signer, Trust, generate_key, key_id

NOW = time.time()  # fixed per process: a strategy must draw the same way every time
MAX_MESSAGE = 2000  # characters of an error message (docs/SECURITY.md: errors never echo the input at length)
HEX16 = re.compile(r"[0-9a-f]{16}")
SHA = re.compile(r"[0-9a-f]{64}")
KEY = re.compile(r"[A-Za-z0-9._-]+")


class Violation(AssertionError):
    """An outcome the contract does not allow: another exception, a wrong acceptance, over a bound."""


# --------------------------------------------------------------------------- measuring one example


class Hang(BaseException):
    """Raised by the alarm inside an example that runs past the hang bound (a BaseException so
    that no ``except Exception`` in the code under test swallows it)."""


def _on_alarm(signum, frame):
    raise Hang()


class Meter:
    """Runs one example: its outcome, CPU time and peak allocation.

    Allocation is measured two ways, since neither sees everything: tracemalloc's peak (Python
    objects and numpy buffers, even untouched ones) and the growth of the peak resident set
    (``VmHWM``, reset per example through ``/proc/self/clear_refs``, less the file pages mapped in
    meanwhile: native allocations of pcodec, zstd, constriction, torch once touched, not the code of
    a library a first call pages in). Where the kernel does not allow the
    reset, tracemalloc alone. A hang is cut by SIGALRM after ``hang_s`` (main thread only)."""

    def __init__(self, hang_s: float = 60.0):
        self.hang_s = hang_s
        self.rss = self._rss_resettable()
        self.examples = 0

    @staticmethod
    def _rss_resettable() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status(*names: str) -> list[int]:
        out = dict.fromkeys(names, 0)
        with open("/proc/self/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in out:
                    out[name] = int(line.split()[1]) * 1024
        return [out[n] for n in names]

    def run(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None, float, int]:
        """(result, exception, CPU seconds (all threads), peak bytes above the start) of ``fn()``."""
        tracemalloc.start()  # per example: traced outside, hypothesis's own work would be slowed down too
        traced0 = tracemalloc.get_traced_memory()[0]
        if self.rss:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss0, file0 = self._status("VmRSS", "RssFile")
        alarm = signal.getsignal(signal.SIGALRM)
        in_main = _main_thread()
        if in_main:
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.hang_s)
        result, exc = None, None
        t = time.process_time()  # CPU time of the process: the bound holds on a loaded machine too
        try:
            result = fn()
        except Hang as e:
            exc = e
        except Exception as e:  # noqa: BLE001 - judged by the caller
            exc = e
        finally:
            seconds = time.process_time() - t
            if in_main:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, alarm)
        peak = tracemalloc.get_traced_memory()[1] - traced0
        tracemalloc.stop()
        if self.rss:
            hwm, file1 = self._status("VmHWM", "RssFile")
            peak = max(peak, hwm - rss0 - (file1 - file0))  # pages of shared libraries a first call maps in are not allocations
        self.examples += 1
        return result, exc, seconds, peak


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


_METER: Meter | None = None


def meter() -> Meter:
    global _METER
    if _METER is None:
        _METER = Meter()
    return _METER


def judge(fn: Callable[[], Any], allowed: tuple[type, ...], seconds: float, max_bytes: int, what: str) -> tuple[Any, BaseException | None]:
    """Run ``fn`` under the meter and enforce the contract: it returns, or raises one of ``allowed``
    (documented refusals, whose HTTP status is the class's and whose message is short); within
    ``seconds`` and ``max_bytes``. :class:`Violation` otherwise."""
    result, exc, took, peak = meter().run(fn)
    if isinstance(exc, Violation):
        raise exc
    if isinstance(exc, Hang):
        raise Violation(f"{what}: hung (cut after {meter().hang_s} s)")
    if exc is not None:
        if not isinstance(exc, allowed):
            raise Violation(f"{what}: undocumented {type(exc).__name__}: {str(exc)[:300]}") from exc
        if isinstance(exc, DeltaError):
            status, body = error_answer(exc)
            if status != type(exc).http_status or status == 500:
                raise Violation(f"{what}: {type(exc).__name__} answered {status}")
        if len(str(exc)) > MAX_MESSAGE:
            raise Violation(f"{what}: a {len(str(exc))}-character error message ({type(exc).__name__}: {str(exc)[:200]}...)")
    if took > seconds:
        raise Violation(f"{what}: took {took:.3f} s, over the {seconds} s bound")
    if peak > max_bytes:
        raise Violation(f"{what}: allocated {peak / 2**20:.1f} MiB, over the {max_bytes / 2**20:.1f} MiB bound")
    return result, exc


# --------------------------------------------------------------------------- generic mutators


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` lists deep, written into the JSON text after serialisation (json.dumps
    would refuse it): parsers must refuse it, not recurse past the stack."""

    depth: int
    kind: str = "["


SPECIAL_INTS = [-2**64, -2**63, -1, 0, 1, 2, 3, 7, 8, 255, 256, 4095, 4096, 65535, 2**16, 2**24, 2**31 - 1, 2**31,
                2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**40 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
SPECIAL_STRS = ["", "a", "0" * 16, "f" * 16, "F" * 16, "0" * 64, "0" * 63, "g" * 64, "-000000000000001", "+00000000000000f",
                " 000000000000001", "000000000000001 ", "0_00000000000001", "0x0000000000000f", "０" * 16, "../x", "a/b",
                ".hidden", "x" * 3000, "\x00", "é", "none", "all", "pco", "zstd", "ctx", "raw", "abs", "rel",
                "delta", "anchor", "bfloat16", "float32", "float8_e4m3fn", "int8", "bool", "complex64",
                "engine-ext-delta", "keep", "wait", "abort", "LATEST", "v00000001.json", "NaN"]
DEPTHS = [3, 50, 900, 1000, 2000, 20000]


def scalars() -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.sampled_from(SPECIAL_INTS), st.integers(),
                     st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 0.5]),
                     st.sampled_from(SPECIAL_STRS), st.text(max_size=8))


def hostile_values() -> st.SearchStrategy:
    small = scalars()
    return st.one_of(small, small, small, st.lists(small, max_size=4), st.dictionaries(st.text(max_size=6), small, max_size=3),
                     st.builds(Deep, st.sampled_from(DEPTHS), st.sampled_from(["[", "{"])))


def _copy(v):
    """A copy of a JSON document (dicts and lists copied, leaves shared): deepcopy's memo is slow."""
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_copy(x) for x in v]
    return v


def _paths(doc, path=()):
    """Every (parent, key) in a JSON document, containers and leaves."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield doc, k
            yield from _paths(v)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield doc, i
            yield from _paths(v)


def _tweak(draw, v):
    """A near miss of ``v``: off by a little, of another type, cut short."""
    if isinstance(v, bool):
        return draw(st.sampled_from([not v, int(v), str(v).lower(), None]))
    if isinstance(v, int):
        return draw(st.sampled_from([v + 1, v - 1, -v, 2 * v, v + 2**32, v * 2**20, float(v), str(v), [v], v ^ 1]))
    if isinstance(v, float):
        return draw(st.sampled_from([v + 1, -v, math.nan, math.inf, int(v) if math.isfinite(v) else 0, str(v)]))
    if isinstance(v, str):
        if not v:
            return draw(st.sampled_from(["x", None, 0]))
        i = draw(st.integers(0, len(v) - 1))
        return draw(st.sampled_from([v[:i], v[:i] + "g" + v[i + 1:], v[:i] + "0" + v[i + 1:], v.upper(), v + v[-1],
                                     " " + v, v + "\n", v.encode().hex()]))
    if isinstance(v, list):
        if not v:
            return draw(st.sampled_from([[None], [0], {}, None]))
        i = draw(st.integers(0, len(v) - 1))
        return draw(st.sampled_from([v[:i], v[:i] + v[i + 1:], v + [v[i]], v[::-1], v * 2, [v], {str(k): x for k, x in enumerate(v)}]))
    if isinstance(v, dict):
        if not v:
            return draw(st.sampled_from([[], None, {"": 0}]))
        k = draw(st.sampled_from(sorted(v, key=str)))
        return draw(st.sampled_from([{a: b for a, b in v.items() if a != k}, list(v.items()), [v], dict(v, **{k + "_": v[k]})]))
    return draw(hostile_values())


@st.composite
def mutated_doc(draw, doc, max_ops: int = 3, min_ops: int = 0):
    """``doc`` (a JSON document) after up to ``max_ops`` structured mutations: a field set to a
    hostile value, nudged, deleted, duplicated, renamed, an unknown field added. Returns the
    document and how many mutations were applied."""
    doc = _copy(doc)
    n = draw(st.integers(min_ops, max_ops))
    for _ in range(n):
        paths = list(_paths(doc))
        if not paths:
            doc = draw(hostile_values())
            continue
        parent, key = paths[draw(st.integers(0, len(paths) - 1))]
        op = draw(st.sampled_from(["set", "tweak", "tweak", "delete", "add", "dup"]))
        if op == "set":
            parent[key] = draw(hostile_values())
        elif op == "tweak":
            parent[key] = _tweak(draw, parent[key])
        elif op == "delete":
            del parent[key]
        elif op == "add":
            if isinstance(parent, dict):
                parent[draw(st.sampled_from(["extra", "x", "grid", "chunks", "step_tables", "mode", "signed"]))] = draw(hostile_values())
            else:
                parent.insert(key, draw(hostile_values()))
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, _copy(parent[key]))
    return doc, n


def dump(doc) -> bytes:
    """JSON bytes of ``doc``, with :class:`Deep` values written nested (and NaN, as Python writes it)."""
    deep: dict[str, Deep] = {}

    def walk(v):
        if isinstance(v, Deep):
            token = f"\x00deep{len(deep)}\x00"
            deep[token] = v
            return token
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(doc))
    for token, d in deep.items():
        opener, closer = (d.kind, "]") if d.kind == "[" else ('{"a":', "}")
        text = text.replace(json.dumps(token), opener * d.depth + "0" + closer * d.depth)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def mutated_bytes(draw, data: bytes, max_ops: int = 2, min_ops: int = 0, pool: tuple = ()):
    """``data`` after byte-level mutations: bit flips, bytes set, spans deleted, inserted or
    repeated, a truncation, a splice from ``pool`` (other real streams)."""
    b = bytearray(data)
    n = draw(st.integers(min_ops, max_ops))
    for _ in range(n):
        op = draw(st.sampled_from(["flip", "flip", "set", "delete", "insert", "truncate", "repeat", "splice", "extend"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and b:
            b[i] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, ord("["), ord('"'), ord("{"), ord("9")]))
        elif op == "delete":
            del b[i:i + draw(st.integers(1, 16))]
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del b[i:]
        elif op == "repeat":
            b[i:i] = b[i:i + draw(st.integers(1, 64))]
        elif op == "splice" and pool:
            other = draw(st.sampled_from(pool))
            j = draw(st.integers(0, max(0, len(other) - 1)))
            b[i:i + draw(st.integers(1, 64))] = other[j:j + draw(st.integers(1, 64))]
        elif op == "extend":
            b += draw(st.binary(min_size=1, max_size=32))
    return bytes(b), n


# --------------------------------------------------------------------------- the corpus: a real published store

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
    manifests: dict  # name -> raw bytes ("ctx/v1", "ctx/v0", "plain/v1", "plain/v0")
    blobs: dict  # key -> bytes (every run's, keys are unique by content)
    scratch: Path  # a store (directory) the targets write into, holding copies of every blob
    expected: dict  # name -> (shape, dtype name): the served model

    def manifest_doc(self, name: str) -> dict:
        return json.loads(self.manifests[name])


@functools.lru_cache(maxsize=1)
def corpus() -> Corpus:
    from engine_ext.trainer.publisher import DeltaPublisher

    root = Path(tempfile.mkdtemp(prefix="engine_ext_fuzz_"))
    generate_key(root / "publisher.key")
    generate_key(root / "other.key")
    a, b = states()
    runs = {"ctx": dict(chunk_min_cell=1024), "plain": dict(chunk_min_cell=None)}
    for run, kw in runs.items():
        with settings.override(context_coder=run == "ctx"):
            with DeltaPublisher(str(root / run), anchor_every=0, signing_key=str(root / "publisher.key"), **kw) as pub:
                pub.publish(a)
                pub.publish(b)
    manifests, blobs = {}, {}
    scratch = root / "scratch"
    scratch.mkdir()
    for run in runs:
        for v, key in ((0, "v00000000.anchor.json"), (1, "v00000001.json")):
            manifests[f"{run}/v{v}"] = (root / run / key).read_bytes()
        for p in (root / run).iterdir():
            if p.name.endswith((".bin", ".safetensors")):
                blobs[p.name] = p.read_bytes()
                (scratch / p.name).write_bytes(blobs[p.name])
    expected = {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in a.items()}
    c = Corpus(root, a, b, str(root / "publisher.key"), str(root / "other.key"), manifests, blobs, scratch, expected)
    _warm_up(c)
    return c


def _warm_up(c: Corpus) -> None:
    """Decode every genuine version once: numba loads its kernels and the pools start their threads
    here, not inside the first measured example."""
    store = LocalStore(str(c.scratch))
    for raw in c.manifests.values():
        m = Manifest.from_json(raw)
        reader.fetch_selected(store, m, None, workers=2, bases=reader.TensorBases(c.a))
    for p in v2_pool():
        cc.decode(p["dtype"], p["shape"], p["box"], p["e"].pos, p["e"].val, p["pos"].size,
                  lambda sub, p=p: cb.box_of(p["base"], p["shape"] if p["box"] is None else
                                             tuple(b - a for a, b in zip(*p["box"])), sub), p["tables"])


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


# --------------------------------------------------------------------------- spec checks of accepted input


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


MANIFEST_KEYS = {"kind", "model", "version", "fingerprint", "base_version", "base_fingerprint", "anchor_version",
                 "base_manifests", "created_unix", "blobs", "tensors", "step_tables", "format", "format_version"}
TENSOR_KEYS = {"name", "dtype", "shape", "nnz", "fingerprint", "base_fingerprint", "blob", "offset", "sha256",
               "positions", "values", "grid", "chunks"}
CHUNK_KEYS = {"cell", "nnz", "blob", "offset", "sha256", "positions", "values"}


def manifest_spec_errors(doc) -> list[str]:
    """What in an accepted manifest's JSON breaks docs/FORMAT.md (independent of the parser; the
    rules the parser's own ``validate`` states are re-checked only where cheap)."""
    out = []
    if not isinstance(doc, dict):
        return ["not an object"]
    if not set(doc) <= MANIFEST_KEYS:
        out.append(f"unknown fields {sorted(set(doc) - MANIFEST_KEYS)}")
    kind, version = doc.get("kind"), doc.get("version")
    if kind not in (DELTA, ANCHOR):
        out.append("kind")
    if not isinstance(doc.get("model"), str):
        out.append("model is not a string")
    if not _int(version) or version < 0:
        out.append("version")
    if not (isinstance(doc.get("fingerprint"), str) and HEX16.fullmatch(doc["fingerprint"])):
        out.append("fingerprint is not 16 lower-case hex digits")
    bfp = doc.get("base_fingerprint")
    if kind == DELTA and not (isinstance(bfp, str) and HEX16.fullmatch(bfp)):
        out.append("base_fingerprint of a delta")
    if kind == ANCHOR and bfp is not None and not (isinstance(bfp, str) and HEX16.fullmatch(bfp)):
        out.append("base_fingerprint of an anchor is neither null nor a fingerprint")
    av = doc.get("anchor_version")
    if av is not None and not (_int(av) and 0 <= av <= (version if _int(version) else av)):
        out.append("anchor_version is neither null nor a version at or before this one")
    if "created_unix" in doc and not _num(doc["created_unix"]):
        out.append("created_unix is not a number")
    if doc.get("format") != FORMAT or not _int(doc.get("format_version")) or doc["format_version"] not in READABLE_VERSIONS:
        out.append("format")
    for b in doc.get("blobs", []):
        if not isinstance(b, dict) or set(b) != {"key", "size", "sha256"}:
            out.append("a blob is not an object of key, size, sha256")
    tensors = doc.get("tensors")
    if not isinstance(tensors, list):
        return out + ["tensors"]
    for t in tensors:
        if not isinstance(t, dict) or not set(t) <= TENSOR_KEYS:
            out.append("a tensor is not an object of the known fields")
            continue
        if not (isinstance(t.get("fingerprint"), str) and HEX16.fullmatch(t["fingerprint"])):
            out.append(f"tensor fingerprint {str(t.get('fingerprint'))[:40]!r}")
        tb = t.get("base_fingerprint")
        if (kind == DELTA or tb is not None) and not (isinstance(tb, str) and HEX16.fullmatch(tb)):
            out.append(f"tensor base_fingerprint {str(tb)[:40]!r}")
        for seg in ("positions", "values"):
            s = t.get(seg, {})
            if not isinstance(s, dict) or not set(s) <= {"coder", "length", "mode"}:
                out.append(f"tensor {seg} is not an object of coder, length, mode")
        for c in t.get("chunks") or []:
            if not isinstance(c, dict) or not set(c) <= CHUNK_KEYS:
                out.append("a chunk is not an object of the known fields")
            else:
                for seg in ("positions", "values"):
                    if not isinstance(c.get(seg), dict) or not set(c[seg]) <= {"coder", "length", "mode"}:
                        out.append(f"chunk {seg} is not an object of coder, length, mode")
    return out


def check_decoded(m: Manifest, decoded: list, selection) -> None:
    """What a rank hands its apply: per tensor, sorted unique positions inside the tensor (inside the
    selected cells), as many values of the tensor's width, never more changes than declared."""
    entries = {t.name: t for t in m.tensors}
    seen: dict[str, int] = {}
    for td in decoded:
        t = entries.get(td.name)
        if t is None or (selection is not None and td.name not in selection):
            raise Violation(f"decoded a tensor nobody asked for: {td.name!r}")
        if td.dtype is not BY_NAME[t.dtype] or tuple(td.shape) != tuple(t.shape) or td.mode not in ("abs", "rel"):
            raise Violation(f"{td.name}: decoded as {td.dtype.name}{td.shape} {td.mode}")
        if td.values.dtype != td.dtype.int_view or td.values.dim() != 1:
            raise Violation(f"{td.name}: values of {td.values.dtype}")
        if td.positions is None:
            if td.values.numel() != t.numel or t.nnz != t.numel:
                raise Violation(f"{td.name}: dense values of the wrong count")
            seen[td.name] = seen.get(td.name, 0) + t.numel
            continue
        p = td.positions
        if p.dtype != torch.int64 or p.numel() != td.values.numel():
            raise Violation(f"{td.name}: {p.numel()} positions, {td.values.numel()} values")
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= t.numel or bool((p[1:] <= p[:-1]).any())):
            raise Violation(f"{td.name}: positions not sorted, unique and inside the tensor")
        if t.chunks is not None and selection is not None and selection.get(td.name) is not None and p.numel():
            boxes = t.boxes()
            allowed = [boxes[c.cell] for c in t.chunks if c.cell in selection[td.name]]
            coords = np.stack(np.unravel_index(p.numpy(), tuple(t.shape)), axis=1)
            inside = np.zeros(len(coords), bool)
            for lo, hi in allowed:
                inside |= np.all((coords >= np.array(lo)) & (coords < np.array(hi)), axis=1)
            if not inside.all():
                raise Violation(f"{td.name}: positions outside the selected cells")
        seen[td.name] = seen.get(td.name, 0) + p.numel()
    for name, n in seen.items():
        if n > entries[name].nnz:
            raise Violation(f"{name}: {n} changes decoded, the manifest declares {entries[name].nnz}")


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """One entry point: ``strategy`` draws an input, ``check(input)`` runs it through the entry point
    under :func:`judge` and raises :class:`Violation` on any outcome the contract does not allow."""

    name: str
    entry: str  # the entry point(s), for the reports
    strategy: Callable[[], st.SearchStrategy]
    check: Callable[[Any], None]
    examples: int  # CI budget


TARGETS: dict[str, Target] = {}


def target(name: str, entry: str, examples: int):
    def register(fn):
        strategy = globals()[f"_{name}_inputs"]
        TARGETS[name] = Target(name, entry, strategy, fn, examples)
        return fn

    return register


# ---- manifest JSON, through what a driver and a rank do with it --------------------------


@dataclass
class ManifestCase:
    source: str  # which manifest of the corpus
    doc_ops: int
    doc: Any
    byte_ops: int
    raw: bytes | None  # after byte mutations (None: dump(doc))
    reseal: bool  # recompute model fingerprints and hashes after the mutations (a signer that lies)
    blob_edits: list  # (blob index, part index, offset in part, xor byte) in-place edits of a part's bytes
    select: int  # 0: every tensor; else a bitmask of the tensors and cells a rank holds
    bases: str  # "right", "wrong", "none"

    @property
    def pristine(self) -> bool:
        return not (self.doc_ops or self.byte_ops or self.blob_edits)


@st.composite
def _manifest_inputs(draw):
    c = corpus()
    source = draw(st.sampled_from(sorted(c.manifests)))
    doc, k = draw(consistent_mutations(c.manifest_doc(source)))
    doc, n = draw(mutated_doc(doc, max_ops=draw(st.sampled_from([0, 1, 1, 2, 3]))))
    n += k
    byte_ops, raw = 0, None
    if draw(st.integers(0, 9)) == 0:
        raw, byte_ops = draw(mutated_bytes(dump(doc), max_ops=2, min_ops=1))
    edits = []
    if draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            edits.append((draw(st.integers(0, 2**16)), draw(st.integers(0, 2**16)), draw(st.integers(1, 255))))
    return ManifestCase(source, n, doc, byte_ops, raw, draw(st.booleans()), edits, draw(st.integers(0, 2**12)),
                        draw(st.sampled_from(["right", "right", "right", "wrong", "none"])))


@st.composite
def consistent_mutations(draw, doc: dict):
    """Mutations of a manifest's parts that its own rules cannot see, so that they reach the
    decoders through the whole path: a declared count off (and the tensor's total with it), the
    boundary between positions and values bytes moved, coders or the value mode swapped, cells
    renumbered, a grid's cut moved, a step table replaced by another valid one. Returns the document and how many were applied."""
    n = draw(st.integers(0, 3))
    tensors = [t for t in doc["tensors"] if t["nnz"]]
    for _ in range(n):
        t = draw(st.sampled_from(tensors))
        e = draw(st.sampled_from(t["chunks"])) if t.get("chunks") else t
        op = draw(st.sampled_from(["nnz", "nnz", "split", "coder", "mode", "cell", "grid", "tables"]))
        if op == "nnz":
            d = draw(st.sampled_from([-2, -1, 1, 2, 64, 2**20, -e["nnz"] + 1]))
            e["nnz"] += d
            if e is not t:
                t["nnz"] += d
        elif op == "split":
            d = draw(st.integers(-8, 8))
            e["positions"]["length"] += d
            e["values"]["length"] -= d
        elif op == "coder":
            pc, vc = draw(st.sampled_from([("pco", "pco"), ("zstd", "zstd"), ("pco", "zstd"), ("zstd", "raw"),
                                           ("pco", "raw"), ("ctx", "ctx"), ("all", "raw")]))
            e["positions"]["coder"], e["values"]["coder"] = pc, vc
        elif op == "mode":
            e["values"]["mode"] = "abs" if e["values"]["mode"] == "rel" else "rel"
        elif op == "cell" and t.get("chunks"):
            a, b = draw(st.sampled_from(t["chunks"])), draw(st.sampled_from(t["chunks"]))
            a["cell"], b["cell"] = b["cell"], a["cell"]
        elif op == "grid" and t.get("grid"):  # an inner cut moved: the cells' boxes change under their bytes
            cuts = draw(st.sampled_from(t["grid"]))
            if len(cuts) > 2:
                i = draw(st.integers(1, len(cuts) - 2))
                cuts[i] = max(cuts[i - 1] + 1, min(cuts[i + 1] - 1, cuts[i] + draw(st.sampled_from([-3, -1, 1, 3]))))
        elif op == "tables" and doc.get("step_tables"):  # other valid step tables: the steps decode otherwise
            dtype = draw(st.sampled_from(sorted(doc["step_tables"])))
            tables = doc["step_tables"][dtype]
            i = draw(st.integers(0, len(tables) - 1))
            tables[i] = bytes(draw(st.lists(st.integers(1, 255), min_size=len(tables[i]) // 2,
                                            max_size=len(tables[i]) // 2))).hex()
    return doc, n


def _parts_of(doc) -> list[dict]:
    """The entries (tensors or chunks) of a manifest document that carry bytes."""
    out = []
    tensors = doc.get("tensors") if isinstance(doc, dict) else None
    for t in tensors if isinstance(tensors, list) else []:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get("chunks"), list):
            out += [ch for ch in t["chunks"] if isinstance(ch, dict)]
        elif _int(t.get("blob")):
            out.append(t)
    return out


def _segment_len(e: dict) -> int:
    try:
        return int(e["positions"]["length"]) + int(e["values"]["length"])
    except (KeyError, TypeError, ValueError):
        return 0


def _materialize(case: ManifestCase, c: Corpus) -> tuple[bytes, set]:
    """The manifest bytes (the blobs it names written to the scratch store), and the bytes changed
    behind the manifest's back, as (blob key, offset): unless resealed, its hashes refuse any part
    that covers one."""
    doc = _copy(case.doc)
    blobs_doc = doc.get("blobs") if isinstance(doc, dict) else None
    written, tampered = {}, set()
    if case.blob_edits and isinstance(blobs_doc, list) and blobs_doc:
        parts = _parts_of(doc)
        for bi, pi, xor in case.blob_edits:
            if not parts:
                break
            e = parts[pi % len(parts)]
            b = e.get("blob")
            if not (_int(b) and 0 <= b < len(blobs_doc) and isinstance(blobs_doc[b], dict)):
                continue
            key = blobs_doc[b].get("key")
            if not isinstance(key, str) or key not in c.blobs:
                continue
            data = bytearray(written.get(key, c.blobs[key]))
            off, n = e.get("offset"), _segment_len(e)
            if not (_int(off) and n > 0 and 0 <= off and off + n <= len(data)):
                continue
            data[off + bi % n] ^= xor
            written[key] = bytes(data)
            if case.reseal:
                e["sha256"] = hashlib.sha256(data[off:off + n]).hexdigest()
        for key, data in written.items():
            fz = "fz." + key
            changed = np.flatnonzero(np.frombuffer(data, np.uint8) != np.frombuffer(c.blobs[key], np.uint8))
            tampered |= {(fz, int(i)) for i in changed}  # two edits of one byte may cancel
            for bd in blobs_doc:
                if isinstance(bd, dict) and bd.get("key") == key:
                    bd["key"] = fz
                    if case.reseal:
                        bd["sha256"] = hashlib.sha256(data).hexdigest()
                        bd["size"] = len(data)
            (c.scratch / fz).write_bytes(data)
    if case.reseal and isinstance(doc, dict) and isinstance(doc.get("tensors"), list):
        _reseal_fingerprints(doc)
    raw = case.raw if case.raw is not None else dump(doc)
    return raw, set() if case.reseal else tampered


def _reseal_fingerprints(doc: dict) -> None:
    """Model fingerprints recomputed from the (mutated) tensor list, where it parses: mutations then
    reach past the model-fingerprint check, as a lying signer's would."""
    try:
        fps = [(t["name"], fpr.parse(t["fingerprint"])) for t in doc["tensors"]]
        doc["fingerprint"] = fpr.fmt(fpr.model_fingerprint(fps))
        if doc.get("kind") == DELTA:
            base = [(t["name"], fpr.parse(t["base_fingerprint"])) for t in doc["tensors"]]
            doc["base_fingerprint"] = fpr.fmt(fpr.model_fingerprint(base))
    except Exception:  # noqa: BLE001 - a tensor list too broken to reseal is left as it is
        pass


def _selection(m: Manifest, mask: int):
    if mask == 0:
        return None
    sel, bit = {}, 0
    for t in m.tensors:
        bit += 1
        if not mask >> (bit % 12) & 1:
            continue
        if t.chunks is None:
            sel[t.name] = None
        else:
            sel[t.name] = {i for i in range(len(t.boxes())) if mask >> ((bit + i) % 12) & 1}
    return sel


@target("manifest", "Manifest.from_json -> check_expected, check_decode_budget -> fetch_selected (a rank's fetch and decode, "
        "v1 and v2 streams, cells, anchors) from a LocalStore", examples=600)
def check_manifest(case: ManifestCase) -> None:
    c = corpus()
    raw, tampered = _materialize(case, c)
    store = LocalStore(str(c.scratch))
    bases = {"right": reader.TensorBases(c.a), "wrong": reader.TensorBases(c.b), "none": None}[case.bases]
    model_bytes = sum(t.numel() * t.element_size() for t in c.a.values())
    state = {}

    def run():
        m = Manifest.from_json(raw)
        errors = manifest_spec_errors(json.loads(raw))
        if errors:
            raise Violation(f"accepted a manifest that breaks the spec: {errors[:3]}")
        state["m"] = m
        reader.check_expected(m, c.expected, "fuzz")
        reader.check_decode_budget(m, 8 * model_bytes)
        sel = _selection(m, case.select)
        decoded, _ = reader.fetch_selected(store, m, sel, workers=2, bases=bases)
        check_decoded(m, decoded, sel)
        return m, sel, decoded

    out, exc = judge(run, (ManifestError, IntegrityError, BaseMismatchError, NotFoundError), 5.0,
                     64 * len(raw) + (48 << 20), "manifest")
    if case.pristine and case.bases == "right":
        if exc is not None:
            raise Violation(f"a genuine manifest refused: {type(exc).__name__}: {exc}")
        m, sel, decoded = out
        _check_round_trip(m, decoded, sel, c)
    if tampered and exc is None:
        m, sel, decoded = out
        for p in reader._parts(m, sel):
            key = m.blobs[p.blob].key
            if any(k == key and p.offset <= o < p.offset + p.length for k, o in tampered):
                raise Violation(f"tensor {p.tensor.name!r}: bytes changed behind the manifest's hashes were decoded")


def _check_round_trip(m: Manifest, decoded: list, sel, c: Corpus) -> None:
    """A genuine version decodes to exactly its weights (where a rank holds whole tensors)."""
    want = c.b if m.version == 1 else c.a
    by_name: dict[str, list] = {}
    for td in decoded:
        by_name.setdefault(td.name, []).append(td)
    for name, tds in by_name.items():
        if sel is not None and sel.get(name) is not None:
            continue  # some cells only
        out = None if m.kind == ANCHOR else c.a[name]
        for td in tds:
            out = apply_tensor(out, td, check=False)
        if not torch.equal(as_bits(out).reshape(-1), as_bits(want[name]).reshape(-1)):
            raise Violation(f"{name}: a genuine version decoded to other bits")


# ---- signatures: read_link on hostile .sig objects -----------------------------------------


@dataclass
class SigCase:
    trust: str
    sig: bytes | None  # the .sig object (None: absent)
    manifest_ops: int
    raw: bytes


@st.composite
def _signature_inputs(draw):
    c = corpus()
    raw = c.manifests[draw(st.sampled_from(["ctx/v1", "plain/v0"]))]
    other_raw = c.manifests["plain/v1"]
    manifest_ops = 0
    if draw(st.integers(0, 4)) == 0:
        raw, manifest_ops = draw(mutated_bytes(raw, max_ops=2, min_ops=1))
    trust = draw(st.sampled_from(["one", "one", "two", "one_or_unsigned", "unsigned", "none"]))
    pub, oth = signer(c.key), signer(c.other)
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        who = draw(st.sampled_from(["pub", "pub", "other", "replay", "junk"]))
        if who == "pub":
            entries += pub.signatures(raw)
        elif who == "other":
            entries += oth.signatures(raw)
        elif who == "replay":  # a genuine signature of another manifest
            entries += pub.signatures(other_raw)
        else:
            entries.append({"keyid": key_id(b"\x00" * 32), "sig": "00" * 64})
    doc = {"signatures": entries}
    if draw(st.booleans()):
        doc, _ = draw(mutated_doc(doc, max_ops=3, min_ops=1))
    sig = dump(doc)
    choice = draw(st.integers(0, 9))
    if choice == 0:
        sig = None
    elif choice == 1:
        sig, _ = draw(mutated_bytes(sig, max_ops=3, min_ops=1))
    elif choice == 2:
        sig = sig[:1] + b" " * MAX_SIGNATURE_BYTES + sig[1:]  # over the size limit
    return SigCase(trust, sig, manifest_ops, raw)


def _reference_signed(t: Trust, raw: bytes, sig: bytes | None) -> tuple[str, int]:
    """What the signature rules (docs/SECURITY.md, FORMAT.md "Signatures") say of ``raw`` with the
    ``.sig`` object ``sig``: ("ok", signed keys), ("unsigned", 0), ("refused", 0), ("too_large", 0);
    computed with the cryptography library directly."""
    from cryptography.exceptions import InvalidSignature

    if not t.keys:
        return ("unsigned", 0) if t.allow_unsigned else ("refused", 0)
    if sig is not None and len(sig) > MAX_SIGNATURE_BYTES:
        return "too_large", 0
    signatures = None
    if sig is not None:
        try:
            doc = json.loads(sig)
            signatures = doc["signatures"]
        except Exception:  # noqa: BLE001
            return "refused", 0
        if not isinstance(signatures, list):
            return "refused", 0
    good = set()
    for s in signatures or []:
        if isinstance(s, dict) and isinstance(s.get("keyid"), str) and isinstance(s.get("sig"), str) and s["keyid"] in t.keys:
            try:
                t.keys[s["keyid"]].verify(bytes.fromhex(s["sig"]), raw)
                good.add(s["keyid"])
            except (InvalidSignature, ValueError):
                pass
    if len(good) >= t.threshold:
        return "ok", len(good)
    if not signatures and t.allow_unsigned:
        return "unsigned", 0
    return "refused", 0


@target("signature", "reader.read_link (Trust.verify_detached on the .sig object, then Manifest.from_json)", examples=300)
def check_signature(case: SigCase) -> None:
    c = corpus()
    d = c.root / "sig"
    d.mkdir(exist_ok=True)
    (d / "v00000001.json").write_bytes(case.raw)
    sig_path = d / "v00000001.json.sig"
    if case.sig is None:
        sig_path.unlink(missing_ok=True)
    else:
        sig_path.write_bytes(case.sig)
    t = trust_of(c, case.trust)
    want, n = _reference_signed(t, case.raw, case.sig)
    link, exc = judge(lambda: reader.read_link(LocalStore(str(d)), "v00000001.json", t),
                      (SignatureError, ManifestError, SourceError), 2.0,
                      MAX_MANIFEST_BYTES + MAX_SIGNATURE_BYTES + 32 * len(case.raw) + (16 << 20), "signature")
    if want == "too_large":
        if not (isinstance(exc, SourceError) and not isinstance(exc, NotFoundError)):
            raise Violation(f"an oversized .sig object gave {exc!r:.200}")
        return
    if want == "refused":
        if not isinstance(exc, SignatureError):
            raise Violation(f"a manifest without {t.threshold} valid trusted signature(s) gave {exc!r:.200}"
                            + ("" if exc else ": ACCEPTED"))
        return
    if isinstance(exc, SignatureError):
        raise Violation(f"signatures that verify were refused: {exc}")
    if exc is None and link.signed != n:
        raise Violation(f"read_link counts {link.signed} signatures, the reference {n}")
    if case.manifest_ops == 0 and exc is not None:
        raise Violation(f"a genuine signed manifest refused: {exc!r:.200}")


# ---- LATEST: Latest.from_json and read_latest ---------------------------------------------


@dataclass
class LatestCase:
    raw: bytes
    trust: str
    allow_expired: bool
    ops: int


@st.composite
def _latest_inputs(draw):
    c = corpus()
    raw_manifest = c.manifests["ctx/v1"]
    m = json.loads(raw_manifest)
    now = NOW
    signed = {"version": 1, "manifest": "v00000001.json", "fingerprint": m["fingerprint"], "anchor_version": 0,
              "sha256": hashlib.sha256(raw_manifest).hexdigest(),
              "expires_unix": draw(st.sampled_from([now + 3600, now - 3600, now + 1e9]))}
    signed, ops = draw(mutated_doc(signed, max_ops=3))
    sigs = []
    how = draw(st.sampled_from(["resign", "resign", "keep", "other", "none"]))
    try:
        lt = Latest(**signed)
        canon = lt.signed_bytes()
    except Exception:  # noqa: BLE001 - fields a Latest cannot hold: sign their canonical JSON anyway
        canon = json.dumps(signed, sort_keys=True, separators=(",", ":"), default=str).encode()
    if how == "resign":  # a signer that signs whatever it is given: field checks must still hold
        sigs = signer(c.key).signatures(canon)
    elif how == "keep":  # the genuine pointer's signature
        sigs = signer(c.key).signatures(Latest(1, "v00000001.json", m["fingerprint"], 0,
                                               hashlib.sha256(raw_manifest).hexdigest(), now + 3600).signed_bytes())
    elif how == "other":
        sigs = signer(c.other).signatures(canon)
    outer = {"signed": signed, "signatures": sigs}
    form = draw(st.integers(0, 9))
    if form == 0:
        outer = signed  # a format-1 pointer
    elif form == 1:
        outer, n = draw(mutated_doc(outer, max_ops=2, min_ops=1))
        ops += n
    raw = dump(outer)
    if draw(st.integers(0, 7)) == 0:
        raw, n = draw(mutated_bytes(raw, max_ops=2, min_ops=1))
        ops += n
    return LatestCase(raw, draw(st.sampled_from(["one", "one", "two", "one_or_unsigned", "unsigned"])), draw(st.booleans()), ops)


def latest_spec_errors(lt: Latest) -> list[str]:
    out = []
    if not _int(lt.version) or lt.version < 0:
        out.append("version")
    if not (isinstance(lt.manifest, str) and KEY.fullmatch(lt.manifest) and not lt.manifest.startswith(".")):
        out.append("manifest key")
    if not (isinstance(lt.fingerprint, str) and HEX16.fullmatch(lt.fingerprint)):
        out.append(f"fingerprint {str(lt.fingerprint)[:40]!r}")
    if lt.anchor_version is not None and not (_int(lt.anchor_version) and 0 <= lt.anchor_version <= lt.version):
        out.append(f"anchor_version {str(lt.anchor_version)[:40]!r}")
    if lt.sha256 is not None and not (isinstance(lt.sha256, str) and SHA.fullmatch(lt.sha256)):
        out.append("sha256")
    if lt.expires_unix is not None and not (_num(lt.expires_unix) and math.isfinite(lt.expires_unix)):
        out.append(f"expires_unix {lt.expires_unix!r:.40}")
    return out


@target("latest", "Latest.from_json and reader.read_latest (signature, expiry, binding)", examples=300)
def check_latest(case: LatestCase) -> None:
    c = corpus()
    d = c.root / "latest"
    d.mkdir(exist_ok=True)
    (d / "LATEST").write_bytes(case.raw)
    t = trust_of(c, case.trust)
    parsed, exc = judge(lambda: Latest.from_json(case.raw), (ManifestError,), 1.0, 64 * len(case.raw) + (8 << 20),
                        "Latest.from_json")
    if exc is None:
        lt, sigs = parsed
        errors = latest_spec_errors(lt)
        if errors:
            raise Violation(f"accepted a LATEST that breaks the spec: {errors}")
    lt2, exc2 = judge(lambda: reader.read_latest(LocalStore(str(d)), t, case.allow_expired),
                      (ManifestError, SignatureError, SourceError), 2.0, 64 * len(case.raw) + (8 << 20), "read_latest")
    if (exc is None) != (exc2 is None) and not isinstance(exc2, SignatureError):
        raise Violation(f"read_latest and Latest.from_json disagree: {exc!r:.100} / {exc2!r:.100}")
    if exc2 is None:
        lt, sigs = parsed
        want, n = _reference_signed(t, lt.signed_bytes(), json.dumps({"signatures": sigs}).encode())
        if want == "refused":
            raise Violation("read_latest accepted a pointer without the trusted signatures")
        if want == "ok":
            if lt.sha256 is None:
                raise Violation("read_latest accepted a signed pointer that does not name its manifest by SHA-256")
            if lt.expires_unix is None or (lt.expires_unix < time.time() and not case.allow_expired):
                raise Violation("read_latest accepted an expired pointer")


# ---- grids of cells -------------------------------------------------------------------------


@st.composite
def _grid_inputs(draw):
    shape = draw(st.lists(st.integers(0, 70), min_size=0, max_size=4))
    how = draw(st.integers(0, 3))
    if how == 0 and shape:
        cuts = chunks.grid(shape, min_cell=draw(st.sampled_from([1, 4, 64])), parts=draw(st.sampled_from([2, 4, 8]))) or []
    elif how == 1:
        cuts = [sorted(set(draw(st.lists(st.integers(0, n), max_size=6))) | {0, n}) for n in shape[:draw(st.integers(0, 3))]]
    else:
        cuts = draw(st.lists(st.lists(st.integers(-2, 80), max_size=6), max_size=3))
    cuts, _ = draw(mutated_doc(cuts, max_ops=draw(st.sampled_from([0, 0, 1, 2]))))
    return cuts, shape


def _reference_valid_cuts(cuts, shape) -> bool:
    if not isinstance(cuts, list) or not 1 <= len(cuts) <= min(2, len(shape)):
        return False
    for d, c in enumerate(cuts):
        if not isinstance(c, list) or not 2 <= len(c) <= 257 or not all(_int(x) for x in c):
            return False
        if c[0] != 0 or c[-1] != shape[d] or any(b <= a for a, b in zip(c, c[1:])):
            return False
    return True


@target("grid", "chunks.valid_cuts, boxes, split/to_local/to_global (format 3 grids of a manifest)", examples=500)
def check_grid(case) -> None:
    cuts, shape = case
    ok, _ = judge(lambda: chunks.valid_cuts(cuts, shape), (), 0.5, 1 << 20, "valid_cuts")
    if ok is not _reference_valid_cuts(cuts, shape):
        raise Violation(f"valid_cuts({str(cuts)[:100]}, {shape}) = {ok}")
    if not ok:
        return
    numel = math.prod(shape)
    boxes = chunks.boxes(cuts, shape)
    if len(boxes) != math.prod(len(c) - 1 for c in cuts) or sum(chunks.box_numel(b) for b in boxes) != numel:
        raise Violation("the cells do not tile the tensor")
    if numel and numel <= 4096:
        pos = np.arange(numel, dtype=np.int64)[::3]
        for cell, idx in chunks.split(pos, shape, cuts):
            local = chunks.to_local(pos[idx], shape, boxes[cell])
            back = chunks.to_global(torch.from_numpy(local), shape, boxes[cell]).numpy()
            if not np.array_equal(back, pos[idx]) or (local < 0).any() or (local >= chunks.box_numel(boxes[cell])).any():
                raise Violation("cell-local positions do not map back")


# ---- v1 streams: codec.decode_positions / decode_values ----------------------------------------


@dataclass
class StreamCase:
    kind: str  # "positions" or "values"
    coder: str
    data: bytes
    nnz: int
    numel: int
    dtype: str
    truth: Any  # the decoded truth when data and counts are as encoded
    pristine: bool


@st.composite
def _v1_streams_inputs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["positions", "values"]))
    nnz = draw(st.sampled_from([0, 1, 2, 3, 17, 100, 1000, 5000]))
    if kind == "positions":
        numel = max(nnz, draw(st.sampled_from([1, 2, 100, 4096, 70_000, 2**32 + 5, 2**40])))
        pos = np.unique(rng.integers(0, numel, size=nnz, dtype=np.int64)) if numel > 4 * nnz else \
            np.sort(rng.choice(numel, size=nnz, replace=False)).astype(np.int64)
        nnz = pos.size
        gaps = np.diff(pos, prepend=np.int64(0)).astype(codec._gap_dtype(numel))
        coder = draw(st.sampled_from(["pco", "zstd", "all"]))
        data = {"pco": lambda: codec._pco(gaps), "zstd": lambda: codec._zstd(gaps.tobytes()), "all": lambda: b""}[coder]()
        if coder == "all":
            nnz = numel = min(numel, 5000)
        truth, dtype = (None if coder == "all" else pos), "int64"
    else:
        dtype = draw(st.sampled_from(sorted(BY_NAME)))
        dt = BY_NAME[dtype]
        vals = rng.integers(-2**(dt.bits - 1), 2**(dt.bits - 1), size=nnz, dtype=np.int64).astype(codec._NP_INT[dt.bits])
        coder = draw(st.sampled_from(["pco", "zstd", "raw"]))
        data = {"pco": lambda: codec._pco(codec._for_pco(vals)), "zstd": lambda: codec._zstd(codec._planes(vals)),
                "raw": lambda: vals.tobytes()}[coder]()
        numel, truth = nnz, vals
    pristine = True
    if draw(st.booleans()):
        data, n = draw(mutated_bytes(data, max_ops=3, min_ops=1))
        pristine = False
    declared = draw(st.sampled_from(["same", "same", "off", "huge", "zero"]))
    if declared != "same":
        pristine = False
        nnz = {"off": max(0, nnz + draw(st.sampled_from([-2, -1, 1, 2]))), "huge": draw(st.sampled_from([2**20, 2**22])),
               "zero": 0}[declared]
    if kind == "positions" and draw(st.integers(0, 5)) == 0:
        pristine = False
        numel = draw(st.sampled_from([max(1, numel // 2), numel + 1, 2**32 + 1, 1]))
    declared_coder = draw(st.sampled_from([coder] * 12 + ["lz4", "none", "ctx", "raw", "all"]))
    return StreamCase(kind, declared_coder, data, nnz, numel, dtype, truth, pristine and declared_coder == coder)


@target("v1_streams", "codec.decode_positions / decode_values (pco, zstd, raw, all)", examples=800)
def check_v1_streams(case: StreamCase) -> None:
    if case.kind == "positions":
        fn = lambda: codec.decode_positions(case.coder, case.data, case.nnz, case.numel)  # noqa: E731
    else:
        fn = lambda: codec.decode_values(case.coder, case.data, case.nnz, BY_NAME[case.dtype])  # noqa: E731
    width = 8 if case.kind == "positions" else BY_NAME[case.dtype].itemsize
    out, exc = judge(fn, (IntegrityError,), 2.0, 3 * case.nnz * max(width, 2) + 8 * len(case.data) + (8 << 20), f"v1 {case.kind}")
    if exc is not None:
        if case.pristine and _expected_coder(case):
            raise Violation(f"a genuine {case.coder} stream refused: {exc}")
        return
    if case.kind == "positions":
        if out is None:
            if case.coder != "all" or case.nnz != case.numel:
                raise Violation("'all' positions accepted for a partial count")
            return
        p = out.numpy()
        if out.dtype != torch.int64 or p.size != case.nnz or (p.size and (p[0] < 0 or p[-1] >= case.numel)) or (np.diff(p) <= 0).any():
            raise Violation(f"positions: {p.size} for {case.nnz} declared, or unsorted / out of range")
    else:
        dt = BY_NAME[case.dtype]
        if out.dtype != dt.int_view or out.numel() != case.nnz:
            raise Violation(f"values: {out.numel()} of {out.dtype} for {case.nnz} {dt.name}")
    if case.pristine and case.truth is not None and _expected_coder(case):
        got = out.numpy()
        if not np.array_equal(got, case.truth):
            raise Violation("a genuine stream decoded to other values")


def _expected_coder(case: StreamCase) -> bool:
    return case.coder in (("pco", "zstd", "all") if case.kind == "positions" else ("pco", "zstd", "raw"))


# ---- v2 streams: context_codec.decode ----------------------------------------------------------


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


@dataclass
class V2Case:
    i: int
    pos: bytes
    val: bytes
    nnz: int
    tables: list
    held: str  # "all", "none", "blocks" (a rank that holds some blocks), "wrong" (another base)
    blocks_mask: int
    pristine: bool


@st.composite
def _v2_streams_inputs(draw):
    pool = v2_pool()
    i = draw(st.integers(0, len(pool) - 1))
    p = pool[i]
    pos, val, pristine = p["e"].pos, p["e"].val, True
    streams = tuple(q["e"].pos for q in pool) + tuple(q["e"].val for q in pool)
    which = draw(st.sampled_from(["none", "pos", "val", "both", "header"]))
    if which in ("pos", "both"):
        pos, _ = draw(mutated_bytes(pos, max_ops=3, min_ops=1, pool=streams))
    if which in ("val", "both"):
        val, _ = draw(mutated_bytes(val, max_ops=3, min_ops=1, pool=streams))
    if which == "header":  # a field of the positions header rewritten (K, policy, edges, counts)
        b = bytearray(pos)
        at = draw(st.integers(2, min(len(b) - 1, 24)))
        b[at] = draw(st.sampled_from([0, 1, 2, 15, 16, 17, 0x1F, 0x20, 0x7F, 0x80, 0xFF]))
        pos = bytes(b)
    pristine = which == "none"
    nnz = p["pos"].size
    if draw(st.integers(0, 5)) == 0:
        nnz = draw(st.sampled_from([0, 1, nnz - 1, nnz + 1, 2**31, 2**40]))
        pristine = False
    tables = p["tables"]
    if draw(st.integers(0, 5)) == 0:
        A = cm.alphabet(p["dtype"])
        tables = [bytes(draw(st.lists(st.integers(1, 255), min_size=A, max_size=A)))
                  for _ in range(draw(st.integers(1, 4)))]
        pristine = False
    held = draw(st.sampled_from(["all", "all", "blocks", "none", "wrong"]))
    return V2Case(i, pos, val, nnz, tables, held, draw(st.integers(0, 2**16)), pristine)


@target("v2_streams", "context_codec.decode (positions header, ranks, steps, the pass over the base; "
        "a rank holding all, some or none of the blocks)", examples=500)
def check_v2_streams(case: V2Case) -> None:
    p = v2_pool()[case.i]
    shape, box, name = p["shape"], p["box"], p["dtype"]
    full = shape if box is None else tuple(b - a for a, b in zip(*box))
    base = p["base"]
    if case.held == "wrong":
        base = base.copy()
        base[::7] ^= base.dtype.type(1 << (8 * base.itemsize - 2))  # other exponents: ranks land elsewhere
    policy_blocks = cb.blocks(shape, box, p["e"].pos[3] if len(p["e"].pos) > 3 else 0)
    held_blocks = {b for b in range(policy_blocks.S) if case.blocks_mask >> (b % 16) & 1}

    def base_of(sub):
        if case.held == "none":
            return None
        if case.held == "blocks":
            whole = tuple(sub[0]) == (0,) * len(full) and tuple(sub[1]) == tuple(full)
            if whole and policy_blocks.S > 1:
                raise PartlyHeldError("some blocks")
            idx = [b for b, bx in enumerate(policy_blocks.boxes) if tuple(bx[0]) == tuple(sub[0]) and tuple(bx[1]) == tuple(sub[1])]
            if idx and idx[0] not in held_blocks:
                return None
        return cb.box_of(base, full, sub)

    out, exc = judge(lambda: cc.decode(name, shape, box, case.pos, case.val, case.nnz, base_of, case.tables),
                     (IntegrityError,), 3.0, 48 * (base.size + min(case.nnz, 10 * base.size)) + 32 * (len(case.pos) + len(case.val)) + (16 << 20),
                     "v2 decode")
    if exc is not None:
        if case.pristine and case.held in ("all", "none", "blocks"):
            raise Violation(f"a genuine context-coded part refused: {exc}")
        return
    pos, steps = out
    n = int(np.prod(full))
    if pos.dtype != np.int64 or pos.size != steps.size or steps.dtype != cm.INT[cm.ITEMSIZE[name]]:
        raise Violation(f"decode gave {pos.size} {pos.dtype} positions and {steps.size} {steps.dtype} steps")
    if pos.size > max(case.nnz, 0) or (pos.size and (pos[0] < 0 or pos[-1] >= n)) or (np.diff(pos) <= 0).any():
        raise Violation("positions beyond the part, unsorted, repeated, or more than declared")
    if (steps == 0).any():
        raise Violation("a zero step decoded")
    if case.pristine:
        if case.held == "all" and not (np.array_equal(pos, p["pos"]) and np.array_equal(steps, p["steps"])):
            raise Violation("a genuine part decoded to other changes")
        if case.held == "none" and pos.size:
            raise Violation("changes decoded without a base")
        if case.held == "blocks":
            keep = np.isin(policy_blocks.block_of(p["pos"]), sorted(held_blocks))
            if not (np.array_equal(pos, p["pos"][keep]) and np.array_equal(steps, p["steps"][keep])):
                raise Violation("the held blocks of a genuine part decoded to other changes")


# ---- v2 positions header: parse_positions_header ------------------------------------------------


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v >= 0x80 else 0))
        v >>= 7
        if not out[-1] & 0x80:
            return bytes(out)


@st.composite
def _v2_header_inputs(draw):
    dtype = draw(st.sampled_from(sorted(cm.EXPONENT) + ["int8", "float64"]))
    numel = draw(st.sampled_from([1, 7, 100, 6144, 2**20, 2**40]))
    nnz = draw(st.integers(0, min(numel, 10_000)))
    K = draw(st.integers(0, 18))
    mask = cm.EXPONENT.get(dtype, (0, 0xFF))[1]
    edges = sorted(draw(st.sets(st.integers(0, mask + 2), min_size=max(0, K - 1), max_size=max(0, K - 1))))
    pops = draw(st.lists(st.integers(0, numel), min_size=K, max_size=K))
    if pops and draw(st.booleans()):
        pops[-1] = max(0, numel - sum(pops[:-1]))
    totals = [min(p, draw(st.integers(0, nnz))) for p in pops]
    if totals and draw(st.booleans()):
        totals[-1] = max(0, nnz - sum(totals[:-1]))
    head = b"X2" + bytes([K % 256, draw(st.integers(0, 40))]) + bytes(e % 256 for e in edges)
    head += b"".join(_varint(v) for v in pops + totals)
    if draw(st.integers(0, 5)) == 0:
        head += b"\xff" * draw(st.integers(1, 12)) + b"\x01"  # an overlong varint
    head += draw(st.binary(max_size=16))
    head, _ = draw(mutated_bytes(head, max_ops=draw(st.sampled_from([0, 0, 1, 2]))))
    return dtype, head, nnz, numel


@target("v2_header", "context_codec.parse_positions_header (classes, edges, populations, counts)", examples=500)
def check_v2_header(case) -> None:
    dtype, head, nnz, numel = case
    h, exc = judge(lambda: cc.parse_positions_header(head, nnz, numel, dtype), (IntegrityError,), 0.5, 4 << 20, "v2 header")
    if exc is None:
        mask = cm.EXPONENT[dtype][1]
        if not (1 <= h.K <= cc.MAX_CLASSES and len(h.edges) == h.K - 1 and all(0 < e <= mask for e in h.edges)
                and all(a < b for a, b in zip(h.edges, h.edges[1:])) and int(h.pops.sum()) == numel
                and int(h.totals.sum()) == nnz and (h.totals <= h.pops).all() and (h.totals >= 0).all()
                and h.policy <= cb.MAX_POLICY):
            raise Violation(f"accepted an inconsistent header: K={h.K} edges={h.edges} pops={h.pops} totals={h.totals}")


# ---- the safetensors header (anchor blobs, checkpoints) -------------------------------------------


@functools.lru_cache(maxsize=1)
def safetensors_sample() -> bytes:
    c = corpus()
    key = next(k for k in c.blobs if k.endswith(".safetensors"))
    return c.blobs[key]


@st.composite
def _safetensors_inputs(draw):
    data = safetensors_sample()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    rest = data[8 + n:]
    how = draw(st.sampled_from(["doc", "doc", "length", "bytes", "short"]))
    if how == "doc":
        header, _ = draw(mutated_doc(header, max_ops=3, min_ops=1))
        raw = dump(header)
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + rest
    if how == "length":
        return struct.pack("<Q", draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, 100 << 20, (100 << 20) + 1, 2**63, 2**64 - 1])))\
            + data[8:]
    if how == "short":
        return data[:draw(st.integers(0, 12))]
    out, _ = draw(mutated_bytes(data[:8 + n + 64], max_ops=3, min_ops=1))
    return out


def checkpoint_spec_errors(ck: CheckpointDir) -> list[str]:
    out = []
    for name, info in ck.tensors.items():
        if not isinstance(name, str) or info.dtype not in BY_SAFETENSORS.values():
            out.append(f"{name!r:.40}: dtype")
        if not (isinstance(info.shape, tuple) and all(_int(s) and s >= 0 for s in info.shape)):
            out.append(f"{name!r:.40}: shape {info.shape!r:.60}")
    return out


@target("safetensors", "store.checkpoint.read_header and CheckpointDir (a safetensors file's header: anchor blobs, "
        "checkpoints)", examples=400)
def check_safetensors(data: bytes) -> None:
    c = corpus()
    d = c.root / "ckpt"
    d.mkdir(exist_ok=True)
    path = d / "model.safetensors"
    path.write_bytes(data)
    header, exc = judge(lambda: read_header(path), (ValueError,), 1.0, 64 * len(data) + (8 << 20), "read_header")
    if exc is None and not isinstance(header, dict):
        raise Violation(f"read_header accepted a header that is a {type(header).__name__}")
    ck, exc = judge(lambda: CheckpointDir(d), (ValueError,), 1.0, 64 * len(data) + (8 << 20), "CheckpointDir")
    if exc is None:
        errors = checkpoint_spec_errors(ck)
        if errors:
            raise Violation(f"CheckpointDir accepted a header that breaks the format: {errors[:3]}")


# ---- the update routes' request body ---------------------------------------------------------------


class _RecordingController:
    """The controller ``post_answer`` hands a parsed request to: records it and answers 200 (the
    update itself is tests/test_hostile.py's; here only the route's parsing and statuses)."""

    def __init__(self):
        self.requests = []

    async def update(self, req):
        self.requests.append(req)
        return {"ok": True, "version": 1}


TOKEN = "fuzz-token"


@st.composite
def _update_body_inputs(draw):
    body = {"url": draw(st.sampled_from(["/runs/a", "s3://bucket/run1", "http://127.0.0.1:1/x/v00000001.json"]))}
    for k, pool in (("base_version", [None, 0, 3, 2**70]), ("pause_mode", [None, *PAUSE_MODES]),
                    ("wait", [None, True, False]), ("rollback", [None, True, False])):
        if draw(st.booleans()):
            body[k] = draw(st.sampled_from(pool))
    body, ops = draw(mutated_doc(body, max_ops=3))
    raw = dump(body)
    form = draw(st.integers(0, 11))
    if form == 0:
        raw, _ = draw(mutated_bytes(raw, max_ops=3, min_ops=1))
    elif form == 1:
        raw = raw[:1] + b" " * MAX_BODY_BYTES + raw[1:]
    elif form == 2:
        raw = draw(st.sampled_from([b"", b"null", b"[]", b'"x"', b"\xef\xbb\xbf" + raw, raw.decode().encode("utf-16"),
                                    b"\xff\xfe", b"{" * 40000]))
    auth = draw(st.sampled_from([f"Bearer {TOKEN}"] * 6 + [f"bearer  {TOKEN} ", f"BEARER {TOKEN}", None, "", "Bearer",
                                                          f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer é\xff",
                                                          f"Bearer{TOKEN}"]))
    return raw, auth


def _reference_request(raw: bytes):
    """(accepted, fields) by the documented rules of the body (docs/vllm.md), without the parser."""
    if len(raw) > MAX_BODY_BYTES:
        return False, None
    try:
        body = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return False, None
    types = {"url": str, "base_version": int, "pause_mode": str, "wait": bool, "rollback": bool}
    if not isinstance(body, dict) or not set(body) <= set(types):
        return False, None
    for k, v in body.items():
        if v is None and k != "url":
            continue
        if not isinstance(v, types[k]) or (types[k] is int and isinstance(v, bool)):
            return False, None
    if not body.get("url") or body.get("pause_mode") not in (None, *PAUSE_MODES):
        return False, None
    return True, {k: v for k, v in body.items() if v is not None}


def _reference_auth(authorization) -> bool:
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and given.strip() == TOKEN


_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP


@target("update_body", "UpdateRequest.parse and server.http.post_answer (the body and token of POST /update_weights_delta, "
        "shared by the vLLM and SGLang routes)", examples=500)
def check_update_body(case) -> None:
    raw, authorization = case
    want, fields = _reference_request(raw)
    req, exc = judge(lambda: UpdateRequest.parse(raw), (RequestError,), 0.5, 64 * len(raw) + (8 << 20), "UpdateRequest.parse")
    if (exc is None) != want:
        raise Violation(f"parse {'accepted' if exc is None else 'refused'} a body the rules {'refuse' if exc is None else 'accept'}: "
                        f"{raw[:120]!r} ({exc!r:.120})")
    if exc is None and {k: getattr(req, k) for k in fields} != fields:
        raise Violation(f"parse read {req} from {raw[:120]!r}")
    ctl = _RecordingController()

    async def read_body():
        return raw

    async def get_controller():
        return ctl

    answer, exc = judge(lambda: _loop().run_until_complete(post_answer(Auth((TOKEN,)), get_controller, authorization, read_body)),
                        (), 0.5, 64 * len(raw) + (8 << 20), "post_answer")
    status, body = answer
    expect = 401 if not _reference_auth(authorization) else 200 if want else 400
    if status != expect or (status != 200 and (body.get("ok") is not False or len(body.get("error", "")) > MAX_MESSAGE)):
        raise Violation(f"post_answer answered {status} {str(body)[:200]}, expected {expect}")
    if status == 200 and ctl.requests != [req]:
        raise Violation("post_answer handed the controller another request than the body's")


# ---- the vLLM route itself: the same bodies through the real router, in process (ASGI) ------


@functools.lru_cache(maxsize=1)
def _vllm_app():
    """vLLM's update routes (the router the endpoint plugin attaches) on a bare FastAPI app, called in
    process through ASGI (no socket, no vLLM), with the recording controller behind them."""
    from fastapi import FastAPI

    from engine_ext.engines.vllm.endpoint import EndpointPlugin

    app = FastAPI()
    EndpointPlugin().attach_router(app)
    app.state.engine_ext, app.state.engine_ext_auth = _RecordingController(), Auth((TOKEN,))
    return app


async def _asgi_post(app, path: str, chunks: list, headers: list) -> tuple[int, bytes]:
    """One POST as an HTTP server hands it to the app: the body in the given chunks (made before the
    measurement, so that what is measured is the app's own holding of it)."""
    pending = list(chunks)
    sent = []

    async def receive():
        if not pending:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("fuzz", 80)}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@st.composite
def _update_route_inputs(draw):
    raw, auth = draw(_update_body_inputs())
    if draw(st.integers(0, 4)) == 0:  # a body far over the limit: the route must not hold it all
        raw = raw[:1] + b" " * draw(st.sampled_from([1 << 20, 8 << 20])) + raw[1:]
    return raw, auth


@target("update_route", "POST /update_weights_delta through vLLM's real router (ASGI, in process): the body as the "
        "route reads it", examples=200)
def check_update_route(case) -> None:
    from engine_ext.server.protocol import ROUTE

    raw, authorization = case
    app = _vllm_app()
    ctl = app.state.engine_ext
    ctl.requests.clear()
    headers = [] if authorization is None else [(b"authorization", authorization.encode("latin-1"))]
    chunks = [raw[i:i + (64 << 10)] for i in range(0, len(raw), 64 << 10)] or [b""]
    want, fields = _reference_request(raw)
    out, _ = judge(lambda: _loop().run_until_complete(_asgi_post(app, ROUTE, chunks, headers)), (), 2.0,
                   32 * MAX_BODY_BYTES + (4 << 20), "vLLM route")
    status, body = out[0], json.loads(out[1])
    expect = 401 if not _reference_auth(authorization) else 200 if want else 400
    if status != expect or (expect != 200 and body.get("ok") is not False):
        raise Violation(f"the route answered {status} {str(body)[:200]}, expected {expect}")
    if expect == 200 and [{k: getattr(q, k) for k in fields} for q in ctl.requests] != [fields]:
        raise Violation(f"the route handed the controller {ctl.requests}, the body says {fields}")


__all__ = ["TARGETS", "Target", "Violation", "corpus", "judge", "meter"]
